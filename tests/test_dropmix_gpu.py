"""Dropout together with window / softcap / ALiBi on the GPU (issue 12), the FlashAttention way.

Each call passes an explicit dropout_seed, so its keep mask is known exactly (cuflash.dropout's
mirror of philox.cuh); the float64 reference and the same computation in the inputs' low
precision take that mask with the same features (softcap, then ALiBi, then window / causal,
bottom-right aligned). cuflash's output must be within 2x the low-precision error, the LSE
(plain attention's, with the features) within 1e-3 relative, gradients within 3x (plus the
floor that test_dropout_gpu explains), outputs poisoned (NaN) before each launch; S_dmask's
sign is the mask where P > 0, and 0 outside the window.

On sm_90 the forward runs sm90_fwd where its mixed instantiation compiles without spills (not
softcap at d128: fa2_fwd), the backward sm90_bwd at d128 (not a window without causal, not
deterministic: fa2_bwd); elsewhere fa2_fwd / fa2_bwd. Compile count: about 14 forward +
backward kernels (one pair per CASES entry and the varlen pair); the CuPy and torch.compile
tests reuse them. Under 2 minutes on an H100 with a cold cache.
"""
import math

import numpy as np
import pytest

import cuflash
from cuflash import api, dropout

from conftest import torch_dtype  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

P_DROP = 0.17
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}

# (id, dtype, head dim, causal, window, softcap, alibi None / "h" / "bh", heads, (b, sq, sk), det)
CASES = [
    ("window_causal_bf16_d64_gqa", "bf16", 64, True, (37, -1), 0.0, None, "gqa", (2, 113, 113), False),
    ("window_full_fp16_d128_mqa", "fp16", 128, False, (50, 20), 0.0, None, "mqa", (1, 17, 1023), False),
    ("softcap_causal_bf16_d128_det", "bf16", 128, True, (-1, -1), 30.0, None, "mha", (1, 1023, 1023), True),
    ("alibi_h_fp16_d64_gqa", "fp16", 64, False, (-1, -1), 0.0, "h", "gqa", (2, 113, 77), False),
    ("alibi_bh_causal_bf16_d128", "bf16", 128, True, (-1, -1), 0.0, "bh", "gqa", (2, 113, 1023), False),
    ("all_full_bf16_d128_gqa", "bf16", 128, False, (64, 32), 10.0, "bh", "gqa", (1, 1023, 1023), False),
    ("all_causal_fp16_d64_gqa", "fp16", 64, True, (29, -1), 10.0, "h", "gqa", (2, 17, 113), False),
]


def slopes_of(alibi, batch, nheads):
    import torch

    if alibi is None:
        return None
    base = torch.tensor([2.0 ** (-8 * (i + 1) / nheads) for i in range(nheads)], device="cuda")
    if alibi == "h":
        return base.float()
    return (base[None] * (0.5 + torch.rand(batch, 1, device="cuda"))).float()


def visible_of(sq, sk, causal, window, device):
    import torch

    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    diag = i + sk - sq
    left, right = window
    if causal:
        right = 0
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        keep &= j <= diag + right
    if left >= 0:
        keep &= j >= diag - left
    return keep


def mix_attention(q, k, v, scale, causal, window, softcap, slopes, dtype, keep, p):
    """Attention with the features and dropout given the keep mask (bool (b, h, sq, sk)), (out,
    lse, probs), in torch ops: float64 the reference, a 16-bit dtype the low-precision baseline
    (matmuls and the softcapped scores in it, softmax in fp32); rows with no visible key give 0
    and LSE = +inf; LSE is plain attention's (with the features, before dropout)."""
    import torch

    low = dtype != torch.float64
    q, k, v = (x.to(dtype).transpose(1, 2) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2)
    if softcap:
        s = (softcap * torch.tanh(s * scale / softcap)).to(torch.float32 if low else dtype)
    else:
        s = s.to(torch.float32 if low else dtype) * scale
    sq, sk = q.shape[2], k.shape[2]
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    if slopes is not None:
        sl = slopes.to(s.dtype)
        sl = sl[None, :, None, None] if sl.ndim == 1 else sl[:, :, None, None]
        s = s - sl * (i + sk - sq - j).abs().to(s.dtype)
    s = s.masked_fill(~visible_of(sq, sk, causal, window, q.device), -math.inf)
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    lse = torch.where(l[..., 0] > 0, (m + torch.log(l))[..., 0], torch.full_like(l[..., 0], math.inf))
    probs = e / torch.where(l > 0, l, torch.ones_like(l))
    dropped = probs * keep.to(probs.dtype) / (1.0 - p)
    return (dropped.to(dtype) @ v).transpose(1, 2), lse, probs


