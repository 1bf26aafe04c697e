"""fa2_fwd: the FlashAttention-2 forward on mma.sync (kernels_cu/fa2_fwd.cu), sm_80 and newer.

One CTA per (Q block, head, batch); K/V blocks stream through a cp.async ring; online
softmax with delayed normalization; O and LSE written once.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from ..problem import Problem
from ..registry import register
from ..features import feature_params, name_suffix, template_suffix
from .base import Family, KernelConfig, LaunchSpec, default_max_smem

MAX_HEAD_DIM = 256

# Registers: mma accumulators a thread keeps live (O and S in fp32). Above this budget
# ptxas spills (read off `nvcc -Xptxas -v` for sm_80 / sm_90a; tests/test_compile.py).
MAX_ACCUM_REGS = 192

LOG2E = 1.4426950408889634


def check_head_dim(problem: Problem, max_head_dim: int = MAX_HEAD_DIM) -> str:
    if problem.head_dim % 8 or not 0 < problem.head_dim <= max_head_dim:
        return f"q: headdim must be a multiple of 8 in 8..{max_head_dim}, got {problem.head_dim}"
    return ""


@dataclasses.dataclass(frozen=True, order=True)
class FwdConfig(KernelConfig):
    """One fa2_fwd kernel: tiles (Br x Bc), warps, cp.async stages, and what it is built for.

    Br:        query rows per CTA (the Q block Q_i)
    Bc:        keys per K/V block (K_j, V_j)
    warps:     warps per CTA; each owns Br / warps whole rows of Q_i
    stages:    K/V blocks resident in shared memory (>= 2: compute one, load the next)
    head_dim:  the compile-time head dim (multiple of 16, <= 256)
    dtype:     "bf16" or "fp16"
    causal:    bottom-right aligned causal mask, a compile-time flag
    varlen:    variable-length batches (cu_seqlens), a compile-time flag set from the call
               (``for_problem``), never tuned
    dropout:   attention dropout (Philox keep mask, philox.cuh), a compile-time flag; the
               probability and the RNG state are run-time params
    window:    sliding window (kWindow; the bounds are run-time params)
    softcap:   softcapping (kSoftcap; the cap is a run-time param)
    alibi:     ALiBi (kAlibi; the slopes are a run-time pointer)
    """

    Br: int
    Bc: int
    warps: int
    stages: int
    head_dim: int
    dtype: str
    causal: bool
    varlen: bool = False
    dropout: bool = False
    window: bool = False
    softcap: bool = False
    alibi: bool = False

    family = "fa2_fwd"
    _what = "forward"

    @property
    def name(self) -> str:
        mask = "causal" if self.causal else "full"
        return (f"fwd_{self.dtype}_d{self.head_dim}_{mask}_"
                f"Br{self.Br}_Bc{self.Bc}_w{self.warps}_s{self.stages}"
                + ("_varlen" if self.varlen else "") + ("_drop" if self.dropout else "")
                + name_suffix(self))

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: Q_i plus `stages` (K_j, V_j) pairs, rows padded by 8."""
        return (self.Br + 2 * self.stages * self.Bc) * (self.head_dim + 8) * 2

    @property
    def accum_regs(self) -> int:
        """fp32 accumulator registers per thread: O (rows x head_dim) and S (rows x Bc)."""
        m_tiles = self.Br // (16 * self.warps)
        return m_tiles * (self.head_dim + self.Bc) // 2

    def kernel_name(self) -> str:
        return (f"cuflash::fa2_fwd<{self.Br}, {self.Bc}, {self.warps}, {self.stages}, "
                f"{self.head_dim}, cuflash::{self.dtype}, {'true' if self.causal else 'false'}"
                f", {'true' if self.varlen else 'false'}, {'true' if self.dropout else 'false'}"
                f"{template_suffix(self)}>")

    def template_args(self) -> tuple:
        return (self.Br, self.Bc, self.warps, self.stages, self.head_dim, self.dtype, self.causal,
                self.varlen, self.dropout, self.window, self.softcap, self.alibi)

    def _problems(self) -> list[str]:
        out = self._common_problems(MAX_HEAD_DIM)
        if 1 <= self.warps <= 16 and (self.Br <= 0 or self.Br % (16 * self.warps)):
            out.append(f"Br={self.Br} must be a positive multiple of 16*warps={16 * self.warps} "
                       "(each warp owns whole 16-row mma tiles)")
        if self.Bc % 16 or self.Bc <= 0:
            out.append(f"Bc must be a positive multiple of 16, got {self.Bc}")
        elif self.dropout and self.Bc % 32:
            out.append(f"dropout needs Bc a multiple of 32 (one Philox call covers 32 keys, "
                       f"philox.cuh), got {self.Bc}")
        if not out and self.accum_regs > MAX_ACCUM_REGS:
            out.append(f"{self.accum_regs} fp32 accumulator registers per thread (O and S) "
                       f"exceed the budget of {MAX_ACCUM_REGS}: it would spill")
        return out


