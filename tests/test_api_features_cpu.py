"""flash-attn 2.8's public API on a machine without a GPU: every entry point (plain, packed,
varlen) with window, softcap, ALiBi, dropout and any head dim <= 256 on torch CPU tensors
against cuflash.reference, gradcheck through the autograd Function, the bert_padding
helpers, argument validation (every error names the argument), and GPU-kind inputs that
raise the unsupported-feature error (or NoGPUError) before any launch."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cuflash  # noqa: E402
from cuflash import (NoGPUError, UnsupportedFeature, _gpu, api, flash_attn_func,  # noqa: E402
                     flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
                     flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func, reference)
from cuflash import torch_ops  # noqa: E402
from cuflash.padding import (index_first_axis, index_put_first_axis, pad_input,  # noqa: E402
                             unpad_input)
from cuflash.select import UnsupportedProblem  # noqa: E402

needs_no_gpu = pytest.mark.skipif(_gpu.available(), reason="a CUDA GPU is usable here: "
                                  "the no-GPU error path cannot be reached")
HAS_VARLEN_REF = hasattr(reference, "attention_varlen_naive") and \
    hasattr(reference, "attention_backward_varlen_naive")
needs_varlen_ref = pytest.mark.skipif(not HAS_VARLEN_REF,
                                      reason="cuflash.reference has no varlen functions yet")


def qkv(b=2, sq=5, sk=7, h=4, hkv=2, d=8, dtype=torch.float64, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(*s, dtype=dtype, generator=g).requires_grad_(grad)  # noqa: E731
    return make(b, sq, h, d), make(b, sk, hkv, d), make(b, sk, hkv, d)


def ref(q, k, v, **kw):
    as64 = lambda x: x.detach().to(torch.float64).numpy()  # noqa: E731
    if "alibi_slopes" in kw and kw["alibi_slopes"] is not None:
        kw["alibi_slopes"] = as64(kw["alibi_slopes"])
    out, lse = reference.attention_naive(as64(q), as64(k), as64(v), return_lse=True, **kw)
    return torch.from_numpy(out), torch.from_numpy(lse)


def slopes(h, b=None):
    s = torch.tensor([2.0 ** -(i + 1) for i in range(h)], dtype=torch.float32)
    return s if b is None else torch.stack([s * (j + 1) for j in range(b)])


FEATURES = {
    "window": dict(window_size=(2, 1)),
    "window_left": dict(window_size=(1, -1)),
    "softcap": dict(softcap=0.7),
    "alibi": dict(alibi_slopes=slopes(4)),
    "alibi_batch": dict(alibi_slopes=slopes(4, 2)),
    "all": dict(window_size=(3, 2), softcap=1.5, alibi_slopes=slopes(4)),
}


# ---------------------------------------------------------------------------------------
# flash_attn_func and the packed variants against the reference

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("shape", [(2, 5, 7), (1, 6, 3)], ids=["sq<sk", "sq>sk"])
def test_features_match_reference(feature, causal, shape):
    b, sq, sk = shape
    kw = dict(FEATURES[feature])
    if feature == "alibi_batch" and b != 2:
        kw["alibi_slopes"] = slopes(4, b)
    q, k, v = qkv(b, sq, sk)
    out, lse, s_dmask = flash_attn_func(q, k, v, causal=causal, softmax_scale=0.4,
                                        return_attn_probs=True, **kw)
    ref_out, ref_lse = ref(q, k, v, causal=causal, softmax_scale=0.4, **kw)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    assert lse.dtype == torch.float32 and lse.shape == (b, 4, sq)
    torch.testing.assert_close(lse, ref_lse.float())
    assert s_dmask.shape == (0,) and s_dmask.dtype == q.dtype and s_dmask.device == q.device
    # positionally, in flash-attn's argument order
    pos = flash_attn_func(q, k, v, 0.0, 0.4, causal, kw.get("window_size", (-1, -1)),
                          kw.get("softcap", 0.0), kw.get("alibi_slopes"), False, False)
    torch.testing.assert_close(pos, out, rtol=0, atol=0)


def test_every_argument_by_keyword():
    q, k, v = qkv()
    out, lse, mask = flash_attn_func(q=q, k=k, v=v, dropout_p=0.0, softmax_scale=None, causal=True,
                                     window_size=(2, 0), softcap=0.5, alibi_slopes=slopes(4),
                                     deterministic=True, return_attn_probs=True)
    ref_out, _ = ref(q, k, v, causal=True, window_size=(2, 0), softcap=0.5, alibi_slopes=slopes(4))
    torch.testing.assert_close(out, ref_out)
    assert mask.shape == (0,) and mask.dtype == q.dtype   # flash-attn's empty S_dmask


@pytest.mark.parametrize("kw", [{}, dict(window_size=(1, 1), softcap=0.5), dict(alibi_slopes=slopes(4))],
                         ids=["plain", "window_softcap", "alibi"])
def test_packed_equal_unpacked(kw):
    b, s, h, d = 2, 6, 4, 8
    qkv_packed = torch.randn(b, s, 3, h, d, dtype=torch.float64, requires_grad=True)
    out = flash_attn_qkvpacked_func(qkv_packed, 0.0, None, True, **kw)
    q, k, v = (qkv_packed[:, :, i].detach().clone().requires_grad_() for i in range(3))
    expect = flash_attn_func(q, k, v, causal=True, **kw)
    torch.testing.assert_close(out, expect, rtol=0, atol=0)
    dout = torch.randn_like(out)
    out.backward(dout)
    expect.backward(dout)
    torch.testing.assert_close(qkv_packed.grad, torch.stack([q.grad, k.grad, v.grad], 2))

    q = torch.randn(b, s, h, d, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(b, s + 2, 2, 2, d, dtype=torch.float64, requires_grad=True)
    out, lse, _ = flash_attn_kvpacked_func(q, kv, causal=False, return_attn_probs=True, **kw)
    k, v = kv[:, :, 0], kv[:, :, 1]
    expect, expect_lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    torch.testing.assert_close(out, expect, rtol=0, atol=0)
    torch.testing.assert_close(lse, expect_lse, rtol=0, atol=0)
    out.sum().backward()
    assert kv.grad.shape == kv.shape and q.grad.shape == q.shape


def test_plain_path_skips_feature_checks(monkeypatch):
    """Default feature arguments never reach the feature validation (the hot path)."""
    def boom(*a, **kw):
        raise AssertionError("feature path taken")

    monkeypatch.setattr(api, "_features_func", boom)
    q, k, v = qkv()
    out, lse, probs = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert probs.shape == (0,) and probs.dtype == q.dtype and out.shape == q.shape


@pytest.mark.parametrize("window,causal,expect_causal", [
    ((-1, 0), False, True),        # flash-attn: causal is the window (-1, 0)
    ((-1, -1), True, True),
    ((-1, 5), True, True),          # causal sets right = 0
    ((6, -1), False, False),        # left >= seqlen_k - 1: every key
    ((100, 100), True, True),
])
def test_window_that_is_no_window(window, causal, expect_causal):
    """Windows that mask nothing beyond causal are plain calls (the GPU kernels run them)."""
    q, k, v = qkv(sk=7)
    out = flash_attn_func(q, k, v, causal=causal, window_size=window)
    torch.testing.assert_close(out, flash_attn_func(q, k, v, causal=expect_causal), rtol=0, atol=0)
    torch.testing.assert_close(out, ref(q, k, v, causal=causal, window_size=window)[0])
    qn, kn, vn = (x.numpy().astype(np.float16) for x in (q, k, v))
    if not _gpu.available():  # a plain problem: the GPU error, not the feature error
        with pytest.raises(NoGPUError):
            flash_attn_func(qn, kn, vn, causal=causal, window_size=window)


# ---------------------------------------------------------------------------------------
# head dims that are not a multiple of 8

@pytest.mark.parametrize("d", [1, 5, 12, 60, 100, 250])
def test_any_head_dim_on_cpu(d):
    q, k, v = qkv(1, 4, 6, 2, 1, d)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    ref_out, ref_lse = ref(q, k, v, causal=True)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse.float())
    # default scale: 1/sqrt(the real head dim)
    torch.testing.assert_close(out, flash_attn_func(q, k, v, causal=True, softmax_scale=d ** -0.5))


def test_odd_head_dim_gradcheck():
    q, k, v = qkv(1, 3, 4, 2, 1, 5, grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: flash_attn_func(q, k, v, causal=True), (q, k, v))


@needs_no_gpu
@pytest.mark.parametrize("d", [4, 60, 250])
def test_odd_head_dim_gpu_input_reaches_no_gpu_error(d):
    q, k, v = (x.numpy().astype(np.float16) for x in qkv(d=d))
    with pytest.raises(NoGPUError):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("kind", ["numpy", "bf16"])
def test_pad_and_slice_head_dim(kind):
    """The zero padding the GPU path uses: a fresh copy, caller's array untouched, 16-bit words."""
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 10)).astype(np.float16)[:, ::2]
    if kind == "bf16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        x = x.astype(ml_dtypes.bfloat16)
    before = x.copy()
    p = api.pad_head_dim(x, 16)
    assert p.shape == (2, 2, 4, 16) and p.dtype == x.dtype and p.flags.c_contiguous
    assert (p[..., 10:].view(np.uint16) == 0).all()
    assert (p[..., :10].view(np.uint16) == x.view(np.uint16)).all()
    s = api.slice_head_dim(p, 10)
    assert s.flags.c_contiguous and (s.view(np.uint16) == x.view(np.uint16)).all()
    assert (x.view(np.uint16) == before.view(np.uint16)).all()
    assert [api.padded_head_dim(d) for d in (1, 8, 60, 250, 256, 257, 260)] == \
        [8, 8, 64, 256, 256, 257, 260]


