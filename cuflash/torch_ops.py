"""The torch bridge: autograd, torch.compile and CUDA graphs for cuflash's kernels.

Two torch ops, one per cuflash op, defined with ``torch.library.define`` + ``impl`` +
``register_fake`` (no kernel logic in them):

* ``cuflash::fwd(q, k, v, softmax_scale, causal, config) -> (out, lse)``
* ``cuflash::bwd(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, config) -> (dq, dk, dv)``

(more ops below for features, decode and dropout: ``cuflash::fwd_dropout`` /
``cuflash::bwd_dropout`` take dropout's int64[2] RNG state as a tensor argument.)

``config`` is a family's encoded config string (``Family.encode``), '' for the tuned or
heuristic choice. Autograd is an ``autograd.Function`` around them (``FlashAttnFn``), not
registered on the op: that costs ~25 µs less per forward + backward (../shared/FACTS.md).

Eager calls skip the dispatcher: ``attention`` looks the call's plan up by one tuple key
(shapes, strides, dtypes, devices, flags), allocates the outputs with torch's caching
allocator and launches by raw pointer on torch's current stream — no DLPack, no CuPy
array, no device synchronization, so CUDA-graph capture is legal. Under torch.compile
the same work goes through the ops, which dynamo traces.

CPU tensors (any float dtype) run the float64 NumPy reference, forward and backward, so
``torch.autograd.gradcheck`` exercises the whole plumbing without a GPU.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from . import api, reference
from . import compile as compile_mod
from .problem import Problem
from .registry import family_of, get as get_family

Tensor = torch.Tensor

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
try:
    _raw_stream = torch._C._cuda_getCurrentRawStream  # (device index) -> cudaStream_t, ~0.1 µs
except AttributeError:  # pragma: no cover - older torch
    def _raw_stream(index):
        return torch.cuda.current_stream(index).cuda_stream


def _scale(softmax_scale, head_dim: int) -> float:
    return api.check_scale(softmax_scale, head_dim)


def _encode(config) -> str:
    return "" if config is None else family_of(config).encode(config)


def _decode(text: str, dtype, causal: bool):
    if not text:
        return None
    return get_family(text.split(":", 1)[0]).decode(text, _DTYPES.get(dtype, "bf16"), causal)


def _aligned(x: Tensor) -> Tensor:
    """x itself if it is contiguous and 16-byte aligned, else a contiguous copy (gradients in
    particular arrive expanded, stride 0, from ``out.sum().backward()``). A copy, not
    x.contiguous(): that returns x itself for a contiguous view whose data is misaligned."""
    if x.is_contiguous() and not x.data_ptr() & 15:  # the common case, one C++ check
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _realign(*xs: Tensor) -> tuple:
    """Fresh (16-byte aligned, contiguous) copies of the tensors whose data is misaligned,
    e.g. a view starting a few elements into its storage."""
    return tuple(x.clone(memory_format=torch.contiguous_format) if x.data_ptr() & 15 else x
                 for x in xs)


def _pad(x: Tensor, padded: int) -> Tensor:
    """A fresh contiguous copy of x with zero columns appended to the head dim."""
    return torch.nn.functional.pad(x, (0, padded - x.shape[-1]))


# ---------------------------------------------------------------------------------------
# forward

class _FwdEntry:
    """The cached part of a forward call shape. ``bwd`` caches the backward of the same call
    shape: (dout strides, dout dtype, deterministic) -> (copy dout first?, backward plan), so
    that autograd's backward finds its plan without rebuilding the backward's long key (q, k,
    v, out and lse are the forward's own, validated with this entry)."""
    __slots__ = ("plan", "out_shape", "lse_shape", "copy", "keyless", "pad", "bwd", "kv_shape")

    def __init__(self, plan, out_shape, lse_shape, copy=False, keyless=False, pad=0):
        # plain tuples of ints, passed unpacked (new_empty(*shape)): torch parses separate
        # ints faster than one sequence, and a torch.Size slowest (~1 µs per allocation)
        self.plan = plan
        self.out_shape, self.lse_shape = tuple(map(int, out_shape)), tuple(map(int, lse_shape))
        self.copy, self.keyless = copy, keyless
        self.pad = pad  # head dim to zero-pad to (not a multiple of 8), 0: none
        self.bwd = {}
        self.kv_shape = None  # k's (= v's) shape, a tuple, set by the first backward


_fwd_plans: dict = {}
_bwd_plans: dict = {}


def _drop_plans() -> None:
    _fwd_plans.clear()
    _bwd_plans.clear()


compile_mod.on_change(_drop_plans)


def _fwd_entry(q, k, v, softmax_scale, causal, config, bwd_config) -> _FwdEntry:
    """First call of a forward shape: validate everything, choose, build the plan."""
    tq, tk, tv, scale, problem = api.check_qkv(q, k, v, softmax_scale, causal)
    api.check_config("config", config, problem)
    api.check_config("bwd_config", bwd_config, problem.replace(op="bwd"))
    b, sq, h, _ = tq.shape
    lse_shape = (b, h, sq)
    if tq.device is None:
        return _FwdEntry(None, tq.shape, lse_shape)
    if b == 0 or sq == 0 or h == 0 or tk.shape[1] == 0:
        return _FwdEntry(None, tq.shape, lse_shape, keyless=tk.shape[1] == 0)
    padded = api.padded_head_dim(tq.shape[3])
    if padded != tq.shape[3]:
        return _FwdEntry(None, tq.shape, lse_shape, pad=padded)
    strides = {"q": tq.strides, "k": tk.strides, "v": tv.strides, "o": api.out_strides(tq.shape)}
    return _FwdEntry(api.make_plan(problem, strides, scale, tq.device, config), tq.shape, lse_shape)


def forward(q: Tensor, k: Tensor, v: Tensor, softmax_scale, causal: bool, config=None,
            bwd_config=None) -> tuple[Tensor, Tensor]:
    """(out, lse) by the kernels (CUDA) or the reference (CPU); no autograd."""
    return _forward(q, k, v, softmax_scale, causal, config, bwd_config)[:2]


def _forward(q, k, v, softmax_scale, causal, config, bwd_config) -> tuple:
    """(out, lse, entry): entry is the call shape's _FwdEntry when its plan ran on q, k, v
    as given (the backward's fast path, FlashAttnFn), else None."""
    if softmax_scale is not None and softmax_scale.__class__ is not float:
        # a str or list must raise naming softmax_scale (not 'unhashable'); a 0-d tensor or
        # NumPy scalar must not key a new plan per call
        softmax_scale = _scale(softmax_scale, q.shape[-1])
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype,
           v.dtype, q.device, k.device, v.device, softmax_scale, causal, config, bwd_config)
    try:
        entry = _fwd_plans.get(key)
    except TypeError:  # an unhashable config: validation names it
        _fwd_entry(q, k, v, softmax_scale, causal, config, bwd_config)
        raise
    if entry is None:
        if q.is_cuda and (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
            # misaligned views: read aligned copies (as a cached plan does below)
            return (*forward(*_realign(q, k, v), softmax_scale, causal, config, bwd_config), None)
        entry = _fwd_plans[key] = _fwd_entry(q, k, v, softmax_scale, causal, config, bwd_config)
    plan = entry.plan
    if plan is None:
        if q.device.type == "cpu":
            return (*_fwd_reference(q, k, v, _scale(softmax_scale, q.shape[-1]), causal), None)
        if entry.pad:  # zero-padded copies (the scale stays 1/sqrt(the real head dim))
            d = q.shape[-1]
            out, lse = forward(*(_pad(x, entry.pad) for x in (q, k, v)), _scale(softmax_scale, d),
                               causal, config, bwd_config)
            return out[..., :d].contiguous(), lse, None
        out = torch.empty(entry.out_shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(entry.lse_shape, dtype=torch.float32, device=q.device)
        if entry.keyless:  # attention over zero keys: every row fully masked
            out.zero_()
            lse.fill_(math.inf)
        return out, lse, None
    qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
    if (qp | kp | vp) & 15:  # misaligned views: read aligned copies
        q, k, v = _realign(q, k, v)
        return (*forward(q, k, v, softmax_scale, causal, config, bwd_config), None)
    out = q.new_empty(*entry.out_shape)  # new_empty(*ints): the fewest arguments to parse
    lse = q.new_empty(*entry.lse_shape, dtype=torch.float32)
    if api.POISON_OUTPUTS:
        out.fill_(math.nan)
        lse.fill_(math.nan)
    plan.run((qp, kp, vp, out.data_ptr(), lse.data_ptr()), 0, _raw_stream(plan.device))
    return out, lse, entry


def _fwd_reference(q, k, v, softmax_scale, causal):
    as64 = lambda x: x.detach().to(torch.float64).numpy()  # noqa: E731
    out, lse = reference.attention_naive(as64(q), as64(k), as64(v), softmax_scale=softmax_scale,
                                         causal=causal, return_lse=True)
    return torch.from_numpy(out).to(q.dtype), torch.from_numpy(lse).to(torch.float32)


# ---------------------------------------------------------------------------------------
# backward

def _bwd_entry(dout, q, k, v, out, lse, scale, causal, deterministic, config, grad_strides=None):
    """The verdict of a backward call shape (see _bwd_verdict). grad_strides: (dq, dk, dv) element
    strides of the gradients the plan writes, when they are slices of one packed buffer (backward_packed);
    None: fresh contiguous ones."""
    tq, tk, tv, scale, problem = api.check_qkv(q, k, v, scale, causal, "bwd", deterministic)
    tdo, to = api.check_bwd_tensors(tq, dout, out, lse)  # the raw op is called unchecked too
    api.check_config("config", config, problem)
    if tq.device is None:
        return "reference"
    if problem.batch == 0 or problem.nheads == 0 or problem.seqlen_q == 0 or problem.seqlen_k == 0:
        return "empty"
    if api.padded_head_dim(problem.head_dim) != problem.head_dim:
        return "pad"
    # strides only: the verdict is cached under a key without the data's alignment (a
    # misaligned pointer is copied per call, in backward_impl)
    unaligned = lambda t: api._Tensor(t.kind, t.dtype, t.shape, t.strides, 0, t.device)  # noqa: E731
    if api.layout_problem(unaligned(to)) or not lse.is_contiguous():
        return "copy"
    dq_st, dk_st, dv_st = grad_strides or (api.out_strides(tq.shape), api.out_strides(tk.shape),
                                           api.out_strides(tk.shape))
    strides = {"dout": tdo.strides, "q": tq.strides, "k": tk.strides, "v": tv.strides,
               "o": to.strides, "dq": tuple(dq_st), "dk": tuple(dk_st), "dv": tuple(dv_st)}
    plan = api.make_plan(problem, strides, scale, tq.device, config)
    # a family with dout_any_strides reads dout through any strides (fa2_bwd: its preprocess
    # copies it when the main kernel cannot read it in place), e.g. the stride-0 broadcast of
    # out.sum().backward(), with no separate copy; otherwise a contiguous copy is made first
    if api.layout_problem(unaligned(tdo)) and not getattr(plan.family, "dout_any_strides", False):
        return "copy"
    return plan


def _bwd_key(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, config) -> tuple:
    # everything the first call validated: a later call with this key is valid too (v, out
    # and lse shapes and every dtype included: a mismatch there would read out of bounds)
    return (dout.shape, dout.stride(), q.shape, q.stride(), k.shape, k.stride(), v.shape,
            v.stride(), out.shape, out.stride(), lse.shape, lse.stride(), q.dtype, k.dtype,
            v.dtype, dout.dtype, out.dtype, lse.dtype, q.device, k.device, v.device, dout.device,
            out.device, lse.device, softmax_scale, causal, deterministic, config)


def _bwd_verdict(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, config):
    """The cached verdict of a backward call shape: a Plan, or "reference", "pad", "copy",
    "empty" (validated on first sight; raises naming the argument)."""
    key = _bwd_key(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, config)
    plan = _bwd_plans.get(key)
    if plan is None:
        plan = _bwd_plans[key] = _bwd_entry(dout, q, k, v, out, lse, softmax_scale, causal,
                                            deterministic, config)
    return plan


def backward_impl(dout, q, k, v, out, lse, softmax_scale: float, causal: bool,
                  deterministic: bool, config=None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) by the kernels (CUDA) or the reference (CPU); no autograd."""
    plan = _bwd_plans.get(_bwd_key(dout, q, k, v, out, lse, softmax_scale, causal, deterministic,
                                   config))
    if plan is None:
        if q.is_cuda and (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
            q, k, v = _realign(q, k, v)  # misaligned views (the forward read copies too)
            return backward_impl(dout, q, k, v, out, lse, softmax_scale, causal, deterministic,
                                 config)
        plan = _bwd_verdict(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, config)
    if plan.__class__ is str:  # one check on the hot path for every verdict that is not a plan
        if plan == "reference":
            return _bwd_reference(dout, q, k, v, softmax_scale, causal)
        if plan == "pad":  # zero-padded copies, the gradients sliced back
            d = q.shape[-1]
            padded = api.padded_head_dim(d)
            grads = backward_impl(*(_pad(x, padded) for x in (dout, q, k, v, out)), lse,
                                  softmax_scale, causal, deterministic, config)
            return tuple(g[..., :d].contiguous() for g in grads)
        if plan == "copy":
            dout, out, lse = _aligned(dout), _aligned(out), lse.contiguous()
            return backward_impl(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, config)
        dq, dk, dv = (torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
        return dq, dk, dv
    ptrs = (dout.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr())
    if (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4]) & 15:
        dout, q, k, v, out = _realign(dout, q, k, v, out)
        return backward_impl(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, config)
    return _bwd_run(plan, ptrs, q, k, v)


def _bwd_plan(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, config):
    """(copy, plan) for autograd's fast path (FlashAttnFn.backward): the plan backward_impl
    would run for these tensors, after a contiguous copy of dout when copy is True; None
    where it runs no single plan (reference, padding, empty problems) or validation fails
    (backward_impl then raises)."""
    try:
        plan = _bwd_verdict(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, config)
        copy = plan == "copy"
        if copy and out.is_contiguous() and lse.is_contiguous():  # only dout is copied
            dout = torch.empty(dout.shape, dtype=dout.dtype, device=dout.device)
            plan = _bwd_verdict(dout, q, k, v, out, lse, softmax_scale, causal, deterministic,
                                config)
    except Exception:  # noqa: BLE001 - backward_impl raises it again, for the caller
        return None
    return (copy, plan) if plan.__class__ is not str else None


def _bwd_run(plan, ptrs: tuple, q, k, v, q_shape=None, kv_shape=None) -> tuple:
    """Allocate dq, dk, dv and the workspace and launch a backward plan on aligned pointers.
    q_shape, kv_shape: q's and k's (= v's) shapes as tuples, when the caller has them."""
    if q_shape is None:
        q_shape, kv_shape = q.shape, k.shape
    dq, dk, dv = q.new_empty(*q_shape), k.new_empty(*kv_shape), v.new_empty(*kv_shape)
    ws = q.new_empty(plan.workspace_bytes, dtype=torch.uint8)
    if api.POISON_OUTPUTS:
        for x in (dq, dk, dv):
            x.fill_(math.nan)
    plan.run(ptrs + (dq.data_ptr(), dk.data_ptr(), dv.data_ptr()), ws.data_ptr(),
             _raw_stream(plan.device))
    return dq, dk, dv


def backward_packed(dout, q, packed, out, lse, softmax_scale: float, causal: bool, deterministic: bool,
                    config=None) -> tuple:
    """(dq, dpacked) of flash_attn_qkvpacked_func (q None, packed = qkv (batch, seqlen, 3, nheads,
    headdim): dq None) or flash_attn_kvpacked_func (packed = kv (batch, seqlen_k, 2, nheads_kv,
    headdim)): the kernels write dk, dv (and dq) straight into the slices of one contiguous buffer
    shaped like ``packed``, as flash-attn does. Through the views qkv[:, :, i] instead, autograd
    would build each slice's gradient as a zero-filled buffer of packed's size and add the three.
    Where no single plan runs the call (reference, padding, empty problems) the gradients are
    computed as backward_impl does and stacked."""
    if q is None:
        q, k, v = packed.unbind(2)
    else:
        k, v = packed.unbind(2)
    dpacked = packed.new_empty(*packed.shape)
    grads = dpacked.unbind(2)
    dq = q.new_empty(*q.shape) if len(grads) == 2 else grads[0]
    dk, dv = grads[-2:]
    key = (_bwd_key(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, config),
           dq.stride(), dk.stride())
    plan = _bwd_plans.get(key)
    if plan is None:
        plan = _bwd_plans[key] = _bwd_entry(dout, q, k, v, out, lse, softmax_scale, causal, deterministic,
                                            config, (dq.stride(), dk.stride(), dv.stride()))
    if plan.__class__ is str and plan == "copy":   # dout (or out, lse) in a layout the kernels do not read
        dout, out, lse = _aligned(dout), _aligned(out), lse.contiguous()
        return backward_packed(dout, None if len(grads) == 3 else q, packed, out, lse, softmax_scale,
                               causal, deterministic, config)
    ptrs = (dout.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr())
    if plan.__class__ is str or (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4]) & 15:
        g = backward_impl(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, config)
        if len(grads) == 3:
            return None, torch.stack(g, dim=2)
        return g[0], torch.stack(g[1:], dim=2)
    ws = q.new_empty(plan.workspace_bytes, dtype=torch.uint8)
    if api.POISON_OUTPUTS:
        dq.fill_(math.nan)
        dpacked.fill_(math.nan)
    plan.run(ptrs + (dq.data_ptr(), dk.data_ptr(), dv.data_ptr()), ws.data_ptr(), _raw_stream(plan.device))
    return (None if len(grads) == 3 else dq), dpacked


def _bwd_reference(dout, q, k, v, softmax_scale, causal):
    as64 = lambda x: x.detach().to(torch.float64).numpy()  # noqa: E731
    grads = reference.attention_backward_naive(as64(dout), as64(q), as64(k), as64(v),
                                               softmax_scale=softmax_scale, causal=causal)
    return tuple(torch.from_numpy(g).to(x.dtype) for g, x in zip(grads, (q, k, v)))


# ---------------------------------------------------------------------------------------
# the torch ops (what torch.compile traces)

torch.library.define("cuflash::fwd", "(Tensor q, Tensor k, Tensor v, float softmax_scale, "
                     "bool causal, str config) -> (Tensor, Tensor)")
torch.library.define("cuflash::bwd", "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
                     "Tensor lse, float softmax_scale, bool causal, bool deterministic, str config) "
                     "-> (Tensor, Tensor, Tensor)")


def _fwd_op(q, k, v, softmax_scale, causal, config):
    return forward(q, k, v, softmax_scale, causal, _decode(config, q.dtype, causal))


def _bwd_op(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, config):
    return backward_impl(dout, q, k, v, out, lse, softmax_scale, causal, deterministic,
                         _decode(config, q.dtype, causal))


for _key in ("CUDA", "CPU"):
    torch.library.impl("cuflash::fwd", _key)(_fwd_op)
    torch.library.impl("cuflash::bwd", _key)(_bwd_op)


@torch.library.register_fake("cuflash::fwd")
def _(q, k, v, softmax_scale, causal, config):
    batch, seqlen_q, nheads, _ = q.shape
    # contiguous, like the real outputs (new_empty takes no memory_format)
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device))


