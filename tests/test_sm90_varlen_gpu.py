"""Variable-length batches on the Hopper forward (sm90_fwd built with varlen: kernels_cu/sm90_fwd.cu
kVarlen), the FlashAttention way. sm_90 only.

Every sequence of a packed batch is compared with plain attention on that sequence alone (the
float64 reference and the same in the inputs' low precision: test_varlen_gpu.per_sequence);
cuflash's error must be within 2x plain attention's, outputs poisoned (NaN) before each launch.
One batch holds lengths 0, 1, 17, 113, 1023 and 2049 with s_q != s_k per sequence (so Q blocks
and K/V boxes run past a sequence's end into the next one's rows, and past the packed end);
causal and not, MHA / GQA / MQA, bf16 / fp16, head dims 64, 96, 128, 256 and 59 (zero-padded to
64 by the API), both schedules (a CTA per tile, persistent), many short sequences. The three
varlen entry points and torch autograd (backward: fa2_bwd) run through cuflash's API.

Window, softcap, ALiBi and dropout with varlen: tests/test_varlen_features_gpu.py, which on the
H100 now selects sm90_fwd for the sets of sm90_fwd.VARLEN_FEATURES.

The varlen backward on sm90_bwd (kVarlen) runs here with sm90_bwd.VARLEN_BWD switched on (it is
off by default until these pass): through autograd at head dim 128 (selection's rank puts
sm90_bwd first there), forced by config= at head dim 64 (deterministic too), within 3x plain
attention's gradient error (test_flash_bwd_gpu.check_grads).

Compiles: 9 sm90_fwd varlen forwards, 2 fa2_fwd varlen forwards (the comparison), 2 fa2_bwd
varlen backwards (autograd), 6 sm90_bwd varlen backwards (2 of them the d128 kernel at head dim 96, which
selection runs there with sm90_bwd.VARLEN_SMALL_D holding 96).
"""
import math

import pytest

import cuflash
from cuflash import registry, varlen
from cuflash.families.sm90_fwd import Sm90FwdConfig
from cuflash.problem import Problem

from conftest import torch_dtype  # noqa: E402
from test_flash_bwd_gpu import check_grads  # noqa: E402
from test_varlen_gpu import check_varlen, cu_seqlens, packed_inputs, per_sequence  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

# lengths 0, 1, 17, 113, 1023, 2049; s_q != s_k per sequence; an empty sequence on each side
LENS_Q = [1, 17, 0, 113, 1023, 2049, 5, 64, 300]
LENS_K = [1, 30, 9, 113, 2049, 1023, 0, 200, 17]
# many short sequences (64..1k) and a few empty ones: most tiles of the grid are past their end
SHORT_Q = [64, 1000, 0, 128, 513, 77, 1024, 250, 0, 999, 640, 65, 300, 1, 900, 200]
SHORT_K = [64, 1000, 7, 128, 513, 77, 1024, 250, 0, 999, 640, 65, 300, 1, 900, 200]


@pytest.fixture(scope="module", autouse=True)
def _precompiled():
    """The kernels this file uses, compiled up front in parallel worker processes (CuPy's disk
    cache), so that the tests themselves only load them."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return
    from cuflash.compile import precompile
    from cuflash.families.fa2_fwd import FwdConfig

    fam_b, fa2_b = registry.get("sm90_bwd"), registry.get("fa2_bwd")
    cfgs = [sm90_config(cuflash.api.padded_head_dim(d), dtype, causal, persistent)
            for dtype, d, causal, _, persistent in CASES]
    cfgs += [sm90_config(128, "bf16", True, True), sm90_config(128, "bf16", False, False),
             sm90_config(64, "fp16", True, False)]
    for dtype, causal, det, heads in BWD_CASES:
        d = 128 if heads == (4, 4) else 64
        p = Problem("bwd", dtype, 3, 1024, 1024, *heads, d, causal, det, ("varlen",))
        cfgs.append(fam_b.for_problem(fam_b.heuristic(p), p))
    for causal in (False, True):
        p = Problem("bwd", "bf16", 3, 1024, 1024, 6, 2, 128, causal, False, ("varlen",))
        cfgs += [fam_b.for_problem(fam_b.heuristic(p), p), fa2_b.for_problem(fa2_b.heuristic(p), p)]
        p = Problem("bwd", "bf16", 3, 1024, 1024, 6, 2, 96, causal, False, ("varlen",))   # (the d96 test's)
        cfgs.append(fam_b.for_problem(fam_b.heuristic(p), p))
    pf = Problem("fwd", "bf16", 3, 1024, 1024, 6, 2, 128, True, False, ("varlen",))
    cfgs.append(registry.get("fa2_fwd").for_problem(FwdConfig(128, 32, 4, 2, 128, "bf16", True), pf))
    failed = [(c.name, e) for c, _, e in precompile(cfgs) if e]
    assert not failed, failed


def need_sm90():
    import torch

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm90_fwd runs on sm_90 only")


def sm90_config(d, dtype, causal, persistent, nseq=3, feats=()):
    """The heuristic's varlen config (its BN), with the schedule forced."""
    fam = registry.get("sm90_fwd")
    p = Problem("fwd", dtype, nseq, 1024, 1024, 4, 4, d, causal, False, ("varlen",) + feats)
    return fam.for_problem(fam.heuristic(p), p).replace(persistent=persistent)


