"""Variable-length batches with sliding window, softcap, ALiBi and dropout on the GPU (fa2_fwd /
fa2_bwd built with varlen and the feature flags), the FlashAttention way.

Every sequence of a packed batch is compared with attention with the same features on that
sequence alone (window and ALiBi distance bottom-right aligned with the sequence's own lengths,
ALiBi slopes (batch, nheads) read at the sequence's index, dropout's keep mask that of the dense
call at batch index b: cuflash.dropout.keep_mask(..., first_batch=b)): the float64 reference and
the same in the inputs' low precision (test_features_gpu.feature_attention,
test_dropout_gpu.attention_with_mask); over all sequences cuflash's error must be within 2x the
low-precision error (3x plus one ulp of the largest gradient for dQ, dK, dV), outputs poisoned
(NaN) before each launch. Lengths include 0 and 1 and s_q != s_k per sequence; GQA / MQA;
bf16 and fp16; head dims 64, 128 and 72 (a kernel head dim of 80).

Compile count: 10 (forward, backward) pairs, one per CASES / DROP_CASES entry and the
deterministic one; the other tests reuse them. A few minutes on an H100 with a cold cache. On the H100
the varlen backwards at head dims <= 96 run on sm90_bwd for the sets sm90_bwd.VARLEN_SMALL_D_FEATURES
lists (at <= 64 window, softcap, ALiBi and their mixes; at 65..96 those, dropout and dropout + window), the others on
fa2_bwd; the mixes themselves on the sm90 kernels: tests/test_sm90_varlen_mix_gpu.py.
"""
import math

import numpy as np
import pytest

import cuflash
from cuflash import api, dropout

from conftest import torch_dtype  # noqa: E402
from test_dropout_gpu import attention_with_mask  # noqa: E402
from test_features_gpu import feature_attention  # noqa: E402
from test_flash_bwd_gpu import check_grads  # noqa: E402
from test_varlen_gpu import LENS, cu_seqlens, packed_inputs  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

HEADS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (4, 1)}
LONG = ([1023, 2049, 3, 0], [2049, 1023, 17, 5])

# (id, dtype, head dim, causal, window, softcap, alibi None / "h" / "bh", heads)
CASES = [
    ("causal_window_bf16_d64_gqa", "bf16", 64, True, (37, -1), 0.0, None, "gqa"),
    ("window_lr_fp16_d128_mqa", "fp16", 128, False, (50, 20), 0.0, None, "mqa"),
    ("softcap_causal_bf16_d128_mha", "bf16", 128, True, (-1, -1), 30.0, None, "mha"),
    ("alibi_h_fp16_d64_gqa", "fp16", 64, False, (-1, -1), 0.0, "h", "gqa"),
    ("all_bh_causal_bf16_d72_gqa", "bf16", 72, True, (129, -1), 10.0, "bh", "gqa"),
    ("window_right_only_alibi_bh_bf16_d64_mha", "bf16", 64, False, (-1, 13), 0.0, "bh", "mha"),
    # softcap alone at d64: its varlen backward on sm90_bwd (VARLEN_SMALL_D_FEATURES)
    ("softcap_full_fp16_d64_mqa", "fp16", 64, False, (-1, -1), 30.0, None, "mqa"),
]
P_DROP = 0.17
# (id, dtype, head dim, causal, heads)
DROP_CASES = [("drop_causal_bf16_d64_gqa", "bf16", 64, True, "gqa"),
              ("drop_full_fp16_d128_mqa", "fp16", 128, False, "mqa")]


def slopes_of(alibi, nseq, nheads):
    import torch

    if alibi is None:
        return None
    base = torch.tensor([2.0 ** (-8 * (i + 1) / nheads) for i in range(nheads)], device="cuda")
    if alibi == "h":
        return base.float()
    return (base[None] * (0.5 + torch.rand(nseq, 1, device="cuda"))).float()


def empty_sequence(qs, ks, vs, dtype):
    import torch

    out = torch.zeros(qs.shape[1:], dtype=dtype, device=qs.device)
    lse = torch.full((qs.shape[2], qs.shape[1]), math.inf, dtype=torch.float64, device=qs.device)
    return out, lse, torch.zeros_like(qs[0]), torch.zeros_like(ks[0]), torch.zeros_like(vs[0])


