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

import contextlib
import contextvars
import math
import operator
import os
import sys
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Optional

import numpy as np

from . import _gpu
from . import compile as compile_mod
from .problem import Problem
from .registry import families
from .select import UnsupportedProblem

# Test hook: fill outputs with NaN (LSE with NaN) before each launch, so that an element the
# kernel fails to write shows up. Set from CUFLASH_POISON_OUTPUTS=1 or by tests.
POISON_OUTPUTS = os.environ.get("CUFLASH_POISON_OUTPUTS", "") not in ("", "0")

GRID_LIMIT = 65535  # gridDim.y / gridDim.z: heads and batch
MAX_HEAD_DIM = 256  # flash-attn's limit; head dims that are not a multiple of 8 are zero-padded


class UnsupportedFeature(UnsupportedProblem, NotImplementedError):
    """A feature (window, softcap, ALiBi, dropout, varlen) that no registered kernel family
    implements yet; the message names the argument. Both a ValueError (UnsupportedProblem,
    as selection raises) and a NotImplementedError."""


def padded_head_dim(head_dim: int) -> int:
    """The head dim the kernels run for a real one: the next multiple of 8 (the inputs are
    copied with zero columns appended; q.k and P.V are unchanged, the output is sliced), as
    long as that is at most MAX_HEAD_DIM; otherwise the head dim itself (and its error)."""
    padded = -(-head_dim // 8) * 8
    return padded if 0 < head_dim and padded <= MAX_HEAD_DIM else head_dim


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


_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16"}
_DTYPE_NAMES_CPU = {**_DTYPE_NAMES, "float32": "fp32", "float64": "fp64"}  # the reference: float64
# dtype_name of NumPy / CuPy arrays by dtype: str(numpy dtype) alone took ~1/5 of a tiny CuPy
# backward's host time (9 arrays described per call; cProfile, H100 host, session 19). Torch dtypes
# never meet this dict: torch.compile(fullgraph=True) cannot compare its NumPy keys (a graph break).
_dtype_name_cache: dict = {}


def dtype_name(x, kind: Optional[str] = None) -> Optional[str]:
    """'bf16' / 'fp16' (torch CPU tensors: also 'fp32' / 'fp64'), None for anything else.
    kind: _kind(x), when the caller has it."""
    kind = _kind(x) if kind is None else kind
    if kind == "torch":
        names = _DTYPE_NAMES_CPU if x.device.type == "cpu" else _DTYPE_NAMES
        return names.get(str(x.dtype).replace("torch.", ""))
    try:
        return _dtype_name_cache[x.dtype]
    except KeyError:
        name = _dtype_name_cache[x.dtype] = _DTYPE_NAMES.get(str(x.dtype))
        return name
    except TypeError:  # an unhashable dtype-like attribute: no caching
        return _DTYPE_NAMES.get(str(x.dtype))


def _check_array(name: str, x, ndim: int, dims: str) -> str:
    """The array's kind ("cupy", "numpy", "torch"), after checking it is one with ``ndim`` dims."""
    kind = _kind(x)
    if kind not in ("cupy", "numpy", "torch"):
        raise TypeError(f"{name}: expected a CuPy array, NumPy array or torch tensor, "
                        f"got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions ({dims}), got shape {tuple(x.shape)}")
    return kind


def describe(name: str, x) -> _Tensor:
    kind = _check_array(name, x, 4, "batch, seqlen, nheads, headdim")
    dtype = dtype_name(x, kind)
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


FEATURES = {  # Problem.features name -> (argument, what it is)
    "alibi": ("alibi_slopes", "ALiBi"),
    "dropout": ("dropout_p", "dropout"),
    "paged": ("block_table", "a paged K/V cache (block_table)"),
    "softcap": ("softcap", "softcapping"),
    "varlen": ("cu_seqlens_q/cu_seqlens_k", "variable-length sequences (varlen)"),
    "window": ("window_size", "sliding window"),
}


@dataclass
class FeatureArgs:
    """The validated feature arguments of one call. ``features``: the sorted Problem.features
    names (empty: the call is a plain one, e.g. window_size=(-1, 0) is causal=True);
    ``causal`` and ``window_size`` normalized as flash-attn does (causal sets right = 0)."""
    causal: bool
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: object = None
    dropout_p: float = 0.0
    features: tuple = ()
    given: dict = None  # feature name -> the argument as the caller wrote it (for messages)


def _real(name: str, value, what: str) -> float:
    """A real number (0-d arrays and tensors too, a bool not), else TypeError naming it."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be {what}, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}") from None


def check_window(window_size) -> tuple:
    """window_size as (left, right) ints >= -1 (-1: unbounded), else an error naming it."""
    try:
        pair = tuple(window_size)
    except TypeError:
        pair = None
    if pair is None or len(pair) != 2 or not all(
            isinstance(w, Integral) and not isinstance(w, (bool, np.bool_)) for w in pair):
        raise TypeError(f"window_size must be a pair (left, right) of ints, -1 for unbounded, "
                        f"got {window_size!r}")
    left, right = int(pair[0]), int(pair[1])
    if left < -1 or right < -1:
        raise ValueError(f"window_size must be >= -1 on both sides (-1: unbounded), got {window_size!r}")
    return left, right


def _device_of(x, kind: str):
    if kind == "torch":
        return x.device.index if x.device.type == "cuda" else None
    return x.device.id if kind == "cupy" else None


def check_alibi(alibi_slopes, tq: _Tensor, batch: int, nheads: int):
    """alibi_slopes: fp32 (nheads,) or (batch, nheads), q's kind of array on q's device."""
    kind = _kind(alibi_slopes)
    if kind != tq.kind:
        raise TypeError(f"alibi_slopes: expected a {tq.kind} array like q, got "
                        f"{type(alibi_slopes).__name__}")
    dtype = str(alibi_slopes.dtype).replace("torch.", "")
    if dtype != "float32":
        raise TypeError(f"alibi_slopes: dtype must be float32, got {dtype}")
    shape = tuple(int(n) for n in alibi_slopes.shape)
    if shape not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes: expected shape (nheads,) = ({nheads},) or (batch, nheads) = "
                         f"({batch}, {nheads}), got {shape}")
    device = _device_of(alibi_slopes, kind)
    if kind != "numpy" and device != tq.device:
        raise ValueError(f"alibi_slopes: must be on q's device {tq.device}, got {alibi_slopes.device}")
    return alibi_slopes


def check_features(tq: _Tensor, dropout_p=0.0, window_size=(-1, -1), softcap=0.0,
                   alibi_slopes=None, causal=False, batch: int = 0, nheads: int = 0,
                   seqlens=None) -> FeatureArgs:
    """Validate the feature arguments (every error names one) and normalize them.
    ``seqlens``: (seqlen_q, seqlen_k) of a fixed-length call, where a window bound that
    reaches past every key is dropped (exactly: left >= seqlen_k - 1, right >= seqlen_q - 1);
    None for varlen."""
    p = _real("dropout_p", dropout_p, "a number in [0, 1)")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    cap = _real("softcap", softcap, "a finite number >= 0 (0: off)")
    if not math.isfinite(cap) or cap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0: off), got {softcap!r}")
    left, right = check_window(window_size)
    if alibi_slopes is not None:
        check_alibi(alibi_slopes, tq, batch, nheads)
    causal = bool(causal)
    if causal:
        right = 0
    if seqlens is not None:
        seqlen_q, seqlen_k = seqlens
        if left >= max(seqlen_k - 1, 0):
            left = -1
        if right >= max(seqlen_q - 1, 0) and not causal:
            right = -1
    if (left, right) == (-1, 0):
        causal = True  # flash-attn: causal is the window (-1, 0)
    window = (left, right) if (left, right) not in ((-1, -1), (-1, 0)) else (-1, -1)
    given = {}
    if p:
        given["dropout"] = f"dropout_p={dropout_p!r}"
    if cap:
        given["softcap"] = f"softcap={softcap!r}"
    if alibi_slopes is not None:
        given["alibi"] = "alibi_slopes"
    if window != (-1, -1):
        given["window"] = f"window_size={tuple(window_size)!r}"
    return FeatureArgs(causal, window, cap, alibi_slopes, p, tuple(sorted(given)), given)


def raise_unsupported(problem: Problem, given: dict) -> None:
    """GPU input with features: raise UnsupportedFeature naming the arguments unless some
    registered family supports the problem (none does yet: then the launch is not wired)."""
    # the reasons of the problem the GPU paths run: an odd head dim is padded (not the reason)
    reasons = [f.supports((99, 9), _head_dim_padded(problem))
               for f in families(problem.op, problem.dtype)]
    names = [f for f in problem.features]
    args = ", ".join(given.get(f, FEATURES[f][0]) for f in names)
    whats = [FEATURES[f][1] for f in names]
    what = whats[0] if len(whats) == 1 else ", ".join(whats[:-1]) + " and " + whats[-1]
    verb = "is" if len(whats) == 1 else "are"
    if not reasons or all(reasons):
        raise UnsupportedFeature(
            f"{args}: {what} {verb} not implemented by any registered kernel family yet "
            f"({'; '.join(dict.fromkeys(reasons)) or 'no family for op ' + problem.op}); "
            "torch CPU tensors run it on the float64 reference (cuflash.reference)")
    raise UnsupportedFeature(f"{args}: {what} {verb} supported by a kernel family, but cuflash.api "
                             "does not pass it to the kernels yet")


def _head_dim_padded(problem: Problem) -> Problem:
    """``problem`` with its head dim zero-padded to a multiple of 8, as the GPU paths run it
    (``padded_head_dim``)."""
    padded = padded_head_dim(problem.head_dim)
    return problem if padded == problem.head_dim else problem.replace(head_dim=padded)


def gpu_supported(problem: Problem) -> bool:
    """Whether some registered family runs ``problem`` (features included) on some GPU, its
    head dim zero-padded to a multiple of 8 as the GPU paths do (``padded_head_dim``)."""
    problem = _head_dim_padded(problem)
    return any(not f.supports((99, 9), problem) for f in families(problem.op))


def feature_problem(problem: Problem, feats: "FeatureArgs") -> Problem:
    """``problem`` with the call's normalized feature flags and run-time values."""
    slopes = feats.alibi_slopes
    return problem.replace(causal=feats.causal, features=feats.features,
                           window=tuple(int(w) for w in feats.window_size),
                           softcap=float(feats.softcap),
                           alibi_batched=slopes is not None and len(slopes.shape) == 2)


_feature_plans: dict = {}


def feature_plan(problem: Problem, strides: dict, softmax_scale: float, device: int, config=None):
    """The launch plan of a problem, cached per (problem with its feature values, strides,
    scale, device, config): the CuPy backward's plans (plain or with features) and the feature
    calls'. A plan with features runs through ``Plan.run_fields({"alibi_slopes": address}, ...)``.
    Cached because a plan is made once per call shape: its dynamic scheduler's counters are
    zeroed with a device synchronization when it is made (cuflash.launch.StreamCounters)."""
    key = (problem, tuple((name, tuple(st)) for name, st in strides.items()), softmax_scale,
           device, config)
    plan = _feature_plans.get(key)
    if plan is None:
        plan = _feature_plans[key] = make_plan(problem, strides, softmax_scale, device, config)
    return plan


def check_supported(problem: Problem) -> None:
    """Raise (naming the argument) unless some registered family can run ``problem`` on some
    GPU. Needs no GPU; the device's own check comes with selection."""
    from .select import UnsupportedProblem

    reasons = [f.supports((99, 9), problem) for f in families(problem.op, problem.dtype)]
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
    if padded_head_dim(head_dim) == head_dim:  # else the kernels read zero-padded copies
        for name, t in (("q", tq), ("k", tk), ("v", tv)):
            _check_layout(name, t)
    softmax_scale = check_scale(softmax_scale, head_dim)
    dtype = tq.dtype if tq.dtype in ("bf16", "fp16") else "bf16"  # torch CPU: any float
    problem = Problem(op, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim,
                      bool(causal), bool(deterministic))
    padded = padded_head_dim(head_dim)  # the kernels run zero-padded copies (api/torch_ops)
    check_supported(problem if padded == head_dim else problem.replace(head_dim=padded))
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
                    return_attn_probs: bool = False, *, config=None, bwd_config=None,
                    dropout_seed=None, q_descale=None, k_descale=None, v_descale=None):
    """Exact attention, FlashAttention-2 algorithm; same signature as flash_attn's.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim),
    nheads % nheads_kv == 0 (GQA / MQA). headdim at most 256 (the kernels run a multiple of
    8: other head dims are zero-padded copies, the output sliced back).
    causal: bottom-right aligned mask (query i sees key j iff j <= i + seqlen_k - seqlen_q);
    fully masked rows give 0 (and LSE = +inf).
    softmax_scale: default 1/sqrt(headdim); must be finite and > 0.
    window_size=(left, right): query i sees keys i + seqlen_k - seqlen_q - left .. + right
    (-1: unbounded; causal sets right = 0). softcap > 0: scores -> softcap·tanh(scores/softcap).
    alibi_slopes: fp32 (nheads,) or (batch, nheads); adds -slope·|i + seqlen_k - seqlen_q - j|.
    dropout_p: probability of dropping an attention weight (kept ones scaled by 1/(1-p)).
    Window, softcap and ALiBi run on the GPU kernels (forward and backward; fa2_fwd, sm90_fwd,
    fa2_bwd), and so does dropout (fa2_fwd / fa2_bwd, Philox keep mask: cuflash/dropout.py),
    alone or combined with window, softcap and ALiBi (sm90_fwd / sm90_bwd run dropout alone;
    the mix falls back to fa2_fwd / fa2_bwd). A feature no family runs raises
    cuflash.api.UnsupportedFeature (a ValueError and a NotImplementedError) naming the
    arguments, before any launch. Dropout's RNG state is (seed, offset), 64 bits each:
      * torch CUDA tensors: drawn per call from torch's CUDA generator into a device tensor
        (torch.manual_seed reproduces it; CUDA-graph replays draw anew), saved for autograd's
        backward; or dropout_seed;
      * CuPy / NumPy arrays: dropout_seed is required: an int (offset 0) or a pair
        (seed, offset) of ints; pass the same to flash_attn_backward. A call with the same
        seed drops the same elements: vary the seed (or offset) between steps;
      * torch CPU tensors: torch's CPU generator (torch.rand), or with dropout_seed the
        kernels' keep mask of that seed (the one a GPU call with it drops);
      * under torch.compile (ops cuflash::fwd_dropout / bwd_dropout): drawn inside the graph
        from torch's generator (a new state per call and per CUDA-graph replay), or dropout_seed.
    dropout_seed: for torch also an int64 tensor (2,) on q's device (read by the kernels).
    deterministic: the backward (torch autograd) adds dQ contributions in a fixed order, so
    gradients are bitwise reproducible (slower); the forward is always deterministic.
    config / bwd_config: an explicit kernel config (e.g. cuflash.FwdConfig / BwdConfig) instead
    of the tuned or heuristic one; bwd_config applies to torch autograd's backward.
    q_descale, k_descale, v_descale: FP8 inputs (torch.float8_e4m3fn; CuPy uint8 e4m3 bytes with
    a descale given) run the FP8 forward (cuflash.fp8: sm_90, forward only, bf16 output): fp32
    descale factors, (1,) or (batch, nheads_kv), flash-attn 3's arguments.

    Returns out (like q), or (out, softmax_lse, S_dmask) when return_attn_probs: softmax_lse
    is fp32 (batch, nheads, seqlen_q), natural log; S_dmask without dropout is empty, shape (0,),
    q's dtype and device, as flash-attn returns it (_no_probs); with dropout on torch CPU the keep mask, bool
    (batch, nheads, seqlen_q, seqlen_k), True = kept; with dropout on the GPU, as flash-attn:
    the probabilities P, fp32 (batch, nheads, seqlen_q, seqlen_k), dropped entries negated,
    computed on the side from the kernels' LSE and the NumPy mirror of their mask (for
    testing: O(seqlen_q·seqlen_k) memory and a host synchronization).
    """
    if q_descale is not None or k_descale is not None or v_descale is not None or _is_fp8(q):
        return _fp8_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                         deterministic, return_attn_probs, config, bwd_config, q_descale, k_descale,
                         v_descale)
    windowed = _windowed(window_size)
    if dropout_p or softcap or alibi_slopes is not None or windowed:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(q, torch.Tensor) and dropout_seed is None \
                and not (dropout_p and return_attn_probs):  # the cached call shapes' route
            res = (_torch_ops or _load_torch_ops()).features_attention(
                q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, config, bwd_config, return_attn_probs)
            if res is not None:
                return (*res, _no_probs(q)) if return_attn_probs else res[0]
        return _features_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                              alibi_slopes, deterministic, return_attn_probs, config, bwd_config,
                              dropout_seed)
    if dropout_seed is not None:
        check_dropout_seed(dropout_seed, q)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(q, torch.Tensor):
        out, lse = (_torch_ops or _load_torch_ops()).attention(
            q, k, v, softmax_scale, causal, deterministic, config, bwd_config, return_attn_probs)
        return (out, lse, _no_probs(q)) if return_attn_probs else out
    if type(q) is _CUPY_NDARRAY and type(k) is _CUPY_NDARRAY and type(v) is _CUPY_NDARRAY \
            and bwd_config is None and _plain_scale(softmax_scale):
        qd, kd, vd = q.data, k.data, v.data
        try:
            plan = _cupy_plans.get((q.shape, q.strides, k.shape, k.strides, v.shape, v.strides,
                                    q.dtype, k.dtype, v.dtype, qd.device_id, kd.device_id,
                                    vd.device_id, softmax_scale, causal, config))
        except TypeError:  # an unhashable config or causal: validation names it
            plan = None
        if plan is not None:
            qp, kp, vp = qd.ptr, kd.ptr, vd.ptr
            if not (qp | kp | vp) & 15:
                out, lse = plan.forward_ptrs(qp, kp, vp)
                return (out, lse, _no_probs(q)) if return_attn_probs else out
    out, lse = _forward_slow(q, k, v, softmax_scale, causal, deterministic, config, bwd_config)
    return (out, lse, _no_probs(q)) if return_attn_probs else out


