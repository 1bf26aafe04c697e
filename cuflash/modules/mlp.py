"""MLP modules with flash-attn 2.8's names, constructor arguments, forwards and state-dict keys
(``fc1``, ``fc2``): ``from flash_attn.modules.mlp import Mlp`` becomes ``from cuflash.modules.mlp
import Mlp``. Plain torch (``nn.Linear`` and the activation), not fused kernels.

* ``Mlp``: fc1 → activation → fc2 (hidden 4 × in by default).
* ``GatedMlp``: fc1 to 2 × hidden (hidden = 8/3 × in rounded up to ``multiple_of``), y, gate =
  the two halves, y · activation(gate) (``F.sigmoid``: ``F.glu``; ``F.silu``: ``swiglu`` in fp32,
  as flash-attn), fc2.
* ``FusedMLP``: flash-attn's ``flash_attn.ops.fused_dense.FusedMLP`` (which its mlp module
  imports) with its arguments and keys, run as fc1 → ``activation`` ('gelu_approx': tanh GELU,
  'relu', 'sqrelu': relu²) → fc2 in torch; ``checkpoint_lvl`` and ``heuristic`` are validated and
  otherwise unused (they pick fused cuBLASLt epilogues / recomputation in flash-attn: the outputs
  are the same). ``forward(x, process_group=...)`` (flash-attn's tensor-parallel reduce-scatter)
  raises ``cuflash.UnsupportedFeature`` naming ``process_group``.

Not provided: ``ParallelMLP``, ``ParallelGatedMlp`` (they need the tensor-parallel linears
``ColumnParallelLinear`` / ``RowParallelLinear``)."""
from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from ..api import UnsupportedFeature
from ..ops.activations import sqrelu_fwd, swiglu

__all__ = ["Mlp", "GatedMlp", "FusedMLP"]


class Mlp(nn.Module):
    """flash-attn's ``Mlp(in_features, hidden_features=None, out_features=None,
    activation=F.gelu, bias1=True, bias2=True, return_residual=False)``; forward returns y, or
    (y, x) with ``return_residual``."""

    def __init__(self, in_features, hidden_features=None, out_features=None, activation=F.gelu, bias1=True,
                 bias2=True, return_residual=False, device=None, dtype=None):
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        out_features = out_features if out_features is not None else in_features
        hidden_features = hidden_features if hidden_features is not None else in_features * 4
        self.return_residual = return_residual
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias1, **factory)
        self.activation = activation
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias2, **factory)

    def forward(self, x):
        y = self.fc2(self.activation(self.fc1(x)))
        return (y, x) if self.return_residual else y


class GatedMlp(nn.Module):
    """flash-attn's ``GatedMlp(in_features, hidden_features=None, out_features=None,
    activation=F.sigmoid, bias1=True, bias2=True, multiple_of=256, return_residual=False)``."""

    def __init__(self, in_features, hidden_features=None, out_features=None, activation=F.sigmoid, bias1=True,
                 bias2=True, multiple_of=256, return_residual=False, device=None, dtype=None):
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        if not isinstance(multiple_of, int) or multiple_of < 1:
            raise ValueError(f"multiple_of must be an int >= 1, got {multiple_of!r}")
        out_features = out_features if out_features is not None else in_features
        hidden_features = hidden_features if hidden_features is not None else int(8 * in_features / 3)
        hidden_features = (hidden_features + multiple_of - 1) // multiple_of * multiple_of
        self.return_residual = return_residual
        self.fc1 = nn.Linear(in_features, 2 * hidden_features, bias=bias1, **factory)
        self.activation = activation
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias2, **factory)

    def forward(self, x):
        y = self.fc1(x)
        if self.activation is F.sigmoid:          # GLU: first half · sigmoid(second half)
            y = F.glu(y, dim=-1)
        else:
            y, gate = y.chunk(2, dim=-1)
            y = swiglu(gate, y) if self.activation is F.silu else y * self.activation(gate)
        y = self.fc2(y)
        return (y, x) if self.return_residual else y


_FUSED_ACTIVATIONS = {"gelu_approx": lambda t: F.gelu(t, approximate="tanh"), "relu": F.relu, "sqrelu": sqrelu_fwd}


class FusedMLP(nn.Module):
    """flash-attn's ``FusedMLP(in_features, hidden_features, out_features=None, bias1=True,
    bias2=True, activation='gelu_approx', return_residual=False, checkpoint_lvl=0,
    heuristic='auto')`` in torch (see the module docstring)."""

    def __init__(self, in_features, hidden_features, out_features=None, bias1=True, bias2=True,
                 activation="gelu_approx", return_residual=False, checkpoint_lvl=0, heuristic="auto", device=None,
                 dtype=None):
        super().__init__()
        if checkpoint_lvl not in (0, 1, 2):
            raise ValueError(f"checkpoint_lvl must be 0, 1 or 2, got {checkpoint_lvl!r}")
        if activation not in _FUSED_ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_FUSED_ACTIVATIONS)}, got {activation!r}")
        if not (heuristic == "auto" or (isinstance(heuristic, int) and -1 <= heuristic <= 4)):
            raise ValueError(f"heuristic must be 'auto' or an int in -1..4, got {heuristic!r}")
        factory = dict(device=device, dtype=dtype)
        out_features = out_features if out_features is not None else in_features
        self.activation = activation
        self.return_residual = return_residual
        self.checkpoint_lvl = checkpoint_lvl
        self.heuristic = heuristic if activation != "sqrelu" else -1
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias1, **factory)
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias2, **factory)

    def forward(self, x, process_group=None):
        if process_group is not None:
            raise UnsupportedFeature("FusedMLP: process_group (tensor-parallel reduce-scatter) is not supported; "
                                     "call it with process_group=None")
        y = self.fc2(_FUSED_ACTIVATIONS[self.activation](self.fc1(x)))
        return (y, x) if self.return_residual else y
