"""decode_splitkv_regs' staged ring (``regs_staged``, kStaged) on the GPU, against the float64 reference.

REGS_STAGED_DEFAULT puts every regs call (plain loads, regs 1) on the staged loop: each warp's first two K/V
blocks load into its register sets, the next regs_staged blocks by cp.async into its own shared-memory ring,
all at the kernel's start, and each later block refills the slot the previous one left. Paged caches run the
plain loop with the same config (their cases check that fallback). Checked as test_decode_gpu.check_call does
(outputs NaN-poisoned, error at most twice that of plain attention in the same precision):
  * odd contexts (1, 17, 255, 257, 8191, 8192, 8193 keys), lengths varying per batch row (0 included), GQA
    ratios 1 / 4 / 8, seqlen_q 1..4 (two row tiles at d 64), append + rotary, cache_batch_idx + leftpad, a
    window with softcap and ALiBi, pages 16 and 256, at num_splits 0 / 1 / 3, 4 and 8 warps;
  * ring depths 1..4 and the separate combine kernel, plain and with its early partial-O loads (early_merge), with
    and without pdl;
  * CUDA-graph replays with changing cache_seqlens (the ring's blocks follow each replay's lengths);
  * REGS_STAGED_RULES: the cuDNN-shaped batch-1 config (4 warps, 32 splits at 1 x 8k) as users call it.

    timeout 300 python -m pytest -q -x tests/test_decode_staged_gpu.py
"""
import numpy as np
import pytest

from cuflash import decode
from cuflash.families import decode_splitkv as fam_mod

from test_decode_gpu import make_case, replays_match_eager
from test_decode_regs_gpu import _ids, _options, check_case
from test_decode_ringfill_gpu import _poison  # noqa: F401  (autouse: outputs poisoned, skip without a GPU)

pytestmark = [pytest.mark.gpu]

# (batch, seqlen_q, lens, nheads, nheads_kv, d, dtype, page, extra, kw)
CASES = [
    (1, 1, [1], 32, 8, 128, "bf16", None, {}, {}),
    (1, 1, [17], 32, 8, 128, "bf16", None, {}, {}),
    (1, 1, [255], 32, 8, 128, "bf16", None, {}, {}),
    (1, 1, [257], 32, 8, 128, "bf16", None, {}, {}),
    (1, 1, [8191], 32, 8, 128, "bf16", None, {}, {}),
    (1, 1, [8192], 32, 8, 128, "bf16", None, {}, {}),
    (1, 1, [8193], 32, 8, 128, "bf16", None, {}, {}),
    (3, 1, [17, 0, 5000], 32, 8, 128, "bf16", None, {}, {}),
    (2, 1, [40000, 999], 32, 4, 128, "bf16", None, {}, {}),                      # GQA 8
    (2, 3, [1500, 64], 16, 16, 128, "bf16", None, {}, {"causal": True}),         # MHA, 3 query rows
    (3, 4, [2049, 700, 9000], 8, 2, 64, "bf16", None, {}, {"causal": True}),     # 16 packed rows: two row tiles
    (2, 2, [113, 20000], 8, 8, 64, "fp16", None, {}, {}),
    (2, 1, [3000, 1500], 32, 8, 128, "bf16", None, {"seqlen_new": 1, "rotary_dim": 128}, {}),
    (3, 1, [3000, 1500, 777], 32, 8, 128, "bf16", None, {"batch_idx": True, "leftpad": True}, {}),
    (2, 4, [900, 250], 8, 4, 128, "bf16", None, {}, {"causal": True, "window_size": (100, 0), "softcap": 2.5,
                                                     "alibi": True}),
    (3, 1, [2049, 0, 6000], 32, 8, 128, "bf16", 16, {}, {}),                     # paged: the plain loop
    (2, 2, [3001, 257], 32, 8, 128, "bf16", 256, {}, {"causal": True}),
]
PAGED = {15, 16}


def _no_spec(monkeypatch):
    """REGS_BATCH1_RULES' 8k entry without regs_order 2 / regs_spec (session 28), which the staged ring excludes."""
    first = {k: v for k, v in fam_mod.REGS_BATCH1_RULES[0][1].items() if k not in ("regs_order", "regs_spec")}
    monkeypatch.setattr(fam_mod, "REGS_BATCH1_RULES",
                        ((fam_mod.REGS_BATCH1_RULES[0][0], first),) + fam_mod.REGS_BATCH1_RULES[1:])