def _no_probs(q):
    """S_dmask of a call without dropout: as flash-attn 2.8 returns it (torch.empty((0,),
    dtype=q.dtype, device=q.device) in flash_attn_interface's forward when it does not return
    the softmax), an empty (0,) tensor of q's dtype on q's device; NumPy / CuPy: an empty (0,)
    array of q's dtype in q's library."""
    if hasattr(q, "new_empty"):   # torch
        return q.new_empty((0,))
    if type(q).__module__.startswith("cupy"):
        return _cupy().empty((0,), q.dtype)
    return np.empty((0,), q.dtype)


_FP8_OF: dict = {}  # NumPy dtype -> is it e4m3 (str() of a NumPy dtype costs ~2 µs per call)


def _is_fp8(x) -> bool:
    dtype = getattr(x, "dtype", "")
    if not isinstance(dtype, np.dtype):  # torch dtypes (str is cheap; torch.compile traces it)
        return str(dtype).endswith("float8_e4m3fn")
    try:
        return _FP8_OF[dtype]
    except (KeyError, TypeError):  # a first sight, or an unhashable dtype attribute
        fp8 = str(dtype).endswith("float8_e4m3fn")
        try:
            _FP8_OF[dtype] = fp8
        except TypeError:
            pass
        return fp8


def _windowed(window_size) -> bool:
    """Whether window_size asks for a window: a tuple is compared as it is (the common case, on
    the hot path; a bad one is validated where the window is used), anything else validated
    first (lists, arrays)."""
    if type(window_size) is tuple:
        return window_size != (-1, -1)
    return check_window(window_size) != (-1, -1)


def _fp8_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
              deterministic, return_attn_probs, config, bwd_config, q_descale, k_descale, v_descale):
    """FP8 inputs: cuflash.fp8 (forward only, none of the features yet)."""
    from . import fp8

    windowed = _windowed(window_size)
    given = {"dropout_p": dropout_p, "softcap": softcap, "alibi_slopes": alibi_slopes is not None,
             "window_size": windowed, "bwd_config": bwd_config is not None}
    unsupported = [name for name, on in given.items() if on]
    if unsupported:
        raise UnsupportedFeature(f"{unsupported[0]}: not implemented for FP8 (e4m3) inputs yet")
    return fp8.flash_attn_fp8_func(q, k, v, softmax_scale, causal, q_descale, k_descale, v_descale,
                                   return_attn_probs, config)


_torch_ops = None  # cuflash.torch_ops once loaded (an import statement per call: ~0.4 µs)


def _load_torch_ops():
    global _torch_ops
    from . import torch_ops

    _torch_ops = torch_ops
    return torch_ops


def _is_torch_cpu(t: _Tensor) -> bool:
    return t.kind == "torch" and t.device is None


def _features_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   deterministic, return_attn_probs, config, bwd_config, dropout_seed=None):
    """flash_attn_func with a non-default feature argument: validate them all, then run the
    torch CPU reference, or raise UnsupportedFeature for GPU inputs (before any launch)."""
    tq, tk, tv, scale, problem = check_qkv(q, k, v, softmax_scale, causal)
    batch, seqlen_q, nheads, _ = tq.shape
    feats = check_features(tq, dropout_p, window_size, softcap, alibi_slopes, causal, batch, nheads,
                           (seqlen_q, tk.shape[1]))
    if not feats.features:  # e.g. window_size=(-1, 0), or one reaching past every key
        return flash_attn_func(q, k, v, 0.0, softmax_scale, feats.causal, (-1, -1), 0.0, None,
                               deterministic, return_attn_probs, config=config, bwd_config=bwd_config,
                               dropout_seed=dropout_seed)
    problem = feature_problem(problem, feats)
    check_config("config", config, problem.replace(features=()))
    check_config("bwd_config", bwd_config, problem.replace(op="bwd", features=()))
    if dropout_seed is not None:
        check_dropout_seed(dropout_seed, q)
    if not _is_torch_cpu(tq):
        if "dropout" in feats.features:  # alone, or with window / softcap / ALiBi
            problem = problem.replace(dropout_p=feats.dropout_p, deterministic=bool(deterministic))
            if feats.features != ("dropout",) and not gpu_supported(problem):
                raise_unsupported(problem, feats.given)
            return _dropout_func(q, k, v, tq, tk, problem, scale, dropout_seed, return_attn_probs,
                                 config, bwd_config, feats.alibi_slopes)
        if not gpu_supported(problem):
            raise_unsupported(problem, feats.given)
        if tq.kind == "torch":
            from . import torch_ops

            out, lse = torch_ops.attention_features(q, k, v, scale, feats, deterministic, config,
                                                    bwd_config)
        else:
            out, lse = _features_forward(q, k, v, tq, tk, problem, scale, feats.alibi_slopes, config)
        return (out, lse, _no_probs(q)) if return_attn_probs else out
    from . import torch_ops

    if "dropout" in feats.features and (dropout_seed is not None
                                        or sys.modules["torch"].compiler.is_compiling()):
        # the ops cuflash::fwd_dropout / bwd_dropout: the reference with the kernels' keep mask
        # of the seed (the GPU's), and what torch.compile traces; window / softcap / ALiBi too
        problem = problem.replace(dropout_p=feats.dropout_p, deterministic=bool(deterministic))
        return _dropout_func(q, k, v, tq, tk, problem, scale, dropout_seed, return_attn_probs,
                             config, bwd_config, feats.alibi_slopes)
    out, lse, mask = torch_ops.attention_reference(q, k, v, scale, feats)
    return (out, lse, _no_probs(q) if mask is None else mask) if return_attn_probs else out


