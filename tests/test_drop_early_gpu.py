"""sm90_fwd's drop_early (kDropEarly, kernels_cu/dropout_packed.cuh) on the GPU, sm_90 only:

* the keep mask read back from the drop_early forward (d128, bf16) equals the NumPy mirror
  (cuflash.dropout.keep_mask, Philox4x32-7), at the default p and at the thresholds' edges
  (0, 154 and 256: the SWAR compare's three forms);
* its output, LSE and gradients are bit for bit those of the drop_packed forward it replaces
  (the same mask on the same packed P; the backward is the same kernel), on odd shapes
  (seqlens 1, 17, 113, 1023, 2049; s_q != s_k both ways; GQA / MQA; causal and not), outputs
  poisoned (NaN) before each launch;
* deterministic: two calls with one seed give the same bits;
* sm90_bwd's dropout backward with the plain heuristic's speed flags (DROPOUT_PLAIN_FLAGS: dynamic,
  ds_double, dq_early, dk_late, frag_pin) within 3x the error of plain low-precision attention's
  gradients against the float64 reference with the mirror's mask.

12 compiles: forward drop_early (form 1 at the heuristic's BN, 2 at BN 128, 4 on the static grid:
full only) and drop_packed at each (BN 128 and the static grid: full only), and the deterministic dropout backward, causal and not;
sm90_bwd's dropout backward with the plain speed flags (sm90_bwd DROPOUT_PLAIN, non-causal)
(tests/drop4_precompile.py compiles them in parallel first)."""
import pytest

pytestmark = pytest.mark.gpu

P_DROP = 0.17
SEED = (0x9E37_79B9_7F4A_7C15, (7 << 32) + 1234)


def require_sm90():
    from cuflash import _gpu

    if tuple(_gpu.arch(0)) != (9, 0):
        pytest.skip(f"sm90_fwd needs sm_90, this GPU is sm_{''.join(map(str, _gpu.arch(0)))}")


def configs(causal, form=1):
    """(drop_early ``form``, drop_packed) forms of sm90_fwd's dropout heuristic (d128, bf16; one shape's, so
    that every test shape runs the same two kernels) and the deterministic dropout backward."""
    from cuflash import _gpu, registry, select

    problem = problem_of(2, 1000, 1000, 4, 2, causal)
    fam = registry.get("sm90_fwd")
    heur = fam.for_problem(fam.heuristic(problem, _gpu.arch(0), _gpu.max_smem(0)), problem)
    assert heur.dropout and heur.drop_packed, heur.name
    if form == 2:   # the fragment masks' BN (sm90_fwd DROP_EARLY_MASKS_BN), for both forms compared
        from cuflash.families.sm90_fwd import DROP_EARLY_MASKS_BN

        heur = heur.replace(BN=DROP_EARLY_MASKS_BN)
    if form == 4:   # the producer warpgroup draws: the static tile order (both forms compared)
        heur = heur.replace(dynamic=False)
    early, packed = heur.replace(drop_early=form), heur.replace(drop_early=0)
    assert not early.problems(227 * 1024) and not packed.problems(227 * 1024)
    bp = problem.replace(op="bwd", deterministic=True)
    return early, packed, select.choose(bp, _gpu.arch(0), "", _gpu.max_smem(0))[1]   # (fa2_bwd at d128)


def problem_of(b, sq, sk, h, h_kv, causal, p=P_DROP):
    from cuflash.problem import Problem

    return Problem("fwd", "bf16", b, sq, sk, h, h_kv, 128, causal, features=("dropout",), dropout_p=p)


def plain_bwd():
    """sm90_bwd's dropout backward with the plain heuristic's speed flags (DROPOUT_PLAIN_FLAGS; d128
    non-causal only) for the fixed shape of configs()."""
    from cuflash import _gpu, registry
    from cuflash.families import sm90_bwd

    bp = problem_of(2, 1000, 1000, 4, 2, False).replace(op="bwd")
    fam = registry.get("sm90_bwd")
    # drop_packed (the heuristic's dropout form at d128, DROPOUT_PACKED) is refused with the plain
    # call's speed flags: this kernel keeps the per-element mask
    cfg = fam.for_problem(fam.heuristic(bp, _gpu.arch(0), _gpu.max_smem(0)), bp).replace(
        drop_packed=0, wide_epi=False, **sm90_bwd.DROPOUT_PLAIN_FLAGS)   # (wide_epi: with drop_packed only)
    assert cfg.dropout_plain() and not cfg.problems(227 * 1024), cfg.name
    return cfg


