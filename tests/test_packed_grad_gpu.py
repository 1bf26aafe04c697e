"""The packed functions' gradient route on the GPU (issue 12): flash_attn_qkvpacked_func and
flash_attn_kvpacked_func write dq, dk, dv straight into one packed buffer (torch_ops.backward_packed,
FlashAttnPackedFn) instead of autograd's per-slice zero-filled buffers.

dqkv / (dq, dkv) against a float64 reference within 3x plain low-precision attention's error (+1 ulp,
test_flash_bwd_gpu.check_grads), the output within 2x; fresh random inputs, outputs poisoned (NaN) before
each launch; odd lengths (1, 17, 113, 197, 257), causal and not, bf16 and fp16, GQA for kv, a head dim
that is padded (40 -> the stacked fallback is not taken: 40 is a multiple of 8; 20 is padded, stacked);
the packed route equal bitwise to the per-slice route (the same kernels, the same order of additions) where
the call is deterministic; the ViT shape (64 x 197 x 12 x 64) once.
"""
import pytest

import cuflash

from conftest import cuda_randn as rand, torch_dtype  # noqa: E402
from test_flash_bwd_gpu import check_grads, plain_attention  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]


def _check_out(out, ref, low):
    err = (out.double() - ref).abs().max().item()
    base = (low.double() - ref).abs().max().item()
    assert err <= 2 * base + 1e-3 * max(1.0, ref.abs().max().item()), (err, base)


def _qkv_case(batch, seqlen, heads, d, dtype, causal, deterministic=False):
    import torch

    tdt = torch_dtype(dtype)
    qkv = rand((batch, seqlen, 3, heads, d), tdt)
    dout = rand((batch, seqlen, heads, d), tdt)
    scale = d ** -0.5
    x = qkv.detach().clone().requires_grad_()
    out = cuflash.flash_attn_qkvpacked_func(x, causal=causal, deterministic=deterministic)
    assert type(out.grad_fn).__name__ == "FlashAttnPackedFnBackward"
    (dqkv,) = torch.autograd.grad(out, x, dout)
    refs = []
    for prec in (torch.float64, tdt):
        y = (qkv.double() if prec == torch.float64 else qkv).detach().clone().requires_grad_()
        o = plain_attention(y[:, :, 0], y[:, :, 1], y[:, :, 2], causal, scale, prec)
        (g,) = torch.autograd.grad(o, y, dout.to(prec))
        refs.append((o.detach(), g))
    (ref_o, ref_g), (low_o, low_g) = refs
    _check_out(out.detach(), ref_o, low_o)
    check_grads(dqkv.unbind(2), ref_g.unbind(2), low_g.unbind(2), f"{batch}x{seqlen}x{heads}x{d} ")
    return qkv, dout, dqkv


@pytest.mark.parametrize("seqlen", [1, 17, 113, 197, 257])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_qkvpacked_odd_lengths(dtype, causal, seqlen):
    _qkv_case(3, seqlen, 4, 64, dtype, causal)


@pytest.mark.parametrize("d", [40, 128, 20])
def test_qkvpacked_head_dims(d):
    _qkv_case(2, 113, 3, d, "bf16", False)


def test_qkvpacked_vit_shape():
    _qkv_case(64, 197, 12, 64, "bf16", False)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_qkvpacked_deterministic_matches_slices(causal):
    """deterministic=True: the packed route's dqkv bitwise equals the per-slice route's gradient."""
    import torch

    qkv, dout, dqkv = _qkv_case(2, 197, 4, 64, "bf16", causal, deterministic=True)
    y = qkv.detach().clone().requires_grad_()
    o = cuflash.flash_attn_func(y[:, :, 0], y[:, :, 1], y[:, :, 2], causal=causal, deterministic=True)
    (g,) = torch.autograd.grad(o, y, dout)
    assert torch.equal(g, dqkv)


@pytest.mark.parametrize("seqlens", [(17, 113), (197, 197), (113, 1)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_kvpacked(seqlens, heads):
    import torch

    sq, sk = seqlens
    h, hk = heads
    tdt = torch.bfloat16
    q = rand((2, sq, h, 64), tdt)
    kv = rand((2, sk, 2, hk, 64), tdt)
    dout = rand((2, sq, h, 64), tdt)
    a, b = q.detach().clone().requires_grad_(), kv.detach().clone().requires_grad_()
    out = cuflash.flash_attn_kvpacked_func(a, b, causal=True)
    assert type(out.grad_fn).__name__ == "FlashAttnPackedFnBackward"
    dq, dkv = torch.autograd.grad(out, (a, b), dout)
    refs = []
    for prec in (torch.float64, tdt):
        x = (q.double() if prec == torch.float64 else q).detach().clone().requires_grad_()
        y = (kv.double() if prec == torch.float64 else kv).detach().clone().requires_grad_()
        rep = h // hk
        k_, v_ = (t.repeat_interleave(rep, dim=2) for t in y.unbind(2))
        o = plain_attention(x, k_, v_, True, 64 ** -0.5, prec)
        refs.append((o.detach(), torch.autograd.grad(o, (x, y), dout.to(prec))))
    (ref_o, (rq, rkv)), (low_o, (lq, lkv)) = refs
    _check_out(out.detach(), ref_o, low_o)
    check_grads((dq, *dkv.unbind(2)), (rq, *rkv.unbind(2)), (lq, *lkv.unbind(2)), f"kv {seqlens} {heads} ")
