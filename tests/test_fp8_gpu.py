"""The FP8 (e4m3) forward (sm90_fwd_fp8, cuflash.fp8) on an H100, the FlashAttention way.

Error rule (cuflash/fp8.py): the kernel's largest error against the float64 reference (the
e4m3 inputs decoded exactly, times their descales) is at most 2x the largest error of plain
attention from the same decoded inputs with P rounded to e4m3 as the kernel does (e4m3(256 P) /
256; fp32 S and P V, bf16 output)
plus 1e-3 x max |reference|. Outputs are NaN-poisoned before each launch; LSE to 1e-3.

Run the layout tests first (`-k one_hot`): one-hot Q and K make each query pick exactly one
key, so O is one row of V, bit-exact, and a wrong fragment / Vᵀ key order / descriptor shows
as the wrong row or column.
"""
import math

import numpy as np
import pytest

import cuflash
from cuflash import fp8, registry

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

FAM = registry.get("sm90_fwd_fp8")


def _torch():
    import torch

    return torch


def require_sm90():
    from cuflash import _gpu

    if not _gpu.available() or _gpu.arch() != (9, 0):
        pytest.skip("sm90_fwd_fp8 needs an sm_90 GPU")


def e4m3(x):
    return x.to(_torch().float8_e4m3fn)


def reference(q8, k8, v8, qd, kd, vd, scale, causal):
    """(out, lse) in float64 on the GPU and the plain e4m3-P baseline (fp8.py's rule), torch."""
    torch = _torch()
    b, sq, h, d = q8.shape
    sk, hkv = k8.shape[1], k8.shape[2]
    rep = h // hkv
    per = lambda x: (x.reshape(-1)[0].expand(b, hkv) if x.numel() == 1 else x).double()  # noqa: E731
    qdh = per(qd).repeat_interleave(rep, 1)
    q = q8.double() * qdh[:, None, :, None]
    k = (k8.double() * per(kd)[:, None, :, None]).repeat_interleave(rep, 2)
    v = (v8.double() * per(vd)[:, None, :, None]).repeat_interleave(rep, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        s = s.masked_fill(~keep, -math.inf)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    out = torch.einsum("bhqk,bkhd->bqhd", p / torch.where(l > 0, l, torch.ones_like(l)), v)
    lse = (m + torch.log(l)).squeeze(-1)                       # +inf rows: log 0 = -inf -> fixed
    lse = torch.where(l.squeeze(-1) > 0, lse, torch.full_like(lse, math.inf))
    # baseline: fp32 S and P, P rounded to e4m3, fp32 P V over the fp32 row sum, bf16 out
    s32, v32 = s.float(), v.float()
    m32 = m.float()
    p32 = torch.exp(s32 - m32)
    l32 = p32.sum(-1, keepdim=True)
    p8 = e4m3(p32 * fp8.P_SCALE).float() / fp8.P_SCALE          # as the kernel rounds P
    base = torch.einsum("bhqk,bkhd->bqhd", p8 / torch.where(l32 > 0, l32, torch.ones_like(l32)),
                        v32).to(torch.bfloat16)
    return out, lse, base


def run_and_check(b, sq, sk, h, hkv, d, causal, per_head_descale, what=""):
    torch = _torch()
    g = torch.Generator(device="cuda").manual_seed(hash((b, sq, sk, h, hkv, d, causal)) % 2 ** 31)
    rn = lambda *s: torch.randn(*s, device="cuda", generator=g) * 3  # noqa: E731
    q8, k8, v8 = e4m3(rn(b, sq, h, d)), e4m3(rn(b, sk, hkv, d)), e4m3(rn(b, sk, hkv, d))
    shape = (b, hkv) if per_head_descale else (1,)
    qd, kd, vd = (torch.rand(shape, device="cuda", generator=g) + 0.5 for _ in range(3))
    scale = 1 / math.sqrt(d)
    out, lse, _ = cuflash.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd,
                                          v_descale=vd, return_attn_probs=True)
    ref, ref_lse, base = reference(q8, k8, v8, qd, kd, vd, scale, causal)
    assert out.dtype == torch.bfloat16 and out.shape == q8.shape
    assert not torch.isnan(out).any(), f"{what}unwritten (NaN-poisoned) output elements"
    err = (out.double() - ref).abs().max().item()
    base_err = (base.double() - ref).abs().max().item()
    bound = 2 * base_err + 1e-3 * ref.abs().max().item()
    assert err <= bound, f"{what}fp8 error {err:.3g} > 2 x baseline {base_err:.3g} + 1e-3 max|ref|"
    assert not torch.isnan(lse).any(), f"{what}unwritten LSE"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"{what}fully masked rows must have LSE = +inf"
    if finite.any():
        lse_err = (lse.double() - ref_lse)[finite].abs().max().item()
        assert lse_err < 1e-3 * max(1.0, ref_lse[finite].abs().max().item()), f"{what}LSE error {lse_err:.3g}"