# ---------------------------------------------------------------------------------------
# gradcheck (float64) through the autograd Function

@pytest.mark.parametrize("feature", ["window", "softcap", "alibi", "all"])
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_features(feature, causal):
    kw = dict(FEATURES[feature])
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = slopes(2)
    q, k, v = qkv(1, 4, 5, 2, 1, 8, grad=True)
    fn = lambda q, k, v: flash_attn_func(q, k, v, causal=causal, **kw)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))


# ---------------------------------------------------------------------------------------
# dropout

def test_dropout_reproducible_and_mask_consistent():
    q, k, v = qkv(2, 5, 6, 4, 2, 8, grad=True)
    torch.manual_seed(7)
    out, lse, mask = flash_attn_func(q, k, v, dropout_p=0.3, causal=True, return_attn_probs=True)
    torch.manual_seed(7)
    out2, _, mask2 = flash_attn_func(q, k, v, dropout_p=0.3, causal=True, return_attn_probs=True)
    assert mask.dtype == torch.bool and mask.shape == (2, 4, 5, 6)
    assert torch.equal(mask, mask2) and torch.equal(out, out2)
    assert 0.4 < mask.float().mean().item() < 0.95           # ~70 % kept
    as64 = lambda x: x.detach().numpy()  # noqa: E731
    ref_out, ref_lse = reference.attention_naive(as64(q), as64(k), as64(v), causal=True,
                                                 return_lse=True, dropout_p=0.3,
                                                 dropout_mask=mask.numpy())
    torch.testing.assert_close(out, torch.from_numpy(ref_out), rtol=0, atol=0)
    torch.testing.assert_close(lse, torch.from_numpy(ref_lse).float())   # the undropped LSE
    torch.manual_seed(8)
    other = flash_attn_func(q, k, v, dropout_p=0.3, causal=True)
    assert not torch.equal(other, out)
    # the backward uses the forward's mask
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = reference.attention_backward_naive(as64(dout), as64(q), as64(k), as64(v), causal=True,
                                                   dropout_p=0.3, dropout_mask=mask.numpy())
    for a, b in zip((dq, dk, dv), ref_grads):
        torch.testing.assert_close(a, torch.from_numpy(b))
    # without return_attn_probs: the same draw
    torch.manual_seed(7)
    torch.testing.assert_close(flash_attn_func(q, k, v, 0.3, causal=True), out, rtol=0, atol=0)


