"""Sliding window, softcap and ALiBi in the GPU kernels (fa2_fwd, sm90_fwd, fa2_bwd), the
FlashAttention way.

cuflash's output (and dQ, dK, dV) must be within 2x (3x for gradients) the error of plain
attention with the same features computed in the same low precision, against a float64
reference (the same torch code in float64, on the GPU), on fresh random inputs, with outputs
poisoned (NaN) before each launch. Each forward family is forced with config= (its device
heuristic, the feature flags set by selection); the backward is fa2_bwd, forced with
bwd_config=. The low-precision baseline rounds the scores to the input dtype before
softcapping, as an unfused model (e.g. Gemma 2's eager attention) does.

Compile count: per forward family 6 flag sets x 3 (dtype, head dim) = 18 kernels; run one
family at a time (-k fa2_fwd, -k sm90_fwd, -k backward) to stay within a few minutes.
"""
import math

import pytest

import cuflash
from cuflash import registry

from conftest import device_heuristic, torch_dtype  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

# (id, causal, window, softcap, alibi: None / "h" / "bh")
CASES = [
    ("window", False, (64, 64), 0.0, None),
    ("window_0_0", False, (0, 0), 0.0, None),
    ("window_right_only", False, (-1, 37), 0.0, None),
    ("window_left_only", False, (200, -1), 0.0, None),
    ("causal_window", True, (100, -1), 0.0, None),
    ("softcap30", False, (-1, -1), 30.0, None),
    ("softcap5_causal", True, (-1, -1), 5.0, None),
    ("alibi_h", False, (-1, -1), 0.0, "h"),
    ("alibi_bh_causal", True, (-1, -1), 0.0, "bh"),
    ("all", False, (50, 20), 10.0, "bh"),
    ("all_causal", True, (129, -1), 10.0, "h"),
]
CASE_IDS = [c[0] for c in CASES]
SEQLENS = [(1, 17), (17, 1), (113, 1023), (1023, 113), (2049, 1023)]
HEADS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (4, 1)}
DTYPE_DIMS = [("bf16", 64), ("bf16", 128), ("fp16", 128)]


def slopes_for(alibi, batch, nheads):
    import torch

    if alibi is None:
        return None
    base = torch.tensor([2.0 ** (-8 * (i + 1) / nheads) for i in range(nheads)], device="cuda")
    if alibi == "h":
        return base.float()
    return (base[None] * torch.rand(batch, 1, device="cuda") * 2).float()


def feature_attention(q, k, v, scale, causal, window, softcap, slopes, dtype):
    """Plain attention with the features, (out, lse), in torch ops: float64 is the reference,
    a 16-bit dtype the low-precision baseline (matmuls and the softcapped scores in that dtype,
    softmax in fp32). Bottom-right aligned; rows with no visible key give 0 and LSE = +inf."""
    import torch

    low = dtype != torch.float64
    q, k, v = (x.to(dtype).transpose(1, 2) for x in (q, k, v))  # (b, h, s, d)
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
    diag = i + sk - sq
    if slopes is not None:
        sl = slopes.to(s.dtype)
        sl = sl[None, :, None, None] if sl.ndim == 1 else sl[:, :, None, None]
        s = s - sl * (diag - j).abs().to(s.dtype)
    left, right = window
    if causal:
        right = 0
    keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        keep &= j <= diag + right
    if left >= 0:
        keep &= j >= diag - left
    s = s.masked_fill(~keep, -math.inf)
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    lse = torch.where(l[..., 0] > 0, (m + torch.log(l))[..., 0], torch.full_like(l[..., 0], math.inf))
    p = p / torch.where(l > 0, l, torch.ones_like(l))
    return (p.to(dtype) @ v).transpose(1, 2), lse


def inputs(batch, sq, sk, heads, d, dtype):
    import torch

    h, hkv = HEADS[heads]
    t = torch_dtype(dtype)
    return (torch.randn(batch, sq, h, d, device="cuda", dtype=t),
            torch.randn(batch, sk, hkv, d, device="cuda", dtype=t),
            torch.randn(batch, sk, hkv, d, device="cuda", dtype=t),
            torch.randn(batch, sq, h, d, device="cuda", dtype=t))


def problem_of(op, q, k, case):
    _, causal, window, softcap, alibi = case
    b, sq, h, d = q.shape
    feats = api_features(q, k, case)
    return cuflash.Problem(op, {"torch.bfloat16": "bf16", "torch.float16": "fp16"}[str(q.dtype)],
                           b, sq, k.shape[1], h, k.shape[2], d, feats.causal, features=feats.features,
                           window=feats.window_size, softcap=feats.softcap)


