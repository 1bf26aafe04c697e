"""Aliases under flash-attn's ``flash_attn.ops.triton`` paths (cuflash has no Triton kernels):
``layer_norm`` is ``cuflash.ops.layer_norm``, ``cross_entropy`` is ``cuflash.ops.cross_entropy``;
``mlp`` (``FusedDenseSqreluDense``), ``linear`` (``triton_linear_act``, ``triton_dgrad_act``) run
``cuflash.ops.fused_dense``'s fused MLP pieces; ``k_activations`` holds the activations and their
derivative factors as torch functions; ``rotary.apply_rotary`` is ``cuflash.rotary.apply_rotary``."""