def forward_errors(lens_q, lens_k, h, hkv, d, dtype, causal, config, seed=0):
    """(error, low-precision error, lse error) of varlen_torch.forward with ``config`` against the
    float64 reference per sequence; asserts nothing is left unwritten."""
    import torch

    tdtype = torch_dtype(dtype)
    q, k, v, _ = packed_inputs(lens_q, lens_k, h, hkv, d, tdtype, seed)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    scale = 1 / math.sqrt(d)
    from cuflash import varlen_torch

    out, lse = varlen_torch.forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), scale, causal, config)
    dout = torch.zeros_like(q)
    ref = per_sequence(lens_q, lens_k, q.double(), k.double(), v.double(), dout.double(), causal,
                       scale, torch.float64)
    low = per_sequence(lens_q, lens_k, q, k, v, dout, causal, scale, tdtype)
    assert out.shape == q.shape and lse.shape == (h, sum(lens_q))
    assert not out.isnan().any(), "unwritten (NaN-poisoned) output elements"
    assert not lse.isnan().any(), "unwritten LSE"
    finite = torch.isfinite(ref[1])
    assert torch.equal(torch.isfinite(lse), finite), "fully masked rows must have LSE = +inf"
    err = (out.double() - ref[0]).abs().max().item()
    base = (low[0].double() - ref[0]).abs().max().item()
    lse_err = (lse.double() - ref[1])[finite].abs().max().item() if finite.any() else 0.0
    return err, base, lse_err


# (dtype, head dim, causal, heads, persistent)
CASES = [("bf16", 128, True, (4, 4), False), ("bf16", 128, False, (6, 2), True),
         ("fp16", 64, True, (4, 1), True), ("fp16", 64, False, (6, 2), False),
         ("bf16", 59, True, (6, 2), False), ("fp16", 96, True, (4, 4), False),
         ("bf16", 256, False, (4, 1), False), ("bf16", 256, True, (6, 2), True)]


@pytest.mark.parametrize("dtype,d,causal,heads,persistent", CASES,
                         ids=[f"{c[0]}_d{c[1]}_{'causal' if c[2] else 'full'}_h{c[3][0]}x{c[3][1]}"
                              f"{'_persist' if c[4] else ''}" for c in CASES])
def test_sm90_varlen_forward(dtype, d, causal, heads, persistent):
    need_sm90()
    cfg = sm90_config(cuflash.api.padded_head_dim(d), dtype, causal, persistent)
    err, base, lse_err = forward_errors(LENS_Q, LENS_K, *heads, d, dtype, causal, cfg)
    assert err <= 2 * base + 1e-5, f"output error {err:.3g} > 2 x plain error {base:.3g}"
    assert lse_err < 1e-3, f"LSE error {lse_err:.3g}"
    assert any(p.family.name == "sm90_fwd" and p.config == cfg for p in varlen._plans.values())


