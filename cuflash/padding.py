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

__all__ = ["index_first_axis", "index_put_first_axis", "unpad_input", "pad_input",
           "IndexFirstAxis", "IndexPutFirstAxis"]


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
