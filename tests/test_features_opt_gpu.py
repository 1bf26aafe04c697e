"""sm90_fwd's variants for calls with window / softcap / ALiBi on the GPU (issue 12's overheads):
lazy rescaling (lazy_rescale, kLazyRescale), the softcap folded into the softmax's scale
(fold_cap 1, 2 and 3, kFoldCap: kernels_cu/softmax_fold.cuh; 3's fixed max and its fallback to
the row max above the cap's bound) and the dynamic scheduler with the
TMA-store epilogue next to the features. The FlashAttention way: fresh random inputs, outputs
poisoned (NaN) before each launch, error vs the float64 reference (tests/test_features_gpu.py's
torch code) within 2x the error of the same attention computed in the same low precision; LSE
within 1e-2 and +inf exactly on the rows with no visible key; seqlens 1, 17, 113, 1023, 2049 with
s_q != s_k, MHA / GQA / MQA; window edges (bounds 0, 1, a block's width, unaligned), causal +
window, and scores large enough that the running max moves by far more than the lazy threshold.

12 compiled kernels (KERNELS, d128 bf16; 9 of them shared with tests/features_overhead_timing.py,
which precompiles all of them in parallel):
    python tests/features_overhead_timing.py --precompile
    CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q tests/test_features_opt_gpu.py
"""
import math

import pytest

import cuflash
from cuflash import registry
from cuflash.families.sm90_fwd import Sm90FwdConfig

from test_features_gpu import check_close, feature_attention, inputs, slopes_for  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

FAM = registry.get("sm90_fwd")
DYN = dict(persistent=True, dynamic=True, tma_store=True)


def cfg(causal, BN, **kw):
    return Sm90FwdConfig(128, BN, 2, 2, True, False, 128, "bf16", causal).replace(**kw)


# (id, config, cases): each case (window, softcap, alibi) runs on this one kernel (the config's
# flags must match the case's features: window / softcap / alibi are compile-time)
KERNELS = [
    ("win_dyn_tmao_lazy_causal", cfg(True, 128, window=True, lazy_rescale=True, **DYN),
     [((1024, 0), 0.0, None), ((0, 0), 0.0, None), ((1, 0), 0.0, None), ((300, 0), 0.0, None)]),
    ("win_dyn_tmao_lazy_full", cfg(False, 128, window=True, lazy_rescale=True, **DYN),
     [((300, 129), 0.0, None), ((128, 128), 0.0, None), ((0, 5), 0.0, None), ((-1, 64), 0.0, None)]),
    ("cap_fold1_causal", cfg(True, 176, softcap=True, fold_cap=1),
     [((-1, -1), 30.0, None), ((-1, -1), 5.0, None)]),
    ("cap_fold2_lazy_causal", cfg(True, 176, softcap=True, fold_cap=2, lazy_rescale=True),
     [((-1, -1), 30.0, None), ((-1, -1), 5.0, None)]),
    ("cap_fold2_lazy_full", cfg(False, 176, softcap=True, fold_cap=2, lazy_rescale=True),
     [((-1, -1), 30.0, None), ((-1, -1), 50.0, None)]),
    # fold_cap 3: the fixed max at softcap 30 and 5, the row max at 50 (2·50·log2(e) > 100)
    ("cap_fold3_lazy_full", cfg(False, 176, softcap=True, fold_cap=3, lazy_rescale=True),
     [((-1, -1), 30.0, None), ((-1, -1), 5.0, None), ((-1, -1), 50.0, None)]),
    ("cap_fold3_lazy_dyn_tmao_causal", cfg(True, 144, softcap=True, fold_cap=3, lazy_rescale=True, **DYN),
     [((-1, -1), 30.0, None), ((-1, -1), 50.0, None)]),
    ("alibi_dyn_tmao_lazy_causal", cfg(True, 144, alibi=True, lazy_rescale=True, **DYN),
     [((-1, -1), 0.0, "h"), ((-1, -1), 0.0, "bh")]),
    ("alibi_dyn_tmao_lazy_full", cfg(False, 144, alibi=True, lazy_rescale=True, **DYN),
     [((-1, -1), 0.0, "bh")]),
    # combinations: ALiBi inside the folded scores (its slope / softcap_out), the double mask of
    # fold_cap 2 on a window's edge blocks
    ("win_cap_alibi_fold1_lazy_causal", cfg(True, 128, persistent=True, window=True, softcap=True,
                                            alibi=True, fold_cap=1, lazy_rescale=True),
     [((200, 0), 10.0, "h")]),
    ("cap_alibi_fold2_lazy_full", cfg(False, 176, softcap=True, alibi=True, fold_cap=2, lazy_rescale=True),
     [((-1, -1), 30.0, "bh")]),
    ("win_cap_fold3_lazy_dyn_tmao_causal", cfg(True, 128, window=True, softcap=True, fold_cap=3,
                                               lazy_rescale=True, **DYN),
     [((256, 0), 30.0, None), ((256, 0), 60.0, None)]),
]
SEQLENS = [(1, 17), (17, 1), (113, 1023), (1023, 113), (2049, 1023), (1023, 2049), (2049, 2049)]
HEADS = ("mha", "gqa", "mqa")


