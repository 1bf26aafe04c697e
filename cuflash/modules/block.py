"""Transformer blocks with flash-attn 2.8's names, constructor arguments, forwards and state-dict
keys (``mixer``, ``norm1``, ``mlp``, ``norm2``): ``from flash_attn.modules.block import Block``
becomes ``from cuflash.modules.block import Block``. Built on ``cuflash.modules.mha.MHA`` (the
default mixer), ``cuflash.modules.mlp.Mlp`` and ``cuflash.ops.layer_norm`` (the
``fused_dropout_add_ln`` path: one ``layer_norm_fn`` call, a torch composition).

* ``Block``, ``prenorm=True`` (flash-attn's layout): dropout → add → norm → mixer → dropout →
  add → norm → MLP; ``forward(hidden_states, residual=None, mixer_subset=None,
  mixer_kwargs=None)`` returns ``(hidden_states, residual)``; ``residual_in_fp32`` keeps the
  residual stream in fp32. ``prenorm=False``: mixer → dropout → add → norm → MLP → dropout →
  add → norm (``return_residual``: the mixer and MLP return (out, input)).
* ``ParallelBlock`` (GPT-J / NeoX / PaLM): mixer and MLP side by side on one normalized residual;
  ``forward(hidden_states1, hidden_states2=None, residual=None, mixer_kwargs=None)`` returns
  ``(hidden_states1, hidden_states2, residual)``; ``tied_norm`` shares norm1.
* ``StochasticDepth(p, mode)``: drop path (torchvision's semantics: "row" drops whole samples,
  "batch" the whole batch, survivors scaled by 1 / (1 - p)), here so that torchvision is not a
  dependency.

Difference: the ``fused_dropout_add_ln`` path passes a zero-centered ``RMSNorm``'s
``zero_centered_weight`` on (flash-attn's drops it there, so its fused and unfused paths differ
for such norms; here they agree).

Bad arguments raise ``ValueError`` (flash-attn asserts): ``residual_in_fp32`` with
``prenorm=False``; ``fused_dropout_add_ln`` with a norm other than ``nn.LayerNorm`` /
``RMSNorm`` or a dropout other than ``nn.Dropout``.
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from ..ops.layer_norm import RMSNorm, layer_norm_fn
from .mha import MHA
from .mlp import Mlp

__all__ = ["Block", "ParallelBlock", "StochasticDepth"]


class StochasticDepth(nn.Module):
    """Drop path: in training with p > 0, each sample ("row") or the whole batch ("batch") is
    zeroed with probability p and the survivors scaled by 1 / (1 - p); identity otherwise."""

    def __init__(self, p: float, mode: str):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"drop path probability p must be in [0, 1], got {p!r}")
        if mode not in ("row", "batch"):
            raise ValueError(f"mode must be 'row' or 'batch', got {mode!r}")
        self.p = p
        self.mode = mode

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        survival = 1.0 - self.p
        shape = [x.shape[0]] + [1] * (x.dim() - 1) if self.mode == "row" else [1] * x.dim()
        noise = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(survival)
        if survival > 0.0:
            noise.div_(survival)
        return x * noise

    def extra_repr(self) -> str:
        return f"p={self.p}, mode={self.mode}"


def _mark_norm_params(norms, sequence_parallel: bool, mark_shared_params: bool) -> None:
    # flash-attn's tags: _sequence_parallel (all-reduce the grads), _shared_params (sync at init)
    for norm in norms:
        for p in norm.parameters():
            if sequence_parallel:
                p._sequence_parallel = True
            if mark_shared_params:
                p._shared_params = True


def _check_fused(norm, dropout) -> None:
    if not isinstance(norm, (nn.LayerNorm, RMSNorm)):
        raise ValueError(f"fused_dropout_add_ln needs norm_cls to make nn.LayerNorm or "
                         f"cuflash.ops.layer_norm.RMSNorm modules, got {type(norm).__name__}")
    if not isinstance(dropout, nn.Dropout):
        raise ValueError(f"fused_dropout_add_ln needs dropout_cls to make nn.Dropout modules, got "
                         f"{type(dropout).__name__}")


def _drop_path_rowscale(drop_path: StochasticDepth, like: Tensor, training: bool):
    """The drop path of the fused path as layer_norm_fn's rowscale: one draw per sample."""
    if drop_path.p == 0 or not training:
        return None
    return drop_path(torch.ones(like.shape[:-1], device=like.device, dtype=like.dtype))


