"""flash-attn's ``flash_attn.ops.fused_dense``: ``from flash_attn.ops.fused_dense import ...``
becomes ``from cuflash.ops.fused_dense import ...``.

**Fused dense and MLP** (``FusedDenseFunc``, ``fused_dense_func``, ``FusedDense``, ``FusedMLPFunc``,
``fused_mlp_func``; the modules ``FusedMLP`` / ``ParallelFusedMLP`` live in ``cuflash.modules.mlp``
and resolve from here too). On CUDA tensors of bf16 / fp16 (or fp32 under autocast) the MLP
fc1 → act → fc2 runs as:

* forward: fc1 = x W1ᵀ + b1 with the bias in the GEMM's cuBLASLt epilogue (``F.linear``), then
  ``kernels_cu/dense_act.cu`` (``cuflash.dense_act``) writes act(fc1) in one pass, fc1 kept as the
  saved pre-activation. When the pre-activation is not kept (``checkpoint_lvl=2``, or
  ``save_pre_act=False``, i.e. inference) and the activation is 'gelu_approx' or 'relu', the
  activation runs in the GEMM's epilogue itself (``torch._addmm_activation``: cuBLASLt's
  GELU (tanh) / ReLU epilogue, as flash-attn's own ``linear_act_forward``; no kernel, fc1 never
  written): ``EPILOGUE_ALIGN`` below says which shapes take it, others take the kernel.
  'sqrelu' has no cuBLASLt epilogue: always the kernel.
* backward: dW2 = doutᵀ act(fc1), db2 = Σ dout; g = dout W2; then one pass of
  ``dense_act.cu`` over g and fc1 writes dfc1 = g · act'(fc1) into g's buffer and sums db1 = Σ
  dfc1 per column (flash-attn: cuBLASLt's DGELU_BGRAD epilogue); dx = dfc1 W1 (+ the residual's
  gradient in the same GEMM with ``return_residual``), dW1 = dfc1ᵀ x.
* ``checkpoint_lvl`` (flash-attn's): 0 saves fc1 and act(fc1); 1 saves fc1 and recomputes
  act(fc1) in the backward; 2 saves x only and recomputes fc1 and act(fc1). ``heuristic``: -1
  never the epilogue (flash-attn: no fused GEMM + activation), 0..4 the epilogue where it applies
  (the cuBLASLt algorithm is torch's pick: the number picks nothing more); ``FusedMLP``'s
  'auto' is ``AUTO_HEURISTIC``.
* routing: training calls of the default form (checkpoint_lvl 0, no process group) take the torch
  composition with 'relu' and 'gelu_approx' (the fused form measured no faster there on the H200; a
  finite ``FUSED_MIN_ELEMENTS`` sends gelu_approx calls of at least that many pre-activation elements to
  the fused path); 'sqrelu', ``checkpoint_lvl`` 1 / 2 and process groups run it. Calls with nothing
  to differentiate run the fused forward (fc1's activation in the epilogue where it applies) without
  the autograd.Function (nothing saved), whatever the training rule says.

Other tensors (CPU, float64, fp32 without autocast) run the torch composition ``F.linear`` →
activation → ``F.linear`` with torch's autograd (exact in float64), or, with a
``process_group``, ``FusedMLPFunc`` over the reference activations (float64 formulas rounded
once), so the collectives run there too (tests use gloo).

**Tensor-parallel linear layers** (``ColumnParallelLinear``, ``RowParallelLinear``), plain torch
(``F.linear``) and ``torch.distributed`` collectives (``cuflash.utils.distributed``), autograd
through the collectives. Megatron-style tensor parallelism over a process group of P ranks; the
collectives work on dimension 0 of the activations (flash-attn's convention: with sequence
parallelism a rank holds rows of the (batch · seqlen, hidden) activation):

* ``ColumnParallelLinear(in_features, out_features, process_group)``: this rank holds
  ``get_dim_for_local_rank(out_features, P, rank, multiple_of)`` rows of the weight (and of the
  bias): out_local = x_full W_localᵀ + b_local. With ``sequence_parallel`` (flash-attn's
  default) the input is this rank's share of the rows and is all-gathered first (backward:
  reduce-scatter of the input gradient); otherwise the input is replicated on every rank and the
  input gradient is all-reduced. As in flash-attn, the backward keeps only this rank's input
  and gathers it again, overlapped with the input gradient's GEMM, and the input gradient's
  collective overlaps the weight gradient's GEMM.
* ``RowParallelLinear(in_features, out_features, process_group)``: this rank holds
  ``get_dim_for_local_rank(in_features, P, rank, multiple_of)`` columns of the weight; the bias
  lives on rank 0 only (added once to the sum). out = Σ_ranks x_local W_localᵀ, reduce-scattered
  over the rows with ``sequence_parallel`` (backward: all-gather), else all-reduced (backward:
  identity).

With one rank (a process group of size 1) both run F.linear alone: no collective, no copy
(``ONE_RANK_SHORTCUT``; off, the collectives run over the one-rank group, which tests use to
exercise that path on one GPU).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..utils.distributed import (_ReduceScatter, all_gather_raw, all_reduce_raw, get_dim_for_local_rank,
                                 reduce_scatter_raw)

__all__ = ["FusedDenseFunc", "fused_dense_func", "FusedDense", "FusedMLPFunc", "fused_mlp_func", "ColumnParallelLinear",
           "RowParallelLinear"]

ONE_RANK_SHORTCUT = True   # a one-rank group: F.linear alone, no collective


def _one_rank(process_group) -> bool:
    return ONE_RANK_SHORTCUT and dist.get_world_size(process_group) == 1


class _ColumnParallelLinearFunc(torch.autograd.Function):
    """out = x_full Wᵀ + b of a column-parallel layer on rows (x 2-D: a view made inside a
    Function could not be changed in place later, and rotary turns q and k in place), x_full
    the all-gathered x with sequence_parallel, else x itself (replicated). Saves this rank's x only (the gathered input
    is P times larger) and gathers it again in the backward while dx = dout W is computed; dx's
    reduce-scatter (sequence_parallel) or all-reduce (replicated x: each rank's dx covers its own
    output columns only) runs while dW is computed."""

    @staticmethod
    def forward(ctx, x, weight, bias, process_group, sequence_parallel):
        device = x.device.type
        if torch.is_autocast_enabled(device):
            # autocast's cast, done here where the backward can see it (as flash-attn's custom_fwd does): the
            # all-gather then moves 16-bit rows, and the backward's products meet operands of one dtype.
            # Autograd returns the gradients in the parameters' own dtypes.
            dtype = torch.get_autocast_dtype(device)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        ctx.process_group, ctx.sequence_parallel, ctx.has_bias = process_group, sequence_parallel, bias is not None
        # x is kept only for the weight's gradient (frozen weights, e.g. adapters: nothing is held)
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        total_x = all_gather_raw(x, process_group)[0] if sequence_parallel else x
        with torch.autocast(device, enabled=False):
            return F.linear(total_x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        group, sp = ctx.process_group, ctx.sequence_parallel
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        total_x, gather = (all_gather_raw(x, group, async_op=True) if sp and need_w else (x, None))
        grad_out = grad_out.contiguous()
        grad_x = reduce = grad_w = grad_b = None
        if need_x:
            grad_x, reduce = (reduce_scatter_raw if sp else all_reduce_raw)(grad_out @ weight, group, async_op=True)
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        if need_w:
            if gather is not None:
                gather.wait()
            grad_w = rows.t() @ total_x.reshape(-1, total_x.shape[-1])
        if ctx.has_bias and need_b:
            grad_b = rows.sum(0)
        if reduce is not None:
            reduce.wait()
        return grad_x, grad_w, grad_b, None, None


class _AllReduceInPlace(torch.autograd.Function):
    """The sum over ranks in place in a tensor that nothing else keeps (RowParallelLinear's partial
    product: no copy); backward: the identity."""

    @staticmethod
    def forward(ctx, partial, process_group):
        ctx.mark_dirty(partial)
        dist.all_reduce(partial, group=process_group)
        return partial

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


# ---------------------------------------------------------------------------------------
# the fused dense layer and MLP

ACTIVATIONS = ("gelu_approx", "relu", "sqrelu")
# fc1's GEMM takes the activation in its cuBLASLt epilogue (torch._addmm_activation) only with a
# bias and in_features, hidden_features multiples of this (16-byte rows for cuBLASLt's fast
# paths) and 16-byte aligned operands; other shapes take F.linear + dense_act.cu, named here
# rather than left to torch's own fallback inside _addmm_activation.
EPILOGUE_ALIGN = 8
# FusedMLP's heuristic='auto': 0 (the epilogue where it applies) or -1 (never). flash-attn picks
# -1 on sm_90 for gelu_approx, its fused cuBLASLt GEMM being slower there.
AUTO_HEURISTIC = 0


# Training calls of the fused path's default form (checkpoint_lvl 0 with the pre-activation kept,
# gelu_approx, no process group) with fewer than FUSED_MIN_ELEMENTS pre-activation elements
# (rows · hidden) run the torch composition instead: there the fused path's host time (its Python
# autograd.Function and kernel launches, about 250 us per forward + backward) exceeds what it saves on
# the GPU (H200, bf16, logs/session29_fd1/r2, r3: at 8192 x 3072 fwd + bwd 0.84-1.02 ms fused against
# 0.62-0.72 ms torch; parity from 16384 x 8192, where the backward kernel saves its 0.07 ms). relu's
# default form takes the composition at every size (r2, r3, r4: 1.7, 2.4, 1.3 % slower fused at 16384 x
# 8192). sqrelu (torch's takes two kernels and keeps relu's output: 9 % faster fused, r3),
# checkpoint_lvl 1 / 2 and process groups always take the fused path. Above 2^27 elements gelu_approx's fused
# path measured 0.1-1.4 % slower than the composition (Llama-7B MLP, 16384 tokens, r3 / r4: 13.82 / 13.55 against
# 13.80 / 13.36 ms) and holds 7.6 % more peak memory, so by default no size takes it (the threshold is
# unbounded); set FUSED_MIN_ELEMENTS to a size (0: always) to route larger calls to the fused path.
FUSED_MIN_ELEMENTS = 1 << 62


def _composition_takes(x, weight1, activation, save_pre_act, checkpoint_lvl) -> bool:
    """Whether a CUDA training call the fused path could take runs the torch composition
    (FUSED_MIN_ELEMENTS); calls with nothing to differentiate always take the fused forward."""
    if not save_pre_act or checkpoint_lvl != 0 or activation == "sqrelu":
        return False
    if activation == "relu":   # torch's ReLU step is as cheap as the kernel's: the composition at every size
        return True
    rows = x.numel() // max(1, x.shape[-1])
    return rows * weight1.shape[0] < FUSED_MIN_ELEMENTS


def _autocast_dtype(device_type: str):
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def _no_autocast(device_type: str):
    """A context with autocast off: torch.autocast(enabled=False) where autocast is on, else nothing
    (entering torch.autocast costs host time on every call)."""
    return torch.autocast(device_type, enabled=False) if torch.is_autocast_enabled(device_type) else nullcontext()


def _takes_fused(x: Tensor, *tensors) -> bool:
    """Whether a call runs FusedMLPFunc's CUDA path: flash-attn's rule (CUDA, fp16 / bf16, or
    fp32 under autocast), every tensor on CUDA."""
    if not (x.is_cuda and all(t is None or t.is_cuda for t in tensors)):
        return False
    return x.dtype in (torch.float16, torch.bfloat16) or (x.dtype == torch.float32
                                                          and torch.is_autocast_enabled("cuda"))


def _check_linear(x, weight, bias, what_w="weight", what_b="bias", in_name="x") -> None:
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(f"{what_w} must be a 2-D tensor (out_features, in_features), got "
                         f"{getattr(weight, 'shape', type(weight).__name__)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{in_name}'s last dimension ({x.shape[-1] if x.dim() else 'none'}) must equal "
                         f"{what_w}.shape[1] ({weight.shape[1]})")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{what_b} must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")


def _check_dtypes(x, names_tensors) -> None:
    """One dtype for every operand unless autocast casts them (flash-attn's custom_fwd)."""
    if _autocast_dtype(x.device.type) is not None:
        return
    for name, t in names_tensors:
        if t is not None and t.dtype != x.dtype:
            raise ValueError(f"{name} has dtype {t.dtype}, x has {x.dtype}: they must match (or run under autocast)")


def _activation_fn(activation):
    """The torch composition's activation (autograd through torch's operations)."""
    if activation == "gelu_approx":
        return lambda t: F.gelu(t, approximate="tanh")
    if activation == "relu":
        return F.relu
    return lambda t: torch.square(F.relu(t))


def _act_fwd(pre, activation):
    from .. import dense_act

    if torch.compiler.is_compiling():
        return torch.ops.cuflash.dense_act_fwd(pre, activation)
    return dense_act.forward(pre, activation)


def _act_bwd(grad, pre, activation, bias_grad):
    """(dpre, dbias or None); dpre written into grad (a temporary) when eager."""
    from .. import dense_act

    if torch.compiler.is_compiling():
        dpre, dbias = torch.ops.cuflash.dense_act_bwd(grad, pre, activation, bias_grad)
        return dpre, dbias if bias_grad else None
    return dense_act.backward(grad, pre, activation, bias_grad, inplace=True)


def epilogue_takes(x2d: Tensor, weight1: Tensor, bias1, activation: str, heuristic) -> bool:
    """Whether fc1 + activation run as one cuBLASLt GEMM (torch._addmm_activation), when the
    pre-activation is not kept (see the module docstring)."""
    return (heuristic != -1 and activation in ("gelu_approx", "relu") and bias1 is not None and x2d.is_cuda
            and x2d.dtype in (torch.float16, torch.bfloat16)
            and x2d.shape[1] % EPILOGUE_ALIGN == 0 and weight1.shape[0] % EPILOGUE_ALIGN == 0
            and all(t.data_ptr() % 16 == 0 for t in (x2d, weight1, bias1)))


def _fc1_act(x2d, weight1, bias1, activation, heuristic, keep_pre):
    """(pre or None, act(pre)) on rows: the epilogue form when pre is not kept and it applies,
    else F.linear (the bias in cuBLASLt's epilogue) and dense_act's forward."""
    if not keep_pre and epilogue_takes(x2d, weight1, bias1, activation, heuristic):
        return None, torch._addmm_activation(bias1, x2d, weight1.t(), use_gelu=activation == "gelu_approx")
    pre = F.linear(x2d, weight1, bias1)
    return pre, _act_fwd(pre, activation)


def _input_grads(rows, weight, x_shape, total_x, gather, res, group, sp, need_x, need_w):
    """The input step's gradients of y = x Wᵀ (+ the residual's with return_residual), given dy as rows:
    (dx, dW). With a process group dx is reduce-scattered (sequence_parallel) or all-reduced while dW's
    GEMM runs, and dW waits for the async all-gather of x (gather) first."""
    grad_x = grad_w = reduce = None
    if need_x:
        if res is not None and group is None:   # the residual's gradient added by the GEMM
            grad_x = torch.addmm(res.reshape(-1, res.shape[-1]), rows, weight)
        else:
            grad_x = rows @ weight
        if group is not None:
            grad_x, reduce = (reduce_scatter_raw if sp else all_reduce_raw)(grad_x, group, async_op=True)
    if need_w:
        if gather is not None:
            gather.wait()
        grad_w = rows.t() @ total_x.reshape(-1, total_x.shape[-1])
    if reduce is not None:
        reduce.wait()
    if grad_x is not None:
        grad_x = grad_x.reshape(x_shape)
        if res is not None and group is not None:
            grad_x = grad_x + res
    return grad_x, grad_w


class FusedDenseFunc(torch.autograd.Function):
    """flash-attn's ``FusedDenseFunc.apply(x, weight, bias, return_residual=False,
    process_group=None, sequence_parallel=True)``: out = x_full Wᵀ + b (x_full all-gathered with
    a process_group and sequence_parallel); with return_residual (out, x). The backward adds the
    residual's gradient in the dx GEMM (addmm), and with a process group gathers x again while dx
    is computed and reduces dx while dW is (as _ColumnParallelLinearFunc)."""

    @staticmethod
    def forward(ctx, x, weight, bias, return_residual=False, process_group=None, sequence_parallel=True):
        dtype = _autocast_dtype(x.device.type)
        if dtype is not None:   # autocast's cast, where the backward sees it (flash-attn's custom_fwd)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        x = x.contiguous()
        ctx.return_residual, ctx.process_group, ctx.sequence_parallel = return_residual, process_group, sequence_parallel
        ctx.has_bias = bias is not None
        ctx.x_shape = x.shape
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        gather = process_group is not None and sequence_parallel
        total_x = all_gather_raw(x, process_group)[0] if gather else x
        with _no_autocast(x.device.type):
            out = F.linear(total_x, weight, bias)
        return (out, x) if return_residual else out

    @staticmethod
    def backward(ctx, grad_out, *args):
        x, weight = ctx.saved_tensors
        group, sp = ctx.process_group, ctx.sequence_parallel
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gather = None
        total_x = x
        if group is not None and sp and need_w:
            total_x, gather = all_gather_raw(x, group, async_op=True)
        rows = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
        res = args[0] if ctx.return_residual else None
        grad_b = rows.sum(0) if ctx.has_bias and need_b else None
        grad_x, grad_w = _input_grads(rows, weight, ctx.x_shape, total_x, gather, res, group, sp, need_x, need_w)
        return grad_x, grad_w, grad_b, None, None, None


def fused_dense_func(x: Tensor, weight: Tensor, bias=None, return_residual: bool = False, process_group=None,
                     sequence_parallel: bool = True):
    """x Wᵀ + b (flash-attn's signature). With a process_group: the column-parallel input step, x
    all-gathered along dimension 0 first (sequence_parallel) or its gradient all-reduced
    (replicated x). return_residual: also return x (this rank's). CUDA fp16 / bf16 calls with
    return_residual run ``FusedDenseFunc`` (the residual's gradient added inside the dx GEMM); the
    others F.linear with torch's autograd (cuBLASLt's bias epilogue already: nothing else to fuse)."""
    grouped = not (process_group is None or _one_rank(process_group))
    if grouped and x.dim() < 2:
        raise ValueError(f"x must have at least 2 dimensions (rows, features) with a process_group, got shape "
                         f"{tuple(x.shape)}")
    _check_linear(x, weight, bias)
    _check_dtypes(x, (("weight", weight), ("bias", bias)))
    if not grouped:
        if return_residual and _takes_fused(x, weight, bias):
            return FusedDenseFunc.apply(x, weight, bias, True, None, sequence_parallel)
        out = F.linear(x, weight, bias)
    else:
        rows = x.shape[0] * (dist.get_world_size(process_group) if sequence_parallel else 1)
        out = _ColumnParallelLinearFunc.apply(x.reshape(-1, x.shape[-1]), weight, bias, process_group,
                                              sequence_parallel).view(rows, *x.shape[1:-1], weight.shape[0])
    return (out, x) if return_residual else out


class FusedDense(nn.Linear):
    """flash-attn's ``FusedDense(in_features, out_features, bias=True, return_residual=False)``:
    an ``nn.Linear`` (same parameters and keys) whose ``forward(x, process_group=None)`` is
    ``fused_dense_func`` (with a process group: x's rows all-gathered first)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, return_residual: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.return_residual = return_residual

    def forward(self, x, process_group=None):
        return fused_dense_func(x, self.weight, self.bias, return_residual=self.return_residual,
                                process_group=process_group)


def check_mlp_args(activation, checkpoint_lvl, heuristic, allow_auto=False) -> None:
    """FusedMLP's / fused_mlp_func's argument rules (flash-attn's asserts, as ValueErrors)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if checkpoint_lvl not in (0, 1, 2):
        raise ValueError(f"checkpoint_lvl must be 0, 1 or 2, got {checkpoint_lvl!r}")
    auto_ok = allow_auto and heuristic == "auto"
    if not auto_ok and not (isinstance(heuristic, int) and not isinstance(heuristic, bool) and -1 <= heuristic <= 4):
        raise ValueError(f"heuristic must be {'auto or ' if allow_auto else ''}an int in -1..4, got {heuristic!r}")


def _mlp_forward(x, weight1, bias1, weight2, bias2, activation, heuristic, keep_pre, process_group,
                 sequence_parallel):
    """FusedMLPFunc's forward without autograd: (x, weight1, bias1, weight2 as used (autocast's cast,
    contiguous), pre or None, act(pre), out (x's leading shape, x_full's rows))."""
    dtype = _autocast_dtype(x.device.type)
    if dtype is not None:   # autocast's cast, where the backward sees it (flash-attn's custom_fwd)
        x, weight1, weight2 = x.to(dtype), weight1.to(dtype), weight2.to(dtype)
        bias1 = None if bias1 is None else bias1.to(dtype)
        bias2 = None if bias2 is None else bias2.to(dtype)
    x = x.contiguous()
    gather = process_group is not None and sequence_parallel
    total_x, handle = all_gather_raw(x, process_group, async_op=True) if gather else (x, None)
    weight1, weight2 = weight1.contiguous(), weight2.contiguous()
    bias1 = None if bias1 is None else bias1.contiguous()
    if handle is not None:
        handle.wait()
    with _no_autocast(x.device.type):
        pre, out1 = _fc1_act(total_x.reshape(-1, total_x.shape[-1]), weight1, bias1, activation, heuristic, keep_pre)
        out2 = F.linear(out1, weight2, bias2)
    return x, weight1, bias1, weight2, pre, out1, out2.reshape(*total_x.shape[:-1], out2.shape[-1])


class FusedMLPFunc(torch.autograd.Function):
    """flash-attn's ``FusedMLPFunc.apply(x, weight1, bias1, weight2, bias2,
    activation='gelu_approx', save_pre_act=True, return_residual=False, checkpoint_lvl=0,
    heuristic=0, process_group=None, sequence_parallel=True)``: fc2(act(fc1(x_full))) on rows,
    x_full all-gathered with a process group and sequence_parallel (the caller reduces the
    output over the group). See the module docstring for the kernels and what each
    checkpoint_lvl saves."""

    @staticmethod
    def forward(ctx, x, weight1, bias1, weight2, bias2, activation="gelu_approx", save_pre_act=True,
                return_residual=False, checkpoint_lvl=0, heuristic=0, process_group=None, sequence_parallel=True):
        check_mlp_args(activation, checkpoint_lvl, heuristic)
        if not save_pre_act:
            checkpoint_lvl = 2
        x, weight1, bias1, weight2, pre, out1, out2 = _mlp_forward(
            x, weight1, bias1, weight2, bias2, activation, heuristic, checkpoint_lvl != 2, process_group,
            sequence_parallel)
        ctx.activation, ctx.checkpoint_lvl, ctx.heuristic = activation, checkpoint_lvl, heuristic
        ctx.return_residual, ctx.process_group, ctx.sequence_parallel = return_residual, process_group, sequence_parallel
        ctx.has_bias1 = bias1 is not None
        if checkpoint_lvl == 0:
            ctx.save_for_backward(x, weight1, weight2, pre, out1)
        elif checkpoint_lvl == 1:
            ctx.save_for_backward(x, weight1, weight2, pre)
        else:
            ctx.save_for_backward(x, weight1, weight2, bias1)
        return (out2, x) if return_residual else out2

    @staticmethod
    def backward(ctx, grad_out, *args):
        x, weight1, weight2, *rest = ctx.saved_tensors
        activation, lvl, group, sp = ctx.activation, ctx.checkpoint_lvl, ctx.process_group, ctx.sequence_parallel
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        gather = None
        if group is not None and sp:
            if lvl == 2:   # fc1 is recomputed from x_full now
                total_x = all_gather_raw(x, group)[0]
            else:
                total_x, gather = all_gather_raw(x, group, async_op=True)
        else:
            total_x = x
        with _no_autocast(x.device.type):
            if lvl == 0:
                pre, out1 = rest
            elif lvl == 1:
                pre, = rest
                out1 = _act_fwd(pre, activation)
            else:
                pre, out1 = _fc1_act(total_x.reshape(-1, total_x.shape[-1]), weight1, rest[0], activation,
                                     ctx.heuristic, keep_pre=True)
            g = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
            grad_w2 = g.t() @ out1 if need_w2 else None
            grad_b2 = g.sum(0) if need_b2 else None
            del out1
            grad_x = grad_w1 = grad_b1 = None
            if need_x or need_w1 or need_b1:
                dpre, grad_b1 = _act_bwd(g @ weight2, pre, activation, need_b1 and ctx.has_bias1)
                del pre
                res = args[0] if ctx.return_residual else None
                grad_x, grad_w1 = _input_grads(dpre, weight1, x.shape, total_x, gather, res, group, sp, need_x,
                                               need_w1)
        return (grad_x, grad_w1, grad_b1, grad_w2, grad_b2) + (None,) * 7


def fused_mlp_func(x: Tensor, weight1: Tensor, weight2: Tensor, bias1=None, bias2=None,
                   activation: str = "gelu_approx", save_pre_act: bool = True, return_residual: bool = False,
                   checkpoint_lvl: int = 0, heuristic: int = 0, process_group=None, sequence_parallel: bool = True):
    """fc2(act(fc1(x))) with flash-attn's signature (x all-gathered first with a process group and
    sequence_parallel; the caller reduces the output). CUDA fp16 / bf16 (or fp32 under autocast):
    ``FusedMLPFunc``'s fused path; with a process group elsewhere: ``FusedMLPFunc`` over the
    reference activations; else the torch composition. Returns out, or (out, x) with
    return_residual."""
    check_mlp_args(activation, checkpoint_lvl, heuristic)
    _check_linear(x, weight1, bias1, "weight1", "bias1")
    if weight2.dim() != 2 or weight2.shape[1] != weight1.shape[0]:
        raise ValueError(f"weight2 must be a 2-D tensor (out_features, {weight1.shape[0]}) (weight1's "
                         f"hidden_features), got {tuple(weight2.shape)}")
    if bias2 is not None and tuple(bias2.shape) != (weight2.shape[0],):
        raise ValueError(f"bias2 must have shape ({weight2.shape[0]},), got {tuple(bias2.shape)}")
    _check_dtypes(x, (("weight1", weight1), ("weight2", weight2), ("bias1", bias1), ("bias2", bias2)))
    if process_group is not None and x.dim() < 2:
        raise ValueError(f"x must have at least 2 dimensions (rows, features) with a process_group, got shape "
                         f"{tuple(x.shape)}")
    fused = _takes_fused(x, weight1, weight2, bias1, bias2)
    training = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                               for t in (x, weight1, bias1, weight2, bias2))
    if (process_group is not None or fused) and not training:
        # nothing to differentiate (inference, whatever save_pre_act / checkpoint_lvl say): the forward alone
        # (fc1's activation in its cuBLASLt epilogue where it applies), no autograd.Function, nothing saved
        x_used, *_, out = _mlp_forward(x, weight1, bias1, weight2, bias2, activation, heuristic, False,
                                       process_group, sequence_parallel)
        return (out, x_used) if return_residual else out
    if process_group is not None or (fused and not _composition_takes(x, weight1, activation, save_pre_act,
                                                                      checkpoint_lvl)):
        return FusedMLPFunc.apply(x, weight1, bias1, weight2, bias2, activation, save_pre_act, return_residual,
                                  checkpoint_lvl, heuristic, process_group, sequence_parallel)
    out = F.linear(_activation_fn(activation)(F.linear(x, weight1, bias1)), weight2, bias2)
    return (out, x) if return_residual else out


def _local_features(features: int, process_group, multiple_of: int, what: str) -> int:
    if process_group is None:
        raise ValueError(f"process_group must be a torch.distributed process group, got None ({what})")
    if multiple_of <= 0 or features % multiple_of:
        raise ValueError(f"{what} = {features} must be a multiple of multiple_of = {multiple_of}")
    return get_dim_for_local_rank(features, dist.get_world_size(process_group), dist.get_rank(process_group),
                                  multiple_of)


class ColumnParallelLinear(nn.Linear):
    """This rank's rows of a linear layer's weight (output features split over the group in
    units of multiple_of); see the module docstring. weight: (out_local, in_features)."""

    def __init__(self, in_features: int, out_features: int, process_group, bias: bool = True,
                 sequence_parallel: bool = True, multiple_of: int = 1, device=None, dtype=None) -> None:
        local = _local_features(out_features, process_group, multiple_of, "out_features")
        super().__init__(in_features, local, bias=bias, device=device, dtype=dtype)
        self.process_group = process_group
        self.sequence_parallel = sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        return fused_dense_func(x, self.weight, self.bias, process_group=self.process_group,
                                sequence_parallel=self.sequence_parallel)


class RowParallelLinear(nn.Linear):
    """This rank's columns of a linear layer's weight (input features split over the group in
    units of multiple_of), the bias on rank 0; the partial products summed over the group (see
    the module docstring). weight: (out_features, in_local)."""

    def __init__(self, in_features: int, out_features: int, process_group, bias: bool = True,
                 sequence_parallel: bool = True, multiple_of: int = 1, device=None, dtype=None) -> None:
        local = _local_features(in_features, process_group, multiple_of, "in_features")
        rank = dist.get_rank(process_group)
        super().__init__(local, out_features, bias=bias and rank == 0, device=device, dtype=dtype)
        self.process_group = process_group
        self.sequence_parallel = sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        if _one_rank(self.process_group):
            return F.linear(x, self.weight, self.bias)
        if self.sequence_parallel:
            return _ReduceScatter.apply(F.linear(x, self.weight, self.bias), self.process_group)
        # on rows: the product is then a tensor of its own (not a view), summed in place
        partial = F.linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias)
        return _AllReduceInPlace.apply(partial, self.process_group).view(*x.shape[:-1], partial.shape[-1])


def __getattr__(name: str):
    # flash-attn keeps FusedMLP and ParallelFusedMLP in flash_attn.ops.fused_dense; cuflash's live with the
    # other MLPs in cuflash.modules.mlp (imported on first use: modules.mha and modules.mlp import this module).
    if name in ("FusedMLP", "ParallelFusedMLP"):
        from ..modules import mlp
        return getattr(mlp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
