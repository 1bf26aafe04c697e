"""The public entry points: ``flash_attn_func`` and ``flash_attn_backward``, flash_attn-compatible.

This module knows no kernel family: it validates the call, describes it as a
``cuflash.problem.Problem``, and hands it to selection (``cuflash.select``) and a launch plan
(``cuflash.launch.Plan``). Every error names the argument and is raised before any launch.

Three kinds of input:

* CuPy arrays: run on the current CuPy stream, return CuPy arrays.
* NumPy arrays: copied to the current GPU, results copied back (a convenience, not fast).
* torch tensors: ``cuflash.torch_ops`` (autograd, torch.compile, CUDA graphs); kernels launch
  by raw pointer on torch's current stream into torch-allocated outputs. CPU tensors (any
  float dtype) run the float64 NumPy reference, so the autograd plumbing is testable
  without a GPU.

Hot path: a repeat call with the same shapes, strides, dtypes, device and flags finds its
plan by one tuple key; validation, selection and packing ran on the first call.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from numbers import Real
from typing import Optional

import numpy as np

from . import _gpu
from . import compile as compile_mod
from .problem import Problem
from .registry import families

# Test hook: fill outputs with NaN (LSE with NaN) before each launch, so that an element the
# kernel fails to write shows up. Set from CUFLASH_POISON_OUTPUTS=1 or by tests.
POISON_OUTPUTS = os.environ.get("CUFLASH_POISON_OUTPUTS", "") not in ("", "0")

GRID_LIMIT = 65535  # gridDim.y / gridDim.z: heads and batch


@dataclass
class _Tensor:
    """What validation needs of one array: shape, strides (elements) and address."""
    kind: str          # "cupy", "numpy" or "torch"
    dtype: Optional[str]
    shape: tuple
    strides: tuple     # in elements
    ptr: int
    device: Optional[int]


def _kind(x) -> str:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    if isinstance(x, np.ndarray):
        return "numpy"
    mod = type(x).__module__.split(".")[0]
    return "cupy" if mod == "cupy" else mod


def dtype_name(x) -> Optional[str]:
    """'bf16' / 'fp16' (torch CPU tensors: also 'fp32' / 'fp64'), None for anything else."""
    name = str(x.dtype).replace("torch.", "")
    names = {"bfloat16": "bf16", "float16": "fp16"}
    if _kind(x) == "torch" and x.device.type == "cpu":  # the reference computes in float64
        names.update({"float32": "fp32", "float64": "fp64"})
    return names.get(name)


def describe(name: str, x) -> _Tensor:
    kind = _kind(x)
    if kind not in ("cupy", "numpy", "torch"):
        raise TypeError(f"{name}: expected a CuPy array, NumPy array or torch tensor, "
                        f"got {type(x).__name__}")
    if x.ndim != 4:
        raise ValueError(f"{name}: expected 4 dimensions (batch, seqlen, nheads, headdim), "
                         f"got shape {tuple(x.shape)}")
    dtype = dtype_name(x)
    if dtype is None:
        raise TypeError(f"{name}: dtype must be float16 or bfloat16, got {x.dtype} "
                        "(fp32 inputs are not supported yet; cast explicitly)")
    if kind == "torch":
        import torch

        if x.device.type not in ("cuda", "cpu"):
            raise ValueError(f"{name}: torch tensors must be on a CUDA device or the CPU, got {x.device}")
        on_gpu = x.device.type == "cuda"
        # torch.compile traces with fake tensors: no address to read then
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


def layout_problem(t: _Tensor) -> str:
    """'' when the kernels can read this GPU array in place (contiguous head dim, strides in
    whole 16-byte chunks, 16-byte aligned), else what is wrong."""
    if t.shape[3] > 1 and t.strides[3] != 1:
        return f"the last dimension (headdim) must be contiguous (stride 1), got strides {t.strides}"
    if any(s % 8 for s, n in zip(t.strides[:3], t.shape[:3]) if n > 1) or t.ptr % 16:
        return (f"batch/seqlen/head strides must be multiples of 8 elements and the data 16-byte "
                f"aligned (got strides {t.strides}, address {t.ptr:#x})")
    return ""


def _check_layout(name: str, t: _Tensor) -> None:
    if t.kind == "numpy" or t.device is None:
        return  # copied into a fresh array (NumPy to the GPU, torch CPU to the reference)
    why = layout_problem(t)
    if why:
        raise ValueError(f"{name}: {why}; make a contiguous copy first")


def check_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(softmax_scale, Real):
        try:  # 0-d arrays and tensors hold a number too; a bool is not a scale
            if isinstance(softmax_scale, (bool, np.bool_)):
                raise TypeError
            softmax_scale = float(softmax_scale)
        except (TypeError, ValueError):
            raise TypeError(f"softmax_scale must be a real number or None, got "
                            f"{type(softmax_scale).__name__} {softmax_scale!r}") from None
    softmax_scale = float(softmax_scale)
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a finite number > 0, got {softmax_scale}")
    return softmax_scale


def check_features(dropout_p=0.0, window_size=(-1, -1), softcap=0.0, alibi_slopes=None) -> None:
    if dropout_p != 0.0:
        raise NotImplementedError(f"dropout_p={dropout_p}: dropout is not implemented yet (use 0.0)")
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"window_size={window_size}: sliding window is not implemented yet")
    if softcap != 0.0:
        raise NotImplementedError(f"softcap={softcap}: softcapping is not implemented yet")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: ALiBi is not implemented yet (pass None)")


def check_supported(problem: Problem) -> None:
    """Raise (naming the argument) unless some registered family can run ``problem`` on some
    GPU. Needs no GPU; the device's own check comes with selection."""
    from .select import UnsupportedProblem

    reasons = [f.supports((99, 9), problem) for f in families(problem.op)]
    if reasons and all(reasons):
        raise UnsupportedProblem("; ".join(dict.fromkeys(reasons)))


