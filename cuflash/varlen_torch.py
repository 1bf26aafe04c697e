"""torch bridge of the varlen kernels (cuflash.varlen): autograd, torch.compile, CUDA graphs.

Two ops (``torch.library.define`` + ``impl`` + ``register_fake``, as cuflash.torch_ops):

* ``cuflash::varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
  softmax_scale, causal, config) -> (out, lse)``
* ``cuflash::varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, softmax_scale, causal, deterministic, config) -> (dq, dk, dv)``

They launch by raw pointer on torch's current stream into torch-allocated outputs and never
read cu_seqlens back to the host, so CUDA-graph capture is legal (the API's value checks of
cu_seqlens, a device-to-host copy, are skipped while capturing or compiling).
"""
from __future__ import annotations

import math
import threading

import numpy as np
import torch

from . import api, varlen
from .torch_ops import _decode, _encode, _raw_stream, cached_backward, cached_forward, fast_outputs, keyable

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _strides3(x) -> tuple:
    return tuple(int(s) for s in x.stride())


def _ready(x):
    """x, or a contiguous 16-byte aligned copy when the kernels cannot read it in place."""
    if x.stride(-1) == 1 and not x.data_ptr() & 15 and all(
            s % 8 == 0 for s, n in zip(x.stride()[:2], x.shape[:2]) if n > 1):
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _pad(x, padded: int):
    return torch.nn.functional.pad(x, (0, padded - x.shape[-1]))


def _outputs(q, total_k: int, max_q: int, max_k: int) -> tuple:
    """(out, lse, done) of a varlen forward: fresh out (q's shape) and lse (nheads, total_q);
    done when no kernel needs to run: no query rows, or no keys (O = 0, LSE = +inf)."""
    total_q, nheads, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((nheads, total_q), dtype=torch.float32, device=q.device)
    if total_q == 0 or nheads == 0 or max_q == 0:
        return out, lse, True
    if total_k == 0 or max_k == 0:
        out.zero_()
        lse.fill_(math.inf)
        return out, lse, True
    return out, lse, False


def forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool, config=None):
    """(out, lse) by the varlen kernels; no autograd. Inputs validated by the API."""
    d = q.shape[-1]
    padded = api.padded_head_dim(d)
    if padded != d:  # zero-padded copies, the output sliced back
        out, lse = forward(*(_pad(x, padded) for x in (q, k, v)), cu_q, cu_k, max_q, max_k, scale,
                           causal, config)
        return out[..., :d].contiguous(), lse
    total_q, nheads, _ = q.shape
    total_k = k.shape[0]
    out, lse, done = _outputs(q, total_k, max_q, max_k)
    if done:
        return out, lse
    q, k, v = _ready(q), _ready(k), _ready(v)
    cu_q, cu_k = cu_q.contiguous(), cu_k.contiguous()
    strides = {"q": _strides3(q), "k": _strides3(k), "v": _strides3(v),
               "o": varlen.contiguous3(q.shape)}
    plan = varlen.get_plan("fwd", _DTYPES[q.dtype], cu_q.shape[0] - 1, int(max_q), int(max_k),
                           (total_q, total_k), tuple(q.shape), tuple(k.shape), strides, float(scale),
                           bool(causal), False, q.device.index, config)
    if api.POISON_OUTPUTS:
        out.fill_(math.nan)
        lse.fill_(math.nan)
    plan.run_varlen((q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()), 0,
                    _raw_stream(plan.device), cu_q.data_ptr(), cu_k.data_ptr())
    return out, lse


def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, scale: float,
             causal: bool, deterministic: bool, config=None):
    """(dq, dk, dv) by the varlen kernels; no autograd."""
    d = q.shape[-1]
    padded = api.padded_head_dim(d)
    if padded != d:
        grads = backward(*(_pad(x, padded) for x in (dout, q, k, v, out)), lse, cu_q, cu_k, max_q,
                         max_k, scale, causal, deterministic, config)
        return tuple(g[..., :d].contiguous() for g in grads)
    total_q, nheads, _ = q.shape
    total_k = k.shape[0]
    if total_q == 0 or total_k == 0 or nheads == 0 or max_q == 0 or max_k == 0:
        return tuple(torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    dout = dout.clone(memory_format=torch.contiguous_format) if (
        not dout.is_contiguous() or dout.data_ptr() & 15) else dout
    q, k, v, out = _ready(q), _ready(k), _ready(v), _ready(out)
    lse, cu_q, cu_k = lse.contiguous(), cu_q.contiguous(), cu_k.contiguous()
    strides = {"dout": _strides3(dout), "q": _strides3(q), "k": _strides3(k), "v": _strides3(v),
               "o": _strides3(out), "dq": varlen.contiguous3(q.shape),
               "dk": varlen.contiguous3(k.shape), "dv": varlen.contiguous3(k.shape)}
    plan = varlen.get_plan("bwd", _DTYPES[q.dtype], cu_q.shape[0] - 1, int(max_q), int(max_k),
                           (total_q, total_k), tuple(q.shape), tuple(k.shape), strides, float(scale),
                           bool(causal), bool(deterministic), q.device.index, config)
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    ws = torch.empty(max(plan.workspace_bytes, 1), dtype=torch.uint8, device=q.device)
    if api.POISON_OUTPUTS:
        for x in (dq, dk, dv):
            x.fill_(math.nan)
    plan.run_varlen((dout.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                     lse.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr()), ws.data_ptr(),
                    _raw_stream(plan.device), cu_q.data_ptr(), cu_k.data_ptr())
    return dq, dk, dv


# ---------------------------------------------------------------------------------------
# the torch ops (what torch.compile traces)

torch.library.define("cuflash::varlen_fwd",
                     "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
                     "int max_seqlen_q, int max_seqlen_k, float softmax_scale, bool causal, "
                     "str config) -> (Tensor, Tensor)")
torch.library.define("cuflash::varlen_bwd",
                     "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                     "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
                     "float softmax_scale, bool causal, bool deterministic, str config) "
                     "-> (Tensor, Tensor, Tensor)")


@torch.library.impl("cuflash::varlen_fwd", "CUDA")
def _fwd_op(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, config):
    return forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, _decode(config, q.dtype, causal))


