"""Float64 formulas for the tests of flash-attn's non-attention building blocks (not a test file):
dropout + residual + LayerNorm / RMSNorm, cross-entropy with smoothing and z-loss, self-attention
and a prenorm Block from the modules' weights, and a tiny GPT (cuflash's Block, MHA, Mlp /
GatedMlp, RMSNorm) with its formula. No cuflash code runs in the formulas."""
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from cuflash.modules.block import Block
from cuflash.modules.mha import MHA
from cuflash.modules.mlp import GatedMlp, Mlp
from cuflash.ops import layer_norm as ln


# ---------------------------------------------------------------------------------------------

def norm_formula(x, w, b, residual=None, x1=None, w1=None, b1=None, eps=1e-6, rowscale=None, keep=None,
                 keep1=None, p=0.0, rms=False, zero_centered=False, colscale=None):
    """h = drop(x·rowscale·colscale) + drop(x1) + residual; y = (h - mean)/sqrt(var + eps)·w + b."""
    h = x.double()
    if rowscale is not None:
        h = h * rowscale.double()[..., None]
    if colscale is not None:
        h = h * colscale.double()
    if keep is not None:
        h = h * keep.double() / (1 - p)
    if x1 is not None:
        h1 = x1.double()
        if keep1 is not None:
            h1 = h1 * keep1.double() / (1 - p)
        h = h + h1
    if residual is not None:
        h = h + residual.double()
    n = h.shape[-1]
    if rms:
        xhat = h / torch.sqrt((h * h).sum(-1, keepdim=True) / n + eps)
    else:
        mu = h.sum(-1, keepdim=True) / n
        var = ((h - mu) ** 2).sum(-1, keepdim=True) / n
        xhat = (h - mu) / torch.sqrt(var + eps)

    def affine(w_, b_):
        out = xhat
        if w_ is not None:
            out = out * (w_.double() + (1.0 if zero_centered else 0.0))
        return out + b_.double() if b_ is not None else out

    return affine(w, b), (affine(w1, b1) if w1 is not None else None), h


def ce_formula(logits, labels, smoothing=0.0, scale=1.0, zsq=0.0, ignore_index=-100):
    """Per-row loss and z-loss in float64: lse - (1-s)·z_y - s·mean(z) + zsq·lse²."""
    z = logits.double() * scale
    m = z.max(dim=-1, keepdim=True).values
    lse = (m + torch.log(torch.exp(z - m).sum(-1, keepdim=True))).squeeze(-1)
    c = z.shape[-1]
    valid = labels != ignore_index
    safe = torch.where(valid, labels, 0)
    zy = z[torch.arange(z.shape[0], device=z.device), safe]
    zl = zsq * lse * lse
    loss = lse - (1 - smoothing) * zy - smoothing * z.sum(-1) / c + zl
    return torch.where(valid, loss, 0.0), torch.where(valid, zl, 0.0)


def attention_formula(x, mha, causal):
    """Self-attention from MHA's weights, written out: qkv projection, softmax(q kᵀ / sqrt(d)) v."""
    b, s, e = x.shape
    h = mha.num_heads
    d = e // h
    qkv = (x @ mha.Wqkv.weight.T + mha.Wqkv.bias).view(b, s, 3, h, d)
    q, k, v = qkv.unbind(2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / d ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), v).reshape(b, s, e)
    return o @ mha.out_proj.weight.T + mha.out_proj.bias


def rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def block_formula(blk, hidden, residual, causal=True):
    """flash-attn's prenorm Block: r = hidden + residual, h = mixer(norm1(r)), r += h,
    out = mlp(norm2(r))."""
    def norm(m, t):
        if isinstance(m, ln.RMSNorm):
            return rms(t, m.weight, m.eps)
        return F.layer_norm(t, t.shape[-1:], m.weight, m.bias, m.eps)

    r = hidden + residual if residual is not None else hidden
    h = attention_formula(norm(blk.norm1, r), blk.mixer, causal)
    r = h + r
    t = norm(blk.norm2, r)
    mlp = blk.mlp
    if isinstance(mlp, GatedMlp):
        y = t @ mlp.fc1.weight.T + mlp.fc1.bias
        a, gate = y.chunk(2, dim=-1)
        out = (a * gate / (1 + torch.exp(-gate))) @ mlp.fc2.weight.T + mlp.fc2.bias
    else:
        out = F.gelu(t @ mlp.fc1.weight.T + mlp.fc1.bias) @ mlp.fc2.weight.T + mlp.fc2.bias
    return out, r


class TinyGPT(nn.Module):
    """Embedding → n prenorm Blocks (MHA, GatedMlp / Mlp, RMSNorm) → final RMSNorm (fused add) →
    tied LM head, flash-attn's GPT layout."""

    def __init__(self, vocab, dim, heads, layers, flash=True, dtype=torch.float64, device=None,
                 residual_in_fp32=False):
        super().__init__()
        f = dict(dtype=dtype, device=device)
        self.emb = nn.Embedding(vocab, dim, **f)
        self.blocks = nn.ModuleList(
            Block(dim, partial(MHA, num_heads=heads, causal=True, use_flash_attn=flash, **f),
                  partial(GatedMlp, activation=F.silu, multiple_of=16, **f) if i % 2 == 0
                  else partial(Mlp, hidden_features=2 * dim, **f),
                  norm_cls=partial(ln.RMSNorm, eps=1e-5, **f), fused_dropout_add_ln=True,
                  residual_in_fp32=residual_in_fp32)
            for i in range(layers))
        self.norm_f = ln.RMSNorm(dim, eps=1e-5, **f)
        self.residual_in_fp32 = residual_in_fp32

    def forward(self, ids):
        h, r = self.emb(ids), None
        for blk in self.blocks:
            h, r = blk(h, r)
        h = ln.rms_norm_fn(h, self.norm_f.weight, None, residual=r, eps=1e-5,
                           residual_in_fp32=self.residual_in_fp32)
        return h @ self.emb.weight.T


def tiny_gpt_formula(model, ids):
    h, r = model.emb(ids).double(), None
    for blk in model.blocks:
        h, r = block_formula(blk, h, r)
    return rms(h + r, model.norm_f.weight, 1e-5) @ model.emb.weight.T
