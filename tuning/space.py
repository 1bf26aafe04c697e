"""What the tuner searches: one ``Family`` per kernel family, and the problem it is tuned for.

A family is data: the tunable parameters as lists (``cuflash.config.FWD_SPACE``,
``BWD_SPACE``), the frozen config class that turns a point into a kernel, the heuristic
that the tuned table overrides, and the benchmark's FLOP count. The restrictions are the
config's own rules (``config.problems(max_smem)``), so the tuner and the kernel's
``static_assert``s can never disagree about what is legal.

The backward family is picked up from ``cuflash.config`` when it is there
(``BwdConfig``, ``BWD_SPACE``, ``default_bwd_config``); until then only "fwd" exists.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable, Mapping, Optional

# Sequence-length buckets of the tuned table: powers of two, 512 .. 16k.
SEQLEN_BUCKETS = (512, 1024, 2048, 4096, 8192, 16384)
KERNELS = ("fwd", "bwd")

# FlashAttention benchmark convention (cuflash.bench): model dim 2048, 16k tokens a batch.
MODEL_DIM = 2048
TOTAL_TOKENS = 16384


@dataclasses.dataclass(frozen=True)
class Family:
    """One kernel family as the tuner sees it.

    kernel:         "fwd" or "bwd": the name in tuned tables and on the command line
    space:          tunable parameter -> candidate values (the config's constructor args)
    config_cls:     frozen dataclass; ``config_cls(**point, head_dim=, dtype=, causal=, **fixed)``
    default_config: the heuristic, ``(head_dim, dtype, causal, arch, max_smem) -> config``
    flops_mode:     FLOP multiplier name for ``cuflash.bench.flops`` ("fwd" or "bwd")
    head_dim_of:    the compiled head dim for a real one (rounded up; per family)
    fixed:          constructor args held fixed while tuning (bwd: deterministic=False)
    """

    kernel: str
    space: Mapping[str, tuple]
    config_cls: type
    default_config: Callable[..., Any]
    flops_mode: str
    head_dim_of: Callable[[int], int]
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def source(self) -> str:
        """The kernels_cu family whose source hash stamps every tuned entry."""
        return self.config_cls.family

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(self.space)

    def make(self, params: Mapping[str, Any], head_dim: int, dtype: str, causal: bool):
        """The config for one point of the space (not validated)."""
        unknown = set(params) - set(self.space)
        missing = set(self.space) - set(params)
        if unknown or missing:
            raise ValueError(f"{self.kernel} parameters must be exactly {sorted(self.space)}; "
                             f"unknown {sorted(unknown)}, missing {sorted(missing)}")
        return self.config_cls(head_dim=self.head_dim_of(head_dim), dtype=dtype, causal=bool(causal),
                               **self.fixed, **{k: params[k] for k in self.space})

    def params(self, config) -> dict[str, Any]:
        """The tunable part of a config, as a plain dict (what optuna and YAML store)."""
        return {k: getattr(config, k) for k in self.space}

    def point(self, config) -> tuple:
        """The tunable part of a config as a tuple in space order (a memo key)."""
        return tuple(getattr(config, k) for k in self.space)

    def neighbours(self, config) -> list[dict[str, Any]]:
        """The points one step away from `config` in one parameter (its value list's next or
        previous entry), in space order: the local search around a good start point."""
        out = []
        for key, values in self.space.items():
            i = values.index(getattr(config, key)) if getattr(config, key) in values else None
            if i is None:
                continue
            for j in (i + 1, i - 1):
                if 0 <= j < len(values):
                    out.append({**self.params(config), key: values[j]})
        return out

    def heuristic(self, head_dim: int, dtype: str, causal: bool,
                  arch=(9, 0), max_smem: Optional[int] = None):
        return self.default_config(head_dim, dtype, causal, tuple(arch), max_smem)

    def enumerate(self, head_dim: int, dtype: str, causal: bool,
                  max_smem: Optional[int] = None) -> list[tuple[Any, list[str]]]:
        """Every point of the space, with the rules it breaks (empty list: valid)."""
        out = []
        for values in itertools.product(*(self.space[k] for k in self.space)):
            cfg = self.make(dict(zip(self.space, values)), head_dim, dtype, causal)
            out.append((cfg, problems(cfg, max_smem)))
        return out

    def valid(self, head_dim: int, dtype: str, causal: bool,
              max_smem: Optional[int] = None) -> list:
        return [cfg for cfg, why in self.enumerate(head_dim, dtype, causal, max_smem) if not why]


def problems(config, max_smem: Optional[int] = None,
             restrictions: tuple[Callable[[Any], Optional[str]], ...] = ()) -> list[str]:
    """The rules ``config`` breaks: its own ``problems()``, then any extra predicates.

    A restriction is ``config -> reason or None`` (e.g. a register budget read off a
    compile report); it is only asked about configs the kernel itself accepts.
    """
    why = list(config.problems(max_smem))
    if not why:
        why += [r for r in (pred(config) for pred in restrictions) if r]
    return why


def _fwd_family() -> Family:
    from cuflash.config import FWD_SPACE, FwdConfig, default_fwd_config, kernel_head_dim

    return Family("fwd", dict(FWD_SPACE), FwdConfig, default_fwd_config, "fwd", kernel_head_dim)


def _bwd_family() -> Optional[Family]:
    """The backward family, or None while cuflash.config has no BwdConfig."""
    import cuflash.config as c

    names = ("BwdConfig", "BWD_SPACE", "default_bwd_config")
    if not all(hasattr(c, n) for n in names):
        return None
    head_dim_of = getattr(c, "bwd_kernel_head_dim", c.kernel_head_dim)
    return Family("bwd", dict(c.BWD_SPACE), c.BwdConfig, c.default_bwd_config, "bwd",
                  head_dim_of, fixed={"deterministic": False})


def families() -> dict[str, Family]:
    """The kernel families that exist in this checkout, by kernel name ("fwd", "bwd")."""
    out = {"fwd": _fwd_family()}
    bwd = _bwd_family()
    if bwd is not None:
        out["bwd"] = bwd
    return out


def get_family(kernel: str) -> Family:
    kernel = {"flash_fwd": "fwd", "flash_bwd": "bwd"}.get(kernel, kernel)
    fams = families()
    if kernel not in fams:
        if kernel == "bwd":
            raise LookupError("the backward kernel is not in this cuflash yet "
                              "(cuflash.config has no BwdConfig)")
        raise LookupError(f"unknown kernel {kernel!r}; known: {sorted(fams)}")
    return fams[kernel]


def seqlen_bucket(seqlen: int) -> int:
    """The table bucket for a sequence length: the nearest power of two (in log scale)
    within 512 .. 16384; shorter and longer sequences use the end buckets."""
    if seqlen <= SEQLEN_BUCKETS[0]:
        return SEQLEN_BUCKETS[0]
    exp = math.floor(math.log2(seqlen) + 0.5)
    return min(max(2 ** exp, SEQLEN_BUCKETS[0]), SEQLEN_BUCKETS[-1])


@dataclasses.dataclass(frozen=True)
class Problem:
    """One problem class to tune: a tuned-table key plus the benchmark shape it is timed on.

    The shape follows the FlashAttention benchmark convention (cuflash.bench): nheads =
    2048 / head_dim, batch * seqlen = 16k, seqlen_q = seqlen_k = the bucket.
    """

    kernel: str
    dtype: str
    head_dim: int
    causal: bool
    seqlen: int
    batch: int
    nheads: int

    @classmethod
    def fa_convention(cls, kernel: str, dtype: str, head_dim: int, causal: bool,
                      seqlen: int) -> "Problem":
        s = seqlen_bucket(seqlen)
        return cls(kernel, dtype, get_family(kernel).head_dim_of(head_dim), bool(causal), s,
                   max(1, TOTAL_TOKENS // s), max(1, MODEL_DIM // head_dim))

    @property
    def name(self) -> str:
        return (f"{self.kernel}_{self.dtype}_d{self.head_dim}_"
                f"{'causal' if self.causal else 'full'}_s{self.seqlen}")

    @property
    def key(self) -> tuple:
        """The tuned-table key (kernel, dtype, head_dim, causal, seqlen bucket)."""
        return (self.kernel, self.dtype, self.head_dim, self.causal, self.seqlen)

    def flops(self, flops_mode: Optional[str] = None) -> float:
        from cuflash.bench import flops

        return flops(self.batch, self.nheads, self.seqlen, self.seqlen, self.head_dim,
                     self.causal, flops_mode or self.kernel)
