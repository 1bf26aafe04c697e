"""What a call asks for, independent of which kernel computes it.

A ``Problem`` is the one description that the API builds, that selection, the families'
``supports()``, the launch plans, the tuner and the benchmarks all read. Its *class*
(``problem.class_key``) is what a tuned table is keyed by, together with the family and
the sequence-length bucket.

Feature flags: today ``causal`` (and ``deterministic``, which only the backward reads).
The ones to come — sliding window, softcap, ALiBi, dropout, variable lengths, paged KV,
block-sparse and arbitrary masks — enter as names in ``features`` (a sorted tuple, part of
the class key), so a family that lacks one says so in ``supports()`` and selection falls
back to one that has it; no signature changes.
"""
from __future__ import annotations

import dataclasses
import math

# Sequence-length buckets of the tuned tables: powers of two, 512 .. 16k.
SEQLEN_BUCKETS = (512, 1024, 2048, 4096, 8192, 16384)

# The FlashAttention benchmark convention: model dim 2048 (heads = 2048 / head dim),
# batch * seqlen = 16k tokens.
MODEL_DIM = 2048
TOTAL_TOKENS = 16384

# Element types by short name. fp32 inputs and fp8 (e4m3) are names families may claim later.
DTYPES = ("bf16", "fp16")
# What the tuner takes for --dtype: DTYPES and the families' own input types (e4m3:
# sm90_fwd_fp8). A separate tuple: DTYPES stays the default of every bf16/fp16 family.
TUNE_DTYPES = DTYPES + ("e4m3",)


def seqlen_bucket(seqlen: int) -> int:
    """The table bucket for a sequence length: the nearest power of two (in log scale)
    within 512 .. 16384; shorter and longer sequences use the end buckets."""
    if seqlen <= SEQLEN_BUCKETS[0]:
        return SEQLEN_BUCKETS[0]
    exp = math.floor(math.log2(seqlen) + 0.5)
    return min(max(2 ** exp, SEQLEN_BUCKETS[0]), SEQLEN_BUCKETS[-1])


@dataclasses.dataclass(frozen=True)
class Problem:
    """One attention call's shape and flags.

    op:         "fwd" or "bwd" (decode, combine, ... to come)
    dtype:      element type name ("bf16", "fp16")
    q is (batch, seqlen_q, nheads, head_dim); k, v are (batch, seqlen_k, nheads_kv, head_dim)
    causal:     bottom-right aligned causal mask
    deterministic: backward only: dQ added in a fixed order
    features:   sorted names of further feature flags ("alibi", "dropout", "softcap", "window", ...)
    dropout_p:  the dropout probability when "dropout" is a feature
    window:     (left, right) of the "window" feature, -1 unbounded (a run-time value)
    softcap:    the "softcap" feature's cap, > 0 (a run-time value)
    alibi_batched: the "alibi" feature's slopes are (batch, nheads), not (nheads,)
    The feature values are not part of the class key: kernels take them as run-time params
    (the launch plan's params carry them).
    """

    op: str
    dtype: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    head_dim: int
    causal: bool = False
    deterministic: bool = False
    features: tuple = ()
    dropout_p: float = 0.0
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi_batched: bool = False

    def __post_init__(self):
        if self.window.__class__ is not tuple:  # e.g. a list read back from JSON
            object.__setattr__(self, "window", tuple(self.window))

    @classmethod
    def fa_convention(cls, op: str, dtype: str, head_dim: int, causal: bool, seqlen: int,
                      **kw) -> "Problem":
        """The benchmark shape for one class and bucket: heads = 2048 / head dim, batch·seqlen = 16k."""
        nheads = max(1, MODEL_DIM // head_dim)
        return cls(op, dtype, max(1, TOTAL_TOKENS // seqlen), seqlen, seqlen, nheads, nheads,
                   head_dim, bool(causal), **kw)

    @property
    def bucket(self) -> int:
        return seqlen_bucket(max(self.seqlen_q, self.seqlen_k))

    @property
    def class_key(self) -> tuple:
        """(op, dtype, head_dim, causal, features): the tuned-table key, less family and bucket."""
        return (self.op, self.dtype, self.head_dim, self.causal, self.features)

    @property
    def name(self) -> str:
        feats = "".join(f"_{f}" for f in self.features)
        return (f"{self.op}_{self.dtype}_d{self.head_dim}_{'causal' if self.causal else 'full'}"
                f"{feats}_b{self.batch}_h{self.nheads}x{self.nheads_kv}_s{self.seqlen_q}x{self.seqlen_k}")

    def replace(self, **changes) -> "Problem":
        return dataclasses.replace(self, **changes)