@torch.library.register_fake("cuflash::bwd")
def _(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, config):
    return tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))


# ---------------------------------------------------------------------------------------
# autograd

class _NoDoubleBackward(torch.autograd.Function):
    """Passes the gradients (dq, dk, dv) through; differentiating them again raises. The
    tensors after them (q, k, v, dout) are inputs only so that the gradients require grad
    (the kernels' outputs have no history of their own), which routes a second-order
    gradient here instead of failing with 'does not require grad'."""

    @staticmethod
    def forward(ctx, dq, dk, dv, *anchors):
        return dq.view_as(dq), dk.view_as(dk), dv.view_as(dv)

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("cuflash: double backward through flash_attn_func (a gradient "
                                  "of its gradients) is not implemented")


class FlashAttnFn(torch.autograd.Function):
    """out, lse = attention(q, k, v), or out alone when args[5] (with_lse) is False (lse is
    then saved for the backward but not an output: one output less for autograd); the
    backward runs cuflash's backward kernels. args = (softmax_scale, causal, deterministic,
    config, bwd_config, with_lse): one argument for the non-tensors (fewer to unpack in
    apply, fewer None gradients to return)."""

    @staticmethod
    def forward(ctx, q, k, v, args):
        softmax_scale, causal, deterministic, config, bwd_config, with_lse = args
        scale = _scale(softmax_scale, q.shape[-1])
        if torch.compiler.is_compiling():
            api.check_qkv(q, k, v, scale, causal)
            out, lse = torch.ops.cuflash.fwd(q, k, v, scale, causal, _encode(config))
            entry = None
        else:
            out, lse, entry = _forward(q, k, v, softmax_scale, causal, config, bwd_config)
            # lse's gradient (always zero) is not materialized: no zeros tensor per backward.
            # Eager only (dynamo does not trace this call); the backward takes either.
            ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.state = (entry, scale, causal, deterministic, bwd_config)  # one attribute store
        if not with_lse:
            return out
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse=None):
        q, k, v, out, lse = ctx.saved_tensors
        entry, scale, causal, deterministic, bwd_config = ctx.state
        if dout is None:
            dout = torch.zeros_like(out)
        if entry is not None and not torch.compiler.is_compiling():  # the forward ran its plan: look the backward up on its entry
            key = (dout.stride(), dout.dtype, deterministic)
            hit = entry.bwd.get(key)
            if hit is None:
                hit = entry.bwd[key] = _bwd_plan(dout, q, k, v, out, lse, scale, causal,
                                                 deterministic, bwd_config) or False
            if hit:
                copy, plan = hit
                if copy:
                    dout = dout.clone(memory_format=torch.contiguous_format)
                dp = dout.data_ptr()
                if not dp & 15:  # q, k, v and out: aligned in the forward (entry)
                    kv_shape = entry.kv_shape
                    if kv_shape is None:  # k's shape is part of the entry's key
                        kv_shape = entry.kv_shape = tuple(k.shape)
                    dq, dk, dv = _bwd_run(plan, (dp, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                                 out.data_ptr(), lse.data_ptr()), q, k, v,
                                          entry.out_shape, kv_shape)
                    if torch.is_grad_enabled():
                        dq, dk, dv = _NoDoubleBackward.apply(dq, dk, dv, q, k, v, dout)
                    return dq, dk, dv, None
        if torch.compiler.is_compiling():
            dq, dk, dv = torch.ops.cuflash.bwd(dout, q, k, v, out, lse, scale, causal,
                                               deterministic, _encode(bwd_config))
        else:
            dq, dk, dv = backward_impl(dout, q, k, v, out, lse, scale, causal, deterministic,
                                       bwd_config)
        if torch.is_grad_enabled():  # create_graph=True: allow first order, refuse second
            dq, dk, dv = _NoDoubleBackward.apply(dq, dk, dv, q, k, v, dout)
        return dq, dk, dv, None


