"""Backward kernels and the torch bridge on the GPU, the FlashAttention way.

dQ, dK, dV of cuflash against a float64 reference (torch autograd on the GPU) must each be
within 3x the error of plain attention's gradients computed in the same low precision, on
fresh random inputs, with gradients poisoned (NaN) before each launch. The gradients flow
through torch autograd (cuflash::fwd / cuflash::bwd custom ops), so the bridge is tested
with them; CuPy's flash_attn_backward, deterministic mode, torch.compile and CUDA graphs
have their own tests.
"""
import math

import numpy as np
import pytest

import cuflash
from cuflash import _gpu, interface, reference

from conftest import GPU_HDIMS as HDIMS, GPU_HEADS as HEADS, GPU_SEQLENS as SEQLENS  # noqa: E402
from conftest import cuda_randn as rand, torch_attention, torch_dtype  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]


def plain_attention(q, k, v, causal, scale, dtype):
    """Plain attention's output in `dtype` (conftest.torch_attention without the LSE)."""
    return torch_attention(q, k, v, causal, scale, dtype)[0]


def grads(fn, q, k, v, dout):
    import torch

    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), (dq, dk, dv)


def check_grads(ours, ref, low, what=""):
    failures = []
    # An absolute floor far below bf16/fp16 resolution: gradients that are exactly 0 in the
    # reference (one key: dS = P (dP - D) = 0) come out as fp32 rounding noise (~1e-6).
    floor = 1e-5 * max(1.0, max(r.abs().max().item() for r in ref))
    for name, a, r, b in zip(("dq", "dk", "dv"), ours, ref, low):
        assert not a.isnan().any(), f"{what}{name}: unwritten (NaN-poisoned) elements"
        err = (a.double() - r).abs().max().item()
        base = (b.double() - r).abs().max().item()
        if not err <= 3 * base + floor:
            failures.append(f"{what}{name}: error {err:.3g} > 3 x plain error {base:.3g} "
                            f"(max |ref| {r.abs().max().item():.3g})")
    assert not failures, "\n".join(failures)


def problem(dtype, sq, sk, h, hkv, hdim, batch=2):
    tdtype = torch_dtype(dtype)
    q = rand((batch, sq, h, hdim), tdtype)
    k, v = rand((batch, sk, hkv, hdim), tdtype), rand((batch, sk, hkv, hdim), tdtype)
    dout = rand((batch, sq, h, hdim), tdtype)
    return q, k, v, dout


def reference_grads(q, k, v, dout, causal, scale):
    import torch

    _, ref = grads(lambda q, k, v: plain_attention(q, k, v, causal, scale, torch.float64), q, k, v, dout.double())
    _, low = grads(lambda q, k, v: plain_attention(q, k, v, causal, scale, q.dtype), q, k, v, dout)
    return ref, low


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("hdim", HDIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_backward_matches_reference(dtype, causal, hdim, seqlens, heads):
    sq, sk = seqlens
    h, hkv = HEADS[heads]
    q, k, v, dout = problem(dtype, sq, sk, h, hkv, hdim)
    scale = 1 / math.sqrt(hdim)
    _, ours = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=causal), q, k, v, dout)
    ref, low = reference_grads(q, k, v, dout, causal, scale)
    check_grads(ours, ref, low)


@pytest.mark.parametrize("causal", [False, True])
def test_cupy_backward_against_numpy_reference(causal):
    """flash_attn_backward on CuPy arrays, checked against cuflash.reference (float64 NumPy)."""
    import cupy

    rng = np.random.default_rng()
    shapes = [(2, 203, 4, 72), (2, 113, 2, 72), (2, 113, 2, 72), (2, 203, 4, 72)]
    q, k, v, dout = (rng.standard_normal(s).astype(np.float16) for s in shapes)
    dq_ref, dk_ref, dv_ref = reference.attention_backward_naive(dout, q, k, v, causal=causal)
    gq, gk, gv, gdo = (cupy.asarray(x) for x in (q, k, v, dout))
    out, lse, _ = cuflash.flash_attn_func(gq, gk, gv, causal=causal, return_attn_probs=True)
    dq, dk, dv = interface.flash_attn_backward(gdo, gq, gk, gv, out, lse, causal=causal)
    assert all(isinstance(x, cupy.ndarray) and x.dtype == np.float16 for x in (dq, dk, dv))
    for name, ours, ref in (("dq", dq, dq_ref), ("dk", dk, dk_ref), ("dv", dv, dv_ref)):
        err = np.abs(cupy.asnumpy(ours).astype(np.float64) - ref).max()
        assert err <= 2e-2 * max(1.0, np.abs(ref).max()), f"{name}: error {err:.3g}"


