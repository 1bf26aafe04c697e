"""Multi-head attention modules with flash-attn 2.8's names, constructor arguments and state-dict
keys: ``from flash_attn.modules.mha import MHA`` becomes ``from cuflash.modules.mha import MHA``,
and a flash-attn checkpoint loads as it is (``Wqkv``, or ``Wq`` / ``Wkv`` with cross-attention,
and ``out_proj``; the rotary tables and ALiBi slopes are non-persistent buffers, as there).

* ``MHA``: projections, optional rotary embedding (``cuflash.layers.rotary``), attention and the
  output projection. ``use_flash_attn=True`` runs cuflash's kernels (``flash_attn_*packed_func``,
  their varlen forms with ``cu_seqlens``, ``flash_attn_with_kvcache`` when decoding with
  ``inference_params``); ``use_flash_attn=False`` (flash-attn's default) runs the plain torch
  attention (``SelfAttention`` / ``CrossAttention``), as flash-attn does.
* ``FlashSelfAttention``, ``FlashCrossAttention``: the inner attention on cuflash;
  ``SelfAttention``, ``CrossAttention``: the same in torch operations (scores masked by adding
  -10000, softmax in v's dtype); ``LinearResidual``; ``get_alibi_slopes``.

Where cuflash accepts more than flash-attn (flash-attn asserts): ``key_padding_mask`` with
``use_flash_attn=True`` (the padded tokens are removed with ``cuflash.unpad_input``, the packed
batch runs the varlen kernels and the output is padded back with zeros at the padded tokens, so
the output projection's bias there; causal masks align on each row's kept tokens: query i sees
the kept keys j <= i in self-attention, and the last kept key is the last query's diagonal in
cross-attention, as the torch path; for MQA / GQA self-attention flash-attn's torch path (a
CrossAttention) aligns the diagonal to the last kept key instead, and cuflash's torch path keeps
that);
``cu_seqlens`` with rotary (each packed sequence starts at position 0) and with
``num_heads_kv != num_heads``. ``fused_bias_fc``: the projections are
``cuflash.ops.fused_dense.FusedDense`` (flash-attn's). Not provided: ``dwconv`` raises
``cuflash.UnsupportedFeature``.

* ``ParallelMHA``: tensor-parallel self-attention (each rank of a process group holds some of
  the heads; Wqkv and out_proj are cuflash.ops.fused_dense's ColumnParallelLinear and
  RowParallelLinear, plain torch and torch.distributed); ``shard_mha_state_dict`` /
  ``combine_mha_state_dicts`` convert between a rank's state dict and MHA's. MHA and
  ParallelMHA share everything from the projections to the context (``_AttentionLayer``).
"""
from __future__ import annotations

import math
import torch
import torch.nn as nn
from torch import Tensor

from ..api import (UnsupportedFeature, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                   flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func,
                   flash_attn_with_kvcache)
from ..layers.rotary import RotaryEmbedding, apply_rotary_emb
from ..padding import pad_input, unpad_input

__all__ = ["get_alibi_slopes", "FlashSelfAttention", "FlashCrossAttention", "SelfAttention",
           "CrossAttention", "LinearResidual", "MHA", "ParallelMHA", "shard_mha_state_dict",
           "combine_mha_state_dicts"]


def get_alibi_slopes(nheads: int) -> list:
    """ALiBi's head slopes (Press et al. 2022): for n a power of two the geometric sequence
    2^(-8 / n), 2^(-16 / n), ..., 2^(-8); otherwise the slopes of the largest power of two below
    nheads, then every other slope of twice that power for the remaining heads."""
    def geometric(n):
        first = 2.0 ** (-8.0 / n)
        return [first ** (i + 1) for i in range(n)]

    if nheads <= 0:
        raise ValueError(f"nheads must be >= 1, got {nheads}")
    if nheads & (nheads - 1) == 0:
        return geometric(nheads)
    below = 1 << (nheads.bit_length() - 1)
    return geometric(below) + get_alibi_slopes(2 * below)[0::2][:nheads - below]


def _check_varlen_args(cu_seqlens, max_seqlen, what: str) -> None:
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"{what}: cu_seqlens must be int32, got {cu_seqlens.dtype}")
    if not isinstance(max_seqlen, int):
        raise ValueError(f"{what}: max_seqlen must be an int with cu_seqlens, got {max_seqlen!r}")


class _FlashAttention(nn.Module):
    """What FlashSelfAttention and FlashCrossAttention share: their settings and the keyword
    arguments of one cuflash call (flash-attn's constructors order alibi_slopes and window_size
    differently, so each keeps its own __init__ signature)."""

    def _setup(self, causal, softmax_scale, attention_dropout, window_size, alibi_slopes, deterministic):
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)
        self.window_size = window_size
        self.deterministic = deterministic
        # BTLM's ALiBi position interpolation (MHA's alibi_train_seqlen); None: the slopes as they are
        self.alibi_train_seqlen = None

    def slopes_for(self, keys=None, cu_seqlens_k=None):
        """The ALiBi slopes of a call: ``alibi_slopes`` in fp32; with alibi_train_seqlen set,
        divided by max(1, keys / alibi_train_seqlen), keys the call's key count (an int), each
        sequence's (a tensor: (batch, nheads) slopes) or each packed sequence's (cu_seqlens_k)."""
        if self.alibi_slopes is not None and self.alibi_slopes.dtype != torch.float32:
            self.alibi_slopes = self.alibi_slopes.to(torch.float32)
        slopes, train = self.alibi_slopes, self.alibi_train_seqlen
        if slopes is None or train is None:
            return slopes
        if cu_seqlens_k is not None:
            keys = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        if isinstance(keys, Tensor):
            return slopes / torch.clamp(keys.to(torch.float32) / train, min=1.0)[:, None]
        return slopes / max(1.0, keys / train)

    def _call_args(self, causal, keys=None, cu_seqlens_k=None) -> tuple:
        """(dropout_p, keyword arguments) of this call (keys, cu_seqlens_k: as slopes_for):
        dropout only while training, ALiBi slopes in fp32."""
        return self.drop.p if self.training else 0.0, dict(
            softmax_scale=self.softmax_scale, causal=self.causal if causal is None else causal,
            alibi_slopes=self.slopes_for(keys, cu_seqlens_k), window_size=self.window_size,
            deterministic=self.deterministic)


