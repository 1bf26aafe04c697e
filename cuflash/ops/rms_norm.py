"""flash-attn's older ``flash_attn.ops.rms_norm`` names (the ``dropout_layer_norm`` CUDA
extension's RMSNorm side) as torch compositions over ``cuflash.ops.layer_norm``: ``rms_norm``,
``dropout_add_rms_norm``, ``dropout_add_rms_norm_parallel_residual``, ``DropoutAddRMSNorm``, and
``RMSNorm`` (the module of ``cuflash.ops.layer_norm``: ``forward(x)`` is flash-attn's older
``RMSNorm.forward``; it also takes the residual arguments)."""
from __future__ import annotations

from .layer_norm import DropoutAddLayerNorm, RMSNorm, _old_dropout_add_norm, _old_parallel_residual

__all__ = ["rms_norm", "dropout_add_rms_norm", "dropout_add_rms_norm_parallel_residual", "DropoutAddRMSNorm",
           "RMSNorm"]


def rms_norm(x, weight, epsilon):
    """flash-attn's older ``rms_norm(x, weight, epsilon)``: x · rstd · weight, rstd = 1 / sqrt(mean(x²) + eps)."""
    return dropout_add_rms_norm(x, None, weight, None, 0.0, epsilon)


def dropout_add_rms_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale=None, layerscale=None,
                         prenorm=False, residual_in_fp32=False, return_dropout_mask=False):
    """flash-attn's older ``dropout_add_rms_norm``: ``dropout_add_layer_norm`` with RMSNorm."""
    return _old_dropout_add_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale, layerscale,
                                 prenorm, residual_in_fp32, return_dropout_mask, True)


def dropout_add_rms_norm_parallel_residual(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon,
                                           prenorm=False, residual_in_fp32=False, return_dropout_mask=False):
    """flash-attn's older ``dropout_add_rms_norm_parallel_residual``."""
    return _old_parallel_residual(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon, prenorm,
                                  residual_in_fp32, return_dropout_mask, True)


class DropoutAddRMSNorm(DropoutAddLayerNorm):
    """flash-attn's older ``DropoutAddRMSNorm(hidden_size, prenorm=False, p=0.0, eps=1e-5,
    residual_in_fp32=False)``: parameter ``weight``, ``bias`` registered as None."""

    _with_bias = False
    _norm_fn = staticmethod(dropout_add_rms_norm)
