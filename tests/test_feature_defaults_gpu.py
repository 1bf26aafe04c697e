"""The heuristic's configs for calls with window / softcap / ALiBi at head dim 128 (sm90_fwd
FEATURE_TILES / SOFTCAP_FOLD, sm90_bwd WINDOW_STAGES: the switches measured faster and turned on),
run on an H100 exactly as selection builds them for bf16 d128 8k, on small odd problems.

The FlashAttention way: fresh random inputs, outputs poisoned (NaN) before each launch, error vs
the float64 reference (test_features_gpu.feature_attention) within 2x the error of the same
attention computed in the same low precision, gradients within 3x; LSE within 1e-2 and +inf
exactly on the rows with no visible key; seqlens 1, 17, 113, 1023, 2049 with s_q != s_k,
MHA / GQA / MQA; window edges (bounds 0, 1, unaligned, a block's width), causal + window, and the
combinations whose heuristic changed with the switches.

14 compiled kernels (10 forward, 4 backward: d128 bf16; features_overhead_timing.py --precompile
builds them in parallel first):
    python tests/features_overhead_timing.py --precompile --tests-only
    CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q -x tests/test_feature_defaults_gpu.py
"""
import pytest

import cuflash
from cuflash import registry
from cuflash.problem import Problem

from test_features_gpu import check_close, feature_attention, grads, inputs, slopes_for  # noqa: E402
from test_features_opt_gpu import check_forward  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

FWD = registry.get("sm90_fwd")
BWD = registry.get("sm90_bwd")


def default_configs(features, causal, op="fwd"):
    """The heuristic's config of a bf16 d128 8k call (batch 2 x 16 heads) with these features, as
    selection's for_problem finishes it (the shape tests/features_overhead_timing.py measures)."""
    kw = dict(window=(1024, 0 if causal else 1024) if "window" in features else (-1, -1),
              softcap=30.0 if "softcap" in features else 0.0)
    p = Problem(op, "bf16", 2, 8192, 8192, 16, 16, 128, causal, features=tuple(sorted(features)), **kw)
    fam = FWD if op == "fwd" else BWD
    return fam.for_problem(fam.heuristic(p), p)


# (id, features, causal, cases): each case (window, softcap, alibi) runs on the default kernel of
# (features, causal); window / softcap / ALiBi are compile-time flags, their values run-time
FORWARD = [
    ("win_causal", ("window",), True,
     [((1024, 0), 0.0, None), ((0, 0), 0.0, None), ((1, 0), 0.0, None), ((300, 0), 0.0, None)]),
    ("win_full", ("window",), False,
     [((300, 129), 0.0, None), ((128, 128), 0.0, None), ((0, 5), 0.0, None), ((-1, 64), 0.0, None)]),
    # fold_cap 4 (3 with Q prescaled): the fixed max at softcap 30 and 5, the row max at 50 (2·50·log2(e) > 100)
    ("cap_causal", ("softcap",), True, [((-1, -1), 30.0, None), ((-1, -1), 5.0, None), ((-1, -1), 50.0, None)]),
    ("cap_full", ("softcap",), False, [((-1, -1), 30.0, None), ((-1, -1), 50.0, None)]),
    ("alibi_causal", ("alibi",), True, [((-1, -1), 0.0, "h"), ((-1, -1), 0.0, "bh")]),
    ("alibi_full", ("alibi",), False, [((-1, -1), 0.0, "bh")]),
    ("win_cap_causal", ("softcap", "window"), True, [((256, 0), 30.0, None), ((100, 0), 60.0, None)]),
    ("win_alibi_full", ("alibi", "window"), False, [((200, 17), 0.0, "bh")]),
    ("win_alibi_causal", ("alibi", "window"), True, [((200, 0), 0.0, "h")]),
    ("cap_alibi_causal", ("alibi", "softcap"), True, [((-1, -1), 30.0, "h")]),
]
SEQLENS = [(1, 17), (17, 1), (113, 1023), (1023, 113), (2049, 1023), (1023, 2049)]
HEADS = ("mha", "gqa", "mqa")
# (id, features, causal, window, softcap, alibi): forward + backward through the default pair
BACKWARD = [
    ("win_causal", ("window",), True, (300, 0), 0.0, None),
    ("win_full", ("window",), False, (300, 129), 0.0, None),
    ("cap_causal", ("softcap",), True, (-1, -1), 30.0, None),
    # the window backward at stages 3 (WINDOW_BWD's former choice, a timing candidate)
    ("win_causal_bwd_s3", ("window",), True, (300, 0), 0.0, None),
]
GRAD_SHAPES = [(17, 113, "gqa"), (1023, 2049, "mqa"), (2049, 1023, "mha")]


