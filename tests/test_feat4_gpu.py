"""sm90_fwd's issue-12 overhead variants on an H100 (session 16, helper feat4), on small odd problems:

* drop_packed (kDropPacked, kernels_cu/dropout_packed.cuh): dropout's keep mask applied to P's packed
  16-bit fragments. The mask read back from the forward equals the NumPy mirror bit for bit
  (cuflash.dropout.keep_mask: what every backward regenerates), also at the thresholds' edges; out,
  LSE and the gradients of forward + backward (the backward by selection) against the float64
  reference with the same mask (2x / 3x the error of plain low-precision attention): at the
  heuristic's BN 160, at BN 192 (DROPOUT_PACKED_BN) and with the TMA-store epilogue;
* emu_exp2 with fold_cap (softmax_fold.cuh): the folded softcap step's exp2 of 1 / 2 quarters of
  S's tiles on the FMA pipes; the error rule against the float64 reference at caps 30 (the fixed
  max), 5 and 50 (the row max), and with large scores.

Seqlens 1, 17, 113, 1023, 2049 with s_q != s_k both ways, MHA / GQA / MQA, causal and not; outputs
NaN-poisoned before each launch. 7 compiles (5 forward, 2 backward), all d128 bf16:
    python tests/feat4_precompile.py
    CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q -x tests/test_feat4_gpu.py
"""
import math

import pytest

import cuflash
from cuflash import registry
from cuflash.problem import Problem

from test_features_gpu import inputs  # noqa: E402
from test_features_opt_gpu import check_forward  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

FWD = registry.get("sm90_fwd")
P_DROP = 0.17
SEED = (0x9E37_79B9_7F4A_7C15, (7 << 32) + 1234)


def heuristic(features, causal, **kw):
    """The heuristic's bf16 d128 8k config (batch 2 x 16 heads) of these features, finished by
    for_problem (tests/features_overhead_timing.py's shape)."""
    p = Problem("fwd", "bf16", 2, 8192, 8192, 16, 16, 128, causal, features=features, **kw)
    return FWD.for_problem(FWD.heuristic(p), p)


def dropout_configs():
    """(id, config): the drop_packed kernels this file and the timing script's dropout rows run."""
    causal, full = heuristic(("dropout",), True), heuristic(("dropout",), False)
    return [("dpk_full", full.replace(drop_packed=True)),
            ("dpk_bn192_causal", causal.replace(drop_packed=True, BN=192, drop_early=0)),   # (drop_early: BN <= 160)
            ("dpk_tmao_causal", causal.replace(drop_packed=True, BN=160, tma_store=True))]


def softcap_configs():
    """(id, config): the folded softcap kernels with the software exp2 on 1 / 2 quarters of tiles."""
    return [("cap_emu1_causal", heuristic(("softcap",), True, softcap=30.0).replace(emu_exp2=1)),
            ("cap_emu2_full", heuristic(("softcap",), False, softcap=30.0).replace(emu_exp2=2))]


def all_test_configs():
    """The forward kernels of this file (tests/feat4_precompile.py builds them with the backwards)."""
    return [c for _, c in dropout_configs() + softcap_configs()]


def test_the_variants_are_what_they_say():
    for name, cfg in dropout_configs():
        assert cfg.dropout and cfg.drop_packed and not cfg.problems(227 * 1024), (name, cfg.problems())
        assert cfg.BN == (192 if "bn192" in name else 160) and cfg.tma_store == ("tmao" in name)
    for name, cfg in softcap_configs():
        assert cfg.fold_cap == 3 and cfg.lazy_rescale and cfg.emu_exp2 in (1, 2), name
        assert not cfg.problems(227 * 1024), (name, cfg.problems())


MASK_CASES = [  # (b, sq, sk, h, h_kv, causal)
    (2, 200, 300, 4, 2, False),
    (1, 300, 177, 3, 1, True),     # s_q > s_k, MQA
    (2, 129, 1023, 2, 2, True),
]


@pytest.mark.parametrize("kernel", dropout_configs(), ids=lambda k: k[0])
def test_packed_mask_is_the_mirrors_bit_for_bit(kernel):
    import torch

    from cuflash import dropout
    from test_sm90_dropout_gpu import read_mask, require_sm90, visible_of

    require_sm90()
    _, cfg = kernel
    for b, sq, sk, h, h_kv, causal in MASK_CASES:
        if causal != cfg.causal:
            continue
        got = read_mask((b, sq, h, 128), (b, sk, h_kv, 128), torch.bfloat16, causal, cfg)
        visible = visible_of(sq, sk, causal)
        want = torch.from_numpy(dropout.keep_mask(*SEED, P_DROP, b, h, sq, sk)).cuda() & visible
        wrong = (got != want).nonzero()
        assert wrong.shape[0] == 0, (f"{cfg.name} {b}x{sq}x{sk}: {wrong.shape[0]} mask bits differ, first "
                                     f"(b, h, row, col) {wrong[:4].tolist()}")
        assert got.any() and not got[..., ~visible].any()


