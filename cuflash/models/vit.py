"""flash-attn 2.8's Vision Transformer (``flash_attn.models.vit``) on cuflash's modules: ``from
flash_attn.models.vit import VisionTransformer, vit_base_patch16_224`` becomes ``from
cuflash.models.vit import ...``, with flash-attn's constructor arguments and module tree
(``patch_embed.proj``, ``cls_token``, ``pos_embed``, ``blocks.{i}.norm1 / mixer / norm2 / mlp``,
``norm``, ``head``; the last block's mixer is a cross-attention, ``Wq`` / ``Wkv``, with
``global_pool="token"``), so flash-attn's checkpoints load as they are, and timm's
``VisionTransformer`` checkpoints too (``load_state_dict`` renames ``blocks.{i}.attn.qkv`` /
``attn.proj``, flattens the patch ``Conv2d`` weight and splits the last layer's ``Wqkv``).

* ``VisionTransformer(img_size=224, patch_size=16, in_chans=3, num_classes=1000,
  global_pool="token", embed_dim=768, depth=12, num_heads=12, mlp_ratio=4.0, qkv_bias=True,
  init_values=None, class_token=True, no_embed_class=False, pre_norm=False, fc_norm=None,
  drop_rate=0.0, attn_drop_rate=0.0, drop_path_rate=0.0, weight_init="", embed_layer=PatchEmbed,
  norm_layer=None, act_layer=None, use_flash_attn=False, fused_bias_fc=False, fused_mlp=False,
  fused_dropout_add_ln=False, device=None, dtype=None, pool_include_prefix=False)``: patch embedding
  (``cuflash.layers.patch_embed.PatchEmbed``, a linear layer on the patches) → class token and
  position embedding → pre-norm blocks (``cuflash.modules.block.Block``: dropout → add → LayerNorm
  → ``MHA`` (non-causal; ``use_flash_attn``: cuflash's kernels) / ``Mlp``, the residual stream in
  fp32) → dropout → add → final norm → pooling → head. ``forward(x)`` returns the logits
  (batch, num_classes); ``forward_features(x, all_tokens=True)``, ``forward_head(x,
  pre_logits=False)`` as flash-attn's. With ``global_pool="token"`` the forward computes the last
  block for the class token only (its query; keys and values from every token).
* ``vit_base_patch16_224(pretrained=False, **kwargs)``: ViT-B/16.
* ``create_mixer_cls``, ``create_mlp_cls``, ``create_block``: flash-attn's factories.
* ``AttentionPoolLatent``: timm's attention pool with a learned latent query (the "map" head).

Where flash-attn asserts, cuflash accepts (timm's meaning): ``global_pool`` "token", "avg" (mean of
the patch tokens), "max" (their maximum), "avgmax" (the average of the two), "map" (timm's MAP
head, ``attn_pool``, an ``AttentionPoolLatent``: a learned latent query attends over the patch
tokens (one query over all of them, non-causal; cuflash's kernels with ``use_flash_attn``), then
a residual MLP (``Mlp`` with act_layer, also with fused_mlp: timm's pool has its own MLP); timm's
keys ``attn_pool.latent`` / ``q`` / ``kv`` / ``proj`` / ``norm`` / ``mlp.fc1`` / ``mlp.fc2``, so
SigLIP-style timm checkpoints load) or "" (no pooling: the head on every token);
``pool_include_prefix`` (timm's: "map" and the reductions read the class token too);
``class_token=False`` (without "token"); ``no_embed_class`` (the position
embedding covers the patches only; the class token is prepended after); ``pre_norm`` (a LayerNorm
``norm_pre`` before the blocks, the patch projection without bias, as CLIP); ``fc_norm`` (the final
norm after pooling, ``fc_norm``, instead of before: ``norm`` is then an Identity; default: with
"avg" / "max" / "avgmax"); ``init_values`` (timm's LayerScale: every block is a
``LayerScaleBlock``, its attention and MLP outputs times learned per-channel ``ls1.gamma`` /
``ls2.gamma``, initialized to init_values, timm's keys; 0 or None: none); ``weight_init`` "jax",
"jax_nlhb", "moco" (timm's ``init_weights_vit_jax`` / ``_moco``, see ``init_weights``; the attention's
qkv initialized as timm's one matrix also where the last block splits it into Wq / Wkv; the MAP
pool's linear layers as the others, its latent truncated normal, std embed_dim^-0.5, at ±2 std).
Other ``global_pool`` values (timm's "prr") and ``weight_init`` values raise ``ValueError``.
The default init ("") is flash-attn's: the patch projection, a linear layer here, is truncated
normal as every linear layer (timm leaves its Conv2d at torch's default); "jax" and "moco" treat it
as timm treats the Conv2d.

The fused switches: ``fused_dropout_add_ln`` runs cuflash's fused dropout + add + LayerNorm
(``cuflash.ops.layer_norm.layer_norm_fn``, CUDA kernels for CUDA tensors) in every block and before
the head, as flash-attn fuses; ``fused_bias_fc`` runs ``nn.Linear`` (the same parameters;
flash-attn's fused dense GEMM is not part of cuflash); ``fused_mlp`` runs
``cuflash.modules.mlp.FusedMLP`` (tanh GELU, flash-attn's FusedMLP default, in torch).

Pretrained weights: ``pretrained`` (or ``load_pretrained(model, source)``) takes a state dict, a
local checkpoint file (``.safetensors``, read by cuflash's own reader, or a ``torch.save`` file), a
local directory holding one, or a Hugging Face hub model id (e.g. one of timm's ``timm/...`` repos)
read from the local Hugging Face cache and downloaded into it when missing (``cuflash.utils.hub``);
timm is not needed (``pretrained=True``, timm's pick of a default tag, raises
``cuflash.UnsupportedFeature``).
"""
from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Mapping
from functools import partial

