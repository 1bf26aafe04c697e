"""FP8 (e4m3) attention: the host side of the sm90_fwd_fp8 family, its float64 reference and
its low-precision error baseline.

``flash_attn_fp8_func`` (reached through ``cuflash.flash_attn_func`` for e4m3 inputs) takes
q, k, v in float8_e4m3fn (torch CUDA tensors; CuPy arrays of dtype uint8 holding e4m3 bytes)
with flash-attn 3's ``q_descale``, ``k_descale``, ``v_descale``: fp32 device tensors of shape
(1,) / () (per tensor) or (batch, nheads_kv); the real tensors are descale · the stored e4m3
values. It returns a bf16 output (and fp32 LSE). Forward only: no autograd, no torch.compile op.

Per call: the checks, one workspace allocation, then two launches: the family's prepare kernel
(the descales expanded to (batch, nheads_kv) and Vᵀ, V transposed to (batch, nheads_kv,
head_dim, seqlen_k rounded up to 16) with the keys of each group of 16 in PERM16 order; the
family's module says why; ``vt_mirror`` / ``descale_mirror`` state it in NumPy) and the
attention kernel. Nothing on this path synchronizes or reads device values on the host.

The error rule of the GPU tests (``error_ok``): the kernel's largest error against the float64
reference (``reference_fp8``: the e4m3 inputs decoded exactly, times their descales) must be at
most 2x the largest error of ``lowp_fp8_attention`` (plain attention from the same decoded
inputs: S in fp32, P = exp(S - rowmax) in fp32, P rounded to e4m3 as the kernel does, O = P V
accumulated in fp32 over the fp32 row sum, rounded to bf16) plus 1e-3 x max |reference|.
P is rounded as the kernel rounds it: e4m3(256 · P) / 256 (the kernel's use of e4m3's range,
FA3's exp2 offset of 8; P_SCALE).
"""
from __future__ import annotations

import functools
import math
import sys
from typing import Optional

import numpy as np

from .problem import Problem

LOG2E = math.log2(math.e)
P_SCALE = 256.0   # the kernel rounds 256 · P to e4m3 (kPScale in sm90_fwd_fp8.cu)


# ---------------------------------------------------------------------------------------
# e4m3 (float8_e4m3fn: 1 sign, 4 exponent bits with bias 7, 3 mantissa bits, no infinities,
# NaN = 0x7F / 0xFF, largest finite 448)

@functools.lru_cache(maxsize=1)
def e4m3_table() -> np.ndarray:
    """The value of every byte 0..255 as float64 (exact)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, man = (codes >> 3) & 0xF, codes & 0x7
    val = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    val = sign * val
    val[(codes & 0x7F) == 0x7F] = np.nan
    return val


def dequantize_e4m3(codes) -> np.ndarray:
    """float64 values of an array of e4m3 bytes (uint8, or any 1-byte dtype viewed as uint8)."""
    codes = np.asarray(codes)
    return e4m3_table()[codes.view(np.uint8)]


def quantize_e4m3(x) -> np.ndarray:
    """The e4m3 bytes nearest to x (round to nearest, ties to even, saturating at +-448, as
    cvt.rn.satfinite); NaN -> 0x7F."""
    x = np.asarray(x, dtype=np.float64)
    pos = e4m3_table()[:127]                       # codes 0..126: 0 .. 448, increasing
    a = np.minimum(np.abs(x), 448.0)
    hi = np.clip(np.searchsorted(pos, a, side="left"), 0, 126)
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = a - pos[lo], pos[hi] - a
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    codes = pick.astype(np.uint8) | np.where(np.signbit(x) & (pick > 0), 0x80, 0).astype(np.uint8)
    return np.where(np.isnan(x), np.uint8(0x7F), codes).astype(np.uint8)


def round_e4m3(x) -> np.ndarray:
    return dequantize_e4m3(quantize_e4m3(x))


def round_bf16(x) -> np.ndarray:
    """float32 -> nearest bf16 (ties to even), returned as float32."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16
    return b.astype(np.uint32).view(np.float32)


# ---------------------------------------------------------------------------------------
# reference and baseline