def _features_forward(q, k, v, tq, tk, problem: Problem, scale: float, slopes, config):
    """(out, lse) of a call with features (window, softcap, ALiBi) on CuPy or NumPy arrays."""
    import cupy

    p = problem
    if tq.kind == "numpy":
        _gpu.require("flash_attn_func")
        dq, dk, dv = (cupy.asarray(np.ascontiguousarray(x).view(np.uint16)) for x in (q, k, v))
        ds = None if slopes is None else cupy.asarray(np.ascontiguousarray(slopes))
        out, lse = _features_forward(dq, dk, dv, describe_raw(dq), describe_raw(dk), p, scale, ds,
                                     config)
        return cupy.asnumpy(out).view(q.dtype), cupy.asnumpy(lse)
    padded = padded_head_dim(p.head_dim)
    if padded != p.head_dim and p.batch and p.seqlen_q and p.nheads and p.seqlen_k:
        qp, kp, vp = (pad_head_dim(x, padded) for x in (q, k, v))
        out, lse = _features_forward(qp, kp, vp, describe_raw(qp), describe_raw(kp),
                                     p.replace(head_dim=padded), scale, slopes, config)
        return slice_head_dim(out, p.head_dim), lse
    with cupy.cuda.Device(q.device.id):
        out = cupy.empty(q.shape, dtype=q.dtype)
        lse = cupy.empty((p.batch, p.nheads, p.seqlen_q), dtype=cupy.float32)
        if p.batch == 0 or p.nheads == 0 or p.seqlen_q == 0:
            return out, lse
        if p.seqlen_k == 0:  # attention over zero keys: every row fully masked
            out.view(cupy.uint16).fill(0)
            lse.fill(np.inf)
            return out, lse
        strides = {"q": tq.strides, "k": tk.strides, "v": describe_raw(v).strides,
                   "o": out_strides(tq.shape)}
        plan = feature_plan(p, strides, scale, q.device.id, config)
        slopes_ptr = 0
        if slopes is not None:
            slopes = cupy.ascontiguousarray(slopes)
            slopes_ptr = slopes.data.ptr
        if POISON_OUTPUTS:
            out.view(cupy.uint16).fill(0x7FFF)
            lse.fill(np.nan)
        plan.run_fields({"alibi_slopes": slopes_ptr},
                        (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr), 0,
                        cupy.cuda.get_current_stream().ptr)
    return out, lse


