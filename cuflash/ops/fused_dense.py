"""Tensor-parallel linear layers with flash-attn's ``flash_attn.ops.fused_dense`` names and
arguments: ``from flash_attn.ops.fused_dense import ColumnParallelLinear, RowParallelLinear``
becomes ``from cuflash.ops.fused_dense import ...``. Plain torch (``F.linear``) and
``torch.distributed`` collectives (``cuflash.utils.distributed``), autograd through the
collectives: nothing is fused. flash-attn's fused GEMM + bias kernels (cuBLASLt epilogues),
the overlap of the all-gather with the GEMM, ``FusedDense`` and the fused MLPs
(``FusedMLP``, ``ParallelFusedMLP``) are not part of cuflash.

Megatron-style tensor parallelism over a process group of P ranks; the collectives work on
dimension 0 of the activations (flash-attn's convention: with sequence parallelism a rank holds
rows of the (batch · seqlen, hidden) activation):

* ``ColumnParallelLinear(in_features, out_features, process_group)``: this rank holds
  ``get_dim_for_local_rank(out_features, P, rank, multiple_of)`` rows of the weight (and of the
  bias): out_local = x_full W_localᵀ + b_local. With ``sequence_parallel`` (flash-attn's
  default) the input is this rank's share of the rows and is all-gathered first (backward:
  reduce-scatter of the input gradient); otherwise the input is replicated on every rank and the
  input gradient is all-reduced.
* ``RowParallelLinear(in_features, out_features, process_group)``: this rank holds
  ``get_dim_for_local_rank(in_features, P, rank, multiple_of)`` columns of the weight; the bias
  lives on rank 0 only (added once to the sum). out = Σ_ranks x_local W_localᵀ, reduce-scattered
  over the rows with ``sequence_parallel`` (backward: all-gather), else all-reduced (backward:
  identity).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..utils.distributed import all_gather, all_reduce, get_dim_for_local_rank, reduce_scatter

__all__ = ["fused_dense_func", "ColumnParallelLinear", "RowParallelLinear"]


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward, all-reduce backward: a replicated input entering a column-parallel
    layer (each rank's input gradient covers only its own output columns)."""

    @staticmethod
    def forward(ctx, input_, process_group):
        ctx.process_group = process_group
        return input_.view_as(input_)

    @staticmethod
    def backward(ctx, grad_output):
        grad = grad_output.contiguous().clone()
        dist.all_reduce(grad, group=ctx.process_group)
        return grad, None


def fused_dense_func(x: Tensor, weight: Tensor, bias=None, return_residual: bool = False, process_group=None,
                     sequence_parallel: bool = True):
    """x Wᵀ + b (flash-attn's signature; plain F.linear here, not fused). With a process_group:
    the column-parallel input step, x all-gathered along dimension 0 first (sequence_parallel)
    or its gradient all-reduced (replicated x). return_residual: also return x (this rank's)."""
    total_x = x
    if process_group is not None:
        total_x = all_gather(x, process_group) if sequence_parallel else _AllReduceGrad.apply(x, process_group)
    out = F.linear(total_x, weight, bias)
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
        partial = F.linear(x, self.weight, self.bias)
        return (reduce_scatter if self.sequence_parallel else all_reduce)(partial, self.process_group)
