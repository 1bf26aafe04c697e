"""Forward kernel on the GPU, the FlashAttention way.

Error of cuflash against a float64 reference must be at most twice the error of plain
attention computed in the same low precision (torch, no fusion), on fresh random inputs,
with outputs poisoned (NaN) before each launch. The float64 reference runs on the GPU
(torch) for speed; a subset is also checked against cuflash.reference (NumPy).
"""
import math

import numpy as np
import pytest

import cuflash
from cuflash import _gpu, reference

from conftest import GPU_HDIMS as HDIMS, GPU_HEADS as HEADS, GPU_SEQLENS as SEQLENS  # noqa: E402
from conftest import cuda_randn as rand, torch_attention, torch_dtype  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("hdim", HDIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_forward_matches_reference(dtype, causal, hdim, seqlens, heads):
    import torch

    tdtype = torch_dtype(dtype)
    sq, sk = seqlens
    h, hkv = HEADS[heads]
    batch = 2
    q, k, v = rand((batch, sq, h, hdim), tdtype), rand((batch, sk, hkv, hdim), tdtype), rand((batch, sk, hkv, hdim), tdtype)
    scale = 1 / math.sqrt(hdim)
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    ref, ref_lse = torch_attention(q, k, v, causal, scale, torch.float64)
    low, _ = torch_attention(q, k, v, causal, scale, q.dtype)
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) output elements"
    err = (out.double() - ref).abs().max().item()
    base = (low.double() - ref).abs().max().item()
    assert err <= 2 * base + 1e-5, f"cuflash error {err:.3g} > 2 x plain {dtype} attention error {base:.3g}"
    assert not torch.isnan(lse).any(), "unwritten LSE"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "fully masked rows must have LSE = +inf"
    assert (lse[~finite] == math.inf).all()
    lse_err = (lse.double() - ref_lse)[finite].abs().max().item() if finite.any() else 0.0
    assert lse_err < 1e-3, f"LSE error {lse_err:.3g}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_numpy_and_cupy_inputs_against_numpy_reference(dtype, causal):
    """The NumPy and CuPy entry points, checked against cuflash.reference (float64 NumPy)."""
    import cupy
    import ml_dtypes

    npdtype = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}[dtype]
    rng = np.random.default_rng()
    q = rng.standard_normal((2, 203, 4, 72)).astype(npdtype)
    k = rng.standard_normal((2, 113, 2, 72)).astype(npdtype)
    v = rng.standard_normal((2, 113, 2, 72)).astype(npdtype)
    ref, ref_lse = reference.attention_naive(q, k, v, causal=causal, return_lse=True)
    low = reference.lowp_attention(q, k, v, causal=causal, dtype=npdtype)
    base = np.abs(low - ref).max()
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert isinstance(out, np.ndarray) and out.dtype == q.dtype
    assert np.abs(out.astype(np.float64) - ref).max() <= 2 * base + 1e-5
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    assert np.abs(lse[finite] - ref_lse[finite]).max() < 1e-3
    if dtype == "fp16":  # CuPy has fp16 natively; bf16 CuPy arrays need ml_dtypes support
        dq, dk, dv = (cupy.asarray(x) for x in (q, k, v))
        dout = cuflash.flash_attn_func(dq, dk, dv, causal=causal)
        assert isinstance(dout, cupy.ndarray)
        np.testing.assert_array_equal(cupy.asnumpy(dout), out)


def test_strided_views_and_explicit_config():
    """q, k, v as views into one packed (b, s, 3, h, d) tensor; a config given explicitly."""
    import torch

    qkv = rand((2, 300, 3, 4, 64), torch.bfloat16)
    q, k, v = qkv.unbind(2)
    cfg = cuflash.FwdConfig(64, 32, 4, 3, 64, "bf16", True)
    out = cuflash.flash_attn_func(q, k, v, causal=True, config=cfg)
    ref, _ = torch_attention(q, k, v, True, 1 / 8, torch.float64)
    low, _ = torch_attention(q, k, v, True, 1 / 8, q.dtype)
    assert (out.double() - ref).abs().max() <= 2 * (low.double() - ref).abs().max() + 1e-5


def test_every_config_of_the_space_is_correct():
    """Each valid point of the tuning space (hdim 64 and 128) computes the same function."""
    import torch

    failures = []
    for hdim in (64, 128):
        for causal in (False, True):
            q, k, v = (rand((1, 333, 2, hdim), torch.bfloat16) for _ in range(3))
            ref, _ = torch_attention(q, k, v, causal, hdim ** -0.5, torch.float64)
            low, _ = torch_attention(q, k, v, causal, hdim ** -0.5, q.dtype)
            base = (low.double() - ref).abs().max().item()
            for cfg in cuflash.config.valid_fwd_configs(hdim, "bf16", causal, _gpu.max_smem()):
                out = cuflash.flash_attn_func(q, k, v, causal=causal, config=cfg)
                err = (out.double() - ref).abs().max().item()
                if not err <= 2 * base + 1e-5:
                    failures.append(f"{cfg.name}: err {err:.3g} vs plain bf16 {base:.3g}")
    assert not failures, "\n".join(failures)


def test_empty_and_keyless_inputs():
    import torch

    q = rand((0, 5, 2, 64), torch.float16)
    assert cuflash.flash_attn_func(q, q, q).shape == (0, 5, 2, 64)
    q, k = rand((1, 4, 2, 64), torch.float16), rand((1, 0, 2, 64), torch.float16)
    out, lse, _ = cuflash.flash_attn_func(q, k, k, return_attn_probs=True)
    assert (out == 0).all() and (lse == math.inf).all()
