"""Variable-length batches on the GPU (fa2_fwd / fa2_bwd built with varlen, kernels_cu/varlen.cuh),
the FlashAttention way.

Every sequence of a packed batch is compared with plain attention on that sequence alone: the
float64 reference and the same in the inputs' low precision (conftest.torch_attention, bottom-right
causal per sequence, fully masked rows 0 / LSE +inf); over all sequences cuflash's error must be
within 2x plain attention's (3x, plus one ulp of the largest gradient, for dQ, dK, dV), with
outputs poisoned (NaN) before each launch. Lengths include 0 and 1, s_q != s_k per sequence,
GQA / MQA, head dims 64, 128, 72 (a kernel head dim of 80) and 100 (zero-padded by the API).
A handful of kernel builds in all (each parametrization compiles one forward and one backward).
"""
import math

import numpy as np
import pytest

import cuflash
from cuflash import api

from conftest import torch_attention, torch_dtype  # noqa: E402
from test_flash_bwd_gpu import check_grads  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

# (lens_q, lens_k): empty sequences on either side, length 1, odd lengths, s_q > s_k and s_q < s_k
LENS = ([1, 17, 0, 113, 257, 64, 5], [1, 30, 9, 113, 0, 200, 2])
LONG = ([1023, 2049, 3], [2049, 1023, 0])


def cu_seqlens(lens):
    import torch

    return torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int32, device="cuda")


def packed_inputs(lens_q, lens_k, h, hkv, d, dtype, seed=0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    rnd = lambda *s: torch.randn(*s, device="cuda", dtype=dtype, generator=g)  # noqa: E731
    return rnd(tq, h, d), rnd(tk, hkv, d), rnd(tk, hkv, d), rnd(tq, h, d)


def per_sequence(lens_q, lens_k, q, k, v, dout, causal, scale, dtype):
    """out, lse (nheads, total_q), and dq, dk, dv of plain attention run sequence by sequence in
    ``dtype`` (float64: the reference)."""
    import torch

    outs, lses, dqs, dks, dvs = [], [], [], [], []
    cq, ck = np.cumsum([0] + list(lens_q)), np.cumsum([0] + list(lens_k))
    for b in range(len(lens_q)):
        qs, ks, vs = (x[None].detach().clone().requires_grad_() for x in
                      (q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]))
        if lens_q[b] == 0 or lens_k[b] == 0:  # nothing to attend to: out 0, LSE +inf
            outs.append(torch.zeros(qs.shape[1:], dtype=dtype, device=q.device))
            lses.append(torch.full((qs.shape[2], qs.shape[1]), math.inf, dtype=torch.float64,
                                   device=q.device))
            dqs.append(torch.zeros_like(qs[0])), dks.append(torch.zeros_like(ks[0]))
            dvs.append(torch.zeros_like(vs[0]))
            continue
        out, lse = torch_attention(qs, ks, vs, causal, scale, dtype)
        if lens_q[b] and lens_k[b]:
            dq, dk, dv = torch.autograd.grad(out, (qs, ks, vs), dout[None, cq[b]:cq[b + 1]].to(out.dtype),
                                             allow_unused=True)
        else:
            dq, dk, dv = (torch.zeros_like(x) for x in (qs, ks, vs))
        outs.append(out[0].detach())
        lses.append(lse[0].detach())
        dqs.append(dq[0]), dks.append(dk[0]), dvs.append(dv[0])
    return (torch.cat(outs), torch.cat(lses, 1), torch.cat(dqs), torch.cat(dks), torch.cat(dvs))