def check_qkv(q, k, v, softmax_scale, causal, op: str = "fwd", deterministic: bool = False):
    """Validate q, k, v and the scale; every error names the argument. No launch, no GPU.
    Returns (tq, tk, tv, softmax_scale, problem)."""
    tq, tk, tv = describe("q", q), describe("k", k), describe("v", v)
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
    if batch > GRID_LIMIT or nheads > GRID_LIMIT:
        raise ValueError(f"q: batch ({batch}) and nheads ({nheads}) must be <= {GRID_LIMIT} (CUDA grid limit)")
    if nheads_kv == 0 or nheads % nheads_kv:
        raise ValueError(f"k: nheads_kv={nheads_kv} must divide q's nheads={nheads} (GQA/MQA)")
    if tq.kind != "numpy" and not tq.device == tk.device == tv.device:
        raise ValueError(f"q, k, v must be on one device, got devices {tq.device}, {tk.device}, {tv.device}")
    for name, t in (("q", tq), ("k", tk), ("v", tv)):
        _check_layout(name, t)
    softmax_scale = check_scale(softmax_scale, head_dim)
    dtype = tq.dtype if tq.dtype in ("bf16", "fp16") else "bf16"  # torch CPU: any float
    problem = Problem(op, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim,
                      bool(causal), bool(deterministic))
    check_supported(problem)
    return tq, tk, tv, softmax_scale, problem


def check_bwd_tensors(tq: _Tensor, dout, out, lse) -> tuple:
    """Validate the backward's dout, out and lse against q (described as ``tq``); every error
    names the argument. Returns (tdo, to)."""
    tdo, to = describe("dout", dout), describe("out", out)
    for name, t in (("dout", tdo), ("out", to)):
        if t.kind != tq.kind or t.dtype != tq.dtype or t.shape != tq.shape:
            raise ValueError(f"{name}: expected a {tq.kind} array of q's shape {tq.shape} and dtype "
                             f"{tq.dtype}, got a {t.kind} {t.dtype} array of shape {t.shape}")
        if tq.kind != "numpy" and t.device != tq.device:
            raise ValueError(f"{name}: must be on q's device {tq.device}, got {t.device}")
    batch, seqlen_q, nheads, _ = tq.shape
    lse_shape = tuple(int(n) for n in getattr(lse, "shape", ()))
    lse_dtype = str(getattr(lse, "dtype", type(lse).__name__)).replace("torch.", "")
    if _kind(lse) != tq.kind or lse_shape != (batch, nheads, seqlen_q) or lse_dtype != "float32":
        raise ValueError(f"lse: expected a {tq.kind} float32 array of shape {(batch, nheads, seqlen_q)} "
                         f"(as returned with return_attn_probs=True), got {_kind(lse)} {lse_dtype} "
                         f"{lse_shape}")
    lse_device = (lse.device.index if lse.device.type == "cuda" else None) if tq.kind == "torch" \
        else lse.device.id if tq.kind == "cupy" else None
    if lse_device != tq.device:
        raise ValueError(f"lse: must be on q's device {tq.device}, got {lse.device}")
    return tdo, to