def all_configs():
    """Every kernel this file runs (tests/drop4_precompile.py compiles them first)."""
    out = [*configs(False, 1), *configs(False, 2), *configs(True, 1), configs(True, 2)[0], *configs(False, 4)[:2]]
    return list(dict.fromkeys(out)) + [plain_bwd()]


MASK_CASES = [(2, 200, 300, 4, 2, False), (1, 300, 177, 3, 1, True)]   # (b, sq, sk, h, h_kv, causal)


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("form", [1, 2, 4])
@pytest.mark.parametrize("case", MASK_CASES, ids=lambda c: "b{}_s{}x{}_h{}x{}_{}".format(
    *c[:5], "causal" if c[5] else "full"))
def test_drop_early_mask_is_the_mirrors(case, form):
    import torch

    from cuflash import dropout
    from test_sm90_dropout_gpu import read_mask, visible_of

    require_sm90()
    b, sq, sk, h, h_kv, causal = case
    if form == 4 and causal:
        pytest.skip("drop_early 4: non-causal only")
    early = configs(causal, form)[0]
    got = read_mask((b, sq, h, 128), (b, sk, h_kv, 128), torch.bfloat16, causal, early)
    visible = visible_of(sq, sk, causal)
    want = torch.from_numpy(dropout.keep_mask(*SEED, P_DROP, b, h, sq, sk)).cuda() & visible
    wrong = (got != want).nonzero()
    assert wrong.shape[0] == 0, f"{early.name}: {wrong.shape[0]} mask bits differ, first (b, h, row, col) {wrong[:4].tolist()}"
    assert got.any() and not got[..., ~visible].any()


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("form", [1, 2, 4])
@pytest.mark.parametrize("p_drop", [0.001, 0.6, 0.999])
def test_drop_early_mask_at_the_thresholds_edges(p_drop, form):
    """threshold 0 (all kept), 154 (>= 128: the AND form) and 256 (nothing kept)."""
    import torch

    from cuflash import dropout
    from test_sm90_dropout_gpu import read_mask

    require_sm90()
    b, sq, sk, h = 1, 200, 300, 2
    early = configs(False, form)[0]
    got = read_mask((b, sq, h, 128), (b, sk, h, 128), torch.bfloat16, False, early, p=p_drop)
    want = torch.from_numpy(dropout.keep_mask(*SEED, p_drop, b, h, sq, sk)).cuda()
    wrong = (got != want).nonzero()
    assert wrong.shape[0] == 0, f"p={p_drop}: {wrong.shape[0]} mask bits differ, first {wrong[:4].tolist()}"


