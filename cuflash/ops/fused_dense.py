"""Tensor-parallel linear layers with flash-attn's ``flash_attn.ops.fused_dense`` names and
arguments: ``from flash_attn.ops.fused_dense import ColumnParallelLinear, RowParallelLinear``
becomes ``from cuflash.ops.fused_dense import ...``. Plain torch (``F.linear``) and
``torch.distributed`` collectives (``cuflash.utils.distributed``), autograd through the
collectives: nothing is fused. flash-attn's fused GEMM + bias kernels (cuBLASLt epilogues),
the overlap of the all-gather with the GEMM and ``FusedDense`` are not part of cuflash;
``FusedMLP`` and ``ParallelFusedMLP`` resolve to ``cuflash.modules.mlp``'s torch forms.

Megatron-style tensor parallelism over a process group of P ranks; the collectives work on
dimension 0 of the activations (flash-attn's convention: with sequence parallelism a rank holds
rows of the (batch · seqlen, hidden) activation):

* ``ColumnParallelLinear(in_features, out_features, process_group)``: this rank holds
  ``get_dim_for_local_rank(out_features, P, rank, multiple_of)`` rows of the weight (and of the
  bias): out_local = x_full W_localᵀ + b_local. With ``sequence_parallel`` (flash-attn's
  default) the input is this rank's share of the rows and is all-gathered first (backward:
  reduce-scatter of the input gradient); otherwise the input is replicated on every rank and the
  input gradient is all-reduced. As in flash-attn, the backward keeps only this rank's input
  and gathers it again, overlapped with the input gradient's GEMM, and the input gradient's
  collective overlaps the weight gradient's GEMM.
* ``RowParallelLinear(in_features, out_features, process_group)``: this rank holds
  ``get_dim_for_local_rank(in_features, P, rank, multiple_of)`` columns of the weight; the bias
  lives on rank 0 only (added once to the sum). out = Σ_ranks x_local W_localᵀ, reduce-scattered
  over the rows with ``sequence_parallel`` (backward: all-gather), else all-reduced (backward:
  identity).

With one rank (a process group of size 1) both run F.linear alone: no collective, no copy
(``ONE_RANK_SHORTCUT``; off, the collectives run over the one-rank group, which tests use to
exercise that path on one GPU).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..utils.distributed import (_ReduceScatter, all_gather_raw, all_reduce_raw, get_dim_for_local_rank,
                                 reduce_scatter_raw)

__all__ = ["fused_dense_func", "ColumnParallelLinear", "RowParallelLinear"]

ONE_RANK_SHORTCUT = True   # a one-rank group: F.linear alone, no collective


def _one_rank(process_group) -> bool:
    return ONE_RANK_SHORTCUT and dist.get_world_size(process_group) == 1


class _ColumnParallelLinearFunc(torch.autograd.Function):
    """out = x_full Wᵀ + b of a column-parallel layer on rows (x 2-D: a view made inside a
    Function could not be changed in place later, and rotary turns q and k in place), x_full
    the all-gathered x with sequence_parallel, else x itself (replicated). Saves this rank's x only (the gathered input
    is P times larger) and gathers it again in the backward while dx = dout W is computed; dx's
    reduce-scatter (sequence_parallel) or all-reduce (replicated x: each rank's dx covers its own
    output columns only) runs while dW is computed."""

    @staticmethod
    def forward(ctx, x, weight, bias, process_group, sequence_parallel):
        device = x.device.type
        if torch.is_autocast_enabled(device):
            # autocast's cast, done here where the backward can see it (as flash-attn's custom_fwd does): the
            # all-gather then moves 16-bit rows, and the backward's products meet operands of one dtype.
            # Autograd returns the gradients in the parameters' own dtypes.
            dtype = torch.get_autocast_dtype(device)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        ctx.process_group, ctx.sequence_parallel, ctx.has_bias = process_group, sequence_parallel, bias is not None
        # x is kept only for the weight's gradient (frozen weights, e.g. adapters: nothing is held)
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        total_x = all_gather_raw(x, process_group)[0] if sequence_parallel else x
        with torch.autocast(device, enabled=False):
            return F.linear(total_x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        group, sp = ctx.process_group, ctx.sequence_parallel
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        total_x, gather = (all_gather_raw(x, group, async_op=True) if sp and need_w else (x, None))
        grad_out = grad_out.contiguous()
        grad_x = reduce = grad_w = grad_b = None
        if need_x:
            grad_x, reduce = (reduce_scatter_raw if sp else all_reduce_raw)(grad_out @ weight, group, async_op=True)
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        if need_w:
            if gather is not None:
                gather.wait()
            grad_w = rows.t() @ total_x.reshape(-1, total_x.shape[-1])
        if ctx.has_bias and need_b:
            grad_b = rows.sum(0)
        if reduce is not None:
            reduce.wait()
        return grad_x, grad_w, grad_b, None, None


class _AllReduceInPlace(torch.autograd.Function):
    """The sum over ranks in place in a tensor that nothing else keeps (RowParallelLinear's partial
    product: no copy); backward: the identity."""

    @staticmethod
    def forward(ctx, partial, process_group):
        ctx.mark_dirty(partial)
        dist.all_reduce(partial, group=process_group)
        return partial

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


def fused_dense_func(x: Tensor, weight: Tensor, bias=None, return_residual: bool = False, process_group=None,
                     sequence_parallel: bool = True):
    """x Wᵀ + b (flash-attn's signature; plain F.linear here, not fused). With a process_group:
    the column-parallel input step, x all-gathered along dimension 0 first (sequence_parallel)
    or its gradient all-reduced (replicated x). return_residual: also return x (this rank's)."""
    if process_group is None or _one_rank(process_group):
        out = F.linear(x, weight, bias)
    else:
        if x.dim() < 2:
            raise ValueError(f"x must have at least 2 dimensions (rows, features) with a process_group, got shape "
                             f"{tuple(x.shape)}")
        rows = x.shape[0] * (dist.get_world_size(process_group) if sequence_parallel else 1)
        out = _ColumnParallelLinearFunc.apply(x.reshape(-1, x.shape[-1]), weight, bias, process_group,
                                              sequence_parallel).view(rows, *x.shape[1:-1], weight.shape[0])
    return (out, x) if return_residual else out


def _local_features(features: int, process_group, multiple_of: int, what: str) -> int:
    if process_group is None:
        raise ValueError(f"process_group must be a torch.distributed process group, got None ({what})")
    if multiple_of <= 0 or features % multiple_of:
        raise ValueError(f"{what} = {features} must be a multiple of multiple_of = {multiple_of}")
    return get_dim_for_local_rank(features, dist.get_world_size(process_group), dist.get_rank(process_group),
                                  multiple_of)


class ColumnParallelLinear(nn.Linear):
    """This rank's rows of a linear layer's weight (output features split over the group in
    units of multiple_of); see the module docstring. weight: (out_local, in_features)."""

    def __init__(self, in_features: int, out_features: int, process_group, bias: bool = True,
                 sequence_parallel: bool = True, multiple_of: int = 1, device=None, dtype=None) -> None:
        local = _local_features(out_features, process_group, multiple_of, "out_features")
        super().__init__(in_features, local, bias=bias, device=device, dtype=dtype)
        self.process_group = process_group
        self.sequence_parallel = sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        return fused_dense_func(x, self.weight, self.bias, process_group=self.process_group,
                                sequence_parallel=self.sequence_parallel)


class RowParallelLinear(nn.Linear):
    """This rank's columns of a linear layer's weight (input features split over the group in
    units of multiple_of), the bias on rank 0; the partial products summed over the group (see
    the module docstring). weight: (out_features, in_local)."""

    def __init__(self, in_features: int, out_features: int, process_group, bias: bool = True,
                 sequence_parallel: bool = True, multiple_of: int = 1, device=None, dtype=None) -> None:
        local = _local_features(in_features, process_group, multiple_of, "in_features")
        rank = dist.get_rank(process_group)
        super().__init__(local, out_features, bias=bias and rank == 0, device=device, dtype=dtype)
        self.process_group = process_group
        self.sequence_parallel = sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        if _one_rank(self.process_group):
            return F.linear(x, self.weight, self.bias)
        if self.sequence_parallel:
            return _ReduceScatter.apply(F.linear(x, self.weight, self.bias), self.process_group)
        # on rows: the product is then a tensor of its own (not a view), summed in place
        partial = F.linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias)
        return _AllReduceInPlace.apply(partial, self.process_group).view(*x.shape[:-1], partial.shape[-1])


def __getattr__(name: str):
    # flash-attn keeps FusedMLP and ParallelFusedMLP in flash_attn.ops.fused_dense; cuflash's live with the
    # other MLPs in cuflash.modules.mlp (imported on first use: modules.mha and modules.mlp import this module).
    if name in ("FusedMLP", "ParallelFusedMLP"):
        from ..modules import mlp
        return getattr(mlp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
