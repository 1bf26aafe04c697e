"""Cross-entropy kernels on torch tensors: the forward and backward behind
``cuflash.ops.cross_entropy`` (no autograd here: its ``autograd.Function`` calls these).

``forward(logits, labels, ...)`` returns per row ``(loss, z_loss, lse, part)`` (fp32), where lse
is the log-sum-exp of this rank's scaled logits and part = -(1 - s) · z_y - s · Σ z / C this
rank's label and smoothing terms, so that a process group combines ranks from lse and part
(loss and z_loss are final for one rank). ``backward(grad_loss, logits, lse, labels, ...,
out)`` writes dlogits into ``out`` (the logits themselves for ``inplace_backward``). The
formulas are ``kernels_cu/cross_entropy.cu``'s header's (and ``cuflash.ops.cross_entropy``'s).

torch CUDA tensors (bf16 / fp16 / fp32 logits with contiguous columns, int32 / int64 labels)
run ``kernels_cu/cross_entropy.cu`` (compiled by CuPy/NVRTC on first use, launched by raw
pointer on torch's current stream, so CUDA-graph capture works); ``kernel_takes`` says whether
a call qualifies. Other tensors (CPU, float64) run ``reference_forward`` / ``reference_backward``,
the same formulas as torch operations in float64 (what the torch ops' CPU impls call).

The kernels are no attention family: no tuning space, no FLOPs, so they stay out of
``cuflash.registry`` and compile through ``cuflash.compile.get_helper_kernels`` (as rotary).
"""
from __future__ import annotations

import struct
import threading

import torch

from . import api
from . import compile as compile_mod

Tensor = torch.Tensor

_KERNEL_TYPES = {torch.bfloat16: "cuflash::bf16", torch.float16: "cuflash::fp16", torch.float32: "float"}
_LABEL_TYPES = (torch.int32, torch.int64)
# (kThreads, kUnroll) of the forward and of the backward: CTA size and 16-byte vectors per
# thread in flight (template arguments; plans made from now on take changed values). H100, bf16,
# 32000 to 256000 columns (logs/session27_ce1/round2/variants.json): the forward within 2% from
# 128x4 to 512x2 (256x4 best or tied, 1024x2 up to 35% slower at 32000), the backward 1-3% faster
# at 512x4 than at 256x4; row splits beyond CTAS_PER_SM 4 changed nothing at 2048 rows.
FWD = (256, 4)
BWD = (512, 4)
_COMBINE_THREADS = 128   # kCeCombineThreads in cross_entropy.cu
# Few rows: a row is split over CTAs until about CTAS_PER_SM CTAs per SM are launched, each
# taking at least MIN_SPLIT_COLS columns.
CTAS_PER_SM = 4
MIN_SPLIT_COLS = 4096
_LOG2E = 1.4426950408889634


def kernel_names(dtype, fwd: tuple = None, bwd: tuple = None) -> tuple:
    """The name expressions of one module: forward, combine, backward with 16-byte stores,
    backward with one-element stores (logits' torch dtype; FWD / BWD unless given)."""
    (ft, fu), (bt, bu), elem = fwd or FWD, bwd or BWD, _KERNEL_TYPES[dtype]
    return (f"cuflash::cross_entropy_fwd<{elem}, {ft}, {fu}>", f"cuflash::cross_entropy_fwd_combine<{elem}>",
            f"cuflash::cross_entropy_bwd<{elem}, {bt}, true, {bu}>",
            f"cuflash::cross_entropy_bwd<{elem}, {bt}, false, {bu}>")


def warm_modules(dtypes) -> list:
    """The modules the calls on logits of these torch dtypes load (``python -m cuflash warmup
    --helpers``)."""
    return [compile_mod.HelperModule("cross_entropy", kernel_names(dt)) for dt in dtypes if dt in _KERNEL_TYPES]


def kernel_takes(logits: Tensor, labels: Tensor) -> bool:
    """Whether the CUDA kernels take this call (else the reference path runs)."""
    return (logits.is_cuda and logits.dtype in _KERNEL_TYPES and labels.dtype in _LABEL_TYPES
            and (logits.stride(1) == 1 or logits.shape[1] == 1))


# ---------------------------------------------------------------------------------------
# the reference: torch operations in float64 (CPU tensors, or anything the kernels do not take)

def reference_forward(logits, labels, smoothing, logit_scale, lse_square_scale, ignore_index, class_start,
                      total_classes):
    """(loss, z_loss, lse, part) in float64 (the kernels' outputs, exactly computed), cast to fp32
    unless logits are float64."""
    out_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = logits.detach().to(torch.float64) * logit_scale
    n_cols = z.shape[1]
    lse = torch.logsumexp(z, dim=-1)
    local = labels.long() - class_start
    in_range = (local >= 0) & (local < n_cols)
    z_y = z.gather(1, torch.where(in_range, local, 0).unsqueeze(1)).squeeze(1)
    part = -(1.0 - smoothing) * torch.where(in_range, z_y, 0.0)
    if smoothing > 0.0:
        part = part - smoothing * z.sum(-1) / total_classes
    zl = lse_square_scale * lse * lse
    ignored = labels == ignore_index
    loss = torch.where(ignored, 0.0, lse + part + zl)
    return tuple(t.to(out_dtype) for t in (loss, torch.where(ignored, 0.0, zl), lse, part))