@torch.library.impl("cuflash::varlen_bwd", "CUDA")
def _bwd_op(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, deterministic, config):
    return backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, deterministic,
                    _decode(config, q.dtype, causal))


@torch.library.register_fake("cuflash::varlen_fwd")
def _(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, config):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device))


@torch.library.register_fake("cuflash::varlen_bwd")
def _(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, deterministic, config):
    return tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))


# ---------------------------------------------------------------------------------------
# autograd

class VarlenFn(torch.autograd.Function):
    """out, lse = varlen attention(q, k, v); the backward runs the varlen backward kernels.
    args = (max_q, max_k, scale, causal, deterministic, config, bwd_config)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, args):
        max_q, max_k, scale, causal, deterministic, config, bwd_config = args
        out, lse = torch.ops.cuflash.varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal,
                                                _encode(config))
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.state = (max_q, max_k, scale, causal, deterministic, bwd_config)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse=None):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, scale, causal, deterministic, bwd_config = ctx.state
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = torch.ops.cuflash.varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                                                  scale, causal, deterministic, _encode(bwd_config))
        return dq, dk, dv, None, None, None


def attention(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool,
              deterministic: bool, config=None, bwd_config=None):
    """(out, lse) of a validated torch CUDA varlen call, with autograd when q, k or v need it."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return VarlenFn.apply(q, k, v, cu_q, cu_k, (int(max_q), int(max_k), float(scale), bool(causal),
                                                    bool(deterministic), config, bwd_config))
    return torch.ops.cuflash.varlen_fwd(q, k, v, cu_q, cu_k, int(max_q), int(max_k), float(scale),
                                        bool(causal), _encode(config))


# ---------------------------------------------------------------------------------------
# varlen with features (window, softcap, ALiBi, dropout): cuflash.varlen's feature plans.
# Two more ops, so that the plain ones above keep their schema and their hot path:
#   cuflash::varlen_fwd_features(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
#       max_seqlen_k, softmax_scale, causal, alibi_slopes?, window_left, window_right, softcap,
#       dropout_p, rng_state?, config) -> (out, lse)
#   cuflash::varlen_bwd_features(dout, q, k, v, out, lse, ..., deterministic, ...) -> (dq, dk, dv)
# rng_state: dropout's int64[2] (seed, offset) on the device (read by the kernels, never on
# the host); alibi_slopes fp32 (nheads,) or (batch, nheads).

def _problem(op, q, k, cu_q, max_q, max_k, causal, slopes, window, softcap, dropout_p,
             deterministic=False):
    return varlen.features_problem(op, _DTYPES[q.dtype], cu_q.shape[0] - 1, max_q, max_k, q.shape[1],
                                   k.shape[1], q.shape[2], causal, window, softcap,
                                   None if slopes is None else slopes.dim() == 2, dropout_p,
                                   deterministic)


def _ptr(x) -> int:
    return 0 if x is None else x.data_ptr()


def forward_features(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool,
                     slopes, window, softcap: float, dropout_p: float, rng, config=None):
    """(out, lse) of a varlen call with features; no autograd. Inputs validated by the API."""
    d = q.shape[-1]
    padded = api.padded_head_dim(d)
    if padded != d:
        out, lse = forward_features(*(_pad(x, padded) for x in (q, k, v)), cu_q, cu_k, max_q, max_k,
                                    scale, causal, slopes, window, softcap, dropout_p, rng, config)
        return out[..., :d].contiguous(), lse
    total_q, nheads, _ = q.shape
    total_k = k.shape[0]
    out, lse, done = _outputs(q, total_k, max_q, max_k)
    if done:
        return out, lse
    q, k, v = _ready(q), _ready(k), _ready(v)
    cu_q, cu_k = cu_q.contiguous(), cu_k.contiguous()
    slopes = None if slopes is None else slopes.contiguous()
    strides = {"q": _strides3(q), "k": _strides3(k), "v": _strides3(v),
               "o": varlen.contiguous3(q.shape)}
    problem = _problem("fwd", q, k, cu_q, max_q, max_k, causal, slopes, window, softcap, dropout_p)
    plan = varlen.feature_plan(problem, (total_q, total_k), strides, float(scale), q.device.index,
                               config)
    if api.POISON_OUTPUTS:
        out.fill_(math.nan)
        lse.fill_(math.nan)
    varlen.run_features(plan, (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()),
                        0, _raw_stream(plan.device), cu_q.data_ptr(), cu_k.data_ptr(), _ptr(slopes),
                        _ptr(rng) if dropout_p else 0)
    return out, lse


