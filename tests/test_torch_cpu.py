"""The torch bridge without a GPU: torch CPU tensors run the float64 NumPy reference through
the same custom ops (cuflash::fwd, cuflash::bwd), autograd Function and plan caches that CUDA
tensors use, so gradcheck, opcheck and torch.compile test the plumbing in CI."""
import math

import pytest

torch = pytest.importorskip("torch")

import cuflash  # noqa: E402
from cuflash import api, flash_attn_func, reference, registry  # noqa: E402
from cuflash import torch_ops  # noqa: E402  (registers the ops)
from cuflash.families.fa2_bwd import BwdConfig  # noqa: E402
from cuflash.families.fa2_fwd import FwdConfig  # noqa: E402


def qkv(b=1, sq=5, sk=3, h=4, hkv=2, d=8, dtype=torch.float64, grad=True):
    make = lambda *s: torch.randn(*s, dtype=dtype).requires_grad_(grad)  # noqa: E731
    return make(b, sq, h, d), make(b, sk, hkv, d), make(b, sk, hkv, d)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 5, 3, 4, 2, 8), (2, 3, 6, 2, 1, 16), (1, 1, 1, 2, 2, 8)])
def test_gradcheck_float64(shape, causal):
    b, sq, sk, h, hkv, d = shape
    q, k, v = qkv(b, sq, sk, h, hkv, d)
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_attn_func(q, k, v, causal=causal, softmax_scale=0.4), (q, k, v))


