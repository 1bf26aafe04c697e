"""Dropout + residual add + LayerNorm / RMSNorm with flash-attn 2.8's names, arguments, return
values and dtype rules. The common case runs fused CUDA kernels (``cuflash.layer_norm``,
``kernels_cu/layer_norm.cu``): CUDA x [+ residual] in bf16 / fp16 / fp32 with a weight (bias
optional), rows of at most 16384 features, no dropout, rowscale, layerscale, x1 or weight1, y in
x's dtype; one read of x (and the residual) and one write of y (and residual_out) forward; one
read of dy and h and one write of dx (and dresidual) backward, with dweight / dbias summed per CTA
on the way and the CTAs' sums added by a second small kernel; under torch.compile the same kernels run as the torch ops
``cuflash::layer_norm_fwd`` / ``layer_norm_bwd``. Every other call (CPU, float64, dropout, ...)
and ``USE_KERNELS = False`` take the torch compositions below (autograd through torch's own
operations; ``torch.compile`` traces them like any torch code).

``flash_attn.ops.triton.layer_norm`` → ``cuflash.ops.layer_norm`` (also importable as
``cuflash.ops.triton.layer_norm``): ``layer_norm_fn``, ``rms_norm_fn``, ``RMSNorm``,
``layer_norm_linear_fn``, ``layer_norm_ref``, ``rms_norm_ref``, and ``LayerNorm`` (cuflash's:
``nn.LayerNorm``'s parameters with ``RMSNorm``'s forward). ``flash_attn.ops.layer_norm`` (the
older CUDA extension's API) → the same module: ``dropout_add_layer_norm``,
``dropout_add_layer_norm_parallel_residual``, ``layer_norm``, ``DropoutAddLayerNorm``; its RMSNorm
names are in ``cuflash.ops.rms_norm``.

What one call computes, per row of the last dim (N features), in fp32 (float64 when an input is
float64), as flash-attn's kernel does:

    h = dropout(x * rowscale [* layerscale]) [+ dropout1(x1)] [+ residual]
    residual_out = h rounded to the residual dtype (residual's dtype; else fp32 with
                   residual_in_fp32; else x's dtype)
    y  = norm(h) * w  [+ b]            norm: (h - mean) * rstd, or h * rstd for RMSNorm
    y1 = norm(h) * w1 [+ b1]           (weight1: a second, parallel output of the same h)

with w = weight + 1 under ``zero_centered_weight``, rstd = 1 / sqrt(var + eps) (RMSNorm: the mean
of h²), y / y1 rounded to ``out_dtype`` (default x's dtype). Dropout keeps each element with
probability 1 - p and scales it by 1 / (1 - p); the keep masks are drawn with torch's generator on
x's device (``torch.manual_seed`` reproduces them) and ``return_dropout_mask=True`` returns them
(bool, x's shape). The gradients are those of this formula: dx in x's dtype, dresidual in the
residual's, dweight in weight's. Bad arguments raise ``ValueError`` naming the argument.

Differences from flash-attn (on the accepting side): any N (flash-attn: N·element size < 64 KB),
CPU tensors, float64, ``weight=None`` (no scale); the keep masks come from torch's generator, not
flash-attn's per-row Philox seeds, so the same seed gives other masks than flash-attn's.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .. import layer_norm as _ln

__all__ = ["layer_norm_fn", "rms_norm_fn", "LayerNormFn", "layer_norm_ref", "rms_norm_ref", "RMSNorm", "LayerNorm",
           "layer_norm_linear_fn", "dropout_add_layer_norm", "dropout_add_layer_norm_parallel_residual",
           "layer_norm", "DropoutAddLayerNorm"]


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------

def _check_tensor(name: str, t, shape=None, allow_none: bool = True, floating: bool = True) -> None:
    if t is None:
        if not allow_none:
            raise ValueError(f"{name} must be a tensor, got None")
        return
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if floating and not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def _check_args(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale,
                layerscale=None) -> None:
    _check_tensor("x", x, allow_none=False)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    n = x.shape[-1]
    _check_tensor("weight", weight, (n,))
    _check_tensor("bias", bias, (n,))
    _check_tensor("residual", residual, x.shape)
    _check_tensor("x1", x1, x.shape)
    _check_tensor("weight1", weight1, (n,))
    _check_tensor("bias1", bias1, (n,))
    _check_tensor("rowscale", rowscale)
    if rowscale is not None and rowscale.numel() != x[..., 0].numel():
        raise ValueError(f"rowscale must have one value per row of x (shape {tuple(x.shape[:-1])}), got "
                         f"{tuple(rowscale.shape)}")
    _check_tensor("layerscale", layerscale, (n,))
    if bias1 is not None and weight1 is None:
        raise ValueError("bias1 needs weight1 (the second output's scale)")
    if x1 is not None and rowscale is not None:
        raise ValueError("rowscale is not supported with x1 (parallel residual branch), as in flash-attn")
    if weight is None and weight1 is not None:
        raise ValueError("weight1 needs weight (got weight=None)")
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    for name, t in (("weight", weight), ("bias", bias), ("residual", residual), ("x1", x1),
                    ("weight1", weight1), ("bias1", bias1), ("rowscale", rowscale),
                    ("layerscale", layerscale)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")


# ---------------------------------------------------------------------------------------------
# The composition
# ---------------------------------------------------------------------------------------------

def _compute_dtype(*tensors) -> torch.dtype:
    """fp32, or float64 when any input is float64 (the CPU float64 tests and gradcheck)."""
    dt = torch.float32
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            dt = torch.float64
    return dt


def _keep_mask(like: Tensor, p: float) -> Tensor:
    # one uniform draw per element from torch's generator on like's device
    return torch.rand(like.shape, device=like.device) >= p


def _add(a: Tensor, b: Tensor, cdt) -> Tensor:
    """a + b in cdt: one operation when either is already in cdt (type promotion converts the other)."""
    if a.dtype != cdt and b.dtype != cdt:
        a = a.to(cdt)
    return a + b


def _norm_affine(h: Tensor, w, b, eps: float, is_rms_norm: bool, zero_centered: bool, cdt) -> Tensor:
    """norm(h) · w + b in cdt through torch's fused F.layer_norm / F.rms_norm."""
    n = h.shape[-1]
    if w is not None:
        w = w.to(cdt) + 1.0 if zero_centered else w.to(cdt)
    b = b.to(cdt) if b is not None else None
    if is_rms_norm:
        y = F.rms_norm(h, (n,), w, eps)
        return y + b if b is not None else y
    return F.layer_norm(h, (n,), w, b, eps)


