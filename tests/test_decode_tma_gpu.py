"""The decode family's Hopper loop (decode_splitkv_tma: a producer warp streams K/V by TMA into an
mbarrier ring) on an sm_90 GPU, against the float64 reference.

Every call runs a forced config: the heuristic's tiles for the call with ``tma=True`` (and the
ring depth / warps of the case), through ``kvcache_with_config``; the checks are
tests/test_decode_gpu.py's (``check_call``: outputs poisoned with NaN first, the error of out at
most twice that of plain attention in the same low precision, LSE likewise, appended cache rows
as the reference wrote them), and each case asserts that the plan it ran was a tma plan.

Cases: batch 1 / 3 with per-batch cache_seqlens (0 included), contexts 1, 17, 1023, 2049, 40000,
GQA 1 / 4 / 8, seqlen_q 1 and 5 (two row tiles), num_splits 0 / 1 / 3 / 17 / 128, d64 and d128,
bf16 and fp16, contiguous and paged (page 16 and 256; page 48: boxes of 16), cache_leftpad
(boxes across a page boundary: the per-row bulk copies; boxes of 16 and 64 rows), cache_batch_idx, append + rotary,
window / softcap / ALiBi, ring depths 2 / 3 / 6, and a CUDA-graph capture replayed with other
cache_seqlens. About 11 kernel sets compile (first run: a minute or two).

    CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q -x tests/test_decode_tma_gpu.py
"""
import numpy as np
import pytest

from cuflash import api
from cuflash import decode as decode_mod
from cuflash.decode import check_kvcache, kvcache_with_config
from cuflash.families import decode_splitkv as fam_mod
from cuflash.registry import get

import test_decode_gpu as base  # noqa: E402  (tests/ is on sys.path under pytest)

pytestmark = [pytest.mark.gpu]

FAM = get("decode_splitkv")


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(api, "POISON_OUTPUTS", True)


@pytest.fixture(autouse=True)
def _sm90():
    from cuflash import _gpu

    if _gpu.arch()[0] != 9:
        pytest.skip("the tma loop needs sm_90")


def tma_config(problem, **changes):
    """The heuristic's Hopper-loop config for ``problem`` (TMA_DEFAULT on), with ``changes``."""
    old = fam_mod.TMA_DEFAULT
    fam_mod.TMA_DEFAULT = True
    try:
        cfg = FAM.heuristic(problem, (9, 0))
    finally:
        fam_mod.TMA_DEFAULT = old
    assert cfg.tma, cfg.name
    return cfg.replace(**changes)


def _forced(changes: dict, seen: list):
    """flash_attn_with_kvcache with the call's heuristic tiles and ``tma=True`` plus ``changes``
    (a drop-in for check_call); the configs it ran go to ``seen``."""

    def run(**kw):
        want_lse = kw.pop("return_softmax_lse", False)
        call = check_kvcache(**kw)
        problem = call.problem(call.tq.dtype)
        cfg = tma_config(problem, **changes)
        out, lse = kvcache_with_config(cfg, **kw)
        seen.append(cfg)
        return (out, lse) if want_lse else out

    return run


def check(monkeypatch, args, dtype, what, changes=None, **kw):
    """check_call of tests/test_decode_gpu.py on the tma loop; asserts the plan was a tma one."""
    seen = []
    monkeypatch.setattr(base, "flash_attn_with_kvcache", _forced(changes or {}, seen))
    decode_mod._gpu_plans.clear()
    out = base.check_call(args, dtype, what, **kw)
    plans = [e.plan for e in decode_mod._gpu_plans.values() if e.plan is not None]
    assert seen and plans and all(p.config.tma for p in plans), f"{what}: no tma plan ran"
    return out


# (batch, seqlen_q, context, nheads, nheads_kv, d, dtype, num_splits, page)
CASES = [
    (1, 1, 1, 8, 8, 128, "bf16", 0, None),
    (3, 1, 17, 32, 8, 128, "bf16", 1, None),
    (3, 1, 1023, 16, 2, 64, "fp16", 3, None),
    (1, 5, 2049, 32, 8, 128, "bf16", 17, None),
    (3, 1, 40000, 32, 8, 128, "bf16", 0, None),
    (1, 1, 40000, 32, 8, 128, "bf16", 128, None),
    (3, 1, 2049, 16, 2, 64, "fp16", 17, None),
    (3, 1, 2049, 8, 1, 64, "bf16", 0, 16),
    (1, 5, 1023, 16, 4, 128, "fp16", 3, 256),
    (3, 1, 40000, 32, 8, 128, "bf16", 0, 16),
    (3, 1, 1023, 32, 8, 128, "bf16", 128, 256),
    (3, 5, 17, 32, 8, 128, "bf16", 0, 48),
]


