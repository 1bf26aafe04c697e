"""Rotary position embedding on torch tensors: the op behind ``cuflash.layers.rotary``.

``apply_rotary(x, cos, sin, ...)`` has the arguments of flash-attn's
``flash_attn.ops.triton.rotary.apply_rotary`` (no autograd: ``cuflash.layers.rotary`` wraps it).
Each token at position ``pos`` (its row in its sequence plus the sequence's offset) turns the
pairs of its first ``rotary_dim = 2 * cos.shape[1]`` features by the angles of row ``pos`` of
``cos`` / ``sin``: ``(a, b) -> (a cos - b sin, a sin + b cos)``; ``conjugate=True`` turns by
the opposite angles (the backward: the rotation's transpose). Pairs are ``(2c, 2c + 1)`` with
``interleaved`` (GPT-J), else ``(c, c + rotary_dim / 2)`` (GPT-NeoX); the other features pass
through. A position at or past ``cos.shape[0]`` (possible with per-sequence offsets) is not
rotated, as in flash-attn's kernel.

torch CUDA tensors run ``kernels_cu/rotary.cu`` (compiled by CuPy/NVRTC on first use, launched
by raw pointer on torch's current stream, so CUDA-graph capture works); torch CPU tensors run
the float64 reference (``cuflash.reference.apply_rotary``), rounded once to x's dtype.

The kernel is no attention family: it has no tuning space, no FLOPs and no reference op in the
registry, so it stays out of ``cuflash.registry`` (whose families the tuner, the benchmarks and
the GPU tests iterate) and compiles through ``cuflash.compile.get_helper_kernels``.
"""
from __future__ import annotations

import struct
import threading
from numbers import Integral

import numpy as np
import torch

from . import api, reference
from . import compile as compile_mod

Tensor = torch.Tensor

_KERNEL_TYPES = {torch.bfloat16: "cuflash::bf16", torch.float16: "cuflash::fp16", torch.float32: "float"}
_THREADS = 128   # kRotaryThreads in rotary.cu
_GRID_Y = 65535  # gridDim.y: one row of CTAs per sequence


def _offsets_kind(seqlen_offsets) -> str:
    """'int' or 'tensor', else TypeError naming the argument."""
    if isinstance(seqlen_offsets, Tensor):
        return "tensor"
    if isinstance(seqlen_offsets, Integral) and not isinstance(seqlen_offsets, bool):
        return "int"
    raise TypeError(f"seqlen_offsets must be an int or an int32 / int64 tensor of shape (batch,), got "
                    f"{type(seqlen_offsets).__name__} {seqlen_offsets!r}")


def check(x: Tensor, cos: Tensor, sin: Tensor, seqlen_offsets, cu_seqlens, max_seqlen) -> tuple:
    """Validate a call; returns (batch, seqlen, rotary_dim). Everything it reads of the tensors is
    their class, shape, dtype and device (never a device value), so a CUDA call shape is checked once."""
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    varlen = cu_seqlens is not None
    want = 3 if varlen else 4
    if x.dim() != want:
        layout = "(total_seqlen, nheads, headdim) with cu_seqlens" if varlen else "(batch, seqlen, nheads, headdim)"
        raise ValueError(f"x must be {layout}, got shape {tuple(x.shape)}")
    if cos.dim() != 2 or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be 2-D of one shape (seqlen_ro, rotary_dim / 2), got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dtype != sin.dtype:
        raise TypeError(f"cos and sin must have one dtype, got {cos.dtype} and {sin.dtype}")
    seqlen_ro, rotary_dim = cos.shape[0], 2 * cos.shape[1]
    headdim = x.shape[-1]
    if rotary_dim > headdim:
        raise ValueError(f"rotary_dim = 2 * cos.shape[1] = {rotary_dim} must be <= headdim = {headdim} (x's last dim)")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")
    if x.is_cuda:
        if x.dtype not in _KERNEL_TYPES:
            raise TypeError(f"x: the CUDA kernel takes bfloat16, float16 or float32, got {x.dtype}")
        if cos.dtype not in (x.dtype, torch.float32):
            raise TypeError(f"cos, sin must have x's dtype {x.dtype} (or float32), got {cos.dtype}")
    if varlen:
        if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32 \
                or cu_seqlens.shape[0] < 1:
            raise ValueError("cu_seqlens must be an int32 tensor of shape (batch + 1,), got "
                             + (f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}" if isinstance(cu_seqlens, Tensor)
                                else type(cu_seqlens).__name__))
        if cu_seqlens.device != x.device:
            raise ValueError(f"cu_seqlens must be on x's device {x.device}, got {cu_seqlens.device}")
        if max_seqlen is None:
            raise ValueError("max_seqlen must be given with cu_seqlens (the longest sequence's length)")
        if not isinstance(max_seqlen, Integral) or isinstance(max_seqlen, bool) or max_seqlen < 0:
            raise ValueError(f"max_seqlen must be an int >= 0, got {max_seqlen!r}")
        batch, seqlen = cu_seqlens.shape[0] - 1, int(max_seqlen)
    else:
        batch, seqlen = x.shape[0], x.shape[1]
    if seqlen_ro < seqlen:
        raise ValueError(f"cos / sin have {seqlen_ro} rows (seqlen_ro), fewer than the sequence length {seqlen}"
                         + (" (max_seqlen)" if varlen else ""))
    if _offsets_kind(seqlen_offsets) == "tensor":
        if seqlen_offsets.shape != (batch,) or seqlen_offsets.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"seqlen_offsets must be an int or an int32 / int64 tensor of shape (batch,) = "
                             f"({batch},), got {seqlen_offsets.dtype} {tuple(seqlen_offsets.shape)}")
        if seqlen_offsets.device != x.device:
            raise ValueError(f"seqlen_offsets must be on x's device {x.device}, got {seqlen_offsets.device}")
    return batch, seqlen, rotary_dim


