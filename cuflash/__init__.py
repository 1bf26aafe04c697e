"""cuflash: exact FlashAttention kernels, compiled at run time, tuned per GPU.

    import cuflash
    out = cuflash.flash_attn_func(q, k, v, causal=True)       # CuPy / NumPy / torch
    ref = cuflash.reference.attention_naive(q, k, v, causal=True)   # float64 oracle

Importing cuflash imports neither CuPy nor torch; both load on first use.
"""
import os as _os

# In a source checkout kernels_cu/ and tuning/ sit beside cuflash/; installed, they are
# inside it (setup.cfg maps them to cuflash.kernels_cu and cuflash.tuning). Either way they
# import as cuflash.kernels_cu and cuflash.tuning.
_here = _os.path.dirname(_os.path.abspath(__file__))
if not _os.path.isdir(_os.path.join(_here, "kernels_cu")):
    __path__.append(_os.path.dirname(_here))  # noqa: F821 - the package's own __path__

from . import reference  # noqa: E402
from ._gpu import NoGPUError  # noqa: E402
from .api import (UnsupportedFeature, bwd_config_for, config_for, flash_attn_backward,  # noqa: E402
                  flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                  flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                  flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)
from .families.base import ConfigError  # noqa: E402
from .families.fa2_bwd import BwdConfig  # noqa: E402
from .families.fa2_fwd import FwdConfig  # noqa: E402
from .problem import Problem  # noqa: E402

__version__ = "0.2.0.dev0"
__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache", "flash_attn_backward",
           "config_for", "bwd_config_for",
           "FwdConfig", "BwdConfig", "ConfigError", "NoGPUError", "UnsupportedFeature", "Problem",
           "reference", "index_first_axis", "index_put_first_axis", "unpad_input", "pad_input",
           "index_first_axis_residual", "unpad_input_for_concatenated_sequences",
           "__version__"]

_PADDING = ("index_first_axis", "index_put_first_axis", "unpad_input", "pad_input",
            "index_first_axis_residual", "unpad_input_for_concatenated_sequences")


def __getattr__(name):
    """The bert_padding helpers (cuflash.padding) load torch: import them on first use, so
    that importing cuflash imports neither CuPy nor torch."""
    if name in _PADDING:
        from . import padding

        return getattr(padding, name)
    raise AttributeError(f"module 'cuflash' has no attribute {name!r}")

# The kernel families register on import; load them now (about 20 ms) rather than on the
# first call, which may be traced by torch.compile: dynamo refuses importlib.import_module,
# so a fullgraph compile that came before any eager call failed.
from .registry import _load as _load_families  # noqa: E402

_load_families()
