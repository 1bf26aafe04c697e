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
  fused_dropout_add_ln=False, device=None, dtype=None)``: patch embedding
  (``cuflash.layers.patch_embed.PatchEmbed``, a linear layer on the patches) → class token and
  position embedding → pre-norm blocks (``cuflash.modules.block.Block``: dropout → add → LayerNorm
  → ``MHA`` (non-causal; ``use_flash_attn``: cuflash's kernels) / ``Mlp``, the residual stream in
  fp32) → dropout → add → final norm → pooling → head. ``forward(x)`` returns the logits
  (batch, num_classes); ``forward_features(x, all_tokens=True)``, ``forward_head(x,
  pre_logits=False)`` as flash-attn's. With ``global_pool="token"`` the forward computes the last
  block for the class token only (its query; keys and values from every token).
* ``vit_base_patch16_224(pretrained=False, **kwargs)``: ViT-B/16.
* ``create_mixer_cls``, ``create_mlp_cls``, ``create_block``: flash-attn's factories.

Where flash-attn asserts, cuflash accepts (timm's meaning): ``global_pool`` "token", "avg" (mean of
the patch tokens) or "" (no pooling: the head on every token); ``class_token=False`` (with
"avg" / ""); ``no_embed_class`` (the position embedding covers the patches only; the class token
is prepended after); ``pre_norm`` (a LayerNorm ``norm_pre`` before the blocks, the patch
projection without bias, as CLIP); ``fc_norm`` (the final norm after pooling, ``fc_norm``, instead
of before: ``norm`` is then an Identity; default: with "avg"). Not provided: ``init_values``
(LayerScale) and ``weight_init`` other than "" raise ``cuflash.UnsupportedFeature``; a
``global_pool`` other than the three raises ``ValueError``.

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
from ..modules.mha import MHA
from ..modules.mlp import FusedMLP, Mlp
from ..ops.layer_norm import layer_norm_fn

__all__ = ["VisionTransformer", "vit_base_patch16_224", "create_mixer_cls", "create_mlp_cls", "create_block",
           "init_weights_vit_timm", "load_pretrained"]

_POOLS = ("token", "avg", "")


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
                 layer_idx=None, n_layer=None, last_layer_subset=False, device=None, dtype=None):
    """flash-attn's: a pre-norm Block with the residual in fp32; the last layer's mixer a
    cross-attention with last_layer_subset."""
    factory = {k: v for k, v in dict(device=device, dtype=dtype).items() if v is not None}
    mixer_cls = create_mixer_cls(num_heads, qkv_bias, attn_drop_rate, use_flash_attn, fused_bias_fc,
                                 cross_attn=last_layer_subset and layer_idx == n_layer - 1, **factory)
    mlp_cls = create_mlp_cls(embed_dim, mlp_ratio, act_layer, fused_mlp, **factory)
    return Block(embed_dim, mixer_cls, mlp_cls, norm_cls=partial(norm_layer, **factory), prenorm=True,
                 resid_dropout1=drop_rate, resid_dropout2=drop_rate, drop_path1=drop_path1, drop_path2=drop_path2,
                 fused_dropout_add_ln=fused_dropout_add_ln, residual_in_fp32=True)


def _trunc_normal_fp32_(t, std=0.02):
    """trunc_normal_(t, std) (bounds ±2, timm's) drawn in fp32 and copied into t: drawn in bf16 /
    fp16 on the GPU, about 1 in 500 of the uniform samples rounds to ±1, which erfinv turns into
    ±inf and the clamp into ±2 (100 standard deviations)."""
    if t.dtype in (torch.float32, torch.float64):
        return trunc_normal_(t, std=std)
    with torch.no_grad():
        return t.copy_(trunc_normal_(torch.empty(t.shape, dtype=torch.float32, device=t.device), std=std))


def init_weights_vit_timm(module: nn.Module, name: str = "") -> None:
    """timm's original ViT init: linear weights truncated normal (std 0.02, drawn in fp32), biases
    zero."""
    if isinstance(module, nn.Linear):
        _trunc_normal_fp32_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


class VisionTransformer(nn.Module):
    """See the module docstring."""

    def __init__(self, img_size=224, patch_size=16, in_chans=3, num_classes=1000, global_pool="token", embed_dim=768,
                 depth=12, num_heads=12, mlp_ratio=4.0, qkv_bias=True, init_values=None, class_token=True,
                 no_embed_class=False, pre_norm=False, fc_norm=None, drop_rate=0.0, attn_drop_rate=0.0,
                 drop_path_rate=0.0, weight_init="", embed_layer=PatchEmbed, norm_layer=None, act_layer=None,
                 use_flash_attn=False, fused_bias_fc=False, fused_mlp=False, fused_dropout_add_ln=False, device=None,
                 dtype=None):
        super().__init__()
        # only the keywords given, so a norm_layer / embed_layer without device / dtype still works
        factory = {k: v for k, v in dict(device=device, dtype=dtype).items() if v is not None}
        if global_pool not in _POOLS:
            raise ValueError(f"global_pool must be one of {list(_POOLS)}, got {global_pool!r}")
        if global_pool == "token" and not class_token:
            raise ValueError("global_pool='token' needs class_token=True")
        if init_values is not None:
            raise UnsupportedFeature(f"init_values={init_values!r}: LayerScale is not part of cuflash's ViT (nor of "
                                     "flash-attn's)")
        if weight_init != "":
            raise UnsupportedFeature(f"weight_init={weight_init!r}: only timm's default init ('') is provided")
        for name, value in (("depth", depth), ("num_heads", num_heads), ("embed_dim", embed_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim = {embed_dim} must be divisible by num_heads = {num_heads}")
        if not isinstance(num_classes, int) or num_classes < 0:
            raise ValueError(f"num_classes must be an int >= 0, got {num_classes!r}")
        use_fc_norm = global_pool == "avg" if fc_norm is None else bool(fc_norm)
        norm_layer = norm_layer or partial(nn.LayerNorm, eps=1e-6)
        act_layer = act_layer or nn.GELU

        self.num_classes = num_classes
        self.global_pool = global_pool
        self.num_features = self.embed_dim = embed_dim
        self.num_prefix_tokens = 1 if class_token else 0
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
                         last_layer_subset=global_pool == "token", **factory)
            for i in range(depth)])
        self.dropout = nn.Dropout(p=drop_rate)
        self.drop_path = StochasticDepth(p=dpr[-1], mode="row")
        self.norm = norm_layer(embed_dim, **factory) if not use_fc_norm else nn.Identity()
        self.fc_norm = norm_layer(embed_dim, **factory) if use_fc_norm else nn.Identity()
        self.head = nn.Linear(embed_dim, num_classes, **factory) if num_classes > 0 else nn.Identity()
        self.init_weights(weight_init)

    def init_weights(self, mode=""):
        """timm's: pos_embed truncated normal (std 0.02), cls_token normal (std 1e-6), the linear
        layers by init_weights_vit_timm."""
        if mode != "":
            raise UnsupportedFeature(f"weight_init={mode!r}: only timm's default init ('') is provided")
        _trunc_normal_fp32_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        self.apply(init_weights_vit_timm)

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
        """Pooling (class token, mean of the patch tokens, or none), fc_norm, then the head
        (skipped with pre_logits)."""
        if self.global_pool == "avg":
            x = x[:, self.num_prefix_tokens:].mean(dim=1)
        elif self.global_pool == "token":
            x = x[:, 0]
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
