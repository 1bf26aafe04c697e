"""decode_splitkv's compile-time options on the GPU: the fused combine (the last CTA of each
(batch, KV head, row block) merges the group's splits, counted in persistent split counters that
it resets to 0) and the paged page-id prefetch.

The heuristic's switches (FUSED_COMBINE_DEFAULT, PAGE_PREFETCH_DEFAULT) are turned on for each
test and the plan cache cleared, so the calls go through flash_attn_with_kvcache as users make
them, and test_decode_gpu.check_call compares with the float64 reference (error at most twice
that of plain attention in the same low precision; outputs NaN-poisoned first; the appended cache
rows as the reference wrote them). Compiles: at most 6 kernel sets (d 128 bf16 with one and two
row tiles, fused + prefetch and prefetch alone; d 64 fp16).
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


def _options(monkeypatch, fused: bool, prefetch: bool):
    monkeypatch.setattr(fam_mod, "FUSED_COMBINE_DEFAULT", fused)
    monkeypatch.setattr(fam_mod, "PAGE_PREFETCH_DEFAULT", prefetch)
    monkeypatch.setattr(fam_mod, "TMA_DEFAULT", False)  # the options of the cp.async loop
    monkeypatch.setattr(fam_mod, "TMA_PAGED_DEFAULT", False)
    monkeypatch.setattr(fam_mod, "SMALL_PAGE_TMA_MAX_KEYS", 0)   # small paged calls stay on it too
    monkeypatch.setattr(fam_mod, "LARGE_PAGE_TMA_MAX_KEYS", 0)   # page 256 as well
    decode._drop_gpu_plans()  # plans made with the other setting must not serve these calls
    monkeypatch.setattr(decode, "_gpu_plans", {})


@pytest.fixture
def fused(monkeypatch):
    _options(monkeypatch, True, True)
    yield
    decode._drop_gpu_plans()


def _entries():
    return [e for e in decode._gpu_plans.values() if e.plan is not None]


def _counters_zero():
    """Every plan's split counters read 0 after its calls (the last CTA of each group resets)."""
    torch = pytest.importorskip("torch")
    torch.cuda.synchronize()
    import cupy

    for e in _entries():
        if e.counters is not None:  # the plan's StreamCounters: one buffer per stream it ran on
            for stream, buf in e.counters.buffers.items():
                vals = cupy.ndarray((e.counters.n,), cupy.int32, buf).get()
                assert not vals.any(), f"{e.plan.config.name} stream {stream:#x}: counters left {vals.tolist()}"


# (batch, seqlen_q, context, nheads, nheads_kv, d, dtype, num_splits, page)
CASES = [
    (1, 1, 1, 8, 8, 128, "bf16", 0, None),
    (3, 1, 17, 32, 8, 128, "bf16", 3, None),
    (3, 5, 1023, 16, 4, 128, "bf16", 17, None),
    (1, 1, 2049, 8, 1, 128, "bf16", 128, None),
    (3, 1, 40000, 32, 8, 128, "bf16", 0, None),
    (1, 5, 2049, 8, 2, 128, "bf16", 0, None),
    (3, 5, 2049, 32, 8, 128, "bf16", 3, 16),
    (1, 1, 40000, 32, 8, 128, "bf16", 128, 256),
    (3, 1, 1023, 8, 8, 128, "bf16", 17, 16),
    (3, 5, 17, 32, 4, 128, "bf16", 1, 256),
    (3, 1, 2049, 16, 2, 64, "fp16", 17, 16),
]


def _id(c):
    page = f"_page{c[8]}" if c[8] else ""
    return f"b{c[0]}_q{c[1]}_ctx{c[2]}_h{c[3]}x{c[4]}_d{c[5]}_{c[6]}_split{c[7]}{page}"


