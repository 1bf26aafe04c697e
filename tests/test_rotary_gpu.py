"""The rotary embedding kernel (kernels_cu/rotary.cu) through cuflash.layers.rotary, on the GPU.

The error rule: cuflash's output (and gradient) must be within 2x (3x for gradients) the error of
the plain torch formula run in the inputs' dtype (apply_rotary_emb_torch: each product and sum
rounded), both against the float64 reference (cuflash.reference.apply_rotary on the same rounded
inputs), plus a floor of one unit in the last place of the largest output (the kernel rounds once
from fp32, and where the torch formula is exact too the ratio means nothing). Outputs are poisoned
(NaN) before each launch; the pass-through features must be copied bit for bit.

Compile count: 8 modules of one small kernel, each with its one-element and 16-byte-group forms
(a second or two each).
"""
import math

import pytest

torch = pytest.importorskip("torch")

from cuflash import rotary as rotary_op  # noqa: E402
from cuflash.layers.rotary import (RotaryEmbedding, apply_rotary_emb, apply_rotary_emb_kv_,  # noqa: E402
                                   apply_rotary_emb_qkv_, apply_rotary_emb_torch)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
EPS = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}


def tables(seqlen_ro, rotary_dim, dtype, device="cuda"):
    """cos, sin of random angles (any angle: the kernel must not assume a frequency ladder)."""
    angles = torch.rand(seqlen_ro, rotary_dim // 2, device=device, dtype=torch.float64) * 2 * math.pi
    return angles.cos().to(dtype), angles.sin().to(dtype)


def reference(x, cos, sin, **kw):
    """float64 on the CPU (cuflash.reference.apply_rotary through cuflash.rotary's CPU path)."""
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    return rotary_op.apply_rotary(x.cpu().double(), cos.cpu().double(), sin.cpu().double(), **cpu)


def within_rule(got, ref, base, factor):
    """max|got - ref| <= factor · max|base - ref| + one ulp of the largest |ref|."""
    err = (got.double().cpu() - ref).abs().max().item()
    base_err = (base.double().cpu() - ref).abs().max().item()
    floor = EPS[got.dtype] * ref.abs().max().item()
    return err <= factor * base_err + floor, (err, base_err, floor)


# (headdim, rotary_dim): whole head, half the head, odd head dims, rotary_dim / 2 odd
DIMS = [(64, 64), (128, 64), (59, 32), (111, 110), (256, 256), (40, 6)]


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dims", DIMS, ids=[f"d{d}_r{r}" for d, r in DIMS])
def test_forward_backward(dtype, interleaved, dims):
    headdim, rotary_dim = dims
    dt = DTYPES[dtype]
    batch, seqlen, nheads, offset = 3, 77, 5, 11
    x = torch.randn(batch, seqlen, nheads, headdim, device="cuda", dtype=dt, requires_grad=True)
    cos, sin = tables(seqlen + offset + 3, rotary_dim, dt)
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offset)
    assert out.shape == x.shape and out.dtype == dt and not out.isnan().any()
    ref = reference(x.detach(), cos, sin, interleaved=interleaved, seqlen_offsets=offset)
    base = apply_rotary_emb_torch(x.detach(), cos[offset:offset + seqlen], sin[offset:offset + seqlen],
                                  interleaved=interleaved)
    ok, errs = within_rule(out.detach(), ref, base, 2)
    assert ok, errs
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])   # passed through, bit for bit
    dout = torch.randn_like(out)
    (dx,) = torch.autograd.grad(out, x, dout)
    dref = reference(dout, cos, sin, interleaved=interleaved, seqlen_offsets=offset, conjugate=True)
    xb = x.detach().clone().requires_grad_()
    rows = slice(offset, offset + seqlen)
    plain = apply_rotary_emb_torch(xb, cos[rows], sin[rows], interleaved=interleaved)
    (dbase,) = torch.autograd.grad(plain, xb, dout)
    ok, errs = within_rule(dx, dref, dbase, 3)
    assert ok, errs


