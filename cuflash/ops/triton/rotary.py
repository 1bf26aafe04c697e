"""flash-attn's ``flash_attn.ops.triton.rotary.apply_rotary(x, cos, sin, seqlen_offsets=0,
cu_seqlens=None, max_seqlen=None, interleaved=False, inplace=False, conjugate=False)``: cuflash's
``cuflash.rotary.apply_rotary`` (``kernels_cu/rotary.cu`` on CUDA tensors, the float64 reference
on CPU; no autograd, as flash-attn's)."""
from ...rotary import apply_rotary

__all__ = ["apply_rotary"]