def test_deterministic_is_bitwise_reproducible():
    """deterministic=True: 20 runs give identical dQ, dK, dV bits (GQA, many K/V blocks)."""
    import torch

    q, k, v, dout = problem("bf16", 1000, 1100, 8, 2, 128, batch=2)
    first = None
    for _ in range(20):
        _, g = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=True, deterministic=True),
                     q, k, v, dout)
        if first is None:
            first = g
            ref, low = reference_grads(q, k, v, dout, True, 128 ** -0.5)
            check_grads(g, ref, low)
        else:
            for a, b in zip(first, g):
                assert torch.equal(a, b), "deterministic backward differs between runs"


def test_every_config_of_the_space_is_correct():
    """Each valid point of the backward tuning space (hdim 64 and 128) computes the gradients."""
    failures = []
    for hdim in (64, 128):
        for causal in (False, True):
            q, k, v, dout = problem("bf16", 333, 301, 2, 1, hdim, batch=1)
            ref, low = reference_grads(q, k, v, dout, causal, hdim ** -0.5)
            for cfg in cuflash.config.valid_bwd_configs(hdim, "bf16", causal, _gpu.max_smem()):
                _, ours = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=causal,
                                                                        bwd_config=cfg), q, k, v, dout)
                try:
                    check_grads(ours, ref, low, what=f"{cfg.name} ")
                except AssertionError as exc:
                    failures.append(str(exc))
    assert not failures, "\n".join(failures)


def test_noncontiguous_and_broadcast_grads():
    """Gradients with stride 0 (from .sum()) and strided q/k/v views into one packed tensor."""
    import torch

    qkv = rand((2, 300, 3, 4, 64), torch.bfloat16).requires_grad_()
    q, k, v = qkv.unbind(2)
    cuflash.flash_attn_func(q, k, v, causal=True).sum().backward()
    ours = qkv.grad.unbind(2)
    ones = torch.ones(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16)
    ref, low = reference_grads(q.detach(), k.detach(), v.detach(), ones, True, 1 / 8)
    check_grads(ours, ref, low)


def test_torch_compile_fullgraph_and_cuda_graphs_match_eager():
    """torch.compile(fullgraph=True) traces the custom ops (forward and backward) with no graph
    break, and a CUDA graph captures a whole training step; both give eager's gradients bit
    for bit (deterministic=True, so dQ's order of additions is fixed)."""
    import torch

    q, k, v, dout = problem("bf16", 512, 512, 4, 2, 64)

    def loss(q, k, v):
        out = cuflash.flash_attn_func(q, k, v, causal=True, deterministic=True)
        return (out.float() * dout.float()).sum()

    def grads_of(fn):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        fn(*leaves).backward()
        return [x.grad for x in leaves]

    eager = grads_of(loss)
    compiled = grads_of(torch.compile(loss, fullgraph=True))
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b), "torch.compile gradients differ from eager"

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture: compiles and loads the kernels
        loss(*leaves).backward()
    torch.cuda.current_stream().wait_stream(side)
    for x in leaves:
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss(*leaves).backward()
    graph.replay()
    torch.cuda.synchronize()
    for x, e in zip(leaves, eager):
        assert torch.equal(x.grad, e), "CUDA graph replay gradients differ from eager"


def test_empty_and_keyless_backward():
    q, k, v, dout = problem("fp16", 4, 0, 2, 2, 64)
    _, (dq, dk, dv) = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v), q, k, v, dout)
    assert (dq == 0).all() and dk.shape == k.shape
    q, k, v, dout = problem("fp16", 0, 5, 2, 2, 64)
    _, (dq, dk, dv) = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v), q, k, v, dout)
    assert (dk == 0).all() and (dv == 0).all() and dq.shape == q.shape
