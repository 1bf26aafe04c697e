"""decode_splitkv's bandwidth option on the GPU: ``l2_prefetch`` (the cp.async loop's whole K/V
blocks load with an L2 prefetch-size hint of 128 or 256 bytes), against the float64 reference.

The heuristic's switch (L2_PREFETCH_DEFAULT) is set for each test and the plan cache cleared, so
the calls go through flash_attn_with_kvcache as users make them; test_decode_gpu.check_call
compares with the reference (outputs NaN-poisoned first, error at most twice that of plain
attention in the same low precision, LSE likewise, appended cache rows as the reference wrote
them). Odd contexts (1, 17, 113, 1023, 2049: ragged last blocks load without the hint), per-batch
cache_seqlens (0 included), GQA 1 / 4 / 8, seqlen_q 1..4, contiguous and paged (page 16, and 48
with cache_leftpad), num_splits 0 / 1 / 3. Compiles: 4 kernel sets (d 128 bf16 and d 64 fp16, each
with one and two row tiles; 256 and 128 bytes).

    CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q -x tests/test_decode_bandwidth_gpu.py
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


def _l2(monkeypatch, size: int):
    monkeypatch.setattr(fam_mod, "L2_PREFETCH_DEFAULT", size)
    monkeypatch.setattr(fam_mod, "TMA_DEFAULT", False)        # the cp.async loop's option
    monkeypatch.setattr(fam_mod, "TMA_PAGED_DEFAULT", False)
    decode._drop_gpu_plans()  # plans made with the other setting must not serve these calls
    monkeypatch.setattr(decode, "_gpu_plans", {})


def _ran_l2(size: int):
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert plans and all(p.config.l2_prefetch == size for p in plans), [p.config.name for p in plans]


# (batch, seqlen_q, context, nheads, nheads_kv, d, dtype, num_splits, page, l2 bytes)
CASES = [
    (1, 1, 1, 8, 8, 128, "bf16", 0, None, 256),
    (3, 1, 17, 32, 8, 128, "bf16", 3, None, 256),
    (2, 1, 113, 8, 2, 64, "fp16", 0, None, 128),
    (3, 4, 1023, 32, 4, 128, "bf16", 0, None, 256),   # 8 x 4 = 32 packed rows: two row tiles
    (2, 2, 2049, 32, 8, 128, "bf16", 1, None, 256),
    (3, 1, 2049, 32, 8, 128, "bf16", 0, 16, 256),
    (3, 3, 1023, 16, 2, 64, "fp16", 3, 16, 128),
]


def _ids(c):
    return f"b{c[0]}_q{c[1]}_ctx{c[2]}_h{c[3]}x{c[4]}_d{c[5]}_{c[6]}_split{c[7]}_page{c[8] or 0}_l2p{c[9]}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_l2_prefetch_grid(monkeypatch, case):
    b, sq, ctx, h, hk, d, dtype, splits, page, size = case
    _l2(monkeypatch, size)
    rng = np.random.default_rng()
    lens = [ctx] + [int(rng.integers(0, ctx + 1)) for _ in range(b - 1)]
    if b > 2:
        lens[2] = 0
    args = make_case(rng, b, sq, lens, h, hk, d, dtype, page=page)
    check_call(args, dtype, _ids(case), causal=sq > 1, num_splits=splits)
    _ran_l2(size)


def test_l2_prefetch_leftpad_append(monkeypatch):
    """Page 48 with cache_leftpad (blocks straddle pages) and one appended token."""
    _l2(monkeypatch, 256)
    rng = np.random.default_rng()
    args = make_case(rng, 3, 1, [2049, 300, 700], 32, 8, 128, "bf16", page=48, seqlen_new=1,
                     leftpad=True)
    check_call(args, "bf16", "l2p256 page 48 leftpad", num_splits=0)
    _ran_l2(256)