def check_config(name: str, config, problem: Problem) -> None:
    """A caller's explicit config: right type and op, fits the call, valid (no device yet)."""
    if config is None:
        return
    from .registry import family_of

    try:
        fam = family_of(config)
    except (TypeError, LookupError):
        raise TypeError(f"{name}: expected a cuflash kernel config (e.g. cuflash.FwdConfig), "
                        f"got {type(config).__name__}") from None
    if fam.op != problem.op:
        raise TypeError(f"{name}: expected a {problem.op} config, got {config.name} ({fam.name}, op {fam.op})")
    why = fam.fits(config, problem)
    if why:
        raise ValueError(f"{name}: {why}")
    config.validate()


# ---------------------------------------------------------------------------------------
# public API

def flash_attn_func(q, k, v, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
                    alibi_slopes=None, deterministic: bool = False,
                    return_attn_probs: bool = False, *, config=None, bwd_config=None):
    """Exact attention, FlashAttention-2 algorithm; same signature as flash_attn's.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim),
    nheads % nheads_kv == 0 (GQA / MQA). headdim a multiple of 8, at most 256.
    causal: bottom-right aligned mask (query i sees key j iff j <= i + seqlen_k - seqlen_q);
    fully masked rows give 0 (and LSE = +inf).
    softmax_scale: default 1/sqrt(headdim); must be finite and > 0.
    deterministic: the backward (torch autograd) adds dQ contributions in a fixed order, so
    gradients are bitwise reproducible (slower); the forward is always deterministic.
    config / bwd_config: an explicit kernel config (e.g. cuflash.FwdConfig / BwdConfig) instead
    of the tuned or heuristic one; bwd_config applies to torch autograd's backward.

    Returns out (like q), or (out, lse, None) when return_attn_probs: lse is fp32
    (batch, nheads, seqlen_q), natural log; the third slot (attention probabilities) stays
    None, as in flash_attn without dropout.
    """
    if dropout_p or softcap or alibi_slopes is not None or window_size != (-1, -1):
        check_features(dropout_p, window_size, softcap, alibi_slopes)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(q, torch.Tensor):
        from . import torch_ops

        out, lse = torch_ops.attention(q, k, v, softmax_scale, causal, deterministic, config, bwd_config)
        return (out, lse, None) if return_attn_probs else out
    if type(q) is _CUPY_NDARRAY and type(k) is _CUPY_NDARRAY and type(v) is _CUPY_NDARRAY \
            and bwd_config is None and _plain_scale(softmax_scale):
        qd, kd, vd = q.data, k.data, v.data
        plan = _cupy_plans.get((q.shape, q.strides, k.shape, k.strides, v.shape, v.strides, q.dtype,
                                k.dtype, v.dtype, qd.device_id, kd.device_id, vd.device_id,
                                softmax_scale, causal, config))
        if plan is not None:
            qp, kp, vp = qd.ptr, kd.ptr, vd.ptr
            if not (qp | kp | vp) & 15:
                out, lse = plan.forward_ptrs(qp, kp, vp)
                return (out, lse, None) if return_attn_probs else out
    out, lse = _forward_slow(q, k, v, softmax_scale, causal, deterministic, config, bwd_config)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_backward(dout, q, k, v, out, lse, softmax_scale: Optional[float] = None,
                        causal: bool = False, deterministic: bool = False, *, config=None):
    """Gradients (dq, dk, dv) of flash_attn_func's output, given dout = dL/dout.

    out and lse are what ``flash_attn_func(q, k, v, ..., return_attn_probs=True)`` returned
    for the same q, k, v, softmax_scale and causal. CuPy arrays (current stream) or torch
    tensors (torch's current stream; no autograd: this is what autograd calls). dk, dv have
    k's shape: under GQA / MQA they are summed over the query heads sharing a K/V head.
    deterministic=True adds the dQ contributions in a fixed order (bitwise reproducible).
    """
    tq, tk, tv, softmax_scale, problem = check_qkv(q, k, v, softmax_scale, causal, "bwd", deterministic)
    tdo, to = check_bwd_tensors(tq, dout, out, lse)
    check_config("config", config, problem)
    if tq.kind == "torch":
        from . import torch_ops

        return torch_ops.backward(dout, q, k, v, out, lse, softmax_scale, causal,
                                  bool(deterministic), config)
    if tq.kind == "numpy":
        raise TypeError("flash_attn_backward takes CuPy arrays or torch tensors; for NumPy "
                        "use cuflash.reference.attention_backward_naive")
    return _backward_cupy(dout, q, k, v, out, lse, tdo, to, problem, softmax_scale, config)


