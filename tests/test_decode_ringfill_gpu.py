"""decode_splitkv's ``ring_fill`` and ``dynamic`` options on the GPU, against the float64 reference:
the cp.async loop's prologue fills every ring slot (ring_fill 1; 2: each iteration's load issued
before S), and a group's splits claim its K/V blocks one at a time from a counter that the fused
combine's last CTA resets (dynamic).

The heuristic's switches (RING_FILL_DEFAULT, DYNAMIC_DEFAULT) are set for each case and the plan
cache cleared, so the calls go through flash_attn_with_kvcache as users make them;
test_decode_gpu.check_call compares with the reference (outputs NaN-poisoned first, error at most
twice that of plain attention in the same low precision, LSE likewise). Odd contexts (ragged last
blocks, fewer blocks than ring slots), per-batch cache_seqlens (0 included), GQA, seqlen_q 1..4
(causal), a local window (the group's blocks start above 0), head dims 64 / 128, contiguous and
paged (page 16), num_splits 0 / 1 / 2 / 3 / 4 / 17, lean; rows of 32+ blocks per split (the claims); repeated calls and CUDA-graph replays (the
claim counter back at 0 after every call).

    CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q -x tests/test_decode_ringfill_gpu.py
"""
import numpy as np
import pytest

from cuflash import _gpu, api, decode
from cuflash.families import decode_splitkv as fam_mod

from test_decode_gpu import _torch, check_call, check_ragged_case, make_case, replays_match_eager

pytestmark = [pytest.mark.gpu]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(api, "POISON_OUTPUTS", True)
    if not _gpu.available():
        pytest.skip("needs a GPU")


def _options(monkeypatch, ring_fill: int, dynamic: int, lean: bool = False):
    monkeypatch.setattr(fam_mod, "RING_FILL_DEFAULT", ring_fill)
    monkeypatch.setattr(fam_mod, "DYNAMIC_DEFAULT", dynamic)
    monkeypatch.setattr(fam_mod, "DYNAMIC_MAX_GROUPS", 1 << 30)   # every call shape, not only batch 1 from 64k
    monkeypatch.setattr(fam_mod, "DYNAMIC_MIN_KEYS", 0)
    monkeypatch.setattr(fam_mod, "LEAN_DEFAULT", lean)
    monkeypatch.setattr(fam_mod, "TMA_DEFAULT", False)           # options of the cp.async loop
    monkeypatch.setattr(fam_mod, "TMA_PAGED_DEFAULT", False)
    monkeypatch.setattr(fam_mod, "SMALL_PAGE_TMA_MAX_KEYS", 0)   # small paged calls stay on it too
    monkeypatch.setattr(fam_mod, "LARGE_PAGE_TMA_MAX_KEYS", 0)
    decode._drop_gpu_plans()  # plans made with other settings must not serve these calls
    monkeypatch.setattr(decode, "_gpu_plans", {})


def _ran(ring_fill: int, dynamic: int):
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert plans and all(p.config.ring_fill == ring_fill and not p.config.tma for p in plans), \
        [p.config.name for p in plans]
    assert all(p.config.dynamic == (0 if "paged_kv" in p.problem.features else
                                    dynamic if dynamic == 2 or p.config.fused_combine else 0) for p in plans), \
        [p.config.name for p in plans]   # the heuristic keeps paged caches on equal runs