class FlashAttnPackedFn(torch.autograd.Function):
    """flash_attn_qkvpacked_func / flash_attn_kvpacked_func's autograd (eager, no features): out =
    attention(q, k, v) of the packed tensor's slices (q None: qkv (batch, seqlen, 3, nheads,
    headdim); else kv (batch, seqlen_k, 2, nheads_kv, headdim)); the backward writes the gradients
    into one packed buffer (backward_packed). args as FlashAttnFn's."""

    @staticmethod
    def forward(ctx, q, packed, args):
        softmax_scale, causal, deterministic, config, bwd_config, with_lse = args
        if q is None:
            qq, k, v = packed.unbind(2)
        else:
            qq, (k, v) = q, packed.unbind(2)
        out, lse = forward(qq, k, v, softmax_scale, causal, config, bwd_config)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, packed, out, lse)
        ctx.state = (_scale(softmax_scale, qq.shape[-1]), causal, deterministic, bwd_config)
        if not with_lse:
            return out
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse=None):
        q, packed, out, lse = ctx.saved_tensors
        scale, causal, deterministic, bwd_config = ctx.state
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dpacked = backward_packed(dout, q, packed, out, lse, scale, causal, deterministic, bwd_config)
        if torch.is_grad_enabled():  # create_graph=True: allow first order, refuse second
            # (qkv: dpacked stands in for the three; kv: q anchors dq too, whether or not kv needs grad)
            anchors = (packed, dout) if q is None else (q, packed, dout)
            first, dpacked, _ = _NoDoubleBackward.apply(dpacked if dq is None else dq, dpacked, dpacked, *anchors)
            dq = None if q is None else first
        return dq, dpacked, None


def attention_packed(q, packed, softmax_scale, causal: bool, deterministic: bool, config, bwd_config,
                     with_lse: bool = True):
    """flash_attn_qkvpacked_func (q None) / flash_attn_kvpacked_func on torch tensors that need
    gradients, eager: (out, lse) through FlashAttnPackedFn, or None where the caller should take
    the per-tensor route (torch.compile, functorch transforms, no gradient wanted)."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled() or torch._C._are_functorch_transforms_active():
        return None
    if not (packed.requires_grad or (q is not None and q.requires_grad)):
        return None
    res = FlashAttnPackedFn.apply(q, packed, (softmax_scale, bool(causal), bool(deterministic), config,
                                              bwd_config, with_lse))
    return res if with_lse else (res, None)


# An autograd.Function's apply without its Python wrapper (autograd.Function.apply: ~3 µs per
# call), for eager calls outside functorch transforms, where that wrapper only unwraps dead
# functorch wrappers (_unwrap_dead) before calling it; torch.compile and functorch transforms
# (vmap, grad, ...) go through the public apply. The eager fast paths of the attention, its
# feature and varlen calls and the norms bind theirs with raw_apply.
try:
    _functorch_active = torch._C._are_functorch_transforms_active
    _unwrap_dead = torch._C._functorch.unwrap_if_dead
    _raw_function_apply = torch._C._FunctionBase.__dict__["apply"]
except (AttributeError, KeyError):  # pragma: no cover - another torch: the public route
    _raw_function_apply = None


def raw_apply(fn_cls):
    """fn_cls.apply without the Python wrapper, or None on a torch without it (callers then take
    fn_cls.apply)."""
    return None if _raw_function_apply is None else _raw_function_apply.__get__(None, fn_cls)


_fn_apply = raw_apply(FlashAttnFn)


# ---------------------------------------------------------------------------------------
# entry points used by cuflash.api

def attention(q, k, v, softmax_scale, causal: bool, deterministic: bool, config, bwd_config,
              with_lse: bool = True):
    """(out, lse); with_lse=False: the caller has no use for lse, which may then be None
    (autograd's Function then has out as its only output)."""
    causal, deterministic = bool(causal), bool(deterministic)
    if torch.compiler.is_compiling():
        return FlashAttnFn.apply(q, k, v, (softmax_scale, causal, deterministic, config,
                                           bwd_config, True))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        args = (softmax_scale, causal, deterministic, config, bwd_config, with_lse)
        if _fn_apply is not None and isinstance(k, Tensor) and isinstance(v, Tensor) \
                and not _functorch_active():  # (k or v no tensor: the public route's error)
            res = _fn_apply(_unwrap_dead(q), _unwrap_dead(k), _unwrap_dead(v), args)
        else:
            res = FlashAttnFn.apply(q, k, v, args)
        return res if with_lse else (res, None)
    return forward(q, k, v, softmax_scale, causal, config, bwd_config)


def backward(dout, q, k, v, out, lse, softmax_scale: float, causal: bool, deterministic: bool,
             config=None):
    if torch.compiler.is_compiling():
        return torch.ops.cuflash.bwd(dout, q, k, v, out, lse, softmax_scale, causal,
                                     deterministic, _encode(config))
    return backward_impl(dout, q, k, v, out, lse, softmax_scale, bool(causal), bool(deterministic),
                         config)


# ---------------------------------------------------------------------------------------
# features on the CPU: window, softcap, ALiBi, dropout, varlen through the float64 reference

class _RefSpec:
    """What the reference needs besides q, k, v: the scale, causal and the feature keywords
    (NumPy), and for varlen (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)."""
    __slots__ = ("scale", "causal", "kw", "varlen")

    def __init__(self, scale, causal, kw, varlen):
        self.scale, self.causal, self.kw, self.varlen = scale, causal, kw, varlen


def _as64(x):
    return x.detach().to(torch.float64).numpy()


def _ref_forward(spec: _RefSpec, q, k, v):
    if spec.varlen is None:
        out, lse = reference.attention_naive(_as64(q), _as64(k), _as64(v), softmax_scale=spec.scale,
                                             causal=spec.causal, return_lse=True, **spec.kw)
    else:
        cu_q, cu_k = spec.varlen[:2]
        out, lse = reference.attention_varlen_naive(_as64(q), _as64(k), _as64(v), cu_q, cu_k,
                                                    softmax_scale=spec.scale, causal=spec.causal,
                                                    return_lse=True, **spec.kw)
    return torch.from_numpy(out).to(q.dtype), torch.from_numpy(lse).to(torch.float32)


def _ref_backward(spec: _RefSpec, dout, q, k, v):
    if spec.varlen is None:
        grads = reference.attention_backward_naive(_as64(dout), _as64(q), _as64(k), _as64(v),
                                                   softmax_scale=spec.scale, causal=spec.causal,
                                                   **spec.kw)
    else:
        cu_q, cu_k = spec.varlen[:2]
        grads = reference.attention_backward_varlen_naive(
            _as64(dout), _as64(q), _as64(k), _as64(v), cu_q, cu_k, softmax_scale=spec.scale,
            causal=spec.causal, **spec.kw)
    return tuple(torch.from_numpy(g).to(x.dtype) for g, x in zip(grads, (q, k, v)))


class ReferenceAttnFn(torch.autograd.Function):
    """out, lse = reference attention with features (CPU); the backward is the reference's."""

    @staticmethod
    def forward(ctx, q, k, v, spec):
        out, lse = _ref_forward(spec, q, k, v)
        ctx.save_for_backward(q, k, v)
        ctx.spec = spec
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros(q.shape, dtype=q.dtype)
        dq, dk, dv = _ref_backward(ctx.spec, dout, q, k, v)
        if torch.is_grad_enabled():  # create_graph=True: allow first order, refuse second
            dq, dk, dv = _NoDoubleBackward.apply(dq, dk, dv, q, k, v, dout)
        return dq, dk, dv, None


def dropout_keep_mask(shape, dropout_p: float) -> Tensor:
    """The dropout keep mask (bool, True = kept with probability 1 - dropout_p), drawn from
    torch's default CPU generator (reproducible under torch.manual_seed)."""
    return torch.rand(shape, dtype=torch.float32) >= dropout_p


def attention_reference(q, k, v, softmax_scale: float, feats, varlen=None, keep=None):
    """(out, lse, S_dmask) of a torch CPU call with features (``cuflash.api.FeatureArgs``),
    validated by the caller. varlen: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    with the offsets as host int64 arrays; q, k, v then (total, nheads, headdim). keep: the
    dropout keep mask to use (bool tensor of the S_dmask shape), else one drawn by torch.rand."""
    kw = {}
    if feats.window_size != (-1, -1):
        kw["window_size"] = feats.window_size
    if feats.softcap:
        kw["softcap"] = feats.softcap
    if feats.alibi_slopes is not None:
        kw["alibi_slopes"] = feats.alibi_slopes.detach().to(torch.float64).numpy()
    mask = None
    if feats.dropout_p:
        if varlen is None:
            b, sq, h, _ = q.shape
            shape = (b, h, sq, k.shape[1])
        else:
            shape = (len(varlen[0]) - 1, q.shape[1], varlen[2], varlen[3])
        mask = dropout_keep_mask(shape, feats.dropout_p) if keep is None else keep
        kw["dropout_p"] = feats.dropout_p
        if varlen is None:
            kw["dropout_mask"] = mask.numpy()
        else:  # the reference takes sequence i's corner (nheads, seqlen_q_i, seqlen_k_i)
            lens_q, lens_k = np.diff(varlen[0]), np.diff(varlen[1])
            kw["dropout_mask"] = [mask[i, :, :lq, :lk].numpy()
                                  for i, (lq, lk) in enumerate(zip(lens_q, lens_k))]
    spec = _RefSpec(float(softmax_scale), bool(feats.causal), kw, varlen)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = ReferenceAttnFn.apply(q, k, v, spec)
    else:
        out, lse = _ref_forward(spec, q, k, v)
    return out, lse, mask


# ---------------------------------------------------------------------------------------
# decode: flash_attn_with_kvcache. Its eager path is cuflash.decode's own plan cache (no
# dispatcher); this op is what torch.compile traces. k_cache and v_cache are appended to in
# place (the schema's mutation marks). cache_seqlen: an int cache_seqlens (-1: a tensor or none).

torch.library.define(
    "cuflash::kvcache",
    "(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, Tensor? rotary_cos, "
    "Tensor? rotary_sin, Tensor? cache_seqlens, Tensor? cache_batch_idx, Tensor? cache_leftpad, "
    "Tensor? block_table, Tensor? alibi_slopes, int cache_seqlen, float softmax_scale, bool causal, "
    "int window_left, int window_right, float softcap, bool rotary_interleaved, int num_splits) "
    "-> (Tensor, Tensor)")


def _kvcache_op(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                cache_leftpad, block_table, alibi_slopes, cache_seqlen, softmax_scale, causal,
                window_left, window_right, softcap, rotary_interleaved, num_splits):
    from .decode import flash_attn_with_kvcache

    if cache_seqlens is None and cache_seqlen >= 0:
        cache_seqlens = cache_seqlen
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
        cache_leftpad, block_table, softmax_scale, causal, (window_left, window_right), softcap,
        rotary_interleaved, alibi_slopes, num_splits, True)
    return out, lse


for _key in ("CUDA", "CPU"):
    torch.library.impl("cuflash::kvcache", _key)(_kvcache_op)


@torch.library.register_fake("cuflash::kvcache")
def _(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
      cache_leftpad, block_table, alibi_slopes, cache_seqlen, softmax_scale, causal, window_left,
      window_right, softcap, rotary_interleaved, num_splits):
    batch, seqlen_q, nheads, _ = q.shape
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device))


def kvcache_traced(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                   cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_size,
                   softcap, rotary_interleaved, alibi_slopes, num_splits):
    """flash_attn_with_kvcache under torch.compile: through the cuflash::kvcache op."""
    from numbers import Integral

    from .decode import _flag

    scale = _scale(softmax_scale, q.shape[-1])
    as_int = isinstance(cache_seqlens, Integral) and not isinstance(cache_seqlens, bool)
    if as_int and int(cache_seqlens) < 0:  # -1 is the op's "no int": it must not stand for all
        raise ValueError(f"cache_seqlens: must be >= 0, got {cache_seqlens}")
    # the scalars as eager validation takes them (int() / bool() would truncate or coerce)
    left, right = api.check_window(window_size)
    causal, rotary_interleaved = _flag("causal", causal), _flag("rotary_interleaved", rotary_interleaved)
    if isinstance(num_splits, bool) or not isinstance(num_splits, Integral):
        raise TypeError(f"num_splits must be an int, got {type(num_splits).__name__} {num_splits!r}")
    softcap = api._real("softcap", softcap, "a finite number >= 0 (0: off)")
    return torch.ops.cuflash.kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, None if as_int else cache_seqlens,
        cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
        int(cache_seqlens) if as_int else -1, scale, bool(causal), left, right, float(softcap),
        bool(rotary_interleaved), int(num_splits))


