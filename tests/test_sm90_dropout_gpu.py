"""Dropout in the Hopper forward sm90_fwd on the GPU (issue 12), sm_90 only:

* the mask bit for bit: the keep mask read back from sm90_fwd's output equals the NumPy mirror
  (cuflash.dropout.keep_mask, philox.cuh's definition) and fa2_fwd's on the same seed, so the
  backward (which regenerates the mask) and S_dmask agree with the forward;
* out, LSE (plain attention's: l sums the undropped P) and S_dmask against the float64
  reference with the same mask, 2x the error of plain low-precision attention, and the
  gradients of a full forward + backward (sm90_fwd dropout, then the backward family's
  dropout) within 3x; odd seqlens (1, 17, 113, 1023, 2049), s_q != s_k both ways, GQA / MQA,
  causal.

9 compiles (5 for the mask, 2 forward + 2 backward for the reference grid); the thresholds'
edges reuse the first mask case's."""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

P_DROP = 0.17
SEED = (0x9E37_79B9_7F4A_7C15, (7 << 32) + 1234)   # high words too: key k1 = seed_hi ^ offset_hi


def require_sm90():
    from cuflash import _gpu

    if tuple(_gpu.arch(0)) != (9, 0):
        pytest.skip(f"sm90_fwd needs sm_90, this GPU is sm_{''.join(map(str, _gpu.arch(0)))}")


def forced(family, problem):
    """``family``'s heuristic for ``problem`` on this GPU, with the call's flags (dropout)."""
    from cuflash import _gpu, registry

    fam = registry.get(family)
    return fam.for_problem(fam.heuristic(problem, _gpu.arch(0), _gpu.max_smem(0)), problem)


def read_mask(q_shape, k_shape, dtype, causal, config, seed=SEED, p=P_DROP):
    """The keep mask that ``config``'s forward applied, bool (b, h, sq, sk), read from its
    output (hidden entries False): with q = 0 every visible score is equal, so P = 1 / n on the
    visible keys; V holds a one-hot row for each key of a window of head_dim keys, so column i
    of O is P ∘ Z / (1 - p) of key c0 + i: positive iff kept. One call per window."""
    import torch

    import cuflash

    b, sq, h, d = q_shape
    sk, h_kv = k_shape[1], k_shape[2]
    q = torch.zeros(q_shape, device="cuda", dtype=dtype)
    k = torch.randn(k_shape, device="cuda", dtype=dtype)   # any K: q = 0 makes every score 0
    mask = torch.zeros(b, h, sq, sk, dtype=torch.bool, device="cuda")
    for c0 in range(0, sk, d):
        n = min(d, sk - c0)
        v = torch.zeros(k_shape, device="cuda", dtype=dtype)
        v[:, c0 + torch.arange(n), :, torch.arange(n)] = 1
        out = cuflash.flash_attn_func(q, k, v, p, causal=causal, dropout_seed=seed, config=config)
        assert not out.isnan().any(), f"{config.name}: unwritten (NaN) outputs"
        mask[..., c0:c0 + n] = (out[..., :n] > 0).permute(0, 2, 1, 3)
    return mask


def visible_of(sq, sk, causal):
    import torch

    ones = torch.ones(sq, sk, dtype=torch.bool, device="cuda")
    return ones.tril(sk - sq) if causal else ones


MASK_CASES = [  # (b, sq, sk, h, h_kv, causal, persistent)
    (2, 200, 300, 4, 2, False, False),
    (2, 200, 300, 4, 2, True, False),
    (1, 300, 177, 3, 1, True, True),   # s_q > s_k, MQA, the persistent schedule (tiles stride heads)
]


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("case", MASK_CASES, ids=lambda c: "b{}_s{}x{}_h{}x{}_{}{}".format(
    *c[:5], "causal" if c[5] else "full", "_persist" if c[6] else ""))
