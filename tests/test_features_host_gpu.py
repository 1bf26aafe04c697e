"""The feature calls' eager fast path on the GPU (issue 12's host time): flash_attn_func with a window,
softcap, ALiBi or dropout and flash_attn_varlen_func give bitwise the results of the validating route
they skip (out, lse and, with deterministic=True, dq, dk, dv; dropout: the same state drawn after
torch.manual_seed), on the first call of a shape and on repeats. tests/features_bitwise_dump.py (whose
inputs and calls these are) compares against another revision."""
import os
import sys

import pytest

torch = pytest.importorskip("torch")

import cuflash  # noqa: E402
from cuflash import torch_ops, varlen_torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import features_bitwise_dump as dump  # noqa: E402

pytestmark = pytest.mark.gpu

CASES = {
    "window": dict(causal=True, window_size=(64, 0)),
    "window_sym": dict(window_size=(48, 32)),
    "softcap": dict(causal=True, softcap=30.0),
    "alibi": dict(causal=True, alibi="heads"),
    "alibi_batched": dict(alibi="batch"),
    "dropout": dict(causal=True, dropout_p=0.1, manual_seed=11),
    "mix_dropout": dict(window_size=(80, 16), alibi="heads", dropout_p=0.17, softcap=20.0,
                        manual_seed=11),
    "varlen": dict(causal=True, varlen=True),
    "varlen_window": dict(causal=True, varlen=True, window_size=(32, 0)),
    "varlen_alibi_dropout": dict(varlen=True, alibi="heads", dropout_p=0.1, manual_seed=11),
}
SHAPE = 1   # dump.SHAPES[1]: batch 2, seqlen 333 x 290, 4 heads over 2 KV heads, d 64; varlen LENS[1]


def bits(x):
    x = x.detach()
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


@pytest.mark.parametrize("case", list(CASES))
def test_fast_route_is_bitwise_the_validating_route(case, monkeypatch):
    q, k, v, dout, cu, kw = dump.make_inputs(CASES[case], SHAPE)
    first = dump.call_once(q, k, v, dout, cu, kw, SHAPE)
    repeat = dump.call_once(q, k, v, dout, cu, kw, SHAPE)
    assert torch_ops._feat_plans or varlen_torch._fast_plans
    monkeypatch.setattr(torch_ops, "features_attention", lambda *a: None)
    monkeypatch.setattr(varlen_torch, "fast_attention", lambda *a: None)
    slow = dump.call_once(q, k, v, dout, cu, kw, SHAPE)
    assert first.keys() == slow.keys()
    for name in slow:
        assert torch.equal(bits(first[name]), bits(slow[name])), f"{case}: {name} differs"
        assert torch.equal(bits(repeat[name]), bits(slow[name])), f"{case}: {name} of the repeat differs"
        assert name == "lse" or torch.isfinite(first[name].float()).all()


def test_sum_backward_and_unused_lse(monkeypatch):
    """out.sum().backward() (a stride-0 dout, copied) with lse returned and unused: the validating
    route's gradients, no zeros for lse's gradient."""
    q, k, v, _, _, kw = dump.make_inputs(dict(causal=True, softcap=10.0), SHAPE)

    def run():
        out, lse, _ = cuflash.flash_attn_func(q, k, v, return_attn_probs=True, deterministic=True,
                                              **kw)
        out.sum().backward()
        res = [bits(x.grad).clone() for x in (q, k, v)] + [bits(lse)]
        for x in (q, k, v):
            x.grad = None
        return res

    fast = run()
    with monkeypatch.context() as m:
        m.setattr(torch_ops, "features_attention", lambda *a: None)
        slow = run()
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))


def test_varlen_repeat_calls_still_check_cu_seqlens():
    """A cached varlen call shape reads cu_seqlens back into its pinned buffers and checks them as
    the validating route does: new values of the same shape that are wrong raise naming the argument."""
    q, k, v, dout, cu, kw = dump.make_inputs(dict(causal=True, varlen=True, softcap=5.0), SHAPE)
    m = max(dump.LENS[SHAPE])
    cuflash.flash_attn_varlen_func(q, k, v, cu, cu, m, m, **kw)
    cuflash.flash_attn_varlen_func(q, k, v, cu, cu.clone(), m, m, **kw)   # two reads, valid
    bad = cu.clone()
    bad[-1] += 1
    with pytest.raises(ValueError, match="^cu_seqlens_q: must start at 0"):
        cuflash.flash_attn_varlen_func(q, k, v, bad, cu, m, m, **kw)
    with pytest.raises(ValueError, match="^cu_seqlens_k: must start at 0"):
        cuflash.flash_attn_varlen_func(q, k, v, cu, bad, m, m, **kw)
    longer = cu.clone()
    longer[1] += 1                       # sequence 0: m + 1 tokens
    with pytest.raises(ValueError, match=f"^max_seqlen_q={m} is less than the longest"):
        cuflash.flash_attn_varlen_func(q, k, v, longer, longer, m, m, **kw)
    assert len([e for e in varlen_torch._fast_plans.values() if e]) >= 1