def describe_raw(x) -> _Tensor:
    """Shape, element strides and address of a CuPy array of any 16-bit dtype (raw uint16
    copies of NumPy input included): what a launch needs, no dtype check."""
    item = x.dtype.itemsize
    return _Tensor("cupy", None, tuple(int(n) for n in x.shape),
                   tuple(int(st) // item for st in x.strides), x.data.ptr, x.device.id)


def check_dropout_seed(dropout_seed, q=None) -> tuple:
    """dropout_seed as (seed, offset), ints in [0, 2**64): an int (offset 0) or a pair of ints;
    for torch q also an int64 tensor (2,) on q's device (then (None, None): its values stay on
    the device). Else an error naming dropout_seed."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dropout_seed, torch.Tensor):
        if q is None or _kind(q) != "torch" or q.device.type != "cuda":
            raise TypeError("dropout_seed: a tensor state is for torch CUDA inputs; pass an int "
                            "or a pair (seed, offset) of ints")
        if dropout_seed.dtype != torch.int64 or tuple(dropout_seed.shape) != (2,) \
                or dropout_seed.device != q.device:
            raise ValueError(f"dropout_seed: expected an int64 tensor of shape (2,) (seed, offset) "
                             f"on {q.device}, got {dropout_seed.dtype} {tuple(dropout_seed.shape)} "
                             f"on {dropout_seed.device}")
        return None, None
    pair = (dropout_seed, 0) if isinstance(dropout_seed, Integral) else dropout_seed
    try:
        seed, offset = pair
    except (TypeError, ValueError):
        seed = offset = None
    if not all(isinstance(x, Integral) and not isinstance(x, (bool, np.bool_)) for x in (seed, offset)):
        raise TypeError(f"dropout_seed must be an int or a pair (seed, offset) of ints, got "
                        f"{dropout_seed!r}")
    if not (0 <= int(seed) < 2 ** 64 and 0 <= int(offset) < 2 ** 64):
        raise ValueError(f"dropout_seed: seed and offset must be in [0, 2**64), got {dropout_seed!r}")
    return int(seed), int(offset)


def _mix_values(problem: Problem) -> tuple:
    """(window, softcap) of a dropout problem, as the kernels take them ((-1, -1) and 0: off)."""
    window = problem.window if "window" in problem.features else (-1, -1)
    return window, (problem.softcap if "softcap" in problem.features else 0.0)


def _dropout_func(q, k, v, tq: _Tensor, tk: _Tensor, problem: Problem, scale: float, dropout_seed,
                  return_attn_probs: bool, config, bwd_config, slopes=None):
    """flash_attn_func with dropout, alone or with window / softcap / ALiBi (the problem's
    features and values, cuflash.api.feature_problem; slopes: the ALiBi slopes or None), on
    GPU inputs (validated): torch through cuflash.torch_ops (autograd), CuPy / NumPy with an
    explicit dropout_seed."""
    b, sq, h, _ = tq.shape
    sk = tk.shape[1]
    window, softcap = _mix_values(problem)
    if tq.kind == "torch":
        from . import torch_ops

        import torch

        if b == 0 or sq == 0 or h == 0 or sk == 0:  # no attention weight to drop
            out, lse, _ = flash_attn_func(q, k, v, 0.0, scale, problem.causal, window, softcap,
                                          slopes, deterministic=problem.deterministic,
                                          return_attn_probs=True, config=config,
                                          bwd_config=bwd_config)
            probs = torch.zeros((b, h, sq, sk), device=q.device,  # (CPU: the keep mask's bool)
                                dtype=torch.bool if q.device.type == "cpu" else torch.float32)
            return (out, lse, probs) if return_attn_probs else out
        rng = None if dropout_seed is None else torch_ops.rng_state_of(dropout_seed, q.device)
        if rng is not None and rng is dropout_seed:  # the caller's state tensor: autograd's backward regenerates the
            rng = rng.clone()    # forward's mask from it, so a later in-place update must not reach it
        out, lse, rng = torch_ops.dropout_attention(q, k, v, problem, scale, rng, config, bwd_config,
                                                    slopes)
        if not return_attn_probs:
            return out
        if q.device.type == "cpu":  # S_dmask on the CPU: the keep mask (reads rng on the host)
            return out, lse, torch.from_numpy(torch_ops.keep_mask_of(rng, problem.dropout_p, b, h,
                                                                     sq, sk))
        return out, lse, torch_ops.dropout_probs(q, k, v, lse, scale, problem.causal,
                                                 problem.dropout_p, rng, window, softcap, slopes)
    if dropout_seed is None:
        raise ValueError(f"dropout_seed: {tq.kind} inputs with dropout_p > 0 need an explicit "
                         "dropout_seed (an int, or a pair (seed, offset) of ints), the same one "
                         "for flash_attn_backward")
    seed, offset = check_dropout_seed(dropout_seed)
    out, lse = _dropout_cupy(q, k, v, tq, problem, scale, seed, offset, config, slopes)
    if not return_attn_probs:
        return out
    from .dropout import dropout_probs_host

    xp = np if tq.kind == "numpy" else _cupy()
    probs = dropout_probs_host(_host16(q), _host16(k), _host_f32(lse), problem.dtype, scale,
                               problem.causal, problem.dropout_p, seed, offset, window=window,
                               softcap=softcap,
                               alibi_slopes=None if slopes is None else _host_f32(slopes))
    return out, lse, (probs if xp is np else xp.asarray(probs))


def _host16(x) -> np.ndarray:
    """x's 16-bit words on the host (NumPy or CuPy; any 16-bit float dtype)."""
    return (x.view(np.uint16) if isinstance(x, np.ndarray) else x.view(np.uint16).get())


def _host_f32(x) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.get()


def _dropout_cupy(q, k, v, tq: _Tensor, problem: Problem, scale: float, seed: int, offset: int,
                  config, slopes=None):
    """(out, lse) with dropout for CuPy arrays (current stream) or NumPy arrays (through the
    GPU), the RNG state (seed, offset) given; the problem's window / softcap / ALiBi (slopes:
    q's kind of fp32 array, or None) too."""
    b, sq, h, d = tq.shape
    if b == 0 or sq == 0 or h == 0 or k.shape[1] == 0:  # no attention weight to drop
        if problem.features == ("dropout",):
            return _forward_slow(q, k, v, scale, problem.causal, False, config, None)
        window, softcap = _mix_values(problem)
        out, lse, _ = flash_attn_func(q, k, v, 0.0, scale, problem.causal, window, softcap, slopes,
                                      return_attn_probs=True, config=config)
        return out, lse
    padded = padded_head_dim(d)
    if padded != d:  # the padded copies are fresh and contiguous: describe them, not q
        shape = (b, sq, h, padded)
        tp = _Tensor(tq.kind, tq.dtype, shape, out_strides(shape), 0, tq.device)
        out, lse = _dropout_cupy(*(pad_head_dim(x, padded) for x in (q, k, v)), tp, problem.replace(
            head_dim=padded), scale, seed, offset, config, slopes)
        return slice_head_dim(out, d), lse
    _gpu.require("flash_attn_func (dropout)")
    cupy = _cupy()
    if tq.kind == "numpy":
        dq, dk, dv = (cupy.asarray(np.ascontiguousarray(x).view(np.uint16)) for x in (q, k, v))
        ds = None if slopes is None else cupy.asarray(np.ascontiguousarray(slopes, np.float32))
        out, lse = _dropout_cupy(dq, dk, dv, describe("q", dq.view(cupy.float16)), problem, scale,
                                 seed, offset, config, ds)
        return cupy.asnumpy(out).view(q.dtype), cupy.asnumpy(lse)
    with cupy.cuda.Device(tq.device):
        item = q.dtype.itemsize  # k, v may be raw 16-bit words here (NumPy inputs)
        strides = {"q": tq.strides, "k": tuple(n // item for n in k.strides),
                   "v": tuple(n // item for n in v.strides), "o": out_strides(tq.shape)}
        plan = make_plan(problem, strides, scale, tq.device, config)
        rng = cupy.asarray(np.array([seed, offset], dtype=np.uint64))
        out = cupy.empty(q.shape, q.dtype)
        lse = cupy.empty((b, h, sq), cupy.float32)
        if POISON_OUTPUTS:
            out.view(cupy.uint16).fill(0x7FFF)
            lse.fill(np.nan)
        slopes = None if slopes is None else cupy.ascontiguousarray(slopes)  # alive past launch
        plan.run_with((q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr), 0,
                      cupy.cuda.get_current_stream().ptr, _dropout_extras(rng, slopes))
    return out, lse


def _split_packed(packed, dim: int) -> tuple:
    """packed's slices along dim (the q / k / v of a packed tensor): torch's unbind for torch tensors, whose
    gradient is one stack of the slices' gradients (slicing by index gives each slice's gradient as a
    zero-filled buffer of packed's size, then adds them: ~3x the memory traffic), views by index otherwise."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(packed, torch.Tensor):
        return packed.unbind(dim)
    index = (slice(None),) * dim
    return tuple(packed[index + (i,)] for i in range(packed.shape[dim]))


def _packed_route(q, packed, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                  deterministic, return_attn_probs, config, bwd_config, dropout_seed):
    """The packed functions' torch route (torch_ops.attention_packed: the gradient written by the
    kernels into one packed buffer, no per-slice zero-filled buffers), or None for the per-tensor
    route of flash_attn_func on the slices: features, FP8, arrays other than torch's, calls that
    need no gradient, torch.compile."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(packed, torch.Tensor) or (q is not None and not isinstance(q, torch.Tensor)):
        return None
    if dropout_p or softcap or alibi_slopes is not None or dropout_seed is not None or _windowed(window_size) \
            or _is_fp8(packed):
        return None
    res = (_torch_ops or _load_torch_ops()).attention_packed(q, packed, softmax_scale, causal, deterministic,
                                                              config, bwd_config, return_attn_probs)
    if res is None:
        return None
    out, lse = res
    return (out, lse, _no_probs(out)) if return_attn_probs else out


def flash_attn_qkvpacked_func(qkv, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                              causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
                              alibi_slopes=None, deterministic: bool = False,
                              return_attn_probs: bool = False, *, config=None, bwd_config=None,
                              dropout_seed=None):
    """flash_attn_func with q, k, v packed: qkv (batch, seqlen, 3, nheads, headdim). The same
    as flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], ...) (strided views, no copy).
    With torch autograd (eager, no dropout / window / softcap / ALiBi) the backward kernels write
    dq, dk, dv into one gradient buffer shaped like qkv, as flash-attn does (no per-slice
    zero-filled gradients to add: _packed_route)."""
    if getattr(qkv, "ndim", None) != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv: expected shape (batch, seqlen, 3, nheads, headdim), got "
                         f"{tuple(getattr(qkv, 'shape', ())) or type(qkv).__name__}")
    res = _packed_route(None, qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                        deterministic, return_attn_probs, config, bwd_config, dropout_seed)
    if res is not None:
        return res
    return flash_attn_func(*_split_packed(qkv, 2), dropout_p, softmax_scale,
                           causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs, config=config, bwd_config=bwd_config,
                           dropout_seed=dropout_seed)


def flash_attn_kvpacked_func(q, kv, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                             causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
                             alibi_slopes=None, deterministic: bool = False,
                             return_attn_probs: bool = False, *, config=None, bwd_config=None,
                             dropout_seed=None):
    """flash_attn_func with k, v packed: kv (batch, seqlen_k, 2, nheads_kv, headdim); kv's gradient
    written by the kernels into one buffer, as flash_attn_qkvpacked_func's."""
    if getattr(kv, "ndim", None) != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv: expected shape (batch, seqlen_k, 2, nheads_kv, headdim), got "
                         f"{tuple(getattr(kv, 'shape', ())) or type(kv).__name__}")
    res = _packed_route(q, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                        deterministic, return_attn_probs, config, bwd_config, dropout_seed)
    if res is not None:
        return res
    return flash_attn_func(q, *_split_packed(kv, 2), dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                           config=config, bwd_config=bwd_config, dropout_seed=dropout_seed)


def _check_varlen_tensor(name: str, x) -> None:
    _check_array(name, x, 3, "total_tokens, nheads, headdim: the varlen layout")


def _host_ints(x, kind: str) -> np.ndarray:
    if kind == "torch":
        return x.detach().cpu().numpy()
    if kind == "cupy":
        return x.get()
    return np.asarray(x)


def check_int32(name: str, x, tq: _Tensor) -> None:
    """x is an int32 array of q's kind, else TypeError naming it (cu_seqlens, block_table)."""
    if _kind(x) != tq.kind:
        raise TypeError(f"{name}: expected a {tq.kind} array like q, got {type(x).__name__}")
    dtype = str(x.dtype).replace("torch.", "")
    if dtype != "int32":
        raise TypeError(f"{name}: dtype must be int32, got {dtype}")


def check_cu_seqlens(name: str, cu, tq: _Tensor, total: int, nseq: Optional[int] = None) -> np.ndarray:
    """cu_seqlens: int32, 1-D, (batch + 1), 0 first, non-decreasing, ``total`` last; q's kind of
    array on q's device. Returns the values (host int64). Reads them back from the GPU (a sync)."""
    check_int32(name, cu, tq)
    kind = tq.kind
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name}: expected a 1-D array of batch + 1 offsets, got shape {tuple(cu.shape)}")
    if nseq is not None and cu.shape[0] != nseq + 1:
        raise ValueError(f"{name}: expected batch + 1 = {nseq + 1} offsets (as cu_seqlens_q), "
                         f"got {cu.shape[0]}")
    if kind != "numpy" and _device_of(cu, kind) != tq.device:
        raise ValueError(f"{name}: must be on q's device {tq.device}, got {cu.device}")
    if _values_unreadable(cu, kind):
        return None  # torch.compile tracing or CUDA-graph capture: no device-to-host read
    return check_cu_values(name, _host_ints(cu, kind).astype(np.int64), total)


def check_cu_values(name: str, values: np.ndarray, total: Optional[int]) -> np.ndarray:
    """cu_seqlens' values read back (host int64): 0 first, non-decreasing, ``total`` last (None:
    a paged cache's cu_seqlens_k, whose differences are the lengths), else an error naming it."""
    if total is None:  # a paged cache's cu_seqlens_k: the differences are the lengths
        if values[0] != 0 or (np.diff(values) < 0).any():
            raise ValueError(f"{name}: must start at 0 and never decrease, got {values.tolist()}")
        return values
    if values[0] != 0 or (np.diff(values) < 0).any() or values[-1] != total:
        raise ValueError(f"{name}: must start at 0, never decrease and end at the total number of "
                         f"tokens {total}, got {values.tolist()}")
    return values


# Whether flash_attn_varlen_func reads GPU cu_seqlens back to check their values (a device-to-host
# copy and a sync per call). CUFLASH_VARLEN_CHECK=0 (or setting this False) trusts them, as
# flash-attn does: wrong offsets then read and write out of bounds. Never read while
# torch.compile traces or a CUDA graph is captured.
CHECK_CU_SEQLENS = os.environ.get("CUFLASH_VARLEN_CHECK", "1") not in ("0", "")
# Set by trusted_cu_seqlens() for callers whose offsets are valid by construction.
_TRUSTED_CU_SEQLENS = contextvars.ContextVar("cuflash_trusted_cu_seqlens", default=False)


@contextlib.contextmanager
def trusted_cu_seqlens():
    """Within this context (this thread / task), the varlen calls do not read GPU cu_seqlens back
    to check them (as CHECK_CU_SEQLENS off: no device-to-host copy and sync per call), for callers
    whose offsets are valid by construction, e.g. cuflash.unpad_input's. Calls made after it exits
    (an autograd backward) check as before."""
    token = _TRUSTED_CU_SEQLENS.set(True)
    try:
        yield
    finally:
        _TRUSTED_CU_SEQLENS.reset(token)


def _values_unreadable(cu, kind: str) -> bool:
    """Whether GPU cu_seqlens are not read back now: CHECK_CU_SEQLENS off, or a torch tensor
    while torch.compile traces (fake tensors) or a CUDA graph is being captured (a sync would
    break the capture). The values are then the caller's responsibility, as in flash-attn."""
    if kind == "numpy":
        return False  # host values (the CPU reference needs them)
    if kind == "torch":
        if sys.modules["torch"].compiler.is_compiling():
            # fake tensors while torch.compile traces: no values (checked before the context
            # variable, whose get() dynamo cannot trace)
            return True
        if cu.device.type != "cuda":
            return False
    if not CHECK_CU_SEQLENS or _TRUSTED_CU_SEQLENS.get():
        return True
    if kind != "torch":
        return False
    import torch

    return torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing()


def check_max_seqlen(name: str, value, cu: Optional[np.ndarray]) -> int:
    """max_seqlen: an int >= the longest sequence of ``cu`` (None: values unknown, >= 0)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    longest = 0 if cu is None else int(np.diff(cu).max()) if len(cu) > 1 else 0
    if n < 0:
        raise ValueError(f"{name}={n} must be >= 0")
    if n < longest:
        raise ValueError(f"{name}={n} is less than the longest sequence ({longest} tokens)")
    return int(n)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                           causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
                           alibi_slopes=None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table=None, *,
                           dropout_seed=None):
    """Attention over a batch of sequences of different lengths, packed without padding.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_kv, headdim); sequence i is rows
    cu_seqlens_q[i]:cu_seqlens_q[i+1] of q and cu_seqlens_k[i]:cu_seqlens_k[i+1] of k, v
    (int32, batch + 1). max_seqlen_q/k: ints >= the longest. causal, window_size and ALiBi are
    bottom-right aligned per sequence. Other arguments as flash_attn_func.

    Returns out (total_q, nheads, headdim), or (out, softmax_lse, S_dmask): softmax_lse fp32
    (nheads, total_q); S_dmask empty without dropout (as flash_attn_func's), else on torch CPU the keep mask (bool,
    (batch, nheads, max_seqlen_q, max_seqlen_k), sequence i in its top-left corner), on the
    GPU flash-attn's probabilities with the dropped entries negated, fp32, same shape and
    corners (computed on the side for testing, as flash_attn_func's).

    torch CPU tensors run the float64 reference (autograd). GPU inputs run the varlen kernels
    (forward sm90_fwd on sm_90, else fa2_fwd; backward fa2_bwd; built with varlen; torch:
    autograd, torch.compile, CUDA graphs; CuPy on the current stream; NumPy copied to the
    GPU), with window, softcap, ALiBi (slopes (nheads,)
    or (batch, nheads), row i of the sequence's index) or dropout too. Dropout's keep mask of
    sequence i is that of the dense call of it alone at batch index i (cuflash/dropout.py);
    its RNG state as flash_attn_func's (dropout_seed: required for CuPy / NumPy, optional for
    torch); with window / softcap / ALiBi too (the S_dmask probabilities with them applied).
    cu_seqlens values are checked (a device-to-host read) except
    while torch.compile traces or a CUDA graph is captured.
    block_table: int32 (batch, max_num_blocks) page ids of a paged K/V cache (forward only):
    k, v are then (num_blocks, page_block_size, nheads_kv, headdim), key j of sequence i is row
    j % page_block_size of page block_table[i, j // page_block_size], and cu_seqlens_k gives
    the sequences' numbers of keys (its differences; its last value need not be anything).
    Any page_block_size >= 1 (flash-attn requires a multiple of 256). Page ids are checked
    (0 <= id < num_blocks, enough columns for each sequence) where cu_seqlens are; the kernels
    clamp them besides, so no id reads outside k, v. Window, softcap and ALiBi apply. Dropout
    (flash-attn's paged kernel silently runs without it) gathers the sequences' keys and values
    from their pages (a copy) and runs the varlen call on them: the same mask and result as that
    call, its backward too (torch autograd through the gather into k, v); not while the lengths
    cannot be read (torch.compile tracing, CUDA graph capture: UnsupportedFeature naming
    dropout_p and block_table). Without dropout a backward
    through it raises NotImplementedError naming block_table (flash-attn's fails too), also
    under torch.compile (op cuflash::varlen_fwd_paged; the graph compiles, the backward raises
    when it runs). torch CPU tensors under torch.compile: block_table through the op's CPU
    impl (the reference); without block_table the call runs eagerly (a graph break).
    """
    if block_table is not None:
        return _varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                             return_attn_probs, block_table, deterministic, dropout_seed)
    if dropout_seed is None and not (dropout_p and return_attn_probs):
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(q, torch.Tensor):  # the cached call shapes' route
            from . import varlen_torch

            res = varlen_torch.fast_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                              max_seqlen_k, dropout_p, softmax_scale, causal,
                                              window_size, softcap, alibi_slopes, deterministic,
                                              return_attn_probs)
            if res is not None:
                return (*res, _no_probs(q)) if return_attn_probs else res[0]
    checked = varlen_checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    if checked is None:  # torch CPU tensors while torch.compile traces
        # the float64 reference reads cu_seqlens on the host: torch.compile runs it eagerly
        return sys.modules["torch"].compiler.disable(flash_attn_varlen_func)(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs, dropout_seed=dropout_seed)
    tq, scale, problem, feats, cu_q, cu_k, max_q, max_k = checked
    nseq, nheads = problem.batch, tq.shape[2]
    if dropout_seed is not None:
        check_dropout_seed(dropout_seed, q)
    if not _is_torch_cpu(tq):
        if feats.features != ("varlen",):  # window, softcap, ALiBi, dropout
            return _varlen_features_gpu(q, k, v, tq, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale,
                                        feats, problem, deterministic, return_attn_probs,
                                        dropout_seed)
        out, lse = _varlen_gpu(q, k, v, tq, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale,
                               feats.causal, deterministic)
        return (out, lse, _no_probs(q)) if return_attn_probs else out
    from . import torch_ops

    keep = None
    if "dropout" in feats.features and dropout_seed is not None:
        # the kernels' keep mask of the seed (sequence i's: the dense call of it alone at batch
        # index i), as flash_attn_func's CPU path takes it
        keep = _varlen_seed_mask(dropout_seed, feats.dropout_p, cu_q, cu_k, nheads, max_q, max_k)
    out, lse, mask = torch_ops.attention_reference(q, k, v, scale, feats, (cu_q, cu_k, max_q, max_k), keep)
    return (out, lse, _no_probs(q) if mask is None else mask) if return_attn_probs else out


def varlen_checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes):
    """flash_attn_varlen_func's validation (every error names its argument): (tq, scale, problem,
    feats, cu_q, cu_k, max_q, max_k), the problem with the sequences' count and longest lengths
    and the features ("varlen" among them), cu_q / cu_k the offsets on the host (None where they
    are not read back); None for torch CPU tensors while torch.compile traces (checked no
    further: the caller runs the call eagerly)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_varlen_tensor(name, x)
    tq, tk, tv, scale, problem = check_qkv(q[None], k[None], v[None], softmax_scale, causal)
    if _is_torch_cpu(tq) and sys.modules["torch"].compiler.is_compiling():
        return None
    _, total_q, nheads, _ = tq.shape
    total_k = tk.shape[1]
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, tq, total_q)
    nseq = int(cu_seqlens_q.shape[0]) - 1
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, tq, total_k, nseq)
    max_q = check_max_seqlen("max_seqlen_q", max_seqlen_q, cu_q)
    max_k = check_max_seqlen("max_seqlen_k", max_seqlen_k, cu_k)
    feats = check_features(tq, dropout_p, window_size, softcap, alibi_slopes, causal, nseq, nheads)
    feats.features = tuple(sorted(feats.features + ("varlen",)))
    problem = problem.replace(batch=nseq, seqlen_q=max_q, seqlen_k=max_k, causal=feats.causal,
                              features=feats.features)
    if nseq > GRID_LIMIT:
        raise ValueError(f"cu_seqlens_q: batch ({nseq}) must be <= {GRID_LIMIT} (CUDA grid limit)")
    return tq, scale, problem, feats, cu_q, cu_k, max_q, max_k


def _varlen_seed_mask(dropout_seed, p: float, cu_q, cu_k, nheads: int, max_q: int, max_k: int):
    """bool (batch, nheads, max_q, max_k) torch CPU tensor: sequence i's keep mask of the seed
    (cuflash.dropout.keep_mask at batch index i) in its top-left corner, False elsewhere."""
    import torch

    from . import dropout

    seed, offset = check_dropout_seed(dropout_seed)
    nseq = len(cu_q) - 1
    out = np.zeros((nseq, nheads, max_q, max_k), bool)
    for i in range(nseq):
        lq, lk = int(cu_q[i + 1] - cu_q[i]), int(cu_k[i + 1] - cu_k[i])
        if lq and lk:
            out[i, :, :lq, :lk] = dropout.keep_mask(seed, offset, p, 1, nheads, lq, lk, first_batch=i)[0]
    return torch.from_numpy(out)


def _varlen_gpu(q, k, v, tq: _Tensor, cu_seqlens_q, cu_seqlens_k, max_q: int, max_k: int,
                scale: float, causal: bool, deterministic: bool):
    """(out, lse) of a validated varlen call by the varlen kernels (cuflash.varlen): torch
    (autograd, torch.compile, CUDA graphs), CuPy (current stream) or NumPy (copied)."""
    from . import varlen

    if tq.kind == "torch":
        from . import varlen_torch

        return varlen_torch.attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale,
                                      causal, deterministic)
    d = tq.shape[3]
    padded = padded_head_dim(d)
    if tq.kind == "numpy":
        total_q, nheads = tq.shape[1], tq.shape[2]
        if total_q == 0 or nheads == 0 or max_q == 0 or k.shape[0] == 0 or max_k == 0:
            lse = np.full((nheads, total_q), np.inf, np.float32)
            return np.zeros(q.shape, q.dtype), lse
        _gpu.require("flash_attn_varlen_func")
        if padded != d:
            out, lse = varlen.forward_numpy(*(pad_head_dim(x, padded) for x in (q, k, v)),
                                            cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale, causal)
            return np.ascontiguousarray(out[..., :d]), lse
        return varlen.forward_numpy(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale, causal)
    if padded != d:
        out, lse = varlen.forward_cupy(*(pad_head_dim(x, padded) for x in (q, k, v)), cu_seqlens_q,
                                       cu_seqlens_k, max_q, max_k, scale, causal)
        return slice_head_dim(out, d), lse
    return varlen.forward_cupy(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale, causal)


def flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q, max_seqlen_k, softmax_scale: Optional[float] = None,
                               causal: bool = False, deterministic: bool = False, *,
                               window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                               dropout_p: float = 0.0, dropout_seed=None):
    """Gradients (dq, dk, dv) of flash_attn_varlen_func's output (CuPy arrays or torch CUDA
    tensors; torch autograd calls the same kernels). out and softmax_lse ((nheads, total_q)
    fp32) are what flash_attn_varlen_func(..., return_attn_probs=True) returned.
    window_size, softcap, alibi_slopes, dropout_p: the forward's; dropout_seed (required with
    dropout_p > 0): the forward's, an int, a pair (seed, offset), or for torch an int64 (2,)
    state tensor on q's device."""
    for name, x in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out)):
        _check_varlen_tensor(name, x)
    tq, tk, tv, scale, problem = check_qkv(q[None], k[None], v[None], softmax_scale, causal)
    total_q, nheads, total_k = tq.shape[1], tq.shape[2], tk.shape[1]
    tdo, to = check_bwd_tensors(tq, dout[None], out[None], _lse_as_batched(softmax_lse, tq))
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, tq, total_q)
    nseq = int(cu_seqlens_q.shape[0]) - 1
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, tq, total_k, nseq)
    max_q = check_max_seqlen("max_seqlen_q", max_seqlen_q, cu_q)
    max_k = check_max_seqlen("max_seqlen_k", max_seqlen_k, cu_k)
    windowed = _windowed(window_size)
    if dropout_p or softcap or alibi_slopes is not None or windowed:
        feats = check_features(tq, dropout_p, window_size, softcap, alibi_slopes, causal, nseq, nheads)
        causal = feats.causal
        if feats.features:
            if tq.kind == "numpy" or _is_torch_cpu(tq):
                raise TypeError("flash_attn_varlen_backward takes CuPy arrays or torch CUDA tensors; "
                                "for NumPy use cuflash.reference.attention_backward_varlen_naive")
            feats.features = tuple(sorted(feats.features + ("varlen",)))
            problem = feature_problem(problem.replace(op="bwd", batch=nseq, seqlen_q=max_q,
                                                      seqlen_k=max_k, deterministic=bool(deterministic)),
                                      feats).replace(dropout_p=feats.dropout_p)
            return _varlen_features_backward(dout, q, k, v, out, softmax_lse, tq, cu_seqlens_q,
                                             cu_seqlens_k, problem, scale, feats, dropout_seed)
    if tq.kind == "numpy" or _is_torch_cpu(tq):
        raise TypeError("flash_attn_varlen_backward takes CuPy arrays or torch CUDA tensors; for "
                        "NumPy use cuflash.reference.attention_backward_varlen_naive")
    d = tq.shape[3]
    padded = padded_head_dim(d)
    if tq.kind == "torch":
        from . import varlen_torch

        return varlen_torch.backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k,
                                     max_q, max_k, scale, bool(causal), bool(deterministic))
    from . import varlen

    if padded != d:
        grads = varlen.backward_cupy(*(pad_head_dim(x, padded) for x in (dout, q, k, v, out)),
                                     softmax_lse, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale,
                                     causal, deterministic)
        return tuple(slice_head_dim(g, d) for g in grads)
    return varlen.backward_cupy(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_q,
                                max_k, scale, causal, deterministic)


