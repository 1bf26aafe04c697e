"""``flash_attn_with_kvcache``: flash-attn 2.8's decoding entry point (KV cache, split-KV).

Same signature, argument order, defaults and return values as flash-attn 2.8's
``flash_attn.flash_attn_with_kvcache``. Every argument is validated, with errors naming it,
before anything runs.

* torch CPU tensors (any float dtype) run the float64 reference
  (``cuflash.reference.attention_kvcache``): when ``k`` / ``v`` are given, ``k_cache`` and
  ``v_cache`` are updated **in place** (the new keys rotated when ``rotary_cos`` /
  ``rotary_sin`` are given), as flash-attn does; ``num_splits > 1`` computes the result
  through the split-KV partials and their LSE combine (the same values).
* torch CUDA tensors run the ``decode_splitkv`` kernel family (op ``decode``; selected through
  the registry like every op): append (+ rotary) into the cache in place, split-KV attention
  with GQA packing, LSE combine. Each new call shape (shapes, strides, dtypes, device, flags,
  scalars) is validated once and gets a launch plan; a repeat call is one tuple key, the output
  allocations and the launches on torch's current stream (CUDA-graph capture is legal; the
  split count depends on shapes only, the per-row lengths are read on the device, where values
  out of range are clamped, never read out of bounds). Under torch.compile the call goes
  through the ``cuflash::kvcache`` torch op.
* CuPy arrays run the same kernels and plans (keyed and validated the same way), with the
  outputs from CuPy's memory pool and the launches on CuPy's current stream.
* NumPy arrays are validated on the host (the values of cache_seqlens, cache_batch_idx,
  cache_leftpad and block_table too), copied to the GPU and run by the same kernels as CuPy
  arrays; out (and lse) come back as NumPy arrays, and an append is copied back into the
  caller's k_cache / v_cache in place (the whole cache both ways per call: for tests and
  small caches).

Where cuflash differs from flash-attn 2.8 (all on the accepting side, none changes a result
flash-attn gives): any ``page_block_size`` and any even ``rotary_dim`` are accepted (flash-attn's
kernels need multiples of 256 and 16; a decode kernel family declares its own limits in
``supports()``), ``cache_leftpad`` works with ``block_table``, an int ``cache_seqlens`` is
broadcast to q's batch (flash-attn uses ``k_cache.shape[0]``), ``batch = 0`` gives empty results,
and the values of ``cache_seqlens``, ``cache_leftpad``, ``cache_batch_idx`` and the used
``block_table`` entries are checked (flash-attn reads out of bounds). Rejected where flash-attn
is silent: a negative ``num_splits`` (flash-attn treats it as 0), and appends from two batch
rows to one cache slot, or to a slot another row reads (duplicate ``cache_batch_idx`` while
appending; shared pages that are appended to).
"""
from __future__ import annotations

import operator
import sys
from dataclasses import dataclass
from numbers import Integral
from typing import Optional

import numpy as np

from . import api, reference
from .problem import Problem

MAX_SPLITS = 128  # flash-attn's limit on num_splits


@dataclass
class KVCacheCall:
    """One validated ``flash_attn_with_kvcache`` call (what a decode family will read)."""
    tq: api._Tensor
    batch: int
    seqlen_q: int
    nheads: int
    nheads_kv: int
    head_dim: int
    capacity: int          # logical length of a cache row (seqlen_cache or blocks * page)
    seqlen_new: int        # rows of k / v to append (0: none)
    paged: bool
    rotary_dim: int        # 0: no rotary
    softmax_scale: float
    causal: bool
    window_size: tuple
    softcap: float
    num_splits: int
    features: tuple        # sorted names: alibi, append, cache_batch_idx, leftpad, paged_kv,
                           # rotary, softcap, window

    def problem(self, dtype: str) -> Problem:
        """The call as a ``Problem`` of op ``decode`` (seqlen_k: the cache capacity)."""
        return Problem("decode", dtype, self.batch, self.seqlen_q, self.capacity, self.nheads,
                       self.nheads_kv, self.head_dim, self.causal, False, self.features)


def _device_of(x, kind: str):
    return api._device_of(x, kind)


def _same_place(name: str, x, tq: api._Tensor) -> str:
    """x's kind (q's) and device (q's), else TypeError / ValueError naming it."""
    kind = api._kind(x)
    if kind != tq.kind:
        raise TypeError(f"{name}: expected a {tq.kind} array like q, got {type(x).__name__}")
    if kind == "torch" and x.device.type not in ("cuda", "cpu"):
        raise ValueError(f"{name}: torch tensors must be on a CUDA device or the CPU, got {x.device}")
    if kind != "numpy" and _device_of(x, kind) != tq.device:
        raise ValueError(f"{name}: must be on q's device {tq.device}, got {x.device}")
    return kind


def _int32_arg(name: str, x, tq: api._Tensor, shape: tuple, what: str):
    """An int32 array of ``shape`` (None entries: any size), q's kind, on q's device."""
    _same_place(name, x, tq)
    dtype = str(x.dtype).replace("torch.", "")
    if dtype != "int32":
        raise TypeError(f"{name}: dtype must be int32, got {dtype}")
    got = tuple(int(n) for n in x.shape)
    if len(got) != len(shape) or any(s is not None and s != g for s, g in zip(shape, got)):
        raise ValueError(f"{name}: expected shape {what}, got {got}")
    return x