def test_dropout_gradcheck():
    q, k, v = qkv(1, 3, 4, 2, 1, 8, grad=True)

    def fn(q, k, v):
        torch.manual_seed(3)  # the same mask on every evaluation
        return flash_attn_func(q, k, v, dropout_p=0.25, window_size=(2, 1))

    assert torch.autograd.gradcheck(fn, (q, k, v))


# ---------------------------------------------------------------------------------------
# varlen

def _cu(lengths):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)


def _varlen_inputs(lens_q, lens_k, h=4, hkv=2, d=8, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(*s, dtype=torch.float64, generator=g).requires_grad_(grad)  # noqa: E731
    return (make(sum(lens_q), h, d), make(sum(lens_k), hkv, d), make(sum(lens_k), hkv, d),
            _cu(lens_q), _cu(lens_k))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kw", [{}, dict(window_size=(2, 1)), dict(softcap=0.6),
                                dict(alibi_slopes=slopes(4, 5))],
                         ids=["plain", "window", "softcap", "alibi"])
def test_varlen_matches_per_sequence_calls(causal, kw):
    rng = np.random.default_rng(1)
    lens_q = [0, 1, 5, 3, 1]
    lens_k = [2, 1, 4, 7, 0]
    rng.shuffle(lens_q)
    q, k, v, cu_q, cu_k = _varlen_inputs(lens_q, lens_k)
    out, lse, mask = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k) + 2,
                                            softmax_scale=0.5, causal=causal,
                                            return_attn_probs=True, **kw)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0]) and lse.dtype == torch.float32
    assert mask.shape == (0,) and mask.dtype == q.dtype
    for i in range(len(lens_q)):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        kwi = dict(kw)
        if "alibi_slopes" in kw:
            kwi["alibi_slopes"] = kw["alibi_slopes"][i]
        o, l, _ = flash_attn_func(q[qs][None], k[ks][None], v[ks][None], softmax_scale=0.5,
                                  causal=causal, return_attn_probs=True, **kwi)
        torch.testing.assert_close(out[qs], o[0])
        torch.testing.assert_close(lse[:, qs], l[0])