# ---------------------------------------------------------------------------------------------
# The fused kernels (cuflash.layer_norm): the common case of CUDA tensors
# ---------------------------------------------------------------------------------------------

# False: CUDA tensors take the torch composition too (the timing script compares the two).
USE_KERNELS = True
# False: every eager call takes the checked route below (_dropout_add_norm), as before the fast
# path (the host-time script compares the two).
EAGER_CACHE = True
# Test hook: True sends CPU tensors through the kernel route too (the torch ops, whose CPU impls
# run cuflash.layer_norm's float64 reference), so its plumbing is tested without a GPU.
OPS_ROUTE_ON_CPU = False


def _kernel_route(x, weight, bias, residual, x1, weight1, dropout_p, rowscale, layerscale, res_dtype,
                  out_dtype) -> bool:
    """The kernels take x [+ residual] -> norm · w [+ b] with no dropout, rowscale, layerscale, x1
    or weight1, y in x's dtype; other calls take the composition."""
    if not USE_KERNELS or dropout_p != 0.0 or rowscale is not None or layerscale is not None or x1 is not None \
            or weight1 is not None or weight is None or out_dtype not in (None, x.dtype) or x.numel() == 0:
        return False
    return _ln.kernel_takes(x, weight, bias, residual, res_dtype) or (OPS_ROUTE_ON_CPU and not x.is_cuda)


