"""The public entry point: ``flash_attn_func``, flash_attn-compatible.

Inputs are validated on the host before anything is launched; every error names the
argument and says what was expected. Three kinds of input:

* CuPy arrays: run on the current CuPy stream, return a CuPy array.
* NumPy arrays: copied to the current GPU, result copied back (a convenience, not fast).
* torch CUDA tensors (forward only for now): raw pointers on torch's current stream,
  outputs from torch's caching allocator, no device synchronization.

bf16 has no NumPy dtype of its own: pass ``ml_dtypes.bfloat16`` NumPy arrays, CuPy arrays of
that dtype (CuPy with ml_dtypes installed) or ``torch.bfloat16`` tensors.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import _gpu
from .config import MAX_HEAD_DIM, FwdConfig, default_fwd_config
from .kernels import get_kernel
from .params import pack

LOG2E = 1.4426950408889634

# Test hook: fill outputs with NaN (LSE with NaN) before each launch, so that an element the
# kernel fails to write shows up. Set from CUFLASH_POISON_OUTPUTS=1 or by tests.
POISON_OUTPUTS = os.environ.get("CUFLASH_POISON_OUTPUTS", "") not in ("", "0")


@dataclass
class _Tensor:
    """What the launcher needs of one array: shape, strides (elements) and address."""
    kind: str          # "cupy", "numpy" or "torch"
    dtype: str         # "bf16" or "fp16"
    shape: tuple
    strides: tuple     # in elements
    ptr: int
    device: Optional[int]


def _dtype_name(kind: str, x) -> Optional[str]:
    if kind == "torch":
        import torch

        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(x.dtype)
    name = np.dtype(x.dtype).name
    return {"bfloat16": "bf16", "float16": "fp16"}.get(name)


def _kind(x) -> str:
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        return "torch"
    if mod == "cupy":
        return "cupy"
    if isinstance(x, np.ndarray):
        return "numpy"
    return mod


def _describe(name: str, x) -> _Tensor:
    kind = _kind(x)
    if kind not in ("cupy", "numpy", "torch"):
        raise TypeError(f"{name}: expected a CuPy array, NumPy array or torch tensor, "
                        f"got {type(x).__name__}")
    if x.ndim != 4:
        raise ValueError(f"{name}: expected 4 dimensions (batch, seqlen, nheads, headdim), "
                         f"got shape {tuple(x.shape)}")
    dtype = _dtype_name(kind, x)
    if dtype is None:
        raise TypeError(f"{name}: dtype must be float16 or bfloat16, got {x.dtype} "
                        "(fp32 inputs are not supported yet; cast explicitly)")
    if kind == "torch":
        if x.device.type != "cuda":
            raise NotImplementedError(
                f"{name}: torch CPU tensors are not supported yet; use "
                "cuflash.reference.attention_naive for a CPU result")
        strides, ptr, device = tuple(x.stride()), x.data_ptr(), x.device.index
    elif kind == "cupy":
        item = x.dtype.itemsize
        strides, ptr, device = tuple(s // item for s in x.strides), x.data.ptr, x.device.id
    else:
        item = x.dtype.itemsize
        strides, ptr, device = tuple(s // item for s in x.strides), 0, None
    return _Tensor(kind, dtype, tuple(int(s) for s in x.shape), strides, ptr, device)


def _check_layout(name: str, t: _Tensor) -> None:
    """GPU inputs: contiguous last dim, 16-byte aligned rows (cp.async moves 16 bytes)."""
    if t.kind == "numpy":
        return  # copied into a fresh contiguous device array
    if t.shape[3] > 1 and t.strides[3] != 1:
        raise ValueError(f"{name}: the last dimension (headdim) must be contiguous "
                         f"(stride 1), got strides {t.strides}")
    bad = [s for s, n in zip(t.strides[:3], t.shape[:3]) if n > 1 and s % 8]
    if bad or t.ptr % 16:
        raise ValueError(f"{name}: batch/seqlen/head strides must be multiples of 8 elements and "
                         f"the data 16-byte aligned (got strides {t.strides}, address "
                         f"{t.ptr:#x}); make a contiguous copy first")


def flash_attn_func(q, k, v, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
                    alibi_slopes=None, deterministic: bool = False,
                    return_attn_probs: bool = False, *, config: Optional[FwdConfig] = None):
    """Exact attention, FlashAttention-2 algorithm; same signature as flash_attn's.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim),
    nheads % nheads_kv == 0 (GQA / MQA). headdim a multiple of 8, at most 256.
    causal: bottom-right aligned mask (query i sees key j iff j <= i + seqlen_k - seqlen_q);
    fully masked rows give 0 (and LSE = +inf).
    softmax_scale: default 1/sqrt(headdim); must be finite and > 0.
    config: an explicit FwdConfig (tiles, warps, stages) instead of the tuned/heuristic one.

    Returns out (like q), or (out, lse, None) when return_attn_probs: lse is fp32
    (batch, nheads, seqlen_q), natural log; the third slot (attention probabilities) stays
    None, as in flash_attn without dropout.
    """
    if dropout_p != 0.0:
        raise NotImplementedError(f"dropout_p={dropout_p}: dropout is not implemented yet (use 0.0)")
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"window_size={window_size}: sliding window is not implemented yet")
    if softcap != 0.0:
        raise NotImplementedError(f"softcap={softcap}: softcapping is not implemented yet")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: ALiBi is not implemented yet (pass None)")

    tq, tk, tv = _describe("q", q), _describe("k", k), _describe("v", v)
    if not tq.kind == tk.kind == tv.kind:
        raise TypeError(f"q, k, v must be the same kind of array, got {tq.kind}, {tk.kind}, {tv.kind}")
    if not tq.dtype == tk.dtype == tv.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    batch, seqlen_q, nheads, head_dim = tq.shape
    _, seqlen_k, nheads_kv, _ = tk.shape
    if tk.shape[0] != batch or tv.shape[0] != batch:
        raise ValueError(f"k, v: batch must match q's {batch}, got {tk.shape[0]} and {tv.shape[0]}")
    if tk.shape[3] != head_dim or tv.shape[3] != head_dim:
        raise ValueError(f"k, v: headdim must match q's {head_dim}, got {tk.shape[3]} and {tv.shape[3]}")
    if tv.shape != tk.shape:
        raise ValueError(f"v: shape must equal k's {tk.shape}, got {tv.shape}")
    if head_dim % 8 or not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q: headdim must be a multiple of 8 in 8..{MAX_HEAD_DIM}, got {head_dim}")
    if batch > 65535 or nheads > 65535:
        raise ValueError(f"q: batch ({batch}) and nheads ({nheads}) must be <= 65535 (CUDA grid limit)")
    if nheads_kv == 0 or nheads % nheads_kv:
        raise ValueError(f"k: nheads_kv={nheads_kv} must divide q's nheads={nheads} (GQA/MQA)")
    if tq.kind != "numpy" and not tq.device == tk.device == tv.device:
        raise ValueError(f"q, k, v must be on one device, got devices {tq.device}, {tk.device}, {tv.device}")
    for name, t in (("q", tq), ("k", tk), ("v", tv)):
        _check_layout(name, t)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    softmax_scale = float(softmax_scale)
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a finite number > 0, got {softmax_scale}")
    causal = bool(causal)
    if config is not None:
        if not isinstance(config, FwdConfig):
            raise TypeError(f"config: expected a cuflash.FwdConfig, got {type(config).__name__}")
        if config.dtype != tq.dtype or config.causal != causal or config.head_dim < head_dim:
            raise ValueError(f"config: {config.name} does not fit this call "
                             f"(dtype {tq.dtype}, causal={causal}, headdim {head_dim})")
        config.validate()

    empty = batch == 0 or seqlen_q == 0 or nheads == 0
    if tq.kind == "numpy" and not empty and seqlen_k == 0:
        # attention over zero keys: every row fully masked, O = 0 and LSE = +inf; no GPU needed
        return _keyless_numpy(q, tq, return_attn_probs)
    if tq.kind != "torch" and not empty:
        _gpu.require("flash_attn_func")
    runner = {"cupy": _run_cupy, "numpy": _run_numpy, "torch": _run_torch}[tq.kind]
    out, lse = runner(q, k, v, tq, tk, tv, softmax_scale, causal, config, empty)
    return (out, lse, None) if return_attn_probs else out


# ---------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def config_for(head_dim: int, dtype: str, causal: bool, device: int = 0) -> FwdConfig:
    """The forward config used for this problem class on `device` (heuristic for now)."""
    return default_fwd_config(head_dim, dtype, causal, _gpu.arch(device), _gpu.max_smem(device))


def _launch_fwd(config: FwdConfig, device: int, stream_ptr: int, *, q, k, v, o, lse,
                batch, nheads, nheads_kv, seqlen_q, seqlen_k, head_dim, softmax_scale) -> None:
    """Launch one forward kernel on `stream_ptr` (raw cudaStream_t; 0 is the legacy default).

    q, k, v, o are _Tensor (pointer + strides), lse a pointer. The hot path is a driver
    launch with the params struct by value: no DLPack, no CuPy array, no synchronization.
    """
    import cupy
    from cupy_backends.cuda.api import driver

    kernel = get_kernel(config, device)
    params = pack(
        "FwdParams", q=q.ptr, k=k.ptr, v=v.ptr, o=o.ptr, lse=lse,
        q_batch_stride=q.strides[0], q_row_stride=q.strides[1], q_head_stride=q.strides[2],
        k_batch_stride=k.strides[0], k_row_stride=k.strides[1], k_head_stride=k.strides[2],
        v_batch_stride=v.strides[0], v_row_stride=v.strides[1], v_head_stride=v.strides[2],
        o_batch_stride=o.strides[0], o_row_stride=o.strides[1], o_head_stride=o.strides[2],
        batch=batch, nheads=nheads, nheads_kv=nheads_kv, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        head_dim=head_dim, softmax_scale=softmax_scale, scale_log2=softmax_scale * LOG2E)
    argv = np.array([params.ctypes.data], dtype=np.uint64)  # kernelParams: one pointer per argument
    grid = (-(-seqlen_q // config.Br), nheads, batch)
    if cupy.cuda.runtime.getDevice() != device:
        with cupy.cuda.Device(device):
            driver.launchKernel(kernel.kernel.ptr, *grid, config.threads, 1, 1, config.smem_bytes,
                                stream_ptr, argv.ctypes.data, 0)
    else:
        driver.launchKernel(kernel.kernel.ptr, *grid, config.threads, 1, 1, config.smem_bytes,
                            stream_ptr, argv.ctypes.data, 0)


def _forward_on_device(tq, tk, tv, out_t: _Tensor, lse_ptr, softmax_scale, causal,
                       config, device, stream_ptr):
    batch, seqlen_q, nheads, head_dim = tq.shape
    _, seqlen_k, nheads_kv, _ = tk.shape
    if config is None:
        config = config_for(head_dim, tq.dtype, causal, device)
    else:  # a research override: check it against this device's shared memory too
        config.validate(_gpu.max_smem(device))
    _launch_fwd(config, device, stream_ptr, q=tq, k=tk, v=tv, o=out_t, lse=lse_ptr,
                batch=batch, nheads=nheads, nheads_kv=nheads_kv, seqlen_q=seqlen_q,
                seqlen_k=seqlen_k, head_dim=head_dim, softmax_scale=softmax_scale)


def _keyless_numpy(q, tq, return_attn_probs):
    batch, seqlen_q, nheads, _ = tq.shape
    out = np.zeros(q.shape, q.dtype)
    lse = np.full((batch, nheads, seqlen_q), np.inf, np.float32)
    return (out, lse, None) if return_attn_probs else out


def _no_keys(tq, tk) -> bool:
    return tk.shape[1] == 0


def _run_cupy(q, k, v, tq, tk, tv, softmax_scale, causal, config, empty):
    import cupy

    batch, seqlen_q, nheads, head_dim = tq.shape
    with cupy.cuda.Device(tq.device if tq.device is not None else 0):
        out = cupy.empty(q.shape, dtype=q.dtype)
        lse = cupy.empty((batch, nheads, seqlen_q), dtype=cupy.float32)
        if empty:
            return out, lse
        if _no_keys(tq, tk):  # attention over zero keys: every row fully masked
            out.view(cupy.uint16).fill(0)
            lse.fill(np.inf)
            return out, lse
        if POISON_OUTPUTS:
            out.view(cupy.uint16).fill(0x7FFF)  # a NaN in bf16 and fp16 alike
            lse.fill(np.nan)
        out_t = _describe("out", out)
        _forward_on_device(tq, tk, tv, out_t, lse.data.ptr, softmax_scale, causal,
                           config, tq.device, cupy.cuda.get_current_stream().ptr)
    return out, lse


def _run_numpy(q, k, v, tq, tk, tv, softmax_scale, causal, config, empty):
    batch, seqlen_q, nheads, head_dim = tq.shape
    if empty:
        return np.empty(q.shape, q.dtype), np.empty((batch, nheads, seqlen_q), np.float32)
    import cupy

    # Move raw 16-bit words: CuPy needs no bf16 dtype for that.
    dq, dk, dv = (cupy.asarray(np.ascontiguousarray(x).view(np.uint16)) for x in (q, k, v))
    with cupy.cuda.Device(dq.device.id):
        out = cupy.empty(q.shape, dtype=cupy.uint16)
        lse = cupy.empty((batch, nheads, seqlen_q), dtype=cupy.float32)
        # (seqlen_k == 0 never gets here: flash_attn_func answers it without a GPU)
        if POISON_OUTPUTS:
            out.fill(0x7FFF)
            lse.fill(np.nan)
        as_t = lambda x: _Tensor("cupy", tq.dtype, tuple(x.shape),  # noqa: E731
                                 tuple(s // 2 for s in x.strides), x.data.ptr, x.device.id)
        _forward_on_device(as_t(dq), as_t(dk), as_t(dv), as_t(out), lse.data.ptr,
                           softmax_scale, causal, config, dq.device.id,
                           cupy.cuda.get_current_stream().ptr)
        return cupy.asnumpy(out).view(q.dtype), cupy.asnumpy(lse)


def _run_torch(q, k, v, tq, tk, tv, softmax_scale, causal, config, empty):
    import torch

    if q.requires_grad or k.requires_grad or v.requires_grad:
        raise NotImplementedError("q, k, v: autograd (requires_grad) through cuflash is not "
                                  "implemented yet; call under torch.no_grad() or detach()")
    batch, seqlen_q, nheads, head_dim = tq.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    if empty:
        return out, lse
    if _no_keys(tq, tk):
        out.zero_()
        lse.fill_(math.inf)
        return out, lse
    _gpu.require("flash_attn_func")
    if POISON_OUTPUTS:
        out.fill_(math.nan)
        lse.fill_(math.nan)
    stream = torch.cuda.current_stream(q.device).cuda_stream
    _forward_on_device(tq, tk, tv, _describe("out", out), lse.data_ptr(), softmax_scale,
                       causal, config, tq.device, stream)
    return out, lse