def test_sm90_mask_is_the_mirrors_and_fa2s_bit_for_bit(case):
    import torch

    from cuflash import dropout
    from cuflash.problem import Problem

    require_sm90()
    b, sq, sk, h, h_kv, causal, persistent = case
    d = 64
    problem = Problem("fwd", "bf16", b, sq, sk, h, h_kv, d, causal, features=("dropout",), dropout_p=P_DROP)
    sm90 = forced("sm90_fwd", problem)
    if persistent:
        sm90 = sm90.replace(persistent=True)
    assert sm90.dropout and sm90.family == "sm90_fwd"
    got = read_mask((b, sq, h, d), (b, sk, h_kv, d), torch.bfloat16, causal, sm90)
    visible = visible_of(sq, sk, causal)
    want = torch.from_numpy(dropout.keep_mask(*SEED, P_DROP, b, h, sq, sk)).cuda() & visible
    wrong = (got != want).nonzero()
    assert wrong.shape[0] == 0, f"{sm90.name}: {wrong.shape[0]} mask bits differ, first (b, h, row, col) {wrong[:4].tolist()}"
    assert got.any() and not got[..., ~visible].any()
    if not persistent:   # the same mask through fa2_fwd (what fa2_bwd regenerates in the backward)
        fa2 = forced("fa2_fwd", problem)
        assert fa2.family == "fa2_fwd" and fa2.dropout
        assert torch.equal(read_mask((b, sq, h, d), (b, sk, h_kv, d), torch.bfloat16, causal, fa2), got)


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("p_drop", [0.001, 0.6, 0.999])
def test_sm90_mask_at_the_thresholds_edges(p_drop):
    """The keep test (philox.cuh: byte >= threshold as a carry into bit 15 / 31 of a 16-bit
    lane) at the thresholds that the default p does not reach: 0 (p = 0.001: every element
    kept), 154 (p = 0.6: the byte's top bit set in half of the kept ones) and 256 (p = 0.999:
    nothing kept, O = 0); the mask read back from sm90_fwd (the dropout heuristic's tiles) equals
    the mirror's. One compile (p is a run-time parameter)."""
    import torch

    from cuflash import dropout
    from cuflash.problem import Problem

    require_sm90()
    b, sq, sk, h, d = 1, 200, 300, 2, 64
    problem = Problem("fwd", "bf16", b, sq, sk, h, h, d, False, features=("dropout",), dropout_p=P_DROP)
    sm90 = forced("sm90_fwd", problem)
    got = read_mask((b, sq, h, d), (b, sk, h, d), torch.bfloat16, False, sm90, p=p_drop)
    want = torch.from_numpy(dropout.keep_mask(*SEED, p_drop, b, h, sq, sk)).cuda()
    assert dropout.drop_threshold(p_drop) == {0.001: 0, 0.6: 154, 0.999: 256}[p_drop]
    wrong = (got != want).nonzero()
    assert wrong.shape[0] == 0, f"p={p_drop}: {wrong.shape[0]} mask bits differ, first {wrong[:4].tolist()}"
    kept = want.float().mean().item()
    assert {0.001: kept == 1.0, 0.6: 0.35 < kept < 0.45, 0.999: kept == 0.0}[p_drop], kept


