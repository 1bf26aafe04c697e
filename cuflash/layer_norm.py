"""The fused residual add + LayerNorm / RMSNorm kernels (``kernels_cu/layer_norm.cu``) behind
``cuflash.ops.layer_norm``'s common case: ``forward`` and ``backward`` on 2-D (rows, n) tensors
with contiguous rows, the formulas of ``kernels_cu/layer_norm.cu``'s header.

``forward(x, weight, bias, residual, eps, is_rms, zero_centered, res_dtype, write_res)`` returns
``(y, residual_out, mean, rstd)``: y in x's dtype, residual_out = x [+ residual] rounded to
``res_dtype`` (an empty tensor unless ``write_res``), mean and rstd (rows,) fp32 (mean 0 for
RMSNorm). ``backward(dy, dres_out, h, weight, has_bias, mean, rstd, is_rms, zero_centered,
has_residual, res_dtype)`` returns ``(dx, dweight, dbias, dresidual)`` (dbias / dresidual empty
when absent); h is the forward's residual_out when it was written, else x.

torch CUDA tensors that ``kernel_takes`` run the kernels (compiled by CuPy/NVRTC on first use,
launched by raw pointer on torch's current stream); others (CPU, float64) run
``reference_forward`` / ``reference_backward``, the same formulas as torch operations in float64
(what the torch ops' CPU impls call). Not an attention family: the kernels compile through
``cuflash.compile.get_helper_functions``, as rotary and cross-entropy.
"""
from __future__ import annotations

import struct

import torch

from . import api
from . import compile as compile_mod

Tensor = torch.Tensor

_KERNEL_TYPES = {torch.bfloat16: "cuflash::bf16", torch.float16: "cuflash::fp16", torch.float32: "float"}
CHUNKS = 4                      # kChunks: 8-element chunks per thread (32 row elements in registers)
# kChunks of the fused backward (layer_norm_bwd) where a CTA of at most MAX_THREADS holds the row at it
# (n <= 8192): 2 chunks a thread hold half the registers of 4 (64 against 128 a thread on sm_90), so
# twice the warps fit on an SM (session 29, ln3: the H200 round 2 A/B)
BWD_CHUNKS = 2
MAX_THREADS = 512               # CTA sizes: multiples of 32 up to this
MAX_N = MAX_THREADS * CHUNKS * 8   # 16384: longer rows take the composition
_DW_THREADS = 128               # kLnDwThreads
_FINISH_THREADS = 512           # kLnFinishThreads
_FINISH_COLS = 32               # kLnFinishCols: columns per CTA of layer_norm_bwd_dw_finish
# layer_norm_bwd_dw: row splits until about DW_CTAS_PER_SM CTAs per SM are launched
DW_CTAS_PER_SM = 4
# The backward: True: layer_norm_bwd (dx and per-CTA dweight / dbias column sums in one pass over dy
# and h, as many CTAs as fit on the GPU at once); False: layer_norm_bwd_dx, then layer_norm_bwd_dw
# reading dy and h again
FUSED_DW = True
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def fused_smem(threads: int, chunks: int = None) -> int:
    """layer_norm_bwd's dynamic shared memory: Σ dy · x̂ and Σ dy, fp32, per column of the row."""
    return 2 * (CHUNKS if chunks is None else chunks) * 8 * threads * 4