class Block(nn.Module):
    """flash-attn's ``Block(dim, mixer_cls=None, mlp_cls=None, norm_cls=nn.LayerNorm,
    dropout_cls=nn.Dropout, prenorm=True, resid_dropout1=0.0, resid_dropout2=0.0, drop_path1=0.0,
    drop_path2=0.0, fused_dropout_add_ln=False, return_residual=False, residual_in_fp32=False,
    sequence_parallel=False, mark_shared_params=False)``; defaults: ``MHA(dim,
    num_heads=dim // 64)``, ``Mlp(dim, hidden_features=4 * dim)``."""

    def __init__(self, dim, mixer_cls=None, mlp_cls=None, norm_cls=nn.LayerNorm, dropout_cls=nn.Dropout,
                 prenorm=True, resid_dropout1=0.0, resid_dropout2=0.0, drop_path1=0.0, drop_path2=0.0,
                 fused_dropout_add_ln=False, return_residual=False, residual_in_fp32=False,
                 sequence_parallel=False, mark_shared_params=False):
        super().__init__()
        if residual_in_fp32 and not prenorm:
            raise ValueError("residual_in_fp32 needs prenorm=True")
        self.prenorm = prenorm
        self.fused_dropout_add_ln = fused_dropout_add_ln
        self.return_residual = return_residual
        self.residual_in_fp32 = residual_in_fp32
        mixer_cls = mixer_cls if mixer_cls is not None else partial(MHA, num_heads=dim // 64)
        mlp_cls = mlp_cls if mlp_cls is not None else partial(Mlp, hidden_features=4 * dim)
        self.mixer = mixer_cls(dim)
        self.dropout1 = dropout_cls(resid_dropout1)
        self.drop_path1 = StochasticDepth(drop_path1, mode="row")
        self.norm1 = norm_cls(dim)
        self.mlp = mlp_cls(dim)
        if not isinstance(self.mlp, nn.Identity):
            self.dropout2 = dropout_cls(resid_dropout2)
            self.drop_path2 = StochasticDepth(drop_path2, mode="row")
            self.norm2 = norm_cls(dim)
        if fused_dropout_add_ln:
            _check_fused(self.norm1, self.dropout1)
        _mark_norm_params([self.norm1] + ([self.norm2] if hasattr(self, "norm2") else []), sequence_parallel,
                          mark_shared_params)

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        return self.mixer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)

    def _prenorm_add(self, x, residual, dropout, drop_path, norm):
        """dropout → add → norm on the residual stream; returns (normed, residual)."""
        if not self.fused_dropout_add_ln:
            dropped = drop_path(dropout(x))
            residual = dropped + residual if residual is not None else dropped
            normed = norm(residual.to(dtype=norm.weight.dtype))
            if self.residual_in_fp32:
                residual = residual.to(torch.float32)
            return normed, residual
        return layer_norm_fn(x, norm.weight, norm.bias, residual=residual, eps=norm.eps,
                             dropout_p=dropout.p if self.training else 0.0,
                             rowscale=_drop_path_rowscale(drop_path, x, self.training), prenorm=True,
                             residual_in_fp32=self.residual_in_fp32, is_rms_norm=isinstance(norm, RMSNorm),
                             zero_centered_weight=getattr(norm, "zero_centered_weight", False))

    def _postnorm_add(self, out, x, dropout, drop_path, norm):
        """dropout → add → norm, post-norm: norm(drop(out) + x)."""
        if not self.fused_dropout_add_ln:
            return norm((drop_path(dropout(out)) + x).to(dtype=norm.weight.dtype))
        return layer_norm_fn(out, norm.weight, norm.bias, residual=x, eps=norm.eps,
                             dropout_p=dropout.p if self.training else 0.0,
                             rowscale=_drop_path_rowscale(drop_path, out, self.training), prenorm=False,
                             is_rms_norm=isinstance(norm, RMSNorm),
                             zero_centered_weight=getattr(norm, "zero_centered_weight", False))

    def forward(self, hidden_states: Tensor, residual: Optional[Tensor] = None, mixer_subset=None,
                mixer_kwargs=None):
        """prenorm: hidden_states = the previous block's output (or the embeddings), residual =
        the residual stream (None in the first block); returns (hidden_states, residual).
        postnorm: residual must be None; returns hidden_states. mixer_subset: cross-attention
        only, the query tokens kept (x[:, mixer_subset])."""
        if self.prenorm:
            hidden_states, residual = self._prenorm_add(hidden_states, residual, self.dropout1, self.drop_path1,
                                                        self.norm1)
            mixer_kwargs = dict(mixer_kwargs) if mixer_kwargs is not None else {}
            if mixer_subset is not None:
                mixer_kwargs["mixer_subset"] = mixer_subset
            hidden_states = self.mixer(hidden_states, **mixer_kwargs)
            if mixer_subset is not None:
                residual = residual[:, mixer_subset]
            if not isinstance(self.mlp, nn.Identity):
                hidden_states, residual = self._prenorm_add(hidden_states, residual, self.dropout2,
                                                            self.drop_path2, self.norm2)
                hidden_states = self.mlp(hidden_states)
            return hidden_states, residual
        if residual is not None:
            raise ValueError("residual must be None with prenorm=False")
        mixer_out = self.mixer(hidden_states, **(mixer_kwargs if mixer_kwargs is not None else {}))
        if self.return_residual:       # the mixer returned (out, its input)
            mixer_out, hidden_states = mixer_out
        hidden_states = self._postnorm_add(mixer_out, hidden_states, self.dropout1, self.drop_path1, self.norm1)
        if not isinstance(self.mlp, nn.Identity):
            mlp_out = self.mlp(hidden_states)
            if self.return_residual:
                mlp_out, hidden_states = mlp_out
            hidden_states = self._postnorm_add(mlp_out, hidden_states, self.dropout2, self.drop_path2, self.norm2)
        return hidden_states


