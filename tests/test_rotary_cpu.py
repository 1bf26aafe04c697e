"""cuflash.layers.rotary without a GPU: torch CPU tensors run the float64 reference
(cuflash.reference.apply_rotary), checked against rotation written as complex multiplication;
gradcheck of every autograd function; RotaryEmbedding's tables; the kernel source compiled by nvcc
(sm_80, sm_90a: no spills) with its params struct laid out as cuflash.launch packs it."""
import math
import subprocess

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cuflash import rotary as rotary_op  # noqa: E402
from cuflash.compile import kernel_dir  # noqa: E402
from cuflash.layers.rotary import (RotaryEmbedding, apply_rotary_emb, apply_rotary_emb_func,  # noqa: E402
                                   apply_rotary_emb_kv_, apply_rotary_emb_qkv_, apply_rotary_emb_torch,
                                   rotate_half)


def complex_rotation(x, cos, sin, positions, interleaved):
    """x (..., seqlen, nheads, headdim) float64 with each pair as one complex number times
    exp(iθ) = cos + i sin of its position's row; positions (..., seqlen), out-of-range ones unturned."""
    half = cos.shape[1]
    rot = 2 * half
    valid = (positions >= 0) & (positions < cos.shape[0])
    idx = positions.clamp(0, cos.shape[0] - 1)
    turn = torch.complex(torch.where(valid[..., None], cos[idx], torch.ones(())),
                         torch.where(valid[..., None], sin[idx], torch.zeros(())))[..., None, :]
    if interleaved:
        z = torch.view_as_complex(x[..., :rot].reshape(*x.shape[:-1], half, 2).contiguous())
        turned = torch.view_as_real(z * turn).flatten(-2)
    else:
        z = torch.complex(x[..., :half], x[..., half:rot])
        w = z * turn
        turned = torch.cat((w.real, w.imag), dim=-1)
    return torch.cat((turned, x[..., rot:]), dim=-1)


def tables(rows, rotary_dim):
    angles = torch.rand(rows, rotary_dim // 2, dtype=torch.float64) * 2 * math.pi
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("headdim,rotary_dim", [(16, 16), (20, 12), (9, 6)])
def test_forward_matches_complex_rotation(interleaved, headdim, rotary_dim):
    x = torch.randn(3, 7, 2, headdim, dtype=torch.float64)
    cos, sin = tables(12, rotary_dim)
    for offsets in (0, 5, torch.tensor([0, 2, 11])):
        got = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
        off = offsets if isinstance(offsets, torch.Tensor) else torch.full((3,), offsets)
        want = complex_rotation(x, cos, sin, off[:, None] + torch.arange(7), interleaved)
        assert torch.allclose(got, want, atol=1e-12), offsets
        # the plain torch formula agrees where every position is in the table
        if not isinstance(offsets, torch.Tensor):
            plain = apply_rotary_emb_torch(x, cos[offsets:offsets + 7], sin[offsets:offsets + 7], interleaved)
            assert torch.allclose(plain, want, atol=1e-12)


def test_varlen_with_empty_and_long_sequences():
    lens = [0, 1, 6, 0, 4]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    x = torch.randn(int(cu[-1]), 3, 10, dtype=torch.float64)
    cos, sin = tables(9, 8)
    offsets = torch.tensor([4, 8, 2, 0, 7])   # 8 + 0 and 7 + 3 run past the 9 rows: unturned there
    got = apply_rotary_emb(x, cos, sin, cu_seqlens=cu, max_seqlen=6, seqlen_offsets=offsets)
    for b in range(5):
        s, e = int(cu[b]), int(cu[b + 1])
        want = complex_rotation(x[s:e][None], cos, sin, (offsets[b] + torch.arange(e - s))[None], False)[0]
        assert torch.allclose(got[s:e], want, atol=1e-12)


def test_inplace_and_conjugate():
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    cos, sin = tables(5, 8)
    y = x.clone()
    assert rotary_op.apply_rotary(y, cos, sin, inplace=True) is y
    back = rotary_op.apply_rotary(y, cos, sin, conjugate=True)    # turn by -θ: back to x
    assert torch.allclose(back, x, atol=1e-12)
    assert apply_rotary_emb_func is apply_rotary_emb


def test_lower_precision_cpu_rounds_once():
    x = torch.randn(2, 5, 3, 8, dtype=torch.bfloat16)
    cos, sin = tables(5, 8)
    got = apply_rotary_emb(x, cos.bfloat16(), sin.bfloat16())
    want = complex_rotation(x.double(), cos.bfloat16().double(), sin.bfloat16().double(),
                            torch.arange(5).expand(2, 5), False)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())


