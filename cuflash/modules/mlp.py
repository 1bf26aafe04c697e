"""MLP modules with flash-attn 2.8's names, constructor arguments, forwards and state-dict keys
(``fc1``, ``fc2``): ``from flash_attn.modules.mlp import Mlp`` becomes ``from cuflash.modules.mlp
import Mlp``. Plain torch (``nn.Linear`` and the activation) but for the ``Fused`` forms.

* ``Mlp``: fc1 → activation → fc2 (hidden 4 × in by default).
* ``GatedMlp``: fc1 to 2 × hidden (hidden = 8/3 × in rounded up to ``multiple_of``), y, gate =
  the two halves, y · activation(gate) (``F.sigmoid``: ``F.glu``; ``F.silu``: ``swiglu`` in fp32,
  as flash-attn), fc2.
* ``FusedMLP``: flash-attn's ``flash_attn.ops.fused_dense.FusedMLP`` (which its mlp module
  imports) with its arguments and keys: fc1 → ``activation`` ('gelu_approx': tanh GELU, 'relu',
  'sqrelu': relu²) → fc2 through ``cuflash.ops.fused_dense.fused_mlp_func`` (CUDA fp16 / bf16:
  the bias and, where the pre-activation is not kept, the activation in fc1's cuBLASLt epilogue,
  ``kernels_cu/dense_act.cu`` for the activation and, backward, its derivative fused with fc1's
  bias gradient; ``checkpoint_lvl`` 0 / 1 / 2 as flash-attn's; ``save_pre_act`` = training);
  ``forward(x, process_group=...)``: flash-attn's tensor-parallel form (x's rows all-gathered,
  the output reduce-scattered).

Tensor-parallel forms (flash-attn's arguments and keys; fc1 a ``ColumnParallelLinear``, fc2 a
``RowParallelLinear`` of ``cuflash.ops.fused_dense``, so the same collectives and the same
``sequence_parallel`` layout as ``ParallelMHA``; a required ``process_group``):

* ``ParallelMLP``: ``Mlp``'s forward on this rank's hidden units, no ``return_residual``.
* ``ParallelGatedMlp``: ``GatedMlp``'s hidden size (``multiple_of``), each rank
  ``get_dim_for_local_rank(hidden, P, rank)`` hidden units: fc1 holds the rank's rows of y then
  the same rows of the gate (flash-attn's ``shard_state_dict_tp`` layout, hidden / P each where P
  divides hidden, as flash-attn requires; other splits work here too), fc2 the same columns.
* ``ParallelFusedMLP`` (flash-attn's ``flash_attn.ops.fused_dense`` name): ``ParallelMLP``'s
  shards and keys with ``FusedMLP``'s string activations, ``checkpoint_lvl`` and ``heuristic``,
  run by ``fused_mlp_func`` over the process group."""
from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..ops import fused_dense
from ..ops.activations import swiglu
from ..ops.fused_dense import ColumnParallelLinear, RowParallelLinear, check_mlp_args, fused_mlp_func
from ..utils.distributed import all_reduce, reduce_scatter

__all__ = ["Mlp", "ParallelMLP", "GatedMlp", "ParallelGatedMlp", "FusedMLP", "ParallelFusedMLP"]


def _check_group(process_group, cls: str, hidden_features: int) -> None:
    if process_group is None:
        raise ValueError(f"{cls}: process_group must be a torch.distributed process group, got None")
    world = dist.get_world_size(process_group)
    if hidden_features < world:
        raise ValueError(f"{cls}: hidden_features = {hidden_features} is smaller than the process group's size "
                         f"({world}): a rank would hold no hidden unit")


def _gated_hidden(in_features, hidden_features, multiple_of) -> int:
    """GatedMlp's hidden size: 8/3 x in_features by default, rounded up to multiple_of."""
    if not isinstance(multiple_of, int) or multiple_of < 1:
        raise ValueError(f"multiple_of must be an int >= 1, got {multiple_of!r}")
    hidden_features = hidden_features if hidden_features is not None else int(8 * in_features / 3)
    return (hidden_features + multiple_of - 1) // multiple_of * multiple_of


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


class ParallelMLP(nn.Module):
    """flash-attn's ``ParallelMLP(in_features, hidden_features=None, out_features=None,
    activation=F.gelu, process_group=None, sequence_parallel=True, bias1=True, bias2=True)``:
    ``Mlp`` over a process group (this rank's hidden units; see the module docstring)."""

    def __init__(self, in_features, hidden_features=None, out_features=None, activation=F.gelu, process_group=None,
                 sequence_parallel=True, bias1=True, bias2=True, device=None, dtype=None):
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        out_features = out_features if out_features is not None else in_features
        hidden_features = hidden_features if hidden_features is not None else in_features * 4
        _check_group(process_group, type(self).__name__, hidden_features)
        self.return_residual = False   # Mlp's forward; flash-attn's parallel MLPs return the output alone
        self.fc1 = ColumnParallelLinear(in_features, hidden_features, process_group, bias=bias1,
                                        sequence_parallel=sequence_parallel, **factory)
        self.activation = activation
        self.fc2 = RowParallelLinear(hidden_features, out_features, process_group, bias=bias2,
                                     sequence_parallel=sequence_parallel, **factory)

    forward = Mlp.forward


class GatedMlp(nn.Module):
    """flash-attn's ``GatedMlp(in_features, hidden_features=None, out_features=None,
    activation=F.sigmoid, bias1=True, bias2=True, multiple_of=128, return_residual=False)``."""

    def __init__(self, in_features, hidden_features=None, out_features=None, activation=F.sigmoid, bias1=True,
                 bias2=True, multiple_of=128, return_residual=False, device=None, dtype=None):
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        out_features = out_features if out_features is not None else in_features
        hidden_features = _gated_hidden(in_features, hidden_features, multiple_of)
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