@pytest.mark.parametrize("offsets", ["int", "int32", "int64"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_varlen_and_offsets(offsets, interleaved):
    """Packed sequences of lengths 0, 1, 37, 200, 5 (cu_seqlens), per-sequence offsets, one of
    them running past the table (those positions keep their features, as in flash-attn)."""
    dt, headdim, rotary_dim, nheads = torch.bfloat16, 72, 48, 3
    lens = [0, 1, 37, 200, 5]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    total, max_seqlen = int(cu[-1]), max(lens)
    x = torch.randn(total, nheads, headdim, device="cuda", dtype=dt)
    cos, sin = tables(260, rotary_dim, dt)
    if offsets == "int":
        seqlen_offsets = 60
    else:
        seqlen_offsets = torch.tensor([3, 0, 250, 60, 7], device="cuda",
                                      dtype=torch.int32 if offsets == "int32" else torch.int64)
    kw = dict(seqlen_offsets=seqlen_offsets, cu_seqlens=cu, max_seqlen=max_seqlen, interleaved=interleaved)
    out = apply_rotary_emb(x, cos, sin, **kw)
    ref = reference(x, cos, sin, **kw)
    assert not out.isnan().any()
    ok, errs = within_rule(out, ref, ref.to(dt), 2)   # the baseline: the reference rounded once
    assert ok, errs
    # in place: the same values, x itself returned
    y = x.clone()
    assert apply_rotary_emb(y, cos, sin, inplace=True, **kw) is y
    assert torch.equal(y, out)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_vector_and_scalar_kernels_agree(interleaved, dtype, monkeypatch):
    """The 16-byte-group kernel (taken where the shape, strides and addresses allow it) and the
    one-element kernel (VECTORIZE off; or a misaligned view, which falls back per call) give the
    same values, within one unit in the last place, and the reference's."""
    dt = DTYPES[dtype]
    base = torch.randn(2 * 50 * 6 * 128 + 8, device="cuda", dtype=dt)
    x = base[:-8].view(2, 50, 6, 128)               # aligned: the vector kernel
    shifted = base[1:-7].view(2, 50, 6, 128)        # one element off: the scalar kernel, per call
    cos, sin = tables(64, 96, torch.float32)        # fp32 tables, pass-through part of 32
    for v in (x, shifted):
        out = apply_rotary_emb(v, cos, sin, interleaved=interleaved, seqlen_offsets=3)
        ref = reference(v, cos, sin, interleaved=interleaved, seqlen_offsets=3)
        err = (out.double().cpu() - ref).abs().max().item()
        assert err <= 4 * EPS[dt] * ref.abs().max().item()   # fp32 arithmetic: a few fp32 ulps
        assert torch.equal(out[..., 96:], v[..., 96:])
    monkeypatch.setattr(rotary_op, "VECTORIZE", False)
    monkeypatch.setattr(rotary_op, "_plans", {})
    scalar = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=3)
    monkeypatch.undo()
    vector = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=3)
    assert (scalar.float() - vector.float()).abs().max().item() <= 2 * EPS[dt] * vector.float().abs().max().item()


def test_varlen_longer_than_max_seqlen_is_covered():
    """A sequence longer than max_seqlen (a caller's mistake) is still rotated whole (the warps
    stride over its rows), never left as uninitialized memory."""
    x = torch.randn(50, 2, 64, device="cuda", dtype=torch.float16)
    cu = torch.tensor([0, 10, 50], dtype=torch.int32, device="cuda")
    cos, sin = tables(64, 64, torch.float16)
    out = apply_rotary_emb(x, cos, sin, cu_seqlens=cu, max_seqlen=20)
    ref = reference(x, cos, sin, cu_seqlens=cu, max_seqlen=20)
    assert (out.double().cpu() - ref).abs().max().item() <= EPS[torch.float16] * ref.abs().max().item()


def test_inplace_strided_views():
    """In place on views: q and k of a packed qkv (head stride d, row stride 3hd), and a tensor
    whose features are not contiguous (copied, rotated, written back)."""
    dt = torch.bfloat16
    qkv = torch.randn(2, 33, 3, 4, 64, device="cuda", dtype=dt)
    cos, sin = tables(40, 32, dt)
    want = [reference(qkv[:, :, i], cos, sin).to(dt) for i in range(2)]
    v = qkv[:, :, 2].clone()
    assert apply_rotary_emb_qkv_(qkv, cos, sin) is qkv
    for i in range(2):
        err = (qkv[:, :, i].float() - want[i].cuda().float()).abs().max().item()
        assert err <= 2 ** -7 * want[i].abs().max().item()
    assert torch.equal(qkv[:, :, 2], v)
    # features with stride 2
    base = torch.randn(2, 9, 3, 64, 2, device="cuda", dtype=dt)
    x = base[..., 0]
    want = reference(x, cos, sin).to(dt).cuda()
    assert apply_rotary_emb(x, cos, sin, inplace=True) is x
    assert (base[..., 0].float() - want.float()).abs().max().item() <= 2 ** -7 * want.abs().max().item()