# ---------------------------------------------------------------------------------------
# features on the GPU: sliding window, softcap, ALiBi (the kernels' compile-time flags)
#
# Two more ops, the plain ones' signatures plus the feature arguments (the window bounds,
# the cap, the optional slopes tensor), so torch.compile and CUDA graphs work as for the
# plain ops; an autograd.Function around them (FeatureAttnFn) passes the same features to
# the backward. Plans are cached per call shape and feature values (cuflash.api.feature_plan).

torch.library.define("cuflash::fwd_features",
                     "(Tensor q, Tensor k, Tensor v, Tensor? alibi_slopes, float softmax_scale, "
                     "bool causal, int window_left, int window_right, float softcap, str config) "
                     "-> (Tensor, Tensor)")
torch.library.define("cuflash::bwd_features",
                     "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                     "Tensor? alibi_slopes, float softmax_scale, bool causal, bool deterministic, "
                     "int window_left, int window_right, float softcap, str config) "
                     "-> (Tensor, Tensor, Tensor)")


def _feats(q, k, slopes, causal, window, softcap):
    """cuflash.api.FeatureArgs of a GPU call (validated, normalized), and q's description."""
    tq = api.describe("q", q)
    b, sq, h, _ = tq.shape
    return api.check_features(tq, 0.0, window, softcap, slopes, causal, b, h, (sq, k.shape[1])), tq


def forward_features(q, k, v, slopes, softmax_scale: float, causal: bool, window, softcap: float,
                     config=None) -> tuple:
    """(out, lse) of a GPU call with features; no autograd."""
    tq, tk, tv, scale, problem = api.check_qkv(q, k, v, softmax_scale, causal)
    feats, _ = _feats(q, k, slopes, causal, window, softcap)
    if not feats.features:  # e.g. a window reaching past every key: the plain kernels
        return forward(q, k, v, scale, feats.causal, config)
    problem = api.feature_problem(problem, feats)
    b, sq, h, d = tq.shape
    if b == 0 or sq == 0 or h == 0 or tk.shape[1] == 0:
        out = torch.empty(tq.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
        if tk.shape[1] == 0:
            out.zero_()
            lse.fill_(math.inf)
        return out, lse
    padded = api.padded_head_dim(d)
    if padded != d:  # zero-padded copies (the scale stays the real head dim's)
        out, lse = forward_features(*(_pad(x, padded) for x in (q, k, v)), slopes, scale, causal,
                                    window, softcap, config)
        return out[..., :d].contiguous(), lse
    if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        return forward_features(*_realign(q, k, v), slopes, scale, causal, window, softcap, config)
    strides = {"q": tq.strides, "k": tk.strides, "v": tv.strides, "o": api.out_strides(tq.shape)}
    plan = api.feature_plan(problem, strides, scale, tq.device, config)
    out = q.new_empty(*tq.shape)
    lse = q.new_empty(b, h, sq, dtype=torch.float32)
    if api.POISON_OUTPUTS:
        out.fill_(math.nan)
        lse.fill_(math.nan)
    slopes = None if slopes is None else slopes.contiguous()
    plan.run_fields({"alibi_slopes": 0 if slopes is None else slopes.data_ptr()},
                    (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()), 0,
                    _raw_stream(plan.device))
    return out, lse


def backward_features_impl(dout, q, k, v, out, lse, slopes, softmax_scale: float, causal: bool,
                           deterministic: bool, window, softcap: float, config=None) -> tuple:
    """(dq, dk, dv) of a GPU call with features; no autograd."""
    tq, tk, tv, scale, problem = api.check_qkv(q, k, v, softmax_scale, causal, "bwd", deterministic)
    api.check_bwd_tensors(tq, dout, out, lse)
    feats, _ = _feats(q, k, slopes, causal, window, softcap)
    if not feats.features:
        return backward_impl(dout, q, k, v, out, lse, scale, feats.causal, deterministic, config)
    problem = api.feature_problem(problem, feats)
    if problem.batch == 0 or problem.nheads == 0 or problem.seqlen_q == 0 or problem.seqlen_k == 0:
        return tuple(torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    d = problem.head_dim
    padded = api.padded_head_dim(d)
    if padded != d:
        grads = backward_features_impl(*(_pad(x, padded) for x in (dout, q, k, v, out)), lse, slopes,
                                       scale, causal, deterministic, window, softcap, config)
        return tuple(g[..., :d].contiguous() for g in grads)
    q, k, v = _realign(q, k, v)
    dout, out, lse = _aligned(dout), _aligned(out), lse.contiguous()
    strides = {"dout": tuple(dout.stride()), "q": tuple(q.stride()), "k": tuple(k.stride()),
               "v": tuple(v.stride()), "o": tuple(out.stride()), "dq": api.out_strides(q.shape),
               "dk": api.out_strides(k.shape), "dv": api.out_strides(k.shape)}
    plan = api.feature_plan(problem, strides, scale, tq.device, config)
    dq, dk, dv = q.new_empty(*q.shape), k.new_empty(*k.shape), v.new_empty(*v.shape)
    ws = q.new_empty(plan.workspace_bytes, dtype=torch.uint8)
    if api.POISON_OUTPUTS:
        for x in (dq, dk, dv):
            x.fill_(math.nan)
    slopes = None if slopes is None else slopes.contiguous()
    plan.run_fields({"alibi_slopes": 0 if slopes is None else slopes.data_ptr()},
                    (dout.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                     lse.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr()), ws.data_ptr(),
                    _raw_stream(plan.device))
    return dq, dk, dv


def _fwd_features_op(q, k, v, alibi_slopes, softmax_scale, causal, window_left, window_right,
                     softcap, config):
    return forward_features(q, k, v, alibi_slopes, softmax_scale, causal,
                            (window_left, window_right), softcap, _decode(config, q.dtype, causal))


def _bwd_features_op(dout, q, k, v, out, lse, alibi_slopes, softmax_scale, causal, deterministic,
                     window_left, window_right, softcap, config):
    return backward_features_impl(dout, q, k, v, out, lse, alibi_slopes, softmax_scale, causal,
                                  deterministic, (window_left, window_right), softcap,
                                  _decode(config, q.dtype, causal))


torch.library.impl("cuflash::fwd_features", "CUDA")(_fwd_features_op)
torch.library.impl("cuflash::bwd_features", "CUDA")(_bwd_features_op)


@torch.library.register_fake("cuflash::fwd_features")
def _(q, k, v, alibi_slopes, softmax_scale, causal, window_left, window_right, softcap, config):
    batch, seqlen_q, nheads, _ = q.shape
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device))


@torch.library.register_fake("cuflash::bwd_features")
def _(dout, q, k, v, out, lse, alibi_slopes, softmax_scale, causal, deterministic, window_left,
      window_right, softcap, config):
    return tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))


class FeatureAttnFn(torch.autograd.Function):
    """out, lse = attention with features (GPU); the backward runs the backward kernels with the
    same features. args = (softmax_scale, causal, window, softcap, deterministic, config,
    bwd_config); slopes: the ALiBi slopes tensor or None (no gradient)."""

    @staticmethod
    def forward(ctx, q, k, v, slopes, args):
        scale, causal, window, softcap, deterministic, config, bwd_config = args
        if torch.compiler.is_compiling():
            out, lse = torch.ops.cuflash.fwd_features(q, k, v, slopes, scale, causal, window[0],
                                                      window[1], softcap, _encode(config))
        else:
            out, lse = forward_features(q, k, v, slopes, scale, causal, window, softcap, config)
        ctx.save_for_backward(q, k, v, out, lse, slopes)
        ctx.args = args
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, slopes = ctx.saved_tensors
        scale, causal, window, softcap, deterministic, config, bwd_config = ctx.args
        if dout is None:
            dout = torch.zeros_like(out)
        if torch.compiler.is_compiling():
            dq, dk, dv = torch.ops.cuflash.bwd_features(dout, q, k, v, out, lse, slopes, scale,
                                                        causal, deterministic, window[0], window[1],
                                                        softcap, _encode(bwd_config))
        else:
            dq, dk, dv = backward_features_impl(dout, q, k, v, out, lse, slopes, scale, causal,
                                                deterministic, window, softcap, bwd_config)
        if torch.is_grad_enabled():
            dq, dk, dv = _NoDoubleBackward.apply(dq, dk, dv, q, k, v, dout)
        return dq, dk, dv, None, None


def attention_features(q, k, v, softmax_scale: float, feats, deterministic: bool, config,
                       bwd_config) -> tuple:
    """(out, lse) of a GPU call with features (``cuflash.api.FeatureArgs``, validated), with
    autograd when q, k or v require grad."""
    args = (float(softmax_scale), bool(feats.causal), tuple(int(w) for w in feats.window_size),
            float(feats.softcap), bool(deterministic), config, bwd_config)
    slopes = feats.alibi_slopes
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return FeatureAttnFn.apply(q, k, v, None if slopes is None else slopes.detach(), args)
    return forward_features(q, k, v, slopes, *args[:4], config)


def backward_features(dout, q, k, v, out, lse, softmax_scale: float, feats, deterministic: bool,
                      config=None) -> tuple:
    """(dq, dk, dv) for cuflash.api.flash_attn_backward with features (torch GPU tensors, or CPU
    tensors through the float64 reference)."""
    if q.device.type == "cpu":
        kw = {}
        if feats.window_size != (-1, -1):
            kw["window_size"] = feats.window_size
        if feats.softcap:
            kw["softcap"] = feats.softcap
        if feats.alibi_slopes is not None:
            kw["alibi_slopes"] = feats.alibi_slopes.detach().to(torch.float64).numpy()
        return _ref_backward(_RefSpec(float(softmax_scale), bool(feats.causal), kw, None), dout, q, k, v)
    window = tuple(int(w) for w in feats.window_size)
    if torch.compiler.is_compiling():
        return torch.ops.cuflash.bwd_features(dout, q, k, v, out, lse, feats.alibi_slopes,
                                              float(softmax_scale), bool(feats.causal),
                                              bool(deterministic), window[0], window[1],
                                              float(feats.softcap), _encode(config))
    return backward_features_impl(dout, q, k, v, out, lse, feats.alibi_slopes, softmax_scale,
                                  feats.causal, deterministic, window, feats.softcap, config)


# ---------------------------------------------------------------------------------------
# dropout on the GPU: fa2_fwd / fa2_bwd with their dropout flag

_drop_fwd_plans: dict = {}
_drop_bwd_plans: dict = {}
compile_mod.on_change(_drop_fwd_plans.clear)
compile_mod.on_change(_drop_bwd_plans.clear)


def draw_rng_state(device) -> Tensor:
    """A fresh dropout RNG state, int64[2] (seed, offset) on ``device``, drawn from torch's
    CUDA generator: ``torch.manual_seed`` reproduces it, and inside a CUDA-graph capture the
    draw is recorded with the generator's graph-safe state, so every replay draws anew (the
    kernels read the state through a pointer, never on the host)."""
    if torch.compiler.is_compiling():  # dynamo refuses Tensor.random_; randint traces (63 bits, as random_)
        return torch.randint(0, 2 ** 63 - 1, (2,), dtype=torch.int64, device=device)
    return torch.empty(2, dtype=torch.int64, device=device).random_()


