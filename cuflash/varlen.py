"""Variable-length batches on the GPU: launch plans for the varlen kernels (sm90_fwd on sm_90,
fa2_fwd elsewhere, and fa2_bwd, built with ``varlen``, kernels_cu/varlen.cuh), for CuPy arrays, NumPy arrays and torch tensors.

``cuflash.api.flash_attn_varlen_func`` validates a call and comes here for GPU inputs; torch
tensors go through ``cuflash.varlen_torch`` (autograd, torch.library ops for torch.compile and
CUDA graphs), which launches the same plans. Layouts are flash-attn's: q, out (total_q, nheads,
head_dim); k, v (total_k, nheads_kv, head_dim); cu_seqlens int32 (batch + 1) on the device;
softmax_lse fp32 (nheads, total_q).

A varlen call is a ``Problem`` with "varlen" in its features, batch = number of sequences and
seqlen_q / seqlen_k = max_seqlen_q / max_seqlen_k (the grids' extent); selection and the
families handle it as any other problem (the forward runs sm90_fwd on the H100, fa2_fwd on
sm_80; the backward fa2_bwd, sm90_bwd refuses varlen).
The token totals travel to the family as ``strides["totals"]`` (the fp32 workspace of the
backward is indexed by tokens), the cu_seqlens pointers per call (``Plan.run_varlen``).
"""
from __future__ import annotations

import math

import numpy as np

from .problem import Problem

VARLEN = ("varlen",)
_plans: dict = {}


def _drop_plans() -> None:
    _plans.clear()


def _on_change():
    from . import compile as compile_mod

    compile_mod.on_change(_drop_plans)


_on_change()


def strides4(strides3) -> tuple:
    """A (total, nheads, head_dim) array's element strides as the kernels' 4-D (batch stride 0)."""
    return (0,) + tuple(int(s) for s in strides3[:2]) + (int(strides3[2]) if len(strides3) > 2 else 1,)


def problem_of(op: str, dtype: str, nseq: int, max_q: int, max_k: int, nheads: int, nheads_kv: int,
               head_dim: int, causal: bool, deterministic: bool = False) -> Problem:
    return Problem(op, dtype, nseq, max_q, max_k, nheads, nheads_kv, head_dim, bool(causal),
                   bool(deterministic), VARLEN)


def get_plan(op: str, dtype: str, nseq: int, max_q: int, max_k: int, totals: tuple, q_shape: tuple,
             k_shape: tuple, strides: dict, scale: float, causal: bool, deterministic: bool,
             device: int, config=None):
    """The cached launch plan of one varlen call shape (``strides``: per tensor, 3-D)."""
    key = (op, dtype, nseq, max_q, max_k, totals, q_shape, k_shape,
           tuple(sorted((n, tuple(s)) for n, s in strides.items())), scale, causal, deterministic,
           device, config)
    plan = _plans.get(key)
    if plan is None:
        from .api import make_plan

        problem = problem_of(op, dtype, nseq, max_q, max_k, q_shape[1], k_shape[1], q_shape[2],
                             causal, deterministic)
        full = {n: strides4(s) for n, s in strides.items()}
        full["totals"] = tuple(int(t) for t in totals)
        plan = _plans[key] = make_plan(problem, full, scale, device, config)
    return plan


def contiguous3(shape) -> tuple:
    return (shape[1] * shape[2], shape[2], 1)


# ---------------------------------------------------------------------------------------
# CuPy (and NumPy through CuPy)

def _cupy():
    import cupy

    return cupy