@needs_varlen_ref
def test_varlen_matches_reference_and_packed():
    lens = [3, 0, 1, 6]
    q, k, v, cu, _ = _varlen_inputs(lens, lens, h=2, hkv=2)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, 0.0, None, True, (2, 0),
                                         return_attn_probs=True)
    ref_out, ref_lse = reference.attention_varlen_naive(q.numpy(), k.numpy(), v.numpy(), cu.numpy(),
                                                        cu.numpy(), causal=True, return_lse=True,
                                                        window_size=(2, 0))
    torch.testing.assert_close(out, torch.from_numpy(ref_out))
    torch.testing.assert_close(lse, torch.from_numpy(ref_lse).float())
    packed = torch.stack([q, k, v], 1)
    torch.testing.assert_close(flash_attn_varlen_qkvpacked_func(packed, cu, 6, causal=True,
                                                                window_size=(2, 0)), out,
                               rtol=0, atol=0)
    kv = torch.stack([k, v], 1)
    torch.testing.assert_close(flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 6, 6, 0.0, None, True,
                                                               (2, 0)), out, rtol=0, atol=0)
    # keyword call
    torch.testing.assert_close(
        flash_attn_varlen_func(q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6,
                               max_seqlen_k=6, causal=True, window_size=(2, 0), block_table=None),
        out, rtol=0, atol=0)


@needs_varlen_ref
@pytest.mark.parametrize("kw", [{}, dict(window_size=(1, 1), softcap=0.5, alibi_slopes=slopes(2))],
                         ids=["plain", "features"])
def test_varlen_gradcheck(kw):
    q, k, v, cu_q, cu_k = _varlen_inputs([2, 0, 3], [3, 1, 2], h=2, hkv=1, d=4, grad=True)
    fn = lambda q, k, v: flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, causal=True, **kw)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))


@needs_varlen_ref
def test_varlen_dropout():
    q, k, v, cu_q, cu_k = _varlen_inputs([2, 4], [3, 5], grad=True)
    torch.manual_seed(0)
    out, _, mask = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 5, 0.2, return_attn_probs=True)
    torch.manual_seed(0)
    again = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 5, 0.2)
    assert mask.dtype == torch.bool and mask.shape == (2, 4, 4, 5)
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    for i in range(2):  # sequence i uses the top-left corner of its mask
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        sq, sk = qs.stop - qs.start, ks.stop - ks.start
        o = reference.attention_naive(q[qs][None].detach().numpy(), k[ks][None].detach().numpy(),
                                      v[ks][None].detach().numpy(), dropout_p=0.2,
                                      dropout_mask=mask[i:i + 1, :, :sq, :sk].numpy())
        torch.testing.assert_close(out[qs], torch.from_numpy(o[0]))
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