def _host_ints(x, tq: api._Tensor) -> Optional[np.ndarray]:
    """The values of an int argument on the host (int64), for CPU inputs (torch CPU, NumPy);
    None for GPU ones (a decode kernel reads them on the device: no synchronization at
    validation)."""
    if tq.kind == "torch" and tq.device is None:
        return x.detach().numpy().astype(np.int64)
    if tq.kind == "numpy":
        return np.asarray(x).astype(np.int64)
    return None


def _flag(name: str, value) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    try:
        if getattr(value, "ndim", 0) == 0 and value in (0, 1):
            return bool(value)
    except (TypeError, ValueError):
        pass
    raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                  cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                  softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                  rotary_interleaved=True, alibi_slopes=None, num_splits=0):
    """Validate a flash_attn_with_kvcache call; every error names the argument. No launch, no
    GPU. Returns a KVCacheCall."""
    tq = api.describe("q", q)
    tkc, tvc = api.describe("k_cache", k_cache), api.describe("v_cache", v_cache)
    for name, t, x in (("k_cache", tkc, k_cache), ("v_cache", tvc, v_cache)):
        _same_place(name, x, tq)
        if t.dtype != tq.dtype:
            raise TypeError(f"{name}: dtype must be q's {q.dtype}, got {x.dtype}")
    batch, seqlen_q, nheads, head_dim = tq.shape
    if not 1 <= head_dim <= api.MAX_HEAD_DIM:
        raise ValueError(f"q: headdim must be in [1, {api.MAX_HEAD_DIM}], got {head_dim}")
    nheads_kv = tkc.shape[2]
    if tkc.shape[3] != head_dim:
        raise ValueError(f"k_cache: headdim must match q's {head_dim}, got {tkc.shape[3]}")
    if tvc.shape != tkc.shape:
        raise ValueError(f"v_cache: shape must equal k_cache's {tkc.shape}, got {tvc.shape}")
    if nheads_kv == 0 or nheads % nheads_kv:
        raise ValueError(f"k_cache: nheads_kv={nheads_kv} must divide q's nheads={nheads} (GQA/MQA)")
    if batch > api.GRID_LIMIT or nheads > api.GRID_LIMIT:
        raise ValueError(f"q: batch ({batch}) and nheads ({nheads}) must be <= {api.GRID_LIMIT} "
                         "(CUDA grid limit)")
    on_gpu = tq.kind != "torch" or tq.device is not None
    if on_gpu:
        for name, t in (("k_cache", tkc), ("v_cache", tvc)):
            if head_dim > 1 and t.strides[3] != 1:
                raise ValueError(f"{name}: the last dimension (headdim) must be contiguous "
                                 f"(stride 1), got strides {t.strides}")
    features = set()

    # paged KV / cache rows
    paged = block_table is not None
    if paged:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx: can't be used with block_table (a paged KV cache "
                             "addresses each batch row through block_table)")
        _int32_arg("block_table", block_table, tq, (batch, None),
                   f"(batch, max_num_blocks_per_seq) = ({batch}, max_num_blocks_per_seq)")
        page = tkc.shape[1]
        if page < 1:
            raise ValueError(f"k_cache: page_block_size (k_cache.shape[1]) must be >= 1, got {page}")
        capacity = int(block_table.shape[1]) * page
        features.add("paged_kv")
    else:
        capacity = tkc.shape[1]
        if cache_batch_idx is None:
            if tkc.shape[0] < batch:
                raise ValueError(f"k_cache: holds {tkc.shape[0]} batch rows, fewer than q's batch "
                                 f"{batch} (pass cache_batch_idx to pick rows)")
        else:
            _int32_arg("cache_batch_idx", cache_batch_idx, tq, (batch,), f"(batch,) = ({batch},)")
            features.add("cache_batch_idx")

    # new keys and values
    if (k is None) != (v is None):
        raise ValueError(f"{'v' if k is not None else 'k'}: k and v must be given together "
                         "(the new keys and values to append) or both be None")
    seqlen_new = 0
    if k is not None:
        if cache_seqlens is None:
            raise ValueError("cache_seqlens: must be given with k and v (where to append them)")
        tk, tv = api.describe("k", k), api.describe("v", v)
        for name, t, x in (("k", tk, k), ("v", tv, v)):
            _same_place(name, x, tq)
            if t.dtype != tq.dtype:
                raise TypeError(f"{name}: dtype must be q's {q.dtype}, got {x.dtype}")
        seqlen_new = tk.shape[1]
        want = (batch, seqlen_new, nheads_kv, head_dim)
        if tk.shape != want:
            raise ValueError(f"k: expected shape (batch, seqlen_new, nheads_kv, headdim) = {want}, "
                             f"got {tk.shape}")
        if tv.shape != tk.shape:
            raise ValueError(f"v: shape must equal k's {tk.shape}, got {tv.shape}")
        if seqlen_new > capacity:
            raise ValueError(f"k: seqlen_new={seqlen_new} new tokens do not fit the KV cache's "
                             f"{capacity} positions")
        if seqlen_new:
            features.add("append")

    # lengths
    ends = None
    if cache_seqlens is not None:
        if isinstance(cache_seqlens, Integral) and not isinstance(cache_seqlens, (bool, np.bool_)):
            ends = np.full(batch, int(cache_seqlens), np.int64)
        elif api._kind(cache_seqlens) in ("torch", "numpy", "cupy"):
            _int32_arg("cache_seqlens", cache_seqlens, tq, (batch,), f"(batch,) = ({batch},)")
            ends = _host_ints(cache_seqlens, tq)
        else:
            raise TypeError(f"cache_seqlens must be an int or an int32 array (batch,), got "
                            f"{type(cache_seqlens).__name__} {cache_seqlens!r}")
        if ends is not None and ((ends < 0).any() or (ends + seqlen_new > capacity).any()):
            raise ValueError(f"cache_seqlens: must lie in [0, {capacity - seqlen_new}] (cache "
                             f"capacity {capacity}, {seqlen_new} new tokens), got {ends.tolist()}")
    if cache_leftpad is not None:
        _int32_arg("cache_leftpad", cache_leftpad, tq, (batch,), f"(batch,) = ({batch},)")
        starts = _host_ints(cache_leftpad, tq)
        if starts is not None:
            top = ends if ends is not None else np.full(batch, capacity, np.int64)
            if (starts < 0).any() or (starts > top).any():
                raise ValueError(f"cache_leftpad: must lie in [0, cache_seqlens[b]] per row, got "
                                 f"{starts.tolist()} for cache_seqlens {top.tolist()}")
        features.add("leftpad")
    if cache_batch_idx is not None:
        rows = _host_ints(cache_batch_idx, tq)
        if rows is not None:
            if rows.size and (rows.min() < 0 or rows.max() >= tkc.shape[0]):
                raise ValueError(f"cache_batch_idx: must index k_cache's {tkc.shape[0]} rows, got "
                                 f"{rows.tolist()}")
            if seqlen_new and len(set(rows.tolist())) != rows.size:
                raise ValueError(f"cache_batch_idx: repeats a cache row while k and v are appended "
                                 f"(ambiguous writes), got {rows.tolist()}")
    if paged:
        table = _host_ints(block_table, tq)
        if table is not None and batch:
            top = ends + seqlen_new if ends is not None else np.full(batch, capacity, np.int64)
            used = np.arange(table.shape[1])[None, :] * tkc.shape[1] < top[:, None]
            vals = table[used]
            if vals.size and (vals.min() < 0 or vals.max() >= tkc.shape[0]):
                raise ValueError(f"block_table: the entries in use must index k_cache's "
                                 f"{tkc.shape[0]} blocks, got {np.unique(vals).tolist()}")

    # rotary
    rotary_dim = 0
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError(f"{'rotary_sin' if rotary_cos is not None else 'rotary_cos'}: rotary_cos "
                         "and rotary_sin must be given together")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos: rotary embedding needs the new k and v to append "
                             "(flash-attn applies it to them and to q)")
        for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            _same_place(name, x, tq)
            if api.dtype_name(x) != tq.dtype:
                raise TypeError(f"{name}: dtype must be q's {q.dtype}, got {x.dtype}")
            if x.ndim != 2:
                raise ValueError(f"{name}: expected shape (seqlen_ro, rotary_dim / 2), got "
                                 f"{tuple(x.shape)}")
        if tuple(rotary_sin.shape) != tuple(rotary_cos.shape):
            raise ValueError(f"rotary_sin: shape must equal rotary_cos's {tuple(rotary_cos.shape)}, "
                             f"got {tuple(rotary_sin.shape)}")
        seqlen_ro, half = (int(n) for n in rotary_cos.shape)
        rotary_dim = 2 * half
        if not 2 <= rotary_dim <= head_dim:
            raise ValueError(f"rotary_cos: rotary_dim = 2 * rotary_cos.shape[1] = {rotary_dim} must "
                             f"be in [2, headdim = {head_dim}]")
        if seqlen_ro < capacity:
            raise ValueError(f"rotary_cos: seqlen_ro = {seqlen_ro} rows must cover the KV cache's "
                             f"{capacity} positions")
        _flag("rotary_interleaved", rotary_interleaved)
        features.add("rotary")
    else:
        _flag("rotary_interleaved", rotary_interleaved)

    # scalars and the features of fwd
    scale = api.check_scale(softmax_scale, head_dim)
    causal = _flag("causal", causal)
    left, right = api.check_window(window_size)
    cap = api._real("softcap", softcap, "a finite number >= 0 (0: off)")
    if not np.isfinite(cap) or cap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0: off), got {softcap!r}")
    if alibi_slopes is not None:
        api.check_alibi(alibi_slopes, tq, batch, nheads)
        features.add("alibi")
    if isinstance(num_splits, (bool, np.bool_)):
        raise TypeError(f"num_splits must be an int, got {num_splits!r}")
    try:
        num_splits = operator.index(num_splits)
    except TypeError:
        raise TypeError(f"num_splits must be an int, got {type(num_splits).__name__} "
                        f"{num_splits!r}") from None
    if not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [0, {MAX_SPLITS}] (0: heuristic, 1: no split), "
                         f"got {num_splits}")
    # flash-attn's mha_fwd_kvcache normalization (the reference's rule, one definition)
    causal, (left, right) = reference._normalize_kvcache_window(
        (left, right), causal, seqlen_q, capacity, alibi_slopes is not None)
    if (left, right) != (-1, -1) and not (causal and left == -1):
        features.add("window")
    if cap:
        features.add("softcap")
    return KVCacheCall(tq, batch, seqlen_q, nheads, nheads_kv, head_dim, capacity, seqlen_new,
                       paged, rotary_dim, scale, causal, (left, right), cap, num_splits,
                       tuple(sorted(features)))


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """Attention of q over a KV cache, optionally appending k, v to it first (decoding).

    flash-attn 2.8's signature and semantics (``cuflash.reference.attention_kvcache`` states
    the math):

    q: (batch, seqlen_q, nheads, headdim). k_cache, v_cache: (batch_cache, seqlen_cache,
    nheads_kv, headdim), or with block_table (num_blocks, page_block_size, nheads_kv, headdim).
    k, v (optional, together): (batch, seqlen_new, nheads_kv, headdim), written into the cache
    *in place* at positions cache_seqlens[b] .. + seqlen_new - 1 (k rotated first with
    rotary), then attended to. rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2), q's dtype,
    need k; positions cache_seqlens[b] + t for k, cache_seqlens[b] + i for q when causal or
    local, else cache_seqlens[b]; rotary_interleaved: GPT-J pairs (True) or GPT-NeoX halves.
    cache_seqlens: int or int32 (batch,), the cache length per row (default: all of it).
    cache_batch_idx: int32 (batch,), the cache row of each batch row. cache_leftpad: int32
    (batch,), where each row's cache starts. block_table: int32 (batch,
    max_num_blocks_per_seq), the pages of each row (paged KV). causal, window_size, softcap,
    alibi_slopes as flash_attn_func, bottom-right aligned per row with its own key count
    cache_seqlens[b] + seqlen_new - cache_leftpad[b]. num_splits: 0 heuristic, 1 no split,
    n split-KV (flash-decoding); the result does not depend on it.

    Returns out (q's shape and dtype), or (out, softmax_lse) with return_softmax_lse:
    fp32 (batch, nheads, seqlen_q), +inf for rows without keys (whose out is 0).

    torch CPU tensors run the float64 reference, torch CUDA tensors the decode_splitkv kernels
    (head dims that are multiples of 8, up to 256; 16-byte aligned tensors whose strides but the
    head dim's are multiples of 8 elements), and so do CuPy arrays (on CuPy's current stream).
    NumPy arrays are copied to the GPU and run the same kernels; out / lse come back as NumPy
    arrays and an append updates the caller's k_cache / v_cache in place, as flash-attn's.
    """
    torch = sys.modules.get("torch")  # not imported: q is no torch tensor (cuflash imports none)
    if torch is not None and isinstance(q, torch.Tensor) and torch.compiler.is_compiling():
        # traced by torch.compile (fake tensors, no addresses): through the cuflash::kvcache op
        out, lse = api._load_torch_ops().kvcache_traced(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
            cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
            rotary_interleaved, alibi_slopes, num_splits)
        return (out, lse) if return_softmax_lse else out
    is_torch = torch is not None and isinstance(q, torch.Tensor)
    cupy_input = not is_torch and api._kind(q) == "cupy"
    if cupy_input or (is_torch and q.is_cuda):  # the hot path: torch CUDA tensors, CuPy arrays
        args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                cache_leftpad, block_table, alibi_slopes)
        scalars = (softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits)
        # without return_softmax_lse no LSE tensor is made (the kernels skip its store)
        out, lse = (_run_cached(_cupy_plans, args, scalars, _cupy_array(), _CupyArrays,
                                want_lse=return_softmax_lse) if cupy_input
                    else _run_cached(_gpu_plans, args, scalars, want_lse=return_softmax_lse))
        return (out, lse) if return_softmax_lse else out
    call = check_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                         cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                         window_size, softcap, rotary_interleaved, alibi_slopes, num_splits)
    if call.tq.kind == "numpy":
        out, lse = _numpy_kvcache(call, (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                         cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                                         alibi_slopes),
                                  (softmax_scale, causal, window_size, softcap, rotary_interleaved,
                                   num_splits))
        return (out, lse) if return_softmax_lse else out
    if not (call.tq.kind == "torch" and call.tq.device is None):
        _raise_unsupported(call)
    out, lse = _reference_torch(call, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                                window_size, causal, bool(rotary_interleaved), alibi_slopes)
    return (out, lse) if return_softmax_lse else out


