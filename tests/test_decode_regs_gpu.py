"""decode_splitkv's ``regs`` option (decode_splitkv_regs: K/V loaded straight into registers,
Sᵀ = K Qᵀ and Oᵀ += Vᵀ Pᵀ on mma.sync) on the GPU, against the float64 reference.

The heuristic's switch (REGS_DEFAULT) is set (1: plain loads; 2..6, the cache hints, on a few
cases) and the plan cache
cleared, so the calls go through flash_attn_with_kvcache as users make them; check_call compares
with the reference (outputs NaN-poisoned first, error at most twice that of plain attention in
the same low precision, LSE likewise). Per-batch cache_seqlens (0 included, ragged ends), GQA 4,
8 and 1, seqlen_q 1..4 (causal, 16 packed rows: two row tiles), head dims 64 (fp16) and 128,
contiguous and paged (pages 16 and 256, leftpad that crosses pages), append + rotary,
cache_batch_idx, windows, softcap, ALiBi, num_splits 1 / 3 / the heuristic's, CUDA-graph replays
(the fused combine's counters back at 0 after every call).

    timeout 120 python -m pytest -q -x tests/test_decode_regs_gpu.py
"""
import numpy as np
import pytest

from cuflash import decode
from cuflash.families import decode_splitkv as fam_mod

from test_decode_gpu import _torch, check_call, make_case, replays_match_eager
from test_decode_ringfill_gpu import _poison  # noqa: F401  (autouse: outputs poisoned, skip without a GPU)

pytestmark = [pytest.mark.gpu]


def _options(monkeypatch, regs: int):
    monkeypatch.setattr(fam_mod, "REGS_DEFAULT", regs)
    monkeypatch.setattr(fam_mod, "REGS_BATCH1_HINT", ())   # every call on this hint, batch 1 at 8k keys too
    monkeypatch.setattr(fam_mod, "REGS_HEAD_DIM_DEFAULT", (64, 128))
    monkeypatch.setattr(fam_mod, "REGS_SHAPE_RULES", ())   # (test_regs_shape_rules runs them)
    decode._drop_gpu_plans()  # plans made with other settings must not serve these calls
    monkeypatch.setattr(decode, "_gpu_plans", {})


def _ran_regs(regs):
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert plans and all(p.config.regs == regs for p in plans), [p.config.name for p in plans]


# (batch, seqlen_q, lens, nheads, nheads_kv, d, dtype, page, extra, kw)
CASES = [
    (1, 1, [1], 8, 8, 128, "bf16", None, {}, {}),
    (1, 1, [8192], 32, 8, 128, "bf16", None, {}, {}),
    (3, 1, [17, 0, 5000], 32, 8, 128, "bf16", None, {}, {}),
    (2, 1, [40000, 999], 32, 4, 128, "bf16", None, {}, {}),          # GQA 8
    (3, 4, [2049, 700, 9000], 8, 2, 64, "bf16", None, {}, {"causal": True}),    # 16 packed rows: two row tiles (d 64)
    (2, 3, [1500, 64], 16, 16, 128, "bf16", None, {}, {"causal": True}),        # MHA: 3 rows of 8
    (2, 1, [113, 20000], 8, 8, 64, "fp16", None, {}, {}),
    (3, 1, [2049, 0, 6000], 32, 8, 128, "bf16", 16, {}, {}),
    (2, 2, [3001, 257], 32, 8, 128, "bf16", 256, {}, {"causal": True}),
    (3, 1, [3000, 1500, 777], 32, 8, 128, "bf16", 16, {"leftpad": True}, {}),  # tiles across pages
    (2, 1, [3000, 1500], 32, 8, 128, "bf16", None, {"seqlen_new": 1, "rotary_dim": 128}, {}),
    (3, 1, [3000, 1500, 777], 32, 8, 128, "bf16", None, {"batch_idx": True, "leftpad": True}, {}),
    (2, 4, [900, 250], 8, 4, 128, "bf16", None, {"seqlen_new": 2}, {"window_size": (100, 3)}),
    (2, 4, [900, 250], 8, 4, 128, "bf16", None, {}, {"causal": True, "window_size": (100, 0), "softcap": 2.5,
                                                     "alibi": True}),
]


