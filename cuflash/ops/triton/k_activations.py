"""flash-attn's ``flash_attn.ops.triton.k_activations`` names as torch functions on tensors
(flash-attn's are Triton device functions, callable only inside its Triton kernels): the
activations and their derivative factors, in the tensor's dtype. ``*_grad(x)`` is the factor
d act / dx at x (to be multiplied by the incoming gradient), as flash-attn's: ``relu_grad`` and
``squared_relu_grad`` take x >= 0 as the active side, ``leaky_relu`` slope 0.01.
``get_triton_activation_kernel`` / ``get_triton_activation_bwd_kernel`` map an ``Activation``
(or its string) to them."""
from __future__ import annotations

import math
from enum import Enum
from typing import Optional

import torch

__all__ = ["Activation", "get_triton_activation_kernel", "get_triton_activation_bwd_kernel", "tanh", "cosh", "relu",
           "relu_grad", "squared_relu", "squared_relu_grad", "leaky_relu", "leaky_relu_grad", "gelu", "gelu_grad",
           "gelu_approx", "gelu_approx_grad"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


class Activation(str, Enum):
    SquaredReLU = "squared_relu"
    GeLU = "gelu"
    GeLUApprox = "gelu_approx"
    LeakyReLU = "leaky_relu"
    ReLU = "relu"


def tanh(x):
    return torch.tanh(x)


def cosh(x):
    return torch.cosh(x)


def relu(x):
    return torch.where(x >= 0, x, torch.zeros_like(x))


def relu_grad(x):
    return (x >= 0).to(x.dtype)


def squared_relu(x):
    r = relu(x)
    return r * r


def squared_relu_grad(x):
    return torch.where(x >= 0, 2.0 * x, torch.zeros_like(x))


def leaky_relu(x):
    return torch.where(x >= 0, x, 0.01 * x)


def leaky_relu_grad(x):
    return torch.where(x >= 0, torch.ones_like(x), torch.full_like(x, 0.01))


def gelu(x):
    """The exact (erf) GELU."""
    return x * 0.5 * (1.0 + torch.erf(x * _SQRT_HALF))


def gelu_grad(x):
    return 0.5 * (1.0 + torch.erf(x * _SQRT_HALF)) + x * torch.exp(-0.5 * x * x) * _INV_SQRT_2PI


def gelu_approx(x):
    """The tanh GELU: 0.5 x (1 + tanh(√(2/π) x (1 + 0.044715 x²)))."""
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * x * (1.0 + 0.044715 * x * x)))


def gelu_approx_grad(x):
    t = torch.tanh(_SQRT_2_OVER_PI * x * (1.0 + 0.044715 * x * x))
    return 0.5 * x * (1.0 - t * t) * (_SQRT_2_OVER_PI + 3 * 0.044715 * _SQRT_2_OVER_PI * x * x) + 0.5 * (1.0 + t)


_FWD = {Activation.ReLU: relu, Activation.LeakyReLU: leaky_relu, Activation.GeLU: gelu,
        Activation.GeLUApprox: gelu_approx, Activation.SquaredReLU: squared_relu}
_BWD = {Activation.ReLU: relu_grad, Activation.LeakyReLU: leaky_relu_grad, Activation.GeLU: gelu_grad,
        Activation.GeLUApprox: gelu_approx_grad, Activation.SquaredReLU: squared_relu_grad}


def _lookup(table, activation):
    if not activation:
        return None
    try:
        return table[Activation(activation)]
    except ValueError:
        raise ValueError(f"activation must be one of {[a.value for a in Activation]} or None, "
                         f"got {activation!r}") from None


def get_triton_activation_kernel(activation: Optional[Activation]):
    """The activation function of ``activation`` (None: None)."""
    return _lookup(_FWD, activation)


def get_triton_activation_bwd_kernel(activation: Optional[Activation]):
    """The derivative factor of ``activation`` (None: None)."""
    return _lookup(_BWD, activation)