class ParallelGatedMlp(nn.Module):
    """flash-attn's ``ParallelGatedMlp(in_features, process_group, hidden_features=None,
    out_features=None, activation=F.sigmoid, bias1=True, bias2=True, multiple_of=128,
    sequence_parallel=True)``: ``GatedMlp`` over a process group (see the module docstring)."""

    def __init__(self, in_features, process_group, hidden_features=None, out_features=None, activation=F.sigmoid,
                 bias1=True, bias2=True, multiple_of=128, sequence_parallel=True, device=None, dtype=None):
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        out_features = out_features if out_features is not None else in_features
        hidden_features = _gated_hidden(in_features, hidden_features, multiple_of)
        _check_group(process_group, type(self).__name__, hidden_features)
        self.return_residual = False
        # fc1's 2 * hidden rows split in units of 2: 2 x the rank's share of hidden (its y rows, then
        # its gate rows, which the forward's halves pick); fc2 the same share of its columns
        self.fc1 = ColumnParallelLinear(in_features, 2 * hidden_features, process_group, bias=bias1,
                                        sequence_parallel=sequence_parallel, multiple_of=2, **factory)
        self.activation = activation
        self.fc2 = RowParallelLinear(hidden_features, out_features, process_group, bias=bias2,
                                     sequence_parallel=sequence_parallel, **factory)

    forward = GatedMlp.forward


def _set_fused_args(module, activation, checkpoint_lvl, heuristic) -> None:
    """FusedMLP's / ParallelFusedMLP's checks and attributes (activation a name, as flash-attn's)."""
    check_mlp_args(activation, checkpoint_lvl, heuristic, allow_auto=True)
    module.activation = activation
    module.checkpoint_lvl = checkpoint_lvl
    module.heuristic = heuristic if activation != "sqrelu" else -1


def _heuristic(module) -> int:
    return fused_dense.AUTO_HEURISTIC if module.heuristic == "auto" else module.heuristic


def _group(process_group):
    """None for no group or a one-rank group (no collective: fused_dense's ONE_RANK_SHORTCUT)."""
    return None if process_group is None or fused_dense._one_rank(process_group) else process_group


class FusedMLP(nn.Module):
    """flash-attn's ``FusedMLP(in_features, hidden_features, out_features=None, bias1=True,
    bias2=True, activation='gelu_approx', return_residual=False, checkpoint_lvl=0,
    heuristic='auto')``: ``cuflash.ops.fused_dense.fused_mlp_func`` (see the module docstring);
    ``forward(x, process_group=None)``: with a process group, this rank's shards of fc1's rows
    and fc2's columns, x's rows all-gathered first and the output reduce-scattered (flash-attn's)."""

    def __init__(self, in_features, hidden_features, out_features=None, bias1=True, bias2=True,
                 activation="gelu_approx", return_residual=False, checkpoint_lvl=0, heuristic="auto", device=None,
                 dtype=None):
        super().__init__()
        _set_fused_args(self, activation, checkpoint_lvl, heuristic)
        factory = dict(device=device, dtype=dtype)
        out_features = out_features if out_features is not None else in_features
        self.return_residual = return_residual
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias1, **factory)
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias2, **factory)

    def forward(self, x, process_group=None):
        group = _group(process_group)
        out = fused_mlp_func(x, self.fc1.weight, self.fc2.weight, self.fc1.bias, self.fc2.bias,
                             activation=self.activation, save_pre_act=self.training,
                             return_residual=self.return_residual, checkpoint_lvl=self.checkpoint_lvl,
                             heuristic=_heuristic(self), process_group=group)
        if self.return_residual:
            out, x = out
        if group is not None:
            out = reduce_scatter(out, group)
        return (out, x) if self.return_residual else out


class ParallelFusedMLP(ParallelMLP):
    """flash-attn's ``flash_attn.ops.fused_dense.ParallelFusedMLP(in_features,
    hidden_features=None, out_features=None, activation='gelu_approx', process_group=None,
    bias1=True, bias2=True, sequence_parallel=True, checkpoint_lvl=0, heuristic='auto')``:
    ``ParallelMLP``'s shards (fc1 a ``ColumnParallelLinear``, fc2 a ``RowParallelLinear``, same
    keys) run through ``fused_mlp_func`` (x all-gathered first with ``sequence_parallel``), the
    output reduce-scattered (``sequence_parallel``) or all-reduced."""

    def __init__(self, in_features, hidden_features=None, out_features=None, activation="gelu_approx",
                 process_group=None, bias1=True, bias2=True, sequence_parallel=True, checkpoint_lvl=0,
                 heuristic="auto", device=None, dtype=None):
        super().__init__(in_features, hidden_features, out_features, None, process_group, sequence_parallel,
                         bias1, bias2, device=device, dtype=dtype)
        _set_fused_args(self, activation, checkpoint_lvl, heuristic)
        self.process_group = process_group
        self.sequence_parallel = sequence_parallel

    def forward(self, x):
        group = _group(self.process_group)
        out = fused_mlp_func(x, self.fc1.weight, self.fc2.weight, self.fc1.bias, self.fc2.bias,
                             activation=self.activation, save_pre_act=self.training,
                             checkpoint_lvl=self.checkpoint_lvl, heuristic=_heuristic(self), process_group=group,
                             sequence_parallel=self.sequence_parallel)
        if group is None:
            return out
        return reduce_scatter(out, group) if self.sequence_parallel else all_reduce(out, group)