def _ids(c):
    return f"b{c[0]}_q{c[1]}_ctx{c[2]}_h{c[3]}x{c[4]}_d{c[5]}_{c[6]}_split{c[7]}_page{c[8] or 0}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_tma_grid(monkeypatch, case, causal):
    """Per-batch cache_seqlens (row 2 empty in batch 3), GQA 1/4/8, seqlen_q 1 and 5, splits."""
    b, sq, ctx, h, hk, d, dtype, splits, page = case
    rng = np.random.default_rng()
    lens = [ctx] + [int(rng.integers(0, ctx + 1)) for _ in range(b - 1)]
    if b > 2:
        lens[2] = 0
    args = base.make_case(rng, b, sq, lens, h, hk, d, dtype, page=page)
    check(monkeypatch, args, dtype, _ids(case), causal=causal, num_splits=splits)


@pytest.mark.parametrize("page", [None, 16, 256], ids=lambda p: f"page{p or 0}")
def test_tma_leftpad(monkeypatch, page):
    """cache_leftpad at any offset: contiguous boxes start anywhere; paged boxes that cross a page
    go by per-row bulk copies."""
    rng = np.random.default_rng()
    args = base.make_case(rng, 4, 2, [500, 33, 1, 1200], 8, 2, 128, "bf16", page=page,
                          seqlen_new=1, leftpad=True)
    check(monkeypatch, args, "bf16", f"leftpad page {page}", causal=True, num_splits=3)


@pytest.mark.parametrize("page, d, sq, heads", [(48, 96, 16, (16, 4)), (64, 128, 1, (32, 8))],
                         ids=["page48_d96_q16", "page64_d128_q1"])
def test_tma_page_crossing_boxes(monkeypatch, page, d, sq, heads):
    """Paged boxes across a page boundary (cache_leftpad 683 and 100, not multiples of the box)
    go by per-row bulk copies, which producer lane 0 issues for rows whose page ids the other
    lanes read: boxes of 16 rows (page 48, 64-key blocks) and of 64 (page 64: two rounds of 32
    rows), 4 warps and 3 stages as TMA_PAGED_DEFAULT runs them. The first is the call that
    compute-sanitizer racecheck flagged in session 13 (decode_splitkv_tma<4, 16, 3, 2, 96>,
    tests/gpu_sanitize.py); its ring slots are reused, and both rows end in a ragged block."""
    torch = base._torch()
    rng = np.random.default_rng()
    args = base.make_case(rng, 2, sq, [2049, 300], *heads, d, "bf16", page=page)
    args["cache_leftpad"] = torch.tensor([683, 100], dtype=torch.int32, device="cuda")
    for splits in (3, 0):
        check(monkeypatch, args, "bf16", f"page {page} d {d} splits {splits}",
              changes=dict(warps=4, stages=3), causal=sq > 1, num_splits=splits)


@pytest.mark.parametrize("append", [0, 3], ids=["read", "append"])
def test_tma_cache_batch_idx(monkeypatch, append):
    rng = np.random.default_rng()
    args = base.make_case(rng, 3, 1, [400, 1000, 9], 8, 8, 128, "bf16", seqlen_new=append,
                          batch_idx=True)
    check(monkeypatch, args, "bf16", "cache_batch_idx", num_splits=0)


@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "page16"])
def test_tma_append_rotary(monkeypatch, page):
    rng = np.random.default_rng()
    args = base.make_case(rng, 2, 4, [300, 77], 8, 2, 128, "fp16", page=page, seqlen_new=4,
                          rotary_dim=64)
    check(monkeypatch, args, "fp16", "append + rotary", causal=True)


def test_tma_features(monkeypatch):
    torch = base._torch()
    rng = np.random.default_rng()
    args = base.make_case(rng, 2, 4, [900, 250], 16, 4, 128, "bf16", seqlen_new=2)
    alibi = torch.rand(2, 16, device="cuda", dtype=torch.float32)
    check(monkeypatch, args, "bf16", "window + softcap + alibi", causal=True, num_splits=3,
          window_size=(100, 0), softcap=2.5, alibi_slopes=alibi)


