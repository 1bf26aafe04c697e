"""flash-attn's ``flash_attn.ops`` names that cuflash provides: ``cuflash.ops.fused_dense``
(``ColumnParallelLinear``, ``RowParallelLinear``, ``fused_dense_func``: tensor-parallel linear
layers in plain torch). Imports torch; ``import cuflash`` does not import this package."""
