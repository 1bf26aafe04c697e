"""decode_splitkv_regs' kSpec (``regs_spec``, with regs_order 2) on the GPU, against the float64 reference.

regs_order 2 loads the split's first block (block ``split`` of the interleaved order) before the row's length is
known; kSpec issues those loads and Q's before cache_seqlens is read (an ordered load after them). A split whose
range turns out not to start at that block, or a row shorter than it, must not use them; the early block is
clamped to the cache's rows (capacity), never out of bounds. Checked as test_decode_gpu.check_call does (outputs
NaN-poisoned, error at most twice that of plain attention in the same precision):
  * every regs call of regs_order 2 with kSpec 1 and 2 (REGS_ORDER_DEFAULT 2, REGS_SPEC_DEFAULT): odd contexts (1, 17,
    255, 257, 8191, 8192, 8193 keys), lengths varying per batch row (0 included), GQA 1 / 4 / 8, seqlen_q 1..4,
    append + rotary, cache_batch_idx + leftpad and a left window (no early loads there), pages 16 and 256, at
    num_splits 0 / 1 / 3 / 40;
  * the batch-1 rule as shipped (REGS_BATCH1_RULES' 8k entry: separate combine, early_merge, pdl 1, regs_order 2,
    kSpec 1), set explicitly here and for paged rows too (no early loads there);
  * CUDA-graph replays with changing cache_seqlens (the early block used or dropped per replay).

    timeout 300 python -m pytest -q -x tests/test_decode_spec_gpu.py
"""
import numpy as np
import pytest

from cuflash import decode
from cuflash.families import decode_splitkv as fam_mod

from test_decode_gpu import make_case, replays_match_eager
from test_decode_regs_gpu import _ids, _options, check_case
from test_decode_ringfill_gpu import _poison  # noqa: F401  (autouse: outputs poisoned, skip without a GPU)
from test_decode_staged_gpu import B1_CASES, B1_PAGED_CASES, CASES

pytestmark = [pytest.mark.gpu]

SPEC_RULE = {"fused_combine": False, "light_fence": False, "early_merge": True, "pdl": 1, "regs_order": 2,
             "regs_spec": 1}   # REGS_BATCH1_RULES' 8k entry as shipped (session 28)


def _sm90():
    torch = __import__("test_decode_gpu")._torch()
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("regs_spec with pdl: sm_90")


def _spec_everywhere(monkeypatch, spec=1):
    _options(monkeypatch, 1)
    monkeypatch.setattr(fam_mod, "REGS_ORDER_DEFAULT", 2)
    monkeypatch.setattr(fam_mod, "REGS_SPEC_DEFAULT", spec)
    monkeypatch.setattr(fam_mod, "REGS_BATCH1", False)   # no batch-1 rule replaces regs_order


def _spec_rule(monkeypatch):
    _sm90()
    monkeypatch.setattr(fam_mod, "REGS_BATCH1_RULES", ((8192, SPEC_RULE),) + fam_mod.REGS_BATCH1_RULES[1:])
    monkeypatch.setattr(fam_mod, "REGS_BATCH1_PAGED_RULES", ((8192, SPEC_RULE),))
    decode._drop_gpu_plans()
    monkeypatch.setattr(decode, "_gpu_plans", {})


def _ran_spec(rule: bool = False, spec: int = 1):
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert plans and all(p.config.regs and p.config.regs_order == 2 and p.config.regs_spec == spec for p in plans), \
        [p.config.name for p in plans]
    if rule:
        assert all(p.config.pdl == 1 and p.config.early_merge and not p.config.fused_combine for p in plans)


@pytest.mark.parametrize("spec", [1, 2], ids=lambda n: f"rsp{n}")
@pytest.mark.parametrize("splits", [0, 1, 3, 40], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_spec_grid(monkeypatch, case, splits, spec):
    _spec_everywhere(monkeypatch, spec)
    check_case(case, splits)
    _ran_spec(spec=spec)


@pytest.mark.parametrize("splits", [0, 3], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("case", B1_CASES + B1_PAGED_CASES, ids=_ids)
def test_spec_batch1_rule(monkeypatch, case, splits):
    _spec_rule(monkeypatch)
    check_case(case, splits)
    _ran_spec(rule=True)


@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "page16"])
def test_spec_cuda_graph(monkeypatch, page):
    """The batch-1 rule with kSpec captured (capacity 8192) and replayed with new lengths: empty, full, one key,
    a block's worth and ragged ones (a split's early block kept in some replays, dropped in others)."""
    _spec_rule(monkeypatch)
    rng = np.random.default_rng()
    args = make_case(rng, 1, 1, [8192], 32, 8, 128, "bf16", page=page)
    lengths = [np.zeros(1, np.int64), np.array([8192]), np.array([1]), np.array([257]), np.array([2047])] + [
        rng.integers(0, 8192, size=1) for _ in range(2)]
    replays_match_eager(dict(args), lengths)
    _ran_spec(rule=True)


def test_spec_cuda_graph_batch3(monkeypatch):
    """Every call on kSpec (3 rows, 16k capacity), replayed with new lengths."""
    _spec_everywhere(monkeypatch)
    rng = np.random.default_rng()
    args = make_case(rng, 3, 1, [16384, 1000, 5], 32, 8, 128, "bf16")
    lengths = [np.zeros(3, np.int64), np.array([16384, 16384, 16384]), np.array([8193, 255, 1])]
    lengths += [rng.integers(0, 16384, size=3) for _ in range(2)]
    replays_match_eager(dict(args), lengths)
    _ran_spec()
