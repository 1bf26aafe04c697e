"""The public entry point: ``flash_attn_func``, flash_attn-compatible.

Inputs are validated on the host before anything is launched; every error names the
argument and says what was expected. Three kinds of input:

* CuPy arrays: run on the current CuPy stream, return a CuPy array.
* NumPy arrays: copied to the current GPU, result copied back (a convenience, not fast).
* torch tensors: CUDA tensors run through the ``cuflash::fwd`` / ``cuflash::bwd`` custom ops
  (cuflash/torch_ops.py): autograd, torch.compile and CUDA graphs work; kernels launch by
  raw pointer on torch's current stream into torch-allocated outputs. CPU tensors (any float
  dtype) run the float64 NumPy reference, so the autograd plumbing is testable without a GPU.

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
from .config import BWD_ROW_PAD, MAX_HEAD_DIM, BwdConfig, FwdConfig
from .kernels import get_kernels
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

        names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
        if x.device.type == "cpu":  # the reference path computes in float64 anyway
            names.update({torch.float32: "fp32", torch.float64: "fp64"})
        return names.get(x.dtype)
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
        import torch

        if x.device.type not in ("cuda", "cpu"):
            raise ValueError(f"{name}: torch tensors must be on a CUDA device or the CPU, "
                             f"got {x.device}")
        on_gpu = x.device.type == "cuda"
        # torch.compile traces this validation with fake tensors: no address to read then
        # (the custom op reads the real one, and copies a misaligned tensor).
        traced = torch.compiler.is_compiling()
        strides, ptr = tuple(x.stride()), x.data_ptr() if on_gpu and not traced else 0
        device = x.device.index if on_gpu else None
    elif kind == "cupy":
        item = x.dtype.itemsize
        strides, ptr, device = tuple(s // item for s in x.strides), x.data.ptr, x.device.id
    else:
        item = x.dtype.itemsize
        strides, ptr, device = tuple(s // item for s in x.strides), 0, None
    return _Tensor(kind, dtype, tuple(int(s) for s in x.shape), strides, ptr, device)


def _check_layout(name: str, t: _Tensor) -> None:
    """GPU inputs: contiguous last dim, 16-byte aligned rows (cp.async moves 16 bytes)."""
    if t.kind == "numpy" or t.device is None:
        return  # copied into a fresh array (NumPy to the GPU, torch CPU to the reference)
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
                    return_attn_probs: bool = False, *, config: Optional[FwdConfig] = None,
                    bwd_config: Optional[BwdConfig] = None):
    """Exact attention, FlashAttention-2 algorithm; same signature as flash_attn's.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim),
    nheads % nheads_kv == 0 (GQA / MQA). headdim a multiple of 8, at most 256.
    causal: bottom-right aligned mask (query i sees key j iff j <= i + seqlen_k - seqlen_q);
    fully masked rows give 0 (and LSE = +inf).
    softmax_scale: default 1/sqrt(headdim); must be finite and > 0.
    deterministic: the backward (torch autograd) adds dQ contributions in a fixed order, so
    gradients are bitwise reproducible (slower); the forward is always deterministic.
    config / bwd_config: an explicit FwdConfig / BwdConfig (tiles, warps, stages) instead of
    the tuned or heuristic one; bwd_config applies to torch autograd's backward.

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

    tq, tk, tv, softmax_scale, causal = _check_qkv(q, k, v, softmax_scale, causal)
    _check_config("config", config, FwdConfig, tq.dtype, causal, tq.shape[3])
    _check_config("bwd_config", bwd_config, BwdConfig, tq.dtype, causal, tq.shape[3])
    if tq.kind == "torch":
        from . import torch_ops

        out, lse = torch_ops.attention(q, k, v, softmax_scale, causal, bool(deterministic),
                                       config, bwd_config)
        return (out, lse, None) if return_attn_probs else out

    batch, seqlen_q, nheads, _ = tq.shape
    empty = batch == 0 or seqlen_q == 0 or nheads == 0
    if tq.kind == "numpy" and not empty and tk.shape[1] == 0:
        # attention over zero keys: every row fully masked, O = 0 and LSE = +inf; no GPU needed
        return _keyless_numpy(q, tq, return_attn_probs)
    if not empty:
        _gpu.require("flash_attn_func")
    runner = {"cupy": _run_cupy, "numpy": _run_numpy}[tq.kind]
    out, lse = runner(q, k, v, tq, tk, tv, softmax_scale, causal, config, empty)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_backward(dout, q, k, v, out, lse, softmax_scale: Optional[float] = None,
                        causal: bool = False, deterministic: bool = False, *,
                        config: Optional[BwdConfig] = None):
    """Gradients (dq, dk, dv) of flash_attn_func's output, given dout = dL/dout.

    out and lse are what ``flash_attn_func(q, k, v, ..., return_attn_probs=True)`` returned
    for the same q, k, v, softmax_scale and causal. CuPy arrays (current stream) or torch
    tensors (torch's current stream; no autograd: this is what autograd calls). dk, dv have
    k's shape: under GQA / MQA they are summed over the query heads sharing a K/V head.
    deterministic=True adds the dQ contributions in a fixed order (bitwise reproducible).
    """
    tq, tk, tv, softmax_scale, causal = _check_qkv(q, k, v, softmax_scale, causal)
    tdo, to = _describe("dout", dout), _describe("out", out)
    for name, t in (("dout", tdo), ("out", to)):
        if t.kind != tq.kind or t.dtype != tq.dtype or t.shape != tq.shape:
            raise ValueError(f"{name}: expected a {tq.kind} array of q's shape {tq.shape} and dtype "
                             f"{tq.dtype}, got a {t.kind} {t.dtype} array of shape {t.shape}")
        if tq.kind != "numpy" and t.device != tq.device:
            raise ValueError(f"{name}: must be on q's device {tq.device}, got {t.device}")
    batch, seqlen_q, nheads, _ = tq.shape
    lse_shape = tuple(int(n) for n in lse.shape)
    if lse_shape != (batch, nheads, seqlen_q) or _float_name(lse) != "float32":
        raise ValueError(f"lse: expected float32 of shape {(batch, nheads, seqlen_q)} (as returned "
                         f"with return_attn_probs=True), got {_float_name(lse)} {lse_shape}")
    _check_config("config", config, BwdConfig, tq.dtype, causal, tq.shape[3])
    if tq.kind == "torch":
        from . import torch_ops

        return torch_ops.backward(dout, q, k, v, out, lse, softmax_scale, causal,
                                  bool(deterministic), config)
    if tq.kind == "numpy":
        raise TypeError("flash_attn_backward takes CuPy arrays or torch tensors; for NumPy "
                        "use cuflash.reference.attention_backward_naive")
    return _backward_cupy(dout, q, k, v, out, lse, tdo, tq, tk, tv, to, softmax_scale, causal,
                          bool(deterministic), config)