# ---------------------------------------------------------------------------------------
# plans for CuPy arrays

_cupy_plans: dict = {}


class _NotCupy:
    """Stands in for cupy.ndarray until CuPy is imported (nothing is an instance of it)."""


def _cupy_ndarray_class():
    cupy = sys.modules.get("cupy")
    return cupy.ndarray if cupy is not None else _NotCupy


_CUPY_NDARRAY = _NotCupy


def _plain_scale(softmax_scale) -> bool:
    """A scale that can key a cached plan: None or a Python number (a list is unhashable, a
    0-d array hashes by identity and would key a new plan per call)."""
    return softmax_scale is None or softmax_scale.__class__ in (float, int)


def _drop_plans() -> None:
    _cupy_plans.clear()


compile_mod.on_change(_drop_plans)


def make_plan(problem: Problem, strides: dict, softmax_scale: float, device: int, config=None):
    """Select (family, config) for ``problem`` on ``device`` and build its launch plan."""
    from .launch import Plan
    from .select import choose_on_device

    _gpu.require(f"flash_attn ({problem.op})")
    family, cfg, _ = choose_on_device(problem, device, config)
    return Plan(family, cfg, problem, strides, softmax_scale, device)


class _CupyForward:
    """A forward plan for CuPy arrays of one shape: allocate out and LSE, launch."""

    def __init__(self, plan, q_shape, q_dtype, lse_shape, device):
        self.plan, self.q_shape, self.q_dtype, self.lse_shape = plan, q_shape, q_dtype, lse_shape
        self.device = device

    def forward(self, q, k, v):
        return self.forward_ptrs(q.data.ptr, k.data.ptr, v.data.ptr)

    def forward_ptrs(self, qp: int, kp: int, vp: int):
        cupy = _cupy()
        if cupy.cuda.runtime.getDevice() != self.device:
            with cupy.cuda.Device(self.device):
                return self.forward_ptrs(qp, kp, vp)
        out = cupy.empty(self.q_shape, self.q_dtype)
        lse = cupy.empty(self.lse_shape, _F32)
        if POISON_OUTPUTS:
            out.view(cupy.uint16).fill(0x7FFF)  # a NaN in bf16 and fp16 alike
            lse.fill(np.nan)
        self.plan.run((qp, kp, vp, out.data.ptr, lse.data.ptr), 0, cupy.cuda.get_current_stream().ptr)
        return out, lse


_F32 = np.dtype(np.float32)


def _cupy():
    import cupy

    return cupy


