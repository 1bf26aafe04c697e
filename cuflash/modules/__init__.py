"""flash-attn's ``flash_attn.modules`` names that cuflash provides: ``cuflash.modules.mha``
(``MHA``, ``ParallelMHA`` and the inner attention modules), ``cuflash.modules.mlp`` (``Mlp``,
``GatedMlp``, ``FusedMLP`` and their ``Parallel`` forms) and ``cuflash.modules.block`` (``Block``, ``ParallelBlock``). Imports torch; ``import cuflash``
does not import this package."""