# ---------------------------------------------------------------------------------------
# bert_padding helpers

def test_unpad_pad_round_trip():
    b, s, h, d = 3, 6, 2, 4
    x = torch.randn(b, s, h, d, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    x_unpad, indices, cu, max_len, used = unpad_input(x, mask)
    assert x_unpad.shape == (9, h, d)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 9, 9]
    assert max_len == 6 and isinstance(max_len, int) and used.tolist() == [3, 6, 0]
    assert indices.tolist() == [0, 1, 2, 6, 7, 8, 9, 10, 11]
    back = pad_input(x_unpad, indices, b, s)
    torch.testing.assert_close(back, x * mask[:, :, None, None])
    back.sum().backward()
    torch.testing.assert_close(x.grad, mask[:, :, None, None].expand_as(x).double())
    # unused_mask: allocated but unused tokens are kept, not counted in seqused
    unused = torch.zeros_like(mask)
    unused[0, 3] = True
    _, idx, cu, max_len, used = unpad_input(x, mask, unused)
    assert cu.tolist() == [0, 4, 10, 10] and used.tolist() == [3, 6, 0] and 3 in idx.tolist()
    assert cuflash.unpad_input is unpad_input and cuflash.pad_input is pad_input


def test_index_first_axis_gradcheck():
    x = torch.randn(6, 2, 3, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([4, 0, 2])
    assert torch.autograd.gradcheck(lambda x: index_first_axis(x, idx), (x,))
    vals = torch.randn(3, 2, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: index_put_first_axis(v, idx, 6), (vals,))
    torch.testing.assert_close(index_first_axis(x, idx), x[idx])
    assert cuflash.index_first_axis is index_first_axis


def test_varlen_through_unpad_equals_padded_call():
    """flash-attn's recipe: unpad, varlen, pad back == the padded call on the valid rows
    (keys of padding masked out by the varlen lengths)."""
    b, s, h, d = 2, 5, 2, 8
    q, k, v = qkv(b, s, s, h, h, d)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    qu, idx, cu, m, _ = unpad_input(q, mask)
    ku, vu = unpad_input(k, mask)[0], unpad_input(v, mask)[0]
    out = pad_input(flash_attn_varlen_func(qu, ku, vu, cu, cu, m, m, causal=True), idx, b, s)
    torch.testing.assert_close(out[0], flash_attn_func(q[:1], k[:1], v[:1], causal=True)[0])
    torch.testing.assert_close(out[1, :2], flash_attn_func(q[1:, :2], k[1:, :2], v[1:, :2],
                                                           causal=True)[0])
    assert not out[1, 2:].any()


# ---------------------------------------------------------------------------------------
# bad arguments name themselves, before any work

@pytest.fixture
def no_reference(monkeypatch):
    def no_work(*a, **kw):
        raise AssertionError("the reference ran on invalid input")

    monkeypatch.setattr(torch_ops, "_ref_forward", no_work)
    monkeypatch.setattr(torch_ops, "_fwd_reference", no_work)


@pytest.mark.parametrize("kw,error,pattern", [
    (dict(dropout_p=1.0), ValueError, r"^dropout_p must be in \[0, 1\)"),
    (dict(dropout_p=-0.1), ValueError, r"^dropout_p must be in"),
    (dict(dropout_p="x"), TypeError, r"^dropout_p must be"),
    (dict(dropout_p=True), TypeError, r"^dropout_p must be"),
    (dict(window_size=(2,)), TypeError, r"^window_size must be a pair"),
    (dict(window_size=(2.0, 1)), TypeError, r"^window_size must be a pair"),
    (dict(window_size=5), TypeError, r"^window_size must be a pair"),
    (dict(window_size=(-2, 0)), ValueError, r"^window_size must be >= -1"),
    (dict(softcap=-1.0), ValueError, r"^softcap must be a finite number >= 0"),
    (dict(softcap=math.inf), ValueError, r"^softcap must be a finite number"),
    (dict(softcap=[1.0]), TypeError, r"^softcap must be"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float64)), TypeError, r"^alibi_slopes: dtype must be float32"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, r"^alibi_slopes: expected shape \(nheads,\) = \(4,\)"),
    (dict(alibi_slopes=torch.ones(3, 4)), ValueError, r"^alibi_slopes: expected shape"),
    (dict(alibi_slopes=np.ones(4, np.float32)), TypeError, r"^alibi_slopes: expected a torch array"),
])
def test_bad_feature_arguments(no_reference, kw, error, pattern):
    q, k, v = qkv()
    with pytest.raises(error, match=pattern):
        flash_attn_func(q, k, v, **kw)