def _raise_unsupported(call: KVCacheCall) -> None:
    """NumPy inputs (the cache lives on the host; the kernels update it in place on the GPU):
    no launch."""
    from .registry import families

    dtype = call.tq.dtype if call.tq.dtype in ("bf16", "fp16") else "bf16"
    problem = call.problem(dtype)
    fams = families("decode")
    reasons = [f.supports((99, 9), problem) for f in fams]
    if not fams or all(reasons):
        why = "; ".join(dict.fromkeys(reasons)) or "no family is registered for op 'decode'"
        raise api.UnsupportedFeature(
            f"q, k_cache, v_cache: decoding with a KV cache (flash_attn_with_kvcache: split-KV, "
            f"cache append, rotary, paged KV) is not implemented by any registered kernel family "
            f"for this call ({why}); torch CPU tensors run it on the float64 reference "
            "(cuflash.reference.attention_kvcache)")
    raise api.UnsupportedFeature(
        f"q, k_cache, v_cache: flash_attn_with_kvcache runs its GPU kernels on torch CUDA tensors "
        f"and CuPy arrays, got {call.tq.kind} arrays (the cache is updated in place, so cuflash does not copy "
        "it); torch CPU tensors run the float64 reference (cuflash.reference.attention_kvcache)")


# ---------------------------------------------------------------------------------------
# the GPU path (torch CUDA tensors): validated once per call shape, then one dict lookup

