"""``flash_attn.ops.triton.cross_entropy`` → ``cuflash.ops.triton.cross_entropy``: the names of
``cuflash.ops.cross_entropy`` (CUDA kernels compiled by NVRTC and a torch composition, not
Triton)."""
from ..cross_entropy import *  # noqa: F401,F403
from ..cross_entropy import __all__  # noqa: F401