def _ln_fwd(*args):
    if torch.compiler.is_compiling():
        return torch.ops.cuflash.layer_norm_fwd(*args)
    return _ln.forward(*args)


def _ln_bwd(*args):
    if torch.compiler.is_compiling():
        return torch.ops.cuflash.layer_norm_bwd(*args)
    return _ln.backward(*args)


def _fused_forward(x, weight, bias, residual, eps, is_rms, zero_centered, res_dtype, write_res):
    """(y, residual_out) of the kernel route without autograd (no input needs a gradient)."""
    shape, n = x.shape, x.shape[-1]
    r2 = residual.reshape(-1, n) if residual is not None else None
    y, res_out, _, _ = _ln_fwd(x.reshape(-1, n), weight, bias, r2, float(eps), is_rms, zero_centered, res_dtype,
                               write_res)
    return y.view(shape), res_out.view(shape) if write_res else res_out


class _FusedNormFn(torch.autograd.Function):
    """x [+ residual] -> (y, residual_out) through cuflash.layer_norm's kernels; residual_out is
    an empty tensor when it is not written (h = x: the caller returns x itself)."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, eps, is_rms, zero_centered, res_dtype, write_res):
        shape, n = x.shape, x.shape[-1]
        x2 = x.reshape(-1, n)
        r2 = residual.reshape(-1, n) if residual is not None else None
        y, res_out, mean, rstd = _ln_fwd(x2, weight, bias, r2, float(eps), is_rms, zero_centered, res_dtype,
                                         write_res)
        # the backward's h: an fp32 residual_out is the forward's h exactly; else x + residual again
        h_from_res = write_res and res_dtype == torch.float32 and x.dtype != torch.float64
        ctx.save_for_backward(res_out if h_from_res else x2, None if h_from_res else r2, weight, mean, rstd)
        ctx.flags = (bias is not None, is_rms, zero_centered, residual is not None, res_dtype, write_res, shape,
                     x.dtype, h_from_res)
        ctx.set_materialize_grads(False)
        if write_res:
            return y.view(shape), res_out.view(shape)
        ctx.mark_non_differentiable(res_out)
        return y.view(shape), res_out

    @staticmethod
    def backward(ctx, dy, dres):
        h, r2, weight, mean, rstd = ctx.saved_tensors
        has_bias, is_rms, zero_centered, has_residual, res_dtype, write_res, shape, x_dtype, h_from_res = ctx.flags
        n = shape[-1]
        dy = torch.zeros(h.shape, dtype=x_dtype, device=h.device) if dy is None else dy.reshape(-1, n)
        dres2 = dres.reshape(-1, n) if write_res and dres is not None else None
        dx, dw, db, dresid = _ln_bwd(dy, dres2, h, r2, weight, has_bias, mean, rstd, is_rms, zero_centered,
                                     has_residual, res_dtype, h_from_res)
        return (dx.view(shape), dw, db if has_bias else None, dresid.view(shape) if has_residual else None,
                None, None, None, None, None)


class _EntryNormFn(torch.autograd.Function):
    """The eager fast path's autograd node: _FusedNormFn's formulas through a cached
    cuflash.layer_norm.Entry (its plans, no checks); y, or (y, residual_out) when the entry writes
    residual_out."""

    @staticmethod
    def forward(ctx, entry, x, weight, bias, residual):
        y, res_out, stats = entry.forward(x, weight, bias, residual)
        ctx.entry = entry
        if entry.h_from_res:
            ctx.save_for_backward(res_out, None, weight, stats)
        else:
            ctx.save_for_backward(x, residual, weight, stats)
        ctx.set_materialize_grads(False)
        return y if res_out is None else (y, res_out)

    @staticmethod
    def backward(ctx, dy, dres=None):
        entry = ctx.entry
        h, r, weight, stats = ctx.saved_tensors
        dy = torch.zeros(h.shape, dtype=entry.dtype, device=h.device) if dy is None else dy.contiguous()
        if dres is not None:
            dres = dres.contiguous()
        dx, dw, db, dresid = entry.backward(dy, dres, h, r, weight, stats)
        return None, dx, dw, db, dresid


# _EntryNormFn.apply without its Python wrapper (torch_ops.raw_apply): the eager fast path's
# recorded forward (issue 12, session 30: host µs per call). None: the public apply.
from ..torch_ops import _functorch_active, _unwrap_dead, raw_apply  # noqa: E402

_entry_apply = raw_apply(_EntryNormFn)


def _fast_call(entry, x, weight, bias, residual, prenorm):
    """A repeat call of a cached key (layer_norm_fn's fast path): y, or (y, residual_out)
    (residual_out is x itself when the entry writes none, as flash-attn returns it)."""
    x0, x = x, x.contiguous()
    if residual is not None:
        residual = residual.contiguous()
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias is not None and bias.requires_grad
                                    or residual is not None and residual.requires_grad):
        weight = weight.contiguous()
        bias = None if bias is None else bias.contiguous()
        if _entry_apply is not None and not _functorch_active():
            out = _entry_apply(entry, _unwrap_dead(x), _unwrap_dead(weight),
                               None if bias is None else _unwrap_dead(bias),
                               None if residual is None else _unwrap_dead(residual))
        else:
            out = _EntryNormFn.apply(entry, x, weight, bias, residual)
        y, res = out if entry.write_res else (out, None)
    else:
        y, res, _ = entry.forward(x, weight.contiguous(), None if bias is None else bias.contiguous(), residual, False)
    if not prenorm:
        return y
    return y, x0 if res is None else res


def _dropout_add_norm(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6,
                      dropout_p=0.0, rowscale=None, layerscale=None, residual_in_fp32=False,
                      zero_centered_weight=False, is_rms_norm=False, out_dtype=None):
    """The shared body: returns (y, y1, residual_out, mask, mask1); y1 / masks None when absent."""
    res_dtype = residual.dtype if residual is not None else torch.float32 if residual_in_fp32 else x.dtype
    if _kernel_route(x, weight, bias, residual, x1, weight1, dropout_p, rowscale, layerscale, res_dtype, out_dtype):
        write_res = residual is not None or res_dtype != x.dtype
        args = (x, weight, bias, residual, eps, is_rms_norm, zero_centered_weight, res_dtype, write_res)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias, residual)) \
                or torch.compiler.is_compiling():
            y, res = _FusedNormFn.apply(*args)
        else:   # nothing to differentiate: the kernel without autograd's bookkeeping (host µs per call)
            y, res = _fused_forward(*args)
        return y, None, res if write_res else x, None, None
    cdt = _compute_dtype(x, weight, bias, residual, x1, weight1, bias1)
    # each step forms its result in cdt, the 16-bit operand converted inside the operation
    h = x
    if rowscale is not None:
        h = h * rowscale.to(cdt).reshape(x.shape[:-1]).unsqueeze(-1)
    if layerscale is not None:
        h = h * layerscale.to(cdt)
    mask = mask1 = None
    scale = 1.0 / (1.0 - dropout_p)
    if dropout_p > 0.0:
        mask = _keep_mask(x, dropout_p)
        h = h * (mask.to(cdt) * scale)
    if x1 is not None:
        h1 = x1
        if dropout_p > 0.0:
            mask1 = _keep_mask(x1, dropout_p)
            h1 = h1 * (mask1.to(cdt) * scale)
        h = _add(h, h1, cdt)
    if residual is not None:
        h = _add(h, residual, cdt)
    h = h.to(cdt)
    residual_dtype = (residual.dtype if residual is not None
                      else torch.float32 if residual_in_fp32 else x.dtype)
    trivial = (residual is None and x1 is None and rowscale is None and layerscale is None
               and dropout_p == 0.0 and residual_dtype == x.dtype)
    residual_out = x if trivial else h.to(residual_dtype)   # flash-attn returns x itself here
    odt = x.dtype if out_dtype is None else out_dtype
    y = _norm_affine(h, weight, bias, eps, is_rms_norm, zero_centered_weight, cdt).to(odt)
    y1 = None
    if weight1 is not None:   # the second output normalizes the same h again (two small reductions)
        y1 = _norm_affine(h, weight1, bias1, eps, is_rms_norm, zero_centered_weight, cdt).to(odt)
    return y, y1, residual_out, mask, mask1


def _write_into(dst, src: Tensor, name: str) -> Tensor:
    """flash-attn's out= / residual_out=: the result is written into the given tensor, returned."""
    if dst is None:
        return src
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{name} must have shape {tuple(src.shape)}, got {tuple(dst.shape)}")
    if dst.dtype != src.dtype:
        raise ValueError(f"{name} must have dtype {src.dtype}, got {dst.dtype}")
    return dst.copy_(src)


def layer_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6,
                  dropout_p=0.0, rowscale=None, prenorm=False, residual_in_fp32=False,
                  zero_centered_weight=False, is_rms_norm=False, return_dropout_mask=False,
                  out_dtype=None, out=None, residual_out=None):
    """flash-attn's ``layer_norm_fn``: see the module docstring for the formula. Returns
    ``y``; ``(y, residual_out)`` with ``prenorm``; ``(y, y1[, residual_out])`` with ``weight1``;
    ``return_dropout_mask=True`` appends ``(dropout_mask, dropout_mask1)`` (bool keep masks of
    x's shape, None without dropout / without x1). ``out`` / ``residual_out``: tensors to write
    y / residual_out into (returned).

    Eager calls that take the kernels are remembered by their key (shapes, dtypes, devices, eps,
    flags): a repeat call of a key checks nothing again and launches through its cached plans
    (``EAGER_CACHE``; cuflash.layer_norm.Entry)."""
    key = None
    if x1 is None and weight1 is None and rowscale is None and out is None and residual_out is None \
            and out_dtype is None and dropout_p == 0.0 and not return_dropout_mask and EAGER_CACHE and USE_KERNELS \
            and not torch.compiler.is_compiling():   # (compiling: the torch ops, traced through the checked route)
        try:
            key = (x.shape, x.dtype, x.device, weight.shape, weight.dtype, weight.device,
                   None if bias is None else (bias.shape, bias.dtype, bias.device),
                   None if residual is None else (residual.shape, residual.dtype, residual.device),
                   eps, residual_in_fp32, zero_centered_weight, is_rms_norm)
            entry = _ln.entries.get(key)
        except (AttributeError, TypeError):   # not tensors, an unhashable eps: the checks below name it
            key = entry = None
        if entry is not None:
            return _fast_call(entry, x, weight, bias, residual, prenorm)
    _check_args(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale)
    if zero_centered_weight and weight is None:
        raise ValueError("zero_centered_weight needs weight (got weight=None)")
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise ValueError(f"out_dtype must be a torch.dtype or None, got {out_dtype!r}")
    if key is not None:
        res_dtype = residual.dtype if residual is not None else torch.float32 if residual_in_fp32 else x.dtype
        if x.numel() and _ln.kernel_takes(x, weight, bias, residual, res_dtype):   # a CUDA call of the kernels
            if len(_ln.entries) >= _ln.ENTRY_LIMIT:   # call keys that keep changing (varlen batches): start over
                _ln.entries.clear()
            entry = _ln.entries[key] = _ln.Entry(x, weight, bias, residual, eps, is_rms_norm, zero_centered_weight,
                                                 res_dtype)
            return _fast_call(entry, x, weight, bias, residual, prenorm)
    y, y1, res, mask, mask1 = _dropout_add_norm(
        x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, None,
        residual_in_fp32, zero_centered_weight, is_rms_norm, out_dtype)
    y = _write_into(out, y, "out")
    if residual_out is not None:
        res = _write_into(residual_out, res, "residual_out")
    outs = (y,) if y1 is None else (y, y1)
    if prenorm:
        outs = outs + (res,)
    if return_dropout_mask:
        return outs + (mask, mask1)
    return outs[0] if len(outs) == 1 else outs


