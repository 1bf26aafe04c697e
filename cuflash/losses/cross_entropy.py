"""``flash_attn.losses.cross_entropy.CrossEntropyLoss`` → ``cuflash.losses.cross_entropy``: the
module over ``cuflash.ops.cross_entropy.cross_entropy_loss`` (fused CUDA kernels on CUDA tensors, a
torch composition on the others; see there for the formula), with flash-attn 2.8's constructor arguments, forward and reductions."""
from __future__ import annotations

import torch.nn as nn

from ..api import UnsupportedFeature
from ..ops.cross_entropy import cross_entropy_loss

__all__ = ["CrossEntropyLoss"]


class CrossEntropyLoss(nn.Module):
    """flash-attn's ``CrossEntropyLoss(ignore_index=-100, reduction="mean", label_smoothing=0.0,
    logit_scale=1.0, lse_square_scale=0.0, inplace_backward=False, process_group=None,
    return_z_loss=False)``. ``forward(input, target, precomputed_lse=None)``: input (batch, vocab)
    (this rank's vocab slice with ``process_group``), target (batch,). Returns the loss ("none":
    per row; "sum"; "mean": the sum over the rows whose target is not ``ignore_index`` divided by
    their count, NaN when every row is ignored, as flash-attn), and with ``return_z_loss`` the z-loss
    part reduced the same way (for logging: no gradient). Other reductions raise
    ``cuflash.UnsupportedFeature`` (a ``NotImplementedError``, as flash-attn raises) naming
    ``reduction``. Unlike flash-attn, CPU tensors are accepted."""

    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0, logit_scale=1.0, lse_square_scale=0.0,
                 inplace_backward=False, process_group=None, return_z_loss=False):
        super().__init__()
        if reduction not in ("mean", "none", "sum"):
            raise UnsupportedFeature(f"reduction must be 'mean', 'none' or 'sum', got {reduction!r}")
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.logit_scale = logit_scale
        self.lse_square_scale = lse_square_scale
        self.inplace_backward = inplace_backward
        self.process_group = process_group
        self.return_z_loss = return_z_loss

    def _reduce(self, losses, target):
        if self.reduction == "mean":
            return losses.sum() / (target != self.ignore_index).sum()
        if self.reduction == "sum":
            return losses.sum()
        return losses

    def forward(self, input, target, precomputed_lse=None):
        loss, z_loss = cross_entropy_loss(input, target, precomputed_lse=precomputed_lse,
                                          label_smoothing=self.label_smoothing, logit_scale=self.logit_scale,
                                          lse_square_scale=self.lse_square_scale, ignore_index=self.ignore_index,
                                          inplace_backward=self.inplace_backward, process_group=self.process_group)
        loss = self._reduce(loss, target)
        if not self.return_z_loss:
            return loss
        return loss, self._reduce(z_loss, target)