def out_strides(shape) -> tuple:
    """Element strides of a fresh contiguous array of ``shape``."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _forward_slow(q, k, v, softmax_scale, causal, deterministic, config, bwd_config):
    """First call of a shape (or an explicit config, or NumPy input): validate, then run."""
    global _CUPY_NDARRAY
    tq, tk, tv, scale, problem = check_qkv(q, k, v, softmax_scale, causal)
    check_config("config", config, problem)
    check_config("bwd_config", bwd_config, problem.replace(op="bwd"))
    batch, seqlen_q, nheads, _ = tq.shape
    _CUPY_NDARRAY = _cupy_ndarray_class()
    empty = batch == 0 or seqlen_q == 0 or nheads == 0
    if tq.kind == "numpy":
        if not empty and tk.shape[1] == 0:
            # attention over zero keys: every row fully masked, O = 0 and LSE = +inf; no GPU needed
            return np.zeros(q.shape, q.dtype), np.full((batch, nheads, seqlen_q), np.inf, np.float32)
        if empty:
            return np.empty(q.shape, q.dtype), np.empty((batch, nheads, seqlen_q), np.float32)
        _gpu.require("flash_attn_func")
        return _run_numpy(q, k, v, problem, scale, config)
    import cupy

    if empty or tk.shape[1] == 0:
        with cupy.cuda.Device(tq.device):
            out = cupy.empty(q.shape, dtype=q.dtype)
            lse = cupy.empty((batch, nheads, seqlen_q), dtype=cupy.float32)
            if not empty:  # attention over zero keys: every row fully masked
                out.view(cupy.uint16).fill(0)
                lse.fill(np.inf)
        return out, lse
    strides = {"q": tq.strides, "k": tk.strides, "v": tv.strides, "o": out_strides(tq.shape)}
    plan = _CupyForward(make_plan(problem, strides, scale, tq.device, config), tq.shape, q.dtype,
                        (batch, nheads, seqlen_q), tq.device)
    if _plain_scale(softmax_scale):  # explicit configs too (the tuner times them)
        _cupy_plans[(q.shape, q.strides, k.shape, k.strides, v.shape, v.strides, q.dtype, k.dtype,
                     v.dtype, tq.device, tk.device, tv.device, softmax_scale, causal, config)] = plan
    return plan.forward(q, k, v)


def _run_numpy(q, k, v, problem: Problem, scale: float, config):
    import cupy

    # Move raw 16-bit words: CuPy needs no bf16 dtype for that.
    dq, dk, dv = (cupy.asarray(np.ascontiguousarray(x).view(np.uint16)) for x in (q, k, v))
    strides = {"q": out_strides(dq.shape), "k": out_strides(dk.shape), "v": out_strides(dv.shape),
               "o": out_strides(dq.shape)}
    device = dq.device.id
    plan = _CupyForward(make_plan(problem, strides, scale, device, config), q.shape, cupy.uint16,
                        (problem.batch, problem.nheads, problem.seqlen_q), device)
    out, lse = plan.forward(dq, dk, dv)
    return cupy.asnumpy(out).view(q.dtype), cupy.asnumpy(lse)


def _backward_cupy(dout, q, k, v, out, lse, tdo, to, problem: Problem, scale: float, config):
    import cupy

    p = problem
    with cupy.cuda.Device(describe("q", q).device):
        dq, dk, dv = (cupy.empty(x.shape, x.dtype) for x in (q, k, v))
        if p.batch == 0 or p.nheads == 0:
            return dq, dk, dv
        if p.seqlen_q == 0 or p.seqlen_k == 0:  # no query rows or no keys: every gradient is zero
            for x in (dq, dk, dv):
                x.view(cupy.uint16).fill(0)
            return dq, dk, dv
        _gpu.require("flash_attn_backward")
        if layout_problem(tdo):
            dout = cupy.ascontiguousarray(dout)
            tdo = describe("dout", dout)
        _check_layout("out", to)
        lse = cupy.ascontiguousarray(lse)
        strides = {"dout": tdo.strides, "q": describe("q", q).strides, "k": describe("k", k).strides,
                   "v": describe("v", v).strides, "o": to.strides, "dq": out_strides(dq.shape),
                   "dk": out_strides(dk.shape), "dv": out_strides(dv.shape)}
        plan = make_plan(p, strides, scale, dq.device.id, config)
        if POISON_OUTPUTS:
            for x in (dq, dk, dv):
                x.view(cupy.uint16).fill(0x7FFF)
        workspace = cupy.empty(max(plan.workspace_bytes, 1), dtype=cupy.uint8)
        plan.run((dout.data.ptr, q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr,
                  dq.data.ptr, dk.data.ptr, dv.data.ptr), workspace.data.ptr,
                 cupy.cuda.get_current_stream().ptr)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------
# configs in force

def config_for(head_dim: int, dtype: str, causal: bool, device: int = 0,
               seqlen: Optional[int] = None, *, with_source: bool = False):
    """The forward config used for this problem class on ``device``: the tuned entry for this
    GPU and seqlen bucket (exact, then nearest bucket), else the heuristic default.
    with_source=True returns (config, source)."""
    from .select import config_for as _config_for

    _gpu.require("config_for")
    return _config_for("fwd", head_dim, dtype, causal, device, seqlen, with_source=with_source)


def bwd_config_for(head_dim: int, dtype: str, causal: bool, deterministic: bool = False,
                   device: int = 0, seqlen: Optional[int] = None, *, with_source: bool = False):
    """The backward config used for this problem class on ``device`` (as config_for)."""
    from .select import config_for as _config_for

    _gpu.require("bwd_config_for")
    return _config_for("bwd", head_dim, dtype, causal, device, seqlen, deterministic,
                       with_source=with_source)