class LayerNormFn:
    """flash-attn's autograd.Function name: ``LayerNormFn.apply(...)`` takes ``layer_norm_fn``'s
    arguments, in its order (autograd here runs through torch's operations)."""
    apply = staticmethod(layer_norm_fn)


def rms_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6,
                dropout_p=0.0, rowscale=None, prenorm=False, residual_in_fp32=False,
                zero_centered_weight=False, return_dropout_mask=False, out_dtype=None, out=None,
                residual_out=None):
    """flash-attn's ``rms_norm_fn``: ``layer_norm_fn`` with ``is_rms_norm=True``."""
    return layer_norm_fn(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale,
                         prenorm, residual_in_fp32, zero_centered_weight, True, return_dropout_mask,
                         out_dtype, out, residual_out)


def _norm_ref(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
              zero_centered_weight, dropout_mask, dropout_mask1, upcast, is_rms_norm):
    """flash-attn's test references: plain torch in the inputs' dtype, or fp32 with ``upcast``;
    dropout from the given keep masks (else ``F.dropout``)."""
    dtype = x.dtype
    if upcast:
        up = lambda t: t.float() if t is not None else None  # noqa: E731
        x, weight, bias, residual, x1, weight1, bias1 = map(up, (x, weight, bias, residual, x1, weight1, bias1))
    if zero_centered_weight:
        weight = weight + 1.0
        weight1 = weight1 + 1.0 if weight1 is not None else None
    if x1 is not None and rowscale is not None:
        raise ValueError("rowscale is not supported with x1 (parallel residual branch)")
    if rowscale is not None:
        x = x * rowscale[..., None]

    def drop(t, m):
        if dropout_p == 0.0:
            return t
        return t.masked_fill(~m, 0.0) / (1.0 - dropout_p) if m is not None else F.dropout(t, p=dropout_p)

    x = drop(x, dropout_mask)
    if x1 is not None:
        x = x + drop(x1, dropout_mask1)
    if residual is not None:
        x = (x + residual).to(x.dtype)

    def norm(w, b):
        if is_rms_norm:
            rstd = 1 / torch.sqrt(x.square().mean(dim=-1, keepdim=True) + eps)
            y = x * rstd * w
            return (y + b if b is not None else y).to(dtype)
        return F.layer_norm(x.to(w.dtype), x.shape[-1:], weight=w, bias=b, eps=eps).to(dtype)

    out = norm(weight, bias)
    if weight1 is None:
        return (out, x) if prenorm else out
    out1 = norm(weight1, bias1)
    return (out, out1, x) if prenorm else (out, out1)


