"""decode_splitkv's bandwidth options on the GPU, against the float64 reference: ``l2_prefetch``
(the cp.async loop's whole K/V blocks load with an L2 prefetch-size hint of 128 or 256 bytes) and
``warp_loads`` (each warp loads the key rows it reads: no CTA barrier per block).

The heuristic's switches (L2_PREFETCH_DEFAULT, WARP_LOADS_DEFAULT) are set for each case and the
plan cache cleared, so the calls go through flash_attn_with_kvcache as users make them;
test_decode_gpu.check_call compares with the reference (outputs NaN-poisoned first, error at most
twice that of plain attention in the same low precision, LSE likewise, appended cache rows as the
reference wrote them). Odd contexts (1, 17, 113, 300, 1023, 2049: ragged last blocks load without
the hint), per-batch cache_seqlens (0 included), GQA 1 / 4 / 8, seqlen_q 1..4, head dims 64 / 128
/ 256, contiguous and paged (page 16, and 48 with cache_leftpad), num_splits 0 / 1 / 3.
Compiles: 7 kernel sets.

    CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q -x tests/test_decode_bandwidth_gpu.py
"""
import numpy as np
import pytest

from cuflash import api, decode
from cuflash.families import decode_splitkv as fam_mod

from test_decode_gpu import check_call, make_case

pytestmark = [pytest.mark.gpu]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(api, "POISON_OUTPUTS", True)


def _options(monkeypatch, l2: int, warp_loads: bool):
    monkeypatch.setattr(fam_mod, "L2_PREFETCH_DEFAULT", l2)
    monkeypatch.setattr(fam_mod, "WARP_LOADS_DEFAULT", warp_loads)
    monkeypatch.setattr(fam_mod, "TMA_DEFAULT", False)        # options of the cp.async loop
    monkeypatch.setattr(fam_mod, "TMA_PAGED_DEFAULT", False)
    monkeypatch.setattr(fam_mod, "SMALL_PAGE_TMA_MAX_KEYS", 0)   # small paged calls stay on it too
    monkeypatch.setattr(fam_mod, "LARGE_PAGE_TMA_MAX_KEYS", 0)   # page 256 as well
    decode._drop_gpu_plans()  # plans made with other settings must not serve these calls
    monkeypatch.setattr(decode, "_gpu_plans", {})


def _ran(l2: int, warp_loads: bool, paged: bool = False):
    """Every plan ran these options (the heuristic gives paged caches no L2 hint)."""
    l2 = 0 if paged else l2
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert plans and all((p.config.l2_prefetch, p.config.warp_loads) == (l2, warp_loads)
                         for p in plans), [p.config.name for p in plans]


# (batch, seqlen_q, context, nheads, nheads_kv, d, dtype, num_splits, page, l2 bytes, warp_loads)
CASES = [
    (1, 1, 1, 8, 8, 128, "bf16", 0, None, 256, False),
    (3, 1, 17, 32, 8, 128, "bf16", 3, None, 256, True),
    (2, 1, 113, 8, 2, 64, "fp16", 0, None, 128, False),
    (3, 4, 1023, 32, 4, 128, "bf16", 0, None, 256, True),   # 8 x 4 = 32 packed rows: two row tiles
    (2, 2, 2049, 32, 8, 128, "bf16", 1, None, 0, True),
    (2, 1, 300, 8, 2, 256, "bf16", 0, None, 0, True),       # d 256: one key row per warp pass
    (3, 1, 2049, 32, 8, 128, "bf16", 0, 16, 256, True),
    (3, 3, 1023, 16, 2, 64, "fp16", 3, 16, 128, False),
]


def _ids(c):
    return (f"b{c[0]}_q{c[1]}_ctx{c[2]}_h{c[3]}x{c[4]}_d{c[5]}_{c[6]}_split{c[7]}_page{c[8] or 0}"
            f"_l2p{c[9]}{'_wl' if c[10] else ''}")


def test_small_page_warps(monkeypatch):
    """SMALL_PAGE_WARPS = 4 with PAGED_SPLIT_RULE_RESIDENT (the heuristic's choice for page 16 when
    the Hopper loop does not take it): 4 warps x 3 stages, the split rule filling two CTAs per SM,
    against the reference;
    per-batch lengths, GQA 4, seqlen_q 2 (causal), one appended token."""
    _options(monkeypatch, 0, False)
    monkeypatch.setattr(fam_mod, "SMALL_PAGE_WARPS", 4)
    monkeypatch.setattr(fam_mod, "PAGED_SPLIT_RULE_RESIDENT", True)
    rng = np.random.default_rng()
    args = make_case(rng, 3, 2, [4097, 1000, 0], 32, 8, 128, "bf16", page=16, seqlen_new=1)
    check_call(args, "bf16", "small pages, 4 warps", causal=True)
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert plans and all((p.config.warps, p.config.stages, p.config.tma) == (4, 3, False) for p in plans)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_bandwidth_options_grid(monkeypatch, case):
    b, sq, ctx, h, hk, d, dtype, splits, page, l2, wl = case
    _options(monkeypatch, l2, wl)
    rng = np.random.default_rng()
    lens = [ctx] + [int(rng.integers(0, ctx + 1)) for _ in range(b - 1)]
    if b > 2:
        lens[2] = 0
    args = make_case(rng, b, sq, lens, h, hk, d, dtype, page=page)
    check_call(args, dtype, _ids(case), causal=sq > 1, num_splits=splits)
    _ran(l2, wl, paged=bool(page))


def test_bandwidth_options_leftpad_append(monkeypatch):
    """Page 48 with cache_leftpad (blocks straddle pages) and one appended token, both options
    forced (the heuristic gives paged caches no L2 hint), 8 warps and SMALL_PAGE_WARPS' 4."""
    import test_decode_gpu

    from cuflash.decode import check_kvcache, kvcache_with_config

    _options(monkeypatch, 0, False)
    rng = np.random.default_rng()
    args = make_case(rng, 3, 1, [2049, 300, 700], 32, 8, 128, "bf16", page=48, seqlen_new=1,
                     leftpad=True)
    for warps in (8, 4):
        def forced(**kw):
            want_lse = kw.pop("return_softmax_lse", False)
            problem = check_kvcache(**kw).problem("bf16")
            cfg = fam_mod.FAMILY.heuristic(problem, (9, 0)).replace(
                warps=warps, stages=3, l2_prefetch=256, warp_loads=True)
            out, lse = kvcache_with_config(cfg, **kw)
            return (out, lse) if want_lse else out

        monkeypatch.setattr(test_decode_gpu, "flash_attn_with_kvcache", forced)
        check_call(dict(args, k_cache=args["k_cache"].clone(), v_cache=args["v_cache"].clone()),
                   "bf16", f"l2p256 + warp loads, {warps} warps, page 48 leftpad", num_splits=0)
        _ran(256, True)