class FlashSelfAttention(_FlashAttention):
    """Softmax attention of packed qkv on cuflash's kernels.

    causal: bottom-right aligned causal mask; softmax_scale: default 1 / sqrt(headdim);
    attention_dropout: the dropout probability while training; window_size, alibi_slopes
    ((nheads,) or (batch, nheads), fp32), deterministic: as flash_attn_func.
    """

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0, window_size=(-1, -1),
                 alibi_slopes=None, deterministic=False):
        super().__init__()
        self._setup(causal, softmax_scale, attention_dropout, window_size, alibi_slopes, deterministic)

    def forward(self, qkv, causal=None, cu_seqlens=None, max_seqlen=None):
        """qkv: (batch, seqlen, 3, nheads, headdim), or (total, 3, nheads, headdim) with cu_seqlens
        (int32, (batch + 1,)) and max_seqlen (int). causal: overrides self.causal. Returns
        (batch, seqlen, nheads, headdim), or (total, nheads, headdim)."""
        p, common = self._call_args(causal, qkv.shape[1], cu_seqlens)
        if cu_seqlens is not None:
            _check_varlen_args(cu_seqlens, max_seqlen, "FlashSelfAttention")
            return flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, p, **common)
        return flash_attn_qkvpacked_func(qkv, p, **common)


class FlashCrossAttention(_FlashAttention):
    """Softmax attention of q over packed kv on cuflash's kernels (MQA / GQA when kv has fewer
    heads). Arguments as FlashSelfAttention."""

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0, alibi_slopes=None,
                 window_size=(-1, -1), deterministic=False):
        super().__init__()
        self._setup(causal, softmax_scale, attention_dropout, window_size, alibi_slopes, deterministic)

    def forward(self, q, kv, causal=None, cu_seqlens=None, max_seqlen=None, cu_seqlens_k=None,
                max_seqlen_k=None):
        """q: (batch, seqlen_q, nheads, headdim); kv: (batch, seqlen_k, 2, nheads_kv, headdim).
        Packed variable-length batches: q (total_q, nheads, headdim), kv (total_k, 2, nheads_kv,
        headdim) with cu_seqlens / max_seqlen (q's) and cu_seqlens_k / max_seqlen_k (kv's)."""
        if cu_seqlens is not None:
            _check_varlen_args(cu_seqlens, max_seqlen, "FlashCrossAttention")
            if cu_seqlens_k is None or max_seqlen_k is None:
                raise ValueError("FlashCrossAttention: cu_seqlens_k and max_seqlen_k must be given with cu_seqlens")
            _check_varlen_args(cu_seqlens_k, max_seqlen_k, "FlashCrossAttention (kv)")
            p, common = self._call_args(causal, cu_seqlens_k=cu_seqlens_k)
            return flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k,
                                                   p, **common)
        if kv.shape[0] != q.shape[0] or kv.shape[-1] != q.shape[-1]:
            raise ValueError(f"kv {tuple(kv.shape)} must have q's batch and head dim, q {tuple(q.shape)}")
        p, common = self._call_args(causal, kv.shape[1])
        return flash_attn_kvpacked_func(q, kv, p, **common)


def _plain_attention(q, k, v, scale, key_padding_mask, causal, drop, queries_padded):
    """softmax(q kᵀ · scale + masks) v in torch operations, (batch, seqlen, heads, headdim) layouts;
    masked scores get -10000 added (padding) or set (causal), the softmax runs in v's dtype, then
    dropout. Causal is bottom-right aligned: on the kept keys' count for cross-attention, and
    query i sees keys j <= i for self-attention (queries_padded: q padded like the keys)."""
    batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k * scale)
    if key_padding_mask is not None:
        bias = torch.zeros((batch, seqlen_k), dtype=scores.dtype, device=scores.device)
        bias = bias.masked_fill(~key_padding_mask.bool(), -10000.0)
        scores = scores + bias[:, None, None, :]
    if causal:
        rows = torch.arange(seqlen_q, device=q.device)[:, None]
        cols = torch.arange(seqlen_k, device=q.device)[None, :]
        kept = seqlen_k if key_padding_mask is None or queries_padded else key_padding_mask.sum(-1)[:, None, None, None]
        scores = scores.masked_fill(cols > rows + kept - seqlen_q, -10000.0)
    probs = drop(torch.softmax(scores, dim=-1, dtype=v.dtype))
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


class SelfAttention(nn.Module):
    """Softmax attention of packed qkv in plain torch operations (MHA's use_flash_attn=False)."""

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)

    def forward(self, qkv, causal=None, key_padding_mask=None):
        """qkv: (batch, seqlen, 3, nheads, headdim); key_padding_mask: bool (batch, seqlen), True
        keeps a key. Returns (batch, seqlen, nheads, headdim)."""
        causal = self.causal if causal is None else causal
        q, k, v = qkv.unbind(dim=2)
        scale = self.softmax_scale or 1.0 / math.sqrt(q.shape[-1])
        return _plain_attention(q, k, v, scale, key_padding_mask, causal, self.drop, queries_padded=True)