def test_gradcheck():
    cos, sin = tables(10, 6)
    x = torch.randn(2, 6, 2, 9, dtype=torch.float64, requires_grad=True)
    for kw in ({}, {"interleaved": True, "seqlen_offsets": 3}, {"seqlen_offsets": torch.tensor([1, 4])}):
        assert torch.autograd.gradcheck(lambda t: apply_rotary_emb(t, cos, sin, **kw), (x,))
        # in place (on a copy: gradcheck's input is a leaf)
        assert torch.autograd.gradcheck(lambda t: apply_rotary_emb(t.clone(), cos, sin, inplace=True, **kw), (x,))
    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    xv = torch.randn(8, 2, 7, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([0, 2, 5])
    assert torch.autograd.gradcheck(
        lambda t: apply_rotary_emb(t, cos, sin, cu_seqlens=cu, max_seqlen=5, seqlen_offsets=offsets), (xv,))
    qkv = torch.randn(2, 6, 3, 2, 8, dtype=torch.float64, requires_grad=True)
    cos8, sin8 = tables(10, 8)
    cos_k, sin_k = tables(10, 8)
    assert torch.autograd.gradcheck(lambda t: apply_rotary_emb_qkv_(t.clone(), cos8, sin8, seqlen_offsets=2), (qkv,))
    assert torch.autograd.gradcheck(lambda t: apply_rotary_emb_qkv_(t.clone(), cos8, sin8, cos_k, sin_k), (qkv,))
    gqa = torch.randn(2, 6, 4 + 2 * 1, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: apply_rotary_emb_qkv_(t.clone(), cos8, sin8, num_heads_q=4), (gqa,))
    kv = torch.randn(2, 6, 2, 2, 8, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([0, 3])
    assert torch.autograd.gradcheck(lambda t: apply_rotary_emb_kv_(t.clone(), cos8, sin8, seqlen_offsets=offsets),
                                    (kv,))


def test_packed_forms_rotate_q_and_k_only():
    cos, sin = tables(8, 8)
    cos_k, sin_k = tables(8, 8)
    qkv = torch.randn(2, 5, 3, 2, 8, dtype=torch.float64)
    got = apply_rotary_emb_qkv_(qkv.clone(), cos, sin, cos_k, sin_k, seqlen_offsets=1)
    pos = (1 + torch.arange(5)).expand(2, 5)
    assert torch.allclose(got[:, :, 0], complex_rotation(qkv[:, :, 0], cos, sin, pos, False), atol=1e-12)
    assert torch.allclose(got[:, :, 1], complex_rotation(qkv[:, :, 1], cos_k, sin_k, pos, False), atol=1e-12)
    assert torch.equal(got[:, :, 2], qkv[:, :, 2])
    gqa = torch.randn(2, 5, 3 + 2, 8, dtype=torch.float64)
    got = apply_rotary_emb_qkv_(gqa.clone(), cos, sin, num_heads_q=3)
    want = complex_rotation(gqa[:, :, :4], cos, sin, torch.arange(5).expand(2, 5), False)
    assert torch.allclose(got[:, :, :4], want, atol=1e-12)
    assert torch.equal(got[:, :, 4], gqa[:, :, 4])
    with pytest.raises(ValueError, match="num_heads_q"):
        apply_rotary_emb_qkv_(gqa.clone(), cos, sin)
    kv = torch.randn(2, 5, 2, 2, 8, dtype=torch.float64)
    got = apply_rotary_emb_kv_(kv.clone(), cos, sin, interleaved=True)
    assert torch.allclose(got[:, :, 0], complex_rotation(kv[:, :, 0], cos, sin, torch.arange(5).expand(2, 5), True),
                          atol=1e-12)
    assert torch.equal(got[:, :, 1], kv[:, :, 1])


def test_rotate_half():
    x = torch.arange(8.0)
    assert rotate_half(x).tolist() == [-4, -5, -6, -7, 0, 1, 2, 3]
    assert rotate_half(x, interleaved=True).tolist() == [-1, 0, -3, 2, -5, 4, -7, 6]


def test_bad_input_raises_naming_the_argument():
    x = torch.randn(2, 5, 2, 8, dtype=torch.float64)
    cos, sin = tables(5, 8)
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary_emb(x, *tables(5, 10))
    with pytest.raises(ValueError, match="seqlen_ro"):
        apply_rotary_emb(x, *tables(4, 8))
    with pytest.raises(ValueError, match="seqlen_offsets"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=1)
    with pytest.raises(ValueError, match="seqlen_offsets"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="seqlen_offsets"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=1.5)
    with pytest.raises(ValueError, match="cos and sin"):
        apply_rotary_emb(x, cos, sin[:, :3])
    with pytest.raises(ValueError, match="max_seqlen"):
        apply_rotary_emb(x[0], cos, sin, cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens"):
        apply_rotary_emb(x[0], cos, sin, cu_seqlens=torch.tensor([0, 5]), max_seqlen=5)
    with pytest.raises(ValueError, match="x must be"):
        apply_rotary_emb(x[0], cos, sin)


# ---------------------------------------------------------------------------------------
# RotaryEmbedding

def test_module_tables_and_forward():
    emb = RotaryEmbedding(8, base=100.0)
    qkv = torch.randn(2, 6, 3, 2, 12, dtype=torch.float64)
    out = emb(qkv.clone(), seqlen_offset=2)
    assert emb._seq_len_cached == 8 and emb._cos_cached.dtype == torch.float64
    angles = (torch.arange(8.0)[:, None] * 100.0 ** (-torch.arange(0, 8, 2) / 8.0)[None]).double()
    assert torch.allclose(emb._cos_cached, angles.cos(), atol=1e-6)
    pos = (2 + torch.arange(6)).expand(2, 6)
    c, s = angles.cos(), angles.sin()
    assert torch.allclose(out[:, :, 0], complex_rotation(qkv[:, :, 0], c, s, pos, False), atol=1e-5)
    assert torch.equal(out[:, :, 2], qkv[:, :, 2])
    # q with a separate kv (GQA): the q heads and k turn alike, v stays
    q, kv = torch.randn(2, 6, 4, 12, dtype=torch.float64), torch.randn(2, 6, 2, 1, 12, dtype=torch.float64)
    q2, kv2 = emb(q.clone(), kv.clone())
    pos0 = torch.arange(6).expand(2, 6)
    assert torch.allclose(q2, complex_rotation(q, c, s, pos0, False), atol=1e-5)
    assert torch.allclose(kv2[:, :, 0], complex_rotation(kv[:, :, 0], c, s, pos0, False), atol=1e-5)
    assert torch.equal(kv2[:, :, 1], kv[:, :, 1])
    # no persistent buffers: a checkpoint holds none of them
    assert list(emb.state_dict()) == []


def test_module_cache_rules():
    emb = RotaryEmbedding(4)
    qkv = torch.randn(1, 5, 3, 1, 4)
    emb(qkv.clone())
    first = emb._cos_cached
    emb(qkv[:, :3].clone())                       # shorter: the cache stays
    assert emb._cos_cached is first
    emb(qkv.clone(), max_seqlen=9)                # longer: remade
    assert emb._seq_len_cached == 9 and emb._cos_cached is not first
    emb(qkv.double().clone())                     # another dtype: remade in it, for this call's length
    assert emb._cos_cached.dtype == torch.float64 and emb._seq_len_cached == 5
    # a tensor offset does not grow the cache unless max_seqlen says how far (positions past it
    # stay unturned)
    emb(qkv.double().clone(), seqlen_offset=torch.tensor([2]))
    assert emb._seq_len_cached == 5


def test_xpos_scales_q_up_and_k_down():
    emb = RotaryEmbedding(8, scale_base=16)
    qkv = torch.randn(1, 10, 3, 1, 8, dtype=torch.float64)
    out = emb(qkv.clone())
    power = (torch.arange(10.0) - 5) / 16
    scale = (((torch.arange(0, 8, 2) + 0.4 * 8) / (1.4 * 8))[None] ** power[:, None]).double()
    assert torch.allclose(emb._sin_cached[1:] / emb._sin_k_cached[1:], scale[1:] ** 2, rtol=1e-5)
    # the product q·k of a pair at one position is unscaled: |q'|·|k'| = |q|·|k|
    qn, kn = out[0, :, 0, 0, :4] ** 2 + out[0, :, 0, 0, 4:] ** 2, out[0, :, 1, 0, :4] ** 2 + out[0, :, 1, 0, 4:] ** 2
    q0, k0 = qkv[0, :, 0, 0, :4] ** 2 + qkv[0, :, 0, 0, 4:] ** 2, qkv[0, :, 1, 0, :4] ** 2 + qkv[0, :, 1, 0, 4:] ** 2
    assert torch.allclose(qn * kn, q0 * k0, rtol=1e-5)


def test_pos_idx_in_fp32_false_rounds_positions_to_inv_freq_dtype():
    emb = RotaryEmbedding(4, pos_idx_in_fp32=False).to(torch.bfloat16)   # inv_freq now bf16
    x = torch.zeros(1, 300, 3, 1, 4, dtype=torch.float32)
    emb(x)
    t = torch.arange(300, dtype=torch.bfloat16)                          # 257 rounds to 256 in bf16
    assert torch.equal(emb._cos_cached[257], emb._cos_cached[256]) and t[257] == t[256]
    exact = RotaryEmbedding(4).to(torch.bfloat16)                       # fp32 positions by default
    exact(x)
    assert not torch.equal(exact._cos_cached[257], exact._cos_cached[256])


# ---------------------------------------------------------------------------------------
# the CUDA kernel's source, without a GPU

from helper_kernel_checks import assert_params_layout, needs_nvcc, ptxas_reports  # noqa: E402
INSTANTIATIONS = [(e, t, i, v) for e, t in (("cuflash::bf16", "cuflash::bf16"), ("cuflash::fp16", "float"),
                                             ("float", "float")) for i in ("false", "true") for v in ("false", "true")]


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_kernel_compiles_without_spills(tmp_path, arch):
    names = [f"cuflash::rotary<{e}, {t}, {i}, {v}>" for e, t, i, v in INSTANTIATIONS]
    reports = ptxas_reports(tmp_path, "rotary", "RotaryParams", names, arch)
    assert all(r.spill_stores == 0 and r.stack_bytes == 0 and r.registers <= 64 for r in reports), reports


@needs_nvcc
def test_params_layout_matches_nvcc(tmp_path):
    dt = assert_params_layout(tmp_path, "RotaryParams", "params_rotary.cuh")
    # the per-call writes of cuflash.rotary: six pointers first, then x's strides, then out's
    assert dt.names[:6] == ("x", "out", "cos", "sin", "cu_seqlens", "seqlen_offsets")
    assert dt.names[9:12] == ("out_batch_stride", "out_row_stride", "out_head_stride")


def test_rotary_is_no_registered_family():
    """The kernel is a helper op: the registry (which the tuner and benchmarks iterate) has no
    'rotary' family, and importing cuflash imports neither cuflash.rotary nor torch through it."""
    from cuflash import registry

    assert all("rotary" not in f.name for f in registry.families())
    code = "import sys, cuflash; print('cuflash.rotary' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([__import__("sys").executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(kernel_dir().parent))
    assert out.stdout.split() == ["False", "False"], out.stderr
