"""REGS_CLUSTER_PAIRS on the GPU (session 27, dec19): calls whose split rule gives exactly 2 splits at
batch >= 2 (batch x KV heads = 64 groups on a 132-SM H100) run the regs kernel's 2 splits as one cluster
of 2 CTAs merged through distributed shared memory. Every call goes through flash_attn_with_kvcache
with the shipped heuristic and is compared with the float64 reference (test_decode_gpu.check_call:
outputs NaN-poisoned first, error at most twice plain low-precision attention's, LSE likewise):
ragged per-batch cache_seqlens (0, 1, odd, block edges), GQA 1 / 4 / 8, seqlen_q 1..4 (d 64 with two
row tiles), fp16, append + rotary, cache_batch_idx + leftpad, window + softcap + ALiBi, pages 16 and 256
(REGS_CLUSTER_PAIRS_PAGED on), and CUDA-graph replays with changing cache_seqlens.

    timeout 120 python -m pytest -q -x tests/test_decode_pair_gpu.py
"""
import numpy as np
import pytest

from cuflash import decode
from cuflash.families import decode_splitkv as fam_mod

from test_decode_gpu import make_case, replays_match_eager
from test_decode_regs_gpu import _ids, check_case
from test_decode_ringfill_gpu import _poison  # noqa: F401  (autouse: outputs poisoned, skip without a GPU)

pytestmark = [pytest.mark.gpu]

LENS8 = [9000, 0, 1, 8191, 8192, 4097, 129, 7777]
# (batch, seqlen_q, lens, nheads, nheads_kv, d, dtype, page, extra, kw)
CASES = [
    (8, 1, LENS8, 32, 8, 128, "bf16", None, {}, {}),                                   # GQA 4, shape rule's order
    (8, 1, [3000, 2999, 17, 0, 1500, 2048, 2049, 640], 8, 8, 128, "fp16", None, {}, {}),  # MHA
    (16, 1, [5000, 4999, 3, 0, 128, 2500, 4000, 1234] * 2, 32, 4, 128, "bf16", None, {}, {}),  # GQA 8
    (8, 3, [2000, 700, 5, 0, 1999, 1024, 333, 1800], 8, 8, 128, "bf16", None, {}, {"causal": True}),
    (8, 2, LENS8, 32, 8, 128, "bf16", None, {}, {"causal": True}),                     # 8 packed rows
    (8, 4, [3000, 900, 1, 0, 2047, 2048, 2049, 100], 32, 8, 64, "bf16", None, {}, {"causal": True}),  # 2 row tiles
    (8, 1, [3000, 1500, 1, 0, 2999, 128, 127, 2000], 32, 8, 128, "bf16", None,
     {"seqlen_new": 1, "rotary_dim": 128}, {}),
    (8, 1, [3000, 1500, 777, 0, 2048, 5, 2999, 1000], 32, 8, 128, "bf16", None,
     {"batch_idx": True, "leftpad": True}, {}),
    (8, 2, [900, 250, 0, 1, 899, 512, 300, 700], 16, 8, 128, "bf16", None, {},
     {"causal": True, "window_size": (100, 0), "softcap": 2.5, "alibi": True}),
    (8, 1, [3001, 2049, 0, 16, 17, 3000, 1024, 999], 32, 8, 128, "bf16", 16, {}, {}),
    (8, 1, [3001, 2049, 0, 256, 257, 3000, 1024, 999], 32, 8, 128, "bf16", 256, {}, {}),
]


def _setup(monkeypatch, paged=False):
    monkeypatch.setattr(fam_mod, "REGS_HEAD_DIM_DEFAULT", (64, 128))   # the d 64 case on the regs kernel too
    monkeypatch.setattr(fam_mod, "REGS_CLUSTER_PAIRS", True)
    monkeypatch.setattr(fam_mod, "REGS_CLUSTER_PAIRS_PAGED", paged)
    decode._drop_gpu_plans()
    monkeypatch.setattr(decode, "_gpu_plans", {})


def _ran_pairs():
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert plans and all(p.config.regs_cluster == 2 and p.config.splits == 2 and not p.config.fused_combine
                         for p in plans), [p.config.name for p in plans]


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_pairs(monkeypatch, case):
    _setup(monkeypatch, paged=case[7] is not None)
    check_case(case, 0)
    _ran_pairs()


@pytest.mark.parametrize("case", [CASES[0], CASES[9]], ids=_ids)
def test_pairs_off(monkeypatch, case):
    """The switch off: the fused combine at the same 2 splits."""
    _setup(monkeypatch, paged=case[7] is not None)
    monkeypatch.setattr(fam_mod, "REGS_CLUSTER_PAIRS", False)
    monkeypatch.setattr(fam_mod, "REGS_CLUSTER_PAIRS_PAGED", False)
    check_case(case, 0)
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert plans and all(p.config.regs_cluster == 0 and p.config.splits == 2 and p.config.fused_combine
                         for p in plans), [p.config.name for p in plans]


@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "page16"])
def test_pairs_cuda_graph(monkeypatch, page):
    """A captured batch-8 call (capacity 20000) replayed empty, full, short and at random lengths per row."""
    _setup(monkeypatch, paged=page is not None)
    rng = np.random.default_rng()
    args = make_case(rng, 8, 1, [20000] * 8, 32, 8, 128, "bf16", page=page)
    lengths = [np.zeros(8, np.int64), np.full(8, 20000), np.full(8, 1000)] + [
        rng.integers(0, 20001, size=8) for _ in range(2)]
    replays_match_eager(dict(args), lengths)
    _ran_pairs()
