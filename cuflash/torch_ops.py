"""The torch bridge: ``cuflash::fwd`` and ``cuflash::bwd`` as torch custom ops.

``flash_attn_func`` routes torch tensors here. The ops own no kernel logic: they allocate
outputs with torch's caching allocator and launch the kernels by raw pointer on torch's
current stream (interface._forward_on_device / _backward_on_device). No DLPack, no CuPy
array and no device synchronization on the way, which keeps the per-call cost low and
makes CUDA-graph capture legal (../shared/FACTS.md).

* ``cuflash::fwd(q, k, v, scale, causal, fwd_tiles, deterministic, bwd_tiles) -> (out, lse)``
  has a fake (meta) implementation and registered autograd, so ``torch.compile(fullgraph=True)``
  traces through it and ``loss.backward()`` calls ``cuflash::bwd``. The last two arguments
  only ride along for the backward.
* ``cuflash::bwd(dout, q, k, v, out, lse, scale, causal, deterministic, bwd_tiles) -> (dq, dk, dv)``.
* Configs cross the op boundary as int lists (empty: the tuned / heuristic default):
  fwd_tiles = [Br, Bc, warps, stages, head_dim], bwd_tiles = [Br, Bc, warps, stages, dsplit,
  qsplit, head_dim]; the call's ``deterministic`` flag overrides the config's.
* CPU tensors (any float dtype) run the float64 NumPy reference, forward and backward, so
  ``torch.autograd.gradcheck`` exercises the whole plumbing without a GPU.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import interface as _itf
from . import reference
from .config import BwdConfig, FwdConfig

Tensor = torch.Tensor


def _fwd_tiles(config: Optional[FwdConfig]) -> list[int]:
    if config is None:
        return []
    return [config.Br, config.Bc, config.warps, config.stages, config.head_dim]


def _bwd_tiles(config: Optional[BwdConfig]) -> list[int]:
    if config is None:
        return []
    return [config.Br, config.Bc, config.warps, config.stages, config.dsplit, config.qsplit,
            config.head_dim]


def _dtype_name(x: Tensor) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}[x.dtype]


def _gpu_layout(x: Tensor) -> Tensor:
    """x itself if the kernels can read it (contiguous last dim, 16-byte aligned rows), else a
    contiguous copy: gradients in particular may arrive expanded (stride 0) or transposed."""
    strides = x.stride()
    ok = (x.shape[-1] <= 1 or strides[-1] == 1) and x.data_ptr() % 16 == 0 and all(
        s % 8 == 0 for s, n in zip(strides[:-1], x.shape[:-1]) if n > 1)
    return x if ok else x.contiguous()


def _t(name: str, x: Tensor):
    return _itf._describe(name, x)


def _stream(x: Tensor) -> int:
    return torch.cuda.current_stream(x.device).cuda_stream


# ---------------------------------------------------------------------------------------
# forward

@torch.library.custom_op("cuflash::fwd", mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool,
        fwd_tiles: list[int], deterministic: bool, bwd_tiles: list[int]) -> tuple[Tensor, Tensor]:
    if q.device.type == "cpu":
        return _fwd_reference(q, k, v, softmax_scale, causal)
    batch, seqlen_q, nheads, head_dim = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if k.shape[1] == 0:  # attention over zero keys: every row fully masked
        return out.zero_(), lse.fill_(math.inf)
    q, k, v = (_gpu_layout(x) for x in (q, k, v))
    if _itf.POISON_OUTPUTS:
        out.fill_(math.nan)
        lse.fill_(math.nan)
    config = None
    if fwd_tiles:
        config = FwdConfig(*fwd_tiles, _dtype_name(q), causal)
    _itf._forward_on_device(_t("q", q), _t("k", k), _t("v", v), _t("out", out), lse.data_ptr(),
                            softmax_scale, causal, config, q.device.index, _stream(q))
    return out, lse


@fwd.register_fake
def _(q, k, v, softmax_scale, causal, fwd_tiles, deterministic, bwd_tiles):
    batch, seqlen_q, nheads, _ = q.shape
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32))


def _fwd_reference(q, k, v, softmax_scale, causal):
    as64 = lambda x: x.detach().to(torch.float64).numpy()  # noqa: E731
    out, lse = reference.attention_naive(as64(q), as64(k), as64(v), softmax_scale=softmax_scale,
                                         causal=causal, return_lse=True)
    return (torch.from_numpy(out).to(q.dtype),
            torch.from_numpy(lse).to(torch.float32))


# ---------------------------------------------------------------------------------------
# backward

@torch.library.custom_op("cuflash::bwd", mutates_args=())
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        softmax_scale: float, causal: bool, deterministic: bool,
        bwd_tiles: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    if q.device.type == "cpu":
        return _bwd_reference(dout, q, k, v, softmax_scale, causal)
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    if batch == 0 or nheads == 0:
        return dq, dk, dv
    if seqlen_q == 0 or seqlen_k == 0:  # no query rows or no keys: every gradient is zero
        return dq.zero_(), dk.zero_(), dv.zero_()
    dout, q, k, v, out = (_gpu_layout(x) for x in (dout, q, k, v, out))
    lse = lse.contiguous()
    device = q.device.index
    config = None
    if bwd_tiles:
        br, bc, warps, stages, dsplit, qsplit, head_dim = bwd_tiles
        config = BwdConfig(br, bc, warps, stages, dsplit, head_dim, _dtype_name(q), causal,
                           qsplit=qsplit)
    config = _itf.resolve_bwd_config(config, head_dim, _dtype_name(q), causal, deterministic, device,
                                     max(seqlen_q, seqlen_k))
    if _itf.POISON_OUTPUTS:
        for x in (dq, dk, dv):
            x.fill_(math.nan)
    ws = _itf.bwd_workspace(batch, nheads, seqlen_q, seqlen_k, nheads != nheads_kv, config)
    workspace = torch.empty(ws["total"], dtype=torch.uint8, device=q.device)
    _itf._backward_on_device(_t("dout", dout), _t("q", q), _t("k", k), _t("v", v), _t("out", out),
                             lse.data_ptr(), _t("dq", dq), _t("dk", dk), _t("dv", dv),
                             workspace.data_ptr(), ws, softmax_scale, causal, config, device,
                             _stream(q))
    return dq, dk, dv


@bwd.register_fake
def _(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, bwd_tiles):
    return tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))


def _bwd_reference(dout, q, k, v, softmax_scale, causal):
    as64 = lambda x: x.detach().to(torch.float64).numpy()  # noqa: E731
    grads = reference.attention_backward_naive(as64(dout), as64(q), as64(k), as64(v),
                                               softmax_scale=softmax_scale, causal=causal)
    return tuple(torch.from_numpy(g).to(x.dtype) for g, x in zip(grads, (q, k, v)))


# ---------------------------------------------------------------------------------------
# autograd: save q, k, v, out, lse; the backward is cuflash::bwd

def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, _, deterministic, bwd_tiles = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale, ctx.causal = softmax_scale, causal
    ctx.deterministic, ctx.bwd_tiles = deterministic, bwd_tiles
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = bwd(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal,
                     ctx.deterministic, ctx.bwd_tiles)
    return dq, dk, dv, None, None, None, None, None


fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------
# entry points used by cuflash.interface (inputs already validated there)

def attention(q, k, v, softmax_scale: float, causal: bool, deterministic: bool,
              config: Optional[FwdConfig], bwd_config: Optional[BwdConfig]):
    return fwd(q, k, v, softmax_scale, causal, _fwd_tiles(config), deterministic,
               _bwd_tiles(bwd_config))


def backward(dout, q, k, v, out, lse, softmax_scale: float, causal: bool, deterministic: bool,
             config: Optional[BwdConfig]):
    return bwd(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, _bwd_tiles(config))