def rng_state_of(seed, device) -> Tensor:
    """The RNG state tensor of an explicit ``dropout_seed``: an int (offset 0) or a pair
    (seed, offset) of ints, or already an int64[2] tensor on ``device``."""
    if isinstance(seed, Tensor):
        if seed.dtype != torch.int64 or tuple(seed.shape) != (2,) or seed.device != torch.device(device):
            raise ValueError(f"dropout_seed: expected an int64 tensor of shape (2,) (seed, offset) on "
                             f"{device}, got {seed.dtype} {tuple(seed.shape)} on {seed.device}")
        return seed
    seed, offset = api.check_dropout_seed(seed)
    as_signed = lambda x: x - 2 ** 64 if x >= 2 ** 63 else x  # noqa: E731  (int64 bits)
    return torch.tensor([as_signed(seed), as_signed(offset)], dtype=torch.int64, device=device)


def _drop_fwd_plan(q, k, v, problem, scale, config):
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device,
           scale, problem.causal, problem.dropout_p, config, problem.features, problem.window,
           problem.softcap, problem.alibi_batched)
    plan = _drop_fwd_plans.get(key)
    if plan is None:
        strides = {"q": tuple(q.stride()), "k": tuple(k.stride()), "v": tuple(v.stride()),
                   "o": api.out_strides(tuple(q.shape))}
        plan = _drop_fwd_plans[key] = api.make_plan(problem, strides, scale, q.device.index, config)
    return plan


def _drop_bwd_plan(dout, q, k, v, out, problem, scale, config):
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), dout.stride(),
           out.stride(), q.dtype, q.device, scale, problem.causal, problem.deterministic,
           problem.dropout_p, config, problem.features, problem.window, problem.softcap,
           problem.alibi_batched)
    plan = _drop_bwd_plans.get(key)
    if plan is None:
        strides = {"dout": tuple(dout.stride()), "q": tuple(q.stride()), "k": tuple(k.stride()),
                   "v": tuple(v.stride()), "o": tuple(out.stride()),
                   "dq": api.out_strides(tuple(q.shape)), "dk": api.out_strides(tuple(k.shape)),
                   "dv": api.out_strides(tuple(k.shape))}
        plan = _drop_bwd_plans[key] = api.make_plan(problem, strides, scale, q.device.index, config)
    return plan


def _drop_extra(rng: Tensor, slopes) -> tuple:
    """Plan.run_with's per-call pointers of a dropout call: the RNG state, and the ALiBi slopes
    (fp32 (nheads,) or (batch, nheads)) when the call has them."""
    extra = (("rng_state", rng.data_ptr()),)
    return extra if slopes is None else extra + (("alibi_slopes", slopes.data_ptr()),)


def dropout_forward(q, k, v, problem, scale: float, rng: Tensor, config=None, slopes=None):
    """(out, lse) of attention with dropout on CUDA tensors (aligned, head dim a multiple of
    8, keys present); ``rng``: the int64[2] (seed, offset) state; no autograd. The problem's
    window / softcap / ALiBi apply too (slopes: the ALiBi slopes tensor, else None)."""
    q, k, v = _realign(q, k, v)
    plan = _drop_fwd_plan(q, k, v, problem, scale, config)
    b, sq, h, _ = q.shape
    out = q.new_empty(*q.shape)
    lse = q.new_empty(b, h, sq, dtype=torch.float32)
    if api.POISON_OUTPUTS:
        out.fill_(math.nan)
        lse.fill_(math.nan)
    slopes = None if slopes is None else slopes.contiguous()
    plan.run_with((q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()), 0,
                  _raw_stream(plan.device), _drop_extra(rng, slopes))
    return out, lse


def dropout_backward(dout, q, k, v, out, lse, problem, scale: float, rng: Tensor, config=None,
                     slopes=None):
    """(dq, dk, dv) of attention with dropout, the forward's ``rng`` state regenerating its
    mask; CUDA tensors as dropout_forward's; no autograd."""
    dout, out = _aligned(dout), _aligned(out)
    q, k, v = _realign(q, k, v)
    lse = lse.contiguous()
    problem = problem.replace(op="bwd")
    plan = _drop_bwd_plan(dout, q, k, v, out, problem, scale, config)
    dq, dk, dv = q.new_empty(*q.shape), k.new_empty(*k.shape), v.new_empty(*v.shape)
    ws = q.new_empty(max(plan.workspace_bytes, 1), dtype=torch.uint8)
    if api.POISON_OUTPUTS:
        for x in (dq, dk, dv):
            x.fill_(math.nan)
    slopes = None if slopes is None else slopes.contiguous()
    plan.run_with((dout.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                   lse.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr()), ws.data_ptr(),
                  _raw_stream(plan.device), _drop_extra(rng, slopes))
    return dq, dk, dv


class DropoutAttnFn(torch.autograd.Function):
    """out, lse = attention with dropout (CUDA); the backward regenerates the forward's mask
    from the RNG state (kept on ctx, never read on the host). args = (problem, scale, rng
    (int64[2] state tensor), config, bwd_config, slopes): slopes, the ALiBi slopes tensor of
    a problem with ALiBi besides dropout, else None."""

    @staticmethod
    def forward(ctx, q, k, v, args):
        problem, scale, rng, config, bwd_config, slopes = args
        out, lse = dropout_forward(q, k, v, problem, scale, rng, config, slopes)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.state = (problem, scale, rng, bwd_config, slopes)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse=None):
        q, k, v, out, lse = ctx.saved_tensors
        problem, scale, rng, bwd_config, slopes = ctx.state
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = dropout_backward(dout, q, k, v, out, lse, problem, scale, rng, bwd_config,
                                      slopes)
        if torch.is_grad_enabled():  # create_graph=True: allow first order, refuse second
            dq, dk, dv = _NoDoubleBackward.apply(dq, dk, dv, q, k, v, dout)
        return dq, dk, dv, None


def dropout_attention(q, k, v, problem, scale: float, rng=None, config=None, bwd_config=None,
                      slopes=None):
    """(out, lse, rng) of attention with dropout on CUDA tensors, with autograd when q, k or
    v require grad (under torch.compile, and for CPU tensors: dropout_attention_ops). problem: the validated call (features ("dropout",), dropout_p,
    deterministic); rng: None (drawn from torch's generator) or an int64[2] state tensor.
    Head dims that are not a multiple of 8 run zero-padded copies (torch's pad: autograd
    slices the gradients back). The problem's window / softcap / ALiBi (features and values, as
    cuflash.api.feature_problem gives them) apply too; slopes: the ALiBi slopes tensor or None."""
    if slopes is not None:
        slopes = slopes.detach()
    if torch.compiler.is_compiling() or q.device.type == "cpu":  # the ops cuflash::fwd_dropout /
        return dropout_attention_ops(q, k, v, problem, scale, rng, config, bwd_config, slopes)
    d = q.shape[-1]
    padded = api.padded_head_dim(d)
    if padded != d:
        q, k, v = (_pad(x, padded) for x in (q, k, v))
        problem = problem.replace(head_dim=padded)
    rng = draw_rng_state(q.device) if rng is None else rng
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = DropoutAttnFn.apply(q, k, v, (problem, scale, rng, config, bwd_config, slopes))
    else:
        out, lse = dropout_forward(q, k, v, problem, scale, rng, config, slopes)
    if padded != d:
        out = out[..., :d]
    return out, lse, rng


