"""sm90_fwd's alibi_lin (kAlibiLinear: ALiBi's bias as one FFMA per score, the per-row part in the
softmax's exponent offset; softmax_fold.cuh AlibiLinear / softmax_step_shift) on an H100.

The FlashAttention way: fresh random inputs, outputs poisoned (NaN) before each launch, output
within 2x the error of the same attention in the same low precision against float64
(test_features_gpu.feature_attention), LSE within 1e-2 and +inf exactly on the rows with no key.
Seqlens 1, 17, 113, 1023, 2049 with s_q != s_k both ways (the diagonal's offset moves the blocks
that lie across it: the exact-distance path), MHA / GQA / MQA, slopes per head and per
(batch, head), causal, non-causal (both signs of the linear form), and with a window. 3 kernels:
    python tests/features_overhead_timing.py --precompile --quick --mask both
    CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q tests/test_alibi_linear_gpu.py
"""
import pytest

from cuflash.families.sm90_fwd import Sm90FwdConfig

from test_features_gpu import inputs, slopes_for  # noqa: E402
from test_features_opt_gpu import check_forward  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]


def cfg(causal, BN, **kw):
    return Sm90FwdConfig(128, BN, 2, 2, True, False, 128, "bf16", causal, alibi=True, alibi_lin=True).replace(**kw)


DYN = dict(persistent=True, dynamic=True)
# (id, config, cases (window, alibi)): the timing's candidates (features_overhead_timing.py alin /
# dyn_alin) and the window's tile
KERNELS = [
    ("causal_dyn", cfg(True, 176, **DYN), [((-1, -1), "h"), ((-1, -1), "bh")]),
    ("full_static", cfg(False, 176), [((-1, -1), "bh"), ((-1, -1), "h")]),
    ("win_full_dyn_tmao", cfg(False, 128, window=True, tma_store=True, **DYN),
     [((300, 129), "bh"), ((0, 5), "h"), ((-1, 64), "h"), ((128, 128), "bh")]),
]
SEQLENS = [(1, 17), (17, 1), (113, 1023), (1023, 113), (2049, 1023), (1023, 2049), (2049, 2049)]
HEADS = ("mha", "gqa", "mqa")


def all_test_configs():
    return [c for _, c, _ in KERNELS]


@pytest.mark.parametrize("kernel", KERNELS, ids=[k[0] for k in KERNELS])
def test_forward(kernel):
    name, config, cases = kernel
    for window, alibi in cases:
        for i, (sq, sk) in enumerate(SEQLENS):
            heads = HEADS[i % 3]
            q, k, v, _ = inputs(2, sq, sk, heads, 128, "bf16")
            slopes = slopes_for(alibi, 2, q.shape[2])
            check_forward(config, q, k, v, config.causal, window, 0.0, slopes,
                          f"{config.name} window {window} alibi {alibi} {sq}x{sk} {heads}")


def test_steep_slopes():
    """Slopes of 1 and more (the bias dominates the scores: the row max is the diagonal key's)."""
    import torch

    for _, config, _ in KERNELS[:2]:
        q, k, v, _ = inputs(2, 1023, 2049, "gqa", 128, "bf16")
        slopes = torch.tensor([1.0, 4.0, 0.5, 2.0, 8.0, 0.25], device="cuda", dtype=torch.float32)[: q.shape[2]]
        check_forward(config, q, k, v, config.causal, (-1, -1), 0.0, slopes, f"{config.name} steep slopes")
