"""flash-attn's ``flash_attn.modules`` names that cuflash provides: ``cuflash.modules.mha``
(``MHA``, ``ParallelMHA`` and the inner attention modules), ``cuflash.modules.mlp`` (``Mlp``,
``GatedMlp``, ``FusedMLP`` and their ``Parallel`` forms), ``cuflash.modules.block`` (``Block``,
``ParallelBlock``) and ``cuflash.modules.embedding`` (``GPT2Embeddings`` and its tensor-parallel
forms). Imports torch; ``import cuflash`` does not import this package."""