def backward_features(dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, scale: float,
                      causal: bool, deterministic: bool, slopes, window, softcap: float,
                      dropout_p: float, rng, config=None):
    """(dq, dk, dv) of a varlen call with features; no autograd."""
    d = q.shape[-1]
    padded = api.padded_head_dim(d)
    if padded != d:
        grads = backward_features(*(_pad(x, padded) for x in (dout, q, k, v, out)), lse, cu_q, cu_k,
                                  max_q, max_k, scale, causal, deterministic, slopes, window, softcap,
                                  dropout_p, rng, config)
        return tuple(g[..., :d].contiguous() for g in grads)
    total_q, nheads, _ = q.shape
    total_k = k.shape[0]
    if total_q == 0 or total_k == 0 or nheads == 0 or max_q == 0 or max_k == 0:
        return tuple(torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    dout = dout.clone(memory_format=torch.contiguous_format) if (
        not dout.is_contiguous() or dout.data_ptr() & 15) else dout
    q, k, v, out = _ready(q), _ready(k), _ready(v), _ready(out)
    lse, cu_q, cu_k = lse.contiguous(), cu_q.contiguous(), cu_k.contiguous()
    slopes = None if slopes is None else slopes.contiguous()
    strides = {"dout": _strides3(dout), "q": _strides3(q), "k": _strides3(k), "v": _strides3(v),
               "o": _strides3(out), "dq": varlen.contiguous3(q.shape),
               "dk": varlen.contiguous3(k.shape), "dv": varlen.contiguous3(k.shape)}
    problem = _problem("bwd", q, k, cu_q, max_q, max_k, causal, slopes, window, softcap, dropout_p,
                       deterministic)
    plan = varlen.feature_plan(problem, (total_q, total_k), strides, float(scale), q.device.index,
                               config)
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    ws = torch.empty(max(plan.workspace_bytes, 1), dtype=torch.uint8, device=q.device)
    if api.POISON_OUTPUTS:
        for x in (dq, dk, dv):
            x.fill_(math.nan)
    varlen.run_features(plan, (dout.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                               out.data_ptr(), lse.data_ptr(), dq.data_ptr(), dk.data_ptr(),
                               dv.data_ptr()), ws.data_ptr(), _raw_stream(plan.device),
                        cu_q.data_ptr(), cu_k.data_ptr(), _ptr(slopes), _ptr(rng) if dropout_p else 0)
    return dq, dk, dv


torch.library.define("cuflash::varlen_fwd_features",
                     "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
                     "int max_seqlen_q, int max_seqlen_k, float softmax_scale, bool causal, "
                     "Tensor? alibi_slopes, int window_left, int window_right, float softcap, "
                     "float dropout_p, Tensor? rng_state, str config) -> (Tensor, Tensor)")
torch.library.define("cuflash::varlen_bwd_features",
                     "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                     "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
                     "float softmax_scale, bool causal, bool deterministic, Tensor? alibi_slopes, "
                     "int window_left, int window_right, float softcap, float dropout_p, "
                     "Tensor? rng_state, str config) -> (Tensor, Tensor, Tensor)")


@torch.library.impl("cuflash::varlen_fwd_features", "CUDA")
def _fwd_features_op(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, slopes, left, right, softcap,
                     dropout_p, rng, config):
    return forward_features(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, slopes, (left, right),
                            softcap, dropout_p, rng, _decode(config, q.dtype, causal))


@torch.library.impl("cuflash::varlen_bwd_features", "CUDA")
def _bwd_features_op(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, deterministic,
                     slopes, left, right, softcap, dropout_p, rng, config):
    return backward_features(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal,
                             deterministic, slopes, (left, right), softcap, dropout_p, rng,
                             _decode(config, q.dtype, causal))


@torch.library.register_fake("cuflash::varlen_fwd_features")
def _(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, slopes, left, right, softcap, dropout_p, rng,
      config):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device))


@torch.library.register_fake("cuflash::varlen_bwd_features")
def _(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, deterministic, slopes, left,
      right, softcap, dropout_p, rng, config):
    return tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))


