"""The fused MLP's element-wise kernels (``kernels_cu/dense_act.cu``) behind
``cuflash.ops.fused_dense.fused_mlp_func``: the activation of fc1's output and, in the backward,
the activation's derivative applied to fc2's input gradient together with fc1's bias gradient
(the column sums), in one pass over the two (rows, hidden) matrices.

``forward(pre, activation)`` returns act(pre) in pre's dtype. ``backward(grad, pre,
activation, bias_grad, inplace)`` returns ``(dpre, dbias)``: dpre = grad · act'(pre) (written
into grad itself with ``inplace``: grad is then a temporary the caller gives up), dbias =
Σ_rows dpre (fp32 sums of the unrounded products, rounded once) or None. Activations:
``ACTIVATIONS`` ('gelu_approx': tanh GELU, 'relu', 'sqrelu': relu²), the formulas of
``kernels_cu/dense_act.cu``'s header.

torch CUDA tensors of bf16 / fp16 that ``kernel_takes`` (2-D, contiguous rows) run the kernels
(compiled by CuPy/NVRTC on first use, launched by raw pointer on torch's current stream); others
(CPU, float64, fp32) run ``reference_forward`` / ``reference_backward``, the same formulas as
torch operations computed in float64 and rounded once. Not an attention family: the kernels
compile through ``cuflash.compile.get_helper_functions``, as layer_norm and cross_entropy.
"""
from __future__ import annotations

import math
import struct

import torch

from . import api
from . import compile as compile_mod

Tensor = torch.Tensor

_KERNEL_TYPES = {torch.bfloat16: "cuflash::bf16", torch.float16: "cuflash::fp16"}
ACTIVATIONS = {"gelu_approx": 0, "relu": 1, "sqrelu": 2}   # kAct
THREADS = 128          # kDaThreads: 8 columns per thread
ROWS_PER_STEP = 4      # kDaRows
FINISH_THREADS = 256   # kDaFinishThreads
# Row splits until about CTAS_PER_SM CTAs per SM are launched (each a row of partials in the backward)
CTAS_PER_SM = 8
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def kernel_names(dtype, activation: str, vector: bool) -> tuple:
    """The name expressions of one module: forward, backward with dbias, backward without, finish."""
    e, a, v = _KERNEL_TYPES[dtype], ACTIVATIONS[activation], "true" if vector else "false"
    return (f"cuflash::dense_act_fwd<{e}, {a}, {v}>", f"cuflash::dense_act_bwd<{e}, {a}, {v}, true>",
            f"cuflash::dense_act_bwd<{e}, {a}, {v}, false>", f"cuflash::dense_act_bwd_finish<{e}>")


def warm_modules(dtypes) -> list:
    """The modules calls on these torch dtypes load with 16-byte accesses (hidden % 8 == 0), every
    activation (``python -m cuflash warmup --helpers dense_act``)."""
    return [compile_mod.HelperModule("dense_act", kernel_names(dt, act, True))
            for dt in dtypes if dt in _KERNEL_TYPES for act in ACTIVATIONS]


def kernel_takes(*tensors) -> bool:
    """Whether the CUDA kernels take these (rows, n) tensors (else the reference runs)."""
    t0 = tensors[0]
    return (t0.is_cuda and t0.dtype in _KERNEL_TYPES and t0.dim() == 2
            and all(t.dtype == t0.dtype and t.shape == t0.shape and t.device == t0.device for t in tensors))


def _check_activation(activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")


# ---------------------------------------------------------------------------------------
# the reference: torch operations in float64, rounded once

def _act64(x: Tensor, activation: str) -> Tensor:
    if activation == "gelu_approx":
        return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x ** 3)))
    r = torch.relu(x)
    return r if activation == "relu" else r * r


def _grad64(x: Tensor, activation: str) -> Tensor:
    if activation == "gelu_approx":
        t = torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x ** 3))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)
    if activation == "relu":
        return (x > 0).to(x.dtype)
    return 2.0 * torch.relu(x)


def reference_forward(pre: Tensor, activation: str) -> Tensor:
    return _act64(pre.double(), activation).to(pre.dtype)


def reference_backward(grad: Tensor, pre: Tensor, activation: str, bias_grad: bool):
    d = grad.double() * _grad64(pre.double(), activation)
    dbias = d.reshape(-1, d.shape[-1]).sum(0).to(grad.dtype) if bias_grad else None
    return d.to(grad.dtype), dbias


# ---------------------------------------------------------------------------------------
# torch CUDA tensors: dense_act.cu

from .torch_ops import _raw_stream  # noqa: E402 - (device index) -> cudaStream_t
from .launch import RecordPlan  # noqa: E402 - the plans' launch steps

_POINTER_FIELDS = ("pre", "out", "grad", "dpre", "partials", "dbias")
_PTRS = struct.Struct("<6Q")   # DenseActParams' six pointers, written per call
_plans: dict = {}


