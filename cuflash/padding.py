"""flash-attn's ``bert_padding`` helpers, same names and returns: move between a padded batch
(batch, seqlen, ...) and the packed tokens (total_tokens, ...) that the varlen functions take.

    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, attention_mask)
    out_unpad = cuflash.flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_seqlens, cu_seqlens,
                                               max_seqlen, max_seqlen)
    out = pad_input(out_unpad, indices, batch, seqlen)

torch only; every function is differentiable (index_first_axis and index_put_first_axis are
autograd Functions whose backward is the other's scatter / gather).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["index_first_axis", "index_put_first_axis", "index_first_axis_residual",
           "unpad_input", "unpad_input_for_concatenated_sequences", "pad_input",
           "IndexFirstAxis", "IndexPutFirstAxis", "IndexFirstAxisResidual"]


class IndexFirstAxis(torch.autograd.Function):
    """input[indices] along the first axis (a gather); the backward scatters into zeros."""

    @staticmethod
    def forward(ctx, input, indices):
        ctx.save_for_backward(indices)
        assert input.ndim >= 2, "index_first_axis: input needs >= 2 dimensions"
        ctx.first_axis_dim, other_shape = input.shape[0], input.shape[1:]
        second_dim = other_shape.numel()
        flat = input.reshape(input.shape[0], second_dim)
        return torch.gather(flat, 0, indices[:, None].expand(-1, second_dim)).reshape(-1, *other_shape)

    @staticmethod
    def backward(ctx, grad_output):
        (indices,) = ctx.saved_tensors
        other_shape = grad_output.shape[1:]
        grad_output = grad_output.reshape(grad_output.shape[0], -1)
        grad_input = torch.zeros((ctx.first_axis_dim, grad_output.shape[1]),
                                 device=grad_output.device, dtype=grad_output.dtype)
        grad_input.scatter_(0, indices[:, None].expand(-1, grad_output.shape[1]), grad_output)
        return grad_input.reshape(ctx.first_axis_dim, *other_shape), None


index_first_axis = IndexFirstAxis.apply


class IndexPutFirstAxis(torch.autograd.Function):
    """zeros(first_axis_dim, ...) with values put at indices; the backward gathers."""

    @staticmethod
    def forward(ctx, values, indices, first_axis_dim):
        ctx.save_for_backward(indices)
        assert indices.ndim == 1, "index_put_first_axis: indices must be 1-D"
        assert values.ndim >= 2, "index_put_first_axis: values need >= 2 dimensions"
        output = torch.zeros(first_axis_dim, *values.shape[1:], device=values.device,
                             dtype=values.dtype)
        output[indices] = values
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (indices,) = ctx.saved_tensors
        return grad_output[indices], None, None


index_put_first_axis = IndexPutFirstAxis.apply


class IndexFirstAxisResidual(torch.autograd.Function):
    """(input[indices], input detached): the gather and the input itself as a residual, whose
    gradient the backward adds the gather's (scatter-added at indices) to."""

    @staticmethod
    def forward(ctx, input, indices):
        ctx.save_for_backward(indices)
        assert input.ndim >= 2, "index_first_axis_residual: input needs >= 2 dimensions"
        ctx.first_axis_dim = input.shape[0]
        return input[indices], input.detach()

    @staticmethod
    def backward(ctx, grad_output, grad_residual):
        (indices,) = ctx.saved_tensors
        if grad_residual is None:
            grad_residual = torch.zeros((ctx.first_axis_dim, *grad_output.shape[1:]),
                                        device=grad_output.device, dtype=grad_output.dtype)
        grad_input = grad_residual.clone()
        if grad_output is not None:
            where = indices.reshape(-1, *((1,) * (grad_output.ndim - 1))).expand_as(grad_output)
            grad_input.scatter_add_(0, where, grad_output)
        return grad_input, None


index_first_axis_residual = IndexFirstAxisResidual.apply


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """
    hidden_states: (batch, seqlen, ...); attention_mask: (batch, seqlen), bool / int, 1 = valid;
    unused_mask: (batch, seqlen), bool / int, 1 = allocated but unused (kept in the packed
    tokens, not counted in seqused).

    Returns (hidden_states (total_nnz, ...), indices (total_nnz,) into the flattened
    (batch * seqlen), cu_seqlens int32 (batch + 1,), max_seqlen_in_batch int,
    seqused int32 (batch,): the tokens of attention_mask per sequence).
    """
    all_masks = (attention_mask + unused_mask) if unused_mask is not None else attention_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item() if seqlens_in_batch.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return (index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen_in_batch,
            used_seqlens_in_batch)


def pad_input(hidden_states, indices, batch, seqlen):
    """hidden_states (total_nnz, ...) put back at ``indices`` of a zero (batch, seqlen, ...)."""
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return output.reshape(batch, seqlen, *output.shape[1:])


def unpad_input_for_concatenated_sequences(hidden_states, attention_mask_in_length):
    """Unpad rows that each hold several samples packed one after another.

    hidden_states: (batch, seqlen, ...); attention_mask_in_length: (batch, seqlen), int: row b
    holds samples of lengths attention_mask_in_length[b, j] for its nonzero entries j, in that
    order from position 0; the rest of the row is padding. E.g. the row [2, 3, 0, 0, 0, 0] of
    seqlen 6 holds a sample of 2 tokens, one of 3, and one padding position.

    Returns (hidden_states (total_nnz, ...), indices (total_nnz,) into the flattened
    (batch * seqlen), cu_seqlens int32 (num_samples + 1,) with one sequence per *sample*, so
    that flash_attn_varlen_func keeps samples from attending to each other,
    max_seqlen_in_batch int: the longest sample).
    """
    lengths = attention_mask_in_length
    batch, seqlen = lengths.shape
    used = lengths.sum(dim=-1)                                     # tokens per row
    positions = torch.arange(seqlen, device=lengths.device, dtype=used.dtype)
    kept = positions.expand(batch, seqlen) < used[:, None]          # each row's leading tokens
    samples = lengths.flatten()
    samples = samples[samples != 0].to(torch.int32)                 # row-major: rows in order
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(samples.max().item()) if samples.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(samples, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen_in_batch