def check_block_table(block_table, tq: _Tensor, nseq: int, num_pages: int, page: int,
                      lens_k) -> None:
    """block_table: int32 (batch, max_num_blocks), q's kind on q's device; where the lengths
    are known (lens_k, host ints) every sequence's pages fit its row and every id it uses is in
    [0, num_pages) (a device-to-host read, as cu_seqlens')."""
    check_int32("block_table", block_table, tq)
    kind = tq.kind
    if block_table.ndim != 2 or block_table.shape[0] != nseq:
        raise ValueError(f"block_table: expected shape (batch, max_num_blocks) with batch = {nseq}, "
                         f"got {tuple(block_table.shape)}")
    if block_table.shape[1] < 1:
        raise ValueError(f"block_table: needs at least one column (page id) per sequence, got shape "
                         f"{tuple(block_table.shape)}")
    if kind != "numpy" and _device_of(block_table, kind) != tq.device:
        raise ValueError(f"block_table: must be on q's device {tq.device}, got {block_table.device}")
    if lens_k is None or _values_unreadable(block_table, kind):
        return
    cols = int(block_table.shape[1])
    need = [-(-int(n) // page) for n in lens_k]
    if max(need, default=0) > cols:
        b = int(np.argmax(need))
        raise ValueError(f"block_table: sequence {b} has {int(lens_k[b])} keys, {need[b]} pages of "
                         f"{page}, but block_table has {cols} columns")
    ids = _host_ints(block_table, kind)
    for b, n in enumerate(need):
        used = ids[b, :n]
        if n and (used.min() < 0 or used.max() >= num_pages):
            raise ValueError(f"block_table: sequence {b} uses page ids {used.tolist()}, outside "
                             f"[0, {num_pages}) (k has {num_pages} pages)")


def _gather_pages(cache, block_table, lens_k, kind: str):
    """varlen.gather_paged on q's kind of array: the page ids read on the host, the rows indexed
    where the cache lives."""
    from . import varlen

    ids = _host_ints(block_table, kind)
    if kind == "cupy":
        import cupy

        page = int(cache.shape[1])
        idx = [(ids[b][np.arange(n) // page], np.arange(n) % page) for b, n in enumerate(int(x) for x in lens_k)]
        pages = np.concatenate([i[0] for i in idx] + [np.zeros(0, np.int64)]).astype(np.int64)
        within = np.concatenate([i[1] for i in idx] + [np.zeros(0, np.int64)]).astype(np.int64)
        return cupy.ascontiguousarray(cache[cupy.asarray(pages), cupy.asarray(within)])
    if kind == "torch":
        return varlen.gather_paged(cache, ids, lens_k, xp="torch").contiguous()
    return np.ascontiguousarray(varlen.gather_paged(cache, ids, lens_k))


def _cu_like(values, like, kind: str):
    """int32 cumulative lengths as an array of ``like``'s kind and device."""
    values = np.asarray(values, np.int32)
    if kind == "torch":
        import torch

        return torch.as_tensor(values, device=like.device)
    if kind == "cupy":
        import cupy

        return cupy.asarray(values)
    return values


def _varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                  softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
                  block_table, deterministic=False, dropout_seed=None):
    """flash_attn_varlen_func with block_table: validated (every error names its argument),
    then fa2_fwd_paged (GPU) or the float64 reference on the gathered keys (torch CPU); with
    dropout the varlen call on the gathered keys (any kind, a backward too)."""
    _check_varlen_tensor("q", q)
    for name, x in (("k", k), ("v", v)):
        _check_array(name, x, 4, "num_blocks, page_block_size, nheads_k, headdim: a paged cache "
                     "with block_table")
    if k.shape[0] < 1 or k.shape[1] < 1:
        raise ValueError(f"k: a paged cache needs at least one block of at least one key, got shape "
                         f"{tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v: shape must equal k's {tuple(k.shape)}, got {tuple(v.shape)}")
    tq, tk1, tv1, scale, problem = check_qkv(q[None], k[:1], v[:1], softmax_scale, causal)
    tk, tv = describe("k", k), describe("v", v)
    if padded_head_dim(tq.shape[3]) == tq.shape[3]:
        _check_layout("k", tk)
        _check_layout("v", tv)
    num_pages, page = int(k.shape[0]), int(k.shape[1])
    _, total_q, nheads, _ = tq.shape
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, tq, total_q)
    nseq = int(cu_seqlens_q.shape[0]) - 1
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, tq, None, nseq)
    max_q = check_max_seqlen("max_seqlen_q", max_seqlen_q, cu_q)
    max_k = check_max_seqlen("max_seqlen_k", max_seqlen_k, cu_k)
    check_block_table(block_table, tq, nseq, num_pages, page, None if cu_k is None else np.diff(cu_k))
    feats = check_features(tq, dropout_p, window_size, softcap, alibi_slopes, causal, nseq, nheads)
    feats.features = tuple(sorted(feats.features + ("paged", "varlen")))
    if nseq > GRID_LIMIT:
        raise ValueError(f"cu_seqlens_q: batch ({nseq}) must be <= {GRID_LIMIT} (CUDA grid limit)")
    problem = feature_problem(problem.replace(batch=nseq, seqlen_q=max_q, seqlen_k=max_k), feats)
    if "dropout" in feats.features:
        # no paged kernel draws the mask: the keys and values gathered from their pages (a copy of
        # total_k rows), then the varlen call on them, whose mask it is (sequence i's at batch index
        # i), with its backward (torch autograd reaches k, v through the gather)
        if cu_k is None:   # the lengths are not readable now (torch.compile tracing, graph capture)
            raise UnsupportedFeature(f"dropout_p={dropout_p!r}, block_table: dropout with a paged K/V "
                                     "cache gathers the pages by the sequence lengths, which cannot be "
                                     "read while torch.compile traces or a CUDA graph is captured "
                                     "(check_cu_seqlens); pass dropout_p=0 or run it eagerly")
        kp, vp = (_gather_pages(x, block_table, np.diff(cu_k), tq.kind) for x in (k, v))
        cu_gathered = _cu_like(np.concatenate([[0], np.cumsum(np.diff(cu_k))]), cu_seqlens_k, tq.kind)
        return flash_attn_varlen_func(q, kp, vp, cu_seqlens_q, cu_gathered, max_seqlen_q, max_seqlen_k,
                                      dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                      deterministic, return_attn_probs, dropout_seed=dropout_seed)
    if _is_torch_cpu(tq) and cu_k is None:  # torch.compile tracing: the op's CPU impl
        from . import varlen_torch

        out, lse = varlen_torch.attention_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table,
                                                max_q, max_k, scale, feats)
        return (out, lse, _no_probs(q)) if return_attn_probs else out
    if _is_torch_cpu(tq):  # the reference on the keys gathered from their pages
        from . import torch_ops, varlen

        kp, vp = (varlen.gather_paged(x, block_table, np.diff(cu_k), xp="torch") for x in (k, v))
        out, lse, _ = torch_ops.attention_reference(q, kp, vp, scale, feats, (cu_q, cu_k, max_q, max_k))
        return (out, lse, _no_probs(q)) if return_attn_probs else out
    if not gpu_supported(problem):
        raise_unsupported(problem, feats.given)
    if tq.kind == "torch":
        from . import varlen_torch

        out, lse = varlen_torch.attention_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table,
                                                max_q, max_k, scale, feats)
        return (out, lse, _no_probs(q)) if return_attn_probs else out
    from . import varlen

    d = tq.shape[3]
    padded = padded_head_dim(d)
    run = problem.replace(head_dim=padded)
    if tq.kind == "numpy":
        if total_q == 0 or nheads == 0 or max_q == 0 or max_k == 0:
            out, lse = np.zeros(q.shape, q.dtype), np.full((nheads, total_q), np.inf, np.float32)
            return (out, lse, _no_probs(q)) if return_attn_probs else out
        _gpu.require("flash_attn_varlen_func (block_table)")
        cupy = _cupy()
        xs = [cupy.asarray(np.ascontiguousarray(x).view(np.uint16)) for x in (q, k, v)]
        xs = xs if padded == d else [pad_head_dim(x, padded) for x in xs]
        ds = None if feats.alibi_slopes is None else cupy.asarray(np.ascontiguousarray(feats.alibi_slopes))
        out, lse = varlen.forward_cupy_paged(*xs, cupy.asarray(np.asarray(cu_seqlens_q, np.int32)),
                                             cupy.asarray(np.asarray(cu_seqlens_k, np.int32)),
                                             cupy.asarray(np.asarray(block_table, np.int32)), run, scale, ds)
        out = cupy.asnumpy(out).view(q.dtype)
        out, lse = (out if padded == d else np.ascontiguousarray(out[..., :d])), cupy.asnumpy(lse)
        return (out, lse, _no_probs(q)) if return_attn_probs else out
    xs = (q, k, v) if padded == d else tuple(pad_head_dim(x, padded) for x in (q, k, v))
    out, lse = varlen.forward_cupy_paged(*xs, cu_seqlens_q, cu_seqlens_k, block_table, run, scale,
                                         feats.alibi_slopes)
    out = out if padded == d else slice_head_dim(out, d)
    return (out, lse, _no_probs(q)) if return_attn_probs else out


def _varlen_features_gpu(q, k, v, tq: _Tensor, cu_seqlens_q, cu_seqlens_k, max_q: int, max_k: int,
                         scale: float, feats: FeatureArgs, problem: Problem, deterministic: bool,
                         return_attn_probs: bool, dropout_seed):
    """flash_attn_varlen_func with window / softcap / ALiBi / dropout on GPU inputs (validated):
    the varlen kernels with the feature flags (cuflash.varlen, cuflash.varlen_torch)."""
    from . import varlen

    problem = feature_problem(problem, feats).replace(dropout_p=feats.dropout_p)
    if not gpu_supported(problem):
        raise_unsupported(problem, feats.given)
    if tq.kind == "torch":
        from . import varlen_torch

        out, lse, rng = varlen_torch.attention_features(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q,
                                                        max_k, scale, feats, deterministic,
                                                        dropout_seed)
        if not return_attn_probs:
            return out
        probs = _no_probs(q) if rng is None else varlen_torch.dropout_probs(   # (empty: flash-attn 2.8's)
            q, k, lse, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale, feats.causal,
            feats.dropout_p, rng, feats.window_size, feats.softcap, feats.alibi_slopes)
        return out, lse, probs
    seed_offset = None
    if feats.dropout_p:
        if dropout_seed is None:
            raise ValueError(f"dropout_seed: {tq.kind} inputs with dropout_p > 0 need an explicit "
                             "dropout_seed (an int, or a pair (seed, offset) of ints), the same one "
                             "for flash_attn_varlen_backward")
        seed_offset = check_dropout_seed(dropout_seed)
    d = tq.shape[3]
    padded = padded_head_dim(d)
    xs = (q, k, v) if padded == d else tuple(pad_head_dim(x, padded) for x in (q, k, v))
    run = problem.replace(head_dim=padded)
    total_q, nheads = tq.shape[1], tq.shape[2]
    if tq.kind == "numpy":
        if total_q == 0 or nheads == 0 or max_q == 0 or k.shape[0] == 0 or max_k == 0:
            out, lse = np.zeros(q.shape, q.dtype), np.full((nheads, total_q), np.inf, np.float32)
        else:
            _gpu.require("flash_attn_varlen_func")
            out, lse = varlen.forward_numpy_features(*xs, cu_seqlens_q, cu_seqlens_k, run, scale,
                                                     feats.alibi_slopes, seed_offset)
            out = out if padded == d else np.ascontiguousarray(out[..., :d])
    else:
        out, lse = varlen.forward_cupy_features(*xs, cu_seqlens_q, cu_seqlens_k, run, scale,
                                                feats.alibi_slopes, seed_offset)
        out = out if padded == d else slice_head_dim(out, d)
    if not return_attn_probs:
        return out
    probs = _no_probs(q)   # (without dropout empty, flash-attn 2.8's)
    if seed_offset is not None:
        from .dropout import varlen_dropout_probs_host

        probs = varlen_dropout_probs_host(_host16(q), _host16(k), _host_f32(lse),
                                          _host_ints(cu_seqlens_q, tq.kind),
                                          _host_ints(cu_seqlens_k, tq.kind), max_q, max_k,
                                          problem.dtype, scale, feats.causal, feats.dropout_p,
                                          *seed_offset, window=tuple(feats.window_size),
                                          softcap=feats.softcap,
                                          alibi_slopes=None if feats.alibi_slopes is None
                                          else _host_f32(feats.alibi_slopes))
        probs = probs if tq.kind == "numpy" else _cupy().asarray(probs)
    return out, lse, probs


def _varlen_features_backward(dout, q, k, v, out, lse, tq: _Tensor, cu_seqlens_q, cu_seqlens_k,
                              problem: Problem, scale: float, feats: FeatureArgs, dropout_seed):
    """flash_attn_varlen_backward with features (validated; GPU inputs)."""
    if not gpu_supported(problem):
        raise_unsupported(problem, feats.given)
    seed_offset = rng = None
    if feats.dropout_p:
        if dropout_seed is None:
            raise ValueError("dropout_seed: flash_attn_varlen_backward with dropout_p > 0 needs the "
                             "forward's dropout_seed")
        seed_offset = check_dropout_seed(dropout_seed, q)
    window = tuple(int(w) for w in feats.window_size)
    if tq.kind == "torch":
        from . import torch_ops, varlen_torch

        if feats.dropout_p:
            rng = torch_ops.rng_state_of(dropout_seed, q.device)
        return varlen_torch.backward_features(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                              problem.seqlen_q, problem.seqlen_k, scale, feats.causal,
                                              problem.deterministic, feats.alibi_slopes, window,
                                              feats.softcap, feats.dropout_p, rng)
    from . import varlen

    d = tq.shape[3]
    padded = padded_head_dim(d)
    xs = (dout, q, k, v, out) if padded == d else tuple(pad_head_dim(x, padded)
                                                          for x in (dout, q, k, v, out))
    grads = varlen.backward_cupy_features(*xs, lse, cu_seqlens_q, cu_seqlens_k,
                                          problem.replace(head_dim=padded), scale, feats.alibi_slopes,
                                          seed_offset)
    return grads if padded == d else tuple(slice_head_dim(g, d) for g in grads)