@pytest.mark.parametrize("layout", ["qkv5", "gqa4", "xpos", "kv"])
def test_packed_forms_match_separate_calls(layout):
    """apply_rotary_emb_qkv_ (5-D, GQA 4-D, with cos_k / sin_k) and apply_rotary_emb_kv_ rotate
    exactly what separate apply_rotary_emb calls rotate, and their backward is the inverse turn."""
    dt = torch.float16
    b, s, h, hk, d = 2, 21, 4, 2, 32
    cos, sin = tables(30, d, dt)
    cos_k, sin_k = tables(30, d, dt)
    if layout == "kv":
        kv = torch.randn(b, s, 2, hk, d, device="cuda", dtype=dt)
        leaf = kv.clone().requires_grad_()
        got = apply_rotary_emb_kv_(leaf.clone(), cos, sin, seqlen_offsets=4)
        assert torch.equal(got[:, :, 0], apply_rotary_emb(kv[:, :, 0], cos, sin, seqlen_offsets=4))
        assert torch.equal(got[:, :, 1], kv[:, :, 1])
    else:
        if layout == "gqa4":
            qkv = torch.randn(b, s, h + 2 * hk, d, device="cuda", dtype=dt)
            q, k, rest, nq = qkv[:, :, :h], qkv[:, :, h:h + hk], qkv[:, :, h + hk:], h
        else:
            qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=dt)
            q, k, rest, nq = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], None
        ck, sk = (cos_k, sin_k) if layout == "xpos" else (None, None)
        want_q = apply_rotary_emb(q, cos, sin, seqlen_offsets=4)
        want_k = apply_rotary_emb(k, cos if ck is None else ck, sin if sk is None else sk, seqlen_offsets=4)
        want_rest = rest.clone()
        leaf = qkv.clone().requires_grad_()
        got = apply_rotary_emb_qkv_(leaf.clone(), cos, sin, ck, sk, seqlen_offsets=4, num_heads_q=nq)
        gq, gk, grest = ((got[:, :, :h], got[:, :, h:h + hk], got[:, :, h + hk:]) if layout == "gqa4"
                         else (got[:, :, 0], got[:, :, 1], got[:, :, 2]))
        assert torch.equal(gq, want_q) and torch.equal(gk, want_k) and torch.equal(grest, want_rest)
    # backward: the gradient turned back (rotation by -θ): for an orthogonal map, <R x, R y> = <x, y>
    g = torch.randn_like(got)
    (dx,) = torch.autograd.grad(got, leaf, g)
    lhs = (dx.double() * leaf.detach().double()).sum().item()
    rhs = (g.double() * got.detach().double()).sum().item()
    assert abs(lhs - rhs) < 1e-2 * g.numel() ** 0.5


def test_module_matches_float64_module():
    """RotaryEmbedding on CUDA (bf16 cache) vs the same module on float64 CPU tensors, xPos and
    GPT-J pairs included, with an int offset."""
    for kw in ({}, {"interleaved": True}, {"scale_base": 512}):
        emb, emb64 = RotaryEmbedding(32, device="cuda", **kw), RotaryEmbedding(32, **kw)
        qkv = torch.randn(2, 40, 3, 4, 48, device="cuda", dtype=torch.bfloat16)
        want = emb64(qkv.cpu().double(), seqlen_offset=5)
        got = emb(qkv.clone(), seqlen_offset=5)
        err = (got.double().cpu() - want).abs().max().item()
        assert err <= 2 ** -6 * want.abs().max().item(), (kw, err)


def test_cuda_graph_replay():
    """The launch is on torch's current stream by raw pointer: a CUDA graph replays it."""
    x = torch.randn(2, 16, 4, 64, device="cuda", dtype=torch.bfloat16)
    cos, sin = tables(16, 64, torch.bfloat16)
    apply_rotary_emb(x, cos, sin)     # the plan (and the compile) before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = apply_rotary_emb(x, cos, sin)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, apply_rotary_emb(x, cos, sin))


def test_bad_input_raises_naming_the_argument():
    x = torch.randn(2, 8, 2, 32, device="cuda", dtype=torch.float16)
    cos, sin = tables(8, 32, torch.float16)
    with pytest.raises(TypeError, match="cos, sin"):
        apply_rotary_emb(x, cos.bfloat16(), sin.bfloat16())
    with pytest.raises(ValueError, match="seqlen_offsets"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=1)       # 1 + 8 rows > seqlen_ro = 8
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary_emb(x, *tables(8, 34, torch.float16))
    with pytest.raises(ValueError, match="cos"):
        apply_rotary_emb(x, cos.cpu(), sin.cpu())
    with pytest.raises(TypeError, match="x"):
        apply_rotary_emb(x.double(), cos.double(), sin.double())
    with pytest.raises(ValueError, match="max_seqlen"):
        apply_rotary_emb(x[0], cos, sin, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32, device="cuda"))
    # fp32 tables with 16-bit x are taken (a superset of flash-attn's same-dtype rule)
    out = apply_rotary_emb(x, cos.float(), sin.float())
    assert out.dtype == torch.float16 and not out.isnan().any()