def layer_norm_ref(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6,
                   dropout_p=0.0, rowscale=None, prenorm=False, zero_centered_weight=False,
                   dropout_mask=None, dropout_mask1=None, upcast=False):
    """flash-attn's ``layer_norm_ref`` (its tests' reference): plain torch LayerNorm."""
    return _norm_ref(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                     zero_centered_weight, dropout_mask, dropout_mask1, upcast, False)


def rms_norm_ref(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6,
                 dropout_p=0.0, rowscale=None, prenorm=False, zero_centered_weight=False,
                 dropout_mask=None, dropout_mask1=None, upcast=False):
    """flash-attn's ``rms_norm_ref`` (its tests' reference): plain torch RMSNorm."""
    return _norm_ref(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                     zero_centered_weight, dropout_mask, dropout_mask1, upcast, True)


class RMSNorm(nn.Module):
    """flash-attn's ``RMSNorm`` (``flash_attn.ops.triton.layer_norm``): parameter ``weight`` (ones,
    zeros with ``zero_centered_weight``), ``bias`` registered as None; the forward takes the
    residual stream: ``forward(x, residual=None, prenorm=False, residual_in_fp32=False)``; dropout
    ``dropout_p`` on x in training mode."""

    def __init__(self, hidden_size, eps=1e-5, dropout_p=0.0, zero_centered_weight=False, device=None,
                 dtype=None):
        super().__init__()
        self.eps = eps
        self.drop = nn.Dropout(dropout_p) if dropout_p > 0.0 else None
        self.zero_centered_weight = zero_centered_weight
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        if self.zero_centered_weight:
            nn.init.zeros_(self.weight)
        else:
            nn.init.ones_(self.weight)

    def forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        return rms_norm_fn(x, self.weight, self.bias, residual=residual, eps=self.eps,
                           dropout_p=self.drop.p if self.drop is not None and self.training else 0.0,
                           prenorm=prenorm, residual_in_fp32=residual_in_fp32,
                           zero_centered_weight=self.zero_centered_weight)


