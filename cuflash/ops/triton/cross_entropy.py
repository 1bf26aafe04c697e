"""``flash_attn.ops.triton.cross_entropy`` → ``cuflash.ops.triton.cross_entropy``: the names of
``cuflash.ops.cross_entropy`` (a torch composition, not a Triton kernel)."""
from ..cross_entropy import *  # noqa: F401,F403
from ..cross_entropy import __all__  # noqa: F401