def all_test_configs():
    """The kernels of this file (tests/features_overhead_timing.py --precompile builds them)."""
    return [c for _, c, _ in KERNELS]


def check_forward(config, q, k, v, causal, window, softcap, slopes, what):
    import torch

    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                          alibi_slopes=slopes, config=config, return_attn_probs=True)
    scale = q.shape[-1] ** -0.5
    ref, ref_lse = feature_attention(q, k, v, scale, causal, window, softcap, slopes, torch.float64)
    low, _ = feature_attention(q, k, v, scale, causal, window, softcap, slopes, q.dtype)
    check_close(out, ref, low, 2, what)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"{what}: LSE = +inf rows differ"
    if finite.any():
        err = (lse[finite].double() - ref_lse[finite]).abs().max().item()
        assert err < 1e-2 * max(1.0, ref_lse[finite].abs().max().item()), f"{what}: LSE error {err:.3g}"
    assert (lse[~finite] == math.inf).all(), f"{what}: rows with no key must have LSE = +inf"
    return out


@pytest.mark.parametrize("kernel", KERNELS, ids=[k[0] for k in KERNELS])
def test_forward(kernel):
    name, config, cases = kernel
    causal = config.causal
    for window, softcap, alibi in cases:
        for i, (sq, sk) in enumerate(SEQLENS):
            heads = HEADS[i % 3]
            q, k, v, _ = inputs(2, sq, sk, heads, 128, "bf16")
            slopes = slopes_for(alibi, 2, q.shape[2])
            check_forward(config, q, k, v, causal, window, softcap, slopes,
                          f"{config.name} window {window} softcap {softcap} alibi {alibi} {sq}x{sk} {heads}")


@pytest.mark.parametrize("kernel", [k for k in KERNELS if k[1].lazy_rescale], ids=lambda k: k[0])
def test_lazy_rescale_large_and_growing_scores(kernel):
    """Scores that move the running max by far more than the lazy threshold (2^8 in P): inputs x 4
    (scores span ~±100 at scale 1/sqrt(128)), and one key of the first block (visited last: the
    K/V loop runs from the last block to the first) raised by 160 / sqrt(128) on every row, so m moves at
    the loop's end and O must be rescaled then."""
    name, config, cases = kernel
    window, softcap, alibi = cases[0]
    for sq, sk in ((1023, 2049), (2049, 2049)):
        q, k, v, _ = inputs(2, sq, sk, "gqa", 128, "bf16")
        q, k = q * 4, k * 4
        q[..., -1] = 4.0                                 # key 3 gets +160 on every row's raw score
        k[:, 3, :, -1] = 40.0
        slopes = slopes_for(alibi, 2, q.shape[2])
        check_forward(config, q, k, v, config.causal, window, softcap, slopes,
                      f"{config.name} large scores {sq}x{sk}")