class LayerNorm(nn.LayerNorm):
    """cuflash's LayerNorm twin of ``RMSNorm`` (flash-attn's Triton module has RMSNorm only): an
    ``nn.LayerNorm`` (same parameters and state dict, so ``isinstance(m, nn.LayerNorm)`` holds as
    flash-attn's ``Block`` asks) whose forward also takes ``residual``, ``prenorm`` and
    ``residual_in_fp32`` through ``layer_norm_fn``, with ``dropout_p`` on x in training mode."""

    def __init__(self, hidden_size, eps=1e-5, dropout_p=0.0, device=None, dtype=None):
        super().__init__(hidden_size, eps=eps, device=device, dtype=dtype)
        self.drop = nn.Dropout(dropout_p) if dropout_p > 0.0 else None

    def forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        return layer_norm_fn(x, self.weight, self.bias, residual=residual, eps=self.eps,
                             dropout_p=self.drop.p if self.drop is not None and self.training else 0.0,
                             prenorm=prenorm, residual_in_fp32=residual_in_fp32)


def layer_norm_linear_fn(x, norm_weight, norm_bias, linear_weight, linear_bias, residual=None, eps=1e-6,
                         prenorm=False, residual_in_fp32=False, is_rms_norm=False):
    """flash-attn's ``layer_norm_linear_fn``: the norm (as ``layer_norm_fn``), then
    ``F.linear`` with the linear weights cast to the autocast dtype when autocast is on (else
    the norm output's dtype). Returns ``out`` or ``(out, residual_out)``."""
    _check_tensor("linear_weight", linear_weight, allow_none=False)
    autocast = torch.is_autocast_enabled(x.device.type) if x.device.type in ("cuda", "cpu") else False
    adt = torch.get_autocast_dtype(x.device.type) if autocast else None
    y, res = layer_norm_fn(x, norm_weight, norm_bias, residual=residual, eps=eps, prenorm=True,
                           residual_in_fp32=residual_in_fp32, is_rms_norm=is_rms_norm, out_dtype=adt)
    dtype = adt if adt is not None else y.dtype
    w = linear_weight.to(dtype)
    b = linear_bias.to(dtype) if linear_bias is not None else None
    out = F.linear(y.to(dtype), w, b)
    return (out, res) if prenorm else out


