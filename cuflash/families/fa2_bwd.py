"""fa2_bwd: the FlashAttention-2 backward on mma.sync (kernels_cu/fa2_bwd.cu), sm_80 and newer.

Four kernels by role: ``preprocess`` (D = rowsum(dO∘O), LSE·log2e, zeroed dQ accumulators),
``main`` (one CTA per K/V block: dK_j, dV_j in registers, dQ by fp32 atomics or in a fixed
order), ``convert_dq`` (dQ = scale · accumulator) and, under GQA/MQA, ``reduce_dkv``.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

from ..problem import Problem
from ..registry import register
from ..features import feature_params, name_suffix, template_suffix
from .base import Family, KernelConfig, LaunchSpec, default_max_smem
from .fa2_fwd import (LOG2E, MAX_ACCUM_REGS, MAX_HEAD_DIM, check_head_dim, dropout_params,
                      feature_mix, first_fitting, is_varlen, strides3, varlen_fields)

# The fp32 workspace pads query rows to a multiple of this (every Br divides it).
ROW_PAD = 128
PREP_ROWS = 32           # kPrepRows in fa2_bwd.cu: query rows per preprocess CTA
PREP_THREADS = 128       # kPrepThreads in fa2_bwd.cu
VARLEN_ROW_PAD = 136     # kVarlenRowPad in varlen.cuh: workspace rows per sequence beyond its length
EPILOGUE_THREADS = 256   # kEpilogueThreads in fa2_bwd.cu


@dataclasses.dataclass(frozen=True, order=True)
class BwdConfig(KernelConfig):
    """One fa2_bwd kernel: a CTA owns the K/V block K_j, V_j.

    Br:            query rows of each Q block Q_i the CTA loops over (multiple of 16, <= 128)
    Bc:            keys of the CTA's K/V block; each key group (qsplit warps) owns
                   Bc * qsplit / warps of them
    warps:         warps per CTA
    stages:        Q/dO blocks resident in shared memory (>= 2)
    dsplit:        head-dim slices: `dsplit` CTAs share a K/V block, each accumulating
                   head_dim / dsplit columns of dK, dV, dQ (Sᵀ and dPᵀ are recomputed by each)
    head_dim:      the compile-time head dim (multiple of 16, <= 256)
    dtype:         "bf16" or "fp16"
    causal:        bottom-right aligned causal mask, a compile-time flag
    deterministic: dQ contributions added in a fixed order (bitwise reproducible, slower)
    qsplit:        warps per key group: 2 splits the group's Sᵀ, dPᵀ by queries and its dK, dV
                   by head-dim columns, with Pᵀ and dSᵀ shared through shared memory
    dropout:       attention dropout: the forward's keep mask regenerated (compile-time flag)
    window, softcap, alibi: the feature flags (as FwdConfig's)
    """

    Br: int
    Bc: int
    warps: int
    stages: int
    dsplit: int
    head_dim: int
    dtype: str
    causal: bool
    deterministic: bool = False
    qsplit: int = 1
    varlen: bool = False
    dropout: bool = False
    window: bool = False
    softcap: bool = False
    alibi: bool = False

    family = "fa2_bwd"
    _what = "backward"

    @property
    def name(self) -> str:
        mask = "causal" if self.causal else "full"
        det = "_det" if self.deterministic else ""
        return (f"bwd_{self.dtype}_d{self.head_dim}_{mask}_"
                f"Br{self.Br}_Bc{self.Bc}_w{self.warps}_s{self.stages}_x{self.dsplit}_q{self.qsplit}{det}"
                + ("_varlen" if self.varlen else "") + ("_drop" if self.dropout else "")
                + name_suffix(self))

    @property
    def smem_bytes(self) -> int:
        """K_j, V_j; `stages` (Q_i, dO_i) pairs; the dSᵀ tile (and Pᵀ's when qsplit > 1);
        `stages` (LSE_i, D_i) rows."""
        pitch = self.head_dim + 8
        key_query_tiles = 1 if self.qsplit == 1 else 2
        elems = ((2 * self.Bc + 2 * self.stages * self.Br) * pitch
                 + key_query_tiles * self.Bc * (self.Br + 8))
        return 2 * elems + 8 * self.stages * self.Br

    @property
    def accum_regs(self) -> int:
        """fp32 accumulators per thread: dK, dV (keys x head_dim / dsplit / qsplit), Sᵀ/P, dPᵀ
        (keys x Br / qsplit)."""
        q = max(self.qsplit, 1)
        m_tiles = self.Bc * q // (16 * self.warps)
        return m_tiles * (self.head_dim // max(self.dsplit, 1) + self.Br) // q

    def kernel_name(self) -> str:
        b = lambda x: "true" if x else "false"  # noqa: E731
        return (f"cuflash::fa2_bwd<{self.Br}, {self.Bc}, {self.warps}, {self.stages}, {self.dsplit}, "
                f"{self.qsplit}, {self.head_dim}, cuflash::{self.dtype}, {b(self.causal)}, "
                f"{b(self.deterministic)}, {b(self.varlen)}, {b(self.dropout)}{template_suffix(self)}>")

    def template_args(self) -> tuple:
        return (self.Br, self.Bc, self.warps, self.stages, self.dsplit, self.qsplit, self.head_dim,
                self.dtype, self.causal, self.deterministic, self.varlen, self.dropout, self.window,
                self.softcap, self.alibi)

    def _problems(self) -> list[str]:
        out = self._common_problems(MAX_HEAD_DIM)
        if not 1 <= self.warps <= 16:
            return out
        if self.qsplit not in (1, 2) or self.warps % self.qsplit:
            out.append(f"qsplit must be 1 or 2 and divide warps={self.warps}, got {self.qsplit}")
            return out
        groups = self.warps // self.qsplit
        if self.Bc <= 0 or self.Bc % (16 * groups):
            out.append(f"Bc={self.Bc} must be a positive multiple of 16*warps/qsplit={16 * groups} "
                       "(each key group owns whole 16-key mma tiles)")
        if self.qsplit > 1 and (self.Br % (16 * self.qsplit)
                                or (self.head_dim // max(self.dsplit, 1)) % (16 * self.qsplit)):
            out.append(f"qsplit={self.qsplit} must split Br={self.Br} and the head-dim slice "
                       f"{self.head_dim // max(self.dsplit, 1)} into whole 16-wide tiles")
        if self.Br <= 0 or self.Br % 16 or ROW_PAD % self.Br:
            out.append(f"Br must be a multiple of 16 dividing {ROW_PAD}, got {self.Br}")
        elif self.Br // 2 > 32 * self.warps:
            out.append(f"Br={self.Br} needs {self.Br // 2} threads to load LSE_i and D_i, "
                       f"the CTA has {32 * self.warps}")
        if self.dsplit < 1 or (self.head_dim // 16) % self.dsplit:
            out.append(f"dsplit={self.dsplit} must divide head_dim/16={self.head_dim // 16} "
                       "(each slice is whole 16-column tiles)")
        if not out and self.accum_regs > MAX_ACCUM_REGS:
            out.append(f"{self.accum_regs} fp32 accumulator registers per thread (dK, dV, S, dP) "
                       f"exceed the budget of {MAX_ACCUM_REGS}: it would spill")
        return out


def varlen_ws_rows(total_q: int, nseq: int) -> int:
    """Workspace rows per head of a varlen backward (varlen.cuh ws_row_offset): every sequence
    gets its tokens plus VARLEN_ROW_PAD rows, rounded up to 8."""
    return -(-(int(total_q) + VARLEN_ROW_PAD * int(nseq)) // 8) * 8


def head_group(pairs: int, kv_ctas: int, sms: int) -> int:
    """(batch, head) pairs whose K/V blocks fa2_bwd interleaves: enough for two waves of
    CTAs (the causal tail is then short blocks), at most all of them. CUFLASH_BWD_HEAD_GROUP=n
    fixes it (1: one head after another; a large n: block 0 of every head first)."""
    fixed = os.environ.get("CUFLASH_BWD_HEAD_GROUP")
    if fixed:
        return max(1, min(pairs, int(fixed)))
    return max(1, min(pairs, -(-2 * sms // kv_ctas)))


def contiguous_strides(p: Problem) -> tuple:
    """Element strides of a contiguous (batch, seqlen_q, nheads, head_dim) tensor."""
    return (p.seqlen_q * p.nheads * p.head_dim, p.nheads * p.head_dim, p.head_dim, 1)


def dout_needs_copy(p: Problem, strides) -> bool:
    """Whether the main kernel cannot read dout in place (16-byte row chunks need a contiguous
    head dim and batch / row / head strides in whole 8-element chunks; dims of size 1 aside):
    the preprocess then copies it (fa2_bwd.cu)."""
    shape = (p.batch, p.seqlen_q, p.nheads, p.head_dim)
    if len(strides) > 3 and shape[3] > 1 and strides[3] != 1:
        return True
    return any(s % 8 for s, n in zip(strides[:3], shape[:3]) if n > 1)


class FA2Backward(Family):
    name = "fa2_bwd"
    op = "bwd"
    version = 1
    config_cls = BwdConfig
    space = {"Br": (32, 64, 128), "Bc": (64, 128), "warps": (4, 8), "stages": (2, 3),
             "dsplit": (1, 2), "qsplit": (1, 2)}
    fixed = {"deterministic": False}
    params_struct = "BwdParams"
    pointer_fields = ("dout", "q", "k", "v", "o", "lse", "dq", "dk", "dv",
                      "lse_log2", "D", "dq_accum", "dk_accum", "dv_accum", "dq_semaphore", "dout_copy")
    min_arch = (8, 0)
    dout_any_strides = True  # the preprocess reads dout through any strides (copies it if need be)
    description = ("FlashAttention-2 backward: K/V-block CTAs, dQ by fp32 atomics "
                   "(or ordered), preprocess / dQ convert / GQA reduction kernels")

    features = ("alibi", "dropout", "softcap", "varlen", "window")

    def supports(self, arch, problem: Problem) -> str:
        return super().supports(arch, problem) or check_head_dim(problem) or feature_mix(self, problem)

    def head_dim_of(self, head_dim: int) -> int:
        """Up to 128 the forward's (a multiple of 16); above, a multiple of 32, so that two
        head-dim slices (dsplit=2) are whole tiles."""
        return -(-head_dim // 16) * 16 if head_dim <= 128 else -(-head_dim // 32) * 32

    def for_problem(self, config, problem: Problem):
        # the call's flags decide (tuned tables and the torch op's configs carry none)
        changes = {}
        if config.deterministic != problem.deterministic:
            changes["deterministic"] = problem.deterministic
        if config.varlen != is_varlen(problem):
            changes["varlen"] = is_varlen(problem)
        if config.dropout != ("dropout" in problem.features):
            changes["dropout"] = "dropout" in problem.features
        return self.with_features(config.replace(**changes) if changes else config, problem)

    def heuristic(self, problem: Problem, arch=(9, 0), max_smem: Optional[int] = None) -> BwdConfig:
        """A warp owns 16·m keys (Bc = 16·m·warps): its rows of dK_j and dV_j cost m·head_dim
        fp32 registers, Sᵀ and dPᵀ another m·Br. Large K/V blocks matter most: every Q block a
        CTA visits ends in Br x head_dim fp32 atomics into dQ, so Bc = 128 halves them against
        64. Measured on the H100 (s = 4096 and 16k): head dim 64 -> Br 32, Bc 128, 4 warps
        (m = 2); 128 -> Br 64, Bc 128, 8 warps as 4 key groups of 2 (qsplit = 2: 3-4% faster
        than 8 warps of 16 keys, fewer ldmatrix per mma), both at the 192-register budget.
        Above 128, two CTAs share each K/V block, one per half of the head dim (dsplit = 2;
        Sᵀ and dPᵀ are computed twice), with Br = 32.
        """
        d = self.head_dim_of(problem.head_dim)
        max_smem = default_max_smem(arch) if max_smem is None else max_smem
        dtype, causal, det = problem.dtype, problem.causal, problem.deterministic
        if d <= 64:
            cfg = BwdConfig(32, 128, 4, 2, 1, d, dtype, causal, det)
        elif d <= 128:
            cfg = BwdConfig(64, 128, 8, 2, 1, d, dtype, causal, det, qsplit=2)
            if cfg.problems():  # head dims of an odd number of 16-column tiles (80, 112)
                cfg = cfg.replace(qsplit=1)
        else:
            cfg = BwdConfig(32, 64, 4, 2, 2, d, dtype, causal, det)
        # Small-shared-memory parts: shrink the Q blocks, then the K/V block.
        return first_fitting(cfg, ({"Br": 32}, {"Br": 32, "Bc": 64, "warps": 4},
                                   {"Br": 16, "Bc": 64, "warps": 4}, {"Br": 16, "Bc": 32, "warps": 2}),
                             max_smem)

    def kernel_names(self, config) -> dict:
        targs = f"cuflash::{config.dtype}" + (", true" if config.varlen else "")
        return {"main": config.kernel_name(),
                "preprocess": f"cuflash::fa2_bwd_preprocess<{targs}>",
                "convert_dq": f"cuflash::fa2_bwd_convert_dq<{targs}>",
                "reduce_dkv": f"cuflash::fa2_bwd_reduce_dkv<{targs}>"}

    def workspace(self, config, problem: Problem, strides: Optional[dict] = None) -> dict:
        """Byte offsets of the workspace pieces (params.cuh BwdParams), and 'total': fp32
        lse_log2, D, dQ accumulators (and dK/dV ones under GQA, dQ turn counters when
        deterministic), and dout_copy when the main kernel cannot read dout in place."""
        rows = -(-problem.seqlen_q // ROW_PAD) * ROW_PAD
        bh = problem.batch * problem.nheads
        sizes = {"lse_log2": bh * rows * 4, "D": bh * rows * 4,
                 "dq_accum": bh * rows * config.head_dim * 4}
        if strides is not None and dout_needs_copy(problem, strides["dout"]):
            sizes["dout_copy"] = bh * problem.seqlen_q * problem.head_dim * 2
        if problem.nheads != problem.nheads_kv:
            sizes["dk_accum"] = sizes["dv_accum"] = bh * problem.seqlen_k * config.head_dim * 4
        if is_varlen(problem):  # indexed by tokens (varlen.cuh); needs the call's totals
            if strides is None or "totals" not in strides:
                raise ValueError("fa2_bwd: a varlen workspace needs strides['totals'] = (total_q, total_k)")
            total_q, total_k = strides["totals"]
            ws_rows = varlen_ws_rows(total_q, problem.batch)
            sizes.update(lse_log2=problem.nheads * ws_rows * 4, D=problem.nheads * ws_rows * 4,
                         dq_accum=problem.nheads * ws_rows * config.head_dim * 4)
            if "dout_copy" in sizes:
                sizes["dout_copy"] = total_q * problem.nheads * problem.head_dim * 2
            if problem.nheads != problem.nheads_kv:
                sizes["dk_accum"] = sizes["dv_accum"] = problem.nheads * total_k * config.head_dim * 4
        if config.deterministic:
            sizes["dq_semaphore"] = bh * (rows // 16) * 4
        offsets, total = {}, 0
        for name, size in sizes.items():
            offsets[name] = total
            total += -(-size // 256) * 256
        offsets["total"] = total
        return offsets

    def _kv_ctas(self, config, problem: Problem) -> int:
        return -(-problem.seqlen_k // config.Bc) * config.dsplit

    def launches(self, config, problem: Problem, sm_count: int) -> list:
        p = problem
        pairs, kv_ctas = p.batch * p.nheads, self._kv_ctas(config, p)
        if pairs * kv_ctas >= 2 ** 31:  # gridDim.x
            raise ValueError(f"batch * nheads * seqlen_k: too many K/V blocks for one launch "
                             f"({pairs} x {kv_ctas})")
        rows = -(-p.seqlen_q // ROW_PAD) * ROW_PAD
        per_row = p.head_dim // 8  # epilogue threads per row
        out = [LaunchSpec("preprocess", (rows // PREP_ROWS, p.nheads, p.batch), PREP_THREADS),
               # one CTA per (pair, K/V block), in the order of head_group (fa2_bwd.cu)
               LaunchSpec("main", (pairs * kv_ctas, 1, 1), config.threads, config.smem_bytes),
               LaunchSpec("convert_dq", (-(-p.seqlen_q * per_row // EPILOGUE_THREADS), p.nheads, p.batch),
                          EPILOGUE_THREADS)]
        if p.nheads != p.nheads_kv:
            out.append(LaunchSpec("reduce_dkv", (-(-p.seqlen_k * per_row // EPILOGUE_THREADS),
                                                 p.nheads_kv, p.batch), EPILOGUE_THREADS))
        return out

    def static_params(self, config, problem, strides, workspace, softmax_scale, sm_count) -> dict:
        return bwd_params(config, problem, strides, workspace, softmax_scale,
                          head_group(problem.batch * problem.nheads, self._kv_ctas(config, problem),
                                     sm_count))


def bwd_params(config, problem, strides, workspace, softmax_scale, group) -> dict:
    """The BwdParams fields of one call shape (its pointers aside): strides, shapes, scale,
    varlen, dropout and feature fields. sm90_bwd's Sm90BwdParams derives from BwdParams and
    takes these too. ``group``: the head_group of the main kernel's CTA order."""
    p = problem
    fields = {}
    for name in ("q", "k", "v", "o", "dq", "dk", "dv"):
        fields.update(strides3(name, strides[name]))
    src = tuple(strides["dout"]) + (1,) * (4 - len(strides["dout"]))
    fields.update(strides3("do_src", src), do_src_col_stride=src[3])
    # the main kernel reads dout in place, or the preprocess's contiguous copy
    fields.update(strides3("do", contiguous_strides(p) if "dout_copy" in workspace else src))
    fields.update(cu_seqlens_q=0, cu_seqlens_k=0, total_q=0, total_k=0, ws_rows=0)
    if is_varlen(p):
        fields.update(varlen_fields(p, strides, ("q", "k", "v", "o", "dq", "dk", "dv", "do",
                                                 "do_src")))
        total_q, total_k = strides["totals"]
        fields.update(total_k=int(total_k), ws_rows=varlen_ws_rows(total_q, p.batch))
    return dict(fields, batch=p.batch, nheads=p.nheads, nheads_kv=p.nheads_kv,
                seqlen_q=p.seqlen_q, seqlen_k=p.seqlen_k,
                seqlen_q_rounded=-(-p.seqlen_q // ROW_PAD) * ROW_PAD, head_dim=p.head_dim,
                head_dim_rounded=config.head_dim,
                head_group=group,
                softmax_scale=softmax_scale, scale_log2=softmax_scale * LOG2E,
                **dropout_params(p), **feature_params(p, softmax_scale))


FAMILY = register(FA2Backward())
