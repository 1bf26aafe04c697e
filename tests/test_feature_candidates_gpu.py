"""The candidates tests/features_overhead_timing.py --quick times next to the shipped defaults
(window: BN 64, BM 64 with one consumer warpgroup; softcap: fold_cap 3 with the row sum on the tensor cores; window backward on the dynamic scheduler with
overlap_sdp or two dS buffers), run for correctness on an H100, so that a candidate that measures faster can be
switched on with its kernel already checked. No compile of its own after the timing's precompile
(the same configs).

The FlashAttention way, as tests/test_feature_defaults_gpu.py: fresh random inputs, outputs
poisoned, output within 2x and gradients within 3x the same attention's low-precision error
against float64; LSE within 1e-2 and +inf on the rows with no key; odd seqlens, s_q != s_k,
MHA / GQA / MQA, window edges.
    python tests/features_overhead_timing.py --precompile --quick --mask both
    CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q tests/test_feature_candidates_gpu.py
"""
import pytest

import cuflash

from test_feature_defaults_gpu import GRAD_SHAPES, HEADS, SEQLENS, default_configs  # noqa: E402
from test_features_gpu import check_close, feature_attention, grads, inputs, slopes_for  # noqa: E402
from test_features_opt_gpu import check_forward  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]


# (id, config, cases (window, softcap, alibi))
FORWARD = [
    ("win_bn64_causal", lambda: default_configs(("window",), True).replace(BN=64),
     [((1024, 0), 0.0, None), ((0, 0), 0.0, None), ((1, 0), 0.0, None), ((300, 0), 0.0, None)]),
    ("win_bn64_full", lambda: default_configs(("window",), False).replace(BN=64),
     [((300, 129), 0.0, None), ((128, 128), 0.0, None), ((0, 5), 0.0, None), ((-1, 64), 0.0, None)]),
    ("win_c1_bm64_causal", lambda: default_configs(("window",), True).replace(BM=64, consumers=1, pingpong=False),
     [((1024, 0), 0.0, None), ((0, 0), 0.0, None), ((300, 0), 0.0, None)]),
    ("win_c1_bm64_full", lambda: default_configs(("window",), False).replace(BM=64, consumers=1, pingpong=False),
     [((300, 129), 0.0, None), ((0, 5), 0.0, None), ((-1, 64), 0.0, None)]),
    # the softcap heuristic (fold_cap 3 since session 19: fold 4's LSE is not the backward's), its
    # row sum on the tensor cores (the fixed max at 30 and 5, the row max at 50), at the heuristic's
    # tiles (causal BN 128, full BN 144) and full BN 160
    ("cap_fold3_causal", lambda: default_configs(("softcap",), True),
     [((-1, -1), 30.0, None), ((-1, -1), 5.0, None), ((-1, -1), 50.0, None)]),
    ("cap_fold3_full", lambda: default_configs(("softcap",), False),
     [((-1, -1), 30.0, None), ((-1, -1), 50.0, None)]),
    ("cap_fold3_bn160_full", lambda: default_configs(("softcap",), False).replace(BN=160),
     [((-1, -1), 30.0, None), ((-1, -1), 50.0, None)]),
]


@pytest.mark.parametrize("kernel", FORWARD, ids=[k[0] for k in FORWARD])
def test_forward(kernel):
    name, make, cases = kernel
    config = make()
    assert not config.problems(227 * 1024), config.problems(227 * 1024)
    for window, softcap, alibi in cases:
        for i, (sq, sk) in enumerate(SEQLENS):
            heads = HEADS[i % 3]
            q, k, v, _ = inputs(2, sq, sk, heads, 128, "bf16")
            slopes = slopes_for(alibi, 2, q.shape[2])
            check_forward(config, q, k, v, config.causal, window, softcap, slopes,
                          f"{config.name} window {window} softcap {softcap} {sq}x{sk} {heads}")


@pytest.mark.parametrize("variant", ["dyn_ovl", "dyn_ds2"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_window_backward(causal, variant):
    """The window backward's candidates on the dynamic scheduler: overlap_sdp, two dS buffers."""
    import torch

    window = (300, 0) if causal else (300, 129)
    fcfg = default_configs(("window",), causal)
    extra = dict(overlap_sdp=True) if variant == "dyn_ovl" else dict(ds_double=True)
    bcfg = default_configs(("window",), causal, "bwd").replace(**extra)
    assert bcfg.dynamic and not bcfg.problems(227 * 1024), bcfg.problems(227 * 1024)
    for sq, sk, heads in GRAD_SHAPES:
        q, k, v, dout = inputs(2, sq, sk, heads, 128, "bf16")
        kw = dict(causal=causal, window_size=window)
        ours = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, config=fcfg, bwd_config=bcfg, **kw),
                     q, k, v, dout)
        scale = 128 ** -0.5
        ref = grads(lambda q, k, v: feature_attention(q, k, v, scale, causal, window, 0.0, None,
                                                      torch.float64)[0], q, k, v, dout.double())
        low = grads(lambda q, k, v: feature_attention(q, k, v, scale, causal, window, 0.0, None,
                                                      q.dtype)[0], q, k, v, dout)
        for gname, a, r, b in zip(("dq", "dk", "dv"), ours, ref, low):
            check_close(a, r, b, 3, f"{bcfg.name} window={window} {sq}x{sk} {heads} {gname}")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_fold4_large_and_growing_scores(causal):
    """fold_cap 4's prescaled Q with scores that move the running max far (as
    test_features_opt_gpu's lazy test): inputs x 4, one early key raised on every row."""
    config = default_configs(("softcap",), causal).replace(fold_cap=4)
    for cap in (30.0, 50.0):
        for sq, sk in ((1023, 2049), (2049, 2049)):
            q, k, v, _ = inputs(2, sq, sk, "gqa", 128, "bf16")
            q, k = q * 4, k * 4
            q[..., -1] = 4.0
            k[:, 3, :, -1] = 40.0
            check_forward(config, q, k, v, causal, (-1, -1), cap, None, f"{config.name} cap {cap} large {sq}x{sk}")