# ---------------------------------------------------------------------------------------
# layouts first: one-hot Q and K

@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("random_v", [False, True], ids=["identity_v", "random_v"])
def test_one_hot_layouts(d, random_v):
    """Query i sees exactly key target(i) (scores 64 vs 0: the others' weight e^-64 rounds to
    0 even as 256 P), so O[i] = V[target(i)] bit-exact in bf16 and LSE = 64. identity_v: V[key] = one-hot(key) (a
    wrong key order shows as the wrong column); random_v: V random e4m3 (a wrong head-dim
    order shows as permuted columns)."""
    require_sm90()
    torch = _torch()
    sk = 64 if d == 64 else 128                    # d 64: 64 one-hot keys, a ragged block
    sq = 96
    target = (7 * torch.arange(sq) + 3) % sk
    eye = torch.eye(d, device="cuda")
    q = (8 * eye[target.cuda()])[None, :, None, :]                     # (1, sq, 1, d)
    k = (8 * eye[:sk])[None, :, None, :]                               # (1, sk, 1, d)
    if random_v:
        v = torch.randn(1, sk, 1, d, device="cuda") * 2
    else:
        v = torch.zeros(1, sk, 1, d, device="cuda")
        # one non-zero per key, in column key, value 1 + (key % 8) / 8 (exact in e4m3)
        v[0, torch.arange(sk), 0, torch.arange(sk)] = 1 + (torch.arange(sk, device="cuda") % 8).float() / 8
    q8, k8, v8 = e4m3(q), e4m3(k), e4m3(v)
    out, lse, _ = cuflash.flash_attn_func(q8, k8, v8, softmax_scale=1.0, return_attn_probs=True)
    want = v8.float()[0, target.cuda(), 0].to(torch.bfloat16)
    got = out[0, :, 0]
    bad = (got.float() != want.float()).nonzero()
    assert bad.numel() == 0, (f"{bad.shape[0]} wrong elements; first (row, col): {bad[:8].tolist()}; "
                              f"row {bad[0, 0].item()}: got {got[bad[0, 0]].float()[:16].tolist()} "
                              f"want {want[bad[0, 0]].float()[:16].tolist()}")
    assert torch.allclose(lse[0, 0].double(), torch.full((sq,), 64.0, dtype=torch.float64, device="cuda"),
                          atol=1e-4), lse[0, 0, :8]


def test_one_hot_descales():
    """The descales: q_descale 0.5, k_descale 0.25 on scores (folded into the exp2 scale and the
    LSE), v_descale 4 on O (the epilogue), per (batch, kv head) with batch 2, 2 kv heads."""
    require_sm90()
    torch = _torch()
    d, sk, sq = 128, 128, 64
    target = (5 * torch.arange(sq) + 1) % sk
    eye = torch.eye(d, device="cuda")
    q = (16 * eye[target.cuda()])[None, :, None, :].expand(2, sq, 4, d).contiguous()
    k = (16 * eye[:sk])[None, :, None, :].expand(2, sk, 2, d).contiguous()
    v = torch.randn(2, sk, 2, d, device="cuda")
    q8, k8, v8 = e4m3(q), e4m3(k), e4m3(v)
    qd = torch.full((2, 2), 0.5, device="cuda")
    kd = torch.tensor([[0.25, 0.5], [1.0, 0.25]], device="cuda")
    vd = torch.tensor([[4.0, 2.0], [1.0, 0.5]], device="cuda")
    out, lse, _ = cuflash.flash_attn_func(q8, k8, v8, softmax_scale=1.0, q_descale=qd, k_descale=kd,
                                          v_descale=vd, return_attn_probs=True)
    for bi in range(2):
        for hi in range(4):
            hk = hi // 2
            want = (v8.float()[bi, target.cuda(), hk] * vd[bi, hk]).to(torch.bfloat16)
            assert torch.equal(out[bi, :, hi], want), (bi, hi)
            s = 256 * qd[bi, hk].item() * kd[bi, hk].item()          # the one visible score
            lse_want = s + math.log1p((sk - 1) * math.exp(-s))
            assert abs(lse[bi, hi].double().mean().item() - lse_want) < 1e-3, (bi, hi)


