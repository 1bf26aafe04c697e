"""flash-attn's ``flash_attn.ops.triton.mlp``: ``FusedDenseSqreluDense`` (fc1 → relu² → fc2, keys
``fc1``, ``fc2``) and ``fused_dense_sqrelu_dense_function(x, weight1, bias1, weight2, bias2,
checkpoint_lvl=0)``, run by ``cuflash.ops.fused_dense.fused_mlp_func`` with activation 'sqrelu'
(CUDA fp16 / bf16: fc1's bias in the cuBLASLt epilogue, relu² and its derivative with fc1's bias
gradient by ``kernels_cu/dense_act.cu``; elsewhere the torch composition). Differs on the
accepting side: ``bias1`` / ``bias2`` may be False (flash-attn asserts them), CPU tensors run."""
from __future__ import annotations

import torch.nn as nn

from ..fused_dense import check_mlp_args, fused_mlp_func

__all__ = ["FusedDenseSqreluDenseFunc", "fused_dense_sqrelu_dense_function", "FusedDenseSqreluDense"]


class FusedDenseSqreluDenseFunc:
    """flash-attn's autograd Function name: ``FusedDenseSqreluDenseFunc.apply(x, weight1, bias1,
    weight2, bias2, checkpoint_lvl=0)`` (``cuflash.ops.fused_dense.FusedMLPFunc`` with 'sqrelu')."""

    @staticmethod
    def apply(x, weight1, bias1, weight2, bias2, checkpoint_lvl=0):
        return fused_mlp_func(x, weight1, weight2, bias1, bias2, activation="sqrelu", checkpoint_lvl=checkpoint_lvl,
                              heuristic=-1)


fused_dense_sqrelu_dense_function = FusedDenseSqreluDenseFunc.apply


class FusedDenseSqreluDense(nn.Module):
    """flash-attn's ``FusedDenseSqreluDense(in_features, hidden_features=None, out_features=None,
    bias1=True, bias2=True, checkpoint_lvl=0)`` (hidden 4 × in by default)."""

    def __init__(self, in_features, hidden_features=None, out_features=None, bias1=True, bias2=True,
                 checkpoint_lvl=0, device=None, dtype=None):
        super().__init__()
        check_mlp_args("sqrelu", checkpoint_lvl, -1)
        factory = dict(device=device, dtype=dtype)
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features * 4
        self.checkpoint_lvl = checkpoint_lvl
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias1, **factory)
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias2, **factory)

    def forward(self, x):
        return fused_dense_sqrelu_dense_function(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias,
                                                 self.checkpoint_lvl)
