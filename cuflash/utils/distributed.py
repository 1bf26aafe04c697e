"""Tensor-parallel collectives with flash-attn's ``flash_attn.utils.distributed`` names, in plain
``torch.distributed`` (any backend: NCCL on GPUs, gloo on CPU tensors). Not to be confused with
``cuflash.distributed`` (ring attention, context parallelism).

Every collective works on dimension 0 of its tensor (flash-attn's convention: a sequence-parallel
activation is the (batch · seqlen, hidden) rows of this rank, concatenated over ranks in rank
order).

* ``all_gather_raw``, ``reduce_scatter_raw``, ``all_reduce_raw``: the collectives alone, no
  autograd, ``async_op`` returns (tensor, work handle).
* ``all_gather``, ``reduce_scatter``, ``all_reduce``: the same with autograd. The backward of an
  all-gather is a reduce-scatter of the gradient and vice versa; the backward of an all-reduce
  is the identity (each rank's copy of the sum sees its own gradient, as in tensor parallelism,
  where every rank goes on with the same replicated activation).
* ``get_dim_for_local_rank(dim, world_size, rank, multiple_of)``: the size of a rank's slice when
  ``dim`` is split in units of ``multiple_of``: the first ``(dim / multiple_of) mod world_size``
  ranks get one unit more. ``local_range`` gives the slice itself, [start, stop).
* ``sync_shared_params``, ``allreduce_sequence_parallel_grad``: broadcast from the group's first
  rank the parameters marked ``_shared_params``, and all-reduce the gradients of those marked
  ``_sequence_parallel``, in name order.
"""
from __future__ import annotations


import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_gather_raw", "reduce_scatter_raw", "all_reduce_raw", "all_gather", "reduce_scatter",
           "all_reduce", "sync_shared_params", "allreduce_sequence_parallel_grad", "get_dim_for_local_rank",
           "local_range"]

# torch 2.13 renamed the tensor collectives (same arguments); the older names stay for older torch
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_scatter_from = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_raw(input_: Tensor, process_group, async_op: bool = False):
    """(world · n, ...) from every rank's (n, ...), in rank order; returns (output, handle)."""
    world = dist.get_world_size(process_group)
    output = input_.new_empty(world * input_.shape[0], *input_.shape[1:])
    handle = _gather_into(output, input_.contiguous(), group=process_group, async_op=async_op)
    return output, handle


def reduce_scatter_raw(input_: Tensor, process_group, async_op: bool = False):
    """This rank's (n / world, ...) rows of the sum over ranks of (n, ...); returns (output, handle)."""
    world = dist.get_world_size(process_group)
    if input_.shape[0] % world:
        raise ValueError(f"reduce_scatter: dimension 0 of the input ({input_.shape[0]}) must be a multiple of "
                         f"the process group's size ({world}); with sequence_parallel the batch · seqlen rows "
                         "are split evenly over the ranks")
    output = input_.new_empty(input_.shape[0] // world, *input_.shape[1:])
    handle = _scatter_from(output, input_.contiguous(), group=process_group, async_op=async_op)
    return output, handle


def all_reduce_raw(input_: Tensor, process_group, async_op: bool = False):
    """The sum over ranks, in place in a contiguous copy of the input (the input itself when
    already contiguous); returns (output, handle)."""
    output = input_.contiguous()
    handle = dist.all_reduce(output, group=process_group, async_op=async_op)
    return output, handle


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, process_group):
        ctx.process_group = process_group
        return all_gather_raw(input_, process_group)[0]

    @staticmethod
    def backward(ctx, grad_output):
        return reduce_scatter_raw(grad_output, ctx.process_group)[0], None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, process_group):
        ctx.process_group = process_group
        return reduce_scatter_raw(input_, process_group)[0]

    @staticmethod
    def backward(ctx, grad_output):
        return all_gather_raw(grad_output, ctx.process_group)[0], None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, process_group):
        # a copy: the input may be saved by another node of the graph (all_reduce_raw sums in place)
        output = input_.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(output, group=process_group)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


def all_gather(input_: Tensor, process_group) -> Tensor:
    """all_gather_raw with autograd (backward: reduce-scatter); one rank: the input itself."""
    return input_ if dist.get_world_size(process_group) == 1 else _AllGather.apply(input_, process_group)


def reduce_scatter(input_: Tensor, process_group) -> Tensor:
    """reduce_scatter_raw with autograd (backward: all-gather); one rank: the input itself."""
    return input_ if dist.get_world_size(process_group) == 1 else _ReduceScatter.apply(input_, process_group)


def all_reduce(input_: Tensor, process_group) -> Tensor:
    """all_reduce_raw with autograd (backward: identity) into a new tensor, the input not
    modified; one rank: the input itself."""
    return input_ if dist.get_world_size(process_group) == 1 else _AllReduce.apply(input_, process_group)


def _marked(model: torch.nn.Module, flag: str) -> list:
    # name order: every rank walks the same parameters in the same order even where only some
    # ranks hold a parameter (RowParallelLinear's bias lives on rank 0)
    return [p for _, p in sorted((n, p) for n, p in model.named_parameters() if getattr(p, flag, False))]


def sync_shared_params(model: torch.nn.Module, process_group) -> None:
    """Broadcast the parameters marked ``p._shared_params = True`` from the group's first rank."""
    source = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    with torch.no_grad():
        for p in _marked(model, "_shared_params"):
            dist.broadcast(p, src=source, group=process_group)


def allreduce_sequence_parallel_grad(model: torch.nn.Module, process_group) -> None:
    """Sum over ranks the gradients of the parameters marked ``p._sequence_parallel = True``
    (replicated parameters that saw only this rank's tokens), in one all-reduce. A marked parameter
    that requires grad but has none on this rank takes a zero gradient, so that every rank sums the
    same list (skipping it on one rank would leave the others waiting in the all-reduce)."""
    params = [p for p in _marked(model, "_sequence_parallel") if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    if not grads:
        return
    with torch.no_grad():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=process_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def get_dim_for_local_rank(dim: int, world_size: int, local_rank: int, multiple_of: int = 1) -> int:
    """The size of rank ``local_rank``'s slice of ``dim`` split over ``world_size`` ranks in
    units of ``multiple_of`` (the first ``(dim // multiple_of) % world_size`` ranks one unit more)."""
    start, stop = local_range(dim, world_size, local_rank, multiple_of)
    return stop - start


def local_range(dim: int, world_size: int, local_rank: int, multiple_of: int = 1) -> tuple:
    """[start, stop) of rank ``local_rank``'s slice in get_dim_for_local_rank's split."""
    units, extra = divmod(dim // multiple_of, world_size)
    start = local_rank * units + min(local_rank, extra)
    stop = start + units + (1 if local_rank < extra else 0)
    return start * multiple_of, stop * multiple_of