_gpu_plans: dict = {}


def _drop_gpu_plans() -> None:
    _gpu_plans.clear()
    _cupy_plans.clear()


def _register_drop() -> None:
    from . import compile as compile_mod

    compile_mod.on_change(_drop_gpu_plans)


_register_drop()


_SCALAR_TYPES = frozenset((int, float, bool, tuple, type(None)))


def _gpu_key(args, softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits,
             array_class=None):
    """Everything validation reads of a call, as one tuple (None: do not cache, e.g. a 0-d
    tensor scale, hashable by identity, which would key a plan per call). An unhashable
    argument makes the lookup raise TypeError, an argument that is no tensor where one belongs
    the key raise AttributeError: the caller validates, which names it. Values of device tensors
    are never read: they are the kernel's to clamp."""
    sc, wc, cc, nc = softmax_scale.__class__, window_size.__class__, softcap.__class__, num_splits.__class__
    if not {sc, causal.__class__, wc, cc, rotary_interleaved.__class__, nc} <= _SCALAR_TYPES:
        return None
    # and the classes validation tells apart: True == 1 == 1.0 and (-1.0, -1) == (-1, -1) hash
    # alike, but a bool scale or softcap, a bool or float num_splits and a float window bound
    # are rejected (the flags take bools and ints alike: their values suffice)
    w = window_size
    scalars = (softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits, sc, cc, nc,
               (w[0].__class__, w[1].__class__) if wc is tuple and len(w) == 2 else None)
    if array_class is not None:  # CuPy arrays: shape, byte strides, dtype, device
        return (*[None if x is None else (x.shape, x.strides, x.dtype, x.device.id)
                  if isinstance(x, array_class) else (x.__class__, x) for x in args], *scalars)
    return _torch_key(args) + scalars