class VarlenFeatureFn(torch.autograd.Function):
    """out, lse = varlen attention with features; the backward runs the varlen backward kernels
    with the same features (dropout: the forward's RNG state regenerates its mask).
    args = (max_q, max_k, scale, causal, deterministic, window, softcap, dropout_p, config,
    bwd_config); slopes, rng: tensors or None (no gradient)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, slopes, rng, args):
        max_q, max_k, scale, causal, deterministic, window, softcap, dropout_p, config, bwd_config = args
        out, lse = torch.ops.cuflash.varlen_fwd_features(q, k, v, cu_q, cu_k, max_q, max_k, scale,
                                                         causal, slopes, window[0], window[1], softcap,
                                                         dropout_p, rng, _encode(config))
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, slopes, rng)
        ctx.args = args
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse=None):
        q, k, v, out, lse, cu_q, cu_k, slopes, rng = ctx.saved_tensors
        max_q, max_k, scale, causal, deterministic, window, softcap, dropout_p, _, bwd_config = ctx.args
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = torch.ops.cuflash.varlen_bwd_features(dout, q, k, v, out, lse, cu_q, cu_k, max_q,
                                                           max_k, scale, causal, deterministic, slopes,
                                                           window[0], window[1], softcap, dropout_p,
                                                           rng, _encode(bwd_config))
        return dq, dk, dv, None, None, None, None, None


def rng_state(dropout_p: float, dropout_seed, device):
    """Dropout's int64[2] state of a call: None without dropout; drawn from torch's CUDA
    generator, or the caller's dropout_seed (a state tensor is cloned: autograd's backward
    regenerates the mask from it, an in-place update of the caller's must not reach it)."""
    if not dropout_p:
        return None
    from . import torch_ops

    if dropout_seed is None:
        return torch_ops.draw_rng_state(device)
    rng = torch_ops.rng_state_of(dropout_seed, device)
    return rng.clone() if rng is dropout_seed else rng


def attention_features(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, feats,
                       deterministic: bool, dropout_seed=None, config=None, bwd_config=None):
    """(out, lse, rng) of a validated torch CUDA varlen call with features
    (``cuflash.api.FeatureArgs``), with autograd when q, k or v need it; rng: the dropout
    state used (None without dropout)."""
    rng = rng_state(feats.dropout_p, dropout_seed, q.device)
    slopes = None if feats.alibi_slopes is None else feats.alibi_slopes.detach()
    window = tuple(int(w) for w in feats.window_size)
    args = (int(max_q), int(max_k), float(scale), bool(feats.causal), bool(deterministic), window,
            float(feats.softcap), float(feats.dropout_p), config, bwd_config)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = VarlenFeatureFn.apply(q, k, v, cu_q, cu_k, slopes, rng, args)
    else:
        out, lse = torch.ops.cuflash.varlen_fwd_features(q, k, v, cu_q, cu_k, *args[:4], slopes,
                                                         window[0], window[1], args[6], args[7], rng,
                                                         _encode(config))
    return out, lse, rng


def dropout_probs(q, k, lse, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool,
                  dropout_p: float, rng, window=(-1, -1), softcap: float = 0.0, slopes=None):
    """S_dmask of a varlen call with dropout (for testing; reads q, k, lse, cu_seqlens and the
    RNG state back to the host): cuflash.dropout.varlen_dropout_probs_host on q's device, the
    call's window / softcap / ALiBi slopes applied."""
    from .dropout import varlen_dropout_probs_host

    def words(x):
        return x.detach().contiguous().view(torch.int16).cpu().numpy().view(np.uint16)

    seed, offset = (int(x) & (2 ** 64 - 1) for x in rng.tolist())
    probs = varlen_dropout_probs_host(words(q), words(k), lse.detach().cpu().numpy(),
                                      cu_q.cpu().numpy(), cu_k.cpu().numpy(), int(max_q), int(max_k),
                                      _DTYPES[q.dtype], scale, causal, dropout_p, seed, offset,
                                      window=tuple(window), softcap=softcap,
                                      alibi_slopes=None if slopes is None
                                      else slopes.detach().float().cpu().numpy())
    return torch.from_numpy(probs).to(q.device)


# ---------------------------------------------------------------------------------------
# paged K/V cache (block_table): forward only, eager (and CUDA graphs: launches by address on
# the current stream) and torch.compile (the ops at the end of this file); a backward through
# it raises NotImplementedError naming block_table

def _ready_cache(x):
    """A (num_pages, page_block_size, nheads_kv, head_dim) cache, or a contiguous aligned copy
    when the kernels cannot read it in place."""
    if x.stride(-1) == 1 and not x.data_ptr() & 15 and all(
            s % 8 == 0 for s, n in zip(x.stride()[:3], x.shape[:3]) if n > 1):
        return x
    return x.clone(memory_format=torch.contiguous_format)


def forward_paged(q, k, v, cu_q, cu_k, block_table, max_q: int, max_k: int, scale: float,
                  causal: bool, slopes, window, softcap: float, config=None):
    """(out, lse) of a validated paged call (cuflash.varlen.paged_plan); no autograd."""
    d = q.shape[-1]
    padded = api.padded_head_dim(d)
    if padded != d:
        out, lse = forward_paged(*(_pad(x, padded) for x in (q, k, v)), cu_q, cu_k, block_table, max_q,
                                 max_k, scale, causal, slopes, window, softcap, config)
        return out[..., :d].contiguous(), lse
    total_q, nheads, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((nheads, total_q), dtype=torch.float32, device=q.device)
    if total_q == 0 or nheads == 0 or max_q == 0:
        return out, lse
    if max_k == 0:
        out.zero_()
        lse.fill_(math.inf)
        return out, lse
    if not q.is_contiguous() or q.data_ptr() & 15:
        q = q.clone(memory_format=torch.contiguous_format)
    k, v = _ready_cache(k), _ready_cache(v)
    cu_q, cu_k, table = cu_q.contiguous(), cu_k.contiguous(), block_table.contiguous()
    slopes = None if slopes is None else slopes.contiguous()
    problem = varlen.features_problem("fwd", _DTYPES[q.dtype], cu_q.shape[0] - 1, max_q, max_k, nheads,
                                      k.shape[2], q.shape[2], causal, window, softcap,
                                      None if slopes is None else slopes.dim() == 2, paged=True)
    paged = (k.shape[1], k.shape[0], table.shape[1], table.shape[1])
    plan = varlen.paged_plan(problem, total_q, _strides3(q), tuple(k.stride()), tuple(v.stride()), paged,
                             float(scale), q.device.index, config)
    if api.POISON_OUTPUTS:
        out.fill_(math.nan)
        lse.fill_(math.nan)
    varlen.run_features(plan, (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()),
                        0, _raw_stream(plan.device), cu_q.data_ptr(), cu_k.data_ptr(), _ptr(slopes), 0,
                        table.data_ptr())
    return out, lse


