"""sm90_fwd's pv_overlap (kPvOverlap: the consumers' K/V loop rotated so that the softmax of S_j runs
under the warpgroup's own P_{j-1} V_{j-1}, kernels_cu/sm90_fwd_common.cuh kRotate) on the GPU, the
FlashAttention way: fresh random inputs, outputs poisoned (NaN) before each launch, error against the
float64 reference within 2x the error of plain attention in the same low precision.

* the heuristic's kernels of the timed cells (tests/sm90_fwd_cells_timing.py's pvo rows: d256
  non-causal 2k bf16 / fp16, d128 non-causal 16k (stream_tail, pingpong), d128 causal 8k (dynamic,
  TMA store), d64 non-causal 4k (3 consumers)) with pv_overlap, over seqlens 1, 17, 113, 1023, 2049
  with s_q != s_k both ways, MHA / GQA / MQA (one K/V block: the rotated loop's j = 1 head never runs);
* each against the same kernel without pv_overlap, bit for bit (the same operations in the same
  order; only the code's layout differs), on many tiles per CTA.

10 compiles (tests/sm90_fwd_cells_timing.py --rows heur,pvo compiles them in parallel):
    CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q tests/test_sm90_pv_overlap_gpu.py
"""
import pytest

import cuflash

from test_features_gpu import inputs  # noqa: E402
from test_sm90_fwdnc_gpu import check  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

# (dtype, head dim, causal, seqlen of the benchmark cell whose heuristic kernel is tested)
CELLS = [("bf16", 256, False, 2048), ("fp16", 256, False, 2048), ("bf16", 128, False, 16384),
         ("bf16", 128, True, 8192), ("bf16", 64, False, 4096)]
SEQLENS = [(1, 17), (17, 1), (113, 1023), (1023, 113), (2049, 1023), (1023, 2049), (2049, 2049)]
HEADS = ("mha", "gqa", "mqa")


def cid(c):
    return f"{c[0]}-d{c[1]}-{'causal' if c[2] else 'full'}-{c[3]}"


def cell_config(c, pv_overlap=True):
    """The heuristic's config of the benchmark cell c (the kernel the timing measured)."""
    from cuflash import registry

    fam = registry.get("sm90_fwd")
    p = cuflash.Problem.fa_convention("fwd", c[0], c[1], c[2], c[3])
    return fam.for_problem(fam.heuristic(p), p).replace(pv_overlap=pv_overlap, lazy_rescale=False, section=0).validate(
        227 * 1024)   # (lazy_rescale: HEURISTIC_LAZY's, since session 22; the study's tile without it)


def forward_grid(k, cfg, seqlens, runs=lambda q, kk: True):
    """cfg against the reference on batch 2 of each (seqlen_q, seqlen_k), heads MHA / GQA / MQA in turn;
    runs(q, kk): whether the call runs cfg as given (asserted first)."""
    for i, (sq, sk) in enumerate(seqlens):
        heads = HEADS[i % 3]
        q, kk, v, _ = inputs(2, sq, sk, heads, k[1], k[0])
        assert runs(q, kk), f"{cfg.name} {sq}x{sk}: the call would not run it"
        check(k, q, kk, v, f"{sq}x{sk} {heads}", cfg=cfg)


@pytest.mark.parametrize("c", CELLS, ids=cid)
def test_forward(c):
    forward_grid((c[0], c[1], c[2], {}), cell_config(c), SEQLENS)


def equal_bit_for_bit(k, cfg_a, cfg_b, shapes=((2049, 1500), (1500, 2049))):
    """cfg_a and cfg_b (same dtype and head dim) give the same O and LSE, bit for bit, each within the
    reference's bounds, on batch 3 x 16:4 heads of each (seqlen_q, seqlen_k)."""
    import torch

    t = {"bf16": torch.bfloat16, "fp16": torch.float16}[k[0]]
    for sq, sk in shapes:
        q = torch.randn(3, sq, 16, k[1], device="cuda", dtype=t)
        kk, v = (torch.randn(3, sk, 4, k[1], device="cuda", dtype=t) for _ in range(2))
        _, out_a, lse_a = check(k, q, kk, v, "a", cfg=cfg_a)
        _, out_b, lse_b = check(k, q, kk, v, "b", cfg=cfg_b)
        assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b), f"{cfg_a.name}: differs from {cfg_b.name}"


@pytest.mark.parametrize("c", CELLS, ids=cid)
def test_equals_the_plain_loop_bit_for_bit(c):
    assert cell_config(c) == cell_config(c, False).replace(pv_overlap=True)
    equal_bit_for_bit((c[0], c[1], c[2], {}), cell_config(c), cell_config(c, False))