class ParallelBlock(nn.Module):
    """flash-attn's ``ParallelBlock(dim, mixer_cls=None, mlp_cls=None, norm_cls=nn.LayerNorm,
    dropout_cls=nn.Dropout, resid_dropout1=0.0, resid_dropout2=0.0, tied_norm=False,
    fused_dropout_add_ln=False, residual_in_fp32=False, sequence_parallel=False,
    mark_shared_params=False)``: residual = dropout1(hidden_states1) + dropout2(hidden_states2) +
    residual, the mixer runs on norm1(residual) and the MLP on norm2(residual) (norm1's with
    ``tied_norm``)."""

    def __init__(self, dim, mixer_cls=None, mlp_cls=None, norm_cls=nn.LayerNorm, dropout_cls=nn.Dropout,
                 resid_dropout1=0.0, resid_dropout2=0.0, tied_norm=False, fused_dropout_add_ln=False,
                 residual_in_fp32=False, sequence_parallel=False, mark_shared_params=False):
        super().__init__()
        self.tied_norm = tied_norm
        self.fused_dropout_add_ln = fused_dropout_add_ln
        self.residual_in_fp32 = residual_in_fp32
        mixer_cls = mixer_cls if mixer_cls is not None else partial(MHA, num_heads=dim // 64)
        mlp_cls = mlp_cls if mlp_cls is not None else partial(Mlp, hidden_features=4 * dim)
        self.mixer = mixer_cls(dim)
        self.dropout1 = dropout_cls(resid_dropout1)
        self.norm1 = norm_cls(dim)
        self.mlp = mlp_cls(dim)
        self.dropout2 = dropout_cls(resid_dropout2)
        if not tied_norm:
            self.norm2 = norm_cls(dim)
        if fused_dropout_add_ln:
            _check_fused(self.norm1, self.dropout1)
        _mark_norm_params([self.norm1] + ([self.norm2] if hasattr(self, "norm2") else []), sequence_parallel,
                          mark_shared_params)

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        return self.mixer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)

    def forward(self, hidden_states1: Tensor, hidden_states2: Optional[Tensor] = None,
                residual: Optional[Tensor] = None, mixer_kwargs=None):
        """hidden_states1: the previous mixer's output (or the embeddings); hidden_states2: the
        previous MLP's output (None in the first block: one dropout only). Returns
        (hidden_states1, hidden_states2, residual)."""
        if not self.fused_dropout_add_ln:
            dropped = self.dropout1(hidden_states1)
            if hidden_states2 is not None:
                dropped = dropped + self.dropout2(hidden_states2)
            residual = residual + dropped if residual is not None else dropped
            hidden_states1 = self.norm1(residual.to(dtype=self.norm1.weight.dtype))
            hidden_states2 = (self.norm2(residual.to(dtype=self.norm2.weight.dtype)) if not self.tied_norm
                              else hidden_states1)
            if self.residual_in_fp32:
                residual = residual.to(torch.float32)
        else:
            weight2, bias2 = (self.norm2.weight, self.norm2.bias) if not self.tied_norm else (None, None)
            outs = layer_norm_fn(hidden_states1, self.norm1.weight, self.norm1.bias, residual=residual,
                                 x1=hidden_states2, weight1=weight2, bias1=bias2, eps=self.norm1.eps,
                                 dropout_p=self.dropout1.p if self.training else 0.0, prenorm=True,
                                 residual_in_fp32=self.residual_in_fp32,
                                 is_rms_norm=isinstance(self.norm1, RMSNorm),
                                 zero_centered_weight=getattr(self.norm1, "zero_centered_weight", False))
            if self.tied_norm:
                hidden_states1, residual = outs
                hidden_states2 = hidden_states1
            else:
                hidden_states1, hidden_states2, residual = outs
        mixer_kwargs = mixer_kwargs if mixer_kwargs is not None else {}
        hidden_states1 = self.mixer(hidden_states1, **mixer_kwargs)
        hidden_states2 = self.mlp(hidden_states2)
        return hidden_states1, hidden_states2, residual