def _check_int_offset(offset: int, seqlen: int, seqlen_ro: int) -> None:
    if offset < 0 or offset + seqlen > seqlen_ro:
        raise ValueError(f"seqlen_offsets = {offset}: offset + seqlen = {offset + seqlen} must lie in "
                         f"[seqlen, seqlen_ro = {seqlen_ro}] (cos / sin have seqlen_ro rows)")


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, seqlen_offsets=0, cu_seqlens=None,
                 max_seqlen=None, interleaved: bool = False, inplace: bool = False,
                 conjugate: bool = False) -> Tensor:
    """x rotated (see the module docstring); x itself, rotated in place, with ``inplace``.

    x: (batch, seqlen, nheads, headdim), or (total_seqlen, nheads, headdim) with cu_seqlens
    (int32, (batch + 1,)) and max_seqlen. cos, sin: (seqlen_ro, rotary_dim / 2), x's dtype (or
    float32 on CUDA). seqlen_offsets: an int, or an int32 / int64 tensor (batch,).
    """
    if x.is_cuda:
        return _cuda(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, bool(interleaved),
                     bool(inplace), bool(conjugate))
    return _reference(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, bool(interleaved),
                      bool(inplace), bool(conjugate))


# ---------------------------------------------------------------------------------------
# torch CPU tensors: the float64 reference