class CrossAttention(nn.Module):
    """Softmax attention of q over packed kv in plain torch operations (MQA / GQA by repeating
    the kv heads)."""

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)

    def forward(self, q, kv, causal=None, key_padding_mask=None):
        """q: (batch, seqlen_q, nheads, headdim); kv: (batch, seqlen_k, 2, nheads_kv, headdim);
        key_padding_mask: bool (batch, seqlen_k), True keeps a key."""
        causal = self.causal if causal is None else causal
        if kv.shape[0] != q.shape[0] or kv.shape[-1] != q.shape[-1]:
            raise ValueError(f"kv {tuple(kv.shape)} must have q's batch and head dim, q {tuple(q.shape)}")
        k, v = kv.unbind(dim=2)
        if k.shape[2] != q.shape[2]:   # each kv head serves nheads / nheads_kv consecutive q heads
            group = q.shape[2] // k.shape[2]
            k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        scale = self.softmax_scale or 1.0 / math.sqrt(q.shape[-1])
        return _plain_attention(q, k, v, scale, key_padding_mask, causal, self.drop, queries_padded=False)


class LinearResidual(nn.Linear):
    """nn.Linear that also returns its input (MHA's return_residual)."""

    def forward(self, input: Tensor):
        return super().forward(input), input


def _update_kv_cache(kv, inference_params, layer_idx):
    """kv (batch, seqlen, 2, nheads_kv, headdim) written into the layer's cache at
    inference_params' batch and sequence offsets (the cache made on first use, (max_batch_size,
    max_seqlen, 2, nheads_kv, headdim)); returns the cache's rows up to the new end."""
    cache = inference_params.key_value_memory_dict.get(layer_idx)
    if cache is None:
        cache = torch.empty(inference_params.max_batch_size, inference_params.max_seqlen, 2, *kv.shape[-2:],
                            dtype=kv.dtype, device=kv.device)
        inference_params.key_value_memory_dict[layer_idx] = cache
    b0, s0 = inference_params.batch_size_offset, inference_params.seqlen_offset
    b1, s1 = b0 + kv.shape[0], s0 + kv.shape[1]
    if b1 > cache.shape[0] or s1 > cache.shape[1]:
        raise ValueError(f"inference_params: rows {b0}..{b1} x positions {s0}..{s1} exceed the KV cache "
                         f"({cache.shape[0]} x {cache.shape[1]}: max_batch_size x max_seqlen)")
    cache[b0:b1, s0:s1] = kv
    return cache[b0:b1, :s1]


