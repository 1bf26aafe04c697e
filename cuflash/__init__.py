"""cuflash: exact FlashAttention kernels, compiled at run time, tuned per GPU.

    import cuflash
    out = cuflash.flash_attn_func(q, k, v, causal=True)       # CuPy / NumPy / torch
    ref = cuflash.reference.attention_naive(q, k, v, causal=True)   # float64 oracle
"""
from . import reference
from ._gpu import NoGPUError
from .config import BwdConfig, ConfigError, FwdConfig, default_bwd_config, default_fwd_config
from .interface import bwd_config_for, config_for, flash_attn_backward, flash_attn_func

__version__ = "0.1.0"
__all__ = ["flash_attn_func", "flash_attn_backward", "config_for", "bwd_config_for", "FwdConfig",
           "BwdConfig", "ConfigError", "default_fwd_config", "default_bwd_config", "NoGPUError",
           "reference", "__version__"]