def check_varlen(lens_q, lens_k, h, hkv, d, dtype, causal, deterministic=False, what=""):
    import torch

    tdtype = torch_dtype(dtype)
    q, k, v, dout = packed_inputs(lens_q, lens_k, h, hkv, d, tdtype)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    scale = 1 / math.sqrt(d)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse, _ = cuflash.flash_attn_varlen_func(qg, kg, vg, cu_q, cu_k, max(lens_q), max(lens_k),
                                                 causal=causal, deterministic=deterministic,
                                                 return_attn_probs=True)
    dq, dk, dv = torch.autograd.grad(out, (qg, kg, vg), dout)
    ref = per_sequence(lens_q, lens_k, q.double(), k.double(), v.double(), dout.double(), causal,
                       scale, torch.float64)
    low = per_sequence(lens_q, lens_k, q, k, v, dout, causal, scale, tdtype)
    assert out.shape == q.shape and lse.shape == (h, sum(lens_q)) and lse.dtype == torch.float32
    assert not out.isnan().any(), f"{what}unwritten (NaN-poisoned) output elements"
    err = (out.double() - ref[0]).abs().max().item() if out.numel() else 0.0
    base = (low[0].double() - ref[0]).abs().max().item() if out.numel() else 0.0
    assert err <= 2 * base + 1e-5, f"{what}output error {err:.3g} > 2 x plain error {base:.3g}"
    assert not lse.isnan().any(), f"{what}unwritten LSE"
    finite = torch.isfinite(ref[1])
    assert torch.equal(torch.isfinite(lse), finite), f"{what}fully masked rows must have LSE = +inf"
    if finite.any():
        assert (lse.double() - ref[1])[finite].abs().max().item() < 1e-3, f"{what}LSE"
    check_grads((dq, dk, dv), ref[2:], low[2:], what)
    return q, k, v, dout, cu_q, cu_k, (out, lse, dq, dk, dv)


@pytest.mark.parametrize("dtype,causal,d", [("bf16", True, 64), ("fp16", False, 128),
                                            ("bf16", False, 72), ("fp16", True, 100)])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_varlen_forward_backward(dtype, causal, d, heads):
    check_varlen(*LENS, *heads, d, dtype, causal, what=f"{dtype} d{d} causal={causal} {heads}: ")


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_long_sequences(causal):
    check_varlen(*LONG, 4, 2, 128, "bf16", causal, what=f"long causal={causal}: ")


def test_varlen_deterministic_is_bitwise_reproducible():
    import torch

    first = check_varlen(*LENS, 4, 2, 64, "bf16", True, deterministic=True)
    q, k, v, dout, cu_q, cu_k, (out, lse, dq, dk, dv) = first
    for _ in range(3):
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        again = cuflash.flash_attn_varlen_func(qg, kg, vg, cu_q, cu_k, max(LENS[0]), max(LENS[1]),
                                               causal=True, deterministic=True)
        grads = torch.autograd.grad(again, (qg, kg, vg), dout)
        assert torch.equal(again, out)
        for a, b in zip(grads, (dq, dk, dv)):
            assert torch.equal(a, b)


def test_varlen_packed_variants_match():
    import torch

    lens = LENS[0]
    q, k, v, _ = packed_inputs(lens, lens, 4, 4, 64, torch.bfloat16)
    cu = cu_seqlens(lens)
    want = cuflash.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    qkv = torch.stack([q, k, v], 1)
    assert torch.equal(cuflash.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True), want)
    kv = torch.stack([k, v], 1)
    assert torch.equal(cuflash.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, max(lens), max(lens),
                                                                causal=True), want)
    # autograd through the packed tensor: one gradient for qkv
    qkv.requires_grad_()
    cuflash.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True).float().sum().backward()
    assert qkv.grad.shape == qkv.shape and not qkv.grad.isnan().any()