import torch
import torch.nn as nn
from torch.nn.init import trunc_normal_

from ..api import UnsupportedFeature
from ..layers.patch_embed import PatchEmbed
from ..modules.block import Block, StochasticDepth
from ..modules.mha import MHA, CrossAttention, FlashCrossAttention
from ..modules.mlp import FusedMLP, Mlp
from ..ops.layer_norm import layer_norm_fn

__all__ = ["VisionTransformer", "vit_base_patch16_224", "create_mixer_cls", "create_mlp_cls", "create_block",
           "LayerScale", "LayerScaleBlock", "AttentionPoolLatent", "init_weights_vit_timm", "init_weights_vit_jax",
           "init_weights_vit_moco", "load_pretrained"]

_POOLS = ("token", "avg", "avgmax", "max", "map", "")
_WEIGHT_INITS = ("", "jax", "jax_nlhb", "moco")


class LayerScale(nn.Module):
    """timm's LayerScale: x times a learned per-channel ``gamma`` (dim,), initialized to
    init_values."""

    def __init__(self, dim, init_values=1e-5, inplace=False, device=None, dtype=None):
        super().__init__()
        self.inplace = inplace
        self.gamma = nn.Parameter(torch.full((dim,), float(init_values), device=device, dtype=dtype))

    def forward(self, x):
        return x.mul_(self.gamma) if self.inplace else x * self.gamma


class LayerScaleBlock(Block):
    """A pre-norm Block with timm's LayerScale on both branches (``ls1`` after the mixer, ``ls2``
    after the MLP, before their dropout / drop path and add: timm's x + drop_path(ls(branch))).
    Arguments as Block's, plus init_values (LayerScale's) and device / dtype (the gammas')."""

    def __init__(self, dim, mixer_cls, mlp_cls, init_values, device=None, dtype=None, **kwargs):
        super().__init__(dim, mixer_cls, mlp_cls, prenorm=True, **kwargs)
        if isinstance(self.mlp, nn.Identity):
            raise ValueError("LayerScaleBlock needs an MLP (mlp_cls making nn.Identity)")
        self.ls1 = LayerScale(dim, init_values, device=device, dtype=dtype)
        self.ls2 = LayerScale(dim, init_values, device=device, dtype=dtype)

    def forward(self, hidden_states, residual=None, mixer_subset=None, mixer_kwargs=None):
        """As Block's (prenorm): returns (ls2(mlp output), residual)."""
        hidden_states, residual = self._prenorm_add(hidden_states, residual, self.dropout1, self.drop_path1,
                                                    self.norm1)
        mixer_kwargs = dict(mixer_kwargs) if mixer_kwargs is not None else {}
        if mixer_subset is not None:
            mixer_kwargs["mixer_subset"] = mixer_subset
            residual = residual[:, mixer_subset]
        hidden_states = self.ls1(self.mixer(hidden_states, **mixer_kwargs))
        hidden_states, residual = self._prenorm_add(hidden_states, residual, self.dropout2, self.drop_path2,
                                                    self.norm2)
        return self.ls2(self.mlp(hidden_states)), residual