def threads_for(n: int, chunks: int = None) -> int:
    """The CTA size of a row of n at ``chunks`` (default CHUNKS) 8-element chunks a thread: the
    fewest whole warps that hold it in registers (12288: 384 threads, every one of them busy)."""
    if n > MAX_N:
        raise ValueError(f"rows of {n} features exceed the kernels' {MAX_N}")
    return 32 * max(1, -(-n // (32 * (CHUNKS if chunks is None else chunks) * 8)))


def plan_chunks(n: int, fused: bool) -> int:
    """kChunks of a plan's module: BWD_CHUNKS for the fused backward where a CTA of at most
    MAX_THREADS holds the row at it, else CHUNKS."""
    if fused and threads_for(n, BWD_CHUNKS) <= MAX_THREADS:
        return BWD_CHUNKS
    return CHUNKS


def kernel_names(dtype, res_dtype, w_dtype, threads: int, vector: bool, chunks: int = None) -> tuple:
    """The name expressions of one module: forward, backward dx, backward dw partials, dw finish,
    the fused backward (dx and the dw partials); ``chunks`` kChunks (default CHUNKS)."""
    e, r, w = _KERNEL_TYPES[dtype], _KERNEL_TYPES[res_dtype], _KERNEL_TYPES[w_dtype]
    v = "true" if vector else "false"
    c = CHUNKS if chunks is None else chunks
    return (f"cuflash::layer_norm_fwd<{e}, {r}, {w}, {threads}, {c}, {v}>",
            f"cuflash::layer_norm_bwd_dx<{e}, {r}, {w}, {threads}, {c}, {v}>",
            f"cuflash::layer_norm_bwd_dw<{e}, {r}, {v}>",
            f"cuflash::layer_norm_bwd_dw_finish<{w}>",
            f"cuflash::layer_norm_bwd<{e}, {r}, {w}, {threads}, {c}, {v}>")


def module_shapes(n: int) -> list:
    """The (threads, chunks) of the modules a row of n loads: the forward's (and the two-pass
    backward's), then the fused backward's when it differs."""
    return list(dict.fromkeys((threads_for(n, c), c) for c in (CHUNKS, plan_chunks(n, True))))


# python -m cuflash warmup --helpers layer_norm: the widths (features per row) it compiles for, as
# models have them (768 ... 16384: CTAs of 32, 64, 96, 128, 160, 256, 384, 512 threads)
WARM_WIDTHS = (768, 1024, 2048, 2560, 3072, 4096, 5120, 8192, 12288, 16384)


def warm_modules(dtypes, widths=WARM_WIDTHS) -> list:
    """The modules that calls on x of these torch dtypes load at these widths (16-byte accesses: n %
    8 == 0), with the weight and residual in x's dtype, the weight in fp32 (autocast's parameters)
    and the residual stream in fp32 (residual_in_fp32) (``python -m cuflash warmup --helpers``)."""
    out = []
    for dt in dtypes:
        if dt not in _KERNEL_TYPES:
            continue
        f32 = torch.float32
        combos = dict.fromkeys(((dt, dt, dt), (dt, dt, f32), (dt, f32, dt)))
        for t, ch in dict.fromkeys(s for n in widths for s in module_shapes(n)):
            out += [compile_mod.HelperModule("layer_norm", kernel_names(*c, t, True, ch)) for c in combos]
    return list(dict.fromkeys(out))


def kernel_takes(x: Tensor, weight, bias, residual, res_dtype) -> bool:
    """Whether the CUDA kernels take this call (x: (rows, n)); else the reference path runs."""
    return (x.is_cuda and x.dtype in _KERNEL_TYPES and weight is not None and weight.dtype in _KERNEL_TYPES
            and (bias is None or bias.dtype == weight.dtype) and res_dtype in _KERNEL_TYPES
            and (residual is None or residual.dtype == res_dtype) and 0 < x.shape[-1] <= MAX_N)


# ---------------------------------------------------------------------------------------
# the reference: torch operations in float64

def reference_forward(x, weight, bias, residual, eps, is_rms, zero_centered, res_dtype, write_res):
    h = x.double()
    if residual is not None:
        h = h + residual.double()
    res_out = h.to(res_dtype, copy=True) if write_res else x.new_empty(0)
    mean = torch.zeros(h.shape[0], dtype=torch.float64, device=x.device) if is_rms else h.mean(-1)
    var = (h * h).mean(-1) if is_rms else (h - mean[:, None]).square().mean(-1)
    rstd = 1.0 / torch.sqrt(var + eps)
    w = weight.double() + (1.0 if zero_centered else 0.0)
    y = (h - mean[:, None]) * rstd[:, None] * w
    if bias is not None:
        y = y + bias.double()
    st = torch.float64 if x.dtype == torch.float64 else torch.float32
    return y.to(x.dtype), res_out, mean.to(st, copy=True), rstd.to(st, copy=True)


def reference_backward(dy, dres_out, h, residual, weight, has_bias, mean, rstd, is_rms, zero_centered, has_residual,
                       res_dtype, h_from_res):
    h = h.double() if h_from_res or residual is None else h.double() + residual.double()
    xh = (h - mean.double()[:, None]) * rstd.double()[:, None]
    g = dy.double() * (weight.double() + (1.0 if zero_centered else 0.0))
    n = h.shape[-1]
    mgx = (g * xh).sum(-1, keepdim=True) / n
    mg = 0.0 if is_rms else g.sum(-1, keepdim=True) / n
    dh = rstd.double()[:, None] * (g - mg - xh * mgx)
    if dres_out is not None:
        dh = dh + dres_out.double()
    dw = (dy.double() * xh).sum(0).to(weight.dtype)
    db = dy.double().sum(0).to(weight.dtype) if has_bias else weight.new_empty(0)
    dres = dh.to(res_dtype, copy=True) if has_residual else dy.new_empty(0)
    return dh.to(dy.dtype, copy=True), dw, db, dres


# ---------------------------------------------------------------------------------------
# torch CUDA tensors: layer_norm.cu

from .torch_ops import _raw_stream  # noqa: E402 - (device index) -> cudaStream_t
from .launch import RecordPlan  # noqa: E402 - the plans' launch steps




_PTRS = struct.Struct("<15Q")   # LayerNormParams' fifteen pointers, written per call
_plans: dict = {}


def _drop_plans() -> None:
    _plans.clear()
    entries.clear()


compile_mod.on_change(_drop_plans)


_POINTER_FIELDS = ("x", "residual", "weight", "bias", "y", "residual_out", "mean", "rstd", "dy", "dresidual_out", "dx",
                   "dresidual", "partials", "dweight", "dbias")


def static_fields(rows, n, is_rms, h_from_res, splits, rows_per_split, eps, zero_centered) -> dict:
    """Every LayerNormParams field for cuflash.launch.pack: the pointers 0 (written per call
    through _PTRS), the rest the plan's."""
    fields = dict.fromkeys(_POINTER_FIELDS, 0)
    fields.update(rows=rows, n=n, is_rms=int(is_rms), h_from_res=int(h_from_res), splits=splits,
                  rows_per_split=rows_per_split, eps=eps, w_offset=1.0 if zero_centered else 0.0)
    return fields


class _Plan(RecordPlan):
    """One call shape: the module's kernels, grids and a packed record of the static fields."""
    __slots__ = ("fwd", "bwd_dx", "bwd_dw", "finish", "bwd", "smem", "threads", "rows", "n", "splits", "dw_grid",
                 "fused")
    PTRS = _PTRS

    def __init__(self, rows, n, dtype, res_dtype, w_dtype, device, vector, is_rms, eps, zero_centered, h_from_res,
                 fused=False):
        from cupy_backends.cuda.api import driver

        from .launch import ParamsRecord, pack

        super().__init__(device.index)
        self.rows, self.n = rows, n
        chunks = plan_chunks(n, fused)
        self.threads = threads_for(n, chunks)
        exprs = kernel_names(dtype, res_dtype, w_dtype, self.threads, vector, chunks)
        fns = compile_mod.get_helper_functions("layer_norm", exprs, self.device)
        self.fwd, self.bwd_dx, self.bwd_dw, self.finish, self.bwd = fns
        self.fused = fused = bool(fused)
        self.smem = fused_smem(self.threads, chunks) if fused else 0
        sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count
        if fused:   # one CTA per resident slot (occupancy of layer_norm_bwd), each a partials row
            current = self.get_device()
            if current != self.device:
                self.set_device(self.device)
            try:
                if self.smem > 48 * 1024:   # above 48 KB, dynamic shared memory is opted into per kernel
                    driver.funcSetAttribute(self.bwd, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.smem)
                per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(self.bwd, self.threads, self.smem)
            finally:
                if current != self.device:
                    self.set_device(current)
            self.splits = max(1, min(rows, max(1, per_sm) * sm_count))
            rows_per_split = 0
        else:
            col_blocks = -(-n // (8 * _DW_THREADS))
            want = max(1, -(-DW_CTAS_PER_SM * sm_count // col_blocks))
            rows_per_split = max(1, -(-rows // want))
            self.splits = max(1, -(-rows // rows_per_split))
        self.dw_grid = -(-n // (8 * _DW_THREADS))
        self.rec = ParamsRecord(pack("LayerNormParams", **static_fields(rows, n, is_rms, h_from_res, self.splits,
                                                                   rows_per_split, eps, zero_centered)))


def _vector(n, *tensors) -> bool:
    return n % 8 == 0 and all(t is None or t.data_ptr() % 16 == 0 for t in tensors)


def _plan(rows, n, dtype, res_dtype, w_dtype, device, vector, is_rms, eps, zero_centered, h_from_res,
          fused=False):
    key = (rows, n, dtype, res_dtype, w_dtype, device, vector, is_rms, eps, zero_centered, h_from_res, CHUNKS,
           BWD_CHUNKS, DW_CTAS_PER_SM, fused)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _Plan(rows, n, dtype, res_dtype, w_dtype, device, vector, is_rms, eps, zero_centered,
                                   h_from_res, fused)
    return plan


def _p(t) -> int:
    return 0 if t is None else t.data_ptr()


def forward(x, weight, bias, residual, eps, is_rms, zero_centered, res_dtype, write_res):
    """(y, residual_out, mean, rstd); x / residual (rows, n) with contiguous rows (see the
    module docstring). Arguments are checked by the caller (cuflash.ops.layer_norm)."""
    if not kernel_takes(x, weight, bias, residual, res_dtype):
        return reference_forward(x, weight, bias, residual, eps, is_rms, zero_centered, res_dtype, write_res)
    rows, n = x.shape
    x = x.contiguous()
    residual = residual.contiguous() if residual is not None else None
    weight = weight.contiguous()
    bias = bias.contiguous() if bias is not None else None
    y = torch.empty_like(x)
    res_out = torch.empty((rows, n) if write_res else (0,), dtype=res_dtype, device=x.device)
    # two allocations: the torch op cuflash::layer_norm_fwd returns both, and an op's outputs may not
    # alias one another (torch 2.11 warns, 2.12 raises)
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if api.POISON_OUTPUTS:   # test hook: anything the kernel misses shows as NaN
        for t in (y, res_out, mean, rstd):
            t.fill_(float("nan"))
    if rows:
        vector = _vector(n, x, residual, weight, bias, y, res_out if write_res else None)
        plan = _plan(rows, n, x.dtype, res_dtype, weight.dtype, x.device, vector, is_rms, eps, zero_centered, False)
        ptrs = (x.data_ptr(), _p(residual), weight.data_ptr(), _p(bias), y.data_ptr(),
                res_out.data_ptr() if write_res else 0, mean.data_ptr(), rstd.data_ptr(), 0, 0, 0, 0, 0, 0, 0)
        plan.run(ptrs, ((plan.fwd, rows, 1, plan.threads, 0),), _raw_stream(plan.device))
    return y, res_out, mean, rstd


def backward(dy, dres_out, h, residual, weight, has_bias, mean, rstd, is_rms, zero_centered, has_residual,
             res_dtype, h_from_res):
    """(dx, dweight, dbias, dresidual): dy (rows, n) in x's dtype; dres_out the gradient of
    residual_out or None; h the forward's fp32 residual_out (h_from_res), else x, and residual
    the forward's residual (or None): h = x + residual again."""
    if not (dy.is_cuda and dy.dtype in _KERNEL_TYPES and weight.dtype in _KERNEL_TYPES and res_dtype in _KERNEL_TYPES
            and h.dtype == (torch.float32 if h_from_res else dy.dtype)
            and (h_from_res or residual is None or residual.dtype == res_dtype)):
        return reference_backward(dy, dres_out, h, residual, weight, has_bias, mean, rstd, is_rms, zero_centered,
                                  has_residual, res_dtype, h_from_res)
    rows, n = dy.shape
    dy = dy.contiguous()
    h = h.contiguous()
    weight = weight.contiguous()
    residual = residual.contiguous() if residual is not None and not h_from_res else None
    dres_out = dres_out.contiguous() if dres_out is not None else None
    dx = torch.empty_like(dy)
    dw = torch.empty_like(weight)
    db = torch.empty_like(weight) if has_bias else weight.new_empty(0)
    dres = torch.empty((rows, n), dtype=res_dtype, device=dy.device) if has_residual else dy.new_empty(0)
    if api.POISON_OUTPUTS:
        for t in (dx, dw, db, dres):
            t.fill_(float("nan"))
    if rows == 0:
        dw.zero_()
        db.zero_()
        return dx, dw, db, dres
    vector = _vector(n, dy, h, residual, dres_out, weight, dx, dres if has_residual else None)
    plan = _plan(rows, n, dy.dtype, res_dtype, weight.dtype, dy.device, vector, is_rms, 0.0, zero_centered,
                 h_from_res, FUSED_DW)
    partials = torch.empty(plan.splits * 2 * n, dtype=torch.float32, device=dy.device)
    ptrs = (0 if h_from_res else h.data_ptr(), _p(residual), weight.data_ptr(), 0, 0, h.data_ptr() if h_from_res else 0,
            mean.data_ptr(), rstd.data_ptr(), dy.data_ptr(), _p(dres_out), dx.data_ptr(),
            dres.data_ptr() if has_residual else 0, partials.data_ptr(), dw.data_ptr(),
            db.data_ptr() if has_bias else 0)
    finish = (plan.finish, -(-n // _FINISH_COLS), 1, _FINISH_THREADS, 0)
    if plan.fused:
        steps = ((plan.bwd, plan.splits, 1, plan.threads, plan.smem), finish)
    else:
        steps = ((plan.bwd_dx, rows, 1, plan.threads, 0), (plan.bwd_dw, plan.dw_grid, plan.splits, _DW_THREADS, 0),
                 finish)
    plan.run(ptrs, steps, _raw_stream(plan.device))
    return dx, dw, db, dres


# ---------------------------------------------------------------------------------------
# The eager calls' fast path (issue 12, host time): cuflash.ops.layer_norm.layer_norm_fn keeps one
# Entry per call key (shapes, dtypes, devices, eps and flags of a call that passed its checks and
# took the kernels), so a repeat call checks nothing again: it allocates its outputs, patches the
# pointers into its plan's packed record and launches. The torch ops (torch.compile) keep forward /
# backward above.

entries: dict = {}   # layer_norm_fn's call key -> Entry
ENTRY_LIMIT = 1024   # entries kept at most (emptied when full: the plans below them stay cached in _plans)
# An entry whose backward's dweight / dbias partials (at most rows · 2 · n fp32: a backward has at
# most one split per row) fit in this many floats allocates them with the forward's statistics, in
# the one buffer the backward reads (issue 12, session 30: one torch.empty fewer per backward, about
# 1.7 µs of host time on the H200's; a host-bound call is a small one). 0: the backward allocates
# them itself, as before. The buffer is the call's own (saved for its backward, never a tensor the
# caller sees), so calls on several streams never share one.
PARTIALS_WITH_STATS = 1 << 16


def _poison(*tensors) -> None:
    """api.POISON_OUTPUTS (a test hook): outputs NaN before the launch, so anything the kernel
    misses shows."""
    for t in tensors:
        if t is not None:
            t.fill_(float("nan"))


class Entry:
    """One eager call key: rows, n and the flags; the plans (forward; backward per FUSED_DW) made on
    first use per access width (16-byte accesses or one element at a time), each with its launch
    steps."""
    __slots__ = ("rows", "n", "dtype", "res_dtype", "w_dtype", "device", "index", "is_rms", "eps", "zero_centered",
                 "write_res", "has_bias", "has_residual", "h_from_res", "n8", "fwd", "bwd", "scratch", "stats_len")

    def __init__(self, x, weight, bias, residual, eps, is_rms, zero_centered, res_dtype):
        self.n = n = x.shape[-1]
        self.rows = x.numel() // n
        self.dtype, self.res_dtype, self.w_dtype = x.dtype, res_dtype, weight.dtype
        self.device, self.index = x.device, x.device.index
        self.is_rms, self.eps, self.zero_centered = bool(is_rms), float(eps), bool(zero_centered)
        self.has_bias, self.has_residual = bias is not None, residual is not None
        self.write_res = residual is not None or res_dtype != x.dtype
        # the backward's h: an fp32 residual_out is the forward's h exactly; else x + residual again
        self.h_from_res = self.write_res and res_dtype == torch.float32
        self.n8 = n % 8 == 0
        self.fwd, self.bwd = {}, {}
        self.scratch = None   # forward's statistics nobody reads (keep_stats=False)
        # the statistics buffer of a call autograd records: the means and rstds, then room for the
        # backward's partials when they fit (PARTIALS_WITH_STATS)
        self.stats_len = 2 * self.rows + (2 * self.rows * n if 0 < 2 * self.rows * n <= PARTIALS_WITH_STATS else 0)

    def _fwd_plan(self, vector):
        got = self.fwd.get(vector)
        if got is None:
            plan = _plan(self.rows, self.n, self.dtype, self.res_dtype, self.w_dtype, self.device, vector, self.is_rms,
                         self.eps, self.zero_centered, False)
            got = self.fwd[vector] = (plan, ((plan.fwd, self.rows, 1, plan.threads, 0),))
        return got

    def _bwd_plan(self, vector):
        key = (vector, FUSED_DW)
        got = self.bwd.get(key)
        if got is None:
            plan = _plan(self.rows, self.n, self.dtype, self.res_dtype, self.w_dtype, self.device, vector, self.is_rms,
                         0.0, self.zero_centered, self.h_from_res, FUSED_DW)
            finish = (plan.finish, -(-self.n // _FINISH_COLS), 1, _FINISH_THREADS, 0)
            if plan.fused:
                steps = ((plan.bwd, plan.splits, 1, plan.threads, plan.smem), finish)
            else:
                steps = ((plan.bwd_dx, self.rows, 1, plan.threads, 0),
                         (plan.bwd_dw, plan.dw_grid, plan.splits, _DW_THREADS, 0), finish)
            got = self.bwd[key] = (plan, steps)
        return got

    def forward(self, x, weight, bias, residual, keep_stats=True):
        """(y, residual_out or None, stats): x / residual contiguous in x's shape; stats (stats_len,)
        fp32, the rows' means then their rstds (then room for the backward's partials).
        keep_stats=False (no backward will read them): the statistics go to the entry's scratch
        buffer, written by every such call and read by none (so calls on several streams at once may
        share it), one allocation fewer per call."""
        y = torch.empty_like(x)
        res_out = torch.empty_like(x, dtype=self.res_dtype) if self.write_res else None
        if keep_stats:
            stats = torch.empty(self.stats_len, dtype=torch.float32, device=self.device)
        else:
            stats = self.scratch
            if stats is None:
                stats = self.scratch = torch.empty(2 * self.rows, dtype=torch.float32, device=self.device)
        if api.POISON_OUTPUTS:   # the scratch statistics are read by nobody (and may be an inference tensor)
            _poison(y, res_out, stats if keep_stats else None)
        xp, wp, yp, sp = x.data_ptr(), weight.data_ptr(), y.data_ptr(), stats.data_ptr()
        bp = 0 if bias is None else bias.data_ptr()
        rp = 0 if residual is None else residual.data_ptr()
        op = 0 if res_out is None else res_out.data_ptr()
        plan, steps = self._fwd_plan(self.n8 and not (xp | wp | yp | bp | rp | op) & 15)
        plan.run((xp, rp, wp, bp, yp, op, sp, sp + 4 * self.rows, 0, 0, 0, 0, 0, 0, 0), steps, _raw_stream(self.index))
        return y, res_out, stats

    def backward(self, dy, dres_out, h, residual, weight, stats):
        """(dx, dweight, dbias or None, dresidual or None): dy / dres_out / h / residual contiguous in
        x's shape (h: x, or the fp32 residual_out when h_from_res; residual None then), stats the
        forward's."""
        dx = torch.empty_like(dy)
        dw = torch.empty_like(weight)
        db = torch.empty_like(weight) if self.has_bias else None
        dres = torch.empty_like(dy, dtype=self.res_dtype) if self.has_residual else None
        if api.POISON_OUTPUTS:
            _poison(dx, dw, db, dres)
        dyp, hp, wp, dxp = dy.data_ptr(), h.data_ptr(), weight.data_ptr(), dx.data_ptr()
        rp = 0 if residual is None else residual.data_ptr()
        dop = 0 if dres_out is None else dres_out.data_ptr()
        drp = 0 if dres is None else dres.data_ptr()
        plan, steps = self._bwd_plan(self.n8 and not (dyp | hp | wp | dxp | rp | dop | drp) & 15)
        sp = stats.data_ptr()
        if stats.numel() >= 2 * self.rows * (1 + self.n) and plan.splits <= self.rows:
            pp = sp + 8 * self.rows   # the forward's buffer has room for them
        else:
            partials = torch.empty(plan.splits * 2 * self.n, dtype=torch.float32, device=self.device)
            pp = partials.data_ptr()
        hfr = self.h_from_res
        plan.run((0 if hfr else hp, rp, wp, 0, 0, hp if hfr else 0, sp, sp + 4 * self.rows, dyp, dop, dxp, drp, pp,
                  dw.data_ptr(), 0 if db is None else db.data_ptr()), steps, _raw_stream(self.index))
        return dx, dw, db, dres