def dropout_probs(q, k, v, lse, scale: float, causal: bool, dropout_p: float, rng,
                  window=(-1, -1), softcap: float = 0.0, slopes=None) -> Tensor:
    """S_dmask for return_attn_probs, as flash-attn gives it (for testing): the probabilities
    P = exp(scale·q·kᵀ - lse), fp32 (batch, nheads, seqlen_q, seqlen_k), with the dropped
    entries negated; the mask is cuflash.dropout's mirror of the kernels' (reads rng on the
    host: a synchronization). Hidden (causal, outside the window) entries are 0. window,
    softcap, slopes: the call's (normalized, as cuflash.api.check_features gives them); the
    scores are softcapped, then biased by ALiBi, as the kernels do."""
    from . import dropout as dropout_mod

    b, sq, h, _ = q.shape
    sk, h_kv = k.shape[1], k.shape[2]
    seed, offset = (int(x) & (2 ** 64 - 1) for x in rng.tolist())
    qf = q.detach().float().transpose(1, 2)
    kf = k.detach().float().repeat_interleave(h // h_kv, dim=2).transpose(1, 2)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:  # -slope·|i + sk - sq - j|, slopes (nheads,) or (batch, nheads)
        sl = slopes.detach().float().reshape(-1, h)[:, :, None, None]
        s = s - sl * (i + sk - sq - j).abs().float()
    if causal:
        s = s.masked_fill(j > i + sk - sq, -math.inf)
    left, right = window
    if left >= 0:
        s = s.masked_fill(j < i + sk - sq - left, -math.inf)
    if right >= 0:
        s = s.masked_fill(j > i + sk - sq + right, -math.inf)
    p = torch.exp(s - lse[..., None])
    p = torch.nan_to_num(p, nan=0.0)  # rows that see no key (lse = +inf)
    keep = torch.from_numpy(dropout_mod.keep_mask(seed, offset, dropout_p, b, h, sq, sk)).to(q.device)
    return torch.where(keep, p, -p)


# ---------------------------------------------------------------------------------------
# dropout as torch ops (what torch.compile traces; eager GPU calls keep dropout_attention's
# direct route). The RNG state is an int64[2] (seed, offset) tensor argument: drawn inside
# the graph (draw_rng_state), so every call and every CUDA-graph replay draws anew, and saved
# for the backward, which regenerates the forward's mask from it.
#   cuflash::fwd_dropout(q, k, v, rng_state, softmax_scale, causal, dropout_p, config,
#                        alibi_slopes?, window_left, window_right, softcap) -> (out, lse)
#   cuflash::bwd_dropout(dout, q, k, v, out, lse, rng_state, softmax_scale, causal, dropout_p,
#                        deterministic, config, alibi_slopes?, window_left, window_right,
#                        softcap) -> (dq, dk, dv)
# CUDA: the dropout plans above (fa2_fwd / fa2_bwd; sm90_fwd / sm90_bwd where they run the
# call's features with dropout). CPU: the float64 reference with the
# kernels' keep mask (cuflash.dropout.keep_mask, the NumPy mirror of philox.cuh) of the same
# state, so a CPU run, opcheck and torch.compile see the mask the GPU draws.

# The feature arguments (window, softcap, ALiBi slopes) come last, with defaults that mean
# "off", so graphs traced before they existed keep working.
torch.library.define("cuflash::fwd_dropout", "(Tensor q, Tensor k, Tensor v, Tensor rng_state, "
                     "float softmax_scale, bool causal, float dropout_p, str config, "
                     "Tensor? alibi_slopes=None, int window_left=-1, int window_right=-1, "
                     "float softcap=0.0) -> (Tensor, Tensor)")
torch.library.define("cuflash::bwd_dropout", "(Tensor dout, Tensor q, Tensor k, Tensor v, "
                     "Tensor out, Tensor lse, Tensor rng_state, float softmax_scale, bool causal, "
                     "float dropout_p, bool deterministic, str config, Tensor? alibi_slopes=None, "
                     "int window_left=-1, int window_right=-1, float softcap=0.0) "
                     "-> (Tensor, Tensor, Tensor)")


def _drop_problem(q, k, causal, dropout_p, deterministic=False, slopes=None, window=(-1, -1),
                  softcap=0.0) -> Problem:
    """The Problem of a dropout op call; window / softcap / ALiBi as the API normalized them
    (window (-1, -1), softcap 0, slopes None: off)."""
    b, sq, h, d = q.shape
    window = (int(window[0]), int(window[1]))
    feats = ["dropout"]
    if window != (-1, -1):
        feats.append("window")
    if softcap:
        feats.append("softcap")
    if slopes is not None:
        feats.append("alibi")
    return Problem("fwd", _DTYPES[q.dtype], b, sq, k.shape[1], h, k.shape[2], d, bool(causal),
                   bool(deterministic), tuple(sorted(feats)), dropout_p=float(dropout_p),
                   window=window, softcap=float(softcap),
                   alibi_batched=slopes is not None and slopes.dim() == 2)


def _fwd_dropout_cuda(q, k, v, rng, softmax_scale, causal, dropout_p, config, alibi_slopes=None,
                      window_left=-1, window_right=-1, softcap=0.0):
    b, sq, h, d = q.shape
    window = (window_left, window_right)
    if b == 0 or sq == 0 or h == 0 or k.shape[1] == 0:  # no weight to drop: the plain op's answer
        if alibi_slopes is None and window == (-1, -1) and not softcap:
            return forward(q, k, v, softmax_scale, causal)
        return forward_features(q, k, v, alibi_slopes, softmax_scale, causal, window, softcap)
    padded = api.padded_head_dim(d)
    if padded != d:  # zero-padded copies (the scale is the caller's)
        out, lse = _fwd_dropout_cuda(*(_pad(x, padded) for x in (q, k, v)), rng, softmax_scale,
                                     causal, dropout_p, config, alibi_slopes, window_left,
                                     window_right, softcap)
        return out[..., :d].contiguous(), lse
    problem = _drop_problem(q, k, causal, dropout_p, False, alibi_slopes, window, softcap)
    return dropout_forward(q, k, v, problem, softmax_scale, rng, _decode(config, q.dtype, causal),
                           alibi_slopes)


def _bwd_dropout_cuda(dout, q, k, v, out, lse, rng, softmax_scale, causal, dropout_p,
                      deterministic, config, alibi_slopes=None, window_left=-1, window_right=-1,
                      softcap=0.0):
    b, sq, h, d = q.shape
    if b == 0 or sq == 0 or h == 0 or k.shape[1] == 0:
        return tuple(torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    padded = api.padded_head_dim(d)
    if padded != d:
        grads = _bwd_dropout_cuda(*(_pad(x, padded) for x in (dout, q, k, v, out)), lse, rng,
                                  softmax_scale, causal, dropout_p, deterministic, config,
                                  alibi_slopes, window_left, window_right, softcap)
        return tuple(g[..., :d].contiguous() for g in grads)
    problem = _drop_problem(q, k, causal, dropout_p, deterministic, alibi_slopes,
                            (window_left, window_right), softcap)
    return dropout_backward(dout, q, k, v, out, lse, problem, softmax_scale, rng,
                            _decode(config, q.dtype, causal), alibi_slopes)


def keep_mask_of(rng: Tensor, dropout_p: float, batch: int, nheads: int, seqlen_q: int,
                 seqlen_k: int) -> np.ndarray:
    """The kernels' keep mask (bool (batch, nheads, seqlen_q, seqlen_k), NumPy) of an int64[2]
    RNG state tensor (read on the host)."""
    from . import dropout as dropout_mod

    seed, offset = (int(x) & (2 ** 64 - 1) for x in rng.tolist())
    return dropout_mod.keep_mask(seed, offset, dropout_p, batch, nheads, seqlen_q, seqlen_k)


def _drop_spec(q, k, rng, softmax_scale, causal, dropout_p, slopes=None, window=(-1, -1),
               softcap=0.0) -> _RefSpec:
    b, sq, h, _ = q.shape
    keep = keep_mask_of(rng, dropout_p, b, h, sq, k.shape[1])
    kw = {"dropout_p": float(dropout_p), "dropout_mask": keep}
    if tuple(window) != (-1, -1):
        kw["window_size"] = (int(window[0]), int(window[1]))
    if softcap:
        kw["softcap"] = float(softcap)
    if slopes is not None:
        kw["alibi_slopes"] = slopes.detach().to(torch.float64).numpy()
    return _RefSpec(float(softmax_scale), bool(causal), kw, None)


def _fwd_dropout_cpu(q, k, v, rng, softmax_scale, causal, dropout_p, config, alibi_slopes=None,
                     window_left=-1, window_right=-1, softcap=0.0):
    spec = _drop_spec(q, k, rng, softmax_scale, causal, dropout_p, alibi_slopes,
                      (window_left, window_right), softcap)
    return _ref_forward(spec, q, k, v)


def _bwd_dropout_cpu(dout, q, k, v, out, lse, rng, softmax_scale, causal, dropout_p,
                     deterministic, config, alibi_slopes=None, window_left=-1, window_right=-1,
                     softcap=0.0):
    spec = _drop_spec(q, k, rng, softmax_scale, causal, dropout_p, alibi_slopes,
                      (window_left, window_right), softcap)
    return _ref_backward(spec, dout, q, k, v)


torch.library.impl("cuflash::fwd_dropout", "CUDA")(_fwd_dropout_cuda)
torch.library.impl("cuflash::bwd_dropout", "CUDA")(_bwd_dropout_cuda)
torch.library.impl("cuflash::fwd_dropout", "CPU")(_fwd_dropout_cpu)
torch.library.impl("cuflash::bwd_dropout", "CPU")(_bwd_dropout_cpu)


@torch.library.register_fake("cuflash::fwd_dropout")
def _(q, k, v, rng, softmax_scale, causal, dropout_p, config, alibi_slopes=None, window_left=-1,
      window_right=-1, softcap=0.0):
    batch, seqlen_q, nheads, _ = q.shape
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device))


@torch.library.register_fake("cuflash::bwd_dropout")
def _(dout, q, k, v, out, lse, rng, softmax_scale, causal, dropout_p, deterministic, config,
      alibi_slopes=None, window_left=-1, window_right=-1, softcap=0.0):
    return tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))


class DropoutOpFn(torch.autograd.Function):
    """DropoutAttnFn through the ops (torch.compile, and torch CPU tensors): out, lse =
    cuflash::fwd_dropout; the backward cuflash::bwd_dropout with the saved RNG state tensor.
    args = (softmax_scale, causal, dropout_p, deterministic, config, bwd_config, window_left,
    window_right, softcap), the configs encoded (str); slopes: the ALiBi slopes or None."""

    @staticmethod
    def forward(ctx, q, k, v, rng, args, slopes=None):
        scale, causal, dropout_p, deterministic, config, bwd_config, left, right, cap = args
        out, lse = torch.ops.cuflash.fwd_dropout(q, k, v, rng, scale, causal, dropout_p, config,
                                                 slopes, left, right, cap)
        ctx.save_for_backward(q, k, v, out, lse, rng, slopes)
        ctx.args = args
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse=None):
        q, k, v, out, lse, rng, slopes = ctx.saved_tensors
        scale, causal, dropout_p, deterministic, config, bwd_config, left, right, cap = ctx.args
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = torch.ops.cuflash.bwd_dropout(dout, q, k, v, out, lse, rng, scale, causal,
                                                   dropout_p, deterministic, bwd_config, slopes,
                                                   left, right, cap)
        if torch.is_grad_enabled():  # create_graph=True: allow first order, refuse second
            dq, dk, dv = _NoDoubleBackward.apply(dq, dk, dv, q, k, v, dout)
        return dq, dk, dv, None, None, None


def dropout_attention_ops(q, k, v, problem, scale: float, rng=None, config=None, bwd_config=None,
                          slopes=None):
    """dropout_attention through the ops cuflash::fwd_dropout / bwd_dropout: (out, lse, rng).
    What torch.compile traces (any device), and the route of torch CPU tensors with an
    explicit dropout_seed (the reference with the kernels' mask of that seed). rng: None
    (drawn from torch's generator, inside the graph under compile) or an int64[2] tensor."""
    rng = draw_rng_state(q.device) if rng is None else rng
    left, right = problem.window if "window" in problem.features else (-1, -1)
    cap = float(problem.softcap) if "softcap" in problem.features else 0.0
    args = (float(scale), bool(problem.causal), float(problem.dropout_p),
            bool(problem.deterministic), _encode(config), _encode(bwd_config), int(left),
            int(right), cap)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = DropoutOpFn.apply(q, k, v, rng, args, slopes)
    else:
        out, lse = torch.ops.cuflash.fwd_dropout(q, k, v, rng, *args[:3], args[4], slopes, left,
                                                 right, cap)
    return out, lse, rng


# ---------------------------------------------------------------------------------------
# the eager fast path of flash_attn_func with features (window, softcap, ALiBi, dropout)
#
# As the plain call's (_forward / FlashAttnFn): one tuple key of everything validation reads
# (shapes, strides, dtypes, devices, the scale and the feature arguments as given, the slopes'
# layout, deterministic, the configs) finds the call shape's _FeatEntry: the validated,
# normalized features, the forward plan and, per dout layout, the backward plan. A repeat
# call checks its pointers' alignment, allocates its outputs, writes the per-call pointers
# (ALiBi slopes, dropout's RNG state) and launches; autograd's backward looks its plan up on
# the entry. The first call of a shape validates through cuflash.api as before (every error
# names the argument, before any launch); what the entry does not run (CPU tensors, empty
# problems, padded head dims, an explicit dropout_seed, S_dmask) takes the validating route.

_NUMBER = (float, int)  # exact classes a feature value is keyed by (a bool, 1.0 for 1: validated)


class _FeatEntry:
    """One call shape of flash_attn_func with features. kind: "features" (window / softcap /
    ALiBi: FeatureAttnFn's kernels), "dropout" (alone or mixed: DropoutAttnFn's) or "plain"
    (the features normalized away, e.g. a window reaching past every key: the plain call with
    ``causal``). bwd: (dout strides, dout dtype) -> (copy dout first?, backward plan)."""
    __slots__ = ("kind", "plan", "out_shape", "lse_shape", "scale", "causal", "window",
                 "softcap", "problem", "deterministic", "config", "bwd_config", "bwd", "kv_shape")

    def __init__(self, kind, plan=None, q_shape=(), k_shape=(), scale=None, feats=None,
                 problem=None, deterministic=False, config=None, bwd_config=None):
        self.kind, self.plan, self.scale, self.problem = kind, plan, scale, problem
        self.out_shape = tuple(map(int, q_shape))
        self.kv_shape = tuple(map(int, k_shape))
        b, sq, h = self.out_shape[:3] if q_shape else (0, 0, 0)
        self.lse_shape = (b, h, sq)
        self.causal = bool(feats.causal) if feats is not None else False
        self.window = tuple(int(w) for w in feats.window_size) if feats is not None else (-1, -1)
        self.softcap = float(feats.softcap) if feats is not None else 0.0
        self.deterministic, self.config, self.bwd_config = bool(deterministic), config, bwd_config
        self.bwd = {}

    def ws_bytes(self, plan) -> int:
        """The backward's workspace bytes as the validating route allocates them."""
        return max(plan.workspace_bytes, 1) if self.kind == "dropout" else plan.workspace_bytes


_feat_plans: dict = {}
compile_mod.on_change(_feat_plans.clear)


