"""flash-attn's ``flash_attn.ops`` names that cuflash provides, as plain torch (not fused kernels):
``cuflash.ops.fused_dense`` (``ColumnParallelLinear``, ``RowParallelLinear``, ``fused_dense_func``:
tensor-parallel linear layers, and ``FusedMLP``), ``cuflash.ops.layer_norm`` (dropout + residual add +
LayerNorm / RMSNorm, flash-attn's ``flash_attn.ops.triton.layer_norm`` and the older
``flash_attn.ops.layer_norm``), ``cuflash.ops.rms_norm`` (the older RMSNorm names),
``cuflash.ops.cross_entropy`` (flash-attn's ``flash_attn.ops.triton.cross_entropy``) and
``cuflash.ops.activations``; ``cuflash.ops.triton`` holds aliases under flash-attn's module paths.
Imports torch; ``import cuflash`` does not import this package."""