class PagedNoBackwardFn(torch.autograd.Function):
    """out, lse of a paged call for inputs that require grad: the backward raises (flash-attn
    has no backward through a paged cache either)."""

    @staticmethod
    def forward(ctx, q, k, v, run):
        out, lse = run()
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse=None):
        raise NotImplementedError(PAGED_NO_BACKWARD)


def attention_paged(q, k, v, cu_q, cu_k, block_table, max_q: int, max_k: int, scale: float, feats,
                    config=None):
    """(out, lse) of a validated torch paged call (``cuflash.api.FeatureArgs``): eager CUDA
    tensors launch directly; under torch.compile (CUDA, or CPU through the reference) the call
    goes through the cuflash::varlen_fwd_paged op."""
    if torch.compiler.is_compiling():
        return attention_paged_traced(q, k, v, cu_q, cu_k, block_table, max_q, max_k, scale, feats,
                                      config)
    slopes = None if feats.alibi_slopes is None else feats.alibi_slopes.detach()

    def run():
        return forward_paged(q.detach(), k.detach(), v.detach(), cu_q, cu_k, block_table, int(max_q),
                             int(max_k), float(scale), bool(feats.causal), slopes,
                             tuple(int(w) for w in feats.window_size), float(feats.softcap), config)

    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return PagedNoBackwardFn.apply(q, k, v, run)
    return run()


# ---------------------------------------------------------------------------------------
# the paged call under torch.compile: one forward op, and a backward op that refuses at run time
#   cuflash::varlen_fwd_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, max_seqlen_q,
#       max_seqlen_k, softmax_scale, causal, alibi_slopes?, window_left, window_right, softcap,
#       config) -> (out, lse)
#   cuflash::varlen_paged_no_bwd(dout, q, k, v) -> (dq, dk, dv): raises NotImplementedError
# flash-attn has no backward through a paged cache either (its varlen backward rejects the 4-D
# cache at run time); a graph that only *could* differentiate compiles, as flash-attn's does,
# and the refusal comes when a backward actually runs. The CPU impl is the float64 reference
# on the keys gathered from their pages (what the eager CPU path computes).

torch.library.define("cuflash::varlen_fwd_paged",
                     "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
                     "Tensor block_table, int max_seqlen_q, int max_seqlen_k, float softmax_scale, "
                     "bool causal, Tensor? alibi_slopes, int window_left, int window_right, "
                     "float softcap, str config) -> (Tensor, Tensor)")
torch.library.define("cuflash::varlen_paged_no_bwd",
                     "(Tensor dout, Tensor q, Tensor k, Tensor v) -> (Tensor, Tensor, Tensor)")

PAGED_NO_BACKWARD = ("block_table: the backward through a paged K/V cache is not implemented "
                     "(use packed k, v without block_table for training)")


@torch.library.impl("cuflash::varlen_fwd_paged", "CUDA")
def _fwd_paged_op(q, k, v, cu_q, cu_k, block_table, max_q, max_k, scale, causal, slopes, left, right,
                  softcap, config):
    return forward_paged(q, k, v, cu_q, cu_k, block_table, max_q, max_k, scale, causal, slopes,
                         (left, right), softcap, _decode(config, q.dtype, causal))


@torch.library.impl("cuflash::varlen_fwd_paged", "CPU")
def _fwd_paged_cpu(q, k, v, cu_q, cu_k, block_table, max_q, max_k, scale, causal, slopes, left,
                   right, softcap, config):
    import types

    from . import torch_ops

    cu_q_host, cu_k_host = (x.numpy().astype(np.int64) for x in (cu_q, cu_k))
    kp, vp = (varlen.gather_paged(x, block_table, np.diff(cu_k_host), xp="torch") for x in (k, v))
    feats = types.SimpleNamespace(window_size=(int(left), int(right)), softcap=float(softcap),
                                  alibi_slopes=slopes, dropout_p=0.0, causal=bool(causal))
    out, lse, _ = torch_ops.attention_reference(q, kp, vp, scale, feats,
                                                (cu_q_host, cu_k_host, int(max_q), int(max_k)))
    return out.contiguous(), lse.contiguous()


@torch.library.register_fake("cuflash::varlen_fwd_paged")
def _(q, k, v, cu_q, cu_k, block_table, max_q, max_k, scale, causal, slopes, left, right, softcap,
      config):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device))