def _lse_as_batched(lse, tq: _Tensor):
    """A varlen softmax_lse (nheads, total_q) as check_bwd_tensors' (1, nheads, total_q),
    after checking its shape (the error names softmax_lse)."""
    shape = tuple(int(n) for n in getattr(lse, "shape", ()))
    if shape != (tq.shape[2], tq.shape[1]):
        raise ValueError(f"softmax_lse: expected shape (nheads, total_q) = {(tq.shape[2], tq.shape[1])}, "
                         f"got {shape}")
    return lse[None]


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p: float = 0.0,
                                     softmax_scale: Optional[float] = None, causal: bool = False,
                                     window_size=(-1, -1), softcap: float = 0.0,
                                     alibi_slopes=None, deterministic: bool = False,
                                     return_attn_probs: bool = False, *, dropout_seed=None):
    """flash_attn_varlen_func with qkv (total, 3, nheads, headdim) and one cu_seqlens / max_seqlen (torch:
    the slices by unbind, so that autograd stacks their gradients into qkv's: _split_packed)."""
    if getattr(qkv, "ndim", None) != 4 or qkv.shape[1] != 3:
        raise ValueError(f"qkv: expected shape (total_tokens, 3, nheads, headdim), got "
                         f"{tuple(getattr(qkv, 'shape', ())) or type(qkv).__name__}")
    return flash_attn_varlen_func(*_split_packed(qkv, 1), cu_seqlens, cu_seqlens,
                                  max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
                                  window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, dropout_seed=dropout_seed)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                                    causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
                                    alibi_slopes=None, deterministic: bool = False,
                                    return_attn_probs: bool = False, *, dropout_seed=None):
    """flash_attn_varlen_func with kv (total_k, 2, nheads_kv, headdim)."""
    if getattr(kv, "ndim", None) != 4 or kv.shape[1] != 2:
        raise ValueError(f"kv: expected shape (total_tokens_k, 2, nheads_kv, headdim), got "
                         f"{tuple(getattr(kv, 'shape', ())) or type(kv).__name__}")
    return flash_attn_varlen_func(q, *_split_packed(kv, 1), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs,
                                  dropout_seed=dropout_seed)


def flash_attn_backward(dout, q, k, v, out, lse, softmax_scale: Optional[float] = None,
                        causal: bool = False, deterministic: bool = False, *, config=None,
                        window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                        dropout_p: float = 0.0, dropout_seed=None):
    """Gradients (dq, dk, dv) of flash_attn_func's output, given dout = dL/dout.

    out and lse are what ``flash_attn_func(q, k, v, ..., return_attn_probs=True)`` returned
    for the same q, k, v, softmax_scale and causal. CuPy arrays (current stream) or torch
    tensors (torch's current stream; no autograd: this is what autograd calls). dk, dv have
    k's shape: under GQA / MQA they are summed over the query heads sharing a K/V head.
    deterministic=True adds the dQ contributions in a fixed order (bitwise reproducible).
    window_size, softcap, alibi_slopes: the forward's (as flash_attn_func takes them).
    dropout_p, dropout_seed: the forward's (dropout_seed required with dropout_p > 0: an int,
    a pair (seed, offset), or for torch an int64 (2,) state tensor on q's device); the
    kernels regenerate the forward's keep mask from them, with window, softcap and ALiBi too.
    """
    if type(q) is _CUPY_NDARRAY and config is None and dropout_p == 0 and not softcap \
            and alibi_slopes is None and _plain_scale(softmax_scale) and _bwd_plans:
        grads = _backward_cupy_cached(dout, q, k, v, out, lse, softmax_scale, causal, deterministic,
                                      window_size)
        if grads is not None:
            return grads
    scale_arg = softmax_scale   # the caller's (None: the default), which keys the repeat-call plans
    tq, tk, tv, softmax_scale, problem = check_qkv(q, k, v, softmax_scale, causal, "bwd", deterministic)
    tdo, to = check_bwd_tensors(tq, dout, out, lse)
    if softcap or alibi_slopes is not None or tuple(window_size) != (-1, -1):
        feats = check_features(tq, dropout_p, window_size, softcap, alibi_slopes, causal,
                               tq.shape[0], tq.shape[2], (tq.shape[1], tk.shape[1]))
        if feats.features and feats.features != ("dropout",):
            problem = feature_problem(problem, feats).replace(dropout_p=feats.dropout_p)
            check_config("config", config, problem.replace(features=()))
            if not _is_torch_cpu(tq) and not gpu_supported(problem):
                raise_unsupported(problem, feats.given)
            if "dropout" in feats.features:  # with window / softcap / ALiBi: dropout's backward
                seed, offset = _backward_seed(dropout_seed, q)
                return _dropout_backward(dout, q, k, v, out, lse, tq, tdo, to, problem,
                                         softmax_scale, dropout_seed, seed, offset, config,
                                         alibi_slopes)
            if tq.kind == "torch":
                from . import torch_ops

                return torch_ops.backward_features(dout, q, k, v, out, lse, softmax_scale, feats,
                                                   bool(deterministic), config)
            if tq.kind == "numpy":
                raise TypeError("flash_attn_backward takes CuPy arrays or torch tensors; for NumPy "
                                "use cuflash.reference.attention_backward_naive")
            head_dim = tq.shape[3]
            padded = padded_head_dim(head_dim)
            if padded != head_dim:
                grads = flash_attn_backward(*(pad_head_dim(x, padded) for x in (dout, q, k, v, out)),
                                            lse, softmax_scale, feats.causal, deterministic,
                                            config=config, window_size=feats.window_size,
                                            softcap=feats.softcap, alibi_slopes=alibi_slopes)
                return tuple(slice_head_dim(g, head_dim) for g in grads)
            return _backward_cupy(dout, q, k, v, out, lse, tdo, to, problem, softmax_scale, config,
                                  alibi_slopes)
        causal = feats.causal
        problem = problem.replace(causal=causal)
    check_config("config", config, problem)
    feats = check_features(tq, dropout_p)
    if feats.dropout_p:
        seed, offset = _backward_seed(dropout_seed, q)
        problem = problem.replace(features=("dropout",), dropout_p=feats.dropout_p)
        return _dropout_backward(dout, q, k, v, out, lse, tq, tdo, to, problem, softmax_scale,
                                 dropout_seed, seed, offset, config)
    if tq.kind == "torch":
        from . import torch_ops

        return torch_ops.backward(dout, q, k, v, out, lse, softmax_scale, causal,
                                  bool(deterministic), config)
    if tq.kind == "numpy":
        raise TypeError("flash_attn_backward takes CuPy arrays or torch tensors; for NumPy "
                        "use cuflash.reference.attention_backward_naive")
    head_dim = tq.shape[3]
    padded = padded_head_dim(head_dim)
    if padded != head_dim:  # zero-padded copies; the gradients sliced back
        grads = flash_attn_backward(*(pad_head_dim(x, padded) for x in (dout, q, k, v, out)), lse,
                                    softmax_scale, causal, deterministic, config=config)
        return tuple(slice_head_dim(g, head_dim) for g in grads)
    plain = config is None and not softcap and alibi_slopes is None and tuple(window_size) == (-1, -1)
    key = _repeat_key(dout, q, k, v, out, lse, tdo, scale_arg, causal, deterministic) if plain else None
    return _backward_cupy(dout, q, k, v, out, lse, tdo, to, problem, softmax_scale, config, repeat_key=key)


def _repeat_key(dout, q, k, v, out, lse, tdo, softmax_scale, causal, deterministic):
    """The _bwd_plans key under which a plain CuPy backward keeps its plan for repeat calls of the
    same arrays' layout, or None where the fast path would not run exactly what the validated one
    does (a scale that is not a plain number, a non-contiguous LSE, a dout copied, non-bool flags)."""
    global _CUPY_NDARRAY
    _CUPY_NDARRAY = _cupy_ndarray_class()
    if not _plain_scale(softmax_scale) or causal.__class__ not in (bool, int) \
            or deterministic.__class__ not in (bool, int) \
            or not all(type(x) is _CUPY_NDARRAY for x in (dout, q, k, v, out, lse)) \
            or tuple(lse.strides) != tuple(4 * n for n in out_strides(lse.shape)) or layout_problem(tdo):
        return None
    return _bwd_key(dout, q, k, v, out, lse, softmax_scale, causal, deterministic)


# CuPy backward plans of plain calls (no features, no explicit config), by the six arrays' shapes,
# strides, dtypes and devices, the scale, causal and deterministic: a repeat call skips validation
# and selection (the CuPy forward's _cupy_plans, for the backward). Session 19: the CuPy backward
# took 110-170 µs of host time per call against the forward's 12-15 (H100 host, tiny problem).
_bwd_plans: dict = {}


def _bwd_key(dout, q, k, v, out, lse, softmax_scale, causal, deterministic):
    arrays = (dout, q, k, v, out, lse)
    try:
        key = tuple((x.shape, x.strides, x.dtype, x.data.device_id) for x in arrays) + (
            softmax_scale, bool(causal), bool(deterministic))
        hash(key)
    except TypeError:
        return None
    return key


def _backward_cupy_cached(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, window_size):
    """flash_attn_backward for a repeat plain CuPy call (its plan in _bwd_plans), or None (the
    validated path then runs, and registers the plan)."""
    if window_size != (-1, -1) and tuple(window_size) != (-1, -1):
        return None
    if causal.__class__ not in (bool, int) or deterministic.__class__ not in (bool, int):
        return None
    if not all(type(x) is _CUPY_NDARRAY for x in (dout, k, v, out, lse)):
        return None
    key = _bwd_key(dout, q, k, v, out, lse, softmax_scale, causal, deterministic)
    plan = None if key is None else _bwd_plans.get(key)
    if plan is None:
        return None
    ptrs = (dout.data.ptr, q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr)
    if (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4]) & 15:
        return None
    return plan.backward_ptrs(ptrs)