@pytest.mark.parametrize("p_drop", [0.001, 0.6, 0.999])
def test_packed_mask_at_the_thresholds_edges(p_drop):
    """Thresholds 0, 154 and 256 (dropout_packed.cuh: the carry into bit 15 / 31 of a 16-bit lane,
    then the sign replicated over the element's 16 bits)."""
    import torch

    from cuflash import dropout
    from test_sm90_dropout_gpu import read_mask, require_sm90

    require_sm90()
    cfg = dropout_configs()[0][1]
    b, sq, sk, h = 1, 200, 300, 2
    got = read_mask((b, sq, h, 128), (b, sk, h, 128), torch.bfloat16, False, cfg, p=p_drop)
    want = torch.from_numpy(dropout.keep_mask(*SEED, p_drop, b, h, sq, sk)).cuda()
    wrong = (got != want).nonzero()
    assert wrong.shape[0] == 0, f"p={p_drop}: {wrong.shape[0]} mask bits differ, first {wrong[:4].tolist()}"


SHAPES = [(2, 113, 113, 4, 4), (1, 17, 1023, 4, 1), (1, 2049, 1023, 2, 2), (3, 1, 1, 4, 2),
          (1, 1023, 2049, 4, 2), (1, 1023, 17, 4, 4)]


@pytest.mark.parametrize("kernel", dropout_configs(), ids=lambda k: k[0])
def test_packed_dropout_forward_backward_against_reference(kernel):
    import torch

    from cuflash import dropout
    from test_dropout_gpu import attention_with_mask, max_err, rand_qkv
    from test_sm90_dropout_gpu import require_sm90

    require_sm90()
    _, cfg = kernel
    causal, d, dtype = cfg.causal, 128, torch.bfloat16
    scale = 1 / math.sqrt(d)
    for i, (b, sq, sk, h, h_kv) in enumerate(SHAPES):
        what = f"{cfg.name} b{b} {sq}x{sk} h{h}x{h_kv}"
        q, k, v = rand_qkv(b, sq, sk, h, h_kv, d, dtype, grad=True)
        dout = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
        keep = torch.from_numpy(dropout.keep_mask(*SEED, P_DROP, b, h, sq, sk)).cuda()
        out, lse, _ = cuflash.flash_attn_func(q, k, v, P_DROP, causal=causal, return_attn_probs=True,
                                              dropout_seed=SEED, config=cfg)
        assert not out.isnan().any() and not lse.isnan().any(), what
        ref_out, ref_lse = attention_with_mask(q, k, v, causal, scale, torch.float64, keep, P_DROP)
        low_out, _ = attention_with_mask(q, k, v, causal, scale, dtype, keep, P_DROP)
        err, base = max_err(out, ref_out), max_err(low_out, ref_out)
        assert err <= 2 * base + 1e-5, f"{what} out: error {err:.3g} > 2 x plain {base:.3g}"
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite), what
        if finite.any():
            assert max_err(lse[finite], ref_lse[finite]) < 1e-3, what
        if i % 2:   # the gradients on every other shape (the backward is selection's, unchanged)
            continue
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        ref_g = torch.autograd.grad(ref_out, (q, k, v), dout.double())
        low_g = torch.autograd.grad(low_out, (q, k, v), dout)
        for name, a, r, lo in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_g, low_g):
            assert not a.isnan().any(), f"{what} {name}: unwritten (NaN) elements"
            e, bse = max_err(a, r), max_err(lo, r)
            floor = torch.finfo(dtype).eps * max(1.0, r.abs().max().item())
            if name in ("dq", "dk"):   # D = rowsum(dO∘O) from the rounded O (test_dropout_gpu.py)
                d_scale = (dout.double() * out.double()).sum(-1).abs().max().item()
                other = k if name == "dq" else q
                floor = max(floor, torch.finfo(dtype).eps * d_scale * other.abs().max().item() * scale)
            assert e <= 3 * bse + floor, f"{what} {name}: error {e:.3g} > 3 x plain {bse:.3g} + {floor:.3g}"


SEQLENS = [(1, 17), (17, 1), (113, 1023), (1023, 113), (2049, 1023), (1023, 2049)]
HEADS = ("mha", "gqa", "mqa")


@pytest.mark.parametrize("kernel", softcap_configs(), ids=lambda k: k[0])
def test_softcap_emu_forward(kernel):
    _, cfg = kernel
    for softcap in (30.0, 5.0, 50.0):       # fixed max (2 cap log2(e) <= 100), and the row max at 50
        for i, (sq, sk) in enumerate(SEQLENS):
            heads = HEADS[i % 3]
            q, k, v, _ = inputs(2, sq, sk, heads, 128, "bf16")
            check_forward(cfg, q, k, v, cfg.causal, (-1, -1), softcap, None,
                          f"{cfg.name} softcap {softcap} {sq}x{sk} {heads}")


@pytest.mark.parametrize("kernel", softcap_configs(), ids=lambda k: k[0])
def test_softcap_emu_large_scores(kernel):
    """Scores near and past the cap (inputs x 4, one key raised on every row): t near +-1, the
    software exp2's arguments down to -2 cap log2(e)."""
    _, cfg = kernel
    for sq, sk in ((1023, 2049), (2049, 2049)):
        q, k, v, _ = inputs(2, sq, sk, "gqa", 128, "bf16")
        q, k = q * 4, k * 4
        q[..., -1] = 4.0
        k[:, 3, :, -1] = 40.0
        check_forward(cfg, q, k, v, cfg.causal, (-1, -1), 30.0, None, f"{cfg.name} large scores {sq}x{sk}")