def api_features(q, k, case, slopes=None):
    from cuflash import api

    _, causal, window, softcap, alibi = case
    tq = api.describe("q", q)
    if alibi is not None and slopes is None:
        slopes = slopes_for(alibi, q.shape[0], q.shape[2])
    return api.check_features(tq, 0.0, window, softcap, slopes, causal, q.shape[0], q.shape[2],
                              (q.shape[1], k.shape[1]))


def check_close(ours, ref, low, factor, what=""):
    import torch

    assert not ours.isnan().any(), f"{what}: unwritten (NaN-poisoned) elements"
    top = ref.abs().max().item() if ref.numel() else 0.0
    floor = torch.finfo(ours.dtype).eps * max(top, 2 ** -14) + 1e-5
    err = (ours.double() - ref).abs().max().item() if ref.numel() else 0.0
    base = (low.double() - ref).abs().max().item() if ref.numel() else 0.0
    assert err <= factor * base + floor, \
        f"{what}: error {err:.3g} > {factor} x plain error {base:.3g} + {floor:.3g} (max |ref| {top:.3g})"


def fwd_params():
    out = []
    for fam in registry.families("fwd"):
        if "window" not in fam.features:
            continue
        for dtype, d in DTYPE_DIMS:
            for case in CASES:
                out.append(pytest.param(fam, dtype, d, case, id=f"{fam.name}-{dtype}-d{d}-{case[0]}"))
    return out


@pytest.mark.parametrize("family,dtype,d,case", fwd_params())
def test_forward(family, dtype, d, case):
    """Every case on every seqlen pair and head layout (one compiled kernel per case)."""
    import torch

    _, causal, window, softcap, alibi = case
    for (sq, sk), heads in zip(SEQLENS * 2, list(HEADS) * 4):
        q, k, v, _ = inputs(2, sq, sk, heads, d, dtype)
        slopes = slopes_for(alibi, 2, q.shape[2])
        cfg = device_heuristic(family, problem_of("fwd", q, k, case))
        out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                              softcap=softcap, alibi_slopes=slopes, config=cfg,
                                              return_attn_probs=True)
        scale = d ** -0.5
        ref, ref_lse = feature_attention(q, k, v, scale, causal, window, softcap, slopes, torch.float64)
        low, _ = feature_attention(q, k, v, scale, causal, window, softcap, slopes, q.dtype)
        what = f"{cfg.name} {sq}x{sk} {heads}"
        check_close(out, ref, low, 2, what)
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite), f"{what}: LSE = +inf rows differ"
        assert (lse[finite].double() - ref_lse[finite]).abs().max().item() < 1e-2 if finite.any() else True
        assert (lse[~finite] == math.inf).all(), f"{what}: rows with no key must have LSE = +inf"


def grads(fn, q, k, v, dout):
    import torch

    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    return torch.autograd.grad(out, (q, k, v), dout)


def check_feature_grads(call, q, k, v, dout, causal, window, softcap, slopes, what):
    """dq, dk, dv of call(q, k, v) (an attention output) within 3x the error of feature_attention in
    q's dtype, against it in float64 (head dim scale)."""
    import torch

    ours = grads(call, q, k, v, dout)
    scale = q.shape[-1] ** -0.5
    ref = grads(lambda q, k, v: feature_attention(q, k, v, scale, causal, window, softcap, slopes,
                                                  torch.float64)[0], q, k, v, dout.double())
    low = grads(lambda q, k, v: feature_attention(q, k, v, scale, causal, window, softcap, slopes,
                                                  q.dtype)[0], q, k, v, dout)
    for name, a, r, b in zip(("dq", "dk", "dv"), ours, ref, low):
        check_close(a, r, b, 3, f"{what} {name}")


def bwd_params():
    out = []
    for dtype, d in DTYPE_DIMS:
        for case in CASES:
            out.append(pytest.param(dtype, d, case, id=f"fa2_bwd-{dtype}-d{d}-{case[0]}"))
    return out