# ---------------------------------------------------------------------------------------
# the grid

SEQLENS = [(1, 1), (17, 17), (113, 203), (203, 113), (1023, 1023), (2049, 2049), (1, 300), (300, 1)]
HEADS = [(4, 4), (4, 1)]


@pytest.mark.parametrize("heads", HEADS, ids=lambda hh: f"h{hh[0]}x{hh[1]}")
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_grid(d, causal, seqlens, heads):
    require_sm90()
    sq, sk = seqlens
    b = 2 if sq * sk < 2 ** 21 else 1
    run_and_check(b, sq, sk, heads[0], heads[1], d, causal, per_head_descale=heads[1] > 1,
                  what=f"d{d} {'causal' if causal else 'full'} {sq}x{sk} {heads}: ")


@pytest.mark.parametrize("d", [32, 96, 160])
def test_smaller_head_dims_zero_filled(d):
    require_sm90()
    run_and_check(2, 113, 203, 4, 2, d, True, True, what=f"d{d}: ")


@pytest.mark.parametrize("change", [{"persistent": True}, {"BM": 64, "consumers": 1, "pingpong": False},
                                    {"stages": 3}, {"pingpong": False}],
                         ids=["persistent", "c1", "s3", "no_pp"])
@pytest.mark.parametrize("d", [64, 256])
def test_layout_variants(d, change):
    """Other points of the space on a ragged shape with more tiles than SMs (persistent)."""
    require_sm90()
    torch = _torch()
    from cuflash.problem import Problem

    p = Problem("fwd", "e4m3", 2, 1100, 900, 16, 4, d, True)
    cfg = FAM.heuristic(p).replace(**change)
    if cfg.problems(227 * 1024):
        pytest.skip(str(cfg.problems(227 * 1024)))
    g = torch.Generator(device="cuda").manual_seed(5)
    q8 = e4m3(torch.randn(2, 1100, 16, d, device="cuda", generator=g) * 3)
    k8, v8 = (e4m3(torch.randn(2, 900, 4, d, device="cuda", generator=g) * 3) for _ in range(2))
    out = cuflash.flash_attn_func(q8, k8, v8, causal=True, config=cfg)
    ref_out = cuflash.flash_attn_func(q8, k8, v8, causal=True)
    ref, _, base = reference(q8, k8, v8, *(torch.ones(1, device="cuda"),) * 3, 1 / math.sqrt(d), True)
    err = (out.double() - ref).abs().max().item()
    base_err = (base.double() - ref).abs().max().item()
    assert err <= 2 * base_err + 1e-3 * ref.abs().max().item(), (cfg.name, err, base_err)
    assert (ref_out.double() - ref).abs().max().item() <= 2 * base_err + 1e-3 * ref.abs().max().item()


def test_cupy_uint8_matches_torch():
    require_sm90()
    torch = _torch()
    cupy = pytest.importorskip("cupy")
    q8 = e4m3(torch.randn(1, 200, 4, 128, device="cuda") * 3)
    k8, v8 = (e4m3(torch.randn(1, 150, 2, 128, device="cuda") * 3) for _ in range(2))
    vd = torch.tensor([1.5], device="cuda")
    out_t = cuflash.flash_attn_func(q8, k8, v8, causal=True, v_descale=vd)
    torch.cuda.synchronize()
    as_cupy = lambda x: cupy.asarray(x.view(torch.uint8))  # noqa: E731
    out_c = cuflash.flash_attn_func(as_cupy(q8), as_cupy(k8), as_cupy(v8), causal=True,
                                    v_descale=cupy.asarray(vd))
    cupy.cuda.get_current_stream().synchronize()
    assert np.array_equal(cupy.asnumpy(out_c), out_t.view(torch.int16).cpu().numpy().view(np.uint16))


def test_bad_descale_names_argument():
    require_sm90()
    torch = _torch()
    q8 = e4m3(torch.randn(1, 16, 2, 64, device="cuda"))
    with pytest.raises(ValueError, match="^k_descale: expected shape"):
        cuflash.flash_attn_func(q8, q8, q8, k_descale=torch.ones(3, device="cuda"))
    with pytest.raises(TypeError, match="^q_descale: dtype must be float32"):
        cuflash.flash_attn_func(q8, q8, q8, q_descale=torch.ones(1, device="cuda", dtype=torch.float64))