# (dtype, head dim, causal): d64 / d128 run through sm90_fwd in test_dropout_gpu.py's grid
FLAGS = [("fp16", 96, False), ("bf16", 256, True)]
SHAPES = [(2, 113, 113, 4, 4), (1, 17, 1023, 4, 1), (1, 2049, 1023, 2, 2), (3, 1, 1, 4, 2),
          (1, 1023, 2049, 4, 2)]


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: f"{f[0]}_d{f[1]}_{'causal' if f[2] else 'full'}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_s{}x{}_h{}x{}".format(*s))
def test_sm90_dropout_forward_backward_against_reference(flags, shape):
    import torch

    import cuflash
    from cuflash.problem import Problem
    from cuflash.select import choose_on_device
    from test_dropout_gpu import attention_with_mask, check_dropout_grads, dropout_case, dtype_of, max_err

    require_sm90()
    name, d, causal = flags
    dtype = dtype_of(name)
    b, sq, sk, h, h_kv = shape
    fam, cfg, _ = choose_on_device(Problem("fwd", name, b, sq, sk, h, h_kv, d, causal,
                                           features=("dropout",), dropout_p=P_DROP), 0)
    assert fam.name == "sm90_fwd" and cfg.dropout, cfg.name
    q, k, v, dout, scale, keep = dropout_case(b, sq, sk, h, h_kv, d, dtype, SEED, P_DROP)
    out, lse, s_dmask = cuflash.flash_attn_func(q, k, v, P_DROP, causal=causal, return_attn_probs=True,
                                                dropout_seed=SEED)
    assert not out.isnan().any() and not lse.isnan().any()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)

    ref_out, ref_lse = attention_with_mask(q, k, v, causal, scale, torch.float64, keep, P_DROP)
    low_out, _ = attention_with_mask(q, k, v, causal, scale, dtype, keep, P_DROP)
    err, base = max_err(out, ref_out), max_err(low_out, ref_out)
    assert err <= 2 * base + 1e-5, f"out: error {err:.3g} > 2 x plain {base:.3g}"
    finite = torch.isfinite(ref_lse)   # LSE of the undropped P; +inf where no key is visible
    assert torch.equal(torch.isfinite(lse), finite)
    if finite.any():
        assert max_err(lse[finite], ref_lse[finite]) < 1e-3

    check_dropout_grads((dq, dk, dv), ref_out, low_out, q, k, v, dout, out, scale)

    # S_dmask (from the LSE and the mirror's mask): its sign is the mask where P > 0
    assert s_dmask.shape == (b, h, sq, sk)
    nz = s_dmask != 0
    assert torch.equal((s_dmask > 0)[nz], keep[nz])
    assert np.isfinite(s_dmask.abs().sum().item())


# forward and backward of different families: the backward regenerates the forward's mask from
# the coordinates alone (philox.cuh), whichever family drew it; 4 compiles (d128 bf16 causal)
CROSS = [("sm90_fwd", "fa2_bwd"), ("fa2_fwd", "sm90_bwd")]


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("fwd,bwd", CROSS, ids=lambda f: f)
@pytest.mark.parametrize("shape", [(2, 300, 417, 4, 2), (1, 1023, 113, 2, 1)],
                         ids=lambda s: "b{}_s{}x{}_h{}x{}".format(*s))
def test_forward_and_backward_of_different_families_share_the_mask(fwd, bwd, shape):
    import torch

    import cuflash
    from cuflash.problem import Problem
    from test_dropout_gpu import attention_with_mask, check_dropout_grads, dropout_case, max_err

    require_sm90()
    b, sq, sk, h, h_kv = shape
    d, causal, dtype = 128, True, torch.bfloat16
    problem = Problem("fwd", "bf16", b, sq, sk, h, h_kv, d, causal, features=("dropout",), dropout_p=P_DROP)
    fcfg, bcfg = forced(fwd, problem), forced(bwd, problem.replace(op="bwd"))
    assert fcfg.family == fwd and bcfg.family == bwd and fcfg.dropout and bcfg.dropout
    q, k, v, dout, scale, keep = dropout_case(b, sq, sk, h, h_kv, d, dtype, SEED, P_DROP)
    out = cuflash.flash_attn_func(q, k, v, P_DROP, causal=causal, dropout_seed=SEED, config=fcfg,
                                  bwd_config=bcfg)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    ref_out, _ = attention_with_mask(q, k, v, causal, scale, torch.float64, keep, P_DROP)
    low_out, _ = attention_with_mask(q, k, v, causal, scale, dtype, keep, P_DROP)
    err, base = max_err(out, ref_out), max_err(low_out, ref_out)
    assert err <= 2 * base + 1e-5, f"{fcfg.name} out: error {err:.3g} > 2 x plain {base:.3g}"
    check_dropout_grads((dq, dk, dv), ref_out, low_out, q, k, v, dout, out, scale, f"{fcfg.name} + {bcfg.name}")
