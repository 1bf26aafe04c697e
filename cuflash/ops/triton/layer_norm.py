"""``flash_attn.ops.triton.layer_norm`` → ``cuflash.ops.triton.layer_norm``: the names of
``cuflash.ops.layer_norm`` (torch compositions, not Triton kernels)."""
from ..layer_norm import *  # noqa: F401,F403
from ..layer_norm import __all__  # noqa: F401