@pytest.mark.parametrize("changes", [dict(stages=2), dict(warps=4, stages=6), dict(warps=4, stages=3)],
                         ids=["w8s2", "w4s6", "w4s3"])
def test_tma_ring_depths(monkeypatch, changes):
    """Other ring depths and block sizes (64-key blocks at 4 warps), ragged paged and not."""
    rng = np.random.default_rng()
    for page in (None, 16):
        args = base.make_case(rng, 3, 1, [2049, 100, 0], 32, 8, 128, "bf16", page=page)
        check(monkeypatch, args, "bf16", f"{changes} page {page}", changes=changes, num_splits=5)


@pytest.mark.parametrize("page", [None, 256], ids=["contiguous", "page256"])
def test_tma_cuda_graph(page):
    """A decode step (append 1 token, per-batch cache_seqlens, heuristic splits) on the tma loop,
    captured once and replayed with other lengths and new tokens: the replay equals an eager call
    on the same state (the tensor maps hold the captured caches' addresses, which stay)."""
    torch = base._torch()
    rng = np.random.default_rng()
    args = base.make_case(rng, 4, 1, [100, 2000, 5, 3000], 32, 8, 128, "bf16", page=page,
                          seqlen_new=1)
    call = check_kvcache(**args)
    cfg = tma_config(call.problem("bf16"))
    cap = call.capacity
    static = dict(args)
    kvcache_with_config(cfg, **{k: (v.clone() if k in ("k_cache", "v_cache") else v)
                                for k, v in static.items()})  # warm-up: plan and kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = kvcache_with_config(cfg, **static)
    for step in range(3):
        lens = rng.integers(0, cap - 1, size=4)
        static["cache_seqlens"].copy_(torch.tensor(lens, dtype=torch.int32))
        static["q"].copy_(torch.randn_like(static["q"]))
        static["k"].copy_(torch.randn_like(static["k"]))
        static["v"].copy_(torch.randn_like(static["v"]))
        kc, vc = static["k_cache"].clone(), static["v_cache"].clone()
        graph.replay()
        torch.cuda.synchronize()
        eager, _ = kvcache_with_config(cfg, **dict(static, k_cache=kc, v_cache=vc))
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"step {step}: graph replay differs from eager"
        assert torch.equal(static["k_cache"], kc) and torch.equal(static["v_cache"], vc)


def test_tma_refusals():
    """A forced tma config names what it cannot run (page size, head dim) before any launch;
    the heuristic's choice falls back to the cp.async loop there."""
    torch = base._torch()
    rng = np.random.default_rng()
    args = base.make_case(rng, 2, 1, [100, 50], 8, 2, 128, "bf16", page=8)
    cfg = FAM.heuristic(check_kvcache(**args).problem("bf16"), (9, 0)).replace(tma=True, fused_combine=False)
    with pytest.raises(ValueError, match=r"^k_cache: the tma loop needs a page_block_size"):
        kvcache_with_config(cfg, **args)
    args = base.make_case(rng, 2, 1, [100, 50], 8, 2, 120, "bf16")
    cfg = FAM.heuristic(check_kvcache(**args).problem("bf16"), (9, 0)).replace(tma=True, fused_combine=False, l2_prefetch=0)
    with pytest.raises(ValueError, match=r"^q: the tma loop needs the head dim"):
        kvcache_with_config(cfg, **args)
    torch.cuda.synchronize()


@pytest.mark.parametrize("page", [16, 256], ids=lambda p: f"page{p}")
def test_heuristic_takes_tma_for_small_pages(page, monkeypatch):
    """flash_attn_with_kvcache as users call it, with TMA_PAGED_DEFAULT on (it is off by default):
    page 16 runs the Hopper loop (4 warps, 3 stages; DecodeSplitKV.call_config), page 256 the
    cp.async loop; both against the reference."""
    monkeypatch.setattr(fam_mod, "TMA_PAGED_DEFAULT", True)
    rng = np.random.default_rng()
    args = base.make_case(rng, 3, 1, [2049, 700, 0], 32, 8, 128, "bf16", page=page, seqlen_new=1)
    decode_mod._gpu_plans.clear()
    base.check_call(args, "bf16", f"heuristic page {page}")
    (entry,) = [e for e in decode_mod._gpu_plans.values() if e.plan is not None]
    cfg = entry.plan.config
    assert cfg.tma == (page < fam_mod.TMA_PAGED_MAX_PAGE), cfg.name
    if cfg.tma:
        assert (cfg.warps, cfg.stages) == (4, 3)