def _ids(c):
    return (f"b{c[0]}_q{c[1]}_l{max(c[2])}_h{c[3]}x{c[4]}_d{c[5]}_{c[6]}_page{c[7] or 0}"
            + "".join(f"_{k}" for k in c[8]) + "".join(f"_{k}" for k in c[9]))


REGS = (1, 2, 3, 4, 5, 6)   # the load hints (decode_precompile.py compiles each case's config under each)


@pytest.mark.parametrize("splits", [0, 1, 3], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_regs_grid(monkeypatch, case, splits):
    """Every case with plain loads (regs 1) at num_splits 0, 1 and 3."""
    _regs_case(monkeypatch, case, 1, splits)


HINT_CASES = [CASES[2], CASES[7]]


@pytest.mark.parametrize("regs", REGS[1:], ids=lambda n: f"regs{n}")
@pytest.mark.parametrize("case", HINT_CASES, ids=_ids)
def test_regs_hints(monkeypatch, case, regs):
    """The other load hints (2..6) on a contiguous and a paged case."""
    _regs_case(monkeypatch, case, regs, 0)


def _regs_case(monkeypatch, case, regs, splits):
    _options(monkeypatch, regs)
    check_case(case, splits)
    _ran_regs(regs)


def check_case(case, splits):
    """One CASES entry against the float64 reference (twice where the fused combine's counters must be
    back at 0 after a call), under whatever switches the caller set."""
    b, sq, lens, h, hk, d, dtype, page, extra, kw = case
    torch = _torch()
    kw = dict(kw)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(b, h, device="cuda", dtype=torch.float32)
    rng = np.random.default_rng()
    args = make_case(rng, b, sq, lens, h, hk, d, dtype, page=page, **extra)
    for _ in range(1 if splits == 1 else 2):   # the fused combine's counters are back at 0 after a call
        check_call(dict(args, k_cache=args["k_cache"].clone(), v_cache=args["v_cache"].clone()), dtype,
                   _ids(case), num_splits=splits, **kw)


@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "page16"])
def test_regs_cuda_graph(monkeypatch, page):
    """A captured call (per-batch cache_seqlens) replayed with new lengths and queries (all rows
    empty first): each replay matches an eager call on the same inputs within bf16 rounding."""
    _options(monkeypatch, 1)
    rng = np.random.default_rng()
    args = make_case(rng, 4, 1, [65536, 1000, 30000, 5], 32, 8, 128, "bf16", page=page)
    cap = 65536
    lengths = [np.zeros(4, np.int64)] + [rng.integers(0, cap, size=4) for _ in range(3)]
    replays_match_eager(dict(args), lengths)
    _ran_regs(1)


PREFETCH_CASES = [(1, 1, [8192], 32, 8, 128, "bf16", None, {}, {}), (3, 1, [17, 0, 5000], 32, 8, 128, "bf16", None, {}, {}),
                  (2, 2, [4096, 1000], 32, 8, 128, "bf16", None, {}, {"causal": True})]


@pytest.mark.parametrize("case", PREFETCH_CASES, ids=_ids)
def test_regs_prefetch(monkeypatch, case):
    """regs_prefetch (the first block's rows of a full row into L1 before the lengths arrive): full
    and partial rows, an empty row, causal at seqlen_q 2."""
    monkeypatch.setattr(fam_mod, "REGS_PREFETCH_DEFAULT", True)
    _regs_case(monkeypatch, case, 1, 0)
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert all(p.config.regs_prefetch for p in plans), [p.config.name for p in plans]


AHEAD_CASES = PREFETCH_CASES + [(3, 1, [2049, 0, 6000], 32, 8, 128, "bf16", 16, {}, {}),
                                (2, 1, [3000, 1500], 32, 8, 128, "bf16", None, {"batch_idx": True, "leftpad": True}, {}),
                                CASES[12]]   # a window cutting the row's bottom (regs_order's first block)
# (regs, regs_ahead, regs_ahead_l1, regs_order): the prefetches ahead into L2 / L1, the evict-last
# hint (7), the interleaved block order (1) and its first block loaded before the lengths (2)
AHEAD_OPTIONS = [(6, 2, False, 0), (6, 3, True, 0), (7, 4, False, 0), (6, 0, False, 1), (6, 2, False, 2),
                 (7, 0, False, 2)]


