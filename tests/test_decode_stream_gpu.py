"""decode_splitkv's ``stream`` option (decode_splitkv_stream, stream-K) on the GPU, against the
float64 reference: every group's K/V blocks as one list in equal ranges over the SMs' CTAs, a
range crossing group boundaries, a group's pieces merged by its last CTA.

The heuristic's switch (STREAM_DEFAULT) is set and the plan cache cleared, so the calls go
through flash_attn_with_kvcache as users make them; test_decode_gpu.check_call compares with the
reference (outputs NaN-poisoned first, error at most twice that of plain attention in the same
low precision, LSE likewise). Per-batch cache_seqlens (0 included: rows without items, and rows
of fewer blocks than a CTA's range), GQA 4 and 1, seqlen_q 1..4 (not causal above 1), head dims
64 / 128, contiguous and paged (page 16), append + rotary, cache_batch_idx, leftpad; the CTA count
forced small (a group's pieces from many CTAs, a range over many groups); repeated calls and
CUDA-graph replays (the counters back at 0 after every call).

    CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q -x tests/test_decode_stream_gpu.py
"""
import numpy as np
import pytest

from cuflash import decode
from cuflash.families import decode_splitkv as fam_mod

from test_decode_gpu import _torch, check_call, make_case, replays_match_eager
from test_decode_ringfill_gpu import _poison  # noqa: F401  (autouse: outputs poisoned, skip without a GPU)

pytestmark = [pytest.mark.gpu]


def _options(monkeypatch, stream: bool = True):
    monkeypatch.setattr(fam_mod, "STREAM_DEFAULT", stream)
    monkeypatch.setattr(fam_mod, "TMA_PAGED_DEFAULT", False)
    monkeypatch.setattr(fam_mod, "SMALL_PAGE_TMA_MAX_KEYS", 0)   # paged calls stay on the cp.async loops
    monkeypatch.setattr(fam_mod, "LARGE_PAGE_TMA_MAX_KEYS", 0)
    monkeypatch.setattr(fam_mod, "SMALL_PAGE_WARPS", 8)
    monkeypatch.setattr(fam_mod, "STREAM_PAGED", True)
    decode._drop_gpu_plans()  # plans made with other settings must not serve these calls
    monkeypatch.setattr(decode, "_gpu_plans", {})


def _ran_stream():
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert plans and all(p.config.stream for p in plans), [p.config.name for p in plans]


# (batch, seqlen_q, lens, nheads, nheads_kv, d, dtype, page, extra)
CASES = [
    (1, 1, [1], 8, 8, 128, "bf16", None, {}),
    (1, 1, [8192], 32, 8, 128, "bf16", None, {}),
    (1, 1, [32768 - 3], 32, 8, 128, "bf16", None, {}),
    (3, 1, [17, 0, 5000], 32, 8, 128, "bf16", None, {}),
    (5, 1, [0, 0, 5, 0, 0], 32, 8, 128, "bf16", None, {}),
    (4, 2, [1023, 4097, 1, 3000], 32, 4, 128, "bf16", None, {}),   # 16 packed rows
    (3, 4, [2049, 700, 9000], 8, 2, 128, "bf16", None, {}),        # GQA 4 x 4 queries: 16 packed rows
    (2, 1, [113, 20000], 8, 8, 64, "fp16", None, {}),
    (8, 1, [8192] * 8, 32, 8, 128, "bf16", None, {}),
    (3, 1, [2049, 0, 6000], 32, 8, 128, "bf16", 16, {}),
    (2, 1, [3000, 1500], 32, 8, 128, "bf16", None, {"seqlen_new": 1, "rotary_dim": 128}),
    (3, 1, [3000, 1500, 777], 32, 8, 128, "bf16", None, {"batch_idx": True, "leftpad": True}),
]


def _ids(c):
    return f"b{c[0]}_q{c[1]}_l{max(c[2])}_h{c[3]}x{c[4]}_d{c[5]}_{c[6]}_page{c[7] or 0}" + "".join(f"_{k}" for k in c[8])


@pytest.mark.parametrize("ctas", [0, 3, 7], ids=lambda n: f"ctas{n}")
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_stream_grid(monkeypatch, case, ctas):
    b, sq, lens, h, hk, d, dtype, page, extra = case
    _options(monkeypatch)
    if ctas:   # few CTAs: long ranges over many groups, a group's pieces from several CTAs
        monkeypatch.setattr(fam_mod, "STREAM_FORCE_CTAS", ctas)
    rng = np.random.default_rng()
    args = make_case(rng, b, sq, lens, h, hk, d, dtype, page=page, **extra)
    for _ in range(2):   # the counters are back at 0 after a call
        check_call(dict(args, k_cache=args["k_cache"].clone(), v_cache=args["v_cache"].clone()), dtype,
                   _ids(case), causal=sq == 1)
    _ran_stream()


def test_stream_cuda_graph(monkeypatch):
    """A captured call (per-batch cache_seqlens, the counters made before the capture) replayed
    with new lengths and queries (all rows empty first: no CTA has items): each replay matches an
    eager call on the same inputs within bf16 rounding."""
    _options(monkeypatch)
    rng = np.random.default_rng()
    args = make_case(rng, 4, 1, [65536, 1000, 30000, 5], 32, 8, 128, "bf16")
    cap = args["k_cache"].shape[1]
    lengths = [np.zeros(4, np.int64)] + [rng.integers(0, cap, size=4) for _ in range(3)]   # first: no items at all
    replays_match_eager(dict(args), lengths)
    _ran_stream()


LF_CASES = [(1, 1, [8192], 32, 8, 128, "bf16", None, {}), (3, 1, [17, 0, 5000], 32, 8, 128, "bf16", None, {}),
            (2, 1, [70000, 3000], 32, 8, 128, "bf16", None, {}), (2, 2, [2049, 900], 32, 8, 128, "bf16", None, {})]


@pytest.mark.parametrize("case", LF_CASES, ids=_ids)
def test_light_fence(monkeypatch, case):
    """light_fence (the split kernel's fused combine counted without per-thread fences, the
    heuristic's switch LIGHT_FENCE_DEFAULT), with the dynamic claims where the heuristic takes them."""
    b, sq, lens, h, hk, d, dtype, page, extra = case
    _options(monkeypatch, stream=False)
    monkeypatch.setattr(fam_mod, "LIGHT_FENCE_DEFAULT", True)
    rng = np.random.default_rng()
    args = make_case(rng, b, sq, lens, h, hk, d, dtype, page=page, **extra)
    for splits in (0, 3):
        check_call(dict(args, k_cache=args["k_cache"].clone(), v_cache=args["v_cache"].clone()), dtype,
                   _ids(case), causal=True, num_splits=splits)
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert plans and all(p.config.light_fence for p in plans if p.config.fused_combine), [p.config.name for p in plans]
