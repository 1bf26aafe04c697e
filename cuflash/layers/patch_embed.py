"""flash-attn 2.8's ``flash_attn.layers.patch_embed.PatchEmbed`` (timm's patch-embedding API):
``from flash_attn.layers.patch_embed import PatchEmbed`` becomes ``from
cuflash.layers.patch_embed import PatchEmbed``.

``PatchEmbed(img_size=224, patch_size=16, in_chans=3, embed_dim=768, norm_layer=None,
flatten=True, bias=True, fused_bias_fc=False)``: the image (batch, in_chans, H, W) cut into
non-overlapping patch_size patches, each patch's pixels (channel, row, column order) through one
``nn.Linear`` (``proj``: the same weights as timm's stride-patch ``Conv2d``, its
(embed_dim, in_chans, p, p) weight flattened to (embed_dim, in_chans · p · p)), then
``norm_layer``; (batch, grid_h · grid_w, embed_dim) with ``flatten``, else (batch, grid_h, grid_w,
embed_dim). ``fused_bias_fc`` runs the same ``nn.Linear`` (flash-attn's fused dense GEMM + bias is
not part of cuflash). An image of another size raises ``ValueError`` naming the sizes (flash-attn
asserts).
"""
from __future__ import annotations

import torch.nn as nn
from torch.nn.modules.utils import _pair

__all__ = ["PatchEmbed"]


class PatchEmbed(nn.Module):
    """See the module docstring. Attributes: img_size, patch_size, grid_size, num_patches,
    flatten, proj, norm."""

    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=768, norm_layer=None, flatten=True,
                 bias=True, fused_bias_fc=False, device=None, dtype=None):
        super().__init__()
        self.img_size, self.patch_size = _pair(img_size), _pair(patch_size)
        for name, pair in (("img_size", self.img_size), ("patch_size", self.patch_size)):
            if not all(isinstance(v, int) and v > 0 for v in pair):
                raise ValueError(f"{name} must be a positive int or a pair of them, got {pair!r}")
        if any(i % p for i, p in zip(self.img_size, self.patch_size)):
            raise ValueError(f"img_size {self.img_size} must be a multiple of patch_size {self.patch_size}")
        self.grid_size = (self.img_size[0] // self.patch_size[0], self.img_size[1] // self.patch_size[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.flatten = flatten
        self.proj = nn.Linear(in_chans * self.patch_size[0] * self.patch_size[1], embed_dim, bias=bias,
                              device=device, dtype=dtype)
        self.norm = norm_layer(embed_dim) if norm_layer else nn.Identity()

    def forward(self, x):
        """x: (batch, in_chans, H, W) with (H, W) = img_size."""
        if x.dim() != 4 or tuple(x.shape[2:]) != self.img_size:
            raise ValueError(f"PatchEmbed: the input must be (batch, channels, {self.img_size[0]}, "
                             f"{self.img_size[1]}) images, got shape {tuple(x.shape)}")
        b, c = x.shape[:2]
        (gh, gw), (ph, pw) = self.grid_size, self.patch_size
        # (b, c, gh, ph, gw, pw) → (b, gh, gw, c, ph, pw): each patch's pixels in the conv weight's order
        patches = x.reshape(b, c, gh, ph, gw, pw).permute(0, 2, 4, 1, 3, 5).reshape(b, gh, gw, c * ph * pw)
        x = self.proj(patches)
        if self.flatten:
            x = x.flatten(1, 2)
        return self.norm(x)
