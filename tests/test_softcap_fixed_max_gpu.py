"""sm90_fwd's softcap with the fixed running max (kFoldCap 3 / 4, softcap_fixed_m = 1): O must be a
convex combination of V's rows, on an H100.

The fixed max m = 1 (t = tanh(S / cap) <= 1) makes every P = exp2(k (t - 1)) a number below 1 that
the P V GEMM takes rounded to 16 bits; before session 18 l summed the unrounded fp32 P, so at one
visible key O = V·P̃/P != V (2^-9 relative in bf16) and the backward's dS = P (dO·V - D) with
D = dO·O left dQ off by 0.01-0.05 where the reference's is 0 (test_sm90_bwd_features_gpu.py::
test_softcap and test_features_gpu.py::test_backward[fa2_bwd-bf16-d128-softcap*] failed at
seqlen_k = 1). Now O is normalized by the sum of the rounded P, the LSE by the fp32 P's (since
session 19 summed on the tensor cores: ptx_sm90_rowsum.cuh; session 18's softmax_fold.cuh add_rounded).

Cases: sm90_fwd's softcap heuristic (fold_cap 3 at d128 since session 19; fold_cap 3 also forced for bf16)
and the default backward, bf16 with caps 30 and 5 (fixed max) and fp16 with cap 4 (fixed max:
2·4·log2(e) <= FIXED_MAX_LOG2_RANGE_FP16) and 30 (row max), causal and not; seqlen_k = 1 (O
must equal V bit for bit, like plain attention's: P = 1 there) and small key counts (one K/V
block: 2, 17, 113) and a few blocks (300), s_q != s_k, MHA / GQA / MQA. Errors within 2x (3x for
gradients) plain attention's in the same precision against float64 (test_features_gpu.check_close),
outputs NaN-poisoned before each launch. CUFLASH_SOFTCAP_FIELDS forces config fields on top of the
heuristic's (forced_fields: the speed knobs' other values, e.g. masked_copy=True).
"""
import math
import os

import pytest

import cuflash
from cuflash import registry
from cuflash.families import sm90_fwd

from conftest import device_heuristic  # noqa: E402
from test_features_gpu import check_close, feature_attention, grads, inputs  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

# (dtype, cap, whether the call runs the fixed max, fold_cap forced or None: the heuristic's); bf16 50 is
# Gemma 2's cap, past FIXED_MAX_LOG2_RANGE: the fixed max raised into P's headroom (FIXED_MAX_LOG2_TOP), bf16
# 80 past that too: the row max (defer_max's deferred steps where forced)
CAPS = [("bf16", 30.0, True, None), ("bf16", 5.0, True, None), ("fp16", 4.0, True, None),
        ("fp16", 30.0, False, None), ("bf16", 30.0, True, 3), ("bf16", 50.0, True, None),
        ("bf16", 80.0, False, None)]
CAP_IDS = [f"{dt}-cap{c:g}" + (f"-fold{f}" if f else "") for dt, c, _, f in CAPS]
# (seqlen_q, seqlen_k, heads)
SMALL = [(1, 2, "mha"), (17, 17, "gqa"), (113, 113, "mqa"), (17, 300, "gqa"), (300, 17, "mha")]


def forced_fields() -> dict:
    """CUFLASH_SOFTCAP_FIELDS="field=value,...": sm90_fwd config fields forced on every softcap call of
    these tests (a speed knob under test, e.g. masked_copy=True or emu_exp2=2); {} without it."""
    from softcap_fixed_timing import parse_variants

    return parse_variants("forced:" + os.environ.get("CUFLASH_SOFTCAP_FIELDS", ""))["forced"]