def _trunc_normal_tf_fp32_(t, std):
    """timm's trunc_normal_tf_: N(0, 1) truncated to ±2, then times std (bounds ±2 std, unlike
    trunc_normal_'s absolute ±2), drawn in fp32 (see _trunc_normal_fp32_)."""
    return _init_fp32_(t, lambda x: trunc_normal_(x, mean=0.0, std=1.0, a=-2.0, b=2.0).mul_(std))


class AttentionPoolLatent(nn.Module):
    """timm's attention pooling with a learned latent query (``AttentionPoolLatent``, the ViT's
    ``global_pool="map"`` head, SigLIP's): ``latent_len`` learned query tokens ``latent`` (1,
    latent_len, dim) attend over the input tokens through ``q`` (dim → dim) and ``kv`` (dim → 2 ·
    dim, keys then values) in ``num_heads`` heads, non-causal, softmax scale 1 / sqrt(head_dim);
    then ``proj`` (dim → dim), dropout, and a residual MLP on the result, y + mlp(norm(y)) (``mlp``:
    fc1 to int(dim · mlp_ratio) units, act_layer(), fc2); ``pool_type`` "token" returns the first
    latent's output (batch, dim), "avg" their mean, "" all of them (batch, latent_len, dim).
    timm's state_dict keys (``latent``, ``q``, ``kv``, ``proj``, ``norm``, ``mlp.fc1`` /
    ``mlp.fc2``). ``use_flash_attn``: the attention on cuflash's kernels (``FlashCrossAttention``,
    seqlen_q = latent_len over seqlen_k = the tokens; CPU tensors take cuflash's float64-exact
    reference), else ``CrossAttention`` in torch operations. norm_layer: None (timm's default)
    for no norm; the ViT passes its own. Not provided: timm's qk_norm, pos_embed="abs" and
    separate embed_dim / latent_dim / out_features (the ViT uses none of them).

    With use_flash_attn the keys are centered over the tokens before the kernel (``center_keys``,
    an attribute, on by default there): softmax is unchanged by subtracting q · mean(k) from a
    row, but FlashAttention-2's backward forms D = rowsum(dO ∘ O) from the rounded O and dS in
    bf16, and a key mean shared by every token (kv's bias) multiplies that rounding into dq; with
    one query over near-uniform scores (the latent at its init) dq is small and the latent's
    gradient error reached 1.6-4.3x the plain bf16 pool's on an H200 (centered: 0.5-1.0x;
    tests/attention_pool_dq_diag.py)."""

    def __init__(self, dim, num_heads=8, mlp_ratio=4.0, qkv_bias=True, latent_len=1, pool_type="token",
                 norm_layer=None, act_layer=nn.GELU, drop=0.0, use_flash_attn=False, device=None, dtype=None):
        super().__init__()
        for name, value in (("dim", dim), ("num_heads", num_heads), ("latent_len", latent_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if dim % num_heads:
            raise ValueError(f"dim = {dim} must be divisible by num_heads = {num_heads}")
        if (not isinstance(mlp_ratio, (int, float)) or isinstance(mlp_ratio, bool) or not math.isfinite(mlp_ratio)
                or int(dim * mlp_ratio) <= 0):
            raise ValueError(f"mlp_ratio must be a finite number with int(dim * mlp_ratio) >= 1, got {mlp_ratio!r}")
        if pool_type not in ("token", "avg", ""):
            raise ValueError(f"pool_type must be one of ['token', 'avg', ''], got {pool_type!r}")
        factory = {k: v for k, v in dict(device=device, dtype=dtype).items() if v is not None}
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.latent_len, self.latent_dim, self.pool = latent_len, dim, pool_type
        self.use_flash_attn = use_flash_attn
        self.center_keys = bool(use_flash_attn)
        self.latent = nn.Parameter(torch.zeros(1, latent_len, dim, **factory))
        self.q = nn.Linear(dim, dim, bias=qkv_bias, **factory)
        self.kv = nn.Linear(dim, 2 * dim, bias=qkv_bias, **factory)
        self.inner_attn = FlashCrossAttention() if use_flash_attn else CrossAttention()
        self.proj = nn.Linear(dim, dim, **factory)
        self.proj_drop = nn.Dropout(drop)
        self.norm = norm_layer(dim, **factory) if norm_layer is not None else nn.Identity()
        self.mlp = Mlp(dim, hidden_features=int(dim * mlp_ratio), activation=act_layer(), **factory)
        self.init_weights()

    def init_weights(self):
        """timm's: the latent truncated normal at ±2 std, std latent_dim^-0.5 (the linear layers
        are left to the caller's init, as in timm)."""
        _trunc_normal_tf_fp32_(self.latent, std=self.latent_dim ** -0.5)

    def forward(self, x):
        """x: (batch, tokens, dim) → (batch, dim) (pool_type "token" / "avg") or (batch,
        latent_len, dim) (pool_type "")."""
        if x.dim() != 3 or x.shape[-1] != self.dim or x.shape[1] == 0:
            raise ValueError(f"x must be (batch, tokens >= 1, dim = {self.dim}), got {tuple(x.shape)}")
        batch, tokens = x.shape[:2]
        # the latent projected once and broadcast over the batch (timm projects the expanded latent:
        # the same rows, up to the GEMM's rounding)
        q = self.q(self.latent).reshape(1, self.latent_len, self.num_heads, self.head_dim)
        q = q.expand(batch, -1, -1, -1).contiguous()
        kv = self.kv(x)
        if self.center_keys:          # the same softmax; see the class docstring (in fp32 at least)
            k, v = kv.split(self.dim, dim=-1)
            wide = k.to(torch.promote_types(k.dtype, torch.float32))
            kv = torch.cat(((wide - wide.mean(dim=1, keepdim=True)).to(k.dtype), v), dim=-1)
        kv = kv.reshape(batch, tokens, 2, self.num_heads, self.head_dim)
        y = self.inner_attn(q, kv).reshape(batch, self.latent_len, self.dim)
        y = self.proj_drop(self.proj(y))
        y = y + self.mlp(self.norm(y))
        if self.pool == "token":
            return y[:, 0]
        return y.mean(dim=1) if self.pool == "avg" else y


def create_mixer_cls(num_heads, qkv_bias, attn_drop, use_flash_attn, fused_bias_fc, cross_attn=False,
                     device=None, dtype=None):
    """flash-attn's: a ``partial`` of non-causal MHA (fused_bias_fc: the same nn.Linear
    projections)."""
    return partial(MHA, num_heads=num_heads, cross_attn=cross_attn, qkv_proj_bias=qkv_bias, dropout=attn_drop,
                   use_flash_attn=use_flash_attn, device=device, dtype=dtype)


def create_mlp_cls(embed_dim, mlp_ratio, act_layer, fused_mlp, device=None, dtype=None):
    """flash-attn's: Mlp of int(embed_dim · mlp_ratio) hidden units with act_layer(), or FusedMLP."""
    inner = int(embed_dim * mlp_ratio)
    if fused_mlp:
        return partial(FusedMLP, hidden_features=inner, device=device, dtype=dtype)
    return partial(Mlp, hidden_features=inner, activation=act_layer(), device=device, dtype=dtype)


def create_block(embed_dim, num_heads, mlp_ratio, qkv_bias, drop_rate, attn_drop_rate, drop_path1, drop_path2,
                 norm_layer, act_layer, use_flash_attn, fused_bias_fc, fused_mlp, fused_dropout_add_ln,
                 layer_idx=None, n_layer=None, last_layer_subset=False, device=None, dtype=None, *,
                 init_values=None):
    """flash-attn's: a pre-norm Block with the residual in fp32; the last layer's mixer a
    cross-attention with last_layer_subset. init_values (cuflash's, keyword-only): a
    LayerScaleBlock."""
    factory = {k: v for k, v in dict(device=device, dtype=dtype).items() if v is not None}
    mixer_cls = create_mixer_cls(num_heads, qkv_bias, attn_drop_rate, use_flash_attn, fused_bias_fc,
                                 cross_attn=last_layer_subset and layer_idx == n_layer - 1, **factory)
    mlp_cls = create_mlp_cls(embed_dim, mlp_ratio, act_layer, fused_mlp, **factory)
    common = dict(norm_cls=partial(norm_layer, **factory), resid_dropout1=drop_rate, resid_dropout2=drop_rate,
                  drop_path1=drop_path1, drop_path2=drop_path2, fused_dropout_add_ln=fused_dropout_add_ln,
                  residual_in_fp32=True)
    if init_values is not None:
        return LayerScaleBlock(embed_dim, mixer_cls, mlp_cls, init_values, **factory, **common)
    return Block(embed_dim, mixer_cls, mlp_cls, prenorm=True, **common)


def _trunc_normal_fp32_(t, std=0.02):
    """trunc_normal_(t, std) (bounds ±2, timm's) drawn in fp32 and copied into t: drawn in bf16 /
    fp16 on the GPU, about 1 in 500 of the uniform samples rounds to ±1, which erfinv turns into
    ±inf and the clamp into ±2 (100 standard deviations)."""
    if t.dtype in (torch.float32, torch.float64):
        return trunc_normal_(t, std=std)
    with torch.no_grad():
        return t.copy_(trunc_normal_(torch.empty(t.shape, dtype=torch.float32, device=t.device), std=std))


def _init_fp32_(t, fn):
    """fn drawn on an fp32 tensor of t's shape and copied into t (see _trunc_normal_fp32_)."""
    with torch.no_grad():
        if t.dtype in (torch.float32, torch.float64):
            return fn(t)
        return t.copy_(fn(torch.empty(t.shape, dtype=torch.float32, device=t.device)))


def _lecun_normal_(t):
    """timm's lecun_normal_ (variance scaling, fan_in, truncated normal): N(0, 1) truncated to
    ±2, times sqrt(1 / fan_in) / 0.8796 (the truncation's standard deviation). fan_in: the
    input features (the patch Conv2d's in_chans · patch²)."""
    std = math.sqrt(1.0 / t.shape[1]) / 0.87962566103423978
    return _init_fp32_(t, lambda x: trunc_normal_(x, mean=0.0, std=1.0, a=-2.0, b=2.0).mul_(std))


def _uniform_(t, bound):
    return _init_fp32_(t, lambda x: nn.init.uniform_(x, -bound, bound))


_SPLIT_QKV = ("mixer.Wq", "mixer.Wkv")      # the last block's cross-attention: timm's qkv rows split in two


def init_weights_vit_timm(module: nn.Module, name: str = "") -> None:
    """timm's original ViT init: linear weights truncated normal (std 0.02, drawn in fp32), biases
    zero."""
    if isinstance(module, nn.Linear):
        _trunc_normal_fp32_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


def init_weights_vit_jax(module: nn.Module, name: str = "", head_bias: float = 0.0, embed_dim=None) -> None:
    """timm's JAX (big_vision) init: the head zero with bias head_bias; the patch projection
    (timm's Conv2d) lecun normal, bias zero; every other linear weight xavier uniform (the
    attention's qkv as one (3 · embed_dim, embed_dim) matrix, also when split into Wq / Wkv),
    biases normal (std 1e-6) in the MLP and zero elsewhere."""
    if not isinstance(module, nn.Linear):
        return
    with torch.no_grad():
        if name.startswith("head"):
            nn.init.zeros_(module.weight)
            if module.bias is not None:
                nn.init.constant_(module.bias, head_bias)
            return
        if name == "patch_embed.proj":
            _lecun_normal_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
            return
        fan_in, fan_out = module.weight.shape[1], module.weight.shape[0]
        if embed_dim is not None and name.endswith(_SPLIT_QKV):
            fan_out = 3 * embed_dim
        _uniform_(module.weight, math.sqrt(6.0 / (fan_in + fan_out)))
        if module.bias is not None:
            if "mlp" in name:
                _init_fp32_(module.bias, lambda x: nn.init.normal_(x, std=1e-6))
            else:
                nn.init.zeros_(module.bias)


def init_weights_vit_moco(module: nn.Module, name: str = "", embed_dim=None) -> None:
    """timm's MoCo v3 init: the qkv weights uniform ±sqrt(6 / (embed_dim + fan_in)) (Q, K, V
    each as its own matrix), every other linear weight xavier uniform, biases zero; the patch
    projection keeps torch's default (timm's Conv2d is left alone: kaiming uniform (a = √5), bias
    uniform ±1 / sqrt(fan_in), which nn.Linear's reset_parameters draws on the same fan-in)."""
    if not isinstance(module, nn.Linear):
        return
    if name == "patch_embed.proj":
        module.reset_parameters()
        return
    fan_in, fan_out = module.weight.shape[1], module.weight.shape[0]
    if embed_dim is not None and name.endswith(_SPLIT_QKV):
        bound = math.sqrt(6.0 / float(embed_dim + fan_in))
    elif "qkv" in name:
        bound = math.sqrt(6.0 / float(fan_out // 3 + fan_in))
    else:
        bound = math.sqrt(6.0 / (fan_in + fan_out))
    _uniform_(module.weight, bound)
    if module.bias is not None:
        with torch.no_grad():
            nn.init.zeros_(module.bias)


class VisionTransformer(nn.Module):
    """See the module docstring."""

    def __init__(self, img_size=224, patch_size=16, in_chans=3, num_classes=1000, global_pool="token", embed_dim=768,
                 depth=12, num_heads=12, mlp_ratio=4.0, qkv_bias=True, init_values=None, class_token=True,
                 no_embed_class=False, pre_norm=False, fc_norm=None, drop_rate=0.0, attn_drop_rate=0.0,
                 drop_path_rate=0.0, weight_init="", embed_layer=PatchEmbed, norm_layer=None, act_layer=None,
                 use_flash_attn=False, fused_bias_fc=False, fused_mlp=False, fused_dropout_add_ln=False, device=None,
                 dtype=None, pool_include_prefix=False):
        super().__init__()
        # only the keywords given, so a norm_layer / embed_layer without device / dtype still works
        factory = {k: v for k, v in dict(device=device, dtype=dtype).items() if v is not None}
        if global_pool not in _POOLS:
            raise ValueError(f"global_pool must be one of {list(_POOLS)}, got {global_pool!r}")
        if global_pool == "token" and not class_token:
            raise ValueError("global_pool='token' needs class_token=True")
        if init_values is not None and (not isinstance(init_values, (int, float)) or isinstance(init_values, bool)
                                        or not math.isfinite(init_values)):
            raise ValueError(f"init_values must be None or a finite number (LayerScale's initial gamma), got "
                             f"{init_values!r}")
        init_values = init_values or None       # timm: 0 / None → no LayerScale
        if weight_init not in _WEIGHT_INITS:
            raise ValueError(f"weight_init must be one of {list(_WEIGHT_INITS)}, got {weight_init!r}")
        for name, value in (("depth", depth), ("num_heads", num_heads), ("embed_dim", embed_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim = {embed_dim} must be divisible by num_heads = {num_heads}")
        if not isinstance(num_classes, int) or num_classes < 0:
            raise ValueError(f"num_classes must be an int >= 0, got {num_classes!r}")
        use_fc_norm = global_pool in ("avg", "avgmax", "max") if fc_norm is None else bool(fc_norm)
        norm_layer = norm_layer or partial(nn.LayerNorm, eps=1e-6)
        act_layer = act_layer or nn.GELU

        self.num_classes = num_classes
        self.global_pool = global_pool
        self.num_features = self.embed_dim = embed_dim
        self.num_prefix_tokens = 1 if class_token else 0
        self.pool_include_prefix = bool(pool_include_prefix)
        self.no_embed_class = no_embed_class
        self.fused_dropout_add_ln = fused_dropout_add_ln
        extra = {"fused_bias_fc": fused_bias_fc, **factory} if embed_layer is PatchEmbed else {}
        self.patch_embed = embed_layer(img_size=img_size, patch_size=patch_size, in_chans=in_chans,
                                       embed_dim=embed_dim, bias=not pre_norm, **extra)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim, **factory)) if class_token else None
        embed_len = num_patches if no_embed_class else num_patches + self.num_prefix_tokens
        self.pos_embed = nn.Parameter(torch.zeros(1, embed_len, embed_dim, **factory))
        self.norm_pre = norm_layer(embed_dim, **factory) if pre_norm else nn.Identity()
        dpr = torch.linspace(0, drop_path_rate, depth).tolist()      # stochastic depth decay rule
        # flash-attn's order: dropout → add → norm → mixer / MLP, so block i's drop_path1 is the
        # previous block's MLP branch (dpr[i - 1]) and drop_path2 its own attention branch (dpr[i])
        self.blocks = nn.ModuleList([
            create_block(embed_dim, num_heads, mlp_ratio, qkv_bias, drop_rate, attn_drop_rate,
                         drop_path1=dpr[i - 1] if i > 0 else 0.0, drop_path2=dpr[i], norm_layer=norm_layer,
                         act_layer=act_layer, use_flash_attn=use_flash_attn, fused_bias_fc=fused_bias_fc,
                         fused_mlp=fused_mlp, fused_dropout_add_ln=fused_dropout_add_ln, layer_idx=i, n_layer=depth,
                         last_layer_subset=global_pool == "token", **factory, init_values=init_values)
            for i in range(depth)])
        self.dropout = nn.Dropout(p=drop_rate)
        self.drop_path = StochasticDepth(p=dpr[-1], mode="row")
        self.norm = norm_layer(embed_dim, **factory) if not use_fc_norm else nn.Identity()
        # timm's MAP head: the blocks' heads, mlp_ratio, norm and activation; q / kv with bias whatever qkv_bias
        self.attn_pool = AttentionPoolLatent(embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio,
                                             norm_layer=norm_layer, act_layer=act_layer,
                                             use_flash_attn=use_flash_attn, **factory) if global_pool == "map" else None
        self.fc_norm = norm_layer(embed_dim, **factory) if use_fc_norm else nn.Identity()
        self.head = nn.Linear(embed_dim, num_classes, **factory) if num_classes > 0 else nn.Identity()
        self.init_weights(weight_init)

    def init_weights(self, mode=""):
        """timm's: pos_embed truncated normal (std 0.02), cls_token normal (std 1e-6), the linear
        layers by mode: "" init_weights_vit_timm, "jax" / "jax_nlhb" init_weights_vit_jax (head
        bias 0 / -log(num_classes)), "moco" init_weights_vit_moco (the MAP pool's q / kv / proj /
        mlp as any linear layer; its latent by AttentionPoolLatent.init_weights). LayerScale's
        gammas and the norms are left as they are (timm's)."""
        if mode not in _WEIGHT_INITS:
            raise ValueError(f"weight_init must be one of {list(_WEIGHT_INITS)}, got {mode!r}")
        _trunc_normal_fp32_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        if mode == "":
            fn = init_weights_vit_timm
        elif mode.startswith("jax"):
            head_bias = -math.log(self.num_classes) if mode == "jax_nlhb" and self.num_classes > 0 else 0.0
            fn = partial(init_weights_vit_jax, head_bias=head_bias, embed_dim=self.embed_dim)
        else:
            fn = partial(init_weights_vit_moco, embed_dim=self.embed_dim)
        for name, module in self.named_modules():
            fn(module, name)
        if self.attn_pool is not None:       # timm: the pool's own init_weights (its latent) after its linears
            self.attn_pool.init_weights()

    def _init_weights(self, m):
        init_weights_vit_timm(m)

    @torch.jit.ignore
    def no_weight_decay(self):
        return {"pos_embed", "cls_token"}

    def _pos_embed(self, x):
        if self.no_embed_class:       # the position embedding for the patches only (DeiT-3, big_vision)
            x = x + self.pos_embed
            if self.cls_token is not None:
                x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
            return x
        if self.cls_token is not None:
            x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        return x + self.pos_embed

    def forward_features(self, x, all_tokens=True):
        """x: (batch, in_chans, H, W) images. Returns the normed features (batch, tokens,
        embed_dim); with global_pool="token" and all_tokens=False the class token's only
        (batch, 1, embed_dim)."""
        hidden_states = self.norm_pre(self._pos_embed(self.patch_embed(x)))
        residual = None
        subset = self.global_pool == "token" and not all_tokens
        for block in self.blocks[:-1]:
            hidden_states, residual = block(hidden_states, residual)
        # the class token's query only (cross-attention to every token) when only it is needed
        hidden_states, residual = self.blocks[-1](hidden_states, residual,
                                                  mixer_subset=slice(0, 1) if subset else None)
        if isinstance(self.norm, nn.Identity):       # fc_norm: the norm comes after the pooling
            return (self.drop_path(self.dropout(hidden_states)) + residual).to(hidden_states.dtype)
        if not self.fused_dropout_add_ln:
            residual = self.drop_path(self.dropout(hidden_states)) + residual
            return self.norm(residual.to(dtype=self.norm.weight.dtype))
        rowscale = None
        if self.training and self.drop_path.p > 0:
            rowscale = self.drop_path(torch.ones(hidden_states.shape[:-1], device=hidden_states.device,
                                                 dtype=hidden_states.dtype))
        return layer_norm_fn(hidden_states, self.norm.weight, self.norm.bias, residual=residual, eps=self.norm.eps,
                             dropout_p=self.dropout.p if self.training else 0.0, rowscale=rowscale, prenorm=False,
                             residual_in_fp32=True)

    def forward_head(self, x, pre_logits: bool = False):
        """Pooling (class token; the MAP attention pool; mean, max or their average of the patch
        tokens; or none), fc_norm, then the head (skipped with pre_logits). The pool and the
        reductions read the patch tokens only, or every token with pool_include_prefix (timm's)."""
        if self.global_pool == "token":
            x = x[:, 0]
        elif self.global_pool:
            tokens = x if self.pool_include_prefix else x[:, self.num_prefix_tokens:]
            if self.global_pool == "map":
                x = self.attn_pool(tokens)
            elif self.global_pool == "avg":
                x = tokens.mean(dim=1)
            elif self.global_pool == "max":
                x = tokens.amax(dim=1)
            else:                        # "avgmax"
                x = 0.5 * (tokens.amax(dim=1) + tokens.mean(dim=1))
        x = self.fc_norm(x)
        return x if pre_logits else self.head(x)

    def forward(self, x):
        """x: (batch, in_chans, H, W) images → logits (batch, num_classes) (global_pool "":
        (batch, tokens, num_classes))."""
        return self.forward_head(self.forward_features(x, all_tokens=False))

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """nn.Module's, also taking timm's ViT keys: ``blocks.{i}.attn.qkv`` / ``attn.proj`` →
        ``mixer.Wqkv`` / ``mixer.out_proj``, the patch Conv2d weight (embed_dim, in_chans, p, p)
        flattened, and the last block's Wqkv split into Wq / Wkv when that block is a
        cross-attention (global_pool="token"). The given dict is not modified."""
        if not isinstance(state_dict, Mapping):
            raise ValueError(f"state_dict must be a mapping of tensors, got {type(state_dict).__name__}")
        sd = OrderedDict()
        for key, value in state_dict.items():
            key = re.sub(r"^blocks\.(\d+)\.attn\.qkv\.", r"blocks.\1.mixer.Wqkv.", key)
            key = re.sub(r"^blocks\.(\d+)\.attn\.proj\.", r"blocks.\1.mixer.out_proj.", key)
            sd[key] = value
        w = sd.get("patch_embed.proj.weight")
        if w is not None and w.dim() == 4:
            sd["patch_embed.proj.weight"] = w.flatten(1)
        last = f"blocks.{len(self.blocks) - 1}.mixer."
        if self.blocks[-1].mixer.cross_attn:
            for kind in ("weight", "bias"):
                wqkv = sd.pop(last + f"Wqkv.{kind}", None)
                if wqkv is not None:
                    sd[last + f"Wq.{kind}"], sd[last + f"Wkv.{kind}"] = wqkv[:self.embed_dim], wqkv[self.embed_dim:]
        return super().load_state_dict(sd, strict=strict, assign=assign)


def load_pretrained(model: VisionTransformer, source, strict=True, revision="main", token=None, cache_dir=None,
                    local_files_only=False):
    """Loads ``source`` into ``model``: a state dict, a local checkpoint file (``.safetensors`` or
    a ``torch.save`` file), a local directory holding one (``model.safetensors``,
    ``pytorch_model.bin`` or their sharded indexes), or a Hugging Face hub model id (through the
    local Hugging Face cache, downloaded into it when missing: ``cuflash.utils.hub``). Returns the
    model."""
    from ._checkpoint import load_state_dict_from

    state_dict = source if isinstance(source, Mapping) else load_state_dict_from(
        source, "load_pretrained", revision=revision, token=token, cache_dir=cache_dir,
        local_files_only=local_files_only)
    model.load_state_dict(state_dict, strict=strict)
    return model


def vit_base_patch16_224(pretrained=False, **kwargs):
    """ViT-B/16 (Dosovitskiy et al. 2021): patch 16, embed_dim 768, depth 12, 12 heads, 224 × 224
    images. pretrained: False, or the weights (see load_pretrained: a state dict, a local file or
    directory, or a hub model id); True (timm's choice of default weights) raises
    cuflash.UnsupportedFeature."""
    if pretrained is True:
        raise UnsupportedFeature("vit_base_patch16_224(pretrained=True): timm's choice of default weights is not part "
                                 "of cuflash; pass pretrained=<state dict, local file or directory, or a Hugging Face "
                                 "hub model id of the weights>")
    model = VisionTransformer(**{**dict(patch_size=16, embed_dim=768, depth=12, num_heads=12), **kwargs})
    if pretrained is not False and pretrained is not None:
        load_pretrained(model, pretrained)
    return model