def test_forward_and_lse_match_reference():
    q, k, v = qkv(2, 7, 9, 4, 1, 16, grad=False)
    out, lse, none = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    ref, ref_lse = reference.attention_naive(q.numpy(), k.numpy(), v.numpy(), causal=True, return_lse=True)
    assert none.shape == (0,) and lse.dtype == torch.float32 and lse.shape == (2, 4, 7)   # flash-attn's empty S_dmask
    torch.testing.assert_close(out, torch.from_numpy(ref))
    torch.testing.assert_close(lse, torch.from_numpy(ref_lse).float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_cpu_tensors_keep_their_dtype(dtype):
    q, k, v = qkv(1, 6, 6, 2, 2, 16, dtype=dtype)
    out = flash_attn_func(q, k, v, causal=True)
    out.float().sum().backward()
    assert out.dtype == dtype and q.grad.dtype == dtype and k.grad.shape == k.shape


def test_mask_fully_masked_rows_have_zero_grad():
    q, k, v = qkv(1, 6, 2, 2, 2, 8)  # causal, seqlen_q > seqlen_k: rows 0..3 see no key
    out = flash_attn_func(q, k, v, causal=True)
    out.sum().backward()
    assert (out[:, :4] == 0).all() and (q.grad[:, :4] == 0).all()
    assert torch.isfinite(k.grad).all()


def test_lse_is_not_differentiable_and_out_is():
    q, k, v = qkv()
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.requires_grad and not lse.requires_grad


def test_backward_function_matches_autograd():
    q, k, v = qkv(1, 5, 7, 4, 2, 8)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    dout = torch.randn_like(out)
    auto = torch.autograd.grad(out, (q, k, v), dout)
    direct = cuflash.flash_attn_backward(dout, q.detach(), k.detach(), v.detach(),
                                         out.detach(), lse, causal=True)
    for a, b in zip(auto, direct):
        torch.testing.assert_close(a, b)


def test_broadcast_grad_with_zero_strides():
    q, k, v = qkv(1, 4, 4, 2, 2, 8)
    flash_attn_func(q, k, v).sum().backward()  # dout arrives as an expanded, stride-0 tensor
    assert torch.isfinite(q.grad).all()


# ---------------------------------------------------------------------------------------
# the torch ops

def test_opcheck_forward_and_backward():
    q, k, v = (x.detach() for x in qkv(1, 5, 6, 2, 2, 8, dtype=torch.float32))
    args = (q, k, v, 0.3, True, "")
    torch.library.opcheck(torch.ops.cuflash.fwd.default, args)
    out, lse = torch.ops.cuflash.fwd(*args)
    torch.library.opcheck(torch.ops.cuflash.bwd.default,
                          (torch.randn_like(out), q, k, v, out, lse, 0.3, True, False, ""))


def test_ops_take_an_encoded_config():
    """The config crosses the op boundary as Family.encode's string; the op decodes and
    validates it like flash_attn_func's config=."""
    q, k, v = (x.detach() for x in qkv(1, 5, 6, 2, 2, 8, dtype=torch.bfloat16))
    fwd = FwdConfig(64, 32, 4, 2, 16, "bf16", True)
    text = registry.get("fa2_fwd").encode(fwd)
    assert text.startswith("fa2_fwd:")
    out, lse = torch.ops.cuflash.fwd(q, k, v, 0.3, True, text)
    ref, _ = torch.ops.cuflash.fwd(q, k, v, 0.3, True, "")
    torch.testing.assert_close(out, ref)
    bwd = BwdConfig(32, 64, 4, 2, 1, 16, "bf16", True, True)
    grads = torch.ops.cuflash.bwd(torch.randn_like(out), q, k, v, out, lse, 0.3, True, True,
                                  registry.get("fa2_bwd").encode(bwd))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    small = registry.get("fa2_fwd").encode(fwd.replace(head_dim=0))
    with pytest.raises(ValueError, match=r"^config: .* does not fit this call"):
        torch.ops.cuflash.fwd(q, k, v, 0.3, True, small)
    with pytest.raises(TypeError, match=r"^config: expected a fwd config"):
        torch.ops.cuflash.fwd(q, k, v, 0.3, True, registry.get("fa2_bwd").encode(bwd))


def test_bwd_op_validates_dout_out_and_lse():
    """The raw op is callable without flash_attn_backward's checks: it makes its own."""
    q, k, v = (x.detach() for x in qkv(1, 5, 6, 2, 2, 8, dtype=torch.float32))
    out, lse = torch.ops.cuflash.fwd(q, k, v, 0.3, False, "")
    dout = torch.randn_like(out)
    with pytest.raises(ValueError, match=r"^dout: expected a torch array of q's shape"):
        torch.ops.cuflash.bwd(dout[:, :4], q, k, v, out, lse, 0.3, False, False, "")
    with pytest.raises(ValueError, match=r"^out: expected a torch array of q's shape"):
        torch.ops.cuflash.bwd(dout, q, k, v, out[:, :4], lse, 0.3, False, False, "")
    with pytest.raises(ValueError, match=r"^lse: expected a torch float32 array"):
        torch.ops.cuflash.bwd(dout, q, k, v, out, lse[:, :1], 0.3, False, False, "")
    # valid once, then a call differing only in lse's shape is checked again (not a cache hit)
    torch.ops.cuflash.bwd(dout, q, k, v, out, lse, 0.3, False, False, "")
    with pytest.raises(ValueError, match=r"^lse: expected"):
        torch.ops.cuflash.bwd(dout, q, k, v, out, lse.double(), 0.3, False, False, "")


def test_torch_compile_fullgraph_matches_eager():
    def loss(q, k, v):
        return (flash_attn_func(q, k, v, causal=True) ** 2).sum()

    q, k, v = qkv(1, 5, 5, 4, 4, 8, dtype=torch.float32)
    eager = torch.autograd.grad(loss(q, k, v), (q, k, v))
    compiled_fn = torch.compile(loss, fullgraph=True, backend="aot_eager")
    compiled = torch.autograd.grad(compiled_fn(q, k, v), (q, k, v))
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------
# errors: bad input before any work; what is not implemented

def test_bad_torch_input_is_rejected_before_any_work(monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("the reference ran on invalid input")

    monkeypatch.setattr(torch_ops, "_fwd_reference", no_work)
    monkeypatch.setattr(torch_ops, "_bwd_reference", no_work)
    q, k, v = qkv(grad=False)
    with pytest.raises(TypeError, match="^q, k, v must share one dtype"):
        flash_attn_func(q, k.float(), v)
    with pytest.raises(ValueError, match="^q: expected 4 dimensions"):
        flash_attn_func(q[0], k, v)
    with pytest.raises(TypeError, match="^q: dtype must be"):
        flash_attn_func(q.to(torch.int32), k, v)
    with pytest.raises(ValueError, match="^q: headdim must be a multiple of 8"):
        big = lambda x: torch.cat([x] * 33, -1)  # noqa: E731 - head dim 264 > 256
        flash_attn_func(big(q), big(k), big(v))
    with pytest.raises(ValueError, match="^k: nheads_kv=3 must divide"):
        flash_attn_func(q, torch.cat([k, k[:, :, :1]], 2), torch.cat([v, v[:, :, :1]], 2))
    with pytest.raises(TypeError, match=r"^config: expected a cuflash kernel config"):
        flash_attn_func(q, k, v, config={"Br": 64})
    with pytest.raises(TypeError, match=r"^bwd_config: expected a cuflash kernel config"):
        flash_attn_func(q, k, v, bwd_config=[64])
    qg, kg, vg = qkv()  # with autograd too
    with pytest.raises(TypeError, match="^q, k, v must share one dtype"):
        flash_attn_func(qg, kg.float(), vg)


@pytest.mark.parametrize("scale", ["abc", [1.0], (2.0,), True], ids=["str", "list", "tuple", "bool"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "autograd"])
def test_non_numeric_softmax_scale_names_it(scale, grad):
    q, k, v = qkv(grad=grad)
    with pytest.raises(TypeError, match=r"^softmax_scale must be a real number or None"):
        flash_attn_func(q, k, v, softmax_scale=scale)


def test_tensor_softmax_scale_is_a_number():
    q, k, v = qkv(grad=False)
    a = flash_attn_func(q, k, v, softmax_scale=torch.tensor(0.3))
    b = flash_attn_func(q, k, v, softmax_scale=0.3)
    torch.testing.assert_close(a, b)
    before = len(torch_ops._fwd_plans)
    for _ in range(3):  # a fresh 0-d tensor each call must not key a new plan each call
        flash_attn_func(q, k, v, softmax_scale=torch.tensor(0.3))
    assert len(torch_ops._fwd_plans) == before


def test_features_run_on_torch_cpu():
    """dropout, window, softcap and ALiBi run on CPU tensors (the reference); GPU-kind inputs
    raise (tests/test_api_features_cpu.py); a bad value still names its argument."""
    q, k, v = qkv(grad=False)
    plain = flash_attn_func(q, k, v)
    for kw in (dict(dropout_p=0.1), dict(window_size=(1, 0)), dict(softcap=0.5),
               dict(alibi_slopes=torch.ones(q.shape[2]))):
        out = flash_attn_func(q, k, v, **kw)
        assert out.shape == q.shape and math.isfinite(out.sum().item())
        assert not torch.equal(out, plain), kw
    with pytest.raises(ValueError, match="^dropout_p must be in"):
        flash_attn_func(q, k, v, dropout_p=1.0)
    with pytest.raises(TypeError, match="^alibi_slopes: dtype must be float32"):
        flash_attn_func(q, k, v, alibi_slopes=torch.ones(q.shape[2], dtype=torch.float64))
    assert math.isfinite(flash_attn_func(q, k, v).sum().item())


def test_double_backward_is_not_implemented():
    q, k, v = qkv(1, 5, 6, 2, 2, 8)
    out = flash_attn_func(q, k, v, causal=True)
    dq, dk, dv = torch.autograd.grad(out.square().sum(), (q, k, v), create_graph=True)
    assert dq.requires_grad  # first order with create_graph=True works ...
    ref = torch.autograd.grad(flash_attn_func(q, k, v, causal=True).square().sum(), (q, k, v))
    for a, b in zip((dq, dk, dv), ref):
        torch.testing.assert_close(a.detach(), b)
    with pytest.raises(NotImplementedError, match=r"double backward through flash_attn_func"):
        torch.autograd.grad((dq.square().sum() + dk.sum()), (q, k, v))   # ... the second does not


def test_backward_bad_input_names_the_argument():
    q, k, v = qkv(1, 5, 6, 2, 2, 8, grad=False)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    dout = torch.randn_like(out)
    bwd = cuflash.flash_attn_backward
    with pytest.raises(ValueError, match="^dout: expected a torch array of q's shape"):
        bwd(dout[:, :4], q, k, v, out, lse)
    with pytest.raises(ValueError, match="^out: expected a torch array of q's shape"):
        bwd(dout, q, k, v, out.float(), lse)
    with pytest.raises(ValueError, match=r"^lse: expected a torch float32 array of shape \(1, 2, 5\)"):
        bwd(dout, q, k, v, out, lse[:, :, :3])
    with pytest.raises(ValueError, match="^lse: expected a torch float32"):
        bwd(dout, q, k, v, out, lse.double())
    with pytest.raises(ValueError, match="^k, v: headdim must match"):
        bwd(dout, q, k[..., :4], v, out, lse)
    with pytest.raises(TypeError, match="^softmax_scale must be a real number"):
        bwd(dout, q, k, v, out, lse, softmax_scale=[0.1])


# ---------------------------------------------------------------------------------------
# the hot path: a repeat call of one shape finds its plan without validating again

def test_repeat_forward_call_is_not_validated_again(count_validation):
    q, k, v = qkv(1, 5, 6, 2, 2, 8, grad=False)
    first = flash_attn_func(q, k, v, causal=True)
    assert count_validation == ["fwd"]
    for _ in range(3):
        again = flash_attn_func(q, k, v, causal=True)
    assert count_validation == ["fwd"]
    torch.testing.assert_close(first, again)
    # new data of the same shape, strides and dtype: still the cached plan
    flash_attn_func(*qkv(1, 5, 6, 2, 2, 8, grad=False), causal=True)
    assert count_validation == ["fwd"]


@pytest.mark.parametrize("change", ["stride", "dtype", "shape", "causal", "scale", "config"])
def test_a_different_call_is_validated(count_validation, change):
    q, k, v = qkv(1, 8, 6, 2, 2, 16, grad=False)
    flash_attn_func(q, k, v)
    assert len(count_validation) == 1
    if change == "stride":    # the same values, laid out (b, h, s, d) and viewed back
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
        args, kw = (q, k, v), {}
    elif change == "dtype":
        args, kw = (q.float(), k.float(), v.float()), {}
    elif change == "shape":
        args, kw = (q[:, :7], k, v), {}
    elif change == "causal":
        args, kw = (q, k, v), {"causal": True}
    elif change == "scale":
        args, kw = (q, k, v), {"softmax_scale": 0.5}
    else:
        args, kw = (q, k, v), {"config": FwdConfig(64, 32, 4, 2, 16, "bf16", False)}
    flash_attn_func(*args, **kw)
    assert len(count_validation) == 2
    flash_attn_func(*args, **kw)
    assert len(count_validation) == 2


def test_repeat_backward_is_not_validated_again(count_validation):
    q, k, v = qkv(1, 5, 6, 2, 2, 8)
    for i in range(3):
        flash_attn_func(q, k, v, causal=True).sum().backward()
        assert count_validation == ["fwd", "bwd"], i
    # a different dout layout (stride 0 from .sum() vs a dense one) is a new backward shape
    flash_attn_func(q, k, v, causal=True).backward(torch.randn(1, 5, 2, 8, dtype=torch.float64))
    assert count_validation == ["fwd", "bwd", "bwd"]


@pytest.mark.parametrize("which", ["k", "v", "dout", "out"])
def test_backward_key_holds_every_tensors_device(count_validation, which):
    """The backward plan cache (behind the op cuflash::bwd, called unchecked) skips
    validation on a hit, so its key must hold what was validated: every tensor's device (q's alone let k on
    another device reach a plan made for q's, e.g. a launch reading cuda:1 memory on cuda:0).
    The meta device stands in for a second GPU."""
    q, k, v = qkv(1, 5, 6, 2, 2, 8, dtype=torch.bfloat16, grad=False)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    args = dict(dout=torch.randn_like(out), q=q, k=k, v=v, out=out, lse=lse)
    bwd = lambda a: torch_ops.backward_impl(a["dout"], a["q"], a["k"], a["v"], a["out"],  # noqa: E731
                                            a["lse"], 0.25, False, False)
    bwd(args)
    assert count_validation == ["fwd", "bwd"]
    args[which] = args[which].to("meta")
    with pytest.raises(ValueError, match=f"^{which}: .*(must be on|CUDA device or the CPU)"):
        bwd(args)
    assert count_validation == ["fwd", "bwd", "bwd"]


# ---------------------------------------------------------------------------------------
# the autograd fast path (CUDA only) run on the CPU: plans that read and write raw pointers

class _PointerPlan:
    """Stands in for a launch.Plan of a float32 call shape: run() computes the reference on
    the memory its pointers address (contiguous layouts) and records the call."""
    device, workspace_bytes = 0, 256

    def __init__(self, op, q_shape, kv_shape, scale, causal, calls):
        self.op, self.q_shape, self.kv_shape = op, q_shape, kv_shape
        self.scale, self.causal, self.calls = scale, causal, calls

    def run(self, ptrs, workspace_ptr, stream):
        import ctypes

        import numpy as np

        self.calls.append((self.op, ptrs, workspace_ptr, stream))
        b, sq, h, _ = self.q_shape
        shapes = {"fwd": [self.q_shape, self.kv_shape, self.kv_shape, self.q_shape, (b, h, sq)],
                  "bwd": [self.q_shape, self.q_shape, self.kv_shape, self.kv_shape, self.q_shape,
                          (b, h, sq), self.q_shape, self.kv_shape, self.kv_shape]}[self.op]
        a = [np.ctypeslib.as_array(ctypes.cast(p, ctypes.POINTER(ctypes.c_float)), s)
             for p, s in zip(ptrs, shapes)]
        kw = dict(softmax_scale=self.scale, causal=self.causal)
        if self.op == "fwd":
            a[3][...], a[4][...] = reference.attention_naive(*a[:3], return_lse=True, **kw)
        else:
            assert workspace_ptr and all(p % 16 == 0 for p in ptrs[:5] + ptrs[6:])
            for x, g in zip(a[6:], reference.attention_backward_naive(*a[:4], **kw)):
                x[...] = g


def test_autograd_fast_path_on_pointer_plans(monkeypatch):
    """FlashAttnFn's path for a cached CUDA plan (forward entry, backward looked up on it),
    driven on float32 CPU tensors by pointer-level stand-ins: gradients through a copied
    (stride 0) and a dense dout, GQA shapes, lse only an output with return_attn_probs,
    no zero gradient materialized for lse, create_graph refusing the second order."""
    monkeypatch.setattr(torch_ops, "_fwd_plans", {})
    monkeypatch.setattr(torch_ops, "_raw_stream", lambda device: 7)
    calls = []
    q, k, v = qkv(2, 7, 9, 4, 2, 8, dtype=torch.float32)
    scale = 8 ** -0.5
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype,
           v.dtype, q.device, k.device, v.device, None, True, None, None)
    plan = lambda op: _PointerPlan(op, tuple(q.shape), tuple(k.shape), scale, True, calls)  # noqa: E731
    entry = torch_ops._fwd_plans[key] = torch_ops._FwdEntry(plan("fwd"), q.shape, (2, 4, 7))
    entry.bwd[((0, 0, 0, 0), torch.float32, False)] = (True, plan("bwd"))
    entry.bwd[(q.stride(), torch.float32, False)] = (False, plan("bwd"))

    def expected(dout):
        ref = reference.attention_backward_naive(*(x.detach().double().numpy() for x in (dout, q, k, v)),
                                                 softmax_scale=scale, causal=True)
        return [torch.from_numpy(g).float() for g in ref]

    out = flash_attn_func(q, k, v, causal=True)
    assert out.grad_fn is not None and len(out.grad_fn.next_functions) == 3
    out.sum().backward()  # dout expanded (stride 0): a contiguous copy reaches the plan
    assert [c[0] for c in calls] == ["fwd", "bwd"] and calls[1][3] == 7
    for x, want in zip((q, k, v), expected(torch.ones(out.shape))):
        torch.testing.assert_close(x.grad, want)

    calls.clear()
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert not lse.requires_grad
    dout = torch.randn(out.shape)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert calls[1][1][6:] == tuple(g.data_ptr() for g in grads)  # the plan's outputs
    for g, want in zip(grads, expected(dout)):
        torch.testing.assert_close(g, want)

    dq, _, _ = torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), dout,
                                   create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(dq.sum(), q)