@pytest.mark.parametrize("dtype,d,case", bwd_params())
def test_backward(dtype, d, case):
    _, causal, window, softcap, alibi = case
    fam = registry.get("fa2_bwd")
    for (sq, sk), heads in zip(SEQLENS[1:4], ("mha", "gqa", "mqa")):
        q, k, v, dout = inputs(2, sq, sk, heads, d, dtype)
        slopes = slopes_for(alibi, 2, q.shape[2])
        cfg = device_heuristic(fam, problem_of("bwd", q, k, case))
        kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
        check_feature_grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, bwd_config=cfg, **kw),
                            q, k, v, dout, causal, window, softcap, slopes, f"{cfg.name} {sq}x{sk} {heads}")


def test_deterministic_backward_is_bitwise_reproducible():
    """deterministic=True with a window's left bound (the dQ turns start at the band's first
    K/V block), softcap and ALiBi: 10 runs give identical bits."""
    import torch

    q, k, v, dout = inputs(2, 1000, 1100, "gqa", 128, "bf16")
    slopes = slopes_for("bh", 2, q.shape[2])
    kw = dict(causal=True, window_size=(300, -1), softcap=20.0, alibi_slopes=slopes, deterministic=True)
    first = None
    for _ in range(10):
        g = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, **kw), q, k, v, dout)
        if first is None:
            first = g
        else:
            for a, b in zip(first, g):
                assert torch.equal(a, b), "deterministic backward differs between runs"


def test_odd_head_dim_is_padded():
    import torch

    q, k, v, dout = inputs(2, 113, 300, "gqa", 59, "bf16")
    kw = dict(causal=False, window_size=(40, 10), softcap=15.0)
    ours = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, **kw), q, k, v, dout)
    scale = 59 ** -0.5
    ref = grads(lambda q, k, v: feature_attention(q, k, v, scale, False, (40, 10), 15.0, None,
                                                  torch.float64)[0], q, k, v, dout.double())
    low = grads(lambda q, k, v: feature_attention(q, k, v, scale, False, (40, 10), 15.0, None,
                                                  q.dtype)[0], q, k, v, dout)
    for name, a, r, b in zip(("dq", "dk", "dv"), ours, ref, low):
        assert a.shape[-1] == 59
        check_close(a, r, b, 3, name)


def test_cupy_and_numpy_match_torch():
    """CuPy arrays (forward and flash_attn_backward) and NumPy arrays give torch's bits (the same
    kernels and plans; deterministic backward)."""
    import cupy
    import numpy as np
    import torch

    q, k, v, dout = inputs(2, 300, 257, "gqa", 64, "fp16")
    slopes = slopes_for("h", 2, q.shape[2])
    kw = dict(causal=True, window_size=(70, -1), softcap=12.0)
    out_t, lse_t, _ = cuflash.flash_attn_func(q, k, v, alibi_slopes=slopes, return_attn_probs=True, **kw)
    qc, kc, vc, doc = (cupy.from_dlpack(x) for x in (q, k, v, dout))
    sc = cupy.from_dlpack(slopes)
    out_c, lse_c, _ = cuflash.flash_attn_func(qc, kc, vc, alibi_slopes=sc, return_attn_probs=True, **kw)
    assert torch.equal(torch.from_dlpack(out_c), out_t) and torch.equal(torch.from_dlpack(lse_c), lse_t)
    out_n = cuflash.flash_attn_func(*(x.cpu().numpy() for x in (q, k, v)),
                                    alibi_slopes=slopes.cpu().numpy(), **kw)
    assert np.array_equal(out_n, out_t.cpu().numpy())
    g_t = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, alibi_slopes=slopes, deterministic=True,
                                                        **kw), q, k, v, dout)
    g_c = cuflash.flash_attn_backward(doc, qc, kc, vc, out_c, lse_c, None, True, True,
                                      window_size=(70, -1), softcap=12.0, alibi_slopes=sc)
    for a, b in zip(g_t, g_c):
        assert torch.equal(a, torch.from_dlpack(b))


def test_torch_compile_and_cuda_graph_match_eager():
    import torch

    q, k, v, dout = inputs(2, 512, 512, "gqa", 64, "bf16")
    slopes = slopes_for("bh", 2, q.shape[2])

    def loss(q, k, v):
        out = cuflash.flash_attn_func(q, k, v, causal=True, window_size=(128, -1), softcap=30.0,
                                      alibi_slopes=slopes, deterministic=True)
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
    with torch.cuda.stream(side):  # warm-up outside the capture
        loss(*leaves).backward()
    torch.cuda.current_stream().wait_stream(side)
    for x in leaves:
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss(*leaves).backward()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, [x.grad for x in leaves]):
        assert torch.equal(a, b), "CUDA graph gradients differ from eager"