def _feat_entry(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, slopes,
                deterministic, config, bwd_config):
    """First call of a feature call shape: validate as cuflash.api's _features_func does (raises
    naming the argument), choose and build the plan; False where the fast path does not run it."""
    tq, tk, tv, scale, problem = api.check_qkv(q, k, v, softmax_scale, causal)
    b, sq, h, d = tq.shape
    sk = tk.shape[1]
    feats = api.check_features(tq, dropout_p, window_size, softcap, slopes, causal, b, h, (sq, sk))
    if not feats.features:  # the plain call (it validates the configs itself)
        return _FeatEntry("plain", feats=feats, scale=scale)
    problem = api.feature_problem(problem, feats)
    api.check_config("config", config, problem.replace(features=()))
    api.check_config("bwd_config", bwd_config, problem.replace(op="bwd", features=()))
    if tq.device is None:  # torch CPU: the reference
        return False
    dropout = "dropout" in feats.features
    if dropout:
        problem = problem.replace(dropout_p=feats.dropout_p, deterministic=bool(deterministic))
        if feats.features != ("dropout",) and not api.gpu_supported(problem):
            api.raise_unsupported(problem, feats.given)
    elif not api.gpu_supported(problem):
        api.raise_unsupported(problem, feats.given)
    if b == 0 or sq == 0 or h == 0 or sk == 0 or api.padded_head_dim(d) != d:
        return False  # empty problems and zero-padded copies: the validating route
    if slopes is not None and not slopes.is_contiguous():
        return False
    if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        return False  # (a first call on misaligned views: the validating route copies them)
    if dropout:
        plan = _drop_fwd_plan(q, k, v, problem, scale, config)
        kind = "dropout"
    else:
        strides = {"q": tq.strides, "k": tk.strides, "v": tv.strides, "o": api.out_strides(tq.shape)}
        plan = api.feature_plan(problem, strides, scale, tq.device, config)
        kind = "features"
    return _FeatEntry(kind, plan, tq.shape, tk.shape, scale, feats, problem, deterministic, config,
                      bwd_config)


def cached_forward(entry, q, k, v, launch):
    """(out, lse) of a cached call shape's forward (entry: out_shape, lse_shape, plan) on aligned
    q, k, v: the outputs allocated, launch(plan, pointers, 0); no autograd."""
    out = q.new_empty(*entry.out_shape)
    lse = q.new_empty(*entry.lse_shape, dtype=torch.float32)
    if api.POISON_OUTPUTS:
        out.fill_(math.nan)
        lse.fill_(math.nan)
    launch(entry.plan, (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()), 0)
    return out, lse


def _feat_run_forward(entry, q, k, v, slopes, rng):
    """(out, lse) of a cached feature call shape on aligned q, k, v; no autograd."""
    return cached_forward(entry, q, k, v, lambda plan, ptrs, ws: _feat_launch(entry, plan, ptrs, ws,
                                                                              slopes, rng))


def _feat_launch(entry, plan, ptrs, ws_ptr, slopes, rng):
    """Launch a cached feature call shape's plan with its per-call fields: dropout plans through
    Plan.run_with (the RNG state, and the slopes), as dropout_forward / dropout_backward; ALiBi
    feature plans through Plan.run_fields, as forward_features / backward_features_impl (the
    CuPy path shares those plans and their fields); the others through Plan.run."""
    if entry.kind == "dropout":
        extra = (("rng_state", rng.data_ptr()),)
        if slopes is not None:
            extra += (("alibi_slopes", slopes.data_ptr()),)
        plan.run_with(ptrs, ws_ptr, _raw_stream(plan.device), extra)
    elif slopes is not None:
        plan.run_fields({"alibi_slopes": slopes.data_ptr()}, ptrs, ws_ptr, _raw_stream(plan.device))
    else:
        plan.run(ptrs, ws_ptr, _raw_stream(plan.device))


def _feat_bwd_plan(entry, dout, q, k, v, out, lse, slopes):
    """(copy, plan) of a cached feature call shape's backward for dout's layout (copy: run on a
    contiguous copy of dout), validated as the validating route's backward does; None where it
    runs no single plan (the validating route then runs, and raises where it must)."""
    try:
        if dout.dtype != q.dtype or dout.shape != q.shape or dout.device != q.device:
            return None
        copy = not dout.is_contiguous()
        if copy:
            dout = torch.empty(dout.shape, dtype=dout.dtype, device=dout.device)
        if entry.kind == "dropout":
            plan = _drop_bwd_plan(dout, q, k, v, out, entry.problem.replace(op="bwd"), entry.scale,
                                  entry.bwd_config)
            return copy, plan
        tq, tk, tv, scale, problem = api.check_qkv(q, k, v, entry.scale, entry.causal, "bwd",
                                                   entry.deterministic)
        tdo, to = api.check_bwd_tensors(tq, dout, out, lse)
        feats, _ = _feats(q, k, slopes, entry.causal, entry.window, entry.softcap)
        if not feats.features:
            return None
        problem = api.feature_problem(problem, feats)
        strides = {"dout": tdo.strides, "q": tq.strides, "k": tk.strides, "v": tv.strides,
                   "o": to.strides, "dq": api.out_strides(tq.shape), "dk": api.out_strides(tk.shape),
                   "dv": api.out_strides(tk.shape)}
        return copy, api.feature_plan(problem, strides, scale, tq.device, entry.bwd_config)
    except Exception:  # noqa: BLE001 - the validating route raises it again, for the caller
        return None


def _feat_backward(entry, dout, q, k, v, out, lse, slopes, rng):
    """(dq, dk, dv) of a cached feature call shape (autograd's backward)."""
    key = (dout.stride(), dout.dtype)
    hit = entry.bwd.get(key)
    if hit is None:
        hit = entry.bwd[key] = _feat_bwd_plan(entry, dout, q, k, v, out, lse, slopes) or False
    if hit:
        grads = cached_backward(hit, entry.ws_bytes(hit[1]), dout, q, k, v, out, lse, entry.out_shape,
                                entry.kv_shape,
                                lambda plan, ptrs, ws: _feat_launch(entry, plan, ptrs, ws, slopes, rng))
        if grads is not None:
            return grads
    if entry.kind == "dropout":
        return dropout_backward(dout, q, k, v, out, lse, entry.problem, entry.scale, rng,
                                entry.bwd_config, slopes)
    return backward_features_impl(dout, q, k, v, out, lse, slopes, entry.scale, entry.causal,
                                  entry.deterministic, entry.window, entry.softcap, entry.bwd_config)


def cached_backward(hit, ws_bytes: int, dout, q, k, v, out, lse, q_shape, kv_shape, launch):
    """(dq, dk, dv) of a cached call shape's backward plan ``hit`` = (copy dout first?, plan):
    the gradients and ws_bytes of workspace allocated, launch(plan, pointers, workspace address);
    None when dout is misaligned (q, k, v: checked by the forward; out and lse: its own)."""
    copy, plan = hit
    if copy:
        dout = dout.clone(memory_format=torch.contiguous_format)
    dp = dout.data_ptr()
    if dp & 15:
        return None
    dq, dk, dv = q.new_empty(*q_shape), k.new_empty(*kv_shape), v.new_empty(*kv_shape)
    ws = q.new_empty(ws_bytes, dtype=torch.uint8)
    if api.POISON_OUTPUTS:
        for x in (dq, dk, dv):
            x.fill_(math.nan)
    launch(plan, (dp, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                  dq.data_ptr(), dk.data_ptr(), dv.data_ptr()), ws.data_ptr())
    return dq, dk, dv


def fast_outputs(ctx, out, lse, with_lse: bool, saved: tuple, state: tuple):
    """The end of a cached call shape's autograd forward: lse's gradient not materialized (nor
    out's when unused: the backward gets None), ``saved`` saved for the backward, ``state`` kept,
    out alone or (out, lse) with lse non-differentiable."""
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*saved)
    ctx.state = state
    if not with_lse:
        return out
    ctx.mark_non_differentiable(lse)
    return out, lse


class FeatureFastFn(torch.autograd.Function):
    """out (, lse) of a cached feature call shape (_FeatEntry) with autograd; the backward finds
    its plan on the entry. args = (entry, rng, with_lse): rng, dropout's int64[2] state drawn for
    this call (None without dropout), kept for the backward (it regenerates the mask); slopes:
    the ALiBi slopes or None, an input so that an in-place change before the backward raises (no
    gradient)."""

    @staticmethod
    def forward(ctx, q, k, v, slopes, args):
        entry, rng, with_lse = args
        out, lse = _feat_run_forward(entry, q, k, v, slopes, rng)
        return fast_outputs(ctx, out, lse, with_lse, (q, k, v, out, lse, slopes), (entry, rng))

    @staticmethod
    def backward(ctx, dout, dlse=None):
        q, k, v, out, lse, slopes = ctx.saved_tensors
        entry, rng = ctx.state
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _feat_backward(entry, dout, q, k, v, out, lse, slopes, rng)
        if torch.is_grad_enabled():  # create_graph=True: allow first order, refuse second
            dq, dk, dv = _NoDoubleBackward.apply(dq, dk, dv, q, k, v, dout)
        return dq, dk, dv, None, None


_feat_apply = raw_apply(FeatureFastFn)   # eager, no functorch (as _fn_apply)


def keyable(softmax_scale, window_size, softcap, dropout_p) -> bool:
    """Whether an eager call's values may key a cached call shape: not while torch.compile
    traces; a float or None scale, a tuple of two ints, numbers of exact class float or int (a
    bool or 30.0 for 30 hash equal to a valid value: such calls are validated every time)."""
    return (not torch.compiler.is_compiling()
            and (softmax_scale is None or softmax_scale.__class__ is float)
            and window_size.__class__ is tuple and len(window_size) == 2
            and window_size[0].__class__ is int and window_size[1].__class__ is int
            and softcap.__class__ in _NUMBER and dropout_p.__class__ in _NUMBER)


def features_attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                       alibi_slopes, deterministic, config, bwd_config, with_lse):
    """(out, lse) of an eager torch call of flash_attn_func with features through its cached
    call shape (lse None when not with_lse and autograd runs), or None: not a call this path
    runs (the caller takes the validating route, cuflash.api._features_func). Arguments as
    flash_attn_func's (dropout_seed None, no S_dmask wanted with dropout)."""
    if not keyable(softmax_scale, window_size, softcap, dropout_p):
        return None
    try:
        skey = None if alibi_slopes is None else (
            alibi_slopes.__class__, alibi_slopes.shape, alibi_slopes.stride(), alibi_slopes.dtype,
            alibi_slopes.device)
        key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype,
               v.dtype, q.device, k.device, v.device, softmax_scale, causal, window_size, softcap,
               dropout_p, skey, deterministic, config, bwd_config)
        entry = _feat_plans.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable: the validating route
        return None
    if entry is None:
        entry = _feat_plans[key] = _feat_entry(q, k, v, dropout_p, softmax_scale, causal,
                                               window_size, softcap, alibi_slopes, deterministic,
                                               config, bwd_config)
    if entry is False:
        return None
    if entry.kind == "plain":
        return attention(q, k, v, softmax_scale, entry.causal, deterministic, config, bwd_config,
                         with_lse)
    if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        return None  # misaligned views: the validating route reads aligned copies
    rng = q.new_empty(2, dtype=torch.int64).random_() if entry.kind == "dropout" else None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        args = (entry, rng, with_lse)
        if _feat_apply is not None and not _functorch_active():
            res = _feat_apply(_unwrap_dead(q), _unwrap_dead(k), _unwrap_dead(v), alibi_slopes, args)
        else:
            res = FeatureFastFn.apply(q, k, v, alibi_slopes, args)
        return res if with_lse else (res, None)
    return _feat_run_forward(entry, q, k, v, alibi_slopes, rng)


# ---------------------------------------------------------------------------------------
# rotary embedding (cuflash.layers.rotary): its eager path is cuflash.rotary's own plan cache
# (no dispatcher, as the attention ops'); these ops are what torch.compile traces. The int
# seqlen_offsets rides as seqlen_offset (a tensor one as seqlen_offsets); max_seqlen -1: none.
# cuflash::rotary returns the rotated copy and has registered autograd (the backward is the turn
# by the opposite angles); cuflash::rotary_ turns x in place (the schema's mutation mark) and is
# called only where autograd does not record (rotary_traced: no input requires grad).

torch.library.define("cuflash::rotary",
                     "(Tensor x, Tensor cos, Tensor sin, Tensor? seqlen_offsets, int seqlen_offset, "
                     "Tensor? cu_seqlens, int max_seqlen, bool interleaved, bool conjugate) -> Tensor")
