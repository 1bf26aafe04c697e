"""Device rules of decode_splitkv for large batches (issue 13, session 30: 4 warps, fixed split counts) on the GPU,
against the float64 reference.

Each test installs one device rule (cuflash.select.device_rules monkeypatched: a rule as a tuned table's
``rules:`` would carry it, matching the case's contiguous call) and clears the plan cache, so the calls go
through flash_attn_with_kvcache as users make them, with REGS_SHAPE_RULES as shipped (the interleaved order and
its 3-block early prefetch from batch 2 and 8k keys). check_call poisons the outputs and compares with the
reference (error at most twice that of plain attention in the same low precision, LSE likewise); each case runs
twice (the fused combine's counters back at 0). Rows: full, one key short of a block, one key, empty, ragged;
and CUDA-graph replays with changing lengths.

    timeout 120 python -m pytest -q tests/test_decode_batch_rules_gpu.py
"""
import pathlib

import numpy as np
import pytest

from cuflash import decode, select
from cuflash.families import decode_splitkv as fam_mod

from test_decode_gpu import check_call, make_case, replays_match_eager
from test_decode_ringfill_gpu import _poison  # noqa: F401  (autouse: outputs poisoned, skip without a GPU)

pytestmark = [pytest.mark.gpu]

# the candidate rules' parameters (RULE_SET): 4 warps at the split rule / fixed splits, 8 warps at fixed splits
RULE_SETS = [{"regs_warps": 4}, {"regs_warps": 4, "splits": 1}, {"regs_warps": 4, "splits": 2},
             {"regs_warps": 4, "splits": 3}, {"splits": 3}, {"splits": 4}, {"splits": 6}]
# (batch, lens): contiguous, 32:8 heads, d 128, bf16, one query row (the rules' shape); capacity = max(lens)
CASES = [(4, [9000, 0, 1, 8193]), (3, [16384, 16383, 5000]), (5, [8192, 8191, 64, 8192, 127])]


def _set_id(s):
    return "_".join(f"{k}{v}" for k, v in s.items())


def _rule(monkeypatch, params):
    rule = select.Rule(family="decode_splitkv", set=dict(params), match={"paged": False, "batch": [2, None]})
    monkeypatch.setattr(select, "device_rules", lambda family, *a, **k: (
        [(rule, pathlib.Path("test_rule.yaml"))] if family.name == "decode_splitkv" else []))
    decode._drop_gpu_plans()
    monkeypatch.setattr(decode, "_gpu_plans", {})


def _ran(params):
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert plans, "no plan"
    for p in plans:
        cfg = p.config
        assert cfg.regs and cfg.warps == params.get("regs_warps", fam_mod.REGS_WARPS), cfg.name
        assert cfg.regs_order == 1 and cfg.regs_prefetch, cfg.name   # REGS_SHAPE_RULES kept under the rule
        if "splits" in params:
            assert cfg.splits == params["splits"], cfg.name


@pytest.mark.parametrize("params", RULE_SETS, ids=_set_id)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}_l{max(c[1])}")
def test_batch_rule(monkeypatch, case, params):
    batch, lens = case
    _rule(monkeypatch, params)
    rng = np.random.default_rng()
    args = make_case(rng, batch, 1, lens, 32, 8, 128, "bf16")
    for _ in range(2):   # the fused combine's counters are back at 0 after a call
        check_call(dict(args, k_cache=args["k_cache"].clone(), v_cache=args["v_cache"].clone()), "bf16",
                   f"{_set_id(params)} b{batch}")
    _ran(params)


@pytest.mark.parametrize("params", [RULE_SETS[0], RULE_SETS[3], RULE_SETS[4]], ids=_set_id)
def test_batch_rule_cuda_graph(monkeypatch, params):
    """Batch 6 (capacity 16384) captured, replayed empty, full, one short and at random lengths."""
    _rule(monkeypatch, params)
    rng = np.random.default_rng()
    args = make_case(rng, 6, 1, [16384] * 6, 32, 8, 128, "bf16")
    lengths = [np.zeros(6, np.int64), np.full(6, 16384), np.full(6, 16383)] + [
        rng.integers(0, 16384, size=6) for _ in range(2)]
    replays_match_eager(dict(args), lengths)
    _ran(params)