def _layout(x) -> tuple:
    """A torch tensor's part of the plan key: class (subclasses such as nn.Parameter key their
    own plans), shape, strides, dtype, device; the strides as True for a contiguous tensor with
    elements (is_contiguous() costs a third of stride(); the strides of size-1 dimensions, which
    it ignores, are never validated, nor multiplied by a non-zero index). Anything else raises
    AttributeError, or keys a tuple that only a validated call of its class could have stored."""
    shape = x.shape
    return (x.__class__, shape, True if x.is_contiguous() and 0 not in shape else x.stride(),
            x.dtype, x.device)


def _torch_key(args) -> tuple:
    """The torch call's arguments as a key (the hot path): q, k_cache, v_cache as _layout's
    fields, inline; the optional ones one tuple or None each, so no two argument patterns key
    alike; an int cache_seqlens by class and value."""
    (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
     cache_leftpad, block_table, alibi_slopes) = args
    if cache_seqlens is not None:
        cache_seqlens = (_layout(cache_seqlens) if isinstance(cache_seqlens, sys.modules["torch"].Tensor)
                         else (cache_seqlens.__class__, cache_seqlens))
    qs, ks, vs = q.shape, k_cache.shape, v_cache.shape
    return (q.__class__, qs, True if q.is_contiguous() and 0 not in qs else q.stride(),
            q.dtype, q.device,
            k_cache.__class__, ks, True if k_cache.is_contiguous() and 0 not in ks else k_cache.stride(),
            k_cache.dtype, k_cache.device,
            v_cache.__class__, vs, True if v_cache.is_contiguous() and 0 not in vs else v_cache.stride(),
            v_cache.dtype, v_cache.device,
            cache_seqlens, k if k is None else _layout(k), v if v is None else _layout(v),
            rotary_cos if rotary_cos is None else _layout(rotary_cos),
            rotary_sin if rotary_sin is None else _layout(rotary_sin),
            cache_batch_idx if cache_batch_idx is None else _layout(cache_batch_idx),
            cache_leftpad if cache_leftpad is None else _layout(cache_leftpad),
            block_table if block_table is None else _layout(block_table),
            alibi_slopes if alibi_slopes is None else _layout(alibi_slopes))


class _GpuEntry:
    """One validated call shape: its plan, output shapes and how to read the call's tensors.
    slots: the positions of ``args`` that hold tensors (fixed by the call shape's key);
    contiguous: those the kernels read densely that arrive strided (copied per call)."""
    __slots__ = ("plan", "out_shape", "lse_shape", "ws_bytes", "contiguous", "empty", "device",
                 "raw_stream", "slots", "f32", "u8", "counters")

    def run(self, args, want_lse=True):
        """(out, lse) of one call (lse None without want_lse: no tensor, the kernels store none)."""
        q = args[0]
        out = q.new_empty(*self.out_shape)  # (a tuple argument parses slower than its items)
        lse = q.new_empty(*self.lse_shape, dtype=self.f32) if want_lse else None
        if self.empty:
            out.zero_()
            if want_lse:
                lse.fill_(float("inf"))
            return out, lse
        if self.contiguous:  # small index / table / rotary tensors the kernels read densely
            args = list(args)
            for i in self.contiguous:
                args[i] = args[i].contiguous()
        ptrs = [0] * len(args)  # 0 for None and an int cache_seqlens
        for i in self.slots:
            ptrs[i] = args[i].data_ptr()
        if (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4]) & 15:
            i = next(i for i in range(5) if ptrs[i] & 15)
            raise ValueError(f"{_ARG_NAMES[i]}: the decode kernels read 16-byte chunks; its data "
                             f"must start on a 16-byte boundary (got address {ptrs[i]:#x})")
        if api.POISON_OUTPUTS:
            out.fill_(float("nan"))
            if want_lse:
                lse.fill_(float("nan"))
        ws = q.new_empty(self.ws_bytes, dtype=self.u8) if self.ws_bytes else None
        self.plan.run((*ptrs, out.data_ptr(), lse.data_ptr() if want_lse else 0),
                      0 if ws is None else ws.data_ptr(), self.raw_stream(self.device))
        return out, lse


_cupy_plans: dict = {}


def _cupy_array():
    import cupy

    return cupy.ndarray