def max_err(a, ref):
    return (a.double() - ref.double()).abs().max().item() if a.numel() else 0.0


def check(name, out, lse, grads, ref, low, dout, q, k, scale, dtype):
    """The 2x / 3x rules (test_dropout_gpu's gradient floor: D = rowsum(dO∘O) from O rounded)."""
    import torch

    assert not out.isnan().any() and not lse.isnan().any(), f"{name}: unwritten out / LSE"
    err, base = max_err(out, ref[0]), max_err(low[0], ref[0])
    assert err <= 2 * base + 1e-5, f"{name}: out error {err:.3g} > 2 x plain {base:.3g}"
    finite = torch.isfinite(ref[1])
    assert torch.equal(torch.isfinite(lse), finite), f"{name}: rows with no visible key: LSE = +inf"
    if finite.any():
        top = max(1.0, ref[1][finite].abs().max().item())
        assert max_err(lse[finite], ref[1][finite]) < 1e-3 * top, f"{name}: LSE"
    d_scale = (dout.double() * out.detach().double()).sum(-1).abs().max().item()
    for what, a, r, lo, other in zip(("dq", "dk", "dv"), grads, ref[2:], low[2:], (k, q, None)):
        assert not a.isnan().any(), f"{name} {what}: unwritten (NaN) elements"
        e, bse = max_err(a, r), max_err(lo, r)
        floor = torch.finfo(dtype).eps * max(1.0, r.abs().max().item())
        if other is not None:
            floor = max(floor, torch.finfo(dtype).eps * d_scale * other.abs().max().item() * scale)
        assert e <= 3 * bse + floor, f"{name} {what}: error {e:.3g} > 3 x plain {bse:.3g} + {floor:.3g}"


def run_dense(case, seed_offset=(1234, 5)):
    import torch

    name, dtype, d, causal, window, softcap, alibi, heads, (b, sq, sk), det = case
    h, hkv = HEADS[heads]
    t = torch_dtype(dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device="cuda", dtype=t, generator=g)  # noqa: E731
    q, k, v, dout = rnd(b, sq, h, d), rnd(b, sk, hkv, d), rnd(b, sk, hkv, d), rnd(b, sq, h, d)
    slopes = slopes_of(alibi, b, h)
    scale = 1 / math.sqrt(d)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse, s_dmask = cuflash.flash_attn_func(qg, kg, vg, P_DROP, causal=causal, window_size=window,
                                                softcap=softcap, alibi_slopes=slopes, deterministic=det,
                                                return_attn_probs=True, dropout_seed=seed_offset)
    grads = torch.autograd.grad(out, (qg, kg, vg), dout)
    keep = torch.from_numpy(dropout.keep_mask(*seed_offset, P_DROP, b, h, sq, sk)).cuda()

    def attend(dt):
        xs = [x.detach().to(dt).requires_grad_() for x in (q, k, v)]
        sl = None if slopes is None else slopes.to(torch.float64 if dt == torch.float64 else torch.float32)
        o, l, probs = mix_attention(*xs, scale, causal, window, softcap, sl, dt, keep, P_DROP)
        return (o, l, *torch.autograd.grad(o, xs, dout.to(o.dtype))), probs

    ref, probs = attend(torch.float64)
    low, _ = attend(t)
    check(name, out, lse, grads, ref, low, dout, q, k, scale, t)
    # S_dmask: the probabilities with the features, dropped ones negated; 0 outside the window
    assert s_dmask.shape == (b, h, sq, sk) and s_dmask.dtype == torch.float32
    visible = s_dmask != 0
    assert torch.equal((s_dmask > 0)[visible], keep[visible]), f"{name}: S_dmask's sign is the mask"
    hidden = ~visible_of(sq, sk, causal, window, q.device)
    assert (s_dmask[..., hidden] == 0).all(), f"{name}: S_dmask outside the window"
    assert max_err(s_dmask.abs(), probs) < 2e-2, f"{name}: S_dmask's probabilities"
    return (q, k, v, dout, slopes), (out, lse, *grads)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_dropout_with_features_forward_backward(case):
    run_dense(case)


