"""decode_splitkv's batch-1 latency and small-page work on the GPU (issue 13), against the float64
reference through flash_attn_with_kvcache as users call it:

  * the split merge with its partials' loads in batches of 16 (decode_combine, and the fused
    combine's last CTA): split counts around the batch edges (2, 15, 16, 17, 33, 64, 128), splits
    without keys (empty rows, short rows with many splits, causal seqlen_q > 1), head dims 64 /
    128 / 256 (d 64 leaves lanes without columns);
  * ``page_gather`` (a K/V block's page ids read before its copies): pages 16, 48 (with
    cache_leftpad: blocks straddle pages) and 256, 8 and 4 warps, per-batch lengths, GQA 1 / 4 /
    8, seqlen_q 1..4, one appended token.

Outputs are NaN-poisoned before each call; errors at most twice plain attention's in the same low
precision (test_decode_gpu.check_call). Compiles: at most 8 kernel sets (d 128 bf16 with one and
two row tiles, plain, fused and page_gather, 4-warp page_gather; d 64 fp16; d 256 bf16).

    CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q -x tests/test_decode_latency_gpu.py
"""
import numpy as np
import pytest

from cuflash import api, decode
from cuflash.families import decode_splitkv as fam_mod

from test_decode_gpu import check_call, make_case

pytestmark = [pytest.mark.gpu]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(api, "POISON_OUTPUTS", True)


def _switches(monkeypatch, fused=False, gather=False, small_page_warps=8):
    monkeypatch.setattr(fam_mod, "FUSED_COMBINE_DEFAULT", fused)
    monkeypatch.setattr(fam_mod, "PAGE_GATHER_DEFAULT", gather)
    monkeypatch.setattr(fam_mod, "PAGE_PREFETCH_DEFAULT", False)
    monkeypatch.setattr(fam_mod, "SMALL_PAGE_WARPS", small_page_warps)
    monkeypatch.setattr(fam_mod, "TMA_DEFAULT", False)        # options of the cp.async loop
    monkeypatch.setattr(fam_mod, "TMA_PAGED_DEFAULT", False)
    monkeypatch.setattr(fam_mod, "SMALL_PAGE_TMA_MAX_KEYS", 0)   # small paged calls stay on it too
    monkeypatch.setattr(fam_mod, "LARGE_PAGE_TMA_MAX_KEYS", 0)   # page 256 as well
    decode._drop_gpu_plans()  # plans made with other settings must not serve these calls
    monkeypatch.setattr(decode, "_gpu_plans", {})


def _configs():
    return [e.plan.config for e in decode._gpu_plans.values() if e.plan is not None]


def _lens(rng, batch, ctx):
    """Per-batch lengths: the first row full, the others random, the third empty."""
    lens = [ctx] + [int(rng.integers(0, ctx + 1)) for _ in range(batch - 1)]
    if batch > 2:
        lens[2] = 0
    return lens


# (batch, seqlen_q, context, nheads, nheads_kv, d, dtype, num_splits)
COMBINE_CASES = [
    (1, 1, 8192, 32, 8, 128, "bf16", 16),    # the 1 x 8k shape: one batch of loads
    (3, 1, 2049, 32, 8, 128, "bf16", 17),    # one past a batch; the third row has no keys
    (2, 1, 1023, 8, 8, 128, "bf16", 15),
    (3, 3, 4000, 16, 4, 128, "bf16", 33),    # two row tiles (12 packed rows: one); causal edges
    (1, 1, 300, 8, 2, 128, "bf16", 128),     # most splits empty (3 blocks of keys)
    (3, 1, 2049, 16, 2, 64, "fp16", 64),     # d 64: lanes without columns
    (2, 2, 2049, 8, 1, 256, "bf16", 2),      # d 256: two column passes
    (1, 4, 113, 32, 8, 128, "bf16", 5),      # 4 x 4 = 16 packed rows, an odd context
]


def _cid(c):
    return f"b{c[0]}_q{c[1]}_ctx{c[2]}_h{c[3]}x{c[4]}_d{c[5]}_{c[6]}_split{c[7]}"


@pytest.mark.parametrize("fused", [False, True], ids=["combine", "fused"])
@pytest.mark.parametrize("case", COMBINE_CASES, ids=_cid)
def test_split_merge(monkeypatch, case, fused):
    b, sq, ctx, h, hk, d, dtype, splits = case
    _switches(monkeypatch, fused=fused)
    rng = np.random.default_rng()
    for call in range(2 if fused else 1):  # fused: the second call finds the counters reset
        args = make_case(rng, b, sq, _lens(rng, b, ctx), h, hk, d, dtype)
        check_call(args, dtype, f"{_cid(case)} call {call}", causal=sq > 1, num_splits=splits)
    assert all(c.fused_combine == fused for c in _configs()), [c.name for c in _configs()]


# (batch, seqlen_q, context, nheads, nheads_kv, page, num_splits, leftpad, warps)
GATHER_CASES = [
    (3, 1, 2049, 32, 8, 16, 0, False, 8),
    (1, 1, 8192, 32, 8, 16, 0, False, 8),    # the 1 x 8k shape
    (3, 4, 1023, 32, 4, 16, 3, False, 8),    # 8 x 4 = 32 packed rows: two row tiles
    (2, 2, 113, 8, 8, 16, 1, False, 8),
    (3, 1, 2049, 32, 8, 48, 0, True, 8),     # blocks straddle pages, odd offsets in a page
    (2, 3, 700, 16, 4, 256, 5, True, 8),
    (3, 1, 4097, 32, 8, 16, 0, False, 4),    # SMALL_PAGE_WARPS' 4 warps (64-key blocks)
    (2, 1, 1023, 32, 8, 48, 3, True, 4),
]


def _gid(c):
    return (f"b{c[0]}_q{c[1]}_ctx{c[2]}_h{c[3]}x{c[4]}_page{c[5]}_split{c[6]}"
            f"{'_leftpad' if c[7] else ''}_w{c[8]}")


@pytest.mark.parametrize("case", GATHER_CASES, ids=_gid)
def test_page_gather(monkeypatch, case):
    b, sq, ctx, h, hk, page, splits, leftpad, warps = case
    _switches(monkeypatch, gather=True, small_page_warps=warps)
    rng = np.random.default_rng()
    args = make_case(rng, b, sq, _lens(rng, b, ctx), h, hk, 128, "bf16", page=page, seqlen_new=1,
                     leftpad=leftpad)
    check_call(args, "bf16", _gid(case), causal=sq > 1, num_splits=splits)
    cfgs = _configs()
    assert cfgs and all(c.page_gather and not c.tma for c in cfgs), [c.name for c in cfgs]
    if page < fam_mod.TMA_PAGED_MAX_PAGE:
        assert all(c.warps == warps for c in cfgs), [c.name for c in cfgs]


def test_page_gather_contiguous_is_plain(monkeypatch):
    """The switch touches paged caches only: a contiguous call runs the plain kernel."""
    _switches(monkeypatch, gather=True)
    rng = np.random.default_rng()
    args = make_case(rng, 2, 1, [3000, 17], 32, 8, 128, "bf16")
    check_call(args, "bf16", "contiguous with PAGE_GATHER_DEFAULT", num_splits=0)
    assert not any(c.page_gather for c in _configs())