class _TorchArrays:
    """How _gpu_entry reads torch tensors (strides in elements)."""
    entry_class = _GpuEntry

    def __init__(self):
        torch = sys.modules["torch"]
        self.array, self.f32, self.u8 = torch.Tensor, torch.float32, torch.uint8
        try:
            self.raw_stream = torch._C._cuda_getCurrentRawStream
        except AttributeError:  # pragma: no cover - older torch
            self.raw_stream = lambda index: torch.cuda.current_stream(index).cuda_stream

    @staticmethod
    def strides(x) -> tuple:
        return tuple(x.stride())

    @staticmethod
    def capturing() -> bool:
        return sys.modules["torch"].cuda.is_current_stream_capturing()

    @staticmethod
    def is_contiguous(x) -> bool:
        return x.is_contiguous()


class _CupyEntry(_GpuEntry):
    """_GpuEntry.run for CuPy arrays: outputs and workspace from CuPy's pool, the launch on
    CuPy's current stream of the arrays' device."""
    __slots__ = ()

    def run(self, args, want_lse=True):
        import cupy

        if cupy.cuda.runtime.getDevice() != self.device:
            with cupy.cuda.Device(self.device):
                return self.run(args, want_lse)
        q = args[0]
        out = cupy.empty(self.out_shape, q.dtype)
        lse = cupy.empty(self.lse_shape, cupy.float32) if want_lse else None
        if self.empty:
            out.fill(0)
            if want_lse:
                lse.fill(np.inf)
            return out, lse
        if self.contiguous:
            args = list(args)
            for i in self.contiguous:
                args[i] = cupy.ascontiguousarray(args[i])
        ptrs = [0] * len(args)
        for i in self.slots:
            ptrs[i] = args[i].data.ptr
        if (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4]) & 15:
            i = next(i for i in range(5) if ptrs[i] & 15)
            raise ValueError(f"{_ARG_NAMES[i]}: the decode kernels read 16-byte chunks; its data "
                             f"must start on a 16-byte boundary (got address {ptrs[i]:#x})")
        if api.POISON_OUTPUTS:
            out.view(cupy.uint16).fill(0x7FFF)  # a NaN in bf16 and fp16 alike
            if want_lse:
                lse.fill(np.nan)
        ws = cupy.empty(self.ws_bytes, cupy.uint8) if self.ws_bytes else None
        self.plan.run((*ptrs, out.data.ptr, lse.data.ptr if want_lse else 0),
                      0 if ws is None else ws.data.ptr, cupy.cuda.get_current_stream().ptr)
        return out, lse


class _CupyArrays:
    """How _gpu_entry reads CuPy arrays (byte strides turned into elements)."""
    entry_class = _CupyEntry

    def __init__(self):
        import cupy

        self.array, self.f32, self.u8 = cupy.ndarray, cupy.float32, cupy.uint8
        self.raw_stream = None  # _CupyEntry.run reads CuPy's current stream

    @staticmethod
    def strides(x) -> tuple:
        return tuple(s // x.itemsize for s in x.strides)

    @staticmethod
    def capturing() -> bool:
        import cupy

        return cupy.cuda.get_current_stream().is_capturing()

    @staticmethod
    def is_contiguous(x) -> bool:
        return x.flags.c_contiguous


_ARG_NAMES = ("q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
              "cache_batch_idx", "cache_leftpad", "block_table", "alibi_slopes")


def kvcache_with_config(config, q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                        rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                        cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                        window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                        alibi_slopes=None, num_splits=0):
    """flash_attn_with_kvcache on torch CUDA tensors with a given decode config (the tuner's
    trial point, a test's forced config): (out, lse). ``config.splits`` (when not 0) wins over
    num_splits; its split rule (split_cost) serves num_splits=0."""
    args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
            cache_leftpad, block_table, alibi_slopes)
    scalars = (softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits)
    return _run_cached(_gpu_plans, args, scalars, config=config)


def _run_cached(plans: dict, args: tuple, scalars: tuple, array_class=None, arrays=None,
                config=None, want_lse=True):
    """Run a call through its cached entry in ``plans`` (made, validated, on first sight): torch
    tensors, or CuPy arrays (array_class cupy.ndarray, arrays the _CupyArrays adapter class);
    a forced ``config`` keys the entry too. (out, lse); lse None without ``want_lse``."""
    try:
        key = _gpu_key(args, *scalars, array_class)
        if key is not None and config is not None:
            key += (config,)
        entry = plans.get(key) if key is not None else None
    except (TypeError, AttributeError):  # an unhashable argument, or no tensor where one belongs:
        entry = key = None                # validation (_gpu_entry) names it
    if entry is None:
        entry = _gpu_entry(args, *scalars, config, arrays=None if arrays is None else arrays())
        if key is not None:
            plans[key] = entry
    return entry.run(args, want_lse)


