"""fa2_fwd_paged: the FlashAttention-2 forward of a variable-length batch over a paged K/V cache
(kernels_cu/fa2_fwd_paged.cu; flash-attn's flash_attn_varlen_func with block_table), sm_80+.

fa2_fwd's algorithm and tiles with each K/V row read from its page: k, v are
(num_pages, page_block_size, nheads_kv, head_dim) and block_table (batch, max_pages) int32 maps
sequence b's key j to row j % page_block_size of page block_table[b, j // page_block_size]. Any
page size >= 1 (a tile may straddle pages). Window, softcap and ALiBi as fa2_fwd; no dropout, no
backward. Runs only problems with the "paged" and "varlen" features, which no other family has.

Call shapes: a paged Problem has ("paged", "varlen") in its features; the launch plan takes
``strides["k"]`` / ``strides["v"]`` as the 4-D cache strides (page, row, head, 1),
``strides["totals"]`` = (total_q, 0) and ``strides["paged"]`` = (page_block_size, num_pages,
block table columns, block table row stride); the block table's address is per call
(``Plan.run_with``, field ``block_table``).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from ..features import template_suffix
from ..problem import Problem
from ..registry import register
from .fa2_fwd import FA2Forward, FwdConfig, is_varlen

PAGED = "paged"


@dataclasses.dataclass(frozen=True, order=True)
class PagedFwdConfig(FwdConfig):
    """One fa2_fwd_paged kernel: FwdConfig's fields (varlen always on, dropout always off)."""

    family = "fa2_fwd_paged"
    _what = "paged forward"

    @property
    def name(self) -> str:
        return "paged_" + FwdConfig.name.fget(self)

    def kernel_name(self) -> str:
        return (f"cuflash::fa2_fwd_paged<{self.Br}, {self.Bc}, {self.warps}, {self.stages}, "
                f"{self.head_dim}, cuflash::{self.dtype}, {'true' if self.causal else 'false'}"
                f"{template_suffix(self)}>")

    def template_args(self) -> tuple:
        return (self.Br, self.Bc, self.warps, self.stages, self.head_dim, self.dtype, self.causal,
                self.window, self.softcap, self.alibi)


def is_paged(problem: Problem) -> bool:
    return PAGED in problem.features


class FA2ForwardPaged(FA2Forward):
    name = "fa2_fwd_paged"
    config_cls = PagedFwdConfig
    params_struct = "FwdPagedParams"
    description = "FlashAttention-2 forward over a paged K/V cache (block_table), varlen batches"
    features = ("alibi", "paged", "softcap", "varlen", "window")
    # features every problem it runs has (the others are optional); a plain problem is refused
    requires = ("paged", "varlen")

    def supports(self, arch, problem: Problem) -> str:
        why = super().supports(arch, problem)
        if why:
            return why
        if not (is_paged(problem) and is_varlen(problem)):
            return (f"{self.name} runs only paged K/V caches of variable-length batches "
                    "(flash_attn_varlen_func with block_table)")
        return ""

    def for_problem(self, config, problem: Problem):
        if not isinstance(config, PagedFwdConfig):  # e.g. fa2_fwd's heuristic
            config = PagedFwdConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(FwdConfig)})
        if not config.varlen or config.dropout:
            config = config.replace(varlen=True, dropout=False)
        return self.with_features(config, problem)

    def heuristic(self, problem: Problem, arch=(9, 0), max_smem: Optional[int] = None) -> PagedFwdConfig:
        """fa2_fwd's heuristic (the page look-ups add a few registers per K/V row: ptxas reports
        no spills for it at head dims 64, 80, 128; tests/test_varlen_paged_cpu.py)."""
        base = super().heuristic(problem.replace(features=tuple(
            f for f in problem.features if f != PAGED)), arch, max_smem)
        return self.for_problem(base, problem)

    def static_params(self, config, problem, strides, workspace, softmax_scale, sm_count) -> dict:
        fields = super().static_params(config, problem, strides, workspace, softmax_scale, sm_count)
        page, num_pages, cols, row_stride = (int(x) for x in strides["paged"])
        # the cache's page strides (varlen_fields zeroed the batch strides of k, v)
        fields.update(k_batch_stride=int(strides["k"][0]), v_batch_stride=int(strides["v"][0]),
                      block_table=0, block_table_stride=row_stride, block_table_cols=cols,
                      page_block_size=page, num_pages=num_pages)
        return fields


FAMILY = register(FA2ForwardPaged())