def test_varlen_cupy_numpy_and_torch_agree():
    import cupy
    import torch

    lens_q, lens_k = LENS
    q, k, v, dout = packed_inputs(lens_q, lens_k, 4, 2, 64, torch.float16)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    out, lse, _ = cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                 causal=True, return_attn_probs=True)
    cq, ck, cv, cdo = (cupy.asarray(x) for x in (q, k, v, dout))
    ccu_q, ccu_k = cupy.asarray(cu_q), cupy.asarray(cu_k)
    cout, clse, _ = cuflash.flash_attn_varlen_func(cq, ck, cv, ccu_q, ccu_k, max(lens_q), max(lens_k),
                                                   causal=True, return_attn_probs=True)
    assert np.array_equal(cupy.asnumpy(cout).view(np.uint16), out.cpu().numpy().view(np.uint16))
    assert np.array_equal(cupy.asnumpy(clse), lse.cpu().numpy())
    nout, nlse, _ = cuflash.flash_attn_varlen_func(
        *(x.cpu().numpy() for x in (q, k, v, cu_q, cu_k)), max(lens_q), max(lens_k), causal=True,
        return_attn_probs=True)
    assert np.array_equal(nout.view(np.uint16), out.cpu().numpy().view(np.uint16))
    assert np.array_equal(nlse, lse.cpu().numpy())
    # the explicit backward, CuPy and torch, against autograd's
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    o = cuflash.flash_attn_varlen_func(qg, kg, vg, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    want = torch.autograd.grad(o, (qg, kg, vg), dout)
    got = api.flash_attn_varlen_backward(cdo, cq, ck, cv, cout, clse, ccu_q, ccu_k, max(lens_q),
                                         max(lens_k), causal=True)
    got_t = api.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max(lens_q),
                                           max(lens_k), causal=True)
    for a, b, c in zip(got, got_t, want):
        # dQ's fp32 atomics may add in another order: compare to the storage's resolution
        torch.testing.assert_close(torch.as_tensor(cupy.asnumpy(a), device="cuda"), c, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(b, c, rtol=2e-2, atol=2e-2)


def test_varlen_empty_batches():
    import torch

    q = torch.randn(0, 2, 64, device="cuda", dtype=torch.bfloat16)
    cu0 = cu_seqlens([0, 0])
    out, lse, _ = cuflash.flash_attn_varlen_func(q, q, q, cu0, cu0, 0, 0, return_attn_probs=True)
    assert out.shape == (0, 2, 64) and lse.shape == (2, 0)
    q = torch.randn(5, 2, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(0, 2, 64, device="cuda", dtype=torch.bfloat16)
    out, lse, _ = cuflash.flash_attn_varlen_func(q, k, k, cu_seqlens([2, 3]), cu_seqlens([0, 0]), 3, 0,
                                                 return_attn_probs=True)
    assert (out == 0).all() and (lse == math.inf).all()


def test_varlen_torch_compile_and_cuda_graph():
    import torch

    lens_q, lens_k = LENS
    q, k, v, dout = packed_inputs(lens_q, lens_k, 4, 2, 64, torch.bfloat16)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    mq, mk = max(lens_q), max(lens_k)

    def f(q, k, v):
        return cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True)

    want = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(q, k, v), want)
    qg = q.clone().requires_grad_()
    compiled(qg, k, v).float().sum().backward()
    assert qg.grad is not None and not qg.grad.isnan().any()
    f(q, k, v)  # warm: plans built outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = f(q, k, v)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, want)


def test_varlen_runs_sm90_fwd_on_sm90():
    """On the H100 selection runs varlen on sm90_fwd (varlen build); fa2_fwd elsewhere."""
    import torch

    from cuflash import varlen as varlen_mod

    lens = [3, 200]
    q, k, v, _ = packed_inputs(lens, lens, 2, 2, 128, torch.bfloat16)
    cuflash.flash_attn_varlen_func(q, k, v, cu_seqlens(lens), cu_seqlens(lens), 200, 200)
    plans = [p for p in varlen_mod._plans.values() if p.family.op == "fwd"]
    want = "sm90_fwd" if torch.cuda.get_device_capability() == (9, 0) else "fa2_fwd"
    assert plans and all(p.family.name == want and p.config.varlen for p in plans)