def per_sequence(lens_q, lens_k, q, k, v, dout, dtype, attend):
    """out, lse (nheads, total_q), dq, dk, dv of ``attend(b, qs, ks, vs, dtype) -> (out, lse)``
    run on each sequence alone (batch 1), in ``dtype`` (float64: the reference)."""
    import torch

    cq, ck = np.cumsum([0] + list(lens_q)), np.cumsum([0] + list(lens_k))
    parts = []
    for b in range(len(lens_q)):
        qs, ks, vs = (x[None].detach().clone().requires_grad_() for x in
                      (q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]))
        if lens_q[b] == 0 or lens_k[b] == 0:
            parts.append(empty_sequence(qs, ks, vs, dtype))
            continue
        out, lse = attend(b, qs, ks, vs, dtype)
        grads = torch.autograd.grad(out, (qs, ks, vs), dout[None, cq[b]:cq[b + 1]].to(out.dtype),
                                    allow_unused=True)
        grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, (qs, ks, vs))]
        parts.append((out[0].detach(), lse[0].detach().to(torch.float64), *(g[0] for g in grads)))
    return (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts], 1),
            *(torch.cat([p[i] for p in parts]) for i in (2, 3, 4)))


def check_outputs(out, lse, ref, low, what):
    import torch

    assert not out.isnan().any(), f"{what}unwritten (NaN-poisoned) output elements"
    assert not lse.isnan().any(), f"{what}unwritten LSE"
    err = (out.double() - ref[0].double()).abs().max().item() if out.numel() else 0.0
    base = (low[0].double() - ref[0].double()).abs().max().item() if out.numel() else 0.0
    assert err <= 2 * base + 1e-5, f"{what}output error {err:.3g} > 2 x plain error {base:.3g}"
    finite = torch.isfinite(ref[1])
    assert torch.equal(torch.isfinite(lse), finite), f"{what}rows with no visible key: LSE = +inf"
    if finite.any():
        assert (lse.double() - ref[1])[finite].abs().max().item() < 1e-3, f"{what}LSE"


def run_case(case, lens_q, lens_k, deterministic=False, seed=0):
    import torch

    name, dtype, d, causal, window, softcap, alibi, heads = case
    h, hkv = HEADS[heads]
    tdtype = torch_dtype(dtype)
    q, k, v, dout = packed_inputs(lens_q, lens_k, h, hkv, d, tdtype, seed)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    slopes = slopes_of(alibi, len(lens_q), h)
    scale = 1 / math.sqrt(d)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse, s_dmask = cuflash.flash_attn_varlen_func(
        qg, kg, vg, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, window_size=window,
        softcap=softcap, alibi_slopes=slopes, deterministic=deterministic, return_attn_probs=True)
    assert s_dmask.shape == (0,) and s_dmask.dtype == q.dtype and out.shape == q.shape and lse.shape == (h, sum(lens_q))
    dq, dk, dv = torch.autograd.grad(out, (qg, kg, vg), dout)

    def attend(b, qs, ks, vs, dt):
        sl = None if slopes is None else (slopes if slopes.ndim == 1 else slopes[b:b + 1])
        return feature_attention(qs, ks, vs, scale, causal, window, softcap,
                                 None if sl is None else sl.to(torch.float64 if dt == torch.float64
                                                               else torch.float32), dt)

    ref = per_sequence(lens_q, lens_k, q.double(), k.double(), v.double(), dout.double(),
                       torch.float64, attend)
    low = per_sequence(lens_q, lens_k, q, k, v, dout, tdtype, attend)
    what = f"{name} lens={lens_q}x{lens_k}: "
    check_outputs(out, lse, ref, low, what)
    check_grads((dq, dk, dv), ref[2:], low[2:], what)
    return (q, k, v, dout, cu_q, cu_k, slopes), (out, lse, dq, dk, dv)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_varlen_features_forward_backward(case):
    run_case(case, *LENS)


def test_varlen_window_long_sequences():
    """Window blocks skipped per sequence over long sequences (the causal-window kernel again)."""
    run_case(CASES[0], *LONG)
    run_case(CASES[0][:4] + ((300, -1),) + CASES[0][5:], *LONG, seed=1)


def test_varlen_features_deterministic_is_bitwise_reproducible():
    import torch

    case = CASES[0]
    (q, k, v, dout, cu_q, cu_k, _), first = run_case(case, *LENS, deterministic=True)
    for _ in range(2):
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        out = cuflash.flash_attn_varlen_func(qg, kg, vg, cu_q, cu_k, max(LENS[0]), max(LENS[1]),
                                             causal=True, window_size=case[4], deterministic=True)
        grads = torch.autograd.grad(out, (qg, kg, vg), dout)
        for a, b in zip((out, *grads), (first[0], *first[2:])):
            assert torch.equal(a, b)


