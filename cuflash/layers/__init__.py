"""flash-attn's ``flash_attn.layers`` names that cuflash provides: ``cuflash.layers.rotary``
(rotary position embeddings) and ``cuflash.layers.patch_embed`` (ViT's patch embedding). Imports
torch; ``import cuflash`` does not import this package."""