def _float_name(x) -> str:
    return str(x.dtype).replace("torch.", "")


def _check_qkv(q, k, v, softmax_scale, causal):
    """Validate q, k, v and the scale; every error names the argument. No launch, no GPU."""
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
    return tq, tk, tv, softmax_scale, bool(causal)


def _check_config(name, config, cls, dtype, causal, head_dim) -> None:
    if config is None:
        return
    if not isinstance(config, cls):
        raise TypeError(f"{name}: expected a cuflash.{cls.__name__}, got {type(config).__name__}")
    if config.dtype != dtype or config.causal != causal or config.head_dim < head_dim:
        raise ValueError(f"{name}: {config.name} does not fit this call "
                         f"(dtype {dtype}, causal={causal}, headdim {head_dim})")
    config.validate()


# ---------------------------------------------------------------------------------------
# configs

@functools.lru_cache(maxsize=None)
def _choose(kernel: str, head_dim: int, dtype: str, causal: bool, bucket, deterministic: bool,
            device: int):
    """(config, where it came from): a tuned entry for this GPU (tuning/), else the heuristic."""
    import tuning

    return tuning.choose(kernel, head_dim, dtype, causal, bucket, gpu_name=_gpu.name(device),
                         cc=_gpu.arch(device), max_smem=_gpu.max_smem(device),
                         deterministic=deterministic)