def _gpu_entry(args, softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits,
               config=None, arrays=None, call=None):
    """First call of a GPU call shape: validate everything (errors name the argument), choose
    the family and config (or check the given one), fix the split count, build the plan.
    call: the KVCacheCall when validated already (NumPy inputs: on the caller's arrays)."""
    from . import _gpu
    from .launch import Plan

    (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
     cache_leftpad, block_table, alibi_slopes) = args
    if call is None:
        call = check_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                             cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                             window_size, softcap, rotary_interleaved, alibi_slopes, num_splits)
    arrays = _TorchArrays() if arrays is None else arrays  # torch tensors, or CuPy arrays
    entry = arrays.entry_class()
    b, sq, h, d = call.tq.shape
    entry.out_shape, entry.lse_shape = (b, sq, h, d), (b, h, sq)
    entry.device = call.tq.device
    entry.empty = b == 0 or h == 0 or (sq == 0 and not call.seqlen_new)
    entry.contiguous, entry.ws_bytes, entry.plan, entry.counters = (), 0, None, None
    entry.slots = tuple(i for i, x in enumerate(args) if isinstance(x, arrays.array))
    entry.f32, entry.u8, entry.raw_stream = arrays.f32, arrays.u8, arrays.raw_stream
    if entry.empty:
        return entry
    _gpu.require("flash_attn_with_kvcache")
    problem = call.problem(call.tq.dtype)
    dev = call.tq.device
    page_size = int(k_cache.shape[1]) if call.paged else 0
    family, cfg = call_config(problem, dev, page_size, call.num_splits, config)
    # 16-byte rows: every stride but the head dim's in whole 8-element (16-byte) chunks
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if x is not None and any(s % 8 for s, n in zip(arrays.strides(x)[:3], x.shape) if n > 1):
            raise ValueError(f"{name}: the decode kernels read 16-byte chunks; strides (elements) "
                             f"must be multiples of 8 but the head dim's, got {arrays.strides(x)}")
    contiguous = [i for i, x in ((5, rotary_cos), (6, rotary_sin), (7, cache_seqlens),
                                 (8, cache_batch_idx), (9, cache_leftpad), (10, block_table),
                                 (11, alibi_slopes))
                  if isinstance(x, arrays.array) and not arrays.is_contiguous(x)]
    entry.contiguous = tuple(contiguous)
    stride3 = lambda x: arrays.strides(x)[:3] if x is not None else (0, 0, 0)  # noqa: E731
    fixed = cache_seqlens if isinstance(cache_seqlens, Integral) else call.capacity
    strides = {
        "q": stride3(q), "k_cache": stride3(k_cache), "v_cache": stride3(v_cache),
        "k_new": stride3(k), "v_new": stride3(v), "o": api.out_strides(entry.out_shape)[:3],
        "call": dict(
            seqlen_new=call.seqlen_new, page_size=int(k_cache.shape[1]) if call.paged else 0,
            num_pages=int(k_cache.shape[0]), cache_seqlen_fixed=int(fixed),
            rotary_dim=call.rotary_dim, rotary_interleaved=bool(rotary_interleaved),
            rotary_q_per_row=call.causal or call.window_size != (-1, -1),
            rotary_row_stride=call.rotary_dim // 2 if call.rotary_dim else 0,
            block_table_stride=int(block_table.shape[1]) if block_table is not None else 0,
            alibi_batch_stride=h if alibi_slopes is not None and alibi_slopes.ndim == 2 else 0,
            window=call.window_size, softcap=call.softcap)}
    if config is None and arrays.capturing():
        cfg = captured_config(family, cfg, problem, dev, call.num_splits)
    _check_counters(family, cfg, problem, arrays)
    entry.plan = Plan(family, cfg, problem, strides, call.softmax_scale, dev)  # it keeps the counters
    entry.counters = entry.plan.counters.get("split_counters")
    entry.ws_bytes = entry.plan.workspace_bytes
    return entry


def call_config(problem: Problem, dev: int, page_size: int, num_splits: int, config=None, dirs=None) -> tuple:
    """(family, config) that a call of ``problem`` (op decode) runs on device ``dev``: the choice
    (or the given ``config``), refined by what only the call knows: its page size (0: contiguous),
    the caller's split count (0: the heuristic's), no query rows; outside a CUDA-graph capture
    (``captured_config`` then). Raises ValueError naming the argument for a given config that
    cannot run the call. ``python -m cuflash warmup --decode`` runs it for the calls it warms
    (``dirs``: the tuned tables' directories, as ``cuflash.select.choose`` takes them)."""
    from . import _gpu
    from .select import choose

    arch, max_smem = _gpu.arch(dev), _gpu.max_smem(dev)
    family, cfg, source = choose(problem, arch, _gpu.name(dev), max_smem, config, dirs)
    # What only the call knows (the page size) refines the config: the decode family's Hopper
    # loop runs only some calls (a given config says why not, a chosen one falls back) and takes
    # small pages when the heuristic chose (DecodeSplitKV.call_config).
    refine = getattr(family, "call_config", None)
    if refine is not None:
        cfg = refine(cfg, problem, arch, page_size, chosen=config is None,
                     heuristic=str(source).startswith("heuristic"), max_smem=max_smem)
    if config is None and num_splits and getattr(cfg, "stream", False):
        cfg = cfg.replace(stream=False)   # the caller's split count: the split kernel runs it
    splits = (getattr(cfg, "splits", 0) or num_splits
              or family.split_count(cfg, problem, _gpu.sm_count(dev), max_smem))
    if problem.seqlen_q == 0:
        splits = 1
    pair = getattr(family, "pair_cluster", None)
    if pair is not None and config is None and not num_splits and not getattr(cfg, "splits", 0):
        cfg = pair(cfg, problem, splits)   # the heuristic's 2 splits as one cluster (REGS_CLUSTER_PAIRS)
    cluster = getattr(cfg, "regs_cluster", 0)
    if cluster and splits != cluster:   # a cluster of the splits runs exactly its own count
        if config is not None:
            raise ValueError(f"num_splits: {cfg.name} merges its splits as one cluster of {cluster} CTAs; "
                             f"num_splits must be 0 or {cluster}, got {splits}")
        cfg = family.without_cluster(cfg)
    return family, cfg.replace(splits=splits).validate(max_smem)


