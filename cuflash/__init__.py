"""cuflash: exact FlashAttention kernels, compiled at run time, tuned per GPU.

    import cuflash
    out = cuflash.flash_attn_func(q, k, v, causal=True)       # CuPy / NumPy / torch
    ref = cuflash.reference.attention_naive(q, k, v, causal=True)   # float64 oracle
"""
from . import reference
from ._gpu import NoGPUError
from .config import ConfigError, FwdConfig, default_fwd_config
from .interface import config_for, flash_attn_func

__version__ = "0.1.0"
__all__ = ["flash_attn_func", "config_for", "FwdConfig", "ConfigError", "default_fwd_config",
           "NoGPUError", "reference", "__version__"]
