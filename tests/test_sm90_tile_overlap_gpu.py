"""sm90_fwd's tile_overlap (kTileOverlap: the next tile's S_0 issued behind a tile's last P V, run
during the epilogue) on the GPU, the FlashAttention way: fresh random inputs, outputs poisoned (NaN)
before each launch, error against the float64 reference within 2x the error of plain attention in
the same low precision.

* every kernel of KERNELS (the static persistent non-causal tile, tile_overlap on; one with pingpong)
  over seqlens 1, 17, 113, 1023, 2049 with s_q != s_k both ways, MHA / GQA / MQA, bf16 and fp16, head
  dims 64 / 128 / 256 (one tile per CTA too: the first S_0 issued before the loop, the last tile's
  dropped S GEMM);
* many tiles per CTA (batch 3 x 16 heads, GQA 16:4, 2049 rows: ~6 tiles per CTA), s_q > s_k and s_q < s_k;
* tile_overlap against the same tile without it, bit for bit (the same GEMMs and softmax, only S_0
  issued earlier), without and with pingpong.

8 compiles (tests/sm90_fwd_cells_timing.py --with-tests compiles them in parallel), under a minute
on an H100:
    CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q tests/test_sm90_tile_overlap_gpu.py
"""
import pytest

import cuflash

from test_features_gpu import inputs  # noqa: E402
from test_sm90_fwdnc_gpu import check, kid  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

STATIC = {"dynamic": False, "pingpong": False, "tma_store": False}
TOV = dict(STATIC, tile_overlap=True)
# (dtype, head dim, causal, changes to the heuristic's tile: tests/test_sm90_fwdnc_gpu.py tile_of)
KERNELS = [
    ("bf16", 256, False, TOV),
    ("fp16", 256, False, TOV),
    ("bf16", 128, False, dict(TOV, BN=176)),
    ("fp16", 64, False, dict(TOV, BM=192, consumers=3, BN=128)),
    ("bf16", 128, False, dict(TOV, BN=176, pingpong=True)),                 # pingpong: S'_0 in the last turn
]
PLAIN = {0: ("bf16", 256, False, STATIC), 2: ("bf16", 128, False, dict(STATIC, BN=176)),
         4: ("bf16", 128, False, dict(STATIC, BN=176, pingpong=True))}
SEQLENS = [(1, 17), (17, 1), (113, 1023), (1023, 113), (2049, 1023), (1023, 2049), (2049, 2049)]
HEADS = ("mha", "gqa", "mqa")


def test_kernels_are_the_overlap_tiles():
    from cuflash import registry

    fam = registry.get("sm90_fwd")
    for dtype, d, causal, change in KERNELS:
        p = cuflash.Problem("fwd", dtype, 2, 2049, 2049, 16, 4, d, causal)
        cfg = fam.heuristic(p).replace(persistent=True, stream_tail=False, lazy_rescale=False, **change)
        assert not cfg.problems(227 * 1024), (cfg.name, cfg.problems(227 * 1024))
        assert cfg.tile_overlap and cfg.persistent and not cfg.dynamic


@pytest.mark.parametrize("k", KERNELS, ids=kid)
def test_forward(k):
    for i, (sq, sk) in enumerate(SEQLENS):
        heads = HEADS[i % 3]
        q, kk, v, _ = inputs(2, sq, sk, heads, k[1], k[0])
        cfg, _, _ = check(k, q, kk, v, f"{sq}x{sk} {heads}")
        assert cfg.tile_overlap and cfg.causal == k[2]


@pytest.mark.parametrize("k", KERNELS, ids=kid)
def test_many_tiles_per_cta(k):
    import torch

    t = {"bf16": torch.bfloat16, "fp16": torch.float16}[k[0]]
    for sq, sk in ((2049, 1500), (1500, 2049)):
        q = torch.randn(3, sq, 16, k[1], device="cuda", dtype=t)
        kk, v = (torch.randn(3, sk, 4, k[1], device="cuda", dtype=t) for _ in range(2))
        check(k, q, kk, v, f"3 x {sq}x{sk} x 16:4 heads")


@pytest.mark.parametrize("i", sorted(PLAIN), ids=lambda i: kid(KERNELS[i]))
def test_equals_the_plain_order_bit_for_bit(i):
    import torch

    tov, plain = KERNELS[i], PLAIN[i]
    t = {"bf16": torch.bfloat16, "fp16": torch.float16}[tov[0]]
    q = torch.randn(3, 2049, 16, tov[1], device="cuda", dtype=t)
    kk, v = (torch.randn(3, 1500, 4, tov[1], device="cuda", dtype=t) for _ in range(2))
    cfg_t, out_t, lse_t = check(tov, q, kk, v, "tile_overlap")
    cfg, out, lse = check(plain, q, kk, v, "plain")
    assert cfg_t == cfg.replace(tile_overlap=True)
    assert torch.equal(out_t, out) and torch.equal(lse_t, lse), f"{cfg_t.name}: differs from {cfg.name}"