def _descale_per_head(d, batch: int, nheads: int, nheads_kv: int) -> np.ndarray:
    """A descale (scalar, (1,) or (batch, nheads_kv)) as (batch, nheads) float64."""
    d = np.asarray(d, dtype=np.float64)
    d = np.broadcast_to(d.reshape(()) if d.size == 1 else d, (batch, nheads_kv))
    return np.repeat(d, nheads // nheads_kv, axis=1)


def decode_inputs(q8, k8, v8, q_descale=1.0, k_descale=1.0, v_descale=1.0):
    """float64 q, k, v from e4m3 bytes and descales (per tensor or (batch, nheads_kv)); k, v keep
    nheads_kv heads (their descales per kv head)."""
    batch, _, nheads, _ = q8.shape
    hkv = k8.shape[2]
    qd = _descale_per_head(q_descale, batch, nheads, hkv)
    kd = _descale_per_head(k_descale, batch, hkv, hkv)
    vd = _descale_per_head(v_descale, batch, hkv, hkv)
    q = dequantize_e4m3(q8) * qd[:, None, :, None]
    k = dequantize_e4m3(k8) * kd[:, None, :, None]
    v = dequantize_e4m3(v8) * vd[:, None, :, None]
    return q, k, v


def reference_fp8(q8, k8, v8, q_descale=1.0, k_descale=1.0, v_descale=1.0, softmax_scale=None,
                  causal=False):
    """(out, lse) in float64: exact attention of the decoded inputs."""
    from .reference import attention_naive

    q, k, v = decode_inputs(q8, k8, v8, q_descale, k_descale, v_descale)
    return attention_naive(q, k, v, softmax_scale, causal, return_lse=True)


def lowp_fp8_attention(q8, k8, v8, q_descale=1.0, k_descale=1.0, v_descale=1.0,
                       softmax_scale=None, causal=False) -> np.ndarray:
    """The error baseline (module docstring): fp32 S, e4m3 P (as e4m3(256 P) / 256), fp32 P V,
    bf16 output."""
    from .reference import causal_mask

    q, k, v = (x.astype(np.float32) for x in decode_inputs(q8, k8, v8, q_descale, k_descale, v_descale))
    batch, sq, nheads, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = np.float32(1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale)
    rep = nheads // hkv
    qh = q.transpose(0, 2, 1, 3)                                   # b h s d
    kh = np.repeat(k.transpose(0, 2, 1, 3), rep, axis=1)
    vh = np.repeat(v.transpose(0, 2, 1, 3), rep, axis=1)
    s = (qh @ kh.transpose(0, 1, 3, 2)) * scale
    if causal:
        s = np.where(causal_mask(sq, sk)[None, None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m).astype(np.float32)
    l = p.sum(axis=-1, keepdims=True)
    p8 = (round_e4m3(p * P_SCALE) / P_SCALE).astype(np.float32)
    o = (p8 @ vh) / np.where(l > 0, l, 1)
    return round_bf16(o.transpose(0, 2, 1, 3))


def error_ok(out, ref, base) -> tuple:
    """(ok, kernel error, baseline error): the tests' rule (module docstring)."""
    out, ref, base = (np.asarray(x, dtype=np.float64) for x in (out, ref, base))
    err, base_err = np.abs(out - ref).max(), np.abs(base - ref).max()
    return bool(err <= 2 * base_err + 1e-3 * np.abs(ref).max()), float(err), float(base_err)


# ---------------------------------------------------------------------------------------
# the GPU path

def is_fp8(x) -> bool:
    """True for a torch float8_e4m3fn tensor or a CuPy/NumPy array of dtype float8_e4m3fn."""
    return str(getattr(x, "dtype", "")).replace("torch.", "") == "float8_e4m3fn"


def _check(name: str, x, kind: str, ndim: int = 4):
    from .api import _kind

    if _kind(x) != kind:
        raise TypeError(f"{name}: expected a {kind} array like q, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions (batch, seqlen, nheads, headdim), "
                         f"got shape {tuple(x.shape)}")


def _raw(x, kind: str):
    """(shape, strides in bytes = elements, address, device) of a 1-byte array."""
    if kind == "torch":
        return tuple(x.shape), tuple(x.stride()), x.data_ptr(), x.device.index
    return tuple(x.shape), tuple(x.strides), x.data.ptr, x.device.id


def check_fp8_qkv(q, k, v, softmax_scale, causal):
    """Validate e4m3 q, k, v (naming the argument, before any launch); (problem, scale, kind)."""
    from .api import _kind, check_scale

    kind = _kind(q)
    if kind not in ("torch", "cupy"):
        raise TypeError(f"q: fp8 inputs must be torch CUDA tensors or CuPy arrays, got {type(q).__name__}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check(name, x, kind)
        if kind == "torch":
            if not is_fp8(x):
                raise TypeError(f"{name}: dtype must be torch.float8_e4m3fn like q, got {x.dtype}")
        elif x.dtype.itemsize != 1 or str(x.dtype) not in ("uint8", "float8_e4m3fn"):
            raise TypeError(f"{name}: CuPy fp8 arrays must be uint8 (e4m3 bytes), got {x.dtype}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if kind == "torch" and x.device.type != "cuda":
            raise ValueError(f"{name}: fp8 torch tensors must be on a CUDA device, got {x.device}")
    (b, sq, h, d), (bk, sk, hk, dk), vshape = q.shape, k.shape, tuple(v.shape)
    if bk != b or dk != d or vshape != tuple(k.shape):
        raise ValueError(f"k, v: expected shape ({b}, seqlen_k, nheads_kv, {d}) each, got "
                         f"{tuple(k.shape)} and {vshape}")
    if hk == 0 or h % hk:
        raise ValueError(f"k: nheads_kv ({hk}) must divide nheads ({h})")
    if d % 16 or not 0 < d <= 256:
        raise ValueError(f"q: headdim must be a multiple of 16 in 16..256 for fp8, got {d}")
    for name, x in (("q", q), ("k", k)):
        shape, st, ptr, _ = _raw(x, kind)
        if st[3] != 1:
            raise ValueError(f"{name}: the head dim must be contiguous (stride 1), got strides {st}")
        bad = [s for s, n in zip(st[:3], shape[:3]) if n > 1 and s % 16]
        if bad or ptr % 16:
            raise ValueError(f"{name}: TMA needs 16-byte aligned rows: strides {st} (bytes) and the "
                             f"address must be multiples of 16; pass a contiguous copy")
    if not isinstance(causal, (bool, np.bool_)) and causal not in (0, 1):
        raise TypeError(f"causal: expected a bool, got {causal!r}")
    scale = check_scale(softmax_scale, d)
    problem = Problem("fwd", "e4m3", b, sq, sk, h, hk, d, bool(causal))
    return problem, scale, kind


def check_descale(name: str, x, kind: str, batch: int, nheads_kv: int, device):
    """None, or an fp32 array on q's device of shape (), (1,) or (batch, nheads_kv)."""
    if x is None:
        return None
    from .api import _kind

    if _kind(x) != kind:
        raise TypeError(f"{name}: expected a {kind} fp32 array like q, got {type(x).__name__}")
    if str(x.dtype).replace("torch.", "") != "float32":
        raise TypeError(f"{name}: dtype must be float32, got {x.dtype}")
    shape = tuple(x.shape)
    if shape not in ((), (1,), (batch, nheads_kv)):
        raise ValueError(f"{name}: expected shape (1,) or (batch, nheads_kv) = ({batch}, {nheads_kv}), "
                         f"got {shape}")
    dev = x.device.index if kind == "torch" else x.device.id
    if dev != device:
        raise ValueError(f"{name}: must be on q's device {device}, got {dev}")
    return x


_plans: dict = {}


def vt_mirror(v8) -> np.ndarray:
    """NumPy statement of the Vᵀ the prepare kernel writes (tests compare it byte for byte):
    V's e4m3 bytes (batch, seqlen_k, nheads_kv, head_dim) -> (batch, nheads_kv, head_dim,
    seqlen_k rounded up to 16), position 16 g + i holding key 16 g + PERM16[i], padding keys 0."""
    from .families.sm90_fwd_fp8 import PERM16

    v8 = np.asarray(v8).view(np.uint8)
    b, sk, hkv, d = v8.shape
    s_pad = -(-sk // 16) * 16
    vp = np.zeros((b, s_pad, hkv, d), np.uint8)
    vp[:, :sk] = v8
    g = vp.reshape(b, s_pad // 16, 16, hkv, d)[:, :, list(PERM16)]     # keys in PERM16 order
    return np.ascontiguousarray(g.transpose(0, 3, 4, 1, 2)).reshape(b, hkv, d, s_pad)


def descale_mirror(d, batch: int, nheads_kv: int) -> np.ndarray:
    """The (batch, nheads_kv) fp32 descale the prepare kernel writes: 1 for None, a per-tensor
    factor repeated, a (batch, nheads_kv) array as it is."""
    if d is None:
        return np.ones((batch, nheads_kv), np.float32)
    d = np.asarray(d, np.float32)
    return np.broadcast_to(d.reshape(()) if d.size == 1 else d, (batch, nheads_kv)).copy()


def _descale_ptr(d, kind: str, batch: int, nheads_kv: int) -> tuple:
    """(address, per-head bit, array) of a checked descale for the prepare kernel: (0, 0) for None; a
    (batch, nheads_kv) array must be contiguous (a strided one is copied, values unchanged)."""
    if d is None:
        return 0, 0, None
    per_head = d.ndim == 2 and batch * nheads_kv > 1
    if kind == "torch":
        if per_head and not d.is_contiguous():
            d = d.contiguous()
        return d.data_ptr(), int(per_head), d
    if per_head and not d.flags.c_contiguous:
        import cupy

        d = cupy.ascontiguousarray(d)
    return d.data.ptr, int(per_head), d


def run_plan(plan, ptrs: tuple, ws_ptr: int, descales: tuple, kind: str, stream: int) -> tuple:
    """Launch an sm90_fwd_fp8 plan (prepare, then main) with the caller's descales (checked
    arrays or None): their addresses and per-head bits go into the params' per-call fields.
    Returns the descale arrays the launch reads (keep them alive until it has run: a strided
    one is a fresh contiguous copy)."""
    p = plan.problem
    addr, mask, keep = [], 0, []
    for bit, d in enumerate(descales):
        got = _descale_ptr(d, kind, p.batch, p.nheads_kv)
        addr.append(got[0])
        mask |= got[1] << bit
        keep.append(got[2])
    plan.run_fields({"q_descale_in": addr[0], "k_descale_in": addr[1], "v_descale_in": addr[2],
                     "descale_per_head": mask}, ptrs, ws_ptr, stream)
    return tuple(keep)


def _torch():
    return sys.modules["torch"]


# ---- the torch hot path: a repeat call skips the checks ----
# _fast maps what the checks look at (shapes, strides, dtypes, devices of q, k, v and of each
# descale, the scale, causal, config) to the plan and the descales' per-head bits, filled after
# a call has passed every check; the pointers' 16-byte alignment is re-checked per call.
_fast: dict = {}


def _descale_sig(d):
    return None if d is None else (d.dtype, d.shape, d.device, d.is_contiguous())


def _fast_key(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal, config):
    try:
        return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype,
                v.dtype, q.device, k.device, v.device, _descale_sig(q_descale),
                _descale_sig(k_descale), _descale_sig(v_descale), softmax_scale, causal, config)
    except (AttributeError, TypeError):   # not torch tensors: the checks say what is wrong
        return None


def _raw_stream(index: int) -> int:
    torch = _torch()
    fn = getattr(torch._C, "_cuda_getCurrentRawStream", None)   # ~0.1 µs; current_stream: ~4 µs
    return fn(index) if fn is not None else torch.cuda.current_stream(index).cuda_stream


def _run_fast(hit, q, k, v, descales, return_attn_probs):
    """The hot path of a checked call shape (see _fast): allocate, write the pointers, launch."""
    torch = _torch()
    plan, mask, lse_shape = hit
    dev = q.device
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=dev)
    ws = torch.empty(plan.workspace_bytes, dtype=torch.uint8, device=dev)
    qd, kd, vd = (0 if d is None else d.data_ptr() for d in descales)
    plan.run_fields({"q_descale_in": qd, "k_descale_in": kd, "v_descale_in": vd,
                     "descale_per_head": mask},
                    (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()),
                    ws.data_ptr(), _raw_stream(dev.index))
    return (out, lse, None) if return_attn_probs else out


def flash_attn_fp8_func(q, k, v, softmax_scale: Optional[float] = None, causal: bool = False,
                        q_descale=None, k_descale=None, v_descale=None,
                        return_attn_probs: bool = False, config=None):
    """FP8 (e4m3) forward (module docstring). Returns out (bf16, q's shape), or (out, lse, None)
    with return_attn_probs (lse fp32 (batch, nheads, seqlen_q), natural log, of the real scores
    softmax_scale · q_descale · k_descale · Q Kᵀ)."""
    from . import api

    fast_key = _fast_key(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal, config)
    try:
        hit = _fast.get(fast_key) if fast_key is not None else None
    except TypeError:   # an unhashable argument (e.g. config): the checks name it
        fast_key = hit = None
    if hit is not None and not api.POISON_OUTPUTS and not (q.data_ptr() | k.data_ptr()) & 15:
        return _run_fast(hit, q, k, v, (q_descale, k_descale, v_descale), return_attn_probs)
    from . import _gpu
    from .launch import Plan
    from .select import choose_on_device

    problem, scale, kind = check_fp8_qkv(q, k, v, softmax_scale, causal)
    p = problem
    qshape, qst, qp, device = _raw(q, kind)
    kshape, kst, kp, kdev = _raw(k, kind)
    _, vst, vp, vdev = _raw(v, kind)
    if not device == kdev == vdev:
        raise ValueError(f"q, k, v: must be on one device, got {device}, {kdev}, {vdev}")
    descales = tuple(check_descale(n, x, kind, p.batch, p.nheads_kv, device) for n, x in
                     (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)))
    if kind == "torch":
        torch = _torch()
        out = torch.empty(qshape, dtype=torch.bfloat16, device=q.device)
        lse = torch.empty((p.batch, p.nheads, p.seqlen_q), dtype=torch.float32, device=q.device)
    else:
        import cupy

        with cupy.cuda.Device(device):
            out = cupy.empty(qshape, dtype=cupy.uint16)       # bf16 bits
            lse = cupy.empty((p.batch, p.nheads, p.seqlen_q), dtype=cupy.float32)
    empty = p.batch == 0 or p.seqlen_q == 0 or p.nheads == 0
    if empty or p.seqlen_k == 0:
        if not empty:   # attention over zero keys: O = 0, LSE = +inf
            (out.zero_() if kind == "torch" else out.fill(0))
            lse.fill_(math.inf) if kind == "torch" else lse.fill(math.inf)
        return (out, lse, None) if return_attn_probs else out
    _gpu.require("flash_attn_func (fp8)")
    ost = tuple(out.stride()) if kind == "torch" else tuple(s // 2 for s in out.strides)
    key = (qshape, qst, kshape, kst, vst, device, scale, bool(causal), config)
    plan = _plans.get(key)
    if plan is None:
        family, cfg, _ = choose_on_device(problem, device, config)
        strides = {"q": qst, "k": kst, "v": vst, "o": ost}
        plan = _plans[key] = Plan(family, cfg, problem, strides, scale, device)
    if kind == "torch":
        ws = torch.empty(plan.workspace_bytes, dtype=torch.uint8, device=q.device)
        stream = _raw_stream(q.device.index)
        ws_ptr = ws.data_ptr()
    else:
        with cupy.cuda.Device(device):
            ws = cupy.empty(plan.workspace_bytes, dtype=cupy.uint8)
        stream = cupy.cuda.get_current_stream().ptr
        ws_ptr = ws.data.ptr
    if api.POISON_OUTPUTS:
        if kind == "torch":
            out.view(torch.int16).fill_(0x7FFF)
            lse.fill_(math.nan)
        else:
            out.fill(0x7FFF)
            lse.fill(np.nan)
    optr = out.data_ptr() if kind == "torch" else out.data.ptr
    lptr = lse.data_ptr() if kind == "torch" else lse.data.ptr
    # ws (and any descale copy) is freed on return: safe, the kernels run on the stream its
    # allocator serves
    run_plan(plan, (qp, kp, vp, optr, lptr), ws_ptr, descales, kind, stream)
    if kind == "torch" and fast_key is not None and all(
            d is None or d.ndim < 2 or d.is_contiguous() for d in descales):
        mask = sum(1 << i for i, d in enumerate(descales)
                   if d is not None and d.ndim == 2 and p.batch * p.nheads_kv > 1)
        if len(_fast) >= 256:
            _fast.clear()
        _fast[fast_key] = (plan, mask, (p.batch, p.nheads, p.seqlen_q))
    return (out, lse, None) if return_attn_probs else out
