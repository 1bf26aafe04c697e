"""flash-attn's ``flash_attn.ops.activations`` names as torch compositions (flash-attn: TorchScript
and a jiterator kernel): the tanh-approximate GELU (``gelu_fwd``, ``gelu_bwd``,
``fast_gelu_impl``, ``bias_gelu_impl``), squared ReLU (``sqrelu_fwd``, ``sqrelu_bwd``,
``relu_bwd``) and ``swiglu(x, y) = silu(x) · y`` (computed in fp32, rounded once to x's dtype, as
flash-attn's kernel). The ``*_impl`` / ``swiglu`` functions take autograd through torch's
operations; ``*_bwd`` are the explicit derivatives flash-attn exports."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["gelu_fwd", "gelu_bwd", "fast_gelu_impl", "bias_gelu_impl", "relu_bwd", "sqrelu_fwd", "sqrelu_bwd",
           "swiglu"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def gelu_fwd(x):
    """GELU, tanh approximation: x/2 · (1 + tanh(sqrt(2/π) · (x + 0.044715 x³)))."""
    return F.gelu(x, approximate="tanh")


def gelu_bwd(g, x):
    """g · d/dx of ``gelu_fwd`` at x, in x's dtype."""
    xf = x.float() if x.dtype != torch.float64 else x
    inner = _SQRT_2_OVER_PI * (xf + 0.044715 * xf ** 3)
    t = torch.tanh(inner)
    d = 0.5 * (1.0 + t) + 0.5 * xf * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * xf * xf)
    return (d * g).to(x.dtype)


def fast_gelu_impl(x):
    """``gelu_fwd`` with autograd."""
    return gelu_fwd(x)


def bias_gelu_impl(y, bias):
    """``gelu_fwd(y + bias)`` with autograd (bias (D,) broadcast over y's last dim)."""
    return gelu_fwd(y + bias).to(y.dtype)


def relu_bwd(g, x):
    """g where x >= 0, else 0, in x's dtype."""
    return torch.where(x >= 0, g, 0.0).to(x.dtype)


def sqrelu_fwd(x):
    """Squared ReLU: relu(x)²."""
    r = F.relu(x)
    return (r * r).to(x.dtype)


def sqrelu_bwd(g, x):
    """g · 2 relu(x), in x's dtype."""
    return (2.0 * g * F.relu(x)).to(x.dtype)


def swiglu(x, y):
    """silu(x) · y, formed in fp32 (float64 for float64) and rounded once to x's dtype; autograd."""
    cdt = torch.float64 if torch.float64 in (x.dtype, y.dtype) else torch.float32
    return (F.silu(x.to(cdt)) * y.to(cdt)).to(x.dtype)
