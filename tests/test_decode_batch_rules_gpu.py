"""Device rules of decode_splitkv for large batches (issue 13, session 30: 4 warps, fixed split counts) on the GPU,
against the float64 reference.

Each test installs one device rule (cuflash.select.device_rules monkeypatched: a rule as a tuned table's
``rules:`` would carry it, matching the case's contiguous call) and clears the plan cache, so the calls go
through flash_attn_with_kvcache as users make them, with REGS_SHAPE_RULES as shipped (the interleaved order and
its 3-block early prefetch from batch 2 and 8k keys). check_call poisons the outputs and compares with the
reference (error at most twice that of plain attention in the same low precision, LSE likewise), then calls it
twice more: equal outputs (the fused combine's counters back at 0). Rows: full, one key short of a block, one
key, empty, ragged; and CUDA-graph replays with changing lengths.

    timeout 120 python -m pytest -q tests/test_decode_batch_rules_gpu.py
"""
import pathlib

import numpy as np
import pytest

from cuflash import decode, select
from cuflash.decode import flash_attn_with_kvcache
from cuflash.families import decode_splitkv as fam_mod

from test_decode_gpu import _torch, check_call, make_case, replays_match_eager
from test_decode_ringfill_gpu import _poison  # noqa: F401  (autouse: outputs poisoned, skip without a GPU)

pytestmark = [pytest.mark.gpu]

# the rules' parameters (RULE_SET): the H200 table's two (4 warps at 1 split; 3 splits), then the other
# candidates of session 30's round 2 (decode_batch_rules_sanitize.py runs them all under memcheck)
SHIPPED_SETS = [{"regs_warps": 4, "splits": 1}, {"splits": 3}]
RULE_SETS = SHIPPED_SETS + [{"regs_warps": 4}, {"regs_warps": 4, "splits": 2}, {"regs_warps": 4, "splits": 3},
                            {"splits": 4}, {"splits": 6}]
# (batch, lens, nheads, nheads_kv): contiguous, d 128, bf16, one query row, GQA 4 (the rules' group); capacity =
# max(lens); 8:2 heads keep the float64 reference quick (the kernels' work per (batch, KV head) is the same)
CASES = [(3, [8192, 0, 8191], 8, 2), (4, [9000, 1, 17, 8193], 8, 2), (2, [8200, 4097], 32, 8),
         (3, [4096, 0, 4095], 8, 2)]   # 4k: below REGS_SHAPE_RULES' 8k (no interleave, no early prefetch)


def _set_id(s):
    return "_".join(f"{k}{v}" for k, v in s.items())


def _rule(monkeypatch, params):
    rule = select.Rule(family="decode_splitkv", set=dict(params), match={"paged": False, "batch": [2, None]})
    monkeypatch.setattr(select, "device_rules", lambda family, *a, **k: (
        [(rule, pathlib.Path("test_rule.yaml"))] if family.name == "decode_splitkv" else []))
    decode._drop_gpu_plans()
    monkeypatch.setattr(decode, "_gpu_plans", {})


def _ran(params, capacity=8192):
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert plans, "no plan"
    for p in plans:
        cfg = p.config
        assert cfg.regs and cfg.warps == params.get("regs_warps", fam_mod.REGS_WARPS), cfg.name
        shape_rule = capacity >= 8192   # REGS_SHAPE_RULES (from 8k keys) kept under the rule
        assert (cfg.regs_order == 1 and cfg.regs_prefetch) == shape_rule, cfg.name
        if "splits" in params:
            assert cfg.splits == params["splits"], cfg.name


@pytest.mark.parametrize("params", SHIPPED_SETS, ids=_set_id)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}_l{max(c[1])}_h{c[2]}x{c[3]}")
def test_batch_rule(monkeypatch, case, params):
    """One call against the reference, then a second (the fused combine's counters back at 0) equal to it."""
    batch, lens, h, hk = case
    _rule(monkeypatch, params)
    torch = _torch()
    rng = np.random.default_rng()
    args = make_case(rng, batch, 1, lens, h, hk, 128, "bf16")
    check_call(dict(args, k_cache=args["k_cache"].clone(), v_cache=args["v_cache"].clone()), "bf16",
               f"{_set_id(params)} b{batch}")
    first = flash_attn_with_kvcache(**args)
    again = flash_attn_with_kvcache(**args)
    torch.cuda.synchronize()
    assert torch.equal(first, again), "a second call differs (the split counters not back at 0?)"
    _ran(params, max(lens))


@pytest.mark.parametrize("params", SHIPPED_SETS, ids=_set_id)
def test_batch_rule_cuda_graph(monkeypatch, params):
    """Batch 4 (capacity 16384, 8:2 heads) captured, replayed empty, full, one short and at random lengths."""
    _rule(monkeypatch, params)
    rng = np.random.default_rng()
    args = make_case(rng, 4, 1, [16384] * 4, 8, 2, 128, "bf16")
    lengths = [np.zeros(4, np.int64), np.full(4, 16384), np.full(4, 16383)] + [
        rng.integers(0, 16384, size=4) for _ in range(2)]
    replays_match_eager(dict(args), lengths)
    _ran(params)