# ---------------------------------------------------------------------------------------------
# flash-attn's older API (flash_attn.ops.layer_norm, the dropout_layer_norm CUDA extension)
# ---------------------------------------------------------------------------------------------

def _uint8_mask(mask, x0):
    # the older API returns uint8 keep masks, all ones without dropout
    return mask.to(torch.uint8) if mask is not None else torch.ones(x0.shape, dtype=torch.uint8, device=x0.device)


def _old_dropout_add_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale, layerscale, prenorm,
                          residual_in_fp32, return_dropout_mask, is_rms_norm):
    _check_args(x0, weight, bias, residual, None, None, None, epsilon, dropout_p, rowscale, layerscale)
    if weight is None:
        raise ValueError("weight must be a tensor, got None")
    y, _, res, mask, _ = _dropout_add_norm(x0, weight, bias, residual, eps=epsilon, dropout_p=dropout_p,
                                           rowscale=rowscale, layerscale=layerscale,
                                           residual_in_fp32=residual_in_fp32, is_rms_norm=is_rms_norm)
    outs = (y, res) if prenorm else (y,)
    if return_dropout_mask:
        outs = outs + (_uint8_mask(mask, x0),)
    return outs[0] if len(outs) == 1 else outs


def dropout_add_layer_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale=None, layerscale=None,
                           prenorm=False, residual_in_fp32=False, return_dropout_mask=False):
    """flash-attn's older ``dropout_add_layer_norm``: x = dropout(x0 · rowscale · layerscale) +
    residual, z = LayerNorm(x). Returns z, (z, x) with prenorm; return_dropout_mask appends the
    uint8 keep mask (ones without dropout). ``layerscale`` (N,) gets a gradient."""
    return _old_dropout_add_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale, layerscale,
                                 prenorm, residual_in_fp32, return_dropout_mask, False)