def _bucket(seqlen: Optional[int]):
    import tuning

    return None if seqlen is None else tuning.seqlen_bucket(seqlen)


def config_for(head_dim: int, dtype: str, causal: bool, device: int = 0,
               seqlen: Optional[int] = None, *, with_source: bool = False):
    """The forward config used for this problem class on `device`: the tuned entry for this
    GPU and seqlen bucket (exact, then nearest bucket), else the heuristic default.
    with_source=True returns (config, source), source naming the YAML file or the heuristic."""
    config, source = _choose("fwd", head_dim, dtype, causal, _bucket(seqlen), False, device)
    return (config, source) if with_source else config


def bwd_config_for(head_dim: int, dtype: str, causal: bool, deterministic: bool = False,
                   device: int = 0, seqlen: Optional[int] = None, *, with_source: bool = False):
    """The backward config used for this problem class on `device` (as config_for)."""
    config, source = _choose("bwd", head_dim, dtype, causal, _bucket(seqlen), deterministic, device)
    return (config, source) if with_source else config


# ---------------------------------------------------------------------------------------
# launches: raw driver calls with the params struct by value, on a raw stream

def _on_device(device: int):
    """Make `device` current for the launches (a no-op, and no cost, when it already is)."""
    import contextlib

    import cupy

    if cupy.cuda.runtime.getDevice() == device:
        return contextlib.nullcontext()
    return cupy.cuda.Device(device)


def _launch(kernel, grid, threads: int, smem: int, stream_ptr: int, params: np.ndarray) -> None:
    from cupy_backends.cuda.api import driver

    argv = np.array([params.ctypes.data], dtype=np.uint64)  # kernelParams: one pointer per argument
    driver.launchKernel(kernel.kernel.ptr, *grid, threads, 1, 1, smem, stream_ptr, argv.ctypes.data, 0)


def _strides(prefix: str, t: _Tensor) -> dict:
    return {f"{prefix}_batch_stride": t.strides[0], f"{prefix}_row_stride": t.strides[1],
            f"{prefix}_head_stride": t.strides[2]}


