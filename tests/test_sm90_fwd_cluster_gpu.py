"""sm90_fwd's cluster (kCluster, sm90_fwd_cluster: clusters of 2 CTAs on adjacent Q blocks of one head,
each loading half of every K_j / V_j by TMA multicast into both) on the GPU, the FlashAttention way:
fresh random inputs, outputs poisoned (NaN) before each launch, error against the float64 reference
within 2x the error of plain attention in the same low precision.

* the timed kernels (tests/sm90_fwd_cells_timing.py's cl rows: the d256 non-causal 2k heuristic tile
  bf16 / fp16, and d128's BN 176 pingpong tile) over an even number of Q blocks
  (seqlen_q 200, 256, 1000, 2048: for_problem drops the cluster otherwise) against seqlen_k 1, 17,
  113, 1023, 2049, MHA / GQA / MQA;
* many tiles per CTA (batch 3 x 16 heads, GQA 16:4, 16 Q blocks: ~6 tiles per CTA) against the same
  kernel without the cluster, bit for bit (the same GEMMs and softmax; only the loads are shared).

    CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q tests/test_sm90_fwd_cluster_gpu.py
"""
import pytest

import cuflash

from test_sm90_pv_overlap_gpu import equal_bit_for_bit, forward_grid  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

# (dtype, head dim, seqlen of the benchmark cell whose heuristic kernel is the base, changes)
KERNELS = [("bf16", 256, 2048, {}), ("fp16", 256, 2048, {}), ("bf16", 128, 16384, {"stream_tail": False})]
SEQLENS = [(200, 1), (256, 17), (1000, 113), (2048, 1023), (200, 2049), (1000, 2049), (2048, 2048)]


def kid(k):
    return f"{k[0]}-d{k[1]}-{k[2]}" + "".join(f"-{a}{int(b)}" for a, b in k[3].items())


def config(k, cluster=True):
    from cuflash import registry

    fam = registry.get("sm90_fwd")
    p = cuflash.Problem.fa_convention("fwd", k[0], k[1], False, k[2])
    return fam.for_problem(fam.heuristic(p), p).replace(**k[3], cluster=cluster, lazy_rescale=False, section=0).validate(
        227 * 1024)   # (lazy_rescale: HEURISTIC_LAZY's, since session 22; the study's tile without it)


def used(cfg, q, kk):
    """The config a call on q, kk runs (for_problem may drop the cluster: it must not here)."""
    from cuflash import registry

    p = cuflash.Problem("fwd", cfg.dtype, q.shape[0], q.shape[1], kk.shape[1], q.shape[2], kk.shape[2], cfg.head_dim,
                        False)
    return registry.get("sm90_fwd").for_problem(cfg, p)


@pytest.mark.parametrize("k", KERNELS, ids=kid)
def test_forward(k):
    cfg = config(k)
    forward_grid((k[0], k[1], False, {}), cfg, SEQLENS, lambda q, kk: used(cfg, q, kk).cluster)


@pytest.mark.parametrize("k", KERNELS, ids=kid)
def test_equals_the_plain_kernel_bit_for_bit(k):
    # (2048 and 2000 rows: 16 Q blocks, the cluster stays on)
    equal_bit_for_bit((k[0], k[1], False, {}), config(k), config(k, False), ((2048, 1500), (2000, 2049)))