def _old_parallel_residual(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon, prenorm,
                           residual_in_fp32, return_dropout_mask, is_rms_norm):
    _check_args(x0, weight0, bias0, residual, x1, weight1, bias1, epsilon, dropout_p, None)
    if weight0 is None:
        raise ValueError("weight0 must be a tensor, got None")
    y0, y1, res, m0, m1 = _dropout_add_norm(x0, weight0, bias0, residual, x1, weight1, bias1, epsilon,
                                            dropout_p, residual_in_fp32=residual_in_fp32,
                                            is_rms_norm=is_rms_norm)
    outs = (y0, y1, res) if prenorm else (y0, y1)
    if return_dropout_mask:
        outs = outs + (_uint8_mask(m0, x0), _uint8_mask(m1 if x1 is not None else None, x0))
    return outs


def dropout_add_layer_norm_parallel_residual(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p,
                                             epsilon, prenorm=False, residual_in_fp32=False,
                                             return_dropout_mask=False):
    """flash-attn's older ``dropout_add_layer_norm_parallel_residual``: x = dropout(x0) +
    dropout(x1) + residual, z0 = LN(x; weight0, bias0), z1 = LN(x; weight1, bias1) (None without
    weight1). Returns (z0, z1[, x][, dmask0, dmask1])."""
    return _old_parallel_residual(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon,
                                  prenorm, residual_in_fp32, return_dropout_mask, False)


def layer_norm(x, weight, bias, epsilon):
    """flash-attn's older ``layer_norm(x, weight, bias, epsilon)``."""
    return dropout_add_layer_norm(x, None, weight, bias, 0.0, epsilon)


class DropoutAddLayerNorm(nn.Module):
    """flash-attn's older ``DropoutAddLayerNorm(hidden_size, prenorm=False, p=0.0, eps=1e-5,
    residual_in_fp32=False)``: ``forward(x0, residual=None)``; parameters ``weight``, ``bias``."""

    def __init__(self, hidden_size, prenorm=False, p=0.0, eps=1e-5, residual_in_fp32=False, device=None,
                 dtype=None):
        super().__init__()
        self.prenorm = prenorm
        self.p = p
        self.epsilon = self.eps = eps
        self.residual_in_fp32 = residual_in_fp32
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        if self._with_bias:
            self.bias = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    # DropoutAddRMSNorm (rms_norm.py) changes these two
    _with_bias = True
    _norm_fn = staticmethod(dropout_add_layer_norm)

    def reset_parameters(self):
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x0, residual=None):
        return self._norm_fn(x0, residual, self.weight, self.bias, self.p if self.training else 0.0, self.epsilon,
                             prenorm=self.prenorm, residual_in_fp32=self.residual_in_fp32)
