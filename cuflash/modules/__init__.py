"""flash-attn's ``flash_attn.modules`` names that cuflash provides: ``cuflash.modules.mha``
(``MHA``, ``ParallelMHA`` and the inner attention modules). Imports torch; ``import cuflash``
does not import this package."""