def bwd_config(name, features, causal):
    """The backward a BACKWARD case runs: the default, or (``_bwd_s3``) the plain grid at stages 3
    (session 14's measured window backward)."""
    cfg = default_configs(features, causal, "bwd")
    if name.endswith("_bwd_s3"):
        cfg = cfg.replace(stages=3, dynamic=False, ds_double=False, dq_early=False, dk_late=False, frag_pin=False,
                          dq_tail=0)   # (dq_tail: the dynamic scheduler's)
        assert not cfg.problems(227 * 1024), cfg.problems()
    return cfg


def all_test_configs():
    """The kernels of this file (tests/features_overhead_timing.py --precompile builds them)."""
    out = [default_configs(f, c) for _, f, c, _ in FORWARD]
    out += [bwd_config(name, f, c) for name, f, c, *_ in BACKWARD]
    return list(dict.fromkeys(out))


def test_the_defaults_are_the_switched_ones():
    """What this file runs is what the switches give (a guard against testing the wrong kernel)."""
    win = default_configs(("window",), True)
    # (session 21: the static persistent schedule with tile_overlap; its backward with dq_first and wide_epi)
    assert not win.dynamic and win.tile_overlap and win.tma_store and win.BN == 128
    cap = default_configs(("softcap",), False)
    assert cap.fold_cap == 3 and cap.lazy_rescale and cap.dynamic and cap.tma_store and cap.BN == 144
    assert default_configs(("softcap",), True).BN == 128
    for causal in (True, False):
        alibi = default_configs(("alibi",), causal)
        assert alibi.dynamic and alibi.alibi_lin
        bwd = default_configs(("window",), causal, "bwd")
        assert bwd.dynamic and bwd.ds_double and bwd.stages == 2 and bwd.dq_first and bwd.wide_epi
        assert bwd.dq_tail == 2   # (session 31: the dQ convert in the grid's tail)


@pytest.mark.parametrize("kernel", FORWARD, ids=[k[0] for k in FORWARD])
def test_forward(kernel):
    name, features, causal, cases = kernel
    config = default_configs(features, causal)
    for window, softcap, alibi in cases:
        for i, (sq, sk) in enumerate(SEQLENS):
            heads = HEADS[i % 3]
            q, k, v, _ = inputs(2, sq, sk, heads, 128, "bf16")
            slopes = slopes_for(alibi, 2, q.shape[2])
            check_forward(config, q, k, v, causal, window, softcap, slopes,
                          f"{config.name} window {window} softcap {softcap} alibi {alibi} {sq}x{sk} {heads}")


@pytest.mark.parametrize("kernel", [k for k in FORWARD if default_configs(k[1], k[2]).lazy_rescale],
                         ids=lambda k: k[0])
def test_lazy_rescale_large_and_growing_scores(kernel):
    """Scores that move the running max by far more than the lazy threshold (as
    test_features_opt_gpu's): inputs x 4 and one early key raised on every row."""
    name, features, causal, cases = kernel
    config = default_configs(features, causal)
    window, softcap, alibi = cases[0]
    for sq, sk in ((1023, 2049), (2049, 2049)):
        q, k, v, _ = inputs(2, sq, sk, "gqa", 128, "bf16")
        q, k = q * 4, k * 4
        q[..., -1] = 4.0
        k[:, 3, :, -1] = 40.0
        slopes = slopes_for(alibi, 2, q.shape[2])
        check_forward(config, q, k, v, causal, window, softcap, slopes, f"{config.name} large scores {sq}x{sk}")


@pytest.mark.parametrize("case", BACKWARD, ids=[c[0] for c in BACKWARD])
def test_forward_backward(case):
    import torch

    name, features, causal, window, softcap, alibi = case
    fcfg, bcfg = default_configs(features, causal), bwd_config(name, features, causal)
    for sq, sk, heads in GRAD_SHAPES:
        q, k, v, dout = inputs(2, sq, sk, heads, 128, "bf16")
        slopes = slopes_for(alibi, 2, q.shape[2])
        kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
        ours = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, config=fcfg, bwd_config=bcfg, **kw),
                     q, k, v, dout)
        scale = 128 ** -0.5
        ref = grads(lambda q, k, v: feature_attention(q, k, v, scale, causal, window, softcap, slopes,
                                                      torch.float64)[0], q, k, v, dout.double())
        low = grads(lambda q, k, v: feature_attention(q, k, v, scale, causal, window, softcap, slopes,
                                                      q.dtype)[0], q, k, v, dout)
        what = f"{fcfg.name} + {bcfg.name} window={window} softcap={softcap} {sq}x{sk} {heads}"
        for gname, a, r, b in zip(("dq", "dk", "dv"), ours, ref, low):
            check_close(a, r, b, 3, f"{what} {gname}")
