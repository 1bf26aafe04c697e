"""Sliding window, softcap, ALiBi and dropout in the Hopper backward sm90_bwd, on an H100, forced with
bwd_config= (the forward is the default one for the call's features).

Gradients must be within 3x the error of plain attention with the same features computed in the
same low precision, against float64 (test_features_gpu.feature_attention), on fresh random
inputs with outputs poisoned (NaN) before each launch. Each test compiles one backward kernel
(the feature flags are compile-time; window bounds, the cap and the slopes are run-time) and runs
it over odd seqlens (1, 17, 113, 1023, 2049), s_q != s_k both ways, MHA / GQA / MQA; the window
test walks several bands through the same kernel (both bounds, left only, right only, a band
narrower than a Q block, causal with a left bound) so that Q blocks outside the band are skipped
and the band's edge blocks masked.

Dropout (test_dropout): the keep mask of the call's rng state (test_dropout_gpu.next_mask) in
the reference, gradients within 3x the plain low-precision error (plus the D residual floor of
test_dropout_gpu); d128 causal / not, d64 causal, d64 deterministic (d128 deterministic dropout
is refused: its kernel spills).

Compiles: 16 backward kernels (d128 bf16: 3 features + all x causal / not; d64 bf16: all x
causal / not; all-features deterministic; fp16; 4 dropout) and their forwards.

Run first: CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q -x tests/test_sm90_bwd_features_gpu.py
"""
import pytest

import cuflash
from cuflash import registry
from cuflash.problem import Problem

from test_features_gpu import check_close, feature_attention, grads, inputs, slopes_for  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

FAM = registry.get("sm90_bwd")

# (seqlen_q, seqlen_k, heads) per call of a test: odd lengths, s_q != s_k both ways, GQA / MQA
SHAPES = [(1, 17, "gqa"), (17, 1, "mha"), (113, 1023, "mqa"), (1023, 113, "gqa"), (1023, 1023, "gqa"),
          (2049, 1023, "mha")]
# window bounds one windowed kernel runs (right is forced to 0 under causal)
WINDOWS = [(64, 64), (200, -1), (-1, 37), (0, 0), (17, 5), (300, 30)]


def sm90_config(dtype, d, causal, deterministic=False):
    """sm90_bwd's heuristic config for the call class; the call's feature flags are applied by
    selection (for_problem), so the plain config forces the family."""
    import torch

    p = Problem("bwd", dtype, 2, 1023, 1023, 4, 2, d, causal, deterministic)
    cc = torch.cuda.get_device_capability()
    why = FAM.supports(cc, p)
    if why:
        pytest.skip(why)
    return FAM.heuristic(p, cc)


def check_case(dtype, d, causal, window, softcap, alibi, shapes=SHAPES, deterministic=False):
    import torch

    cfg = sm90_config(dtype, d, causal, deterministic)
    for sq, sk, heads in shapes:
        q, k, v, dout = inputs(2, sq, sk, heads, d, dtype)
        slopes = slopes_for(alibi, 2, q.shape[2])
        kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
                  deterministic=deterministic)
        ours = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, bwd_config=cfg, **kw), q, k, v, dout)
        scale = d ** -0.5
        ref = grads(lambda q, k, v: feature_attention(q, k, v, scale, causal, window, softcap, slopes,
                                                      torch.float64)[0], q, k, v, dout.double())
        low = grads(lambda q, k, v: feature_attention(q, k, v, scale, causal, window, softcap, slopes,
                                                      q.dtype)[0], q, k, v, dout)
        what = f"{cfg.name} window={window} softcap={softcap} alibi={alibi} {sq}x{sk} {heads}"
        for name, a, r, b in zip(("dq", "dk", "dv"), ours, ref, low):
            check_close(a, r, b, 3, f"{what} {name}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_window(causal):
    for window in WINDOWS:
        if causal and window[0] < 0:
            continue  # (-1, 0) is plain causal: no window kernel
        check_case("bf16", 128, causal, window, 0.0, None, SHAPES[2:5])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcap(causal):
    check_case("bf16", 128, causal, (-1, -1), 5.0 if causal else 30.0, None)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_alibi(causal):
    check_case("bf16", 128, causal, (-1, -1), 0.0, "bh" if causal else "h")


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_all_features(d, causal):
    if d == 128:  # the d128 all-features kernel
        check_case("bf16", d, causal, (129, -1) if causal else (50, 20), 10.0, "bh")
    else:         # d64: the only d64 kernels here
        check_case("bf16", d, causal, (129, -1) if causal else (50, 20), 10.0, "h")


def test_fp16_all_features():
    check_case("fp16", 128, False, (300, 30), 20.0, "bh", SHAPES[::2])


def test_deterministic_window_is_bitwise_reproducible():
    """deterministic=True with a window's left bound (the dQ turns of a Q block start at the first
    K/V block of its band: a wrong start hangs, hence the timeout in the run command), softcap
    and ALiBi: right, and 10 runs give identical bits."""
    import torch

    cfg = sm90_config("bf16", 128, True, deterministic=True)
    check_case("bf16", 128, True, (300, -1), 20.0, "bh", [(1000, 1100, "gqa"), (1023, 113, "gqa")],
               deterministic=True)
    q, k, v, dout = inputs(2, 1000, 1100, "gqa", 128, "bf16")
    slopes = slopes_for("bh", 2, q.shape[2])
    kw = dict(causal=True, window_size=(300, -1), softcap=20.0, alibi_slopes=slopes, deterministic=True)
    first = None
    for _ in range(10):
        g = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, bwd_config=cfg, **kw), q, k, v, dout)
        if first is None:
            first = g
        else:
            for a, b in zip(first, g):
                assert torch.equal(a, b), "deterministic backward differs between runs"


