"""Cross-entropy with flash-attn 2.8's ``flash_attn.ops.triton.cross_entropy`` names, arguments
and return values: ``cross_entropy_loss`` and the ``autograd.Function`` ``CrossEntropyLoss``
(``CrossEntropyLossFunction``). The module that reduces the losses is
``cuflash.losses.cross_entropy.CrossEntropyLoss``.

CUDA tensors (bf16 / fp16 / fp32 logits with contiguous columns, int32 / int64 labels) run
``kernels_cu/cross_entropy.cu`` through ``cuflash.cross_entropy``: the forward reads the logits
once (online log-sum-exp, the loss, z-loss and label terms per row), the backward reads them once
and writes the gradient once (into the logits with ``inplace_backward``); fp32 arithmetic. Under
torch.compile the same kernels run as the torch ops ``cuflash::cross_entropy_fwd`` /
``cross_entropy_bwd`` / ``cross_entropy_bwd_``. Other tensors (CPU, float64, strided columns,
other label dtypes) and ``USE_KERNELS = False`` take the torch composition below, an
``autograd.Function`` whose forward and backward are torch operations in fp32 (float64 for
float64 logits).

Per row, with z = logits · logit_scale over the C classes (C = world size × the local vocab
with a ``process_group``), lse = logsumexp(z), s = label_smoothing, y = the row's label:

    loss   = lse - (1 - s) · z_y - s · sum(z) / C + z_loss,    z_loss = lse_square_scale · lse²
    dz     = softmax(z) · (1 + 2 · lse_square_scale · lse) - (1 - s) · onehot(y) - s / C
    dlogits = dloss · logit_scale · dz                          (in the logits' dtype)

Rows whose label is ``ignore_index`` get loss = z_loss = 0 and a zero gradient. A label outside
[0, C) (and not ``ignore_index``) drops the z_y term (loss = lse - s · mean(z) + z_loss), the
rule flash-attn's backward and its vocab-split forward follow (its single-process forward also
drops the (1 - s) · lse part there). ``z_loss`` is returned for logging and takes no gradient.
``process_group``: each rank holds its slice of the vocab (rank r: classes r·V .. r·V + V - 1 of
``logits``' V columns); the LSEs are all-gathered and the label terms all-reduced in the forward,
the backward needs no communication; every rank returns the same losses.
``precomputed_lse`` is used only when ``logit_scale == 1`` and ``label_smoothing == 0`` (as
flash-attn): the LSE of this rank's logits. ``inplace_backward=True`` writes the gradient into the
logits' storage and returns it, as flash-attn (no gradient buffer is allocated then).
The kernels need no temporaries beyond per-row fp32 values (and the gradient, unless in place).
The composition forms its fp32 temporaries ``CHUNK_BYTES`` (256 MiB) of rows at a time: the
extra memory is one chunk (plus the gradient, unless in place); it makes several torch passes
over the logits (session 26, H100, 4096 × 128256 bf16, forward + backward: 14.0 ms against
``F.cross_entropy``'s 4.2 ms on the bf16 logits).

Differences (on the accepting side): CPU tensors, float64 logits (losses in float64 then; fp32
otherwise, as flash-attn), any vocab size. Bad arguments raise ``ValueError`` naming the argument.
"""
from __future__ import annotations

from numbers import Integral
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .. import cross_entropy as _ce

__all__ = ["cross_entropy_loss", "CrossEntropyLoss", "CrossEntropyLossFunction"]


def _compute_dtype(logits):
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _split(process_group):
    if process_group is None:
        return 1, 0
    return dist.get_world_size(process_group), dist.get_rank(process_group)


# The fp32 temporaries (the log-softmax in the forward, the softmax in the backward) are formed
# one chunk of rows at a time (CHUNK_BYTES of fp32 each), so the extra memory is one chunk plus
# the gradient (written chunk by chunk into its output: the logits themselves with
# inplace_backward). Chunks of 256 MiB measured 3-4% slower than one whole-tensor pass on the
# H100 at 4096 x 128256 bf16, at 1.5 against 5 GiB peak (logs/session26_api11/round3, round4).
CHUNK_BYTES = 256 << 20


