"""flash-attn's ``flash_attn.ops.triton.linear``: ``triton_linear_act`` (activation(x Wᵀ + b), the
pre-activation optionally returned) and ``triton_dgrad_act`` ((dout W) · act'(act_input)), the
same arguments, without Triton. CUDA fp16 / bf16 with 'gelu_approx' or 'squared_relu' run the fused
MLP's pieces (``cuflash.ops.fused_dense``: fc1 with the bias in the cuBLASLt epilogue, the
activation or its derivative by ``kernels_cu/dense_act.cu``; 'gelu_approx' without
``save_act_input`` in the GEMM's epilogue); other calls ('id', 'gelu', CPU, fp32) the torch
formulas of ``cuflash.ops.triton.k_activations``."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .. import fused_dense
from . import k_activations

__all__ = ["triton_linear_act", "triton_dgrad_act"]

_NAMES = ("id", "gelu", "gelu_approx", "squared_relu")
_KERNEL_NAMES = {"gelu_approx": "gelu_approx", "squared_relu": "sqrelu"}


def _up(t):
    """fp32 arithmetic for 16-bit tensors (float64 stays)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _check(activation):
    if activation not in _NAMES:
        raise ValueError(f"activation must be one of {list(_NAMES)}, got {activation!r}")


def _kernel_takes(t: torch.Tensor, activation: str) -> bool:
    return activation in _KERNEL_NAMES and t.is_cuda and t.dtype in (torch.float16, torch.bfloat16)


def triton_linear_act(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                      activation: str = "id", save_act_input: bool = False):
    """activation(x Wᵀ + b) for x (..., in), weight (out, in); with save_act_input also x Wᵀ + b.
    No autograd of its own (flash-attn's neither)."""
    _check(activation)
    fused_dense._check_linear(x, weight, bias)
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"weight and bias must have x's dtype {x.dtype}, got {weight.dtype} and "
                         f"{None if bias is None else bias.dtype}")
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    with torch.no_grad():
        if _kernel_takes(x, activation):
            pre, out = fused_dense._fc1_act(x2d.contiguous(), weight.contiguous(), bias, _KERNEL_NAMES[activation],
                                            0, keep_pre=save_act_input)
        else:
            pre = F.linear(x2d, weight, bias)
            act = k_activations.get_triton_activation_kernel(activation if activation != "id" else None)
            out = pre if act is None else act(_up(pre)).to(pre.dtype)
    out = out.reshape(*lead, out.shape[-1])
    return (out, pre.reshape(*lead, pre.shape[-1])) if save_act_input else out


def triton_dgrad_act(grad_output: torch.Tensor, weight: torch.Tensor, activation: str = "id",
                     act_input: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(grad_output W) · act'(act_input) for grad_output (..., out), weight (out, in), act_input
    (..., in) (required unless activation is 'id')."""
    _check(activation)
    if weight.dim() != 2 or grad_output.shape[-1] != weight.shape[0]:
        raise ValueError(f"grad_output's last dimension ({grad_output.shape[-1]}) must equal weight.shape[0] "
                         f"({weight.shape[0] if weight.dim() == 2 else weight.shape})")
    if grad_output.dtype != weight.dtype:
        raise ValueError(f"grad_output and weight must have the same dtype, got {grad_output.dtype} and {weight.dtype}")
    lead = grad_output.shape[:-1]
    if activation != "id" and (act_input is None or tuple(act_input.shape) != (*lead, weight.shape[1])):
        raise ValueError(f"act_input must be a tensor of shape {(*lead, weight.shape[1])} for activation "
                         f"{activation!r}, got {None if act_input is None else tuple(act_input.shape)}")
    with torch.no_grad():
        g = grad_output.reshape(-1, grad_output.shape[-1]) @ weight
        if activation == "id":
            d = g
        elif _kernel_takes(g, activation) and act_input.dtype == g.dtype:
            d, _ = fused_dense._act_bwd(g, act_input.reshape(g.shape), _KERNEL_NAMES[activation], False)
        else:
            grad_fn = k_activations.get_triton_activation_bwd_kernel(activation)
            d = (_up(g) * grad_fn(_up(act_input.reshape(g.shape)))).to(g.dtype)
    return d.reshape(*lead, d.shape[-1])