def reference_backward(grad_loss, logits, lse, labels, smoothing, logit_scale, lse_square_scale, ignore_index,
                       class_start, total_classes):
    """dlogits in logits' dtype, computed in float64."""
    z = logits.detach().to(torch.float64) * logit_scale
    n_cols = z.shape[1]
    lse = lse.to(torch.float64)
    c = torch.where(labels == ignore_index, 0.0, grad_loss.to(torch.float64)) * logit_scale
    p = torch.exp(z - lse.unsqueeze(1))
    g = p * (c * (1.0 + 2.0 * lse_square_scale * lse)).unsqueeze(1) - (c * smoothing / total_classes).unsqueeze(1)
    local = labels.long() - class_start
    in_range = (local >= 0) & (local < n_cols)
    hit = torch.zeros_like(g).scatter_(1, torch.where(in_range, local, 0).unsqueeze(1),
                                       ((1.0 - smoothing) * c * in_range).unsqueeze(1))
    g = torch.where((labels == ignore_index).unsqueeze(1), 0.0, g - hit)
    return g.to(logits.dtype)


# ---------------------------------------------------------------------------------------
# torch CUDA tensors: cross_entropy.cu

from .torch_ops import _raw_stream  # noqa: E402 - (device index) -> cudaStream_t, the attention ops' own