@pytest.mark.parametrize("change,error,pattern", [
    (dict(cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int64)), TypeError, r"^cu_seqlens_q: dtype must be int32"),
    (dict(cu_seqlens_q=np.array([0, 2, 5], np.int32)), TypeError, r"^cu_seqlens_q: expected a torch array"),
    (dict(cu_seqlens_q=torch.tensor([[0, 2, 5]], dtype=torch.int32)), ValueError, r"^cu_seqlens_q: expected a 1-D"),
    (dict(cu_seqlens_q=torch.tensor([1, 2, 5], dtype=torch.int32)), ValueError, r"^cu_seqlens_q: must start at 0"),
    (dict(cu_seqlens_q=torch.tensor([0, 3, 2, 5], dtype=torch.int32)), ValueError, r"^cu_seqlens_q: must start at 0, never decrease"),
    (dict(cu_seqlens_q=torch.tensor([0, 2, 4], dtype=torch.int32)), ValueError, r"^cu_seqlens_q: .* end at the total number of tokens 5"),
    (dict(cu_seqlens_k=torch.tensor([0, 6], dtype=torch.int32)), ValueError, r"^cu_seqlens_k: expected batch \+ 1 = 3"),
    (dict(cu_seqlens_k=torch.tensor([0, 2, 7], dtype=torch.int32)), ValueError, r"^cu_seqlens_k: .*tokens 6"),
    (dict(max_seqlen_q=2), ValueError, r"^max_seqlen_q=2 is less than the longest sequence \(3 tokens\)"),
    (dict(max_seqlen_k=3.0), TypeError, r"^max_seqlen_k must be an int"),
    (dict(max_seqlen_k=True), TypeError, r"^max_seqlen_k must be an int"),
    (dict(q=torch.zeros(1, 5, 4, 8, dtype=torch.float64)), ValueError, r"^q: expected 3 dimensions \(total_tokens"),
    (dict(k=torch.zeros(6, 2, 4, dtype=torch.float64)), ValueError, r"^k, v: headdim must match"),
    (dict(alibi_slopes=torch.ones(3, 4)), ValueError, r"^alibi_slopes: expected shape .* \(batch, nheads\) = \(2, 4\)"),
    (dict(block_table=torch.zeros(2, 1, dtype=torch.int32)), ValueError, r"^k: expected 4 dimensions \(num_blocks"),
])
def test_bad_varlen_arguments(no_reference, change, error, pattern):
    args = dict(q=torch.zeros(5, 4, 8, dtype=torch.float64), k=torch.zeros(6, 2, 8, dtype=torch.float64),
                v=torch.zeros(6, 2, 8, dtype=torch.float64),
                cu_seqlens_q=torch.tensor([0, 3, 5], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 2, 6], dtype=torch.int32), max_seqlen_q=3, max_seqlen_k=4)
    args.update(change)
    with pytest.raises(error, match=pattern):
        flash_attn_varlen_func(**args)