SHAPES = [(2, 113, 113, 4, 4), (1, 17, 1023, 4, 1), (1, 2049, 1023, 2, 2), (3, 1, 1, 4, 2),
          (1, 1023, 2049, 4, 2)]


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("form", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_s{}x{}_h{}x{}".format(*s))
def test_drop_early_equals_drop_packed_bit_for_bit(shape, causal, form, monkeypatch):
    import torch

    import cuflash
    from cuflash import api
    from cuflash.families import sm90_fwd

    require_sm90()
    # for_problem gives a dropout-alone config without drop_early DROPOUT_EARLY's form, so the
    # drop_packed twin (drop_early 0) would run form 1 too: keep each config's own form here, and
    # build the plans afresh (a cached plan may carry the switch's form)
    monkeypatch.setattr(sm90_fwd, "DROPOUT_EARLY", {})
    api._drop_plans()
    monkeypatch.setattr(api, "_feature_plans", {})
    b, sq, sk, h, h_kv = shape
    if form == 2 and causal:
        pytest.skip("form 2's causal kernel: the mask tests (the BN 128 drop_packed twin compiled for the full mask only)")
    if form == 4 and causal:
        pytest.skip("drop_early 4: non-causal only")
    early, packed, bwd = configs(causal, form)
    problem = problem_of(b, sq, sk, h, h_kv, causal)
    fam = cuflash.registry.get("sm90_fwd")
    assert fam.for_problem(packed, problem).drop_early == 0 and fam.for_problem(early, problem).drop_early == form
    gen = torch.Generator(device="cuda").manual_seed(sq * 7919 + sk)
    q = torch.randn(b, sq, h, 128, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    k = torch.randn(b, sk, h_kv, 128, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    v = torch.randn(b, sk, h_kv, 128, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    dout = torch.randn(b, sq, h, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    res = {}
    for name, cfg in (("early", early), ("early2", early), ("packed", packed)):
        out, lse, _ = cuflash.flash_attn_func(q, k, v, P_DROP, causal=causal, dropout_seed=SEED, config=cfg,
                                              bwd_config=bwd, deterministic=True, return_attn_probs=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        assert not out.isnan().any() and not lse.isnan().any(), f"{cfg.name}: unwritten (NaN) outputs"
        assert not any(g.isnan().any() for g in grads), f"{cfg.name}: NaN gradients"
        res[name] = (out, lse, *grads)
    for a, c, what in zip(res["early"], res["packed"], ("out", "lse", "dq", "dk", "dv")):
        assert torch.equal(a, c), f"{early.name}: {what} differs from {packed.name}'s"
    for a, c, what in zip(res["early"], res["early2"], ("out", "lse", "dq", "dk", "dv")):
        assert torch.equal(a, c), f"{early.name}: {what} differs between two calls (deterministic)"


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_s{}x{}_h{}x{}".format(*s))
def test_dropout_plain_flags_backward_against_reference(shape):
    import math

    import torch

    import cuflash
    from cuflash import dropout
    from test_dropout_gpu import attention_with_mask, max_err, rand_qkv

    require_sm90()
    b, sq, sk, h, h_kv = shape
    d, causal, dtype = 128, False, torch.bfloat16
    early, bcfg = configs(False)[0], plain_bwd()
    q, k, v = rand_qkv(b, sq, sk, h, h_kv, d, dtype, grad=True)
    dout = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    scale = 1 / math.sqrt(d)
    keep = torch.from_numpy(dropout.keep_mask(*SEED, P_DROP, b, h, sq, sk)).cuda()
    out = cuflash.flash_attn_func(q, k, v, P_DROP, causal=causal, dropout_seed=SEED, config=early, bwd_config=bcfg)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    ref_out, _ = attention_with_mask(q, k, v, causal, scale, torch.float64, keep, P_DROP)
    low_out, _ = attention_with_mask(q, k, v, causal, scale, dtype, keep, P_DROP)
    err, base = max_err(out, ref_out), max_err(low_out, ref_out)
    assert err <= 2 * base + 1e-5, f"{early.name} out: error {err:.3g} > 2 x plain {base:.3g}"
    ref_g = torch.autograd.grad(ref_out, (q, k, v), dout.double())
    low_g = torch.autograd.grad(low_out, (q, k, v), dout)
    for what, a, r, lo in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_g, low_g):
        assert not a.isnan().any(), f"{bcfg.name} {what}: unwritten (NaN) elements"
        e, bse = max_err(a, r), max_err(lo, r)
        floor = torch.finfo(dtype).eps * max(1.0, r.abs().max().item())
        if what in ("dq", "dk"):   # D's residual (test_dropout_gpu.py says why)
            d_scale = (dout.double() * out.double()).sum(-1).abs().max().item()
            other = k if what == "dq" else q
            floor = max(floor, torch.finfo(dtype).eps * d_scale * other.abs().max().item() * scale)
        assert e <= 3 * bse + floor, f"{bcfg.name} {what}: error {e:.3g} > 3 x plain {bse:.3g} + {floor:.3g}"