def first_fitting(config, shrinks, max_smem: int):
    """`config`, or the first of its shrunken variants that fits the device; else raise."""
    for shrink in ({},) + tuple(shrinks):
        candidate = config.replace(**shrink)
        if not candidate.problems(max_smem):
            return candidate
    return config.validate(max_smem)


def forward_sizes(problem: Problem, softmax_scale: float) -> dict:
    """The size and scale fields every forward params struct shares (FwdParams, Sm90FwdParams)."""
    p = problem
    return dict(batch=p.batch, nheads=p.nheads, nheads_kv=p.nheads_kv, seqlen_q=p.seqlen_q,
                seqlen_k=p.seqlen_k, head_dim=p.head_dim, softmax_scale=softmax_scale,
                scale_log2=softmax_scale * LOG2E)


def dropout_params(problem: Problem) -> dict:
    """The dropout fields of FwdParams / BwdParams: the drop threshold round(p·256) and the
    scale 1 / (1 - p), both as the kernels' fp32 arithmetic gives them (cuflash/dropout.py);
    rng_state is a per-call pointer (Plan.run_with)."""
    import numpy as np

    from ..dropout import drop_threshold

    p = float(getattr(problem, "dropout_p", 0.0)) if "dropout" in problem.features else 0.0
    scale = float(np.float32(1.0) / (np.float32(1.0) - np.float32(p)))
    return dict(rng_state=0, dropout_threshold=drop_threshold(p) if p else 0, dropout_scale=scale)


def strides3(prefix: str, strides) -> dict:
    return {f"{prefix}_batch_stride": strides[0], f"{prefix}_row_stride": strides[1],
            f"{prefix}_head_stride": strides[2]}


# ---- variable-length batches (kernels_cu/varlen.cuh) ----
# A varlen Problem has "varlen" in its features, batch = the number of sequences and
# seqlen_q / seqlen_k = the longest (max_seqlen_q/k). The API passes the packed tensors as
# (1, total, nheads, head_dim) views and the token totals as strides["totals"] =
# (total_q, total_k); the cu_seqlens pointers are per call (launch.Plan.run_varlen).
VARLEN = "varlen"


def is_varlen(problem: Problem) -> bool:
    return VARLEN in problem.features


def other_features(problem: Problem) -> tuple:
    """The features of ``problem`` besides varlen."""
    return tuple(f for f in problem.features if f != VARLEN)


# window / softcap / ALiBi: the features path of the API (cuflash.features)
BAND_SCORE = ("alibi", "softcap", "window")


# features that the varlen call paths pass with varlen (cuflash.varlen, cuflash.varlen_torch):
# the kernels build every mask, score modifier and dropout counter from the sequence's own
# lengths and its batch index (kernels_cu/varlen.cuh)
VARLEN_MIX = ("alibi", "dropout", "paged", "softcap", "window")


def feature_mix(family, problem: Problem) -> str:
    """'' unless ``problem`` mixes features that no call path passes together yet (the kernels
    have every flag): varlen with a feature of the family outside VARLEN_MIX. Dropout with
    window / softcap / ALiBi runs (the dropout paths of the API carry the feature values);
    a family whose mixed instantiations are not checked refuses it with ``dropout_mix``."""
    if is_varlen(problem):
        mixed = [f for f in other_features(problem) if f in family.features and f not in VARLEN_MIX]
        if mixed:
            return f"{family.name} has no feature {mixed[0]!r} with varlen"
    return ""


def dropout_mix(family, problem: Problem) -> str:
    """'' unless ``problem`` has dropout with window / softcap / ALiBi: for a family whose mixed
    instantiations are not checked (spills), so selection falls back to fa2 for that mix."""
    if "dropout" in problem.features:
        mixed = [f for f in problem.features if f in BAND_SCORE and f in family.features]
        if mixed:
            return f"{family.name} has no feature {mixed[0]!r} with dropout"
    return ""