def fwd_config(dtype, q, k, causal, cap, fixed, fold=None):
    """sm90_fwd's heuristic for the call (what selection runs without a tuned entry), checked to be
    the path under test; with forced_fields() on top."""
    import torch

    (b, sq, h, d), (sk, hkv) = q.shape, k.shape[1:3]
    p = cuflash.Problem("fwd", dtype, b, sq, sk, h, hkv, d, causal, features=("softcap",), softcap=cap)
    cfg = device_heuristic(registry.get("sm90_fwd"), p)
    if fold is not None:
        cfg = cfg.replace(fold_cap=fold)
        assert not cfg.problems(), cfg.problems()
    if forced_fields():
        cfg = cfg.replace(**forced_fields())
        assert not cfg.problems(), cfg.problems()
    assert cfg.fold_cap >= 3, f"{cfg.name}: the test expects the folded softcap with the fixed max"
    assert (sm90_fwd.softcap_fixed_m(p) <= 1) == fixed, f"{cfg.name} cap {cap}: fixed max expected {fixed}"
    assert torch.cuda.get_device_capability() >= (9, 0)
    return cfg


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype,cap,fixed,fold", CAPS, ids=CAP_IDS)
def test_one_key_output_is_v(dtype, cap, fixed, fold, causal):
    """One visible key: O = V exactly (every query row), LSE = cap·tanh(s·scale / cap) within 1e-2."""
    import torch

    for sq, heads in ((1, "mha"), (17, "gqa"), (113, "mqa")):
        if causal and sq > 1:
            continue   # bottom-right causal: rows above the last see no key (O = 0 elsewhere)
        q, k, v, _ = inputs(2, sq, 1, heads, 128, dtype)
        cfg = fwd_config(dtype, q, k, causal, cap, fixed, fold)
        out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, softcap=cap, config=cfg,
                                              return_attn_probs=True)
        rep = q.shape[2] // k.shape[2]
        want = v.repeat_interleave(rep, 2).expand(-1, sq, -1, -1)
        bad = (out != want).sum().item()
        assert bad == 0, f"{cfg.name} {sq}x1 {heads}: {bad} elements of O differ from V"
        _, ref_lse = feature_attention(q, k, v, 128 ** -0.5, causal, (-1, -1), cap, None, torch.float64)
        err = (lse.double() - ref_lse).abs().max().item()
        assert err < 1e-2, f"{cfg.name} {sq}x1 {heads}: LSE error {err:.3g}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype,cap,fixed,fold", CAPS, ids=CAP_IDS)
def test_small_keys_fwd_bwd(dtype, cap, fixed, fold, causal):
    """seqlen_k 1 and small: forward within 2x, gradients (default backward) within 3x the plain
    low-precision error against float64; at seqlen_k = 1 the reference dQ is 0."""
    import torch

    scale = 128 ** -0.5
    for sq, sk, heads in [(1, 1, "gqa"), (17, 1, "mha")] + SMALL:
        if causal and sk == 1 and sq > 1:
            sq = 1
        q, k, v, dout = inputs(2, sq, sk, heads, 128, dtype)
        cfg = fwd_config(dtype, q, k, causal, cap, fixed, fold)
        what = f"{cfg.name} cap {cap:g} {sq}x{sk} {heads}"
        out = cuflash.flash_attn_func(q, k, v, causal=causal, softcap=cap, config=cfg)
        ref = feature_attention(q, k, v, scale, causal, (-1, -1), cap, None, torch.float64)[0]
        low = feature_attention(q, k, v, scale, causal, (-1, -1), cap, None, q.dtype)[0]
        check_close(out, ref, low, 2, f"{what} out")
        ours = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=causal, softcap=cap, config=cfg),
                     q, k, v, dout)
        ref_g = grads(lambda q, k, v: feature_attention(q, k, v, scale, causal, (-1, -1), cap, None,
                                                        torch.float64)[0], q, k, v, dout.double())
        low_g = grads(lambda q, k, v: feature_attention(q, k, v, scale, causal, (-1, -1), cap, None,
                                                        q.dtype)[0], q, k, v, dout)
        for name, a, r, b in zip(("dq", "dk", "dv"), ours, ref_g, low_g):
            check_close(a, r, b, 3, f"{what} {name}")
        assert math.isfinite(out.float().abs().max().item())
