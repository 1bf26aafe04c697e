"""Aliases under flash-attn's ``flash_attn.ops.triton`` paths: ``layer_norm`` is
``cuflash.ops.layer_norm``, ``cross_entropy`` is ``cuflash.ops.cross_entropy`` (torch
compositions; cuflash has no Triton kernels)."""