def _drop_plans() -> None:
    _plans.clear()


compile_mod.on_change(_drop_plans)


def static_fields(rows, n, splits, rows_per_split) -> dict:
    """Every DenseActParams field for cuflash.launch.pack: the pointers 0 (written per call)."""
    fields = dict.fromkeys(_POINTER_FIELDS, 0)
    fields.update(rows=rows, n=n, splits=splits, rows_per_split=rows_per_split)
    return fields


def split_rows(rows: int, n: int, sm_count: int) -> tuple:
    """(splits, rows_per_split): about CTAS_PER_SM CTAs per SM over the column blocks, each split
    at least ROWS_PER_STEP rows."""
    col_blocks = -(-n // (8 * THREADS))
    want = max(1, -(-CTAS_PER_SM * sm_count // col_blocks))
    rows_per_split = max(ROWS_PER_STEP, -(-rows // want))
    return -(-rows // rows_per_split), rows_per_split


class _Plan(RecordPlan):
    """One call shape: the module's kernels, the grids and a packed record of the static fields."""
    __slots__ = ("fwd", "bwd_bias", "bwd", "finish", "rows", "n", "splits", "col_blocks")
    PTRS = _PTRS

    def __init__(self, rows, n, dtype, activation, device, vector):
        from .launch import ParamsRecord, pack

        super().__init__(device.index)
        self.rows, self.n = rows, n
        names = kernel_names(dtype, activation, vector)
        self.fwd, self.bwd_bias, self.bwd, self.finish = compile_mod.get_helper_functions("dense_act", names,
                                                                                          self.device)
        sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.splits, rows_per_split = split_rows(rows, n, sm_count)
        self.col_blocks = -(-n // (8 * THREADS))
        self.rec = ParamsRecord(pack("DenseActParams", **static_fields(rows, n, self.splits, rows_per_split)))


def _vector(n, *tensors) -> bool:
    return n % 8 == 0 and all(t.data_ptr() % 16 == 0 for t in tensors)


def _plan(rows, n, dtype, activation, device, vector):
    key = (rows, n, dtype, activation, device, vector, CTAS_PER_SM)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _Plan(rows, n, dtype, activation, device, vector)
    return plan


def forward(pre: Tensor, activation: str) -> Tensor:
    """act(pre), pre (rows, n); see the module docstring."""
    _check_activation(activation)
    if not kernel_takes(pre):
        return reference_forward(pre, activation)
    pre = pre.contiguous()
    out = torch.empty_like(pre)
    if api.POISON_OUTPUTS:   # test hook: anything the kernel misses shows as NaN
        out.fill_(float("nan"))
    rows, n = pre.shape
    if rows and n:
        plan = _plan(rows, n, pre.dtype, activation, pre.device, _vector(n, pre, out))
        plan.run((pre.data_ptr(), out.data_ptr(), 0, 0, 0, 0), ((plan.fwd, plan.col_blocks, plan.splits, THREADS, 0),),
                 _raw_stream(plan.device))
    return out


def backward(grad: Tensor, pre: Tensor, activation: str, bias_grad: bool, inplace: bool = False):
    """(dpre, dbias or None), grad and pre (rows, n); see the module docstring."""
    _check_activation(activation)
    if not kernel_takes(grad, pre):
        return reference_backward(grad, pre, activation, bias_grad)
    pre = pre.contiguous()
    inplace = inplace and grad.is_contiguous()
    grad = grad.contiguous()
    dpre = grad if inplace else torch.empty_like(grad)
    rows, n = grad.shape
    dbias = torch.empty(n, dtype=grad.dtype, device=grad.device) if bias_grad else None
    if api.POISON_OUTPUTS:
        if not inplace:
            dpre.fill_(float("nan"))
        if dbias is not None:
            dbias.fill_(float("nan"))
    if n == 0:
        return dpre, dbias
    if rows == 0:
        if dbias is not None:
            dbias.zero_()
        return dpre, dbias
    plan = _plan(rows, n, grad.dtype, activation, grad.device, _vector(n, grad, pre, dpre))
    if bias_grad:
        partials = torch.empty(plan.splits * n, dtype=torch.float32, device=grad.device)
        ptrs = (pre.data_ptr(), 0, grad.data_ptr(), dpre.data_ptr(), partials.data_ptr(), dbias.data_ptr())
        steps = ((plan.bwd_bias, plan.col_blocks, plan.splits, THREADS, 0),
                 (plan.finish, -(-n // FINISH_THREADS), 1, FINISH_THREADS, 0))
    else:
        ptrs = (pre.data_ptr(), 0, grad.data_ptr(), dpre.data_ptr(), 0, 0)
        steps = ((plan.bwd, plan.col_blocks, plan.splits, THREADS, 0),)
    plan.run(ptrs, steps, _raw_stream(plan.device))
    return dpre, dbias