def _paged_no_bwd(dout, q, k, v):
    raise NotImplementedError(PAGED_NO_BACKWARD)


torch.library.impl("cuflash::varlen_paged_no_bwd", "CUDA")(_paged_no_bwd)
torch.library.impl("cuflash::varlen_paged_no_bwd", "CPU")(_paged_no_bwd)


@torch.library.register_fake("cuflash::varlen_paged_no_bwd")
def _(dout, q, k, v):
    return tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))


class VarlenPagedFn(torch.autograd.Function):
    """out, lse of a paged call under torch.compile, for inputs that require grad: the
    backward is the refusing op (so the graph traces; running it raises)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, block_table, slopes, args):
        out, lse = torch.ops.cuflash.varlen_fwd_paged(q, k, v, cu_q, cu_k, block_table, *args[:4],
                                                      slopes, *args[4:])
        ctx.save_for_backward(q, k, v)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse=None):
        q, k, v = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        dq, dk, dv = torch.ops.cuflash.varlen_paged_no_bwd(dout, q, k, v)
        return dq, dk, dv, None, None, None, None, None


def attention_paged_traced(q, k, v, cu_q, cu_k, block_table, max_q: int, max_k: int, scale: float,
                           feats, config=None):
    """attention_paged under torch.compile: through the cuflash::varlen_fwd_paged op."""
    slopes = None if feats.alibi_slopes is None else feats.alibi_slopes.detach()
    window = tuple(int(w) for w in feats.window_size)
    args = (int(max_q), int(max_k), float(scale), bool(feats.causal), window[0], window[1],
            float(feats.softcap), _encode(config))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return VarlenPagedFn.apply(q, k, v, cu_q, cu_k, block_table, slopes, args)
    return torch.ops.cuflash.varlen_fwd_paged(q, k, v, cu_q, cu_k, block_table, *args[:4], slopes,
                                              *args[4:])


# ---------------------------------------------------------------------------------------
# the eager fast path of flash_attn_varlen_func (torch CUDA tensors, with or without features)
#
# As flash_attn_func's (cuflash.torch_ops.features_attention): one tuple key of everything
# validation reads but cu_seqlens' values finds the call shape's _VarlenEntry (validated, the
# forward plan, per dout layout the backward plan). A repeat call still reads cu_seqlens back
# and checks their values where the validating route does (cuflash.api.CHECK_CU_SEQLENS, not
# while capturing a CUDA graph): one device-to-host read when cu_seqlens_k is cu_seqlens_q.
# The first call of a shape validates through cuflash.api.varlen_checked; what the entry does
# not run (empty problems, padded head dims, copies to make, an explicit dropout_seed, S_dmask
# with dropout) takes the validating route.

_fast_plans: dict = {}


def _on_change_fast():
    from . import compile as compile_mod

    compile_mod.on_change(_fast_plans.clear)


_on_change_fast()


class _VarlenEntry:
    """One call shape of flash_attn_varlen_func on torch CUDA tensors. features: the call has
    window / softcap / ALiBi / dropout (cuflash.varlen.feature_plan's plans), else the plain
    varlen plans. bwd: (dout strides, dout dtype) -> (copy dout first?, backward plan)."""
    __slots__ = ("features", "plan", "out_shape", "lse_shape", "kv_shape", "totals", "nseq",
                 "max_q", "max_k", "scale", "causal", "window", "softcap", "dropout_p",
                 "deterministic", "bwd", "batched", "host", "lock")

    def __init__(self, features, plan, q, k, nseq, max_q, max_k, scale, feats, deterministic,
                 batched):
        self.features, self.plan, self.nseq = features, plan, nseq
        self.out_shape, self.kv_shape = tuple(map(int, q.shape)), tuple(map(int, k.shape))
        self.lse_shape = (self.out_shape[1], self.out_shape[0])
        self.totals = (self.out_shape[0], self.kv_shape[0])
        self.max_q, self.max_k, self.scale = int(max_q), int(max_k), float(scale)
        self.causal = bool(feats.causal)
        self.window = tuple(int(w) for w in feats.window_size)
        self.softcap, self.dropout_p = float(feats.softcap), float(feats.dropout_p)
        self.deterministic, self.batched = bool(deterministic), batched
        self.bwd = {}
        # pinned int32 buffers cu_seqlens_q / _k are read back into (_check_values)
        self.host = tuple(torch.empty(nseq + 1, dtype=torch.int32, pin_memory=True)
                          for _ in range(2)) if q.is_cuda else None
        self.lock = threading.Lock()


def _ready_in_place(x) -> bool:
    """Whether _ready returns x itself (the kernels read it in place)."""
    return x.stride(-1) == 1 and not x.data_ptr() & 15 and all(
        s % 8 == 0 for s, n in zip(x.stride()[:2], x.shape[:2]) if n > 1)


def _fast_entry(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, window_size,
                softcap, slopes, deterministic):
    """First call of a varlen call shape: validate (cuflash.api.varlen_checked: raises naming the
    argument), choose and build the forward plan; False where the fast path does not run it."""
    checked = api.varlen_checked(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale,
                                 causal, window_size, softcap, slopes)
    if checked is None:
        return False
    tq, scale, problem, feats, _, _, max_q, max_k = checked
    if tq.device is None:  # torch CPU: the reference
        return False
    features = feats.features != ("varlen",)
    if features:  # as cuflash.api._varlen_features_gpu
        fp = api.feature_problem(problem, feats).replace(dropout_p=feats.dropout_p)
        if not api.gpu_supported(fp):
            api.raise_unsupported(fp, feats.given)
    total_q, nheads, d = q.shape
    if total_q == 0 or nheads == 0 or max_q == 0 or k.shape[0] == 0 or max_k == 0 \
            or api.padded_head_dim(d) != d:
        return False
    if not (_ready_in_place(q) and _ready_in_place(k) and _ready_in_place(v)
            and cu_q.is_contiguous() and cu_k.is_contiguous()
            and (slopes is None or slopes.is_contiguous())):
        return False
    strides = {"q": _strides3(q), "k": _strides3(k), "v": _strides3(v),
               "o": varlen.contiguous3(q.shape)}
    batched = None if slopes is None else slopes.dim() == 2
    if features:
        p = _problem("fwd", q, k, cu_q, max_q, max_k, feats.causal, slopes, feats.window_size,
                     feats.softcap, feats.dropout_p)
        plan = varlen.feature_plan(p, (total_q, k.shape[0]), strides, float(scale), q.device.index)
    else:
        plan = varlen.get_plan("fwd", _DTYPES[q.dtype], cu_q.shape[0] - 1, int(max_q), int(max_k),
                               (total_q, k.shape[0]), tuple(q.shape), tuple(k.shape), strides,
                               float(scale), bool(feats.causal), False, q.device.index)
    return _VarlenEntry(features, plan, q, k, cu_q.shape[0] - 1, max_q, max_k, scale, feats,
                        deterministic, batched)


def _check_values(cu_q, cu_k, entry) -> None:
    """A repeat call's cu_seqlens values, checked as the validating route checks them (where it
    reads them back; the same errors): one read when cu_seqlens_k is cu_seqlens_q, into the
    entry's pinned host buffers (no allocation, an asynchronous copy and a stream synchronize:
    what .cpu() does besides)."""
    if api._values_unreadable(cu_q, "torch"):
        return
    if entry.host is None:  # (no pinned memory: not CUDA tensors, e.g. a test's fake GPU)
        vq = api._host_ints(cu_q, "torch")
        vk = vq if cu_k is cu_q else api._host_ints(cu_k, "torch")
    else:
        with entry.lock:
            hq, hk = entry.host
            hq.copy_(cu_q, non_blocking=True)
            if cu_k is not cu_q:
                hk.copy_(cu_k, non_blocking=True)
            torch.cuda.current_stream(cu_q.device).synchronize()
            vq = hq.numpy().copy()
            vk = vq if cu_k is cu_q else hk.numpy().copy()
    dq = np.diff(vq)
    dk = dq if vk is vq else np.diff(vk)
    (tq, tk), n = entry.totals, len(vq) - 1
    if not (vq[0] == 0 and vq[-1] == tq and vk[0] == 0 and vk[-1] == tk and (n == 0 or (
            dq.min() >= 0 and dk.min() >= 0 and dq.max() <= entry.max_q and dk.max() <= entry.max_k))):
        api.check_cu_values("cu_seqlens_q", vq.astype(np.int64), tq)   # raise naming it
        api.check_cu_values("cu_seqlens_k", vk.astype(np.int64), tk)
        api.check_max_seqlen("max_seqlen_q", entry.max_q, vq.astype(np.int64))
        api.check_max_seqlen("max_seqlen_k", entry.max_k, vk.astype(np.int64))


def _fast_launch(entry, plan, ptrs, ws_ptr, cu_q, cu_k, slopes, rng):
    stream = _raw_stream(plan.device)
    if entry.features:
        varlen.run_features(plan, ptrs, ws_ptr, stream, cu_q.data_ptr(), cu_k.data_ptr(),
                            _ptr(slopes), _ptr(rng) if entry.dropout_p else 0)
    else:
        plan.run_varlen(ptrs, ws_ptr, stream, cu_q.data_ptr(), cu_k.data_ptr())


def _fast_forward(entry, q, k, v, cu_q, cu_k, slopes, rng):
    """(out, lse) of a cached varlen call shape on aligned q, k, v; no autograd."""
    return cached_forward(entry, q, k, v, lambda plan, ptrs, ws: _fast_launch(
        entry, plan, ptrs, ws, cu_q, cu_k, slopes, rng))


def _fast_bwd_plan(entry, dout, q, k, v, out, cu_q, slopes):
    """(copy, plan) of a cached varlen call shape's backward for dout's layout, as backward() /
    backward_features() make it; None where dout is not q's kind of tensor (the op route then)."""
    if dout.dtype != q.dtype or dout.shape != q.shape or dout.device != q.device:
        return None
    copy = not dout.is_contiguous()
    strides = {"dout": varlen.contiguous3(q.shape) if copy else _strides3(dout), "q": _strides3(q),
               "k": _strides3(k), "v": _strides3(v), "o": _strides3(out),
               "dq": varlen.contiguous3(q.shape), "dk": varlen.contiguous3(k.shape),
               "dv": varlen.contiguous3(k.shape)}
    if entry.features:
        p = _problem("bwd", q, k, cu_q, entry.max_q, entry.max_k, entry.causal, slopes,
                     entry.window, entry.softcap, entry.dropout_p, entry.deterministic)
        return copy, varlen.feature_plan(p, entry.totals, strides, entry.scale, q.device.index)
    return copy, varlen.get_plan("bwd", _DTYPES[q.dtype], entry.nseq, entry.max_q, entry.max_k,
                                 entry.totals, entry.out_shape, entry.kv_shape, strides,
                                 entry.scale, entry.causal, entry.deterministic, q.device.index)


