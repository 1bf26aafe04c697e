"""decode_splitkv's ``bulk`` option on the GPU (sm_90), against the float64 reference: the cp.async
loop's whole K/V blocks arrive by one cp.async.bulk per key row on a per-slot mbarrier (bulk 1),
with an L2 evict-first policy (bulk 2); blocks with rows past a row's end keep the zero-filling
cp.asyncs (their slot's barrier gets a plain arrival).

The heuristic's switches (BULK_DEFAULT, BULK_PAGED_DEFAULT) are set for each case and the plan
cache cleared, so the calls go through flash_attn_with_kvcache as users make them;
test_decode_gpu.check_call compares with the reference (outputs NaN-poisoned first, error at most
twice that of plain attention in the same low precision, LSE likewise, appended cache rows as the
reference wrote them). Odd contexts (1, 17, 113, 1023, 2049: ragged last blocks), per-batch
cache_seqlens (0 included), GQA 1 / 4 / 8, seqlen_q 1..4 (causal), head dims 64 / 128, contiguous
and paged (page 16; page 48 with cache_leftpad and an appended token: rows of one block on
several pages), num_splits 0 / 1 / 3 (fused combine, no split, separate-combine counts).
early_merge (the fused combine's early partial-O loads) with and without bulk. Compiles: at most
9 kernel sets.

    CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q -x tests/test_decode_bulk_gpu.py
"""
import numpy as np
import pytest

from cuflash import _gpu, api, decode
from cuflash.families import decode_splitkv as fam_mod

from test_decode_gpu import check_call, make_case

pytestmark = [pytest.mark.gpu]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(api, "POISON_OUTPUTS", True)
    if _gpu.arch()[0] != 9:
        pytest.skip("bulk needs sm_90 (cp.async.bulk)")


def _options(monkeypatch, bulk: int):
    monkeypatch.setattr(fam_mod, "BULK_DEFAULT", bulk)
    monkeypatch.setattr(fam_mod, "BULK_PAGED_DEFAULT", bulk)
    monkeypatch.setattr(fam_mod, "TMA_DEFAULT", False)           # options of the cp.async loop
    monkeypatch.setattr(fam_mod, "TMA_PAGED_DEFAULT", False)
    monkeypatch.setattr(fam_mod, "SMALL_PAGE_TMA_MAX_KEYS", 0)   # small paged calls stay on it too
    monkeypatch.setattr(fam_mod, "LARGE_PAGE_TMA_MAX_KEYS", 0)   # page 256 as well
    decode._drop_gpu_plans()  # plans made with other settings must not serve these calls
    monkeypatch.setattr(decode, "_gpu_plans", {})


def _ran(bulk: int):
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert plans and all(p.config.bulk == bulk and not p.config.tma for p in plans), \
        [p.config.name for p in plans]


# (batch, seqlen_q, context, nheads, nheads_kv, d, dtype, num_splits, page, bulk)
CASES = [
    (1, 1, 1, 8, 8, 128, "bf16", 0, None, 1),
    (3, 1, 17, 32, 8, 128, "bf16", 3, None, 1),
    (2, 1, 113, 8, 2, 64, "fp16", 0, None, 1),
    (3, 4, 1023, 32, 4, 128, "bf16", 0, None, 1),   # 8 x 4 = 32 packed rows: two row tiles
    (2, 2, 2049, 32, 8, 128, "bf16", 1, None, 2),
    (4, 1, 8192, 32, 8, 128, "bf16", 0, None, 2),
    (3, 1, 2049, 32, 8, 128, "bf16", 0, 16, 1),
    (3, 3, 1023, 16, 2, 128, "bf16", 3, 16, 1),
]


def _ids(c):
    return (f"b{c[0]}_q{c[1]}_ctx{c[2]}_h{c[3]}x{c[4]}_d{c[5]}_{c[6]}_split{c[7]}_page{c[8] or 0}"
            f"_bk{c[9]}")


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_bulk_grid(monkeypatch, case):
    b, sq, ctx, h, hk, d, dtype, splits, page, bulk = case
    _options(monkeypatch, bulk)
    rng = np.random.default_rng()
    lens = [ctx] + [int(rng.integers(0, ctx + 1)) for _ in range(b - 1)]
    if b > 2:
        lens[2] = 0
    args = make_case(rng, b, sq, lens, h, hk, d, dtype, page=page)
    check_call(args, dtype, _ids(case), causal=sq > 1, num_splits=splits)
    _ran(bulk)


def test_bulk_paged_leftpad_append(monkeypatch):
    """Page 48 with cache_leftpad (a block's rows on several pages, looked up per row) and one
    appended token, bulk 1 on the heuristic's paged tiles (SMALL_PAGE_WARPS)."""
    _options(monkeypatch, 1)
    rng = np.random.default_rng()
    args = make_case(rng, 3, 1, [2049, 300, 700], 32, 8, 128, "bf16", page=48, seqlen_new=1, leftpad=True)
    check_call(args, "bf16", "bulk 1, page 48 leftpad append", num_splits=0)
    _ran(1)


def test_bulk_repeated_calls_flip_every_phase(monkeypatch):
    """Many blocks per split (phases wrap around the ring many times) and a second call on the same
    plan: 1 x 16k with one split, then with the heuristic's splits."""
    _options(monkeypatch, 1)
    rng = np.random.default_rng()
    args = make_case(rng, 1, 1, [16384 - 5], 32, 8, 128, "bf16")
    for splits in (1, 0, 0):
        check_call(dict(args, k_cache=args["k_cache"].clone(), v_cache=args["v_cache"].clone()),
                   "bf16", f"bulk 1, 16k, splits {splits}", num_splits=splits)
    _ran(1)


@pytest.mark.parametrize("bulk", [0, 1])
def test_early_merge(monkeypatch, bulk):
    """early_merge (the fused combine's merging CTA issues its first partial-O loads before the LSE
    loads): 17 splits (a second load batch), 3 splits, the heuristic's count, per-batch lengths
    (0 included: splits without keys), GQA 4 with seqlen_q 2."""
    _options(monkeypatch, bulk)
    monkeypatch.setattr(fam_mod, "EARLY_MERGE_DEFAULT", True)
    rng = np.random.default_rng()
    args = make_case(rng, 3, 2, [8191, 0, 4000], 32, 8, 128, "bf16")
    for splits in (17, 3, 0):
        check_call(dict(args, k_cache=args["k_cache"].clone(), v_cache=args["v_cache"].clone()),
                   "bf16", f"early merge, bulk {bulk}, splits {splits}", causal=True, num_splits=splits)
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert plans and all(p.config.early_merge and p.config.bulk == bulk for p in plans), \
        [p.config.name for p in plans]
