"""The torch bridge without a GPU: torch CPU tensors run the float64 NumPy reference through
the same custom ops (cuflash::fwd, cuflash::bwd) and autograd registration that CUDA tensors
use, so gradcheck, opcheck and torch.compile test the plumbing in CI."""
import math

import pytest

torch = pytest.importorskip("torch")

import cuflash  # noqa: E402
from cuflash import flash_attn_func, reference  # noqa: E402
from cuflash import torch_ops  # noqa: E402,F401  (registers the ops)


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
    assert none is None and lse.dtype == torch.float32 and lse.shape == (2, 4, 7)
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
    direct = cuflash.interface.flash_attn_backward(dout, q.detach(), k.detach(), v.detach(),
                                                   out.detach(), lse, causal=True)
    for a, b in zip(auto, direct):
        torch.testing.assert_close(a, b)


def test_broadcast_grad_with_zero_strides():
    q, k, v = qkv(1, 4, 4, 2, 2, 8)
    flash_attn_func(q, k, v).sum().backward()  # dout arrives as an expanded, stride-0 tensor
    assert torch.isfinite(q.grad).all()


def test_opcheck_forward_and_backward():
    q, k, v = (x.detach() for x in qkv(1, 5, 6, 2, 2, 8, dtype=torch.float32))
    args = (q, k, v, 0.3, True, [], False, [])
    torch.library.opcheck(torch.ops.cuflash.fwd.default, args)
    out, lse = torch.ops.cuflash.fwd(*args)
    torch.library.opcheck(torch.ops.cuflash.bwd.default,
                          (torch.randn_like(out), q, k, v, out, lse, 0.3, True, False, []))


def test_torch_compile_fullgraph_matches_eager():
    def loss(q, k, v):
        return (flash_attn_func(q, k, v, causal=True) ** 2).sum()

    q, k, v = qkv(1, 5, 5, 4, 4, 8, dtype=torch.float32)
    eager = torch.autograd.grad(loss(q, k, v), (q, k, v))
    compiled_fn = torch.compile(loss, fullgraph=True, backend="aot_eager")
    compiled = torch.autograd.grad(compiled_fn(q, k, v), (q, k, v))
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b)


def test_bad_torch_input_is_rejected_before_any_work():
    q, k, v = qkv(grad=False)
    with pytest.raises(TypeError, match="^q, k, v must share one dtype"):
        flash_attn_func(q, k.float(), v)
    with pytest.raises(ValueError, match="^q: expected 4 dimensions"):
        flash_attn_func(q[0], k, v)
    with pytest.raises(TypeError, match="^q: dtype must be"):
        flash_attn_func(q.to(torch.int32), k, v)


def test_unimplemented_features_raise_for_torch():
    q, k, v = qkv(grad=False)
    with pytest.raises(NotImplementedError, match="dropout"):
        flash_attn_func(q, k, v, dropout_p=0.1)
    assert math.isfinite(flash_attn_func(q, k, v).sum().item())


def test_backward_bad_input_names_the_argument():
    q, k, v = qkv(1, 5, 6, 2, 2, 8, grad=False)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    dout = torch.randn_like(out)
    bwd = cuflash.flash_attn_backward
    with pytest.raises(ValueError, match="^dout: expected a torch array of q's shape"):
        bwd(dout[:, :4], q, k, v, out, lse)
    with pytest.raises(ValueError, match="^out: expected a torch array of q's shape"):
        bwd(dout, q, k, v, out.float(), lse)
    with pytest.raises(ValueError, match=r"^lse: expected float32 of shape \(1, 2, 5\)"):
        bwd(dout, q, k, v, out, lse[:, :, :3])
    with pytest.raises(ValueError, match="^lse: expected float32"):
        bwd(dout, q, k, v, out, lse.double())
    with pytest.raises(ValueError, match="^k, v: headdim must match"):
        bwd(dout, q, k[..., :4], v, out, lse)


def test_backward_numpy_input_points_to_the_reference():
    import numpy as np

    q, k, v = (x.detach().to(torch.float16).numpy() for x in qkv(1, 3, 3, 2, 2, 8, grad=False))
    lse = np.zeros((1, 2, 3), np.float32)
    with pytest.raises(TypeError, match="attention_backward_naive"):
        cuflash.flash_attn_backward(q, q, k, v, q, lse)