@pytest.mark.parametrize("persistent", [False, True], ids=["per_tile", "persistent"])
def test_sm90_varlen_many_short_sequences(persistent):
    need_sm90()
    cfg = sm90_config(128, "bf16", True, persistent)
    err, base, lse_err = forward_errors(SHORT_Q, SHORT_K, 4, 2, 128, "bf16", True, cfg, seed=3)
    assert err <= 2 * base + 1e-5 and lse_err < 1e-3, (err, base, lse_err)


def test_sm90_and_fa2_varlen_agree():
    """Both families on the same packed batch, each within 2x plain attention's error; config=
    forces either."""
    need_sm90()
    from cuflash.families.fa2_fwd import FwdConfig

    fa2 = FwdConfig(128, 32, 4, 2, 128, "bf16", True)
    e_fa2, base, _ = forward_errors(LENS_Q, LENS_K, 6, 2, 128, "bf16", True, fa2, seed=5)
    e_sm90, base2, _ = forward_errors(LENS_Q, LENS_K, 6, 2, 128, "bf16", True,
                                      sm90_config(128, "bf16", True, False), seed=5)
    assert base == base2 and e_fa2 <= 2 * base + 1e-5 and e_sm90 <= 2 * base + 1e-5, (e_fa2, e_sm90, base)
    names = {p.family.name for p in varlen._plans.values()}
    assert {"fa2_fwd", "sm90_fwd"} <= names


@pytest.mark.parametrize("causal", [False, True])
def test_sm90_varlen_api_autograd(causal):
    """flash_attn_varlen_func with autograd (forward sm90_fwd by selection, backward fa2_bwd),
    the long sequences and the odd ones in one batch, GQA."""
    need_sm90()
    varlen._plans.clear()
    check_varlen(LENS_Q, LENS_K, 6, 2, 128, "bf16", causal, what=f"api causal={causal}: ")
    fwd = [p for p in varlen._plans.values() if p.family.op == "fwd"]
    assert fwd and all(p.family.name == "sm90_fwd" and p.config.varlen for p in fwd)


def test_sm90_varlen_packed_entry_points():
    need_sm90()
    import torch

    lens = [0, 1, 17, 113, 1023, 2049]
    q, k, v, _ = packed_inputs(lens, lens, 4, 4, 64, torch.float16, seed=7)
    cu = cu_seqlens(lens)
    want = cuflash.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    assert not want.isnan().any()
    qkv = torch.stack([q, k, v], 1)
    assert torch.equal(cuflash.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True), want)
    kv = torch.stack([k, v], 1)
    assert torch.equal(cuflash.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, max(lens), max(lens),
                                                                causal=True), want)
    qkv.requires_grad_()
    cuflash.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True).float().sum().backward()
    assert qkv.grad.shape == qkv.shape and not qkv.grad.isnan().any()
    # the qkv-packed views were read in place (strided tensor maps), the result as the dense copies'
    ref = per_sequence(lens, lens, q.double(), k.double(), v.double(), torch.zeros_like(q).double(),
                       True, 1 / 8, torch.float64)
    low = per_sequence(lens, lens, q, k, v, torch.zeros_like(q), True, 1 / 8, torch.float16)
    err = (want.double() - ref[0]).abs().max().item()
    assert err <= 2 * (low[0].double() - ref[0]).abs().max().item() + 1e-5


def test_sm90_varlen_matches_dense_rows():
    """A varlen batch of equal lengths is the dense call: sm90_fwd varlen equals sm90_fwd dense
    bit for bit at the same tile (the same K/V blocks in the same order)."""
    need_sm90()
    import torch

    b, s, h, d = 3, 333, 4, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cfg = sm90_config(128, "bf16", True, False)
    dense, lse_dense, _ = cuflash.flash_attn_func(q, k, v, causal=True, config=cfg.replace(varlen=False),
                                                  return_attn_probs=True)
    cu = cu_seqlens([s] * b)
    from cuflash import varlen_torch

    out, lse = varlen_torch.forward(q.reshape(b * s, h, d), k.reshape(b * s, h, d), v.reshape(b * s, h, d),
                                    cu, cu, s, s, 1 / math.sqrt(d), True, cfg)
    assert torch.equal(out.reshape(b, s, h, d), dense)
    assert torch.equal(lse.reshape(h, b, s).permute(1, 0, 2), lse_dense)