@pytest.mark.parametrize("splits", [0, 3], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("opt", AHEAD_OPTIONS, ids=lambda o: f"rg{o[0]}_ra{o[1]}{'l1' if o[2] else ''}_ro{o[3]}")
@pytest.mark.parametrize("case", AHEAD_CASES, ids=_ids)
def test_regs_ahead(monkeypatch, case, opt, splits):
    """regs_ahead (the block kAhead iterations ahead prefetched into L2 / L1), load hint 7 (L2
    evict-last) and regs_order 1 / 2: full, ragged and empty rows, causal at seqlen_q 2, paged (no
    prefetch, no early loads), a cache row index with leftpad, a window with appended keys."""
    regs, ahead, l1, order = opt
    monkeypatch.setattr(fam_mod, "REGS_BATCH1", False)   # the batch-1 rule's regs_order 2 (session 28) would replace it
    monkeypatch.setattr(fam_mod, "REGS_AHEAD_DEFAULT", ahead)
    monkeypatch.setattr(fam_mod, "REGS_AHEAD_L1_DEFAULT", l1)
    monkeypatch.setattr(fam_mod, "REGS_ORDER_DEFAULT", order)
    _regs_case(monkeypatch, case, regs, splits)
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert all((p.config.regs_ahead, p.config.regs_ahead_l1, p.config.regs_order) == (ahead, l1, order)
               for p in plans), [p.config.name for p in plans]


@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "page16"])
def test_regs_ahead_cuda_graph(monkeypatch, page):
    """As test_regs_cuda_graph with regs_ahead 3, the evict-last hint (7) and regs_order 2 (the
    early loads kept or not as the replays' lengths change)."""
    monkeypatch.setattr(fam_mod, "REGS_AHEAD_DEFAULT", 3)
    monkeypatch.setattr(fam_mod, "REGS_ORDER_DEFAULT", 2)
    _options(monkeypatch, 7)
    rng = np.random.default_rng()
    args = make_case(rng, 4, 1, [65536, 1000, 30000, 5], 32, 8, 128, "bf16", page=page)
    lengths = [np.zeros(4, np.int64)] + [rng.integers(0, 65536, size=4) for _ in range(3)]
    replays_match_eager(dict(args), lengths)
    _ran_regs(7)


# REGS_BATCH1_RULES' options (fields of the regs config at batch 1, contiguous), each on full and
# ragged rows, at the heuristic's split count and 3, and under CUDA-graph replays whose lengths
# change (the early prefetch / loads assume a full row: kept or redone)
BATCH1_OPTIONS = [{"regs_prefetch": True}, {"regs_prefetch": True, "regs_prefetch_blocks": 2},
                  {"regs_prefetch": True, "regs_prefetch_blocks": 3},
                  {"regs_prefetch": True, "warps": 4}, {"regs_order": 2}, {"regs": 1, "regs_prefetch": True},
                  {"regs_order": 1, "regs_prefetch": True, "regs_prefetch_blocks": 3},   # the interleave's first blocks
                  {"regs_order": 2, "regs_prefetch": True, "regs_prefetch_blocks": 3}]
BATCH1_CASES = [(1, 1, [8192], 32, 8, 128, "bf16", None, {}, {}), (1, 1, [3001], 32, 8, 128, "bf16", None, {}, {}),
                (1, 2, [4096], 32, 8, 128, "bf16", None, {}, {"causal": True})]


def _batch1(monkeypatch, fields):
    monkeypatch.setattr(fam_mod, "REGS_BATCH1_RULES", ((1 << 30, dict(fields)),))


def _b1_id(f):
    return "_".join(f"{k}{int(v)}" for k, v in f.items())