DROP_SHAPES = [(2, 113, 113, 4, 4), (1, 17, 1023, 4, 1), (1, 2049, 1023, 2, 2), (3, 1, 1, 4, 2),
               (1, 1023, 2049, 4, 2)]


@pytest.mark.parametrize("d,causal,det", [(128, False, False), (128, True, False), (64, True, False),
                                          (64, False, True)], ids=["d128_full", "d128_causal", "d64_causal",
                                                                   "d64_full_det"])
def test_dropout(d, causal, det):
    import math

    import torch

    from test_dropout_gpu import P_DROP, attention_with_mask, max_err, next_mask, rand_qkv

    cfg = sm90_config("bf16", d, causal, det)
    for b, sq, sk, h, h_kv in DROP_SHAPES:
        q, k, v = rand_qkv(b, sq, sk, h, h_kv, d, torch.bfloat16, grad=True)
        dout = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
        scale = 1 / math.sqrt(d)
        keep, _ = next_mask(4321, b, h, sq, sk)
        out = cuflash.flash_attn_func(q, k, v, P_DROP, causal=causal, deterministic=det, bwd_config=cfg)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        ref_out, _ = attention_with_mask(q, k, v, causal, scale, torch.float64, keep, P_DROP)
        low_out, _ = attention_with_mask(q, k, v, causal, scale, torch.bfloat16, keep, P_DROP)
        ref_g = torch.autograd.grad(ref_out, (q, k, v), dout.double())
        low_g = torch.autograd.grad(low_out, (q, k, v), dout)
        for what, a, r, lo in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_g, low_g):
            assert not a.isnan().any(), f"{cfg.name} {what}: unwritten (NaN) elements"
            e, bse = max_err(a, r), max_err(lo, r)
            floor = torch.finfo(torch.bfloat16).eps * max(1.0, r.abs().max().item())
            if what in ("dq", "dk"):  # D's residual (test_dropout_gpu explains it)
                d_scale = (dout.double() * out.double()).sum(-1).abs().max().item()
                other = k if what == "dq" else q
                floor = max(floor, torch.finfo(torch.bfloat16).eps * d_scale * other.abs().max().item() * scale)
            assert e <= 3 * bse + floor, \
                f"{cfg.name} b{b} {sq}x{sk} h{h}x{h_kv} {what}: error {e:.3g} > 3 x plain {bse:.3g} + {floor:.3g}"


def test_selection_runs_sm90_bwd_for_features():
    """Without bwd_config, a backward with features is sm90_bwd's at d128 and d64 (rank, as
    measured: D64_ABOVE_FA2)."""
    import torch

    from cuflash.select import choose

    cc = torch.cuda.get_device_capability()
    if tuple(cc) != (9, 0):
        pytest.skip("sm_90 only")
    for d, want in ((128, "sm90_bwd"), (64, "sm90_bwd")):
        p = Problem("bwd", "bf16", 2, 1000, 1000, 4, 2, d, True, features=("alibi", "softcap", "window"),
                    window=(100, 0), softcap=10.0)
        assert choose(p, cc)[0].name == want