def test_deterministic_mix_is_bitwise_reproducible():
    """deterministic=True with the mix: the same seed twice gives bitwise equal gradients."""
    import torch

    case = CASES[2]
    (q, k, v, dout, slopes), first = run_dense(case, (3, 4))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out = cuflash.flash_attn_func(qg, kg, vg, P_DROP, causal=case[3], window_size=case[4],
                                  softcap=case[5], alibi_slopes=slopes, deterministic=True,
                                  dropout_seed=(3, 4))
    again = (out, *torch.autograd.grad(out, (qg, kg, vg), dout))
    for a, b in zip(again, (first[0], *first[2:])):
        assert torch.equal(a, b)


def test_cupy_numpy_and_backward_with_the_mix():
    """CuPy with an explicit seed: the torch call's output bit for bit (same kernels, mask and
    features); NumPy through the GPU the same; flash_attn_backward with the forward's seed and
    features gives the torch autograd gradients."""
    import cupy
    import torch

    case = CASES[6]  # fp16 (CuPy has no bf16)
    (q, k, v, dout, slopes), (out, lse, dq, dk, dv) = run_dense(case, (9, 1))
    _, _, _, causal, window, softcap = case[:6]
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    cq, ck, cv, cdo = (cupy.asarray(x) for x in (q, k, v, dout))
    cs = cupy.asarray(slopes)
    cout, clse, probs = cuflash.flash_attn_func(cq, ck, cv, P_DROP, alibi_slopes=cs,
                                                return_attn_probs=True, dropout_seed=(9, 1), **kw)
    assert np.array_equal(cupy.asnumpy(cout).view(np.uint16), out.detach().cpu().numpy().view(np.uint16))
    keep = dropout.keep_mask(9, 1, P_DROP, *probs.shape)
    visible = cupy.asnumpy(probs) != 0
    assert ((cupy.asnumpy(probs) > 0) == keep)[visible].all()
    nout = cuflash.flash_attn_func(*(x.cpu().numpy() for x in (q, k, v)), P_DROP,
                                   alibi_slopes=slopes.cpu().numpy(), dropout_seed=(9, 1), **kw)
    assert np.array_equal(nout, cupy.asnumpy(cout))
    got = api.flash_attn_backward(cdo, cq, ck, cv, cout, clse, alibi_slopes=cs, dropout_p=P_DROP,
                                  dropout_seed=(9, 1), **kw)
    for a, c in zip(got, (dq, dk, dv)):
        torch.testing.assert_close(torch.as_tensor(cupy.asnumpy(a), device="cuda"), c, rtol=2e-2,
                                   atol=2e-2)


def test_torch_compile_fullgraph_with_the_mix():
    """torch.compile(fullgraph=True) through cuflash::fwd_dropout / bwd_dropout with the feature
    arguments: bitwise the eager call (same seed, deterministic backward)."""
    import torch

    case = CASES[5]
    _, dtype, d, causal, window, softcap, alibi, heads, (b, sq, sk), _ = case
    h, hkv = HEADS[heads]
    t = torch_dtype(dtype)
    slopes = slopes_of(alibi, b, h)
    q, k, v = (torch.randn(b, s, n, d, device="cuda", dtype=t).requires_grad_()
               for s, n in ((sq, h), (sk, hkv), (sk, hkv)))
    dout = torch.randn_like(q)

    def f(q, k, v):
        return cuflash.flash_attn_func(q, k, v, P_DROP, causal=causal, window_size=window,
                                       softcap=softcap, alibi_slopes=slopes, deterministic=True,
                                       dropout_seed=(5, 9))

    eager = f(q, k, v)
    eg = torch.autograd.grad(eager, (q, k, v), dout)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v)
    cg = torch.autograd.grad(out, (q, k, v), dout)
    assert torch.equal(out, eager)
    for a, c in zip(cg, eg):
        assert torch.equal(a, c)


