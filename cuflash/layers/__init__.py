"""flash-attn's ``flash_attn.layers`` names that cuflash provides: ``cuflash.layers.rotary``
(rotary position embeddings). Imports torch; ``import cuflash`` does not import this package."""