def _staged(monkeypatch, staged: int, warps: int = 4, fused: bool = True):
    _no_spec(monkeypatch)
    _options(monkeypatch, 1)
    monkeypatch.setattr(fam_mod, "REGS_STAGED_DEFAULT", staged)
    monkeypatch.setattr(fam_mod, "REGS_STAGED_RULES", ())
    monkeypatch.setattr(fam_mod, "REGS_WARPS", warps)
    if not fused:
        monkeypatch.setattr(fam_mod, "FUSED_COMBINE_DEFAULT", False)


def _ran_staged(staged: int, warps: int):
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert plans and all(p.config.regs_staged == staged and p.config.warps == warps for p in plans), \
        [p.config.name for p in plans]


@pytest.mark.parametrize("splits", [0, 1, 3], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_staged_grid(monkeypatch, case, splits):
    """Every case at ring depth 2 with 4 warps (the batch-1 rule's shape) at num_splits 0, 1 and 3."""
    _staged(monkeypatch, 2, 4)
    check_case(case, splits)
    _ran_staged(2, 4)


DEPTH_CASES = [CASES[i] for i in (4, 7, 10, 12, 15)]


DEPTHS = [(1, 4), (3, 4), (4, 4), (2, 8), (3, 8)]   # (ring depth, warps): 8 warps x 4 slots would need 256 KB


@pytest.mark.parametrize("staged,warps", DEPTHS, ids=lambda x: str(x))
@pytest.mark.parametrize("case", DEPTH_CASES, ids=_ids)
def test_staged_depths(monkeypatch, case, staged, warps):
    """Ring depths 1..4 at 4 and 8 warps, 3 splits (a split of several blocks: slots refilled)."""
    _staged(monkeypatch, staged, warps)
    check_case(case, 3)
    _ran_staged(staged, warps)


@pytest.mark.parametrize("case", [CASES[i] for i in (5, 7, 13)], ids=_ids)
def test_staged_separate_combine(monkeypatch, case):
    """num_splits 0 and 3 without the fused combine: decode_combine after the staged kernel."""
    _staged(monkeypatch, 2, 4, fused=False)
    check_case(case, 0)
    check_case(case, 3)
    _ran_staged(2, 4)


SEPARATE = {"warps": 4, "regs_staged": 2, "fused_combine": False, "light_fence": False}


@pytest.mark.parametrize("pdl", [0, 1], ids=lambda n: f"pdl{n}")
@pytest.mark.parametrize("case", [CASES[i] for i in (0, 5, 7, 8, 10, 12)], ids=_ids)
def test_staged_early_combine(monkeypatch, case, pdl):
    """The separate combine with its first partial-O loads before the LSE loads (the regs kernel's early_merge:
    decode_combine's kEarly), without and with pdl, at num_splits 0 (32 at 1 x 8k: two batches of 16), 3 and 40
    (past one batch of 16, splits without keys)."""
    _no_spec(monkeypatch)
    _options(monkeypatch, 1)
    if pdl:
        import test_decode_pdl_gpu

        test_decode_pdl_gpu._pdl(monkeypatch, 0)
    monkeypatch.setattr(fam_mod, "REGS_STAGED_RULES", ((1 << 20, 1 << 30, dict(SEPARATE, early_merge=True, pdl=pdl)),))
    for splits in (0, 3, 40):
        check_case(case, splits)
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert plans and all(p.config.early_merge and p.config.pdl == pdl and not p.config.fused_combine for p in plans)


@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "page16"])
@pytest.mark.parametrize("staged", [1, 2], ids=lambda n: f"rst{n}")
def test_staged_cuda_graph(monkeypatch, page, staged):
    """A captured call (per-batch cache_seqlens) replayed with new lengths and queries (all rows empty
    first, then full, ragged): each replay matches an eager call on the same inputs within bf16 rounding."""
    _staged(monkeypatch, staged, 4)
    rng = np.random.default_rng()
    args = make_case(rng, 3, 1, [16384, 1000, 5], 32, 8, 128, "bf16", page=page)
    lengths = [np.zeros(3, np.int64), np.array([16384, 16384, 16384]), np.array([8193, 255, 1])]
    lengths += [rng.integers(0, 16384, size=3) for _ in range(2)]
    replays_match_eager(dict(args), lengths)
    _ran_staged(staged, 4)


@pytest.mark.parametrize("case", [(1, 1, [8192], 32, 8, 128, "bf16", None, {}, {}),
                                  (1, 1, [4096], 32, 8, 128, "bf16", None, {}, {}),
                                  (1, 1, [8000], 32, 8, 128, "bf16", None, {"seqlen_new": 1, "rotary_dim": 64}, {})],
                         ids=_ids)