torch.library.define("cuflash::rotary_",
                     "(Tensor(a!) x, Tensor cos, Tensor sin, Tensor? seqlen_offsets, int seqlen_offset, "
                     "Tensor? cu_seqlens, int max_seqlen, bool interleaved, bool conjugate) -> ()")


def _rotary_args(seqlen_offsets, seqlen_offset, max_seqlen) -> tuple:
    """(seqlen_offsets, max_seqlen) as cuflash.rotary.apply_rotary takes them."""
    return (seqlen_offset if seqlen_offsets is None else seqlen_offsets,
            None if max_seqlen < 0 else max_seqlen)


def _rotary_op(x, cos, sin, seqlen_offsets, seqlen_offset, cu_seqlens, max_seqlen, interleaved,
               conjugate):
    from .rotary import apply_rotary

    offsets, max_seqlen = _rotary_args(seqlen_offsets, seqlen_offset, max_seqlen)
    return apply_rotary(x, cos, sin, offsets, cu_seqlens, max_seqlen, interleaved, False, conjugate)


def _rotary_inplace_op(x, cos, sin, seqlen_offsets, seqlen_offset, cu_seqlens, max_seqlen,
                       interleaved, conjugate):
    from .rotary import apply_rotary

    offsets, max_seqlen = _rotary_args(seqlen_offsets, seqlen_offset, max_seqlen)
    apply_rotary(x, cos, sin, offsets, cu_seqlens, max_seqlen, interleaved, True, conjugate)


for _key in ("CUDA", "CPU"):
    torch.library.impl("cuflash::rotary", _key)(_rotary_op)
    torch.library.impl("cuflash::rotary_", _key)(_rotary_inplace_op)


@torch.library.register_fake("cuflash::rotary")
def _(x, cos, sin, seqlen_offsets, seqlen_offset, cu_seqlens, max_seqlen, interleaved, conjugate):
    # the real output: empty_like of x, or of x's contiguous copy where x's features are strided
    # (cuflash.rotary's copy_x)
    return torch.empty_like(x if x.stride(-1) == 1 else x.contiguous())


@torch.library.register_fake("cuflash::rotary_")
def _(x, cos, sin, seqlen_offsets, seqlen_offset, cu_seqlens, max_seqlen, interleaved, conjugate):
    return None


def _rotary_setup(ctx, inputs, output):
    _, cos, sin, seqlen_offsets, seqlen_offset, cu_seqlens, max_seqlen, interleaved, conjugate = inputs
    ctx.save_for_backward(cos, sin, seqlen_offsets, cu_seqlens)
    ctx.state = (seqlen_offset, max_seqlen, interleaved, conjugate)


def _rotary_backward(ctx, dout):
    cos, sin, seqlen_offsets, cu_seqlens = ctx.saved_tensors
    seqlen_offset, max_seqlen, interleaved, conjugate = ctx.state
    dx = torch.ops.cuflash.rotary(dout, cos, sin, seqlen_offsets, seqlen_offset, cu_seqlens,
                                  max_seqlen, interleaved, not conjugate)
    return dx, None, None, None, None, None, None, None, None


torch.library.register_autograd("cuflash::rotary", _rotary_backward, setup_context=_rotary_setup)


def rotary_traced(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, interleaved: bool,
                  inplace: bool) -> Tensor:
    """cuflash.rotary.apply_rotary with autograd under torch.compile, through the ops: x rotated
    (x itself with inplace). Validation is eager's (traced: it reads shapes, dtypes and
    devices). In place where autograd records (an input requires grad) is the rotated copy
    written back into x (x.copy_: autograd rebases x's history, as mark_dirty does eagerly)."""
    from . import rotary

    _, seqlen, _ = rotary.check(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen)
    if rotary._offsets_kind(seqlen_offsets) == "int":
        rotary._check_int_offset(int(seqlen_offsets), seqlen, cos.shape[0])
        args = (None, int(seqlen_offsets))
    else:
        args = (seqlen_offsets, 0)
    args += (cu_seqlens, -1 if max_seqlen is None else int(max_seqlen), bool(interleaved), False)
    if not inplace:
        return torch.ops.cuflash.rotary(x, cos, sin, *args)
    if torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad):
        return x.copy_(torch.ops.cuflash.rotary(x, cos, sin, *args))
    torch.ops.cuflash.rotary_(x, cos, sin, *args)
    return x


# ---------------------------------------------------------------------------------------
# cross-entropy (cuflash.ops.cross_entropy): its eager path calls cuflash.cross_entropy directly
# (no dispatcher); these ops are what torch.compile traces inside its autograd.Function. No
# autograd on the ops: the Function owns it. cuflash::cross_entropy_bwd_ writes the gradient
# into the logits (inplace_backward: the schema's mutation mark).

_CE_ARGS = ("float smoothing, float logit_scale, float lse_square_scale, int ignore_index, int class_start, "
            "int total_classes")
torch.library.define("cuflash::cross_entropy_fwd",
                     f"(Tensor logits, Tensor labels, {_CE_ARGS}) -> (Tensor, Tensor, Tensor, Tensor)")
torch.library.define("cuflash::cross_entropy_bwd",
                     f"(Tensor grad_loss, Tensor logits, Tensor lse, Tensor labels, {_CE_ARGS}) -> Tensor")
torch.library.define("cuflash::cross_entropy_bwd_",
                     f"(Tensor grad_loss, Tensor(a!) logits, Tensor lse, Tensor labels, {_CE_ARGS}) -> ()")


def _ce_fwd_op(logits, labels, smoothing, logit_scale, lse_square_scale, ignore_index, class_start, total_classes):
    from . import cross_entropy

    return cross_entropy.forward(logits, labels, smoothing, logit_scale, lse_square_scale, ignore_index,
                                 class_start, total_classes)


def _ce_bwd_op(grad_loss, logits, lse, labels, smoothing, logit_scale, lse_square_scale, ignore_index,
               class_start, total_classes):
    from . import cross_entropy

    return cross_entropy.backward(grad_loss, logits, lse, labels, smoothing, logit_scale, lse_square_scale,
                                  ignore_index, class_start, total_classes, False)


def _ce_bwd_inplace_op(grad_loss, logits, lse, labels, smoothing, logit_scale, lse_square_scale, ignore_index,
                       class_start, total_classes):
    from . import cross_entropy

    cross_entropy.backward(grad_loss, logits, lse, labels, smoothing, logit_scale, lse_square_scale,
                           ignore_index, class_start, total_classes, True)


for _key in ("CUDA", "CPU"):
    torch.library.impl("cuflash::cross_entropy_fwd", _key)(_ce_fwd_op)
    torch.library.impl("cuflash::cross_entropy_bwd", _key)(_ce_bwd_op)
    torch.library.impl("cuflash::cross_entropy_bwd_", _key)(_ce_bwd_inplace_op)


@torch.library.register_fake("cuflash::cross_entropy_fwd")
def _(logits, labels, smoothing, logit_scale, lse_square_scale, ignore_index, class_start, total_classes):
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return tuple(logits.new_empty(logits.shape[0], dtype=dtype) for _ in range(4))


@torch.library.register_fake("cuflash::cross_entropy_bwd")
def _(grad_loss, logits, lse, labels, smoothing, logit_scale, lse_square_scale, ignore_index, class_start,
      total_classes):
    return torch.empty_like(logits)


@torch.library.register_fake("cuflash::cross_entropy_bwd_")
def _(grad_loss, logits, lse, labels, smoothing, logit_scale, lse_square_scale, ignore_index, class_start,
      total_classes):
    return None


# ---------------------------------------------------------------------------------------
# fused residual add + LayerNorm / RMSNorm (cuflash.ops.layer_norm): its eager path calls
# cuflash.layer_norm directly; these ops are what torch.compile traces inside its
# autograd.Function (no autograd on the ops). Absent outputs are empty tensors.

torch.library.define(
    "cuflash::layer_norm_fwd",
    "(Tensor x, Tensor weight, Tensor? bias, Tensor? residual, float eps, bool is_rms, bool zero_centered, "
    "ScalarType res_dtype, bool write_res) -> (Tensor, Tensor, Tensor, Tensor)")
torch.library.define(
    "cuflash::layer_norm_bwd",
    "(Tensor dy, Tensor? dres_out, Tensor h, Tensor? residual, Tensor weight, bool has_bias, Tensor mean, "
    "Tensor rstd, bool is_rms, "
    "bool zero_centered, bool has_residual, ScalarType res_dtype, bool h_from_res) -> (Tensor, Tensor, Tensor, Tensor)")


def _ln_fwd_op(x, weight, bias, residual, eps, is_rms, zero_centered, res_dtype, write_res):
    from . import layer_norm

    return layer_norm.forward(x, weight, bias, residual, eps, is_rms, zero_centered, res_dtype, write_res)


def _ln_bwd_op(dy, dres_out, h, residual, weight, has_bias, mean, rstd, is_rms, zero_centered, has_residual,
               res_dtype, h_from_res):
    from . import layer_norm

    return layer_norm.backward(dy, dres_out, h, residual, weight, has_bias, mean, rstd, is_rms, zero_centered,
                               has_residual, res_dtype, h_from_res)


for _key in ("CUDA", "CPU"):
    torch.library.impl("cuflash::layer_norm_fwd", _key)(_ln_fwd_op)
    torch.library.impl("cuflash::layer_norm_bwd", _key)(_ln_bwd_op)


@torch.library.register_fake("cuflash::layer_norm_fwd")
def _(x, weight, bias, residual, eps, is_rms, zero_centered, res_dtype, write_res):
    st = torch.float64 if x.dtype == torch.float64 else torch.float32
    rows = x.shape[0]
    return (torch.empty_like(x), x.new_empty(tuple(x.shape) if write_res else (0,), dtype=res_dtype),
            x.new_empty(rows, dtype=st), x.new_empty(rows, dtype=st))


@torch.library.register_fake("cuflash::layer_norm_bwd")
def _(dy, dres_out, h, residual, weight, has_bias, mean, rstd, is_rms, zero_centered, has_residual, res_dtype,
      h_from_res):
    return (torch.empty_like(dy), torch.empty_like(weight),
            torch.empty_like(weight) if has_bias else weight.new_empty(0),
            dy.new_empty(tuple(dy.shape) if has_residual else (0,), dtype=res_dtype))


# ---------------------------------------------------------------------------------------
# the fused MLP's activation kernels (cuflash.dense_act, behind cuflash.ops.fused_dense's
# fused_mlp_func): its eager path calls cuflash.dense_act directly; these ops are what
# torch.compile traces inside its autograd.Function (no autograd on the ops, never in place).
# An absent dbias is an empty tensor.

torch.library.define("cuflash::dense_act_fwd", "(Tensor pre, str activation) -> Tensor")
torch.library.define("cuflash::dense_act_bwd",
                     "(Tensor grad, Tensor pre, str activation, bool bias_grad) -> (Tensor, Tensor)")


def _da_fwd_op(pre, activation):
    from . import dense_act

    return dense_act.forward(pre, activation)


def _da_bwd_op(grad, pre, activation, bias_grad):
    from . import dense_act

    dpre, dbias = dense_act.backward(grad, pre, activation, bias_grad, inplace=False)
    return dpre, dbias if dbias is not None else grad.new_empty(0)


for _key in ("CUDA", "CPU"):
    torch.library.impl("cuflash::dense_act_fwd", _key)(_da_fwd_op)
    torch.library.impl("cuflash::dense_act_bwd", _key)(_da_bwd_op)


@torch.library.register_fake("cuflash::dense_act_fwd")
def _(pre, activation):
    return torch.empty_like(pre)


@torch.library.register_fake("cuflash::dense_act_bwd")
def _(grad, pre, activation, bias_grad):
    return torch.empty_like(grad), grad.new_empty(grad.shape[-1] if bias_grad else 0)