def _reference(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, interleaved, inplace, conjugate):
    batch, seqlen, rotary_dim = check(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen)
    seqlen_ro = cos.shape[0]
    if _offsets_kind(seqlen_offsets) == "int":
        _check_int_offset(int(seqlen_offsets), seqlen, seqlen_ro)
        offsets = np.full(batch, int(seqlen_offsets), dtype=np.int64)
    else:
        offsets = seqlen_offsets.detach().cpu().numpy().astype(np.int64)
    with torch.no_grad():
        x64 = x.detach().to(torch.float64).numpy()
        if cu_seqlens is not None:
            cu = cu_seqlens.detach().cpu().numpy().astype(np.int64)
            if cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] > x.shape[0]:
                raise ValueError(f"cu_seqlens must start at 0, not decrease and end at most at x.shape[0] = "
                                 f"{x.shape[0]}, got {cu.tolist()}")
            positions = np.zeros(x.shape[0], dtype=np.int64)
            covered = np.zeros(x.shape[0], dtype=bool)
            for b in range(batch):
                positions[cu[b]:cu[b + 1]] = offsets[b] + np.arange(cu[b + 1] - cu[b])
                covered[cu[b]:cu[b + 1]] = True
            positions, x64 = positions[None], x64[None]
        else:
            positions = offsets[:, None] + np.arange(seqlen)[None, :]
            covered = None
        # positions outside [0, seqlen_ro) keep their features: a row of cos 1, sin 0 past the table
        c = np.concatenate([cos.detach().to(torch.float64).cpu().numpy(), np.ones((1, rotary_dim // 2))])
        s = np.concatenate([sin.detach().to(torch.float64).cpu().numpy(), np.zeros((1, rotary_dim // 2))])
        if conjugate:
            s = -s
        positions = np.where((positions >= 0) & (positions < seqlen_ro), positions, seqlen_ro)
        y = reference.apply_rotary(x64, c, s, positions, interleaved)
        if cu_seqlens is not None:
            y = np.where(covered[:, None, None], y[0], x64[0])  # rows outside every sequence: as x
        y = torch.from_numpy(y).to(x.dtype)
        if inplace:
            x.copy_(y)
            return x
        like = x if x.stride(-1) == 1 else x.contiguous()   # out's layout as the CUDA path's
        if y.stride() != like.stride():
            y = torch.empty_like(like).copy_(y)
        return y


# ---------------------------------------------------------------------------------------
# torch CUDA tensors: rotary.cu

from .torch_ops import _raw_stream  # noqa: E402 - (device index) -> cudaStream_t, the attention ops' own


# Vector groups (rotary.cu's kVector): 16 bytes of x per access where the call allows it. False
# makes every plan made from now on take the one-element kernel (the timing script compares them).
VECTORIZE = True


class _Kernel:
    """One of a plan's two kernels (one element per access, or 16-byte groups): its function, grid
    and packed params."""
    __slots__ = ("fn", "grid", "record", "bytes", "argv", "argv_ptr")

    def __init__(self, fn, grid, static: dict):
        from .launch import pack

        self.fn, self.grid = fn, grid
        self.record = pack("RotaryParams", **static)
        self.bytes = self.record.view(np.uint8)
        self.argv = np.array([self.bytes.ctypes.data], dtype=np.uint64)
        self.argv_ptr = int(self.argv.ctypes.data)


def kernel_names(x_dtype, cos_dtype, interleaved: bool) -> tuple:
    """The name expressions of one module: one element per access, 16-byte groups."""
    types = f"{_KERNEL_TYPES[x_dtype]}, {_KERNEL_TYPES[cos_dtype]}, {'true' if interleaved else 'false'}"
    return (f"cuflash::rotary<{types}, false>", f"cuflash::rotary<{types}, true>")


def warm_modules(dtypes) -> list:
    """The modules the calls on x of these torch dtypes load with cos / sin of the same dtype,
    interleaved or not (``python -m cuflash warmup --helpers``)."""
    return [compile_mod.HelperModule("rotary", kernel_names(dt, dt, il))
            for dt in dtypes if dt in _KERNEL_TYPES for il in (False, True)]


def _row_split(per_row: int, rows: int) -> tuple:
    """(log2 of the lanes sharing a row, CTAs): the fewest lanes (a power of two <= 32) that cover a
    row's groups in one step, so a warp holds the most rows; about two rows per lane group."""
    lanes = 1
    while lanes < min(per_row, 32):
        lanes *= 2
    rows_per_cta = (_THREADS // 32) * (32 // lanes)
    return lanes.bit_length() - 1, max(1, min(-(-rows // (2 * rows_per_cta)), 1 << 20))


class _Plan:
    """One CUDA call shape: the two kernels (one element per access, 16-byte groups), their grids
    and params with every field but the per-call ones (the pointers, out's strides, the int offset)
    packed; a repeat call picks the vector kernel where the addresses allow it, writes those fields
    and launches."""
    __slots__ = ("scalar", "vector", "device", "lock", "seqlen", "seqlen_ro", "copy_x", "offset_at",
                 "out_at", "get_device", "set_device", "launch", "trig_mask", "tail")

    def __init__(self, x, cos, shape: tuple, varlen: bool, seqlen_offsets, interleaved, conjugate, copy_tail):
        from cupy_backends.cuda.api import driver

        from .launch import _device_fns, struct_dtype

        batch, seqlen, rotary_dim = shape
        if batch > _GRID_Y:
            raise ValueError(f"x: at most {_GRID_Y} sequences per call, got {batch}")
        self.device, self.seqlen, self.seqlen_ro = x.device.index, seqlen, cos.shape[0]
        self.copy_x = x.stride(-1) != 1   # the kernel reads rows of contiguous features
        xs = x.contiguous().stride() if self.copy_x else x.stride()
        nheads, headdim, half = x.shape[-2], x.shape[-1], rotary_dim // 2
        # 16-byte groups: tail elements per access, pairs per group; the shape and x's strides allow
        # them (the addresses and out's strides are checked per call)
        self.tail = 16 // x.element_size()
        pairs = self.tail // 2 if interleaved else self.tail
        used = (xs[-3], xs[-2]) + (() if varlen else (xs[0],))
        vector_ok = (VECTORIZE and half % pairs == 0 and cos.stride(0) % pairs == 0
                     and (not copy_tail or (headdim - rotary_dim) % self.tail == 0)
                     and all(st % self.tail == 0 for st in used))
        self.trig_mask = min(16, pairs * cos.element_size()) - 1   # cos / sin group alignment
        exprs = kernel_names(x.dtype, cos.dtype, interleaved)
        self.launch = driver.launchKernel
        self.get_device, self.set_device = _device_fns()
        fns = compile_mod.get_helper_functions("rotary", exprs, self.device)
        tensor_offsets = _offsets_kind(seqlen_offsets) == "tensor"
        static = dict(x=0, out=0, cos=0, sin=0, cu_seqlens=0, seqlen_offsets=0,
                      x_batch_stride=0 if varlen else xs[0], x_row_stride=xs[-3], x_head_stride=xs[-2],
                      out_batch_stride=0, out_row_stride=0, out_head_stride=0,  # per call: out's strides
                      trig_row_stride=cos.stride(0), seqlen=seqlen, nheads=nheads, headdim=headdim,
                      rotary_dim=rotary_dim, seqlen_ro=cos.shape[0], seqlen_offset=0,
                      offsets_i64=int(tensor_offsets and seqlen_offsets.dtype == torch.int64),
                      copy_tail=int(copy_tail), row_lanes_log2=0, sin_sign=-1.0 if conjugate else 1.0)
        rows = max(seqlen, 1) * nheads
        tail = headdim - rotary_dim if copy_tail else 0
        kernels = []
        for fn, (group_pairs, group_tail) in zip(fns, ((1, 1), (pairs, self.tail))):
            log2, ctas = _row_split(half // group_pairs + tail // group_tail, rows)
            kernels.append(_Kernel(fn, (ctas, max(batch, 1)), {**static, "row_lanes_log2": log2}))
        self.scalar, self.vector = kernels[0], (kernels[1] if vector_ok else None)
        dtype = struct_dtype("RotaryParams")
        self.offset_at = dtype.fields["seqlen_offset"][1]
        self.out_at = dtype.fields["out_batch_stride"][1]
        self.lock = threading.Lock()

    def run(self, ptrs: tuple, out_strides: tuple, offset: int, stream: int, varlen: bool) -> None:
        ob = 0 if varlen else out_strides[0]
        k = self.vector
        if k is None or (ptrs[0] | ptrs[1]) & 15 or (ptrs[2] | ptrs[3]) & self.trig_mask \
                or (ob | out_strides[-3] | out_strides[-2]) % self.tail:
            k = self.scalar
        with self.lock:  # the packed record is shared; the driver copies it at the launch
            _PTRS.pack_into(k.bytes, 0, *ptrs)
            _STRIDES.pack_into(k.bytes, self.out_at, ob, out_strides[-3], out_strides[-2])
            _I32.pack_into(k.bytes, self.offset_at, offset)
            current = self.get_device()
            if current != self.device:
                self.set_device(self.device)
            try:
                self.launch(k.fn, k.grid[0], k.grid[1], 1, _THREADS, 1, 1, 0, stream, k.argv_ptr, 0)
            finally:
                if current != self.device:
                    self.set_device(current)


# per call: the six pointers (RotaryParams' first fields) and out's strides (out is x, or new)
_PTRS = struct.Struct("<6Q")
_STRIDES = struct.Struct("<3q")
_I32 = struct.Struct("<i")
_plans: dict = {}


def _drop_plans() -> None:
    _plans.clear()


compile_mod.on_change(_drop_plans)


def _cuda(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, interleaved, inplace, conjugate):
    kind = _offsets_kind(seqlen_offsets)
    key = (x.shape, x.stride(), x.dtype, x.device, cos.shape, cos.stride(), cos.dtype,
           sin.shape, sin.stride(), sin.dtype, sin.device,
           None if cu_seqlens is None else (cu_seqlens.shape, cu_seqlens.dtype, cu_seqlens.device),
           None if cu_seqlens is None else max_seqlen,
           kind if kind == "int" else (seqlen_offsets.shape, seqlen_offsets.dtype, seqlen_offsets.device),
           interleaved, inplace, conjugate)
    plan = _plans.get(key)
    if plan is None:
        shape = check(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen)
        if cos.stride(-1) != 1 or sin.stride() != cos.stride():  # the plan is made for the copies
            cos, sin = cos.contiguous(), sin.contiguous()
        plan = _Plan(x, cos, shape, cu_seqlens is not None, seqlen_offsets, interleaved, conjugate,
                     copy_tail=not inplace and shape[2] < x.shape[-1])
        _plans[key] = plan
    elif cos.stride(-1) != 1 or sin.stride() != cos.stride():  # as the plan's first call did
        cos, sin = cos.contiguous(), sin.contiguous()
    offset = 0
    if kind == "int":
        offset = int(seqlen_offsets)
        _check_int_offset(offset, plan.seqlen, plan.seqlen_ro)
    src = x.contiguous() if plan.copy_x else x
    out = src if inplace else torch.empty_like(src)
    if api.POISON_OUTPUTS and not inplace:  # test hook: an element the kernel misses shows as NaN
        out.fill_(float("nan"))
    if x.numel():
        ptrs = (src.data_ptr(), out.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                0 if cu_seqlens is None else cu_seqlens.data_ptr(),
                seqlen_offsets.data_ptr() if kind == "tensor" else 0)
        plan.run(ptrs, out.stride(), offset, _raw_stream(plan.device), cu_seqlens is not None)
    if inplace and plan.copy_x:
        x.copy_(out)
        return x
    return out