def varlen_fields(problem: Problem, strides: dict, prefixes) -> dict:
    """Params fields of a varlen call (zeros for a fixed-length one): batch strides 0 (the
    sequence offsets come from cu_seqlens), the totals, null cu_seqlens (written per call)."""
    if not is_varlen(problem):
        return {}
    out = {f"{name}_batch_stride": 0 for name in prefixes}
    out.update(total_q=int(strides["totals"][0]))
    return out


class FA2Forward(Family):
    name = "fa2_fwd"
    op = "fwd"
    version = 1
    config_cls = FwdConfig
    space = {"Br": (64, 128), "Bc": (32, 64, 128), "warps": (4, 8), "stages": (2, 3)}
    params_struct = "FwdParams"
    pointer_fields = ("q", "k", "v", "o", "lse")
    min_arch = (8, 0)
    description = "FlashAttention-2 forward: mma.sync m16n8k16, ldmatrix, cp.async ring"
    features = ("alibi", "dropout", "softcap", "varlen", "window")

    def supports(self, arch, problem: Problem) -> str:
        return super().supports(arch, problem) or check_head_dim(problem) or feature_mix(self, problem)

    def for_problem(self, config, problem: Problem):
        # varlen and dropout are the call's (tuned tables and heuristics carry none); so are
        # the features
        varlen, dropout = is_varlen(problem), "dropout" in problem.features
        if config.varlen != varlen or config.dropout != dropout:
            config = config.replace(varlen=varlen, dropout=dropout)
        return self.with_features(config, problem)

    def heuristic(self, problem: Problem, arch=(9, 0), max_smem: Optional[int] = None) -> FwdConfig:
        """Each warp should own two 16-row tiles of Q (Br = 128 with 4 warps): every K or V
        fragment read from shared memory then feeds two mma instructions, which keeps
        shared-memory bandwidth under the tensor cores' appetite. That fits the register file
        up to head dim 128; above it the O accumulator alone is 128 registers per tile, so the
        CTA goes to 8 warps of one tile each. Bc trades S registers against loop overhead.

        The heuristic stays at <= 160 accumulator registers, where ptxas (nvcc 13.0, sm_80 and
        sm_90a) spills nothing; tests/test_compile.py holds it to that. The 192-register
        points (Br=128, 4 warps, Bc=128 at d=64 / Bc=64 at d=128) measured 2-10% faster on the
        H100 although ptxas spills a few bytes for them: choosing those is the tuner's job.
        """
        d = self.head_dim_of(problem.head_dim)
        max_smem = default_max_smem(arch) if max_smem is None else max_smem
        dtype, causal = problem.dtype, problem.causal
        if d <= 64 and "dropout" in problem.features:
            # the Philox rounds need registers: Bc = 64 spills on sm_80 (nvcc 13.0)
            cfg = FwdConfig(128, 32, 4, 2, d, dtype, causal)
        elif d <= 64:
            cfg = FwdConfig(128, 64, 4, 2, d, dtype, causal)
        elif d <= 128 and "dropout" in problem.features and is_varlen(problem):
            # the sequence offsets on top of the Philox rounds: 4 warps of 2 row tiles spill
            # on sm_80 (nvcc 13.0, 76 bytes at d 128); 8 warps of one tile each spill nothing
            cfg = FwdConfig(128, 32, 8, 2, d, dtype, causal)
        elif d <= 128:
            cfg = FwdConfig(128, 32, 4, 2, d, dtype, causal)
        else:
            cfg = FwdConfig(128, 64, 8, 2, d, dtype, causal)
        # Small-shared-memory parts (sm_86/89 have ~99 KB): shrink the K/V blocks, then Q.
        return first_fitting(cfg, ({"Bc": 32}, {"Br": 64, "Bc": 32, "warps": 4}), max_smem)

    def kernel_names(self, config) -> dict:
        return {"main": config.kernel_name()}

    def launches(self, config, problem: Problem, sm_count: int) -> list:
        grid = (-(-problem.seqlen_q // config.Br), problem.nheads, problem.batch)
        return [LaunchSpec("main", grid, config.threads, config.smem_bytes)]

    def static_params(self, config, problem, strides, workspace, softmax_scale, sm_count) -> dict:
        fields = dict(**strides3("q", strides["q"]), **strides3("k", strides["k"]),
                      **strides3("v", strides["v"]), **strides3("o", strides["o"]),
                      **forward_sizes(problem, softmax_scale), cu_seqlens_q=0, cu_seqlens_k=0,
                      total_q=0, **dropout_params(problem), **feature_params(problem, softmax_scale))
        fields.update(varlen_fields(problem, strides, ("q", "k", "v", "o")))
        return fields


FAMILY = register(FA2Forward())