class _CupyBackward:
    """A backward plan for CuPy arrays of one shape: allocate dq, dk, dv (one pool allocation,
    256-byte aligned parts) and the workspace, launch."""

    def __init__(self, plan, shapes, dtype, device):
        cupy = _cupy()
        self.plan, self.shapes, self.dtype, self.device = plan, shapes, dtype, device
        sizes = [int(np.prod(sh)) * np.dtype(dtype).itemsize for sh in shapes]
        self._offsets, off = [], 0
        for n in sizes:
            self._offsets.append(off)
            off += -(-n // 256) * 256
        self._bytes, self._ws_bytes = off, max(plan.workspace_bytes, 1)
        self._alloc, self._ndarray, self._stream = cupy.cuda.alloc, cupy.ndarray, cupy.cuda.get_current_stream
        self._get_device = cupy.cuda.runtime.getDevice

    def backward_ptrs(self, ptrs: tuple):
        if self._get_device() != self.device:
            with _cupy().cuda.Device(self.device):
                return self.backward_ptrs(ptrs)
        mem = self._alloc(self._bytes)
        grads = tuple(self._ndarray(sh, self.dtype, mem + off) for sh, off in zip(self.shapes, self._offsets))
        if POISON_OUTPUTS:
            for g in grads:
                g.view(_cupy().uint16).fill(0x7FFF)
        workspace = self._alloc(self._ws_bytes)   # released to the pool after the launch (stream order)
        self.plan.run_current(ptrs + tuple(g.data.ptr for g in grads), workspace.ptr, self._stream().ptr)
        return grads


def _backward_seed(dropout_seed, q) -> tuple:
    """(seed, offset) of the forward's dropout_seed, which flash_attn_backward needs."""
    if dropout_seed is None:
        raise ValueError("dropout_seed: flash_attn_backward with dropout_p > 0 needs the "
                         "forward's dropout_seed")
    return check_dropout_seed(dropout_seed, q)


def _dropout_extras(rng, slopes) -> tuple:
    """The per-call pointers of a CuPy dropout launch (Plan.run_with): the (seed, offset) state
    and, with ALiBi, the slopes (contiguous, kept alive by the caller past the launch)."""
    extra = (("rng_state", rng.data.ptr),)
    return extra if slopes is None else extra + (("alibi_slopes", slopes.data.ptr),)


def _dropout_backward(dout, q, k, v, out, lse, tq, tdo, to, problem, scale, dropout_seed, seed,
                      offset, config, slopes=None):
    """flash_attn_backward with dropout (validated): torch (no autograd) or CuPy; the problem's
    window / softcap / ALiBi too (slopes: the ALiBi slopes or None)."""
    if tq.kind == "numpy":
        raise TypeError("flash_attn_backward takes CuPy arrays or torch tensors; for NumPy "
                        "use cuflash.reference.attention_backward_naive")
    if _is_torch_cpu(tq):  # (the GPU plans below would be handed CPU addresses)
        raise UnsupportedFeature("dropout_p: flash_attn_backward with dropout on torch CPU tensors "
                                 "is not implemented (the CPU forward draws its keep mask from "
                                 "torch's RNG, not from dropout_seed); use autograd (backward())")
    p = problem
    empty = p.batch == 0 or p.nheads == 0 or p.seqlen_q == 0 or p.seqlen_k == 0
    if empty:  # no attention weight: the plain backward's zeros
        return flash_attn_backward(dout, q, k, v, out, lse, scale, p.causal, p.deterministic,
                                   config=config)
    d = tq.shape[3]
    padded = padded_head_dim(d)
    if tq.kind == "torch":
        from . import torch_ops

        rng = torch_ops.rng_state_of(dropout_seed, q.device)
        if padded != d:
            args = [torch_ops._pad(x, padded) for x in (dout, q, k, v, out)]
            grads = torch_ops.dropout_backward(*args[:5], lse, p.replace(head_dim=padded), scale,
                                               rng, config, slopes)
            return tuple(g[..., :d].contiguous() for g in grads)
        return torch_ops.dropout_backward(dout, q, k, v, out, lse, p, scale, rng, config, slopes)
    if padded != d:
        grads = _dropout_backward(*(pad_head_dim(x, padded) for x in (dout, q, k, v, out)), lse,
                                  describe("q", pad_head_dim(q, padded)), None, None,
                                  p.replace(head_dim=padded), scale, dropout_seed, seed, offset,
                                  config, slopes)
        return tuple(slice_head_dim(g, d) for g in grads)
    cupy = _cupy()
    with cupy.cuda.Device(tq.device):
        rng = cupy.asarray(np.array([seed, offset], dtype=np.uint64))
        return _backward_cupy(dout, q, k, v, out, lse, describe("dout", dout), describe("out", out),
                              p, scale, config, slopes, rng=rng)


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
    _feature_plans.clear()
    _bwd_plans.clear()


compile_mod.on_change(_drop_plans)


def make_plan(problem: Problem, strides: dict, softmax_scale: float, device: int, config=None):
    """Select (family, config) for ``problem`` on ``device`` and build its launch plan."""
    from .launch import Plan
    from .select import choose_on_device

    _gpu.require(f"flash_attn ({problem.op})")
    family, cfg, _ = choose_on_device(problem, device, config)
    if config is None and getattr(cfg, "dynamic", False) and _capturing():
        # the dynamic scheduler's plan zeroes a tile counter when it is made, which cannot
        # happen inside a CUDA-graph capture: a shape first seen there gets the static
        # persistent schedule (same tiles, same results; config= still forces either)
        cfg = cfg.replace(dynamic=False)
    return Plan(family, cfg, problem, strides, softmax_scale, device)


def _capturing() -> bool:
    """Whether the current stream (torch's, or CuPy's) is capturing a CUDA graph."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return True
    cupy = sys.modules.get("cupy")
    return cupy is not None and cupy.cuda.get_current_stream().is_capturing()


class _CupyForward:
    """A forward plan for CuPy arrays of one shape: allocate out and LSE, launch.

    out and LSE share one pool allocation (LSE after out, 256-byte aligned): one pool call
    and two array headers per call instead of two ``cupy.empty``."""

    def __init__(self, plan, q_shape, q_dtype, lse_shape, device):
        cupy = _cupy()
        self.plan, self.q_shape, self.q_dtype, self.lse_shape = plan, q_shape, q_dtype, lse_shape
        self.device = device
        out_bytes = int(np.prod(q_shape)) * np.dtype(q_dtype).itemsize
        self._lse_offset = -(-out_bytes // 256) * 256
        self._bytes = self._lse_offset + int(np.prod(lse_shape)) * 4
        self._alloc, self._ndarray, self._stream = cupy.cuda.alloc, cupy.ndarray, cupy.cuda.get_current_stream
        self._get_device = cupy.cuda.runtime.getDevice

    def forward(self, q, k, v):
        return self.forward_ptrs(q.data.ptr, k.data.ptr, v.data.ptr)

    def forward_ptrs(self, qp: int, kp: int, vp: int):
        if self._get_device() != self.device:
            with _cupy().cuda.Device(self.device):
                return self.forward_ptrs(qp, kp, vp)
        mem = self._alloc(self._bytes)
        out = self._ndarray(self.q_shape, self.q_dtype, mem)
        lse = self._ndarray(self.lse_shape, _F32, mem + self._lse_offset)
        if POISON_OUTPUTS:
            out.view(_cupy().uint16).fill(0x7FFF)  # a NaN in bf16 and fp16 alike
            lse.fill(np.nan)
        self.plan.run_current((qp, kp, vp, mem.ptr, mem.ptr + self._lse_offset), 0, self._stream().ptr)
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
    batch, seqlen_q, nheads, head_dim = tq.shape
    _CUPY_NDARRAY = _cupy_ndarray_class()
    empty = batch == 0 or seqlen_q == 0 or nheads == 0
    padded = padded_head_dim(head_dim)
    if padded != head_dim and not empty and tk.shape[1] and (tq.kind != "numpy" or _gpu.available()):
        # zero-padded copies of q, k, v (the caller's arrays are only read), output sliced back
        out, lse = _forward_slow(*(pad_head_dim(x, padded) for x in (q, k, v)), scale, causal,
                                 deterministic, config, bwd_config)
        return slice_head_dim(out, head_dim), lse
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
    if _plain_scale(softmax_scale) and causal.__class__ in (bool, int):  # explicit configs too
        _cupy_plans[(q.shape, q.strides, k.shape, k.strides, v.shape, v.strides, q.dtype, k.dtype,
                     v.dtype, tq.device, tk.device, tv.device, softmax_scale, causal, config)] = plan
    return plan.forward(q, k, v)


def pad_head_dim(x, padded: int):
    """A fresh contiguous NumPy/CuPy array of x with zero columns appended to the head dim
    (copied as raw 16-bit words, so any 16-bit dtype works), on x's device."""
    if _kind(x) == "cupy":
        with x.device:  # CuPy allocates on the current device, not x's
            return _pad_head_dim(_cupy(), x, padded)
    return _pad_head_dim(np, x, padded)


def _pad_head_dim(xp, x, padded: int):
    out = xp.zeros(x.shape[:-1] + (padded,), dtype=np.uint16)
    out[..., :x.shape[-1]] = x.view(np.uint16)
    return out.view(x.dtype)


def slice_head_dim(x, head_dim: int):
    """A contiguous copy of x[..., :head_dim], on x's device."""
    if _kind(x) == "cupy":
        with x.device:
            return _cupy().ascontiguousarray(x.view(np.uint16)[..., :head_dim]).view(x.dtype)
    return np.ascontiguousarray(x.view(np.uint16)[..., :head_dim]).view(x.dtype)


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


def _backward_cupy(dout, q, k, v, out, lse, tdo, to, problem: Problem, scale: float, config,
                   slopes=None, rng=None, repeat_key=None):
    """repeat_key: where given (a plain call, _repeat_key), the plan is kept in _bwd_plans for repeat
    calls of the same layout."""
    import cupy

    p = problem
    with cupy.cuda.Device(describe("q", q).device):
        dq, dk, dv = (cupy.empty(x.shape, x.dtype) for x in (q, k, v))
        if p.batch == 0 or p.nheads == 0 or p.seqlen_q == 0 or p.seqlen_k == 0:
            # no query heads, rows or keys: every gradient is zero (nheads == 0 leaves k, v
            # with elements: dk, dv must not be left uninitialized)
            for x in (dq, dk, dv):
                x.view(cupy.uint16).fill(0)
            return dq, dk, dv
        _gpu.require("flash_attn_backward")
        if layout_problem(tdo):
            # a copy, not ascontiguousarray: that returns a contiguous but misaligned dout itself
            dout = dout.copy(order="C")
            tdo = describe("dout", dout)
        _check_layout("out", to)
        lse = cupy.ascontiguousarray(lse)
        strides = {"dout": tdo.strides, "q": describe("q", q).strides, "k": describe("k", k).strides,
                   "v": describe("v", v).strides, "o": to.strides, "dq": out_strides(dq.shape),
                   "dk": out_strides(dk.shape), "dv": out_strides(dv.shape)}
        # cached: a new plan per call would zero the dynamic scheduler's counters with a device
        # synchronization every call (6-27% of a 2k backward, session 18)
        plan = feature_plan(p, strides, scale, dq.device.id, config) if rng is None \
            else make_plan(p, strides, scale, dq.device.id, config)
        if repeat_key is not None:
            _bwd_plans[repeat_key] = _CupyBackward(plan, (q.shape, k.shape, v.shape), q.dtype, dq.device.id)
        if POISON_OUTPUTS:
            for x in (dq, dk, dv):
                x.view(cupy.uint16).fill(0x7FFF)
        workspace = cupy.empty(max(plan.workspace_bytes, 1), dtype=cupy.uint8)
        ptrs = (dout.data.ptr, q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr,
                dq.data.ptr, dk.data.ptr, dv.data.ptr)
        if p.features and rng is None:
            slopes = None if slopes is None else cupy.ascontiguousarray(slopes)
            plan.run_fields({"alibi_slopes": 0 if slopes is None else slopes.data.ptr}, ptrs,
                            workspace.data.ptr, cupy.cuda.get_current_stream().ptr)
        elif rng is None:
            plan.run(ptrs, workspace.data.ptr, cupy.cuda.get_current_stream().ptr)
        else:  # dropout: the forward's (seed, offset), int64[2] in device memory (and ALiBi's slopes)
            slopes = None if slopes is None else cupy.ascontiguousarray(slopes)  # alive past launch
            plan.run_with(ptrs, workspace.data.ptr, cupy.cuda.get_current_stream().ptr,
                          _dropout_extras(rng, slopes))
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


# ---------------------------------------------------------------------------------------
# decoding (flash_attn_with_kvcache): cuflash.decode

from .decode import flash_attn_with_kvcache  # noqa: E402,F401  (decode imports this module)