def _forward_on_device(tq, tk, tv, out_t: _Tensor, lse_ptr, softmax_scale, causal,
                       config, device, stream_ptr):
    """Launch the forward on `stream_ptr` (raw cudaStream_t): O into out_t, LSE at lse_ptr."""
    batch, seqlen_q, nheads, head_dim = tq.shape
    _, seqlen_k, nheads_kv, _ = tk.shape
    if config is None:
        config = config_for(head_dim, tq.dtype, causal, device, max(seqlen_q, seqlen_k))
    else:  # a research override: check it against this device's shared memory too
        config.validate(_gpu.max_smem(device))
    kernel = get_kernels(config, device)["main"]
    params = pack(
        "FwdParams", q=tq.ptr, k=tk.ptr, v=tv.ptr, o=out_t.ptr, lse=lse_ptr,
        **_strides("q", tq), **_strides("k", tk), **_strides("v", tv), **_strides("o", out_t),
        batch=batch, nheads=nheads, nheads_kv=nheads_kv, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        head_dim=head_dim, softmax_scale=softmax_scale, scale_log2=softmax_scale * LOG2E)
    grid = (-(-seqlen_q // config.Br), nheads, batch)
    with _on_device(device):
        _launch(kernel, grid, config.threads, config.smem_bytes, stream_ptr, params)


def bwd_workspace(batch, nheads, seqlen_q, seqlen_k, grouped: bool, config: BwdConfig) -> dict:
    """Byte offsets of the backward's fp32 workspace pieces (params.cuh BwdParams), and 'total'."""
    rows = -(-seqlen_q // BWD_ROW_PAD) * BWD_ROW_PAD
    sizes = {"lse_log2": batch * nheads * rows * 4, "dsum": batch * nheads * rows * 4,
             "dq_accum": batch * nheads * rows * config.head_dim * 4}
    if grouped:
        sizes["dk_accum"] = sizes["dv_accum"] = batch * nheads * seqlen_k * config.head_dim * 4
    if config.deterministic:
        sizes["dq_semaphore"] = batch * nheads * (rows // 16) * 4
    offsets, total = {}, 0
    for name, size in sizes.items():
        offsets[name] = total
        total += -(-size // 256) * 256
    offsets["total"] = total
    offsets["rows"] = rows
    return offsets


def bwd_head_group(pairs: int, kv_ctas: int, sms: int) -> int:
    """(batch, head) pairs whose K/V blocks flash_bwd interleaves: enough for two waves of
    CTAs (the causal tail is then short blocks), at most all of them. CUFLASH_BWD_HEAD_GROUP=n
    fixes it (1: one head after another; a large n: block 0 of every head first)."""
    fixed = os.environ.get("CUFLASH_BWD_HEAD_GROUP")
    if fixed:
        return max(1, min(pairs, int(fixed)))
    return max(1, min(pairs, -(-2 * sms // kv_ctas)))


def _backward_on_device(tdo, tq, tk, tv, to, lse_ptr, tdq, tdk, tdv, workspace_ptr, ws: dict,
                        softmax_scale, causal, config, device, stream_ptr) -> None:
    """Launch the backward (preprocess, main, dQ epilogue, GQA reduction) on `stream_ptr`.

    All of dq, dk, dv are written; `workspace_ptr` holds ws['total'] bytes laid out as
    ws = bwd_workspace(...) (the caller sized its allocation with it).
    The caller handles the empty cases (no query rows, no keys).
    """
    batch, seqlen_q, nheads, head_dim = tq.shape
    _, seqlen_k, nheads_kv, _ = tk.shape
    grouped = nheads != nheads_kv
    kv_ctas = -(-seqlen_k // config.Bc) * config.dsplit
    pairs = batch * nheads
    if pairs * kv_ctas >= 2 ** 31:  # gridDim.x
        raise ValueError(f"batch * nheads * seqlen_k: too many K/V blocks for one launch "
                         f"({pairs} x {kv_ctas})")
    at = lambda name: workspace_ptr + ws[name] if name in ws else 0  # noqa: E731
    kernels = get_kernels(config, device)
    params = pack(
        "BwdParams", q=tq.ptr, k=tk.ptr, v=tv.ptr, o=to.ptr, dout=tdo.ptr, lse=lse_ptr,
        dq=tdq.ptr, dk=tdk.ptr, dv=tdv.ptr, lse_log2=at("lse_log2"), dsum=at("dsum"),
        dq_accum=at("dq_accum"), dk_accum=at("dk_accum"), dv_accum=at("dv_accum"),
        dq_semaphore=at("dq_semaphore"),
        **_strides("q", tq), **_strides("k", tk), **_strides("v", tv), **_strides("o", to),
        **_strides("do", tdo), **_strides("dq", tdq), **_strides("dk", tdk), **_strides("dv", tdv),
        batch=batch, nheads=nheads, nheads_kv=nheads_kv, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        seqlen_q_rounded=ws["rows"], head_dim=head_dim, head_dim_rounded=config.head_dim,
        head_group=bwd_head_group(pairs, kv_ctas, _gpu.sm_count(device)),
        softmax_scale=softmax_scale, scale_log2=softmax_scale * LOG2E)
    per_row = head_dim // 8  # epilogue threads per row
    with _on_device(device):
        _launch(kernels["preprocess"], (ws["rows"] // 4, nheads, batch), 128, 0, stream_ptr, params)
        # one block per (pair, K/V block), in the order of bwd_head_group (flash_bwd.cu)
        _launch(kernels["main"], (pairs * kv_ctas, 1, 1),
                config.threads, config.smem_bytes, stream_ptr, params)
        _launch(kernels["convert_dq"], (-(-seqlen_q * per_row // 256), nheads, batch), 256, 0,
                stream_ptr, params)
        if grouped:
            _launch(kernels["reduce_dkv"], (-(-seqlen_k * per_row // 256), nheads_kv, batch), 256, 0,
                    stream_ptr, params)


def resolve_bwd_config(config, head_dim, dtype, causal, deterministic, device,
                       seqlen: Optional[int] = None) -> BwdConfig:
    if config is None:
        return bwd_config_for(head_dim, dtype, causal, deterministic, device, seqlen)
    # the call's flag decides, as on the torch path (whose configs cross the op as tiles)
    return config.replace(deterministic=deterministic).validate(_gpu.max_smem(device))


# ---------------------------------------------------------------------------------------
# CuPy and NumPy inputs

def _keyless_numpy(q, tq, return_attn_probs):
    batch, seqlen_q, nheads, _ = tq.shape
    out = np.zeros(q.shape, q.dtype)
    lse = np.full((batch, nheads, seqlen_q), np.inf, np.float32)
    return (out, lse, None) if return_attn_probs else out


def _run_cupy(q, k, v, tq, tk, tv, softmax_scale, causal, config, empty):
    import cupy

    batch, seqlen_q, nheads, head_dim = tq.shape
    with cupy.cuda.Device(tq.device if tq.device is not None else 0):
        out = cupy.empty(q.shape, dtype=q.dtype)
        lse = cupy.empty((batch, nheads, seqlen_q), dtype=cupy.float32)
        if empty:
            return out, lse
        if tk.shape[1] == 0:  # attention over zero keys: every row fully masked
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


def _backward_cupy(dout, q, k, v, out, lse, tdo, tq, tk, tv, to, softmax_scale, causal,
                   deterministic, config):
    import cupy

    batch, seqlen_q, nheads, head_dim = tq.shape
    _, seqlen_k, nheads_kv, _ = tk.shape
    with cupy.cuda.Device(tq.device):
        dq = cupy.empty(q.shape, q.dtype)
        dk = cupy.empty(k.shape, k.dtype)
        dv = cupy.empty(v.shape, v.dtype)
        if batch == 0 or nheads == 0:
            return dq, dk, dv
        if seqlen_q == 0 or seqlen_k == 0:  # no query rows or no keys: every gradient is zero
            for x in (dq, dk, dv):
                x.view(cupy.uint16).fill(0)
            return dq, dk, dv
        _gpu.require("flash_attn_backward")
        if not tdo.strides[3] == 1 or any(s % 8 for s in tdo.strides[:3]):
            dout = cupy.ascontiguousarray(dout)
            tdo = _describe("dout", dout)
        _check_layout("out", to)
        config = resolve_bwd_config(config, head_dim, tq.dtype, causal, deterministic, tq.device,
                                    max(seqlen_q, seqlen_k))
        if POISON_OUTPUTS:
            for x in (dq, dk, dv):
                x.view(cupy.uint16).fill(0x7FFF)
        ws = bwd_workspace(batch, nheads, seqlen_q, seqlen_k, nheads != nheads_kv, config)
        workspace = cupy.empty(ws["total"], dtype=cupy.uint8)
        _backward_on_device(tdo, tq, tk, tv, to, lse.data.ptr, _describe("dq", dq),
                            _describe("dk", dk), _describe("dv", dv), workspace.data.ptr, ws,
                            softmax_scale, causal, config, tq.device,
                            cupy.cuda.get_current_stream().ptr)
    return dq, dk, dv