def captured_config(family, cfg, problem: Problem, dev: int, num_splits: int):
    """A chosen ``cfg`` (call_config's) for a call shape first seen inside a CUDA-graph capture: a
    chosen fused combine cannot allocate its zeroed split counters there, so the call shape runs
    the separate combine launch (same splits) instead."""
    from . import _gpu

    if not (getattr(cfg, "fused_combine", False) and getattr(family, "counters", lambda c, p: 0)(cfg, problem)):
        return cfg
    return cfg.replace(fused_combine=False, **({"early_merge": False} if getattr(cfg, "early_merge", False) else {}),
                       **({"dynamic": 0} if getattr(cfg, "dynamic", 0) == 1 else {}),
                       **({"light_fence": False} if getattr(cfg, "light_fence", False) else {}),
                       **({"stream": False, "splits": num_splits or family.split_count(
                           cfg.replace(stream=False, splits=0), problem, _gpu.sm_count(dev), _gpu.max_smem(dev))}
                          if getattr(cfg, "stream", False) else {}))


def _check_counters(family, cfg, problem, arrays):
    """A config that keeps counters between calls (the fused combine's per-group count of
    finished splits, reset to 0 by the kernel itself) has its plan zero them when it is made,
    one buffer per CUDA stream (cuflash.launch.StreamCounters), never per call; not during a
    CUDA-graph capture, where the zeroing would only run at replay (a chosen config drops
    fused_combine there, _gpu_entry; a given one raises here, before any CUDA call)."""
    if getattr(family, "counters", lambda c, p: 0)(cfg, problem) and arrays.capturing():
        raise RuntimeError(f"flash_attn_with_kvcache: {cfg.name} (fused combine) allocates its split "
                           "counters on a call shape's first call; make that call once before "
                           "capturing a CUDA graph")


def _numpy_kvcache(call: KVCacheCall, args: tuple, scalars: tuple) -> tuple:
    """NumPy inputs (validated on the host, int arguments' values included): copied to the GPU
    (CuPy, the current device), run by the same kernels as CuPy arrays, out and lse copied
    back; when k, v are appended, the caller's k_cache / v_cache receive the updated cache
    (in place, as flash-attn mutates its cache). No plan cache: each call copies the cache
    both ways, O(cache) traffic (for tests and small caches; keep a serving cache on the GPU)."""
    from . import _gpu

    q, k_cache, v_cache = args[:3]
    if call.seqlen_new:
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not x.flags.writeable:
                raise ValueError(f"{name}: a read-only NumPy array; flash_attn_with_kvcache appends "
                                 "k, v to the cache in place")
        if np.shares_memory(k_cache, v_cache):
            raise ValueError("v_cache: shares memory with k_cache; the in-place append needs two "
                             "separate caches")
    b, sq, h, _ = call.tq.shape
    if b == 0 or h == 0 or (sq == 0 and not call.seqlen_new):  # nothing to run or append
        return np.zeros(q.shape, q.dtype), np.full((b, h, sq), np.inf, np.float32)
    _gpu.require("flash_attn_with_kvcache (NumPy inputs)")
    import dataclasses

    import cupy

    def to_gpu(x):  # 16-bit floats as raw words (NumPy has no bf16 CuPy can hold)
        if not isinstance(x, np.ndarray):
            return x  # None, an int cache_seqlens
        x = np.ascontiguousarray(x)
        return cupy.asarray(x.view(np.uint16) if x.dtype.itemsize == 2 and x.dtype.kind not in "iub"
                            else x)

    dev_args = tuple(to_gpu(x) for x in args)
    tq = dataclasses.replace(api.describe_raw(dev_args[0]), dtype=call.tq.dtype)
    dev_call = dataclasses.replace(call, tq=tq)
    entry = _gpu_entry(dev_args, *scalars, arrays=_CupyArrays(), call=dev_call)
    out, lse = entry.run(dev_args)
    if call.seqlen_new:  # the appended rows (and all others, unchanged) back into the caller's
        k_cache[...] = cupy.asnumpy(dev_args[1]).view(k_cache.dtype)
        v_cache[...] = cupy.asnumpy(dev_args[2]).view(v_cache.dtype)
    return cupy.asnumpy(out).view(q.dtype), cupy.asnumpy(lse)


def _reference_torch(call, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                     cache_batch_idx, cache_leftpad, block_table, window_size, causal,
                     rotary_interleaved, alibi_slopes):
    """The torch CPU path: the float64 reference, the caches updated in place."""
    import torch

    from . import reference

    def as64(x):
        return None if x is None else x.detach().to(torch.float64).numpy()

    def ints(x):
        return None if x is None or isinstance(x, Integral) else x.detach().numpy().astype(np.int64)

    dtype = q.dtype

    def rounding(x):  # the rotated q and k, as a kernel in the inputs' dtype holds them
        return torch.from_numpy(x).to(dtype).to(torch.float64).numpy()

    out, lse, k_new, v_new = reference.attention_kvcache(
        as64(q), as64(k_cache), as64(v_cache),
        cache_seqlens if isinstance(cache_seqlens, Integral) else ints(cache_seqlens),
        as64(k), as64(v), rotary_cos=as64(rotary_cos), rotary_sin=as64(rotary_sin),
        rotary_interleaved=rotary_interleaved, cache_batch_idx=ints(cache_batch_idx),
        cache_leftpad=ints(cache_leftpad), block_table=ints(block_table),
        softmax_scale=call.softmax_scale, causal=bool(causal), window_size=tuple(window_size),
        softcap=call.softcap, alibi_slopes=as64(alibi_slopes), num_splits=call.num_splits,
        rounding=rounding)
    if call.seqlen_new:
        with torch.no_grad():
            k_cache.copy_(torch.from_numpy(k_new))
            v_cache.copy_(torch.from_numpy(v_new))
    return torch.from_numpy(out).to(dtype), torch.from_numpy(lse).to(torch.float32)


__all__ = ["flash_attn_with_kvcache", "check_kvcache", "KVCacheCall", "kvcache_with_config"]
