"""The packed functions' gradient route without a GPU (issue 12): flash_attn_qkvpacked_func /
flash_attn_kvpacked_func on torch tensors that need gradients run FlashAttnPackedFn, whose backward
(torch_ops.backward_packed) returns one gradient for the packed tensor (on the GPU written by the kernels
into its slices; on the CPU the float64 reference's gradients stacked). Checked here: gradcheck, equality
with the per-slice route (flash_attn_func on the slices), which calls take the route (not with features,
without gradients, FP8 or arrays), and the double-backward refusal. GPU: tests/test_packed_grad_gpu.py."""
import pytest
import torch

import cuflash
from cuflash import torch_ops


def _rand(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_qkvpacked_gradcheck_and_slices(causal):
    qkv = _rand(2, 7, 3, 2, 8)
    assert torch.autograd.gradcheck(lambda x: cuflash.flash_attn_qkvpacked_func(x, causal=causal), (qkv,))
    out = cuflash.flash_attn_qkvpacked_func(qkv, causal=causal)
    assert type(out.grad_fn) is torch_ops.FlashAttnPackedFn._backward_cls
    dout = torch.randn_like(out)
    (g,) = torch.autograd.grad(out, qkv, dout)
    y = qkv.detach().clone().requires_grad_()
    ref = cuflash.flash_attn_func(y[:, :, 0], y[:, :, 1], y[:, :, 2], causal=causal)
    (g2,) = torch.autograd.grad(ref, y, dout)
    assert torch.equal(out, ref) and torch.allclose(g, g2, rtol=0, atol=1e-12)
    assert g.shape == qkv.shape and g.is_contiguous()


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_kvpacked_gradcheck_and_slices(heads):
    h, hk = heads
    q, kv = _rand(2, 5, h, 8), _rand(2, 9, 2, hk, 8)
    assert torch.autograd.gradcheck(lambda a, b: cuflash.flash_attn_kvpacked_func(a, b, causal=True), (q, kv))
    out = cuflash.flash_attn_kvpacked_func(q, kv, causal=True)
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, kv), dout)
    a, b = q.detach().clone().requires_grad_(), kv.detach().clone().requires_grad_()
    ref = cuflash.flash_attn_func(a, b[:, :, 0], b[:, :, 1], causal=True)
    g2 = torch.autograd.grad(ref, (a, b), dout)
    assert all(torch.allclose(x, y, rtol=0, atol=1e-12) for x, y in zip(g, g2))


def test_kvpacked_q_without_grad():
    q = torch.randn(1, 5, 2, 8, dtype=torch.float64)
    kv = _rand(1, 6, 2, 2, 8)
    out = cuflash.flash_attn_kvpacked_func(q, kv)
    (g,) = torch.autograd.grad(out.sum(), kv)
    assert g.shape == kv.shape


def test_return_attn_probs_and_lse():
    qkv = _rand(1, 6, 3, 2, 8)
    out, lse, probs = cuflash.flash_attn_qkvpacked_func(qkv, return_attn_probs=True)
    ref = cuflash.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], return_attn_probs=True)
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1]) and probs.shape == (0,)
    assert type(out.grad_fn) is torch_ops.FlashAttnPackedFn._backward_cls and not lse.requires_grad


def test_routes_not_taken():
    """Features, calls without gradients and torch.compile keep the per-slice route."""
    qkv = _rand(1, 6, 3, 2, 8)
    out = cuflash.flash_attn_qkvpacked_func(qkv, softcap=5.0)
    assert type(out.grad_fn) is not torch_ops.FlashAttnPackedFn._backward_cls
    out = cuflash.flash_attn_qkvpacked_func(qkv, window_size=(2, 0))
    assert type(out.grad_fn) is not torch_ops.FlashAttnPackedFn._backward_cls
    with torch.no_grad():
        assert cuflash.flash_attn_qkvpacked_func(qkv).grad_fn is None
    assert cuflash.flash_attn_qkvpacked_func(qkv.detach()).grad_fn is None


def test_double_backward_refused():
    qkv = _rand(1, 4, 3, 1, 8)
    out = cuflash.flash_attn_qkvpacked_func(qkv)
    (g,) = torch.autograd.grad(out.sum(), qkv, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        g.sum().backward()



def test_double_backward_refused_kvpacked_frozen_kv():
    """q needs a gradient, kv does not: q anchors dq, so a second order raises the same refusal (not
    autograd's 'does not require grad')."""
    q = _rand(1, 5, 2, 8)
    kv = torch.randn(1, 6, 2, 2, 8, dtype=torch.float64)
    out = cuflash.flash_attn_kvpacked_func(q, kv)
    (g,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        g.sum().backward()

def test_bad_qkv_named():
    with pytest.raises(ValueError, match="qkv"):
        cuflash.flash_attn_qkvpacked_func(_rand(1, 4, 2, 1, 8))
    with pytest.raises(ValueError, match="kv"):
        cuflash.flash_attn_kvpacked_func(_rand(1, 4, 1, 8), _rand(1, 4, 3, 1, 8))


def test_varlen_packed_split_by_unbind():
    """flash_attn_varlen_qkvpacked_func / kvpacked_func split torch tensors by unbind (their gradients
    stacked into the packed tensor's: one stack, not a zero-filled buffer per slice): the same gradients as
    slicing by index."""
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    qkv = _rand(8, 3, 2, 8)
    out = cuflash.flash_attn_varlen_qkvpacked_func(qkv, cu, 5, causal=True)
    assert "Unbind" in type(out.grad_fn.next_functions[0][0]).__name__ or any(
        "Unbind" in type(f).__name__ for f, _ in out.grad_fn.next_functions if f is not None)
    dout = torch.randn_like(out)
    (g,) = torch.autograd.grad(out, qkv, dout)
    y = qkv.detach().clone().requires_grad_()
    ref = cuflash.flash_attn_varlen_func(y[:, 0], y[:, 1], y[:, 2], cu, cu, 5, 5, causal=True)
    (g2,) = torch.autograd.grad(ref, y, dout)
    assert torch.allclose(g, g2, rtol=0, atol=1e-12)
    q, kv = _rand(8, 2, 8), _rand(8, 2, 1, 8)
    out = cuflash.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 5, 5)
    g = torch.autograd.grad(out, (q, kv), dout)
    a, b = q.detach().clone().requires_grad_(), kv.detach().clone().requires_grad_()
    ref = cuflash.flash_attn_varlen_func(a, b[:, 0], b[:, 1], cu, cu, 5, 5)
    g2 = torch.autograd.grad(ref, (a, b), dout)
    assert all(torch.allclose(x, y, rtol=0, atol=1e-12) for x, y in zip(g, g2))