def _splits(rows: int, n_cols: int, sm_count: int) -> tuple:
    """(splits, split_cols): CTAs per row and the columns of each (a multiple of 16, the last
    split takes the rest)."""
    want = -(-CTAS_PER_SM * sm_count // max(rows, 1))
    splits = max(1, min(want, n_cols // MIN_SPLIT_COLS))
    split_cols = -(-n_cols // splits)
    split_cols = -(-split_cols // 16) * 16
    return -(-n_cols // split_cols), split_cols


class _Plan:
    """One call shape and its scalars: the kernels (forward, combine, backward with 16-byte
    stores or one element per store), grids and packed params with every field but the per-call
    ones (the pointers and the grad_loss / dlogits strides)."""
    __slots__ = ("device", "fwd", "combine", "bwd_vector", "bwd_scalar", "fwd_rec", "bwd_rec", "fwd_grid",
                 "bwd_grid", "combine_grid", "splits", "lock", "launch", "get_device", "set_device",
                 "fwd_threads", "bwd_threads")

    def __init__(self, logits, labels, smoothing, logit_scale, lse_square_scale, ignore_index, class_start,
                 total_classes):
        from cupy_backends.cuda.api import driver

        from .launch import ParamsRecord, _device_fns, pack

        rows, n_cols = logits.shape
        self.device = logits.device.index
        sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count
        exprs = kernel_names(logits.dtype)
        self.fwd_threads, self.bwd_threads = FWD[0], BWD[0]
        self.launch = driver.launchKernel
        self.get_device, self.set_device = _device_fns()
        self.fwd, self.combine, self.bwd_vector, self.bwd_scalar = compile_mod.get_helper_functions(
            "cross_entropy", exprs, self.device)
        self.splits, split_cols = _splits(rows, n_cols, sm_count)
        static = dict(logits=0, labels=0, loss=0, z_loss=0, lse=0, part=0, partials=0, grad_loss=0, dlogits=0,
                      grad_loss_stride=0, logits_row_stride=logits.stride(0), dlogits_row_stride=0,
                      ignore_index=ignore_index, class_start=class_start, rows=rows, n_cols=n_cols,
                      splits=self.splits, split_cols=split_cols, labels_i64=int(labels.dtype == torch.int64),
                      logit_scale=logit_scale, scale_log2=logit_scale * _LOG2E, smoothing=smoothing,
                      smooth_per_class=smoothing / total_classes, lse_square_scale=lse_square_scale)
        # the backward has no cross-CTA step: its rows split the same way
        self.fwd_rec = ParamsRecord(pack("CrossEntropyParams", **static))
        self.bwd_rec = ParamsRecord(pack("CrossEntropyParams", **static))
        self.fwd_grid = self.bwd_grid = rows * self.splits
        self.combine_grid = -(-rows // _COMBINE_THREADS)
        self.lock = threading.Lock()

    def _run(self, fn, grid, threads, rec, stream):
        self.launch(fn, grid, 1, 1, threads, 1, 1, 0, stream, rec.argv_ptr, 0)

    def forward(self, ptrs: tuple, logits_row_stride: int, stream: int) -> None:
        with self.lock:  # the packed record is shared; the driver copies it at the launch
            rec = self.fwd_rec
            _PTRS.pack_into(rec.bytes, 0, *ptrs, 0, logits_row_stride, 0)
            current = self.get_device()
            if current != self.device:
                self.set_device(self.device)
            try:
                self._run(self.fwd, self.fwd_grid, self.fwd_threads, rec, stream)
                if self.splits > 1:
                    self._run(self.combine, self.combine_grid, _COMBINE_THREADS, rec, stream)
            finally:
                if current != self.device:
                    self.set_device(current)

    def backward(self, ptrs: tuple, strides: tuple, vector: bool, stream: int) -> None:
        with self.lock:
            rec = self.bwd_rec
            _PTRS.pack_into(rec.bytes, 0, *ptrs, *strides)
            current = self.get_device()
            if current != self.device:
                self.set_device(self.device)
            try:
                self._run(self.bwd_vector if vector else self.bwd_scalar, self.bwd_grid, self.bwd_threads, rec,
                          stream)
            finally:
                if current != self.device:
                    self.set_device(current)




# per call: the nine pointers (CrossEntropyParams' first fields), then the grad_loss, logits and
# dlogits strides (the logits' row stride is the plan key's: rewritten with its own value)
_PTRS = struct.Struct("<9Q3q")
_plans: dict = {}


def _drop_plans() -> None:
    _plans.clear()


compile_mod.on_change(_drop_plans)


def _plan(logits, labels, smoothing, logit_scale, lse_square_scale, ignore_index, class_start, total_classes):
    key = (logits.shape, logits.stride(0), logits.dtype, logits.device, labels.dtype, smoothing, logit_scale,
           lse_square_scale, ignore_index, class_start, total_classes, FWD, BWD, CTAS_PER_SM)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _Plan(logits, labels, smoothing, logit_scale, lse_square_scale, ignore_index,
                                   class_start, total_classes)
    return plan


def forward(logits: Tensor, labels: Tensor, smoothing: float, logit_scale: float, lse_square_scale: float,
            ignore_index: int, class_start: int, total_classes: int) -> tuple:
    """(loss, z_loss, lse, part), each (rows,) fp32 (float64 on the reference path for float64
    logits). Arguments are checked by the caller (cuflash.ops.cross_entropy)."""
    if not kernel_takes(logits, labels):
        return reference_forward(logits, labels, smoothing, logit_scale, lse_square_scale, ignore_index,
                                 class_start, total_classes)
    rows = logits.shape[0]
    labels = labels.contiguous()
    outs = tuple(torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(4))
    if api.POISON_OUTPUTS:  # test hook: a row the kernels miss shows as NaN
        for t in outs:
            t.fill_(float("nan"))
    if rows:
        plan = _plan(logits, labels, smoothing, logit_scale, lse_square_scale, ignore_index, class_start,
                     total_classes)
        partials = None   # the split rows' states (torch's caching allocator; held until the launch is queued)
        if plan.splits > 1:
            partials = torch.empty(rows * plan.splits * 3, dtype=torch.float32, device=logits.device)
        plan.forward((logits.data_ptr(), labels.data_ptr(), *(t.data_ptr() for t in outs),
                      0 if partials is None else partials.data_ptr(), 0, 0), logits.stride(0),
                     _raw_stream(plan.device))
    return outs


def backward(grad_loss: Tensor, logits: Tensor, lse: Tensor, labels: Tensor, smoothing: float, logit_scale: float,
             lse_square_scale: float, ignore_index: int, class_start: int, total_classes: int,
             inplace: bool) -> Tensor:
    """dlogits (logits' dtype and shape): into logits' own storage with ``inplace`` (returned),
    else a new tensor. grad_loss: (rows,) any stride; lse: (rows,) the LSE that normalizes p."""
    if not kernel_takes(logits, labels):
        g = reference_backward(grad_loss, logits, lse, labels, smoothing, logit_scale, lse_square_scale,
                               ignore_index, class_start, total_classes)
        return (logits if inplace else torch.empty_like(logits)).copy_(g)   # the kernel path's layout
    out = logits if inplace else torch.empty_like(logits)
    if api.POISON_OUTPUTS and not inplace:
        out.fill_(float("nan"))
    rows, n_cols = logits.shape
    if rows and n_cols:
        labels = labels.contiguous()
        if grad_loss.dtype != torch.float32 or grad_loss.device != logits.device:
            grad_loss = grad_loss.to(device=logits.device, dtype=torch.float32)
        lse = lse if lse.dtype == torch.float32 and lse.stride(0) == 1 else lse.float().contiguous()
        plan = _plan(logits, labels, smoothing, logit_scale, lse_square_scale, ignore_index, class_start,
                     total_classes)
        esize = logits.element_size()
        # 16-byte stores where each dlogits row has its logits row's 16-byte phase
        vector = ((out.data_ptr() - logits.data_ptr()) % 16 == 0
                  and ((out.stride(0) - logits.stride(0)) * esize) % 16 == 0 and (out.stride(1) == 1 or n_cols == 1))
        if not vector and out.stride(1) != 1 and n_cols > 1:
            raise AssertionError("dlogits' columns must be contiguous")  # empty_like keeps logits' layout
        plan.backward((logits.data_ptr(), labels.data_ptr(), 0, 0, lse.data_ptr(), 0, 0, grad_loss.data_ptr(),
                       out.data_ptr()), (grad_loss.stride(0), logits.stride(0), out.stride(0)), vector,
                      _raw_stream(plan.device))
    return out