# (batch, seqlen_q, context, nheads, nheads_kv, d, dtype, num_splits, page)
CASES = [
    (1, 1, 1, 8, 8, 128, "bf16", 0, None),
    (3, 1, 17, 32, 8, 128, "bf16", 3, None),
    (2, 1, 113, 8, 2, 64, "fp16", 0, None),
    (3, 4, 1023, 32, 4, 128, "bf16", 0, None),   # 8 x 4 = 32 packed rows: two row tiles
    (2, 2, 2049, 32, 8, 128, "bf16", 1, None),
    (4, 1, 8192, 32, 8, 128, "bf16", 0, None),
    (1, 1, 8192, 32, 8, 128, "bf16", 17, None),  # more splits than a row has blocks / 3
    (3, 1, 2049, 32, 8, 128, "bf16", 0, 16),
    (3, 3, 1023, 16, 2, 128, "bf16", 3, 16),
    (1, 1, 70000, 32, 8, 128, "bf16", 2, None),   # >= 32 blocks per split: the claims (dynamic 1)
    (2, 2, 40000, 32, 8, 128, "bf16", 4, None),   # row 1's groups may fall back to equal runs
]
MODES = [(2, 0), (1, 1), (2, 1), (1, 2)]   # (ring_fill, dynamic): 1 is the heuristic's (DYNAMIC_DEFAULT)


def _ids(c):
    return f"b{c[0]}_q{c[1]}_ctx{c[2]}_h{c[3]}x{c[4]}_d{c[5]}_{c[6]}_split{c[7]}_page{c[8] or 0}"


@pytest.mark.parametrize("mode", MODES, ids=lambda m: f"rf{m[0]}_dyn{m[1]}")
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_ringfill_grid(monkeypatch, case, mode):
    b, sq, ctx, h, hk, d, dtype, splits, page = case
    ring_fill, dynamic = mode
    _options(monkeypatch, ring_fill, dynamic)
    check_ragged_case(b, sq, ctx, h, hk, d, dtype, splits, page, _ids(case))
    _ran(ring_fill, dynamic)


def test_dynamic_window_repeated(monkeypatch):
    """A local window (the group's blocks start above block 0; causal with seqlen_q 2) and the
    plain rows, with lean, each called on one plan more than once: every call finds its claim
    counters at 0 (2 splits: claims; the heuristic's count: claims or equal runs per group)."""
    _options(monkeypatch, 2, 1, lean=True)
    rng = np.random.default_rng()
    args = make_case(rng, 3, 2, [40000 - 5, 0, 20000], 32, 8, 128, "bf16")
    for splits in (2, 0):
        for kw in ({"window_size": (10000, 0), "causal": True}, {"causal": True}):
            check_call(dict(args, k_cache=args["k_cache"].clone(), v_cache=args["v_cache"].clone()),
                       "bf16", f"dynamic, splits {splits}, {kw}", num_splits=splits, **kw)
    _ran(2, 1)


def test_dynamic_cuda_graph(monkeypatch):
    """A captured call (per-batch cache_seqlens, num_splits=0, the fused combine's counters made
    before the capture) replayed with new lengths and queries: each replay matches an eager call
    on the same inputs within bf16 rounding (the blocks' order differs between calls)."""
    _options(monkeypatch, 2, 1)
    rng = np.random.default_rng()
    args = make_case(rng, 1, 1, [131072], 32, 8, 128, "bf16")
    cap = args["k_cache"].shape[1]
    lengths = [rng.integers(70000, cap, size=1) for _ in range(4)]   # >= 32 blocks per split: the claims
    replays_match_eager(dict(args), lengths)
    _ran(2, 1)


def test_heuristic_dynamic_1x64k(monkeypatch):
    """The heuristic's own choice (no switch set): batch 1 x 8 KV heads at 64k keys (512 blocks,
    16 splits: 32 per split) runs the dynamic claims (DYNAMIC_DEFAULT), against the reference,
    twice on one plan."""
    decode._drop_gpu_plans()
    monkeypatch.setattr(decode, "_gpu_plans", {})
    rng = np.random.default_rng()
    args = make_case(rng, 1, 1, [65536 + 9], 32, 8, 128, "bf16")   # >= DYNAMIC_MIN_KEYS
    for _ in range(2):
        check_call(args, "bf16", "heuristic 1 x 64k")
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert plans and all(p.config.dynamic == fam_mod.DYNAMIC_DEFAULT for p in plans), [p.config.name for p in plans]
