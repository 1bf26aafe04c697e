"""sm90_fwd's stream_tail (kStreamTail, kernels_cu/sm90_tail.cuh: the static persistent schedule with
its last stretch cut by K/V blocks, tiles cut in two merged through fp32 partials) on the GPU, the
FlashAttention way: fresh random inputs, outputs poisoned (NaN) before each launch, error against the
float64 reference within 2x the error of plain attention in the same low precision.

* every kernel of KERNELS over seqlens 1, 17, 113, 1023, 2049, s_q != s_k both ways, MHA / GQA / MQA,
  on shapes with more tiles than SMs (a stretch with tiles cut in two: batch x heads x Q blocks from
  144 to 816 tiles) and with fewer (one tile per CTA, no cut);
* the same shape three times with new inputs (the flags a finisher resets must be 0 again for the
  next launch: a stale flag would let it read the last launch's partial);
* pieces of one tile: tests/test_sm90_stream_tail_cpu.py checks the schedule's mirror.
Causal calls run without it (for_problem drops the flag: CPU test).

5 compiles (tests/sm90_fwd_cells_timing.py --with-st-tests --precompile-only compiles them in
parallel), about a minute on an H100:
    CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q tests/test_sm90_stream_tail_gpu.py
"""
import pytest

from test_sm90_fwdnc_gpu import check, kid  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

ST = {"dynamic": False, "stream_tail": True}
# (dtype, head dim, causal, changes to the heuristic's tile: tests/test_sm90_fwdnc_gpu.py tile_of)
KERNELS = [
    ("bf16", 256, False, dict(ST, pingpong=False)),                      # the d256 heuristic's + st
    ("fp16", 256, False, dict(ST, pingpong=False)),
    ("bf16", 128, False, dict(ST, BN=160, tma_store=True)),              # d128 below 16k: + TMA store, pingpong
    ("fp16", 128, False, dict(ST, BN=176)),                              # d128 from 16k, pingpong
    ("bf16", 64, False, dict(ST, BM=192, consumers=3, BN=128)),          # three consumer warpgroups
]
# (batch, s_q, s_k, heads, heads_kv): tiles = batch x heads x ceil(s_q / BM)
SHAPES = [
    (4, 1, 1023, 40, 8),        # 160 tiles of one row, GQA
    (3, 17, 113, 48, 48),       # 144 tiles, MHA, short keys (2 blocks)
    (8, 113, 17, 24, 1),        # 192 tiles, MQA, one block: no cut possible
    (2, 1023, 2049, 16, 4),     # 128-256 tiles (BM 128: 8 Q blocks x 32)
    (2, 2049, 1023, 16, 16),    # 17 Q blocks x 32 = 544 tiles
    (3, 2049, 2049, 16, 2),     # 816 tiles, GQA 8:1
    (1, 2049, 1, 8, 8),         # a single key
    (1, 113, 2049, 4, 1),       # 4 tiles: fewer than SMs, no stretch cut
]


def _inputs(shape, d, dtype):
    import torch

    b, sq, sk, h, hkv = shape
    t = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    return (torch.randn(b, sq, h, d, device="cuda", dtype=t), torch.randn(b, sk, hkv, d, device="cuda", dtype=t),
            torch.randn(b, sk, hkv, d, device="cuda", dtype=t))


@pytest.mark.parametrize("k", KERNELS, ids=kid)
def test_forward(k):
    for shape in SHAPES:
        q, kk, v = _inputs(shape, k[1], k[0])
        cfg, _, _ = check(k, q, kk, v, f"{shape}")
        assert cfg.stream_tail and not cfg.causal


@pytest.mark.parametrize("k", KERNELS[:3], ids=kid)
def test_repeated_launches_with_new_inputs(k):
    for _ in range(3):
        q, kk, v = _inputs((2, 2049, 2049, 16, 4), k[1], k[0])
        check(k, q, kk, v, "repeat")