# ---------------------------------------------------------------------------------------
# the varlen backward on sm90_bwd

@pytest.fixture
def varlen_bwd_on(monkeypatch):
    """sm90_bwd.VARLEN_BWD on, selection's and the varlen plans' caches cleared around the test."""
    from cuflash import select
    from cuflash.families import sm90_bwd

    monkeypatch.setattr(sm90_bwd, "VARLEN_BWD", True)
    select._chosen.clear()
    varlen._plans.clear()
    yield
    select._chosen.clear()
    varlen._plans.clear()


@pytest.mark.parametrize("causal", [False, True])
def test_sm90_varlen_backward_autograd(varlen_bwd_on, causal):
    need_sm90()
    check_varlen(LENS_Q, LENS_K, 6, 2, 128, "bf16", causal, what=f"sm90_bwd causal={causal}: ")
    bwd = [p for p in varlen._plans.values() if p.family.op == "bwd"]
    assert bwd and all(p.family.name == "sm90_bwd" and p.config.varlen for p in bwd)


BWD_CASES = [("fp16", True, True, (4, 1)), ("bf16", False, False, (6, 2)), ("bf16", True, False, (4, 4))]


@pytest.mark.parametrize("dtype,causal,deterministic,heads", BWD_CASES,
                         ids=["fp16_causal_det_mqa", "bf16_full_gqa", "bf16_causal_mha"])
def test_sm90_varlen_backward_forced(varlen_bwd_on, dtype, causal, deterministic, heads):
    """config= forces sm90_bwd at head dim 64 (the d128 kernel too, for the MHA case); the
    deterministic one twice, bitwise equal."""
    need_sm90()
    import torch

    from cuflash import varlen_torch

    d = 128 if heads == (4, 4) else 64
    fam = registry.get("sm90_bwd")
    p = Problem("bwd", dtype, 3, 1024, 1024, *heads, d, causal, deterministic, ("varlen",))
    cfg = fam.for_problem(fam.heuristic(p), p)
    tdtype = torch_dtype(dtype)
    q, k, v, dout = packed_inputs(LENS_Q, LENS_K, *heads, d, tdtype, seed=11)
    cu_q, cu_k = cu_seqlens(LENS_Q), cu_seqlens(LENS_K)
    scale = 1 / math.sqrt(d)
    mq, mk = max(LENS_Q), max(LENS_K)
    out, lse = varlen_torch.forward(q, k, v, cu_q, cu_k, mq, mk, scale, causal)
    grads = varlen_torch.backward(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, scale, causal,
                                  deterministic, cfg)
    assert any(pl.family.name == "sm90_bwd" and pl.config == cfg for pl in varlen._plans.values())
    ref = per_sequence(LENS_Q, LENS_K, q.double(), k.double(), v.double(), dout.double(), causal,
                       scale, torch.float64)
    low = per_sequence(LENS_Q, LENS_K, q, k, v, dout, causal, scale, tdtype)
    check_grads(grads, ref[2:], low[2:], f"sm90_bwd {cfg.name}: ")
    if deterministic:
        again = varlen_torch.backward(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, scale, causal,
                                      deterministic, cfg)
        assert all(torch.equal(a, b) for a, b in zip(grads, again))


@pytest.mark.parametrize("causal", [False, True])
def test_sm90_varlen_backward_d96_selected(varlen_bwd_on, monkeypatch, causal):
    """Head dim 96 with sm90_bwd.VARLEN_SMALL_D holding 96: selection runs the varlen backward on
    sm90_bwd's d128 kernel (columns 96..127 zero-filled), through autograd, GQA."""
    need_sm90()
    from cuflash.families import sm90_bwd

    monkeypatch.setattr(sm90_bwd, "VARLEN_SMALL_D", sm90_bwd.VARLEN_SMALL_D | {96})
    check_varlen(LENS_Q, LENS_K, 6, 2, 96, "bf16", causal, what=f"sm90_bwd d96 causal={causal}: ")
    bwd = [p for p in varlen._plans.values() if p.family.op == "bwd"]
    assert bwd and all(p.family.name == "sm90_bwd" and p.config.varlen for p in bwd)