def _log_softmax_fp(zc, scale, cdt):
    """log_softmax(zc · scale) in cdt."""
    if scale == 1.0:   # (torch 2.11 converts a bf16 input to fp32 first; fp16 goes straight in)
        return torch.log_softmax(zc, -1, dtype=cdt)
    return torch.log_softmax(zc.to(cdt) * scale, dim=-1)


def _softmax_fp(zc, scale, cdt):
    """softmax(zc · scale) in cdt."""
    if scale == 1.0:
        return torch.softmax(zc, -1, dtype=cdt)
    return torch.softmax(zc.to(cdt) * scale, dim=-1)


def _row_chunks(n_rows: int, n_cols: int):
    step = max(1, CHUNK_BYTES // (4 * max(n_cols, 1)))
    return [(r, min(r + step, n_rows)) for r in range(0, n_rows, step)]


# False: CUDA tensors take the torch composition too (the timing scripts compare the two).
USE_KERNELS = True
# Test hook: True sends CPU tensors through the kernel route too (the torch ops, whose CPU impls
# run cuflash.cross_entropy's float64 reference), so its plumbing is tested without a GPU.
OPS_ROUTE_ON_CPU = False


def _kernel_route(logits, labels) -> bool:
    if not USE_KERNELS:
        return False
    return _ce.kernel_takes(logits, labels) or (OPS_ROUTE_ON_CPU and not logits.is_cuda)


def _kernel_fwd(*args):
    if torch.compiler.is_compiling():
        return torch.ops.cuflash.cross_entropy_fwd(*args)
    return _ce.forward(*args)


def _kernel_bwd(grad_loss, logits, *args, inplace):
    if torch.compiler.is_compiling():
        if inplace:
            torch.ops.cuflash.cross_entropy_bwd_(grad_loss, logits, *args)
            return logits
        return torch.ops.cuflash.cross_entropy_bwd(grad_loss, logits, *args)
    return _ce.backward(grad_loss, logits, *args, inplace)


class CrossEntropyLossFunction(torch.autograd.Function):
    """flash-attn's ``CrossEntropyLoss`` autograd.Function: ``apply(logits, labels,
    precomputed_lse, smoothing, logit_scale, lse_square_scale, ignore_index, inplace_backward,
    process_group)`` → ``(losses, z_losses)``. CUDA logits the kernels take (``cuflash.cross_entropy``)
    run them; other tensors the torch composition."""

    @staticmethod
    def forward(ctx, logits, labels, precomputed_lse=None, smoothing=0.0, logit_scale=1.0, lse_square_scale=0.0,
                ignore_index=-100, inplace_backward=False, process_group=None):
        cdt = _compute_dtype(logits)
        n_rows, n_cols = logits.shape
        world, rank = _split(process_group)
        total_classes = world * n_cols
        kernel = _kernel_route(logits, labels)
        use_pre = precomputed_lse is not None and logit_scale == 1.0 and smoothing == 0.0
        loss = z_loss = lse_local = None
        if kernel and not use_pre:
            # one pass over the logits: this rank's lse and label / smoothing terms (and, on one
            # rank, the losses)
            loss, z_loss, lse, part = _kernel_fwd(logits, labels, smoothing, logit_scale, lse_square_scale,
                                                  ignore_index, rank * n_cols, total_classes)
        else:
            local = labels.long() - rank * n_cols
            in_range = (local >= 0) & (local < n_cols)
            index = torch.where(in_range, local, 0).unsqueeze(1)
            # whole-tensor reductions on the logits as they are (exact values), scaled after (scale > 0)
            z_label = logits.gather(1, index).squeeze(1).to(cdt) * logit_scale
            z_sum = logits.sum(dim=-1, dtype=cdt) * logit_scale if smoothing > 0.0 else None
            if use_pre:
                lse = precomputed_lse.to(cdt)
            else:
                # lse = max(z) - max(log_softmax(z)): the second term lies in [-log V, 0], so the
                # rounding stays at the LSE's own scale; log_softmax in cdt, one row chunk at a time
                lp_max = []
                for r0, r1 in _row_chunks(n_rows, n_cols):
                    lp = _log_softmax_fp(logits[r0:r1], logit_scale, cdt)
                    lp_max.append(lp.amax(dim=-1))
                    del lp
                lse = lse_local = logits.amax(dim=-1).to(cdt) * logit_scale - torch.cat(lp_max)
            part = -(1.0 - smoothing) * torch.where(in_range, z_label, 0.0)
            if z_sum is not None:
                part = part - smoothing * z_sum / total_classes
        if world > 1:
            # the global LSE from every rank's (local) LSE; the label / smoothing terms summed
            lses = [torch.empty_like(lse) for _ in range(world)]
            dist.all_gather(lses, lse.contiguous(), group=process_group)
            lse = torch.logsumexp(torch.stack(lses), dim=0)
            dist.all_reduce(part, op=dist.ReduceOp.SUM, group=process_group)
            loss = None
        if loss is None:
            ignored = labels == ignore_index
            z_loss = torch.where(ignored, 0.0, lse_square_scale * lse.square())
            loss = torch.where(ignored, 0.0, lse + part + z_loss)
        # the backward normalizes p by lse (all ranks' LSE, or the given one); the composition's
        # softmax by lse_local
        ctx.save_for_backward(logits, lse, labels, None if kernel else lse_local)
        ctx.mark_non_differentiable(z_loss)
        ctx.smoothing, ctx.logit_scale, ctx.lse_square_scale = smoothing, logit_scale, lse_square_scale
        ctx.ignore_index, ctx.total_classes, ctx.class_start = ignore_index, total_classes, rank * n_cols
        ctx.inplace_backward, ctx.kernel = inplace_backward, kernel
        return loss, z_loss

    @staticmethod
    def backward(ctx, grad_loss, grad_z_loss):
        del grad_z_loss  # z_loss is for logging only
        logits, lse, labels, lse_local = ctx.saved_tensors
        if ctx.kernel:
            dlogits = _kernel_bwd(grad_loss, logits, lse, labels, ctx.smoothing, ctx.logit_scale,
                                  ctx.lse_square_scale, ctx.ignore_index, ctx.class_start, ctx.total_classes,
                                  inplace=ctx.inplace_backward)
            return dlogits, None, None, None, None, None, None, None, None
        cdt = lse.dtype
        n_rows, n_cols = logits.shape
        scale = ctx.logit_scale
        # dlogits = c · (p · (1 + 2 · lse_square_scale · lse) - (1 - s) · onehot - s / C), p = exp(z - lse),
        # c = dloss · logit_scale (0 on ignored rows)
        c = torch.where(labels == ctx.ignore_index, 0.0, grad_loss.to(cdt)) * scale
        factor = c * (1.0 + 2.0 * ctx.lse_square_scale * lse)
        if lse_local is not None:
            # p from torch's softmax of this rank's logits (normalized by lse_local): rescaled to lse
            factor = factor * torch.exp(lse_local - lse)
        flat = c * (ctx.smoothing / ctx.total_classes)
        local = labels.long() - ctx.class_start
        in_range = (local >= 0) & (local < n_cols)
        index = torch.where(in_range, local, 0).unsqueeze(1)
        hit = (1.0 - ctx.smoothing) * c * in_range.to(cdt)
        factor_col, neg_flat, neg_lse = factor.unsqueeze(1), (-flat).unsqueeze(1), (-lse).unsqueeze(1)
        dlogits = logits if ctx.inplace_backward else torch.empty_like(logits)
        for r0, r1 in _row_chunks(n_rows, n_cols):
            zc, rows = logits[r0:r1], slice(r0, r1)
            if lse_local is not None:
                p = _softmax_fp(zc, scale, cdt)
            else:      # precomputed_lse: exp(z - lse) with the given lse, as flash-attn
                p = torch.add(neg_lse[rows], zc, alpha=scale).exp_()
            # the label column in cdt first (p_y · factor - (1 - s) · c cancels when p_y is near 1)
            label_val = p.gather(1, index[rows]).squeeze(1) * factor[rows] - flat[rows] - hit[rows]
            # p · factor - s · c / C, rounded once into the gradient's dtype; then the label column
            torch.addcmul(neg_flat[rows], p, factor_col[rows], out=dlogits[rows])
            del p
            dlogits[rows].scatter_(1, index[rows], label_val.unsqueeze(1).to(dlogits.dtype))
        return dlogits, None, None, None, None, None, None, None, None


CrossEntropyLoss = CrossEntropyLossFunction   # flash-attn's name for the autograd.Function here


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor, precomputed_lse: Optional[torch.Tensor] = None,
                       label_smoothing: float = 0.0, logit_scale: float = 1.0, lse_square_scale: float = 0.0,
                       ignore_index=-100, inplace_backward: bool = False,
                       process_group=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """flash-attn's ``cross_entropy_loss``: logits (batch, vocab) — this rank's vocab slice with
    ``process_group`` —, labels (batch,) integer class ids. Returns ``(losses, z_losses)``, each
    (batch,), fp32 (float64 for float64 logits); see the module docstring for the formula."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a 2-D floating-point tensor (batch, vocab), got "
                         f"{getattr(logits, 'shape', type(logits).__name__)}")
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.is_complex() \
            or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got {getattr(labels, 'dtype', type(labels).__name__)}")
    if tuple(labels.shape) != (logits.shape[0],):
        raise ValueError(f"labels must have shape ({logits.shape[0]},) (one per logits row), got {tuple(labels.shape)}")
    if labels.device != logits.device:
        raise ValueError(f"labels are on {labels.device}, logits on {logits.device}")
    if logits.shape[1] == 0:
        raise ValueError("logits must have at least one class column")
    if not isinstance(logit_scale, (int, float)) or not logit_scale > 0.0:
        raise ValueError(f"logit_scale must be > 0, got {logit_scale!r}")
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if not isinstance(lse_square_scale, (int, float)) or lse_square_scale < 0.0:
        raise ValueError(f"lse_square_scale must be a float >= 0, got {lse_square_scale!r}")
    if not isinstance(ignore_index, Integral) or isinstance(ignore_index, bool) \
            or not -2 ** 63 <= int(ignore_index) < 2 ** 63:
        raise ValueError(f"ignore_index must be an int (int64 range), got {ignore_index!r}")
    if precomputed_lse is not None:
        if not isinstance(precomputed_lse, torch.Tensor) or tuple(precomputed_lse.shape) != (logits.shape[0],):
            raise ValueError(f"precomputed_lse must be a tensor of shape ({logits.shape[0]},), got "
                             f"{getattr(precomputed_lse, 'shape', type(precomputed_lse).__name__)}")
        if precomputed_lse.device != logits.device:
            raise ValueError(f"precomputed_lse is on {precomputed_lse.device}, logits on {logits.device}")
        if precomputed_lse.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"precomputed_lse must be float32 or float64 (an LSE in 16 bits loses the loss's "
                             f"precision), got {precomputed_lse.dtype}")
    if process_group is not None and not dist.is_initialized():
        raise ValueError("process_group is given but torch.distributed is not initialized")
    if process_group is None and not (torch.is_grad_enabled() and logits.requires_grad) \
            and (precomputed_lse is None or logit_scale != 1.0 or label_smoothing != 0.0) \
            and not torch.compiler.is_compiling() and _kernel_route(logits, labels):
        # nothing to differentiate: the kernel without autograd.Function's bookkeeping (host µs per call)
        loss, z_loss, _, _ = _kernel_fwd(logits, labels, float(label_smoothing), float(logit_scale),
                                         float(lse_square_scale), int(ignore_index), 0, logits.shape[1])
        return loss, z_loss
    return CrossEntropyLossFunction.apply(logits, labels, precomputed_lse, float(label_smoothing), float(logit_scale),
                                          float(lse_square_scale), int(ignore_index), bool(inplace_backward),
                                          process_group)
