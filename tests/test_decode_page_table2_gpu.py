"""decode_splitkv_regs' regs_page_table 2 (kPageTable 2, session 31, dec28): the whole block table row staged in shared
memory, every page id read from there (no global table read after the first K/V load). Paged regs calls run
REGS_PAGE_TABLE_DEFAULT 2 (call_config keeps it where the row has at most REGS_PAGE_IDS pages, else the slice with
global reads, regs_page_table 1) with and without regs_page_shift, at regs_order 0 and 1, through
flash_attn_with_kvcache, against the float64 reference (check_call: outputs poisoned, error at most twice plain
low-precision attention's): pages 16 / 32 / 256 / 40, full, ragged and empty rows, leftpad across pages, a 40000-key
row at page 16 (2500 pages: the fallback to 1), d 64 with two row tiles, fp16, GQA 8, append + rotary, a causal
window with softcap and ALiBi; CUDA-graph replays at new lengths against eager calls.

    timeout 120 python -m pytest -q tests/test_decode_page_table2_gpu.py
"""
import numpy as np
import pytest

from cuflash import decode, select
from cuflash.families import decode_splitkv as fam_mod

from test_decode_gpu import make_case, replays_match_eager
from test_decode_regs_gpu import _ids, check_case
from test_decode_ringfill_gpu import _poison  # noqa: F401  (autouse: outputs poisoned, skip without a GPU)

pytestmark = [pytest.mark.gpu]

# (batch, seqlen_q, lens, nheads, nheads_kv, d, dtype, page, extra, kw)
CASES = [
    (1, 1, [8192], 32, 8, 128, "bf16", 16, {}, {}),
    (1, 1, [8192], 32, 8, 128, "bf16", 256, {}, {}),
    (1, 1, [4097], 32, 8, 128, "bf16", 256, {}, {}),
    (3, 1, [2049, 0, 6000], 32, 8, 128, "bf16", 16, {}, {}),
    (2, 2, [3001, 257], 32, 8, 128, "bf16", 256, {}, {"causal": True}),
    (3, 1, [3000, 1500, 777], 32, 8, 128, "bf16", 16, {"leftpad": True}, {}),  # tiles across pages
    (1, 1, [40000], 32, 8, 128, "bf16", 16, {}, {}),                            # 2500 pages: regs_page_table 1
    (2, 1, [30000, 4097], 32, 4, 128, "bf16", 32, {}, {}),                      # GQA 8
    (3, 4, [2049, 700, 9000], 8, 2, 64, "bf16", 16, {}, {"causal": True}),      # d 64: two row tiles
    (2, 1, [113, 20000], 8, 8, 64, "fp16", 256, {}, {}),
    (2, 1, [3000, 1500], 32, 8, 128, "bf16", 16, {"seqlen_new": 1, "rotary_dim": 128}, {}),
    (2, 4, [900, 250], 8, 4, 128, "bf16", 16, {}, {"causal": True, "window_size": (100, 0), "softcap": 2.5,
                                                   "alibi": True}),
    (2, 1, [5000, 1234], 32, 8, 128, "bf16", 40, {}, {}),                       # not a power of two
]


def _table2(monkeypatch, order, shift):
    monkeypatch.setattr(select, "device_rules", lambda family, *a, **k: [])   # the module's switches, not a GPU's table
    monkeypatch.setattr(fam_mod, "REGS_DEFAULT", 1)
    monkeypatch.setattr(fam_mod, "REGS_BATCH1_HINT", ())
    monkeypatch.setattr(fam_mod, "REGS_HEAD_DIM_DEFAULT", (64, 128))
    monkeypatch.setattr(fam_mod, "REGS_SHAPE_RULES", ())
    monkeypatch.setattr(fam_mod, "REGS_PAGED_TMA_MAX_KEYS", 0)   # small calls stay on the regs kernel
    monkeypatch.setattr(fam_mod, "REGS_PAGE_SHIFT_DEFAULT", shift)
    monkeypatch.setattr(fam_mod, "REGS_ORDER_DEFAULT", order)
    monkeypatch.setattr(fam_mod, "REGS_PAGE_TABLE_DEFAULT", 2)
    decode._drop_gpu_plans()
    monkeypatch.setattr(decode, "_gpu_plans", {})


def _ran(case):
    page, cap = case[7], max(case[2]) + case[8].get("seqlen_new", 0)
    want = 2 if -(-cap // page) <= fam_mod.REGS_PAGE_IDS else 1
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert plans and all(p.config.regs and p.config.regs_page_table == want for p in plans), [p.config.name for p in plans]


@pytest.mark.parametrize("splits", [0, 1, 3], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("shift", [1, 0], ids=lambda n: f"rps{n}")
@pytest.mark.parametrize("order", [0, 1], ids=lambda n: f"ro{n}")
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_page_table2(monkeypatch, case, order, shift, splits):
    _table2(monkeypatch, order, shift)
    check_case(case, splits)
    _ran(case)


@pytest.mark.parametrize("page", [16, 256], ids=lambda n: f"page{n}")
def test_page_table2_cuda_graph(monkeypatch, page):
    """Batch 1 (capacity 8192) and batch 3 (capacity 20000) captured, replayed empty, full, one key short of full and
    at random lengths, each against an eager call."""
    _table2(monkeypatch, 0, 1)
    rng = np.random.default_rng()
    for batch, cap in ((1, 8192), (3, 20000)):
        args = make_case(rng, batch, 1, [cap] + [1000, 17][:batch - 1], 32, 8, 128, "bf16", page=page)
        lengths = [np.zeros(batch, np.int64), np.full(batch, cap), np.full(batch, cap - 1)] + [
            rng.integers(0, cap, size=batch) for _ in range(2)]
        replays_match_eager(dict(args), lengths)
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert plans and all(p.config.regs_page_table == 2 for p in plans), [p.config.name for p in plans]
