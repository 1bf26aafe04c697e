"""A plain multi-head attention computed from an MHA module's weights, for the MHA tests (not a
test file): projections, rotary embedding as complex multiplication, attention with every mask
as -inf, the output projection. No cuflash code runs in it.

reference_mha(m, x, ...) in ``dtype``: float64 is the reference; a 16-bit dtype is the plain
low-precision baseline (projections and matmuls in that dtype, the softmax in fp32).
"""
import math

import torch
import torch.nn.functional as F


def rotary_angles(seqlen, dim, base, device, offset=0):
    """θ[pos, c] = pos · base^(-2c / dim), float64, positions offset .. offset + seqlen - 1."""
    pos = torch.arange(offset, offset + seqlen, device=device, dtype=torch.float64)
    return pos[:, None] * base ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim)[None]


def rotate(x, angles, interleaved, scale=None):
    """x (batch, seqlen, heads, headdim): its first 2 · angles.shape[1] features turned pair by
    pair as complex numbers times exp(iθ) (times scale[pos, c] when given: xPos)."""
    half = angles.shape[1]
    turn = torch.polar(torch.ones_like(angles), angles)
    if scale is not None:
        turn = turn * scale
    turn = turn[None, :, None, :]
    xr = x[..., :2 * half].double()
    if interleaved:
        z = torch.view_as_complex(xr.reshape(*x.shape[:-1], half, 2).contiguous())
        turned = torch.view_as_real(z * turn).flatten(-2)
    else:
        w = torch.complex(xr[..., :half], xr[..., half:]) * turn
        turned = torch.cat((w.real, w.imag), dim=-1)
    return torch.cat((turned.to(x.dtype), x[..., 2 * half:]), dim=-1)


def xpos_scale(seqlen, dim, scale_base, device):
    power = (torch.arange(seqlen, device=device, dtype=torch.float64) - seqlen // 2) / scale_base
    base = (torch.arange(0, dim, 2, device=device, dtype=torch.float64) + 0.4 * dim) / (1.4 * dim)
    return base[None] ** power[:, None]


def alibi_slopes(nheads):
    """ALiBi slopes, written from the paper's rule (the geometric sequence for a power of two,
    interleaved from the next power of two otherwise)."""
    n = 2 ** math.floor(math.log2(nheads))
    slopes = [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]
    if n < nheads:
        extra = [2.0 ** (-8.0 * (i + 1) / (2 * n)) for i in range(2 * n)][0::2]
        slopes += extra[:nheads - n]
    return slopes


def attention(q, k, v, scale, causal, key_padding_mask=None, window=(-1, -1), slopes=None, low=False,
              queries_padded=False):
    """softmax(q kᵀ · scale + masks) v, (batch, seqlen, heads, headdim) layouts, bottom-right
    aligned on the kept keys (the first kept_b keys of row b), and on as many query rows when
    the queries are padded with the keys (self-attention), else on all seqlen_q rows."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(h // hk, dim=2), v.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k)
    s = s.float() * scale if low else s * scale
    kept = torch.full((b,), sk, device=q.device) if key_padding_mask is None else key_padding_mask.sum(-1)
    i = torch.arange(sq, device=q.device)[None, None, :, None]
    j = torch.arange(sk, device=q.device)[None, None, None, :]
    diag = i + (0 if queries_padded else kept[:, None, None, None] - sq)
    if slopes is not None:
        s = s - torch.tensor(slopes, device=q.device, dtype=s.dtype)[None, :, None, None] * (diag - j).abs()
    masked = torch.zeros_like(s, dtype=torch.bool)
    if key_padding_mask is not None:
        masked |= ~key_padding_mask.bool()[:, None, None, :]
    if causal:
        masked |= j > diag
    left, right = window
    if left >= 0:
        masked |= j < diag - left
    if right >= 0:
        masked |= j > diag + right
    p = torch.softmax(s.masked_fill(masked, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p.to(v.dtype), v)


def reference_mha(m, x, x_kv=None, key_padding_mask=None, mixer_subset=None, dtype=torch.float64,
                  window=(-1, -1), alibi=False):
    """The module m's forward (no dropout) from its weights, in ``dtype``."""
    P = {name: t.to(dtype) for name, t in m.named_parameters()}   # differentiable in the weights
    h, hk, d = m.num_heads, m.num_heads_kv, m.head_dim
    x = x.to(dtype)
    if m.cross_attn:
        q = F.linear(x if mixer_subset is None else x[:, mixer_subset], P["Wq.weight"], P.get("Wq.bias"))
        kv = F.linear((x if x_kv is None else x_kv.to(dtype)), P["Wkv.weight"], P.get("Wkv.bias"))
        k, v = kv.split(hk * d, dim=-1)
    else:
        q, k, v = F.linear(x, P["Wqkv.weight"], P.get("Wqkv.bias")).split([h * d, hk * d, hk * d], dim=-1)
    q, k, v = (t.unflatten(-1, (-1, d)) for t in (q, k, v))
    if m.rotary_emb_dim:
        emb = m.rotary_emb
        angles = rotary_angles(q.shape[1], m.rotary_emb_dim, emb.base, x.device)
        scale = None if emb.scale is None else xpos_scale(q.shape[1], m.rotary_emb_dim, emb.scale_base, x.device)
        q = rotate(q, angles, emb.interleaved, scale)
        k = rotate(k, angles, emb.interleaved, None if scale is None else 1 / scale)
    softmax_scale = m.inner_attn.softmax_scale or 1 / math.sqrt(d)
    ctx = attention(q, k, v, softmax_scale, m.causal, key_padding_mask, window,
                    alibi_slopes(h) if alibi else None, low=dtype != torch.float64,
                    queries_padded=not m.cross_attn)
    return F.linear(ctx.flatten(-2), P["out_proj.weight"], P.get("out_proj.bias"))