@pytest.mark.parametrize("splits", [0, 3], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("fields", BATCH1_OPTIONS, ids=_b1_id)
@pytest.mark.parametrize("case", BATCH1_CASES, ids=_ids)
def test_regs_batch1_rules(monkeypatch, case, fields, splits):
    _batch1(monkeypatch, fields)
    _regs_case(monkeypatch, case, fields.get("regs", 6), splits)
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert all(getattr(p.config, k) == v for p in plans for k, v in fields.items()), [p.config.name for p in plans]


@pytest.mark.parametrize("fields", BATCH1_OPTIONS, ids=_b1_id)
def test_regs_batch1_cuda_graph(monkeypatch, fields):
    """One batch row of capacity 65536 captured, replayed empty, full, and at lengths that end
    inside the early-prefetched / early-loaded blocks or before them."""
    _batch1(monkeypatch, fields)
    _options(monkeypatch, 6)
    rng = np.random.default_rng()
    args = make_case(rng, 1, 1, [65536], 32, 8, 128, "bf16")
    lengths = [np.zeros(1, np.int64), np.array([65536]), np.array([65535]), np.array([1000]),
               rng.integers(0, 65536, size=1)]
    replays_match_eager(dict(args), lengths)
    _ran_regs(fields.get("regs", 6))


# regs_cluster (decode_splitkv_regs' kCluster): the splits of a group as one cluster of 2..16 CTAs,
# merged through distributed shared memory. REGS_CLUSTER_DEFAULT puts every regs call of these cases
# on it (any batch, paged too): full, ragged and empty rows, GQA 4 / 8 / 1, two row tiles (d 64,
# 16 packed rows), fp16, pages 256 and 16 (leftpad across pages), append + rotary, cache_batch_idx,
# window + softcap + ALiBi. With num_splits given (3) the call runs the plain split kernel.
CLUSTER_CASES = [CASES[1], CASES[2], CASES[3], CASES[4], CASES[5], CASES[6], CASES[8], CASES[9], CASES[10],
                 CASES[11], CASES[13]]
CLUSTERS = (16, 8, 4, 2)


def _cluster(monkeypatch, cluster):
    monkeypatch.setattr(fam_mod, "REGS_CLUSTER_DEFAULT", cluster)


@pytest.mark.parametrize("cluster", CLUSTERS, ids=lambda n: f"cl{n}")
@pytest.mark.parametrize("case", CLUSTER_CASES, ids=_ids)
def test_regs_cluster(monkeypatch, case, cluster):
    _cluster(monkeypatch, cluster)
    _regs_case(monkeypatch, case, 6, 0)
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert all(p.config.regs_cluster == cluster and p.config.splits == cluster and not p.config.fused_combine
               for p in plans), [p.config.name for p in plans]


@pytest.mark.parametrize("case", CLUSTER_CASES[:3], ids=_ids)
def test_regs_cluster_num_splits(monkeypatch, case):
    """num_splits=3 with the cluster rule on: the plain split kernel at 3 splits."""
    _cluster(monkeypatch, 16)
    _regs_case(monkeypatch, case, 6, 3)
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert all(p.config.regs_cluster == 0 and p.config.splits == 3 for p in plans), [p.config.name for p in plans]


@pytest.mark.parametrize("cluster", (16, 8), ids=lambda n: f"cl{n}")
@pytest.mark.parametrize("batch", (1, 4), ids=lambda n: f"b{n}")
def test_regs_cluster_cuda_graph(monkeypatch, cluster, batch):
    """A captured call replayed empty, full and at other lengths (batch 1, capacity 65536; batch 4:
    random lengths per row)."""
    _cluster(monkeypatch, cluster)
    _options(monkeypatch, 6)
    rng = np.random.default_rng()
    args = make_case(rng, batch, 1, [65536] * batch, 32, 8, 128, "bf16")
    lengths = [np.zeros(batch, np.int64), np.full(batch, 65536), np.full(batch, 1000)] + [
        rng.integers(0, 65536, size=batch) for _ in range(2)]
    replays_match_eager(dict(args), lengths)
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert plans and all(p.config.regs_cluster == cluster for p in plans), [p.config.name for p in plans]


# regs_page_table (decode_splitkv_regs' kPageTable): the page ids staged in shared memory, a table
# row of at most REGS_PAGE_IDS pages whole, a longer one's split slice (ids past it read from global
# memory); with regs_prefetch, the rows of the blocks after the first two into L1. Pages 16 / 32 /
# 256, full, ragged and empty rows, leftpad across pages, rows wider than REGS_PAGE_IDS (40000 keys
# of page 16: 2500 pages, the split's slice; 1 split: its top 2048 pages and the rest from global
# memory), GQA 4 / 8 / 1, two row tiles (d 64), fp16, append + rotary, a window with softcap and ALiBi.
PAGE_TABLE_CASES = [
    (3, 1, [2049, 0, 6000], 32, 8, 128, "bf16", 16, {}, {}),
    (2, 2, [3001, 257], 32, 8, 128, "bf16", 256, {}, {"causal": True}),
    (3, 1, [3000, 1500, 777], 32, 8, 128, "bf16", 16, {"leftpad": True}, {}),   # tiles across pages
    (1, 1, [40000], 32, 8, 128, "bf16", 16, {}, {}),                            # 2500 pages: the slice
    (2, 1, [40000, 4097], 32, 4, 128, "bf16", 32, {}, {}),                      # GQA 8
    (3, 4, [2049, 700, 9000], 8, 2, 64, "bf16", 16, {}, {"causal": True}),      # two row tiles (d 64)
    (2, 3, [1500, 64], 16, 16, 128, "bf16", 32, {}, {"causal": True}),          # MHA
    (2, 1, [113, 20000], 8, 8, 64, "fp16", 256, {}, {}),
    (2, 1, [3000, 1500], 32, 8, 128, "bf16", 16, {"seqlen_new": 1, "rotary_dim": 128}, {}),
    (2, 4, [900, 250], 8, 4, 128, "bf16", 16, {}, {"causal": True, "window_size": (100, 0), "softcap": 2.5,
                                                   "alibi": True}),
]
PAGE_TABLE_B1_CASES = [(1, 1, [8192], 32, 8, 128, "bf16", 16, {}, {}), (1, 1, [40000], 32, 8, 128, "bf16", 16, {}, {}),
                       (1, 2, [4096], 32, 8, 128, "bf16", 256, {}, {"causal": True})]


def _page_table(monkeypatch, warps=8, prefetch=0):
    """Every paged regs call on the page table (REGS_WARPS warps; at batch 1 with regs_prefetch of
    ``prefetch`` blocks where it is not 0)."""
    monkeypatch.setattr(fam_mod, "REGS_PAGE_TABLE_DEFAULT", 1)
    monkeypatch.setattr(fam_mod, "REGS_PAGED_TMA_MAX_KEYS", 0)   # small calls stay on the regs kernel
    monkeypatch.setattr(fam_mod, "REGS_WARPS", warps)
    monkeypatch.setattr(fam_mod, "REGS_PAGED_BATCH1_PREFETCH", ((1 << 30, prefetch),))


def _ran_page_table(warps=8, prefetch=0):
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert plans and all(p.config.regs_page_table == 1 and p.config.warps == warps
                         and p.config.regs_prefetch == bool(prefetch)
                         and p.config.regs_prefetch_blocks == (prefetch or 1) for p in plans), [p.config.name for p in plans]


@pytest.mark.parametrize("splits", [0, 1, 3], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("case", PAGE_TABLE_CASES, ids=_ids)
def test_regs_page_table(monkeypatch, case, splits):
    _page_table(monkeypatch)
    _regs_case(monkeypatch, case, 1, splits)
    _ran_page_table()


@pytest.mark.parametrize("case", PAGE_TABLE_CASES[:5], ids=_ids)
def test_regs_page_table_4_warps(monkeypatch, case):
    """4 warps (16 staged ids per thread)."""
    _page_table(monkeypatch, warps=4)
    _regs_case(monkeypatch, case, 1, 0)
    _ran_page_table(warps=4)


@pytest.mark.parametrize("prefetch", [1, 3], ids=lambda n: f"pf{n}")
@pytest.mark.parametrize("case", PAGE_TABLE_B1_CASES, ids=_ids)
def test_regs_page_table_prefetch(monkeypatch, case, prefetch):
    """Batch 1 with the rows of the blocks after the first two prefetched into L1."""
    _page_table(monkeypatch, prefetch=prefetch)
    _regs_case(monkeypatch, case, 1, 0)
    _ran_page_table(prefetch=prefetch)


@pytest.mark.parametrize("batch,page,prefetch", [(4, 16, 0), (4, 256, 0), (1, 16, 3)],
                         ids=["b4_page16", "b4_page256", "b1_page16_pf3"])
def test_regs_page_table_cuda_graph(monkeypatch, batch, page, prefetch):
    """A captured paged call (capacity 65536: page 16 is 4096 pages, the split slice; page 256 the
    whole row) replayed empty, full and at other lengths, each against an eager call."""
    _options(monkeypatch, 1)
    _page_table(monkeypatch, prefetch=prefetch)
    rng = np.random.default_rng()
    args = make_case(rng, batch, 1, [65536] + [1000, 30000, 5][:batch - 1], 32, 8, 128, "bf16", page=page)
    lengths = [np.zeros(batch, np.int64), np.full(batch, 65536), np.full(batch, 65535)] + [
        rng.integers(0, 65536, size=batch) for _ in range(3)]
    replays_match_eager(dict(args), lengths)
    _ran_page_table(prefetch=prefetch)


# REGS_SHAPE_RULES and REGS_BATCH1_RULES as shipped (the heuristic's own choice): contiguous batch 8 and
# batch 1 above 8k keys (the interleaved order, its first 3 blocks prefetched before the lengths arrive),
# paged batch 8 (the page table and the prefetch of 3 blocks) and batch 1 (the table; the prefetch above 8k
# keys; a 40000-key row of page 16 is wider than the staged ids): full, ragged and empty rows.
# (case, page table, regs_order) per case
SHAPE_CASES = [
    ((8, 1, [9000, 0, 1, 4097, 8192, 300, 9000, 128], 32, 8, 128, "bf16", None, {}, {}), 0, 1),
    ((8, 1, [9000, 0, 1, 4097, 8192, 300, 9000, 128], 32, 8, 128, "bf16", 16, {}, {}), 1, 0),
    ((8, 1, [10000, 17, 5000, 10000, 0, 333, 9999, 4096], 32, 8, 128, "bf16", 256, {}, {}), 1, 0),
    ((1, 1, [12000], 32, 8, 128, "bf16", None, {}, {}), 0, 1),
    ((1, 1, [8192], 32, 8, 128, "bf16", 16, {}, {}), 1, 0),
    ((1, 1, [12000], 32, 8, 128, "bf16", 256, {}, {}), 1, 0),
    ((1, 1, [40000], 32, 8, 128, "bf16", 16, {}, {}), 1, 0),
]


def _shipped(monkeypatch):
    decode._drop_gpu_plans()
    monkeypatch.setattr(decode, "_gpu_plans", {})


@pytest.mark.parametrize("splits", [0, 3], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("shape", SHAPE_CASES, ids=lambda c: _ids(c[0]))
def test_regs_shape_rules(monkeypatch, shape, splits):
    case, table, order = shape
    b, sq, lens, h, hk, d, dtype, page, extra, kw = case
    _shipped(monkeypatch)
    rng = np.random.default_rng()
    args = make_case(rng, b, sq, lens, h, hk, d, dtype, page=page, **extra)
    for _ in range(2):
        check_call(dict(args, k_cache=args["k_cache"].clone(), v_cache=args["v_cache"].clone()), dtype,
                   _ids(case), num_splits=splits, **kw)
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert plans and all(p.config.regs and p.config.regs_page_table == table and p.config.regs_order == order
                         for p in plans), [p.config.name for p in plans]


@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "page16"])
def test_regs_shape_rules_cuda_graph(monkeypatch, page):
    """Batch 8 (capacity 16384) captured and replayed empty, full and at random lengths."""
    _shipped(monkeypatch)
    rng = np.random.default_rng()
    args = make_case(rng, 8, 1, [16384] * 8, 32, 8, 128, "bf16", page=page)
    lengths = [np.zeros(8, np.int64), np.full(8, 16384)] + [rng.integers(0, 16384, size=8) for _ in range(2)]
    replays_match_eager(dict(args), lengths)
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert plans and all(p.config.regs_prefetch for p in plans), [p.config.name for p in plans]