def test_varlen_features_cupy_numpy_and_torch_agree():
    """CuPy (current stream), NumPy and torch run the same kernels: bitwise the same outputs;
    the explicit backward (CuPy, torch) matches autograd's."""
    import cupy
    import torch

    case = CASES[3]  # ALiBi (nheads,), fp16 d64 GQA: its kernels are built already
    (q, k, v, dout, cu_q, cu_k, slopes), (out, lse, dq, dk, dv) = run_case(case, *LENS)
    mq, mk = max(LENS[0]), max(LENS[1])
    cq, ck, cv, cdo, cs = (cupy.asarray(x) for x in (q, k, v, dout, slopes))
    ccu_q, ccu_k = cupy.asarray(cu_q), cupy.asarray(cu_k)
    cout, clse, _ = cuflash.flash_attn_varlen_func(cq, ck, cv, ccu_q, ccu_k, mq, mk, alibi_slopes=cs,
                                                   return_attn_probs=True)
    assert np.array_equal(cupy.asnumpy(cout).view(np.uint16), out.detach().cpu().numpy().view(np.uint16))
    assert np.array_equal(cupy.asnumpy(clse), lse.cpu().numpy())
    nout, nlse, _ = cuflash.flash_attn_varlen_func(
        *(x.cpu().numpy() for x in (q, k, v, cu_q, cu_k)), mq, mk, alibi_slopes=slopes.cpu().numpy(),
        return_attn_probs=True)
    assert np.array_equal(nout.view(np.uint16), out.detach().cpu().numpy().view(np.uint16))
    got = api.flash_attn_varlen_backward(cdo, cq, ck, cv, cout, clse, ccu_q, ccu_k, mq, mk,
                                         alibi_slopes=cs)
    got_t = api.flash_attn_varlen_backward(dout, q, k, v, out.detach(), lse, cu_q, cu_k, mq, mk,
                                           alibi_slopes=slopes)
    for a, b, c in zip(got, got_t, (dq, dk, dv)):
        torch.testing.assert_close(torch.as_tensor(cupy.asnumpy(a), device="cuda"), c, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(b, c, rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------
# dropout

def run_dropout(case, lens_q, lens_k, seed_offset=(1234, 5)):
    import torch

    name, dtype, d, causal, heads = case
    h, hkv = HEADS[heads]
    tdtype = torch_dtype(dtype)
    q, k, v, dout = packed_inputs(lens_q, lens_k, h, hkv, d, tdtype)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    scale = 1 / math.sqrt(d)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse, s_dmask = cuflash.flash_attn_varlen_func(
        qg, kg, vg, cu_q, cu_k, max(lens_q), max(lens_k), P_DROP, causal=causal,
        return_attn_probs=True, dropout_seed=seed_offset)
    dq, dk, dv = torch.autograd.grad(out, (qg, kg, vg), dout)
    keeps = [torch.from_numpy(dropout.keep_mask(*seed_offset, P_DROP, 1, h, lq, lk, first_batch=b)).cuda()
             for b, (lq, lk) in enumerate(zip(lens_q, lens_k))]

    def attend(b, qs, ks, vs, dt):
        return attention_with_mask(qs, ks, vs, causal, scale, dt, keeps[b], P_DROP)

    ref = per_sequence(lens_q, lens_k, q.double(), k.double(), v.double(), dout.double(),
                       torch.float64, attend)
    low = per_sequence(lens_q, lens_k, q, k, v, dout, tdtype, attend)
    what = f"{name}: "
    check_outputs(out, lse, ref, low, what)
    # dS = P∘(dP∘Z/(1-p) - D), D from O rounded to the input dtype: a residual of about
    # eps·|dO||O| per row where dS is 0 exactly (test_dropout_gpu says more); dQ, dK carry it
    d_scale = (dout.double() * out.detach().double()).sum(-1).abs().max().item() if out.numel() else 0.0
    for gname, a, r, lo, other in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[2:], low[2:], (k, q, None)):
        assert not a.isnan().any(), f"{what}{gname}: unwritten (NaN) elements"
        e = (a.double() - r.double()).abs().max().item()
        bse = (lo.double() - r.double()).abs().max().item()
        floor = torch.finfo(tdtype).eps * max(1.0, r.abs().max().item())
        if other is not None:
            floor = max(floor, torch.finfo(tdtype).eps * d_scale * other.abs().max().item() * scale)
        assert e <= 3 * bse + floor, f"{what}{gname}: error {e:.3g} > 3 x plain {bse:.3g} + {floor:.3g}"
    # S_dmask: (batch, nheads, max_q, max_k), sequence b's probabilities in its corner, dropped
    # ones negated: the sign is the keep mask of batch index b where P > 0
    assert s_dmask.shape == (len(lens_q), h, max(lens_q), max(lens_k))
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        corner = s_dmask[b, :, :lq, :lk]
        visible = corner != 0
        assert torch.equal((corner > 0)[visible], keeps[b][0][visible]), f"{what}S_dmask of sequence {b}"
        assert (s_dmask[b, :, lq:] == 0).all() and (s_dmask[b, :, :, lk:] == 0).all()
    return q, k, v, dout, cu_q, cu_k, (out, lse, dq, dk, dv)


@pytest.mark.parametrize("case", DROP_CASES, ids=[c[0] for c in DROP_CASES])
def test_varlen_dropout_forward_backward(case):
    run_dropout(case, *LENS)


def test_varlen_dropout_equals_the_dense_batch():
    """Equal lengths: the varlen call is the dense batch (same seed): sequence b's keep mask is
    the dense one of batch index b, so the outputs agree (same kernel code, other offsets)."""
    import torch

    case = DROP_CASES[0]
    lens_q, lens_k = [100] * 3, [130] * 3
    q, k, v, dout, cu_q, cu_k, (out, lse, dq, dk, dv) = run_dropout(case, lens_q, lens_k, (77, 3))
    h, hkv = HEADS[case[4]]
    dense = [x.detach().reshape(3, -1, *x.shape[1:]).clone().requires_grad_() for x in (q, k, v)]
    dout_d = dout.reshape(3, -1, *dout.shape[1:])
    o, l, _ = cuflash.flash_attn_func(*dense, P_DROP, causal=case[3], return_attn_probs=True,
                                      dropout_seed=(77, 3))
    grads = torch.autograd.grad(o, dense, dout_d)
    torch.testing.assert_close(o.reshape(out.shape), out.detach(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(l.transpose(0, 1).reshape(h, -1), lse, rtol=1e-4, atol=1e-4)
    for a, b in zip(grads, (dq, dk, dv)):
        torch.testing.assert_close(a.reshape(b.shape), b, rtol=2e-2, atol=2e-2)


def test_varlen_dropout_cupy_with_explicit_seed_matches_torch():
    import cupy
    import torch

    case = DROP_CASES[1]  # fp16: CuPy has no bf16 (a bf16 tensor becomes a void |V2 array)
    q, k, v, dout, cu_q, cu_k, (out, lse, dq, dk, dv) = run_dropout(case, *LENS, seed_offset=(9, 1))
    mq, mk = max(LENS[0]), max(LENS[1])
    cq, ck, cv, cdo = (cupy.asarray(x) for x in (q, k, v, dout))
    ccu_q, ccu_k = cupy.asarray(cu_q), cupy.asarray(cu_k)
    with pytest.raises(ValueError, match="^dropout_seed"):
        cuflash.flash_attn_varlen_func(cq, ck, cv, ccu_q, ccu_k, mq, mk, P_DROP, causal=case[3])
    cout, clse, probs = cuflash.flash_attn_varlen_func(cq, ck, cv, ccu_q, ccu_k, mq, mk, P_DROP,
                                                       causal=case[3], return_attn_probs=True,
                                                       dropout_seed=(9, 1))
    assert np.array_equal(cupy.asnumpy(cout).view(np.uint16), out.detach().cpu().numpy().view(np.uint16))
    assert probs.shape == (len(LENS[0]), HEADS[case[4]][0], mq, mk)
    got = api.flash_attn_varlen_backward(cdo, cq, ck, cv, cout, clse, ccu_q, ccu_k, mq, mk, causal=case[3],
                                         dropout_p=P_DROP, dropout_seed=(9, 1))
    for a, c in zip(got, (dq, dk, dv)):
        torch.testing.assert_close(torch.as_tensor(cupy.asnumpy(a), device="cuda"), c, rtol=2e-2, atol=2e-2)


def test_varlen_features_torch_compile_and_cuda_graph():
    """The feature ops (cuflash::varlen_fwd_features / varlen_bwd_features) under torch.compile
    and CUDA-graph capture (the causal-window kernels of CASES[0])."""
    import torch

    lens_q, lens_k = LENS
    q, k, v, dout = packed_inputs(lens_q, lens_k, 6, 2, 64, torch.bfloat16)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    mq, mk = max(lens_q), max(lens_k)

    def f(q, k, v):
        return cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True,
                                              window_size=(37, -1))

    want = f(q, k, v)
    compiled = torch.compile(f)
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