class _AttentionLayer(nn.Module):
    """What MHA and ParallelMHA share: the inner attention modules, rotary, the KV cache and the
    forward from the projections to the context. Subclasses make the projections and say how many
    heads this module holds (_local_heads: all of them in MHA, this rank's in ParallelMHA)."""

    def _setup_attention(self, *, embed_dim, num_heads, num_heads_kv, causal, softmax_scale, dropout,
                         window_size, alibi_slopes, use_flash_attn, rotary_emb_dim, rotary_emb_base,
                         rotary_emb_scale_base, rotary_emb_interleaved, layer_idx, checkpointing, cross_attn,
                         device):
        """Checks the head counts (head_dim = embed_dim / num_heads) and makes the inner attention
        (alibi_slopes: this module's heads' slopes or None) and the rotary embedding."""
        self.embed_dim = embed_dim
        self.cross_attn = cross_attn
        self.causal = causal
        self.layer_idx = layer_idx
        self.rotary_emb_dim = rotary_emb_dim
        self.use_flash_attn = use_flash_attn
        self.checkpointing = checkpointing
        if alibi_slopes is not None and not use_flash_attn:
            raise ValueError("use_alibi=True needs use_flash_attn=True (the torch attention has no ALiBi)")
        if tuple(window_size) != (-1, -1) and not use_flash_attn:
            raise ValueError(f"window_size={tuple(window_size)} needs use_flash_attn=True (the torch "
                             "attention has no sliding window)")
        self.num_heads = num_heads
        self.num_heads_kv = num_heads_kv if num_heads_kv is not None else num_heads
        if num_heads <= 0 or self.num_heads_kv <= 0 or num_heads % self.num_heads_kv:
            raise ValueError(f"num_heads = {num_heads} must be a positive multiple of num_heads_kv = "
                             f"{self.num_heads_kv}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim = {embed_dim} must be divisible by num_heads = {num_heads}")
        self.head_dim = embed_dim // num_heads
        if rotary_emb_dim > 0:
            if cross_attn:
                raise UnsupportedFeature("rotary_emb_dim > 0 with cross_attn=True: rotary embedding needs "
                                         "self-attention (as in flash-attn)")
            self.rotary_emb = RotaryEmbedding(rotary_emb_dim, base=rotary_emb_base, scale_base=rotary_emb_scale_base,
                                              interleaved=rotary_emb_interleaved, device=device)
        if use_flash_attn:
            self.inner_attn = FlashSelfAttention(causal=causal, softmax_scale=softmax_scale, attention_dropout=dropout,
                                                 alibi_slopes=alibi_slopes, window_size=window_size)
            self.inner_cross_attn = FlashCrossAttention(causal=causal, softmax_scale=softmax_scale,
                                                        attention_dropout=dropout, alibi_slopes=alibi_slopes,
                                                        window_size=window_size)
        else:
            self.inner_attn = SelfAttention(causal=causal, softmax_scale=softmax_scale, attention_dropout=dropout)
            self.inner_cross_attn = CrossAttention(causal=causal, softmax_scale=softmax_scale,
                                                   attention_dropout=dropout)

    def _local_heads(self) -> tuple:
        """(query heads, kv heads) that this module computes."""
        return self.num_heads, self.num_heads_kv

    def _set_alibi(self, slopes, alibi_slope_scale, alibi_train_seqlen, device):
        """This module's heads' ALiBi slopes (a list, or None without use_alibi) times
        alibi_slope_scale into the inner attention, and alibi_train_seqlen (see MHA)."""
        if (not isinstance(alibi_slope_scale, (int, float)) or isinstance(alibi_slope_scale, bool)
                or not alibi_slope_scale > 0 or not math.isfinite(alibi_slope_scale)):
            raise ValueError(f"alibi_slope_scale must be a finite number > 0, got {alibi_slope_scale!r}")
        if alibi_train_seqlen is not None and (not isinstance(alibi_train_seqlen, int)
                                               or isinstance(alibi_train_seqlen, bool) or alibi_train_seqlen < 1):
            raise ValueError(f"alibi_train_seqlen must be None or an int >= 1, got {alibi_train_seqlen!r}")
        if slopes is None:
            if alibi_slope_scale != 1.0 or alibi_train_seqlen is not None:
                raise ValueError("alibi_slope_scale and alibi_train_seqlen need use_alibi=True")
            return
        if not self.use_flash_attn:
            raise ValueError("use_alibi=True needs use_flash_attn=True (the torch attention has no ALiBi)")
        slopes = torch.tensor([s * alibi_slope_scale for s in slopes], dtype=torch.float32, device=device)
        for attn in (self.inner_attn, self.inner_cross_attn):
            attn.alibi_slopes = slopes
            attn.alibi_train_seqlen = alibi_train_seqlen

    # ---- decoding ----
    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None):
        """An empty KV cache (batch_size, max_seqlen, 2, kv heads, head_dim) for this layer (its
        own kv heads: this rank's in ParallelMHA)."""
        dtype = self.out_proj.weight.dtype if dtype is None else dtype
        return torch.empty(batch_size, max_seqlen, 2, self._local_heads()[1], self.head_dim, dtype=dtype,
                           device=self.out_proj.weight.device)

    def _update_kv_cache(self, kv, inference_params):
        if self.layer_idx is None:
            raise ValueError("inference_params: decoding needs layer_idx in the constructor")
        return _update_kv_cache(kv, inference_params, self.layer_idx)

    def _kvcache_call(self, q, kv, inference_params, rotary: bool):
        """flash_attn_with_kvcache on this layer's cache: kv appended at each row's length (k
        rotated by the cached tables with rotary, q too), then q attends to the cache."""
        if self.layer_idx is None:
            raise ValueError("inference_params: decoding needs layer_idx in the constructor")
        cos = sin = None
        if rotary:
            if self.rotary_emb.scale is not None:
                raise UnsupportedFeature("rotary_emb_scale_base (xPos) when decoding with the fused rotary path")
            self.rotary_emb._update_cos_sin_cache(inference_params.max_seqlen, device=q.device, dtype=q.dtype)
            cos, sin = self.rotary_emb._cos_cached, self.rotary_emb._sin_cached
        batch = q.shape[0]
        cache = inference_params.key_value_memory_dict[self.layer_idx][:batch]
        lengths = (inference_params.lengths_per_sample[:batch] if inference_params.lengths_per_sample is not None
                   else inference_params.seqlen_offset)
        attn = self.inner_cross_attn
        # keys = cache + new tokens only where the slopes depend on them (BTLM): for the rest no per-step add
        # (a kernel launch per layer and token when lengths_per_sample is a tensor)
        slopes = attn.slopes_for() if attn.alibi_train_seqlen is None else attn.slopes_for(lengths + q.shape[1])
        return flash_attn_with_kvcache(q, cache[:, :, 0], cache[:, :, 1], kv[:, :, 0], kv[:, :, 1],
                                       rotary_cos=cos, rotary_sin=sin, cache_seqlens=lengths,
                                       softmax_scale=attn.softmax_scale, causal=attn.causal,
                                       rotary_interleaved=self.rotary_emb.interleaved if rotary else False,
                                       alibi_slopes=slopes)

    def _update_kvcache_attention(self, q, kv, inference_params):
        """kv into the cache, then q's attention over it."""
        if inference_params.seqlen_offset == 0 or not self.use_flash_attn:
            return self.inner_cross_attn(q, self._update_kv_cache(kv, inference_params))
        return self._kvcache_call(q, kv, inference_params, rotary=False)

    def _apply_rotary_update_kvcache_attention(self, q, kv, inference_params):
        """Rotary on q and k, kv into the cache and the attention, in one flash_attn_with_kvcache."""
        return self._kvcache_call(q, kv, inference_params, rotary=self.rotary_emb_dim > 0)

    # ---- attention on the projections ----
    def _rotary_varlen(self, q, k, cu_seqlens, max_seqlen):
        """Rotary on packed variable-length q, k (total, heads, headdim) in place, each sequence
        from position 0."""
        emb = self.rotary_emb
        emb._update_cos_sin_cache(max_seqlen, device=q.device, dtype=q.dtype)
        xpos = emb.scale is not None
        apply_rotary_emb(q, emb._cos_cached, emb._sin_cached, interleaved=emb.interleaved, inplace=True,
                         cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        apply_rotary_emb(k, emb._cos_k_cached if xpos else emb._cos_cached,
                         emb._sin_k_cached if xpos else emb._sin_cached, interleaved=emb.interleaved,
                         inplace=True, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)

    def _self_attention(self, qkv, key_padding_mask=None, **kwargs):
        if self.use_flash_attn and key_padding_mask is not None:
            batch, seqlen = qkv.shape[:2]
            packed, indices, cu, longest, _ = unpad_input(qkv, key_padding_mask)
            return pad_input(self.inner_attn(packed, cu_seqlens=cu, max_seqlen=longest), indices, batch, seqlen)
        if not self.use_flash_attn:
            return self.inner_attn(qkv, key_padding_mask=key_padding_mask)
        return self.inner_attn(qkv, **kwargs)

    def _cross_attention(self, q, kv, key_padding_mask=None, **kwargs):
        if self.use_flash_attn and key_padding_mask is not None:
            batch, seqlen_q = q.shape[:2]
            packed_kv, indices, cu_k, longest_k, _ = unpad_input(kv, key_padding_mask)
            if not self.cross_attn:   # MQA / GQA self-attention: the queries are the same tokens
                out = self.inner_cross_attn(unpad_input(q, key_padding_mask)[0], packed_kv, cu_seqlens=cu_k,
                                            max_seqlen=longest_k, cu_seqlens_k=cu_k, max_seqlen_k=longest_k)
                return pad_input(out, indices, batch, seqlen_q)
            cu_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=q.device)
            out = self.inner_cross_attn(q.reshape(batch * seqlen_q, *q.shape[2:]), packed_kv, cu_seqlens=cu_q,
                                        max_seqlen=seqlen_q, cu_seqlens_k=cu_k, max_seqlen_k=longest_k)
            return out.reshape(batch, seqlen_q, *out.shape[1:])
        if not self.use_flash_attn:
            return self.inner_cross_attn(q, kv, key_padding_mask=key_padding_mask)
        if kwargs.get("cu_seqlens") is not None and kwargs.get("cu_seqlens_k") is None:
            # self-attention with MQA / GQA on packed sequences: the keys are the queries' tokens
            kwargs = {**kwargs, "cu_seqlens_k": kwargs["cu_seqlens"], "max_seqlen_k": kwargs["max_seqlen"]}
        return self.inner_cross_attn(q, kv, **kwargs)

    def _run(self, fn, *args, **kwargs):
        if self.checkpointing:
            return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)
        return fn(*args, **kwargs)

    def _attention_kwargs(self, key_padding_mask, cu_seqlens, max_seqlen, inference_params, kwargs) -> dict:
        """The forward's arguments checked; the keyword arguments of the inner attention call."""
        if cu_seqlens is not None:
            if max_seqlen is None:
                raise ValueError("max_seqlen must be given with cu_seqlens")
            if key_padding_mask is not None:
                raise ValueError("key_padding_mask and cu_seqlens exclude each other (cu_seqlens: already packed)")
            if not self.use_flash_attn:
                raise ValueError("cu_seqlens needs use_flash_attn=True")
        if inference_params is not None:
            if key_padding_mask is not None or cu_seqlens is not None or max_seqlen is not None:
                raise ValueError("inference_params excludes key_padding_mask, cu_seqlens and max_seqlen")
        attn_kwargs = ({"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen, **kwargs}
                       if cu_seqlens is not None else dict(kwargs))
        if key_padding_mask is not None:
            attn_kwargs["key_padding_mask"] = key_padding_mask
        return attn_kwargs

    def _context(self, q, kv, inference_params, cu_seqlens, max_seqlen, attn_kwargs):
        """The attention's context (..., heads, head_dim) from the projections: q (..., heads,
        head_dim) and kv (..., 2, kv heads, head_dim), or, with kv None, q the packed qkv (...,
        3, heads, head_dim) of self-attention with as many kv heads as query heads. Rotary,
        the KV cache with inference_params (decoding after the prompt: rotary, cache append
        and attention in one flash_attn_with_kvcache) and the inner attention."""
        packed = kv is None
        seqlen_offset = 0 if inference_params is None else (   # lengths_per_sample: max_batch_size rows
            inference_params.lengths_per_sample[:q.shape[0]] if inference_params.lengths_per_sample is not None
            else inference_params.seqlen_offset)
        rotary_max_seqlen = inference_params.max_seqlen if inference_params is not None else None
        fused_decode = (inference_params is not None and inference_params.seqlen_offset > 0
                        and self.use_flash_attn and self.rotary_emb_dim > 0 and self.rotary_emb_dim % 16 == 0)
        if fused_decode:
            return (self._apply_rotary_update_kvcache_attention(q[:, :, 0], q[:, :, 1:], inference_params)
                    if packed else self._apply_rotary_update_kvcache_attention(q, kv, inference_params))
        if self.rotary_emb_dim > 0:
            if cu_seqlens is not None:
                self._rotary_varlen(q[:, 0] if packed else q, q[:, 1] if packed else kv[:, 0], cu_seqlens, max_seqlen)
            elif packed:
                q = self.rotary_emb(q, seqlen_offset=seqlen_offset, max_seqlen=rotary_max_seqlen)
            else:
                q, kv = self.rotary_emb(q, kv, seqlen_offset=seqlen_offset, max_seqlen=rotary_max_seqlen)
        if packed:
            if inference_params is None:
                return self._run(self._self_attention, q, **attn_kwargs)
            return self._update_kvcache_attention(q[:, :, 0], q[:, :, 1:], inference_params)
        if inference_params is None:
            return self._run(self._cross_attention, q, kv, **attn_kwargs)
        return self._update_kvcache_attention(q, kv, inference_params)

    def _qkv_context(self, qkv, inference_params, cu_seqlens, max_seqlen, attn_kwargs):
        """_context of self-attention from the Wqkv projection (..., (heads + 2 kv heads) ·
        head_dim): the query heads, then the keys' heads, then the values' (this module's heads)."""
        heads, heads_kv = self._local_heads()
        d = self.head_dim
        if heads == heads_kv:
            return self._context(qkv.unflatten(-1, (3, heads, d)), None, inference_params, cu_seqlens, max_seqlen,
                                 attn_kwargs)
        q = qkv[..., :heads * d].unflatten(-1, (heads, d))
        kv = qkv[..., heads * d:].unflatten(-1, (2, heads_kv, d))
        return self._context(q, kv, inference_params, cu_seqlens, max_seqlen, attn_kwargs)


class MHA(_AttentionLayer):
    """Multi-head self- and cross-attention (flash-attn's ``MHA``).

    embed_dim = num_heads · head_dim; num_heads_kv: MQA / GQA (default num_heads); cross_attn:
    q from x, k and v from x_kv (Wq, Wkv instead of Wqkv); qkv_proj_bias, out_proj_bias: the
    projections' biases; dropout: attention dropout while training; softmax_scale; causal;
    layer_idx: this layer's key in inference_params.key_value_memory_dict (decoding);
    rotary_emb_dim > 0: rotary embedding of that many features per head (rotary_emb_base,
    rotary_emb_scale_base (xPos), rotary_emb_interleaved); use_alibi: ALiBi with
    get_alibi_slopes(num_heads); window_size: sliding window (left, right); use_flash_attn:
    cuflash's kernels (else plain torch attention); return_residual: forward returns (out, x);
    checkpointing: recompute the attention in the backward; device, dtype: the parameters'.
    fused_bias_fc: the projections are cuflash.ops.fused_dense.FusedDense (same parameters and
    keys). dwconv raises cuflash.UnsupportedFeature.

    cuflash's additions (keyword-only, after flash-attn's arguments; with use_alibi only): alibi_slope_scale:
    the slopes times this number (Falcon-RW adds ALiBi to the raw scores before the softmax
    scale: alibi_slope_scale = 1 / sqrt(head_dim); BTLM's fixed position interpolation: 1 /
    factor); alibi_train_seqlen: BTLM's dynamic position interpolation, each call's slopes
    divided by max(1, keys / alibi_train_seqlen), keys the call's key count (per sequence with
    cu_seqlens, key_padding_mask or per-row cache lengths; the cache plus the new tokens when
    decoding).
    """

    def __init__(self, embed_dim, num_heads, num_heads_kv=None, cross_attn=False, qkv_proj_bias=True,
                 out_proj_bias=True, dropout=0.0, softmax_scale=None, causal=False, layer_idx=None,
                 dwconv=False, rotary_emb_dim=0, rotary_emb_base=10000.0, rotary_emb_scale_base=None,
                 rotary_emb_interleaved=False, use_alibi=False, window_size=(-1, -1), fused_bias_fc=False,
                 use_flash_attn=False, return_residual=False, checkpointing=False, device=None,
                 dtype=None, *, alibi_slope_scale=1.0, alibi_train_seqlen=None) -> None:
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        if dwconv:
            raise UnsupportedFeature("dwconv=True: the depthwise convolution after the projections is not "
                                     "part of cuflash's MHA")
        self.dwconv = dwconv
        self.return_residual = return_residual
        if use_alibi and not use_flash_attn:
            raise ValueError("use_alibi=True needs use_flash_attn=True (the torch attention has no ALiBi)")
        self._setup_attention(embed_dim=embed_dim, num_heads=num_heads, num_heads_kv=num_heads_kv, causal=causal,
                              softmax_scale=softmax_scale, dropout=dropout, window_size=window_size,
                              alibi_slopes=None, use_flash_attn=use_flash_attn, rotary_emb_dim=rotary_emb_dim,
                              rotary_emb_base=rotary_emb_base, rotary_emb_scale_base=rotary_emb_scale_base,
                              rotary_emb_interleaved=rotary_emb_interleaved, layer_idx=layer_idx,
                              checkpointing=checkpointing, cross_attn=cross_attn, device=device)
        self._set_alibi(get_alibi_slopes(num_heads) if use_alibi else None, alibi_slope_scale, alibi_train_seqlen,
                        device)
        qkv_dim = self.head_dim * (self.num_heads + 2 * self.num_heads_kv)
        kv_dim = 2 * self.head_dim * self.num_heads_kv
        # fused_bias_fc: cuflash.ops.fused_dense.FusedDense (an nn.Linear: the same parameters and keys; with
        # return_residual the residual's gradient added inside the input-gradient GEMM)
        if fused_bias_fc:
            from functools import partial

            from ..ops.fused_dense import FusedDense

            linear_cls = FusedDense
            wqkv_cls = partial(FusedDense, return_residual=True) if return_residual else FusedDense
        else:
            linear_cls, wqkv_cls = nn.Linear, LinearResidual if return_residual else nn.Linear
        if not cross_attn:
            self.Wqkv = wqkv_cls(embed_dim, qkv_dim, bias=qkv_proj_bias, **factory)
        else:
            self.Wq = linear_cls(embed_dim, embed_dim, bias=qkv_proj_bias, **factory)
            self.Wkv = wqkv_cls(embed_dim, kv_dim, bias=qkv_proj_bias, **factory)
        self.out_proj = linear_cls(embed_dim, embed_dim, bias=out_proj_bias, **factory)

    def forward(self, x, x_kv=None, key_padding_mask=None, cu_seqlens=None, max_seqlen=None,
                mixer_subset=None, inference_params=None, **kwargs):
        """x: (batch, seqlen, embed_dim), or (total, embed_dim) with cu_seqlens (int32, (batch + 1,))
        and max_seqlen (int). x_kv: cross-attention's (batch, seqlen_k, embed_dim) (default x).
        key_padding_mask: bool (batch, seqlen_k), True keeps a key. mixer_subset: cross-attention
        only, the query tokens to keep (x[:, mixer_subset]). inference_params: decoding with a KV
        cache (cuflash.utils.generation.InferenceParams: max_seqlen, max_batch_size,
        seqlen_offset, batch_size_offset, key_value_memory_dict, lengths_per_sample).
        Returns (batch, seqlen, embed_dim) (or (out, x) with return_residual)."""
        attn_kwargs = self._attention_kwargs(key_padding_mask, cu_seqlens, max_seqlen, inference_params, kwargs)
        if mixer_subset is not None and not self.cross_attn:
            raise ValueError("mixer_subset is for cross-attention (cross_attn=True) only")
        if x_kv is not None and not self.cross_attn:
            raise ValueError("x_kv is for cross-attention (cross_attn=True) only")
        if not self.cross_attn:
            qkv = self.Wqkv(x)
            if self.return_residual:
                qkv, x = qkv
            context = self._qkv_context(qkv, inference_params, cu_seqlens, max_seqlen, attn_kwargs)
        else:
            if x_kv is not None:
                kv = self.Wkv(x_kv)
                if self.return_residual:
                    kv, x_kv = kv
            else:
                kv = self.Wkv(x)
                if self.return_residual:
                    kv, x = kv
            q = self.Wq(x if mixer_subset is None else x[:, mixer_subset])
            context = self._context(q.unflatten(-1, (-1, self.head_dim)), kv.unflatten(-1, (2, -1, self.head_dim)),
                                    inference_params, cu_seqlens, max_seqlen, attn_kwargs)
        out = self.out_proj(context.flatten(-2))
        return (out, x) if self.return_residual else out


class ParallelMHA(_AttentionLayer):
    """Tensor-parallel multi-head self-attention (flash-attn's ``ParallelMHA``): each rank of
    process_group holds some of the heads (Megatron's split: Wqkv a ColumnParallelLinear,
    out_proj a RowParallelLinear from cuflash.ops.fused_dense) and the attention of its heads
    runs locally; out_proj sums the ranks' shares.

    Arguments as MHA's (self-attention only: no cross_attn, return_residual, fused_bias_fc,
    dwconv), plus process_group and sequence_parallel (default True, as in flash-attn): the
    input is this rank's rows of x (dimension 0, see forward), all-gathered by Wqkv, and the
    output is this rank's rows of the result (out_proj reduce-scatters); without it, x and the
    output are whole on every rank (out_proj all-reduces).

    The split (P ranks): the kv heads by get_dim_for_local_rank(num_heads_kv, P, rank), the
    first ranks one more when P does not divide num_heads_kv, and with each kv head the
    num_heads / num_heads_kv query heads that share it (num_heads_per_rank,
    num_heads_kv_per_rank). Where flash-attn's split works (num_heads_kv a multiple of P, or
    num_heads_kv == num_heads) this is flash-attn's split; flash-attn's GQA with P not dividing
    num_heads_kv gives a rank's Wqkv a size that its forward cannot unpack, and cuflash keeps
    query heads with their kv head instead. num_heads_kv < P (a rank without a kv head)
    raises UnsupportedFeature. Rank r's Wqkv rows are its query heads, then its key heads, then
    its value heads (head_dim rows each); out_proj's columns are its query heads'; its ALiBi
    slopes are those of its query heads in get_alibi_slopes(num_heads) (flash-attn slices by
    ceil(num_heads / P) per rank, which differs for ranks past the remainder of an uneven split).
    shard_mha_state_dict / combine_mha_state_dicts convert to and from MHA's state dict.
    """

    def __init__(self, embed_dim, num_heads, process_group, num_heads_kv=None, qkv_proj_bias=True,
                 out_proj_bias=True, dropout=0.0, softmax_scale=None, causal=False, layer_idx=None,
                 rotary_emb_dim=0, rotary_emb_base=10000.0, rotary_emb_scale_base=None,
                 rotary_emb_interleaved=False, use_alibi=False, window_size=(-1, -1), use_flash_attn=False,
                 checkpointing=False, sequence_parallel=True, device=None, dtype=None, *, alibi_slope_scale=1.0,
                 alibi_train_seqlen=None) -> None:
        from ..ops.fused_dense import ColumnParallelLinear, RowParallelLinear
        from ..utils.distributed import local_range

        super().__init__()
        if process_group is None:
            raise ValueError("process_group must be a torch.distributed process group (the tensor-parallel "
                             "ranks), got None")
        self.process_group = process_group
        self.world_size = torch.distributed.get_world_size(process_group)
        self.local_rank = torch.distributed.get_rank(process_group)
        self.sequence_parallel = sequence_parallel
        self._setup_attention(embed_dim=embed_dim, num_heads=num_heads, num_heads_kv=num_heads_kv, causal=causal,
                              softmax_scale=softmax_scale, dropout=dropout, window_size=window_size,
                              alibi_slopes=None, use_flash_attn=use_flash_attn, rotary_emb_dim=rotary_emb_dim,
                              rotary_emb_base=rotary_emb_base, rotary_emb_scale_base=rotary_emb_scale_base,
                              rotary_emb_interleaved=rotary_emb_interleaved, layer_idx=layer_idx,
                              checkpointing=checkpointing, cross_attn=False, device=device)
        if self.num_heads_kv < self.world_size:
            raise UnsupportedFeature(f"num_heads_kv = {self.num_heads_kv} with {self.world_size} tensor-parallel "
                                     "ranks: every rank needs a kv head of its own (kv heads are not replicated "
                                     "across ranks)")
        group = self.num_heads // self.num_heads_kv
        kv_start, kv_stop = local_range(self.num_heads_kv, self.world_size, self.local_rank)
        self.num_heads_kv_per_rank = kv_stop - kv_start
        self.num_heads_per_rank = group * self.num_heads_kv_per_rank
        self._set_alibi(get_alibi_slopes(num_heads)[group * kv_start:group * kv_stop] if use_alibi else None,
                        alibi_slope_scale, alibi_train_seqlen, device)
        factory = {"device": device, "dtype": dtype}
        d = self.head_dim
        self.Wqkv = ColumnParallelLinear(embed_dim, d * (self.num_heads + 2 * self.num_heads_kv), process_group,
                                         bias=qkv_proj_bias, sequence_parallel=sequence_parallel,
                                         multiple_of=d * (group + 2), **factory)
        self.out_proj = RowParallelLinear(embed_dim, embed_dim, process_group, bias=out_proj_bias,
                                          sequence_parallel=sequence_parallel, multiple_of=d * group, **factory)

    def _local_heads(self) -> tuple:
        return self.num_heads_per_rank, self.num_heads_kv_per_rank

    def forward(self, x, seqlen=None, inference_params=None, **kwargs):
        """x: (batch, seqlen, embed_dim), or (batch · seqlen, embed_dim) with seqlen given (so that
        sequence parallelism can split the batch · seqlen rows when the batch is small). With
        sequence_parallel, x is this rank's rows of that along dimension 0 (the ranks' rows in rank
        order; the row count times P must divide evenly by P again for the reduce-scatter), and so
        is the output. inference_params: decoding with this rank's KV cache (as MHA; layer_idx).
        kwargs go to the inner attention: key_padding_mask, or cu_seqlens (int32, (batch + 1,))
        and max_seqlen with x (total, embed_dim) of packed sequences (use_flash_attn=True; not
        with seqlen). Returns x's shape."""
        key_padding_mask = kwargs.pop("key_padding_mask", None)
        cu_seqlens = kwargs.pop("cu_seqlens", None)
        max_seqlen = kwargs.pop("max_seqlen", None)
        if cu_seqlens is not None and seqlen is not None:
            raise ValueError("seqlen and cu_seqlens exclude each other (cu_seqlens: x is already packed)")
        attn_kwargs = self._attention_kwargs(key_padding_mask, cu_seqlens, max_seqlen, inference_params, kwargs)
        qkv = self.Wqkv(x)
        if seqlen is not None:
            if qkv.dim() != 2 or qkv.shape[0] % seqlen:
                raise ValueError(f"seqlen = {seqlen}: x must be (batch * seqlen, embed_dim) after the all-gather, "
                                 f"got {tuple(qkv.shape[:-1])} rows")
            qkv = qkv.unflatten(0, (-1, seqlen))
        context = self._qkv_context(qkv, inference_params, cu_seqlens, max_seqlen, attn_kwargs).flatten(-2)
        if seqlen is not None:
            context = context.flatten(0, 1)
        return self.out_proj(context)


def _rank_rows(num_heads, num_heads_kv, head_dim, world_size, rank) -> tuple:
    """(Wqkv's row indices, out_proj's column slice) of rank's heads in ParallelMHA's split."""
    from ..utils.distributed import local_range

    group = num_heads // num_heads_kv
    a, b = local_range(num_heads_kv, world_size, rank)
    d = head_dim
    rows = torch.cat([torch.arange(group * a * d, group * b * d),
                      torch.arange((num_heads + a) * d, (num_heads + b) * d),
                      torch.arange((num_heads + num_heads_kv + a) * d, (num_heads + num_heads_kv + b) * d)])
    return rows, slice(group * a * d, group * b * d)


def _head_dim_of(state_dict, prefix, num_heads, num_heads_kv) -> int:
    return state_dict[prefix + "Wqkv.weight"].shape[0] // (num_heads + 2 * num_heads_kv)


def shard_mha_state_dict(state_dict: dict, num_heads: int, num_heads_kv=None, world_size: int = 1, rank: int = 0,
                         prefix: str = "") -> dict:
    """Rank ``rank``'s ParallelMHA state dict from a self-attention MHA's (keys ``prefix`` +
    Wqkv.weight, Wqkv.bias, out_proj.weight, out_proj.bias; other keys pass unchanged): its
    heads' rows of Wqkv, its heads' columns of out_proj.weight, out_proj.bias on rank 0 only.
    Works on any dict of tensors keyed like the parameters (gradients too)."""
    num_heads_kv = num_heads if num_heads_kv is None else num_heads_kv
    d = _head_dim_of(state_dict, prefix, num_heads, num_heads_kv)
    rows, cols = _rank_rows(num_heads, num_heads_kv, d, world_size, rank)
    out = {}
    for key, value in state_dict.items():
        name = key[len(prefix):] if key.startswith(prefix) else None
        if name in ("Wqkv.weight", "Wqkv.bias"):
            out[key] = value[rows.to(value.device)]
        elif name == "out_proj.weight":
            out[key] = value[:, cols]
        elif name == "out_proj.bias":
            if rank == 0:
                out[key] = value
        else:
            out[key] = value
    return out


def combine_mha_state_dicts(state_dicts: list, num_heads: int, num_heads_kv=None, prefix: str = "") -> dict:
    """The MHA state dict (self-attention) whose shards are ``state_dicts`` (rank order): the
    inverse of shard_mha_state_dict."""
    num_heads_kv = num_heads if num_heads_kv is None else num_heads_kv
    world = len(state_dicts)
    d = sum(sd[prefix + "Wqkv.weight"].shape[0] for sd in state_dicts) // (num_heads + 2 * num_heads_kv)
    out = dict(state_dicts[0])
    for name in ("Wqkv.weight", "Wqkv.bias"):
        key = prefix + name
        if key not in state_dicts[0]:
            continue
        first = state_dicts[0][key]
        full = first.new_empty((d * (num_heads + 2 * num_heads_kv), *first.shape[1:]))
        for rank, sd in enumerate(state_dicts):
            full[_rank_rows(num_heads, num_heads_kv, d, world, rank)[0].to(full.device)] = sd[key]
        out[key] = full
    key = prefix + "out_proj.weight"
    out[key] = torch.cat([sd[key] for sd in state_dicts], dim=1)
    return out
