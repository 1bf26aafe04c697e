"""The feature calls' eager fast path without a GPU (issue 12's host time): flash_attn_func with a window,
softcap, ALiBi or dropout (cuflash.torch_ops.features_attention) and flash_attn_varlen_func
(cuflash.varlen_torch.fast_attention) keep one entry per call shape. Here torch CPU tensors pass for
CUDA ones (the device queries faked), plans are fakes that record their launches: a repeat call makes
no plan and validates nothing, a changed argument makes a new entry, bad input still raises naming the
argument before any plan, and autograd's backward finds its plan on the entry."""
import os
import sys

import pytest

torch = pytest.importorskip("torch")

import cuflash  # noqa: E402
from cuflash import api, torch_ops, varlen, varlen_torch  # noqa: E402


@pytest.fixture
def gpu(monkeypatch):
    """CPU tensors described as on CUDA device 0, plans faked (tests/features_host_profile.py's
    stub, through monkeypatch): returns the list of plans made."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import features_host_profile

    return features_host_profile.stub_gpu(monkeypatch.setattr)


def qkv(b=2, s=100, h=4, h_kv=2, d=64, grad=False):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, s, h, d, generator=g).to(torch.bfloat16).requires_grad_(grad)
    k, v = (torch.randn(b, s, h_kv, d, generator=g).to(torch.bfloat16).requires_grad_(grad)
            for _ in range(2))
    return q, k, v


def fast(q, k, v, dropout_p=0.0, scale=None, causal=True, window=(-1, -1), softcap=0.0, slopes=None,
         deterministic=False, with_lse=True):
    return torch_ops.features_attention(q, k, v, dropout_p, scale, causal, window, softcap, slopes,
                                        deterministic, None, None, with_lse)


def test_repeat_calls_reuse_the_entry_and_validate_nothing(gpu, monkeypatch):
    q, k, v = qkv()
    slopes = torch.rand(4)
    out, lse = fast(q, k, v, window=(30, 0), softcap=7.0, slopes=slopes)
    (plan,) = gpu
    p = plan.problem
    assert p.features == ("alibi", "softcap", "window") and p.window == (30, 0) and p.causal
    assert out.shape == q.shape and lse.shape == (2, 4, 100) and lse.dtype == torch.float32
    kind, ptrs, _, fields = plan.launches[-1]
    assert kind == "run_fields" and fields == (("alibi_slopes", slopes.data_ptr()),)
    assert ptrs == (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr())
    # a repeat call: no validation, no plan, a launch on the new tensors' addresses
    for name in ("check_qkv", "check_features", "gpu_supported", "feature_problem", "describe"):
        monkeypatch.setattr(api, name, lambda *a, **kw: pytest.fail("validated on a repeat call"))
    slopes2 = torch.rand(4)
    out2, _ = fast(q, k, v, window=(30, 0), softcap=7.0, slopes=slopes2)
    assert len(gpu) == 1 and len(plan.launches) == 2
    assert plan.launches[-1][3] == (("alibi_slopes", slopes2.data_ptr()),)
    assert plan.launches[-1][1][3] == out2.data_ptr() != out.data_ptr()


@pytest.mark.parametrize("change", [dict(window=(31, 0)), dict(softcap=8.0), dict(causal=False),
                                    dict(scale=0.1), dict(slopes="batched"), dict(deterministic=True),
                                    dict(dropout_p=0.1), dict(q_dtype=torch.float16)])
def test_a_changed_argument_makes_a_new_entry(gpu, change):
    q, k, v = qkv()
    base = dict(window=(30, 0), softcap=7.0, slopes=torch.rand(4))
    fast(q, k, v, **base)
    fast(q, k, v, **base)
    assert len(torch_ops._feat_plans) == 1
    kw = dict(base)
    if change.get("slopes") == "batched":
        kw["slopes"] = torch.rand(2, 4)
    elif "q_dtype" in change:
        q, k, v = (x.to(change["q_dtype"]) for x in (q, k, v))
    else:
        kw.update(change)
    fast(q, k, v, **kw)
    assert len(torch_ops._feat_plans) == 2
    fast(q, k, v, **kw)
    assert len(torch_ops._feat_plans) == 2


def test_dropout_entry_draws_a_state_per_call_and_keeps_it_for_the_backward(gpu):
    q, k, v = qkv(grad=True)
    torch.manual_seed(3)
    out, lse = fast(q, k, v, dropout_p=0.2, window=(20, 0))
    (fwd,) = gpu
    assert fwd.problem.features == ("dropout", "window") and fwd.problem.dropout_p == 0.2
    kind, _, _, extra = fwd.launches[-1]
    assert kind == "run_with" and extra[0][0] == "rng_state"
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    bwd = gpu[-1]
    assert bwd.problem.op == "bwd" and bwd.launches[-1][3] == extra   # the forward's state
    assert dq.shape == q.shape and dk.shape == k.shape
    out2, _ = fast(q, k, v, dropout_p=0.2, window=(20, 0))
    assert fwd.launches[-1][3][0][1] != extra[0][1]    # a fresh state tensor per call
    torch.autograd.grad(out2, (q, k, v), dout)
    assert len(gpu) == 2 and len(bwd.launches) == 2       # the backward's plan reused


def test_backward_plans_per_dout_layout(gpu):
    q, k, v = qkv(grad=True)
    out, _ = fast(q, k, v, softcap=5.0)
    out.sum().backward()             # a stride-0 dout: run on a contiguous copy
    bwd = gpu[-1]
    assert bwd.problem.op == "bwd" and bwd.problem.features == ("softcap",)
    assert bwd.launches[-1][1][0] != 0 and q.grad.shape == q.shape
    entry = next(iter(torch_ops._feat_plans.values()))
    assert [c for c, _ in entry.bwd.values()] == [True]
    out, _ = fast(q, k, v, softcap=5.0)
    out.backward(torch.randn_like(out))
    assert [c for c, _ in entry.bwd.values()] == [True, False]
    assert len({id(p) for _, p in entry.bwd.values()}) == 1   # the same call shape: one plan
    # lse's gradient is never materialized (set_materialize_grads(False)); out unused: dout None
    out, lse = fast(q, k, v, softcap=5.0)
    (g,) = torch.autograd.grad(out.sum() * 0 + lse.detach().sum(), (q,), allow_unused=True)


def test_bad_input_raises_naming_the_argument_before_any_plan(gpu):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="window_size"):
        fast(q, k, v, window=(-2, 0))
    with pytest.raises(ValueError, match="softcap"):
        fast(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match="dropout_p"):
        fast(q, k, v, dropout_p=1.0)
    with pytest.raises(TypeError, match="alibi_slopes"):
        fast(q, k, v, slopes=torch.rand(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="^k: nheads_kv=3 must divide"):
        fast(q, *(x[:, :, :1].expand(2, 100, 3, 64) for x in (k, v)))
    assert not gpu and not torch_ops._feat_plans
    fast(q, k, v, softcap=3.0)
    with pytest.raises(ValueError, match="softcap"):   # a cached shape: new values still checked
        fast(q, k, v, softcap=float("nan"))


@pytest.mark.parametrize("window", [(True, 0), (30.0, 0), [30, 0], (30, 0, 1)])
def test_values_keyed_equal_to_valid_ones_take_the_validating_route(gpu, window):
    """(True, 0) and (30.0, 0) hash and compare equal to (1, 0) and (30, 0): never keyed."""
    q, k, v = qkv()
    fast(q, k, v, window=(30, 0))
    assert fast(q, k, v, window=window) is None
    if window == [30, 0]:   # valid: the validating route runs it
        assert cuflash.flash_attn_func(q, k, v, causal=True, window_size=window).shape == q.shape
    else:
        with pytest.raises(TypeError, match="window_size"):
            cuflash.flash_attn_func(q, k, v, causal=True, window_size=window)


def test_what_the_entry_does_not_run_takes_the_validating_route(gpu, monkeypatch):
    q, k, v = qkv()
    assert fast(q[..., :60], k[..., :60], v[..., :60], softcap=2.0) is None      # padded head dim
    assert fast(q[:0], k[:0], v[:0], softcap=2.0) is None                          # empty
    assert fast(q, k, v, softcap=2.0, scale=torch.tensor(0.1)) is None             # 0-d tensor scale
    assert not gpu
    seen = []
    monkeypatch.setattr(torch_ops, "attention", lambda *a: seen.append(a) or ("out", "lse"))
    assert fast(q, k, v, window=(500, 0)) == ("out", "lse")    # past every key: the plain call
    assert seen[-1][4] is True and not gpu
    cpu = qkv()
    monkeypatch.undo()
    assert torch_ops.features_attention(*cpu, 0.0, None, True, (30, 0), 0.0, None, False, None, None,
                                        True) is None


def test_flash_attn_func_takes_the_fast_route(gpu, monkeypatch):
    q, k, v = qkv()
    out = cuflash.flash_attn_func(q, k, v, causal=True, window_size=(30, 0))
    assert out.shape == q.shape and len(gpu) == 1
    out, lse, probs = cuflash.flash_attn_func(q, k, v, causal=True, window_size=(30, 0),
                                              return_attn_probs=True)
    assert lse.shape == (2, 4, 100) and probs.shape == (0,) and len(gpu) == 1


# ---------------------------------------------------------------------------------------
# flash_attn_varlen_func

def varlen_args(lens=(60, 28, 40), grad=False):
    g = torch.Generator().manual_seed(1)
    total = sum(lens)
    q, k, v = (torch.randn(total, 4, 64, generator=g).to(torch.bfloat16).requires_grad_(grad)
               for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu, max(lens)


def vfast(q, k, v, cu_q, cu_k, mq, mk, dropout_p=0.0, causal=True, window=(-1, -1), softcap=0.0,
          slopes=None, with_lse=True):
    return varlen_torch.fast_attention(q, k, v, cu_q, cu_k, mq, mk, dropout_p, None, causal, window,
                                       softcap, slopes, False, with_lse)


def test_varlen_repeat_calls_reuse_the_entry_and_check_cu_values(gpu, monkeypatch):
    q, k, v, cu, m = varlen_args()
    out, lse = vfast(q, k, v, cu, cu, m, m)
    (plan,) = gpu
    assert plan.problem.features == ("varlen",) and plan.launches[-1][0] == "run_varlen"
    assert out.shape == q.shape and lse.shape == (4, 128)
    out, lse = vfast(q, k, v, cu, cu, m, m, window=(16, 0), softcap=3.0)
    assert gpu[-1].problem.features == ("softcap", "varlen", "window") and len(gpu) == 2
    assert gpu[-1].launches[-1][3][:2] == (("cu_seqlens_q", cu.data_ptr()), ("cu_seqlens_k", cu.data_ptr()))
    monkeypatch.setattr(api, "varlen_checked", lambda *a: pytest.fail("validated on a repeat call"))
    vfast(q, k, v, cu, cu, m, m)
    assert len(gpu) == 2 and len(gpu[0].launches) == 2
    # the values are still read back and checked (same shape, new values)
    bad = torch.tensor([0, 60, 88, 127], dtype=torch.int32)
    with pytest.raises(ValueError, match="^cu_seqlens_q: must start at 0"):
        vfast(q, k, v, bad, cu, m, m)
    longer = torch.tensor([0, 70, 88, 128], dtype=torch.int32)
    with pytest.raises(ValueError, match="^max_seqlen_q=60 is less than the longest"):
        vfast(q, k, v, longer, longer, m, m)
    # CUFLASH_VARLEN_CHECK=0 (or a CUDA graph capturing): trusted, as flash-attn does
    monkeypatch.setattr(api, "_values_unreadable", lambda cu, kind: True)
    vfast(q, k, v, longer, longer, m, m)
    assert len(gpu[0].launches) == 3


def test_varlen_backward_finds_its_plan_on_the_entry(gpu):
    q, k, v, cu, m = varlen_args(grad=True)
    torch.manual_seed(0)
    out, _ = vfast(q, k, v, cu, cu, m, m, dropout_p=0.1, slopes=torch.rand(4))
    fwd = gpu[-1]
    assert fwd.problem.features == ("alibi", "dropout", "varlen")
    dout = torch.randn_like(out)
    for _ in range(2):
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    bwd = gpu[-1]
    assert bwd.problem.op == "bwd" and len(gpu) == 2 and len(bwd.launches) == 2
    assert dq.shape == q.shape and dk.shape == k.shape


def test_varlen_bad_input_raises_naming_the_argument(gpu):
    q, k, v, cu, m = varlen_args()
    with pytest.raises(ValueError, match="^max_seqlen_k"):
        vfast(q, k, v, cu, cu, m, 10)
    with pytest.raises(TypeError, match="^cu_seqlens_k"):
        vfast(q, k, v, cu, cu.long(), m, m)
    with pytest.raises(ValueError, match="window_size"):
        vfast(q, k, v, cu, cu, m, m, window=(-3, 0))
    assert not gpu and not varlen_torch._fast_plans
    assert vfast(q, k, v, cu, cu, float(m), m) is None       # (validated by the validating route)
    out = cuflash.flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=True)
    assert out.shape == q.shape and len(gpu) == 1


def test_host_profile_script_runs(monkeypatch):
    """tests/features_host_profile.py stubs for good (a script): here through monkeypatch."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import features_host_profile

    stub = features_host_profile.stub_gpu
    monkeypatch.setattr(features_host_profile, "stub_gpu", lambda attr=None: stub(monkeypatch.setattr))
    monkeypatch.setattr(features_host_profile.FakePlan, "keep", True)
    features_host_profile.main(["--calls", "3", "--rounds", "1", "--cases", "window", "varlen"])