def test_bad_packed_shapes():
    with pytest.raises(ValueError, match=r"^qkv: expected shape \(batch, seqlen, 3"):
        flash_attn_qkvpacked_func(torch.zeros(1, 4, 2, 2, 8))
    with pytest.raises(ValueError, match=r"^kv: expected shape \(batch, seqlen_k, 2"):
        flash_attn_kvpacked_func(torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 3, 2, 8))
    with pytest.raises(ValueError, match=r"^qkv: expected shape \(total_tokens, 3"):
        flash_attn_varlen_qkvpacked_func(torch.zeros(4, 2, 8), torch.tensor([0, 4], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match=r"^kv: expected shape \(total_tokens_k, 2"):
        flash_attn_varlen_kvpacked_func(torch.zeros(4, 2, 8), torch.zeros(4, 2, 8),
                                        torch.tensor([0, 4], dtype=torch.int32),
                                        torch.tensor([0, 4], dtype=torch.int32), 4, 4)


# ---------------------------------------------------------------------------------------
# GPU-kind inputs: the unsupported-feature error (or NoGPUError), never a silent fallback

def np_qkv(**kw):
    return tuple(x.numpy().astype(np.float16) for x in qkv(**kw))


@pytest.mark.parametrize("kw", [dict(dropout_p=0.1, window_size=(2, 1)),
                                dict(dropout_p=0.1, softcap=0.5),
                                dict(dropout_p=0.1, alibi_slopes=np.ones(4, np.float32))])
def test_numpy_dropout_with_features_reaches_the_gpu(kw, monkeypatch):
    """Dropout with window / softcap / ALiBi runs the kernels: NumPy input needs its
    dropout_seed (named before the GPU), then a GPU; the packed variant too."""
    def require(what):
        raise NoGPUError(f"{what}: no GPU")
    monkeypatch.setattr(_gpu, "require", require)
    q, k, v = np_qkv()
    with pytest.raises(ValueError, match=r"^dropout_seed: numpy inputs with dropout_p > 0 need"):
        flash_attn_func(q, k, v, **kw)
    with pytest.raises(NoGPUError, match="flash_attn_func"):
        flash_attn_func(q, k, v, dropout_seed=(1, 2), **kw)
    packed = np.stack([q, q, q], 2)
    with pytest.raises(NoGPUError, match="flash_attn_func"):
        flash_attn_qkvpacked_func(packed, dropout_seed=1, **kw)


@pytest.mark.parametrize("kw", [dict(window_size=(2, 1)), dict(softcap=0.5),
                                dict(alibi_slopes=np.ones(4, np.float32)),
                                dict(window_size=(2, 1), softcap=0.5, causal=True)])
def test_numpy_window_softcap_alibi_reach_the_gpu(kw, monkeypatch):
    """Window, softcap and ALiBi run on the GPU kernels: NumPy input validates, then needs a GPU."""
    def require(what):
        raise NoGPUError(f"{what}: no GPU")
    monkeypatch.setattr(_gpu, "require", require)
    q, k, v = np_qkv()
    with pytest.raises(NoGPUError, match="flash_attn_func"):
        flash_attn_func(q, k, v, **kw)


def test_numpy_varlen_names_it(monkeypatch):
    monkeypatch.setattr(_gpu, "require", lambda what: pytest.fail("reached the GPU"))
    q, k, v = (x[0] for x in np_qkv(b=1, sq=5, sk=5))
    cu = np.array([0, 2, 5], np.int32)
    # varlen alone runs the varlen kernels: validated, then the GPU is asked for
    with pytest.raises(pytest.fail.Exception, match="reached the GPU"):
        flash_attn_varlen_func(q, k, v, cu, cu, 3, 3)
    # with window, softcap or ALiBi it runs the varlen kernels too, and so does dropout with a
    # window
    with pytest.raises(pytest.fail.Exception, match="reached the GPU"):
        flash_attn_varlen_func(q, k, v, cu, cu, 3, 3, window_size=(1, 1))
    with pytest.raises(pytest.fail.Exception, match="reached the GPU"):
        flash_attn_varlen_func(q, k, v, cu, cu, 3, 3, dropout_p=0.5, window_size=(1, 1),
                               dropout_seed=1)
    with pytest.raises(ValueError, match=r"^cu_seqlens_k: must start at 0"):  # validated first
        flash_attn_varlen_func(q, k, v, cu, cu[::-1].copy(), 3, 3)
    with pytest.raises(TypeError, match=r"^alibi_slopes: dtype must be float32"):
        flash_attn_varlen_func(q, k, v, cu, cu, 3, 3, alibi_slopes=np.ones(4))


def test_feature_problem_is_rejected_by_the_families():
    """The features enter Problem.features; the registered families refuse them by name."""
    from cuflash.registry import families

    p = cuflash.Problem("fwd", "bf16", 1, 128, 128, 4, 4, 64, features=("dropout", "paged"))
    for fam in families():
        why = fam.supports((9, 0), p.replace(op=fam.op))
        assert "dropout" in why or "paged" in why or "op" in why


def test_window_size_as_an_array_or_list_is_read_as_a_pair():
    """A NumPy array or a list window_size is validated like a tuple (no ambiguous truth value);
    the default given as a list is no window."""
    torch = pytest.importorskip("torch")
    q = torch.randn(1, 8, 2, 16, dtype=torch.float64)
    out = flash_attn_func(q, q, q, window_size=[-1, -1])        # torch CPU: the reference
    assert torch.allclose(out, flash_attn_func(q, q, q))
    with pytest.raises(TypeError, match=r"^window_size must be a pair"):
        flash_attn_func(q, q, q, window_size=np.array([1.5, 2.0]))


def test_gpu_supported_pads_odd_head_dims():
    """An odd head dim with features runs on the GPU zero-padded (as the torch paths do), so the
    gate must not refuse it before padding."""
    from cuflash.api import gpu_supported
    from cuflash.problem import Problem

    p = Problem("fwd", "bf16", 2, 113, 300, 6, 2, 59, False, features=("softcap", "window"),
                window=(40, 10), softcap=15.0)
    assert gpu_supported(p)
    assert gpu_supported(p.replace(op="bwd"))


def test_gpu_sanitize_forces_the_heuristic_of_the_calls_features():
    """tests/gpu_sanitize.py --features forces each forward family's heuristic: for the call's
    features (as the API selects), not the plain problem's (sm90_fwd's BN with window + ALiBi,
    fa2_fwd's Bc with dropout at d 64 and sm90_fwd's BN with dropout differ; the plain ones
    spill)."""
    pytest.importorskip("torch")
    import gpu_sanitize
    from cuflash import registry

    sm90, fa2 = registry.get("sm90_fwd"), registry.get("fa2_fwd")
    by_spec = {}
    for spec in gpu_sanitize.FEATURES:
        for shape in gpu_sanitize.FEATURE_SHAPES:
            p = gpu_sanitize.feature_problem("bf16", *shape, spec)
            assert p.features == tuple(sorted(p.features)) and p.head_dim % 8 == 0
            for fam in (sm90, fa2):
                if not fam.supports((9, 0), p):
                    by_spec.setdefault(fam.name, []).append(
                        (tuple(sorted(spec)), p.head_dim, fam.heuristic(p, (9, 0))))
    wa = gpu_sanitize.feature_problem("bf16", 2, 203, 130, 4, 2, 128,
                                      dict(alibi_slopes="batch", window_size=(50, 50)))
    assert wa.features == ("alibi", "window") and sm90.heuristic(wa, (9, 0)).BN == 128
    drop = gpu_sanitize.feature_problem("bf16", 1, 17, 113, 4, 1, 64, dict(dropout_p=0.17))
    assert drop.features == ("dropout",) and sm90.supports((9, 0), drop) == ""
    assert fa2.heuristic(drop, (8, 0)).Bc == 32
    # d 64: dropout's BN is the plain one since the 32-key Philox layout; d 128: narrower
    # (the plain call at more keys than SHORT_KEYS_MAX: below them plain calls take short_keys_bn's width)
    assert sm90.heuristic(drop, (9, 0)).BN == 192 == sm90.heuristic(drop.replace(features=(), seqlen_k=1000),
                                                                   (9, 0)).BN
    drop128 = drop.replace(head_dim=128)
    # (the plain d128 call below 16k keys runs BN 160 too: the dynamic schedule with the TMA store)
    assert sm90.heuristic(drop128, (9, 0)).BN == 160 < sm90.heuristic(
        drop128.replace(features=(), seqlen_k=16384), (9, 0)).BN
    assert any("dropout_p" in keys for keys, _, _ in by_spec["sm90_fwd"])   # sm90_fwd runs dropout too


def test_unsupported_features_name_the_features_not_an_odd_head_dim():
    """An odd head dim is padded on the GPU paths: when the features themselves are what no
    family runs (dropout with a paged cache), the error gives the families' reasons for them,
    not 'headdim must be a multiple of 8'."""
    from cuflash.api import UnsupportedFeature, raise_unsupported
    from cuflash.problem import Problem

    p = Problem("fwd", "bf16", 1, 8, 8, 2, 2, 59, features=("dropout", "paged"), dropout_p=0.1)
    with pytest.raises(UnsupportedFeature, match=r"^dropout_p, block_table: .*no feature") as info:
        raise_unsupported(p, {})
    assert "multiple of 8" not in str(info.value)