def test_staged_rule(monkeypatch, case):
    """REGS_STAGED_RULES' batch-1 entry as users call it (num_splits 0): 4 warps, ring depth 2, and the
    co-resident split rule's count (32 at 8 KV heads on 132 SMs; the call's own SM count here)."""
    _no_spec(monkeypatch)
    monkeypatch.setattr(fam_mod, "REGS_STAGED_RULES", ((1, 8192, {"warps": 4, "regs_staged": 2}),))
    decode._drop_gpu_plans()
    monkeypatch.setattr(decode, "_gpu_plans", {})
    check_case(case, 0)
    _ran_staged(2, 4)


# REGS_BATCH1_RULES' first entry as shipped (session 27): one batch row of at most 8192 keys, contiguous, runs the
# regs kernel with the separate combine, launched as a programmatic dependent, its first partial-O loads early
# (session 28: also regs_order 2 with kSpec, regs_spec 1; test_decode_spec_gpu.py)
B1_CASES = [(1, 1, [n], 32, 8, 128, "bf16", None, {}, {}) for n in (1, 17, 255, 257, 4096, 8191, 8192)] + [
    (1, 1, [8000], 32, 4, 128, "bf16", None, {}, {}),                                     # GQA 8
    (1, 3, [5000], 16, 16, 128, "bf16", None, {}, {"causal": True}),                      # MHA, 3 query rows
    (1, 4, [3001], 16, 8, 128, "bf16", None, {}, {"causal": True}),                       # GQA 2, 4 query rows
    (1, 2, [7000], 32, 8, 128, "bf16", None, {"seqlen_new": 2, "rotary_dim": 128}, {"causal": True}),
    (1, 1, [6000], 8, 8, 128, "fp16", None, {"leftpad": True}, {"window_size": (1000, 0), "softcap": 3.0}),
]


def _shipped(monkeypatch):
    torch = __import__("test_decode_gpu")._torch()
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the regs kernel and pdl: sm_90")
    decode._drop_gpu_plans()
    monkeypatch.setattr(decode, "_gpu_plans", {})


def _ran_shipped():
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert plans and all(p.config.regs and not p.config.fused_combine and p.config.early_merge and p.config.pdl == 1
                         for p in plans), [p.config.name for p in plans]


@pytest.mark.parametrize("splits", [0, 1, 3], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("case", B1_CASES, ids=_ids)
def test_batch1_rule(monkeypatch, case, splits):
    _shipped(monkeypatch)
    check_case(case, splits)
    _ran_shipped()


def test_batch1_rule_cuda_graph(monkeypatch):
    """The shipped batch-1 config captured (capacity 8192) and replayed with new lengths: empty, full, ragged."""
    _shipped(monkeypatch)
    rng = np.random.default_rng()
    args = make_case(rng, 1, 1, [8192], 32, 8, 128, "bf16")
    lengths = [np.zeros(1, np.int64), np.array([8192]), np.array([1]), np.array([257])] + [
        rng.integers(0, 8192, size=1) for _ in range(2)]
    replays_match_eager(dict(args), lengths)
    _ran_shipped()


# REGS_BATCH1_PAGED_RULES (session 27, lead): the same for one batch row of at most 8192 keys in pages of 16 / 256
# (the page table and its prefetch from the paged rules)
B1_PAGED_CASES = [(1, 1, [n], 32, 8, 128, "bf16", page, {}, {}) for n in (1, 255, 4097, 8192) for page in (16, 256)] + [
    (1, 2, [7000], 32, 8, 128, "bf16", 16, {"seqlen_new": 2, "rotary_dim": 128}, {"causal": True}),
    (1, 1, [6000], 8, 8, 128, "fp16", 256, {"leftpad": True}, {"window_size": (1000, 0), "softcap": 3.0}),
]


@pytest.mark.parametrize("splits", [0, 3], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("case", B1_PAGED_CASES, ids=_ids)
def test_batch1_paged_rule(monkeypatch, case, splits):
    _shipped(monkeypatch)
    check_case(case, splits)
    _ran_shipped()
    if __import__("test_decode_gpu")._torch().cuda.get_device_name() == "NVIDIA H200":   # its table's batch-1 rule
        measured = case[1] == 1 and case[3:7] == (32, 8, 128, "bf16")   # the class it was timed on, and only that
        tables = [e.plan.config.regs_page_table for e in decode._gpu_plans.values() if e.plan is not None]
        assert tables and all((t == 2) == measured for t in tables), (case, tables)
