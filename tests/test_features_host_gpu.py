"""The feature calls' eager fast path on the GPU (issue 12's host time): flash_attn_func with a window,
softcap, ALiBi or dropout and flash_attn_varlen_func give bitwise the results of the validating route
they skip (out, lse and, with deterministic=True, dq, dk, dv; dropout: the same state drawn after
torch.manual_seed), on the first call of a shape and on repeats. tests/features_bitwise_dump.py
compares against another revision."""
import pytest

torch = pytest.importorskip("torch")

import cuflash  # noqa: E402
from cuflash import torch_ops, varlen_torch  # noqa: E402

pytestmark = pytest.mark.gpu

CASES = {
    "window": dict(causal=True, window_size=(64, 0)),
    "window_sym": dict(window_size=(48, 32)),
    "softcap": dict(causal=True, softcap=30.0),
    "alibi": dict(causal=True, alibi="heads"),
    "alibi_batched": dict(alibi="batch"),
    "dropout": dict(causal=True, dropout_p=0.1),
    "mix_dropout": dict(window_size=(80, 16), alibi="heads", dropout_p=0.17, softcap=20.0),
    "varlen": dict(causal=True, varlen=True),
    "varlen_window": dict(causal=True, varlen=True, window_size=(32, 0)),
    "varlen_alibi_dropout": dict(varlen=True, alibi="heads", dropout_p=0.1),
}
LENS = (200, 1, 0, 133)


def inputs(kw, b=2, sq=333, sk=290, h=4, h_kv=2, d=64):
    g = torch.Generator().manual_seed(5)
    kw = dict(kw)
    varlen = kw.pop("varlen", False)
    alibi = kw.pop("alibi", None)
    if varlen:
        b, shapes = len(LENS), ((sum(LENS), h, d), (sum(LENS), h_kv, d))
        kw["cu"] = torch.tensor([0] + [sum(LENS[:i + 1]) for i in range(len(LENS))],
                                dtype=torch.int32, device="cuda")
    else:
        shapes = ((b, sq, h, d), (b, sk, h_kv, d))
    q = torch.randn(*shapes[0], generator=g).to("cuda", torch.bfloat16).requires_grad_()
    k, v = (torch.randn(*shapes[1], generator=g).to("cuda", torch.bfloat16).requires_grad_()
            for _ in range(2))
    dout = torch.randn(*shapes[0], generator=g).to("cuda", torch.bfloat16)
    if alibi:
        kw["alibi_slopes"] = (torch.rand(h, generator=g) if alibi == "heads"
                              else torch.rand(b, h, generator=g)).to("cuda") * 0.3
    return q, k, v, dout, kw


def call(q, k, v, dout, kw):
    kw = dict(kw)
    cu = kw.pop("cu", None)
    torch.manual_seed(11)
    if cu is not None:
        m = max(LENS)
        out = cuflash.flash_attn_varlen_func(q, k, v, cu, cu, m, m, deterministic=True, **kw)
        lse = None
        if "dropout_p" not in kw:
            lse = cuflash.flash_attn_varlen_func(q, k, v, cu, cu, m, m, return_attn_probs=True,
                                                 **kw)[1]
    else:
        out = cuflash.flash_attn_func(q, k, v, deterministic=True, **kw)
        lse = None
        if "dropout_p" not in kw:
            lse = cuflash.flash_attn_func(q, k, v, return_attn_probs=True, **kw)[1]
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return [x.detach().clone() for x in (out, *grads)] + ([] if lse is None else [lse.clone()])


def bits_equal(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.view(torch.int16) if a.dtype == torch.bfloat16 else a, b.view(torch.int16)
        if b.dtype == torch.bfloat16 else b)


@pytest.mark.parametrize("case", list(CASES))
def test_fast_route_is_bitwise_the_validating_route(case, monkeypatch):
    q, k, v, dout, kw = inputs(CASES[case])
    fast_first = call(q, k, v, dout, kw)
    fast_repeat = call(q, k, v, dout, kw)
    assert torch_ops._feat_plans or varlen_torch._fast_plans
    monkeypatch.setattr(torch_ops, "features_attention", lambda *a: None)
    monkeypatch.setattr(varlen_torch, "fast_attention", lambda *a: None)
    slow = call(q, k, v, dout, kw)
    names = ["out", "dq", "dk", "dv", "lse"]
    for name, a, b, c in zip(names, fast_first, fast_repeat, slow):
        assert bits_equal(a, c), f"{case}: {name} differs from the validating route's"
        assert bits_equal(b, c), f"{case}: {name} of the repeat call differs"
        assert torch.isfinite(a).all() or name == "lse"


def test_sum_backward_and_unused_lse():
    """out.sum().backward() (a stride-0 dout, copied) and an lse output left unused: the gradients
    of the validating route's, no zeros for lse's gradient."""
    q, k, v, dout, kw = inputs(dict(causal=True, softcap=10.0))
    out, lse, _ = cuflash.flash_attn_func(q, k, v, return_attn_probs=True, deterministic=True, **kw)
    out.sum().backward()
    fast = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    args = (0.0, None, True, (-1, -1), 10.0, None, True, True, None, None)
    out2, lse2, _ = cuflash.api._features_func(q, k, v, *args)
    out2.sum().backward()
    assert all(bits_equal(a, x.grad) for a, x in zip(fast, (q, k, v)))
    assert bits_equal(lse, lse2)