def test_varlen_dropout_with_features():
    """flash_attn_varlen_func with dropout + window + softcap + ALiBi (batch, nheads): each
    sequence against the dense reference of it alone, its keep mask that of batch index b."""
    import torch

    lens_q, lens_k = [17, 113, 1, 0, 64], [113, 17, 30, 5, 64]
    h, hkv, d, t = 4, 2, 64, torch.bfloat16
    causal, window, softcap, seed = True, (21, -1), 10.0, (77, 3)
    g = torch.Generator(device="cuda").manual_seed(1)
    rnd = lambda *s: torch.randn(*s, device="cuda", dtype=t, generator=g)  # noqa: E731
    tq, tk = sum(lens_q), sum(lens_k)
    q, k, v, dout = rnd(tq, h, d), rnd(tk, hkv, d), rnd(tk, hkv, d), rnd(tq, h, d)
    cu = lambda lens: torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int32, device="cuda")  # noqa: E731
    slopes = slopes_of("bh", len(lens_q), h)
    scale = 1 / math.sqrt(d)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse, s_dmask = cuflash.flash_attn_varlen_func(
        qg, kg, vg, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), P_DROP, causal=causal,
        window_size=window, softcap=softcap, alibi_slopes=slopes, return_attn_probs=True,
        dropout_seed=seed)
    dq, dk, dv = torch.autograd.grad(out, (qg, kg, vg), dout)
    check_varlen("varlen mix", lens_q, lens_k, (q, k, v, dout), (out, lse, dq, dk, dv, s_dmask), causal, window,
                 softcap, slopes, P_DROP, seed, scale)


def check_varlen(name, lens_q, lens_k, inputs, outputs, causal, window, softcap, slopes, p, seed, scale):
    """Each sequence of a varlen call with the features (and dropout p > 0 with ``seed``: its keep mask that
    of batch index b) against the dense reference of it alone (``check``); S_dmask's sign is the mask; a
    sequence without keys gives 0, LSE +inf and zero dQ, one without queries zero dK, dV."""
    import torch

    (q, k, v, dout), (out, lse, dq, dk, dv, s_dmask) = inputs, outputs
    t, h = q.dtype, q.shape[1]
    cq, ck = np.cumsum([0] + list(lens_q)), np.cumsum([0] + list(lens_k))
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        rows, keys = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if lq == 0:
            assert (dk[keys] == 0).all() and (dv[keys] == 0).all(), f"{name}: dK, dV of sequence {b}"
            continue
        if lk == 0:
            assert (out[rows] == 0).all() and torch.isinf(lse[:, rows]).all() and (dq[rows] == 0).all()
            continue
        keep = (torch.from_numpy(dropout.keep_mask(*seed, p, 1, h, lq, lk, first_batch=b)).cuda() if p
                else torch.ones(1, h, lq, lk, dtype=torch.bool, device=q.device))

        def attend(dt):
            xs = [x[None].detach().to(dt).requires_grad_() for x in (q[rows], k[keys], v[keys])]
            sl = None if slopes is None else (slopes if slopes.ndim == 1 else slopes[b:b + 1]).to(
                torch.float64 if dt == torch.float64 else torch.float32)
            o, l, _ = mix_attention(*xs, scale, causal, window, softcap, sl, dt, keep, p)
            gr = torch.autograd.grad(o, xs, dout[None, rows].to(o.dtype), allow_unused=True)
            gr = [torch.zeros_like(x) if gg is None else gg for gg, x in zip(gr, xs)]
            return (o[0], l[0], *(gg[0] for gg in gr))

        ref, low = attend(torch.float64), attend(t)
        check(f"{name} sequence {b}", out[rows], lse[:, rows], (dq[rows], dk[keys], dv[keys]), ref, low,
              dout[rows], q[rows], k[keys], scale, t)
        if p:
            corner = s_dmask[b, :, :lq, :lk]
            visible = corner != 0
            assert torch.equal((corner > 0)[visible], keep[0][visible]), f"{name}: S_dmask of sequence {b}"
            assert (corner[:, ~visible_of(lq, lk, causal, window, q.device)] == 0).all()
