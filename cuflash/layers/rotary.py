"""Rotary position embeddings with flash-attn 2.8's names: ``from flash_attn.layers.rotary import
...`` becomes ``from cuflash.layers.rotary import ...``.

* ``apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0,
  cu_seqlens=None, max_seqlen=None)`` (alias ``apply_rotary_emb_func``): x rotated, with autograd;
* ``apply_rotary_emb_qkv_(qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False,
  seqlen_offsets=0, num_heads_q=None)``: q and k of a packed qkv rotated in place;
* ``apply_rotary_emb_kv_(kv, cos, sin, interleaved=False, seqlen_offsets=0)``: k of a packed kv
  rotated in place;
* ``RotaryEmbedding(dim, base=10000.0, interleaved=False, scale_base=None, pos_idx_in_fp32=True,
  device=None)``: the module with its cos / sin cache (xPos with ``scale_base``);
* ``rotate_half``, ``apply_rotary_emb_torch``: the plain torch formula.

The rotation itself is ``cuflash.rotary.apply_rotary`` (a CUDA kernel for CUDA tensors, the
float64 reference for CPU tensors). Its backward is the rotation by the opposite angles (a
rotation's inverse is its transpose), so no activation is saved. Differences from flash-attn:
the backward of the in-place functions writes a new gradient tensor instead of overwriting the
incoming one (which may be a stride-0 expansion), and the in-place functions mark their input
dirty for autograd; CUDA tensors may also take float32 cos / sin with 16-bit x.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from ..rotary import apply_rotary
from ..torch_ops import rotary_traced

_compiling = torch.compiler.is_compiling

__all__ = ["rotate_half", "apply_rotary_emb_torch", "ApplyRotaryEmb", "apply_rotary_emb",
           "apply_rotary_emb_func", "ApplyRotaryEmbQKV_", "apply_rotary_emb_qkv_",
           "ApplyRotaryEmbKV_", "apply_rotary_emb_kv_", "RotaryEmbedding"]


# ---------------------------------------------------------------------------------------
# the plain torch formula

def rotate_half(x: Tensor, interleaved: bool = False) -> Tensor:
    """The pair partner of every feature, with the first of each pair negated: (-b, a) for each
    pair (a, b), pairs (c, c + d/2) (GPT-NeoX) or (2c, 2c + 1) (interleaved, GPT-J)."""
    if interleaved:
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((-odd, even), dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_emb_torch(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """x (batch, seqlen, nheads, headdim) rotated by cos, sin of shape (seqlen, rotary_dim / 2) or
    (batch, seqlen, rotary_dim / 2), with torch operations (the first rotary_dim features; the
    rest pass through)."""
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim = 2 * cos.shape[-1] = {rotary_dim} must be <= headdim = {x.shape[-1]}")

    def spread(t):  # (..., seqlen, rotary_dim / 2) -> (..., seqlen, 1, rotary_dim), per feature
        t = t.repeat_interleave(2, dim=-1) if interleaved else torch.cat((t, t), dim=-1)
        return t.unsqueeze(-2)

    head = x[..., :rotary_dim]
    turned = head * spread(cos) + rotate_half(head, interleaved) * spread(sin)
    return torch.cat((turned, x[..., rotary_dim:]), dim=-1)


# ---------------------------------------------------------------------------------------
# autograd

def _save_offsets(ctx, tensors: tuple, seqlen_offsets) -> None:
    """save_for_backward(tensors, and seqlen_offsets when it is a tensor); an int rides on ctx."""
    if isinstance(seqlen_offsets, Tensor):
        ctx.save_for_backward(*tensors, seqlen_offsets)
        ctx.seqlen_offsets = None
    else:
        ctx.save_for_backward(*tensors)
        ctx.seqlen_offsets = seqlen_offsets


def _saved(ctx) -> tuple:
    """(saved tensors but the offsets, seqlen_offsets)."""
    saved = ctx.saved_tensors
    if ctx.seqlen_offsets is None:
        return saved[:-1], saved[-1]
    return saved, ctx.seqlen_offsets


def _records(*tensors) -> bool:
    """Whether autograd records a call on these tensors (grad mode on and one requires grad;
    None and non-tensors are skipped): else the functions rotate without their autograd.Function."""
    return torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors)


class ApplyRotaryEmb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                max_seqlen=None):
        out = apply_rotary(x, cos, sin, seqlen_offsets=seqlen_offsets, cu_seqlens=cu_seqlens,
                           max_seqlen=max_seqlen, interleaved=interleaved, inplace=inplace)
        _save_offsets(ctx, (cos, sin, cu_seqlens), seqlen_offsets)
        ctx.interleaved, ctx.max_seqlen = interleaved, max_seqlen
        if inplace:
            ctx.mark_dirty(x)
            return x
        return out

    @staticmethod
    def backward(ctx, dout):
        (cos, sin, cu_seqlens), seqlen_offsets = _saved(ctx)
        dx = apply_rotary(dout, cos, sin, seqlen_offsets=seqlen_offsets, cu_seqlens=cu_seqlens,
                          max_seqlen=ctx.max_seqlen, interleaved=ctx.interleaved, conjugate=True)
        return dx, None, None, None, None, None, None, None


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False,
                     seqlen_offsets: Union[int, Tensor] = 0, cu_seqlens: Optional[Tensor] = None,
                     max_seqlen: Optional[int] = None):
    """x rotated by cos, sin at the positions of its tokens (flash-attn's ``apply_rotary_emb``).

    x: (batch, seqlen, nheads, headdim), or (total_seqlen, nheads, headdim) with cu_seqlens.
    cos, sin: (seqlen_rotary, rotary_dim / 2); the first rotary_dim <= headdim features turn.
    interleaved: pairs (2c, 2c + 1) (GPT-J) instead of (c, c + rotary_dim / 2) (GPT-NeoX).
    inplace: rotate x itself (and return it). seqlen_offsets: an int or an int32 / int64 tensor
    (batch,), the position of each sequence's first token (decoding with a KV cache).
    cu_seqlens: int32 (batch + 1,), with max_seqlen (int): packed variable-length sequences, each
    starting at position 0 (+ its offset).
    Returns x's shape and dtype; differentiable in x.
    """
    if _compiling():  # the torch ops cuflash::rotary / rotary_ (torch_ops)
        return rotary_traced(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, interleaved, inplace)
    if not _records(x, cos, sin):   # no autograd.Function where autograd records nothing (~µs per call)
        return apply_rotary(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, interleaved, inplace)
    return ApplyRotaryEmb.apply(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)


apply_rotary_emb_func = apply_rotary_emb   # flash-attn's older name


def _qk_views(qkv: Tensor, num_heads_q: Optional[int]) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Views (q, k, qk) of a packed qkv: 5-D (batch, seqlen, 3, nheads, headdim), or 4-D (batch,
    seqlen, num_heads_q + 2 * num_heads_k, headdim) with num_heads_q; qk is q and k as one view
    (batch, seqlen, heads, headdim) where the layout allows it (one launch instead of two), else None."""
    if qkv.dim() == 5:
        batch, seqlen, three, nheads, headdim = qkv.shape
        if three != 3:
            raise ValueError(f"qkv must be (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
        qk = None
        if qkv.stride(2) == nheads * qkv.stride(3):   # q's and k's heads in one run of stride(3)
            qk = qkv[:, :, :2].view(batch, seqlen, 2 * nheads, headdim) if qkv.stride(-1) == 1 else None
        return qkv[:, :, 0], qkv[:, :, 1], qk
    if qkv.dim() != 4:
        raise ValueError(f"qkv must be (batch, seqlen, 3, nheads, headdim) or (batch, seqlen, "
                         f"num_heads_q + 2 * num_heads_k, headdim), got {tuple(qkv.shape)}")
    if num_heads_q is None:
        raise ValueError("num_heads_q must be given for a 4-D qkv (batch, seqlen, num_heads_q + 2 * "
                         "num_heads_k, headdim)")
    num_heads_k = (qkv.shape[2] - num_heads_q) // 2
    if num_heads_q <= 0 or num_heads_k <= 0 or num_heads_q + 2 * num_heads_k != qkv.shape[2]:
        raise ValueError(f"num_heads_q = {num_heads_q}: qkv's {qkv.shape[2]} heads must be num_heads_q + "
                         "2 * num_heads_k with num_heads_k >= 1")
    q, k = qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q:num_heads_q + num_heads_k]
    return q, k, qkv[:, :, :num_heads_q + num_heads_k]


def _rotate_qkv_(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q, conjugate=False):
    """q and k of qkv rotated in place (k by cos_k, sin_k when given: xPos)."""
    q, k, qk = _qk_views(qkv, num_heads_q)
    if cos_k is None and sin_k is None and qk is not None:
        apply_rotary(qk, cos, sin, seqlen_offsets=seqlen_offsets, interleaved=interleaved, inplace=True,
                     conjugate=conjugate)
        return
    apply_rotary(q, cos, sin, seqlen_offsets=seqlen_offsets, interleaved=interleaved, inplace=True,
                 conjugate=conjugate)
    apply_rotary(k, cos if cos_k is None else cos_k, sin if sin_k is None else sin_k,
                 seqlen_offsets=seqlen_offsets, interleaved=interleaved, inplace=True, conjugate=conjugate)


class ApplyRotaryEmbQKV_(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False, seqlen_offsets=0,
                num_heads_q=None):
        _rotate_qkv_(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q)
        _save_offsets(ctx, (cos, sin, cos_k, sin_k), seqlen_offsets)
        ctx.interleaved, ctx.num_heads_q = interleaved, num_heads_q
        ctx.mark_dirty(qkv)
        return qkv

    @staticmethod
    def backward(ctx, dqkv):
        (cos, sin, cos_k, sin_k), seqlen_offsets = _saved(ctx)
        dqkv = dqkv.clone(memory_format=torch.contiguous_format)  # never the incoming gradient itself
        _rotate_qkv_(dqkv, cos, sin, cos_k, sin_k, ctx.interleaved, seqlen_offsets, ctx.num_heads_q,
                     conjugate=True)
        return dqkv, None, None, None, None, None, None, None


def apply_rotary_emb_qkv_(qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False,
                          seqlen_offsets: Union[int, Tensor] = 0, num_heads_q: Optional[int] = None):
    """q and k of a packed qkv rotated *in place*; returns qkv (flash-attn's ``apply_rotary_emb_qkv_``).

    qkv: (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, num_heads_q + 2 * num_heads_k,
    headdim) (MQA / GQA) with num_heads_q. cos, sin: (seqlen, rotary_dim / 2); cos_k, sin_k:
    the same for k where they differ (xPos). interleaved, seqlen_offsets as apply_rotary_emb.
    """
    if _compiling():
        q, k, qk = _qk_views(qkv, num_heads_q)
        if cos_k is None and sin_k is None and qk is not None:
            rotary_traced(qk, cos, sin, seqlen_offsets, None, None, interleaved, True)
        else:
            rotary_traced(q, cos, sin, seqlen_offsets, None, None, interleaved, True)
            rotary_traced(k, cos if cos_k is None else cos_k, sin if sin_k is None else sin_k,
                          seqlen_offsets, None, None, interleaved, True)
        return qkv
    if not _records(qkv, cos, sin, cos_k, sin_k):
        _rotate_qkv_(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q)
        return qkv
    return ApplyRotaryEmbQKV_.apply(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q)


def _check_kv(kv) -> None:
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv must be (batch, seqlen, 2, nheads, headdim), got {tuple(kv.shape)}")


class ApplyRotaryEmbKV_(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv, cos, sin, interleaved=False, seqlen_offsets=0):
        _check_kv(kv)
        apply_rotary(kv[:, :, 0], cos, sin, seqlen_offsets=seqlen_offsets, interleaved=interleaved,
                     inplace=True)
        _save_offsets(ctx, (cos, sin), seqlen_offsets)
        ctx.interleaved = interleaved
        ctx.mark_dirty(kv)
        return kv

    @staticmethod
    def backward(ctx, dkv):
        (cos, sin), seqlen_offsets = _saved(ctx)
        dkv = dkv.clone(memory_format=torch.contiguous_format)
        apply_rotary(dkv[:, :, 0], cos, sin, seqlen_offsets=seqlen_offsets, interleaved=ctx.interleaved,
                     inplace=True, conjugate=True)
        return dkv, None, None, None, None


def apply_rotary_emb_kv_(kv, cos, sin, interleaved=False, seqlen_offsets: Union[int, Tensor] = 0):
    """k of a packed kv (batch, seqlen, 2, nheads, headdim) rotated *in place*; returns kv
    (flash-attn's ``apply_rotary_emb_kv_``). Arguments as apply_rotary_emb_qkv_."""
    if _compiling():
        _check_kv(kv)
        rotary_traced(kv[:, :, 0], cos, sin, seqlen_offsets, None, None, interleaved, True)
        return kv
    if not _records(kv, cos, sin):
        _check_kv(kv)
        apply_rotary(kv[:, :, 0], cos, sin, seqlen_offsets=seqlen_offsets, interleaved=interleaved, inplace=True)
        return kv
    return ApplyRotaryEmbKV_.apply(kv, cos, sin, interleaved, seqlen_offsets)


# ---------------------------------------------------------------------------------------
# the module

class RotaryEmbedding(torch.nn.Module):
    """Rotary position embeddings (RoFormer, Su et al. 2021) for q and k, with flash-attn's
    constructor and forward.

    dim: the rotary dim (features rotated per head); base: the frequency base, pair c turning by
    position · base^(-2c / dim); interleaved: GPT-J pairs; scale_base: xPos (Sun et al. 2022):
    q's cos / sin scaled by s_c^((pos - seqlen / 2) / scale_base), k's divided by it, with
    s_c = (2c + 0.4 dim) / (1.4 dim); pos_idx_in_fp32: positions in fp32 (True), else in
    inv_freq's dtype (the behaviour of models trained with bf16 positions, where e.g. 1995
    rounds to 2000); device: where the buffers start.

    The cos / sin tables are cached in the inputs' dtype and remade when a longer sequence, a
    new device or dtype comes, or when training starts on a cache made under inference mode
    (eager only: torch.compile cannot trace ``is_inference``; it takes no inference-mode tensors).
    """

    def __init__(self, dim: int, base=10000.0, interleaved=False, scale_base=None,
                 pos_idx_in_fp32=True, device=None):
        super().__init__()
        self.dim = dim
        self.base = float(base)
        self.pos_idx_in_fp32 = pos_idx_in_fp32
        self.register_buffer("inv_freq", self._compute_inv_freq(device), persistent=False)
        self.interleaved = interleaved
        self.scale_base = scale_base
        scale = self._compute_scale(device) if scale_base is not None else None
        self.register_buffer("scale", scale, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = None
        self._sin_cached = None
        self._cos_k_cached = None
        self._sin_k_cached = None

    def _compute_inv_freq(self, device=None) -> Tensor:
        """base^(-2c / dim) for c = 0 .. dim / 2 - 1, fp32."""
        exponents = torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim
        return 1.0 / (self.base ** exponents)

    def _compute_scale(self, device=None) -> Tensor:
        """xPos's per-pair base s_c = (2c + 0.4 dim) / (1.4 dim), fp32."""
        return (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) + 0.4 * self.dim) / (1.4 * self.dim)

    def _update_cos_sin_cache(self, seqlen, device=None, dtype=None):
        stale = (seqlen > self._seq_len_cached or self._cos_cached is None
                 or self._cos_cached.device != device or self._cos_cached.dtype != dtype
                 or (self.training and not _compiling() and self._cos_cached.is_inference()))
        if not stale:
            return
        self._seq_len_cached = seqlen
        if self.pos_idx_in_fp32:
            # fp32 positions and frequencies: their product reaches seqlen, where bf16 has no units
            positions = torch.arange(seqlen, device=device, dtype=torch.float32)
            inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float32 else self._compute_inv_freq(device)
        else:
            positions = torch.arange(seqlen, device=device, dtype=self.inv_freq.dtype)
            inv_freq = self.inv_freq
        angles = torch.outer(positions, inv_freq.to(positions.device))  # not einsum: autocast would lower it
        cos, sin = torch.cos(angles), torch.sin(angles)
        if self.scale is None:
            self._cos_cached, self._sin_cached = cos.to(dtype), sin.to(dtype)
            return
        # xPos in fp32 (scale may have been cast to 16 bits with the module: recompute it)
        base = self.scale if self.scale.dtype == torch.float32 else self._compute_scale(self.scale.device)
        power = (torch.arange(seqlen, dtype=torch.float32, device=base.device) - seqlen // 2) / self.scale_base
        scale = (base ** power[:, None]).to(angles.device)
        self._cos_cached, self._sin_cached = (cos * scale).to(dtype), (sin * scale).to(dtype)
        self._cos_k_cached, self._sin_k_cached = (cos / scale).to(dtype), (sin / scale).to(dtype)

    def forward(self, qkv: Tensor, kv: Optional[Tensor] = None, seqlen_offset: Union[int, Tensor] = 0,
                max_seqlen: Optional[int] = None, num_heads_q: Optional[int] = None
                ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        """Rotate q and k *in place*.

        qkv: (batch, seqlen, 3, nheads, headdim) or (batch, seqlen, num_heads_q + 2 * num_heads_k,
        headdim) with num_heads_q; or, when kv is given, q alone (batch, seqlen, nheads, headdim).
        kv: (batch, seqlen, 2, nheads_kv, headdim). seqlen_offset: an int or an int tensor (batch,),
        the position of each sequence's first token; with a tensor, pass max_seqlen so that the
        cache covers every position. Returns qkv, or (q, kv).
        """
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif not isinstance(seqlen_offset, Tensor):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
        xpos = self.scale is not None
        if kv is None:
            return apply_rotary_emb_qkv_(qkv, self._cos_cached, self._sin_cached,
                                         self._cos_k_cached if xpos else None,
                                         self._sin_k_cached if xpos else None,
                                         interleaved=self.interleaved, seqlen_offsets=seqlen_offset,
                                         num_heads_q=num_heads_q)
        q = apply_rotary_emb_func(qkv, self._cos_cached, self._sin_cached, interleaved=self.interleaved,
                                  inplace=True, seqlen_offsets=seqlen_offset)
        kv = apply_rotary_emb_kv_(kv, self._cos_k_cached if xpos else self._cos_cached,
                                  self._sin_k_cached if xpos else self._sin_cached,
                                  interleaved=self.interleaved, seqlen_offsets=seqlen_offset)
        return q, kv