class VarlenFastFn(torch.autograd.Function):
    """out (, lse) of a cached varlen call shape (_VarlenEntry) with autograd; the backward finds
    its plan on the entry. args = (entry, rng, with_lse): rng, dropout's int64[2] state of this
    call or None; cu_seqlens and the ALiBi slopes are inputs (saved: an in-place change before
    the backward raises; no gradient)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, slopes, args):
        entry, rng, with_lse = args
        out, lse = _fast_forward(entry, q, k, v, cu_q, cu_k, slopes, rng)
        return fast_outputs(ctx, out, lse, with_lse, (q, k, v, out, lse, cu_q, cu_k, slopes),
                            (entry, rng))

    @staticmethod
    def backward(ctx, dout, dlse=None):
        q, k, v, out, lse, cu_q, cu_k, slopes = ctx.saved_tensors
        entry, rng = ctx.state
        if dout is None:
            dout = torch.zeros_like(out)
        key = (dout.stride(), dout.dtype)
        hit = entry.bwd.get(key)
        if hit is None:
            hit = entry.bwd[key] = _fast_bwd_plan(entry, dout, q, k, v, out, cu_q, slopes) or False
        if hit and not torch.is_grad_enabled():  # (create_graph: the ops' route, as before)
            grads = cached_backward(hit, max(hit[1].workspace_bytes, 1), dout, q, k, v, out, lse,
                                    entry.out_shape, entry.kv_shape,
                                    lambda plan, ptrs, ws: _fast_launch(entry, plan, ptrs, ws, cu_q,
                                                                        cu_k, slopes, rng))
            if grads is not None:
                return (*grads, None, None, None, None)
        if entry.features:
            dq, dk, dv = torch.ops.cuflash.varlen_bwd_features(
                dout, q, k, v, out, lse, cu_q, cu_k, entry.max_q, entry.max_k, entry.scale,
                entry.causal, entry.deterministic, slopes, entry.window[0], entry.window[1],
                entry.softcap, entry.dropout_p, rng, "")
        else:
            dq, dk, dv = torch.ops.cuflash.varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, entry.max_q,
                                                      entry.max_k, entry.scale, entry.causal,
                                                      entry.deterministic, "")
        return dq, dk, dv, None, None, None, None


from .torch_ops import _functorch_active, _unwrap_dead, raw_apply  # noqa: E402

_fast_apply = raw_apply(VarlenFastFn)   # VarlenFastFn.apply without its Python wrapper (eager, no functorch)


def fast_attention(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal,
                   window_size, softcap, slopes, deterministic, with_lse):
    """(out, lse) of an eager torch call of flash_attn_varlen_func through its cached call shape
    (lse None when not with_lse and autograd runs), or None: not a call this path runs (the
    caller takes the validating route). Arguments as flash_attn_varlen_func's (no block_table,
    dropout_seed None, no S_dmask wanted with dropout)."""
    if not keyable(softmax_scale, window_size, softcap, dropout_p) \
            or max_q.__class__ is not int or max_k.__class__ is not int:
        return None
    try:
        skey = None if slopes is None else (slopes.__class__, slopes.shape, slopes.stride(),
                                            slopes.dtype, slopes.device)
        key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype,
               v.dtype, q.device, k.device, v.device, cu_q.__class__, cu_q.shape, cu_q.stride(),
               cu_q.dtype, cu_q.device, cu_k.__class__, cu_k.shape, cu_k.stride(), cu_k.dtype,
               cu_k.device, max_q, max_k, softmax_scale, causal, window_size, softcap, dropout_p,
               skey, deterministic)
        entry = _fast_plans.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable: the validating route
        return None
    if entry is None:
        entry = _fast_plans[key] = _fast_entry(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p,
                                               softmax_scale, causal, window_size, softcap, slopes,
                                               deterministic)
    elif entry is not False:
        _check_values(cu_q, cu_k, entry)
    if entry is False:
        return None
    if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        return None  # misaligned views (strides: keyed): the validating route reads aligned copies
    rng = q.new_empty(2, dtype=torch.int64).random_() if entry.dropout_p else None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        args = (entry, rng, with_lse)
        if _fast_apply is not None and not _functorch_active():
            res = _fast_apply(_unwrap_dead(q), _unwrap_dead(k), _unwrap_dead(v), cu_q, cu_k, slopes,
                              args)
        else:
            res = VarlenFastFn.apply(q, k, v, cu_q, cu_k, slopes, args)
        return res if with_lse else (res, None)
    return _fast_forward(entry, q, k, v, cu_q, cu_k, slopes, rng)