def _strides3(x) -> tuple:
    item = x.dtype.itemsize
    return tuple(s // item for s in x.strides)


def forward_cupy(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool,
                 config=None, dtype=None):
    """(out, lse) of validated CuPy arrays, on the current stream; head dim a multiple of 8.
    dtype: "bf16" / "fp16" for arrays of raw 16-bit words (NumPy inputs), else q's."""
    cupy = _cupy()
    total_q, nheads, d = q.shape
    total_k = k.shape[0]
    nseq = cu_q.shape[0] - 1
    with cupy.cuda.Device(q.device.id):
        out = cupy.empty(q.shape, q.dtype)
        lse = cupy.empty((nheads, total_q), cupy.float32)
        if total_q == 0 or nheads == 0 or max_q == 0:
            return out, lse
        if total_k == 0 or max_k == 0:  # no keys anywhere: every row fully masked
            out.view(cupy.uint16).fill(0)
            lse.fill(math.inf)
            return out, lse
        from . import api

        if api.POISON_OUTPUTS:
            out.view(cupy.uint16).fill(0x7FFF)
            lse.fill(np.nan)
        cu_q, cu_k = cupy.ascontiguousarray(cu_q), cupy.ascontiguousarray(cu_k)  # read as int32[]
        strides = {"q": _strides3(q), "k": _strides3(k), "v": _strides3(v), "o": contiguous3(q.shape)}
        plan = get_plan("fwd", dtype or api.dtype_name(q), nseq, int(max_q), int(max_k), (total_q, total_k),
                        q.shape, k.shape, strides, scale, bool(causal), False, q.device.id, config)
        plan.run_varlen((q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr), 0,
                        cupy.cuda.get_current_stream().ptr, cu_q.data.ptr, cu_k.data.ptr)
    return out, lse


def _backward_inputs(cupy, dout, out, lse, cu_q, cu_k) -> tuple:
    """The CuPy backward's inputs as the kernels read them: dout dense and 16-byte aligned; out
    in place when its rows are whole aligned 16-byte chunks, else a dense copy; lse and the
    int32 cu_seqlens dense."""
    dout = cupy.ascontiguousarray(dout)
    if dout.data.ptr & 15:
        dout = dout.copy()
    if out.strides[-1] != out.dtype.itemsize or out.data.ptr & 15 or any(
            (st // out.dtype.itemsize) % 8 for st, n in zip(out.strides[:2], out.shape[:2]) if n > 1):
        out = out.copy()
    return (dout, out, cupy.ascontiguousarray(lse), cupy.ascontiguousarray(cu_q),
            cupy.ascontiguousarray(cu_k))


def backward_cupy(dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, scale: float,
                  causal: bool, deterministic: bool = False, config=None):
    """(dq, dk, dv) of validated CuPy arrays, on the current stream; head dim a multiple of 8."""
    cupy = _cupy()
    total_q, nheads, d = q.shape
    total_k = k.shape[0]
    nseq = cu_q.shape[0] - 1
    with cupy.cuda.Device(q.device.id):
        dq, dk, dv = (cupy.empty(x.shape, x.dtype) for x in (q, k, v))
        if total_q == 0 or total_k == 0 or nheads == 0 or max_q == 0 or max_k == 0:
            for x in (dq, dk, dv):
                x.view(cupy.uint16).fill(0)
            return dq, dk, dv
        from . import api

        dout, out, lse, cu_q, cu_k = _backward_inputs(cupy, dout, out, lse, cu_q, cu_k)
        strides = {"dout": _strides3(dout), "q": _strides3(q), "k": _strides3(k), "v": _strides3(v),
                   "o": _strides3(out), "dq": contiguous3(q.shape), "dk": contiguous3(k.shape),
                   "dv": contiguous3(k.shape)}
        plan = get_plan("bwd", api.dtype_name(q), nseq, int(max_q), int(max_k), (total_q, total_k),
                        q.shape, k.shape, strides, scale, bool(causal), bool(deterministic),
                        q.device.id, config)
        if api.POISON_OUTPUTS:
            for x in (dq, dk, dv):
                x.view(cupy.uint16).fill(0x7FFF)
        ws = cupy.empty(max(plan.workspace_bytes, 1), cupy.uint8)
        plan.run_varlen((dout.data.ptr, q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr,
                         lse.data.ptr, dq.data.ptr, dk.data.ptr, dv.data.ptr), ws.data.ptr,
                        cupy.cuda.get_current_stream().ptr, cu_q.data.ptr, cu_k.data.ptr)
    return dq, dk, dv


def forward_numpy(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, config=None):
    """NumPy inputs: copied to the current GPU as raw 16-bit words, results copied back."""
    cupy = _cupy()
    dq, dk, dv = (cupy.asarray(np.ascontiguousarray(x).view(np.uint16)) for x in (q, k, v))
    cq, ck = cupy.asarray(np.asarray(cu_q, np.int32)), cupy.asarray(np.asarray(cu_k, np.int32))
    out, lse = forward_cupy(dq, dk, dv, cq, ck, max_q, max_k, scale, causal, config,
                            "bf16" if str(q.dtype) == "bfloat16" else "fp16")
    return cupy.asnumpy(out).view(q.dtype), cupy.asnumpy(lse)


# ---------------------------------------------------------------------------------------
# varlen with features: sliding window, softcap, ALiBi, dropout. The same kernels with their
# feature flags (fa2_fwd / fa2_bwd); every mask, score modifier and dropout counter is built
# per sequence from its own lengths and its batch index (kernels_cu/varlen.cuh): window and
# ALiBi distance bottom-right aligned per sequence, ALiBi slopes (batch, nheads) read at the
# sequence's index, Philox keyed by (seed, offset, b·nheads + head, row, column) within
# sequence b, so sequence b's keep mask is that of the dense call of it alone at batch index b.
# The per-call addresses (cu_seqlens, slopes, the RNG state) are written by Plan.run_with.

_feature_plans: dict = {}


def _on_change_features():
    from . import compile as compile_mod

    compile_mod.on_change(_feature_plans.clear)


_on_change_features()


def features_problem(op: str, dtype: str, nseq: int, max_q: int, max_k: int, nheads: int,
                     nheads_kv: int, head_dim: int, causal: bool, window=(-1, -1), softcap: float = 0.0,
                     alibi_batched=None, dropout_p: float = 0.0, deterministic: bool = False,
                     paged: bool = False) -> Problem:
    """The Problem of a varlen call with features, from normalized values (cuflash.api's
    check_features): window (left, right) with -1 unbounded ((-1, -1): none), softcap 0: none,
    alibi_batched None: no ALiBi, else whether the slopes are (batch, nheads); dropout_p 0: none."""
    window = (int(window[0]), int(window[1]))
    feats = ["varlen"]
    if window != (-1, -1):
        feats.append("window")
    if softcap:
        feats.append("softcap")
    if alibi_batched is not None:
        feats.append("alibi")
    if dropout_p:
        feats.append("dropout")
    if paged:  # block_table: a paged K/V cache (fa2_fwd_paged)
        feats.append("paged")
    return Problem(op, dtype, int(nseq), int(max_q), int(max_k), int(nheads), int(nheads_kv),
                   int(head_dim), bool(causal), bool(deterministic), tuple(sorted(feats)),
                   float(dropout_p), window, float(softcap), bool(alibi_batched))


def feature_plan(problem: Problem, totals: tuple, strides: dict, scale: float, device: int,
                 config=None):
    """The cached launch plan of a varlen call with features (``strides``: per tensor, 3-D);
    run it with ``run_features``."""
    key = (problem, tuple(int(t) for t in totals),
           tuple(sorted((n, tuple(s)) for n, s in strides.items())), scale, device, config)
    plan = _feature_plans.get(key)
    if plan is None:
        from .api import make_plan

        full = {n: strides4(s) for n, s in strides.items()}
        full["totals"] = tuple(int(t) for t in totals)
        plan = _feature_plans[key] = make_plan(problem, full, scale, device, config)
    return plan


def run_features(plan, ptrs: tuple, workspace_ptr: int, stream: int, cu_q: int, cu_k: int,
                 slopes: int = 0, rng: int = 0, block_table: int = 0) -> None:
    """Launch a feature plan: the tensors' addresses, then the per-call fields (cu_seqlens,
    the ALiBi slopes, dropout's (seed, offset) state, a paged cache's block table), reset
    after the launch."""
    extra = (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k))
    if slopes:
        extra += (("alibi_slopes", slopes),)
    if rng:
        extra += (("rng_state", rng),)
    if block_table:
        extra += (("block_table", block_table),)
    plan.run_with(ptrs, workspace_ptr, stream, extra)


def _rng_array(cupy, seed_offset):
    return None if seed_offset is None else cupy.asarray(np.array(seed_offset, dtype=np.uint64))


def forward_cupy_features(q, k, v, cu_q, cu_k, problem: Problem, scale: float, slopes=None,
                          seed_offset=None, config=None):
    """(out, lse) of validated CuPy arrays (any 16-bit dtype: problem.dtype says which) with
    features, on the current stream; head dim a multiple of 8 (problem.head_dim). slopes: fp32
    CuPy array or None; seed_offset: dropout's (seed, offset) or None."""
    cupy = _cupy()
    total_q, nheads, _ = q.shape
    total_k = k.shape[0]
    with cupy.cuda.Device(q.device.id):
        out = cupy.empty(q.shape, q.dtype)
        lse = cupy.empty((nheads, total_q), cupy.float32)
        if total_q == 0 or nheads == 0 or problem.seqlen_q == 0:
            return out, lse
        if total_k == 0 or problem.seqlen_k == 0:  # no keys anywhere: every row fully masked
            out.view(cupy.uint16).fill(0)
            lse.fill(math.inf)
            return out, lse
        from . import api

        cu_q, cu_k = cupy.ascontiguousarray(cu_q), cupy.ascontiguousarray(cu_k)
        strides = {"q": _strides3(q), "k": _strides3(k), "v": _strides3(v), "o": contiguous3(q.shape)}
        plan = feature_plan(problem, (total_q, total_k), strides, scale, q.device.id, config)
        slopes = None if slopes is None else cupy.ascontiguousarray(slopes)
        rng = _rng_array(cupy, seed_offset)
        if api.POISON_OUTPUTS:
            out.view(cupy.uint16).fill(0x7FFF)
            lse.fill(np.nan)
        run_features(plan, (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr), 0,
                     cupy.cuda.get_current_stream().ptr, cu_q.data.ptr, cu_k.data.ptr,
                     0 if slopes is None else slopes.data.ptr, 0 if rng is None else rng.data.ptr)
    return out, lse


def backward_cupy_features(dout, q, k, v, out, lse, cu_q, cu_k, problem: Problem, scale: float,
                           slopes=None, seed_offset=None, config=None):
    """(dq, dk, dv) of validated CuPy arrays with features (problem.op "bwd"), on the current
    stream; head dim a multiple of 8."""
    cupy = _cupy()
    total_q, nheads, _ = q.shape
    total_k = k.shape[0]
    with cupy.cuda.Device(q.device.id):
        dq, dk, dv = (cupy.empty(x.shape, x.dtype) for x in (q, k, v))
        if total_q == 0 or total_k == 0 or nheads == 0 or problem.seqlen_q == 0 or problem.seqlen_k == 0:
            for x in (dq, dk, dv):
                x.view(cupy.uint16).fill(0)
            return dq, dk, dv
        from . import api

        dout, out, lse, cu_q, cu_k = _backward_inputs(cupy, dout, out, lse, cu_q, cu_k)
        strides = {"dout": _strides3(dout), "q": _strides3(q), "k": _strides3(k), "v": _strides3(v),
                   "o": _strides3(out), "dq": contiguous3(q.shape), "dk": contiguous3(k.shape),
                   "dv": contiguous3(k.shape)}
        plan = feature_plan(problem, (total_q, total_k), strides, scale, q.device.id, config)
        slopes = None if slopes is None else cupy.ascontiguousarray(slopes)
        rng = _rng_array(cupy, seed_offset)
        if api.POISON_OUTPUTS:
            for x in (dq, dk, dv):
                x.view(cupy.uint16).fill(0x7FFF)
        ws = cupy.empty(max(plan.workspace_bytes, 1), cupy.uint8)
        run_features(plan, (dout.data.ptr, q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr,
                            lse.data.ptr, dq.data.ptr, dk.data.ptr, dv.data.ptr), ws.data.ptr,
                     cupy.cuda.get_current_stream().ptr, cu_q.data.ptr, cu_k.data.ptr,
                     0 if slopes is None else slopes.data.ptr, 0 if rng is None else rng.data.ptr)
    return dq, dk, dv


def forward_numpy_features(q, k, v, cu_q, cu_k, problem: Problem, scale: float, slopes=None,
                           seed_offset=None, config=None):
    """NumPy inputs with features: copied to the current GPU as raw 16-bit words (slopes as
    fp32), results copied back."""
    cupy = _cupy()
    dq, dk, dv = (cupy.asarray(np.ascontiguousarray(x).view(np.uint16)) for x in (q, k, v))
    cq, ck = cupy.asarray(np.asarray(cu_q, np.int32)), cupy.asarray(np.asarray(cu_k, np.int32))
    ds = None if slopes is None else cupy.asarray(np.ascontiguousarray(slopes, np.float32))
    out, lse = forward_cupy_features(dq, dk, dv, cq, ck, problem, scale, ds, seed_offset, config)
    return cupy.asnumpy(out).view(q.dtype), cupy.asnumpy(lse)


# ---------------------------------------------------------------------------------------
# paged K/V cache (flash_attn_varlen_func with block_table; fa2_fwd_paged, forward only):
# k, v (num_pages, page_block_size, nheads_kv, head_dim), block_table int32 (batch, max_pages),
# cu_seqlens_k the cumulative numbers of keys of the sequences.

def paged_plan(problem: Problem, total_q: int, q_strides: tuple, k_strides: tuple, v_strides: tuple,
               paged: tuple, scale: float, device: int, config=None):
    """The cached launch plan of a paged call: q (and out) 3-D strides, k / v 4-D cache strides,
    paged = (page_block_size, num_pages, block table columns, block table row stride)."""
    key = ("paged", problem, int(total_q), tuple(q_strides), tuple(k_strides), tuple(v_strides),
           tuple(paged), scale, device, config)
    plan = _feature_plans.get(key)
    if plan is None:
        from .api import make_plan

        strides = {"q": strides4(q_strides), "o": strides4(q_strides), "k": tuple(int(x) for x in k_strides),
                   "v": tuple(int(x) for x in v_strides), "totals": (int(total_q), 0),
                   "paged": tuple(int(x) for x in paged)}
        plan = _feature_plans[key] = make_plan(problem, strides, scale, device, config)
    return plan


def _cache_strides(x) -> tuple:
    item = x.dtype.itemsize
    return tuple(int(s) // item for s in x.strides)


def forward_cupy_paged(q, k, v, cu_q, cu_k, block_table, problem: Problem, scale: float,
                       slopes=None, config=None):
    """(out, lse) of a validated paged call on CuPy arrays (any 16-bit dtype), current stream;
    head dim a multiple of 8 (problem.head_dim); q contiguous (a copy is made otherwise)."""
    cupy = _cupy()
    total_q, nheads, _ = q.shape
    with cupy.cuda.Device(q.device.id):
        out = cupy.empty(q.shape, q.dtype)
        lse = cupy.empty((nheads, total_q), cupy.float32)
        if total_q == 0 or nheads == 0 or problem.seqlen_q == 0:
            return out, lse
        if problem.seqlen_k == 0:
            out.view(cupy.uint16).fill(0)
            lse.fill(math.inf)
            return out, lse
        from . import api

        q = cupy.ascontiguousarray(q)
        cu_q, cu_k = cupy.ascontiguousarray(cu_q), cupy.ascontiguousarray(cu_k)
        table = cupy.ascontiguousarray(block_table)
        paged = (k.shape[1], k.shape[0], table.shape[1], table.shape[1])
        plan = paged_plan(problem, total_q, contiguous3(q.shape), _cache_strides(k), _cache_strides(v),
                          paged, scale, q.device.id, config)
        slopes = None if slopes is None else cupy.ascontiguousarray(slopes)
        if api.POISON_OUTPUTS:
            out.view(cupy.uint16).fill(0x7FFF)
            lse.fill(np.nan)
        run_features(plan, (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr), 0,
                     cupy.cuda.get_current_stream().ptr, cu_q.data.ptr, cu_k.data.ptr,
                     0 if slopes is None else slopes.data.ptr, 0, table.data.ptr)
    return out, lse


def gather_paged(cache, block_table, lens_k, xp=np):
    """The packed (total_k, nheads_kv, head_dim) keys (or values) of a paged cache: sequence b's
    lens_k[b] rows, key j from row j % page_block_size of page block_table[b, j //
    page_block_size] (the kernels' addressing; the reference and the CPU path use it).
    ``xp``: numpy or torch (host arrays / tensors, indexed alike)."""
    page = int(cache.shape[1])
    rows = []
    for b, n in enumerate(int(x) for x in lens_k):
        j = np.arange(n)
        pages = np.asarray(block_table[b])[j // page] if n else np.zeros(0, np.int64)
        rows.append((np.asarray(pages, np.int64), j % page))
    pages = np.concatenate([r[0] for r in rows]) if rows else np.zeros(0, np.int64)
    within = np.concatenate([r[1] for r in rows]) if rows else np.zeros(0, np.int64)
    if xp is np:
        return cache[pages, within]
    import torch

    return cache[torch.as_tensor(pages), torch.as_tensor(within)]