def _lens(rng, batch, ctx):
    """Per-batch lengths: the first row full, the others random, the third empty."""
    lens = [ctx] + [int(rng.integers(0, ctx + 1)) for _ in range(batch - 1)]
    if batch > 2:
        lens[2] = 0
    return lens


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fused_combine_grid(fused, case, causal):
    """Two consecutive calls of one call shape on fresh inputs (the second finds the counters
    the first reset), each against the reference; one new token appended."""
    b, sq, ctx, h, hk, d, dtype, splits, page = case
    rng = np.random.default_rng()
    for call in range(2):
        args = make_case(rng, b, sq, _lens(rng, b, ctx), h, hk, d, dtype, page=page, seqlen_new=1)
        check_call(args, dtype, f"{_id(case)} call {call}", causal=causal, num_splits=splits)
    names = {e.plan.config.name for e in _entries()}
    assert all("_fc" in n for n in names), names
    _counters_zero()


@pytest.mark.parametrize("page", [16, 256], ids=lambda p: f"page{p}")
def test_page_prefetch_without_fused(monkeypatch, page):
    """The prefetch alone (separate combine launch), with leftpad: odd key offsets in a page."""
    _options(monkeypatch, False, True)
    rng = np.random.default_rng()
    for splits in (0, 3):
        args = make_case(rng, 3, 2, [2049, 113, 700], 32, 8, 128, "bf16", page=page, seqlen_new=1,
                         leftpad=True)
        check_call(args, "bf16", f"page {page} splits {splits}", causal=True, num_splits=splits)
    assert all(e.plan.config.name.endswith("_pp") for e in _entries())
    decode._drop_gpu_plans()


def test_fused_combine_cuda_graph(fused):
    """Capture one decode step (fused combine, 17 splits, rotary append) and replay it with other
    cache_seqlens: each replay equals an eager call on the same state, and the counters are 0
    after every replay (the kernel resets them; nothing is zeroed per call)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    args = make_case(rng, 4, 1, [100, 2000, 5, 3000], 32, 8, 128, "bf16", seqlen_new=1,
                     rotary_dim=128)
    cap = args["k_cache"].shape[1]
    kw = dict(num_splits=17)
    flash_attn = decode.flash_attn_with_kvcache
    flash_attn(**{k: (v.clone() if k in ("k_cache", "v_cache") else v) for k, v in args.items()},
               **kw)  # warm-up: plan, kernels, counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn(**args, **kw)
    for step in range(3):
        lens = rng.integers(0, cap - 1, size=4)
        args["cache_seqlens"].copy_(torch.tensor(lens, dtype=torch.int32))
        for name in ("q", "k", "v"):
            args[name].copy_(torch.randn_like(args[name]))
        kc, vc = args["k_cache"].clone(), args["v_cache"].clone()
        graph.replay()
        _counters_zero()
        eager = flash_attn(**dict(args, k_cache=kc, v_cache=vc), **kw)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"step {step}: graph replay differs from eager"
        _counters_zero()
    # and the eager path is still right after the replays
    args = make_case(rng, 4, 1, [100, 2000, 5, 3000], 32, 8, 128, "bf16", seqlen_new=1, rotary_dim=128)
    check_call(args, "bf16", "after replays", **kw)


def test_fused_combine_inside_a_first_capture(fused):
    """A call shape's first call under CUDA-graph capture cannot zero its counters: a chosen
    config (FUSED_COMBINE_DEFAULT) runs that call shape with the separate combine instead, and the
    replay matches an eager call; a given config with fused_combine is refused with a clear error
    (make the call once before capturing)."""
    torch = pytest.importorskip("torch")
    from cuflash.decode import check_kvcache, kvcache_with_config

    rng = np.random.default_rng()
    args = make_case(rng, 1, 1, [3000], 32, 8, 128, "bf16")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode.flash_attn_with_kvcache(**args, num_splits=5)
    graph.replay()
    torch.cuda.synchronize()
    assert [e.plan.config.fused_combine for e in _entries()] == [False]
    eager = decode.flash_attn_with_kvcache(**args, num_splits=5)   # the same plan, eagerly
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    decode._drop_gpu_plans()
    cfg = fam_mod.FAMILY.heuristic(check_kvcache(**args).problem("bf16"), (9, 0)).replace(fused_combine=True)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="before capturing"):
        with torch.cuda.graph(graph):
            kvcache_with_config(cfg, **args, num_splits=5)
