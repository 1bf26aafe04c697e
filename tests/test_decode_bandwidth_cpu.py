"""decode_splitkv's bandwidth options without a GPU: ``l2_prefetch`` (an L2 prefetch-size hint on
the cp.async loop's K/V copies) and ``warp_loads`` (each warp loads the key rows it reads): config
fields, names, template arguments, rules, the space, the heuristic's switches, points from before
the options, and nvcc builds for sm_80 and sm_90a with zero spills (the plain kernel's template
arguments gain trailing defaults: its code is what it was)."""
import shutil

import pytest

from cuflash.compile import nvcc_compile, render_source
from cuflash.families import decode_splitkv as mod
from cuflash.families.decode_splitkv import DecodeConfig
from cuflash.problem import Problem
from cuflash.registry import get

FAM = get("decode_splitkv")
BASE = DecodeConfig(8, 16, 3, 1, 4, 128, "bf16", False)
P = Problem("decode", "bf16", 1, 1, 32768, 32, 8, 128)


def test_names_and_template_arguments():
    assert BASE.name == "decode_bf16_d128_w8_n16_s3_m1_c4"          # plain names unchanged
    both = BASE.replace(l2_prefetch=256, warp_loads=True)
    assert both.name == "decode_bf16_d128_w8_n16_s3_m1_c4_l2p256_wl"
    assert BASE.template_args()[-9:-3] == (0, False, False, False, 0, False)
    assert both.template_args()[-9:-3] == (256, True, False, False, 0, False)
    assert both.kernel_name() == ("cuflash::decode_splitkv<8, 16, 3, 1, 128, cuflash::bf16, false, false, "
                                  "256, true>")
    for cfg in (BASE, both, both.replace(splits=9, fused_combine=True)):
        assert FAM.decode(FAM.encode(cfg), "bf16", False) == cfg
    assert both.smem_bytes == BASE.smem_bytes and both.threads == BASE.threads


def test_rules():
    assert "l2_prefetch must be one of (0, 64, 128, 256)" in " ".join(BASE.replace(l2_prefetch=32).problems())
    for size in mod.L2_PREFETCH_SIZES:
        assert not BASE.replace(l2_prefetch=size, warp_loads=True).problems(232448)
    tma = BASE.replace(tma=True)
    assert "no warp_loads" in " ".join(tma.replace(warp_loads=True).problems())
    assert "no l2_prefetch" in " ".join(tma.replace(l2_prefetch=128).problems())


def test_space_and_points_from_before():
    assert FAM.space["l2_prefetch"] == mod.L2_PREFETCH_SPACE == (0, 128, 256)   # the sizes run on the H100
    assert FAM.space["warp_loads"] == mod.WARP_LOADS_SPACE == (False,)          # not yet run on a GPU
    assert set(mod.L2_PREFETCH_SPACE) <= set(mod.L2_PREFETCH_SIZES)
    point = {k: getattr(BASE, k) for k in FAM.space
             if k not in ("tma", "l2_prefetch", "warp_loads", "page_gather")}
    cfg = FAM.make(point, P)                 # a tuned entry / study point from before the options
    assert (cfg.tma, cfg.l2_prefetch, cfg.warp_loads, cfg.page_gather) == (False, 0, False, False)


def test_heuristic_switches(monkeypatch):
    cfg = FAM.heuristic(P, (9, 0))
    assert (cfg.l2_prefetch, cfg.warp_loads) == (mod.L2_PREFETCH_DEFAULT, mod.WARP_LOADS_DEFAULT)
    monkeypatch.setattr(mod, "L2_PREFETCH_DEFAULT", 256)
    monkeypatch.setattr(mod, "WARP_LOADS_DEFAULT", True)
    cfg = FAM.heuristic(P, (8, 0))
    assert (cfg.l2_prefetch, cfg.warp_loads) == (256, True) and not cfg.problems(166912)
    paged = FAM.heuristic(P.replace(features=("paged_kv",)), (9, 0))   # paged caches: no L2 hint
    assert (paged.l2_prefetch, paged.warp_loads) == (0, True)
    # the Hopper loop drops them (its own loads), as it drops the fused combine
    monkeypatch.setattr(mod, "TMA_DEFAULT", True)
    tma = FAM.heuristic(P, (9, 0))
    assert tma.tma and (tma.l2_prefetch, tma.warp_loads) == (0, False) and not tma.problems(232448)
    monkeypatch.setattr(mod, "TMA_DEFAULT", False)
    monkeypatch.setattr(mod, "TMA_PAGED_DEFAULT", True)
    paged = P.replace(features=("paged_kv",))
    small = FAM.call_config(FAM.heuristic(paged, (9, 0)), paged, (9, 0), 16, chosen=True, heuristic=True)
    assert small.tma and (small.l2_prefetch, small.warp_loads) == (0, False)


def test_kernel_source_flags():
    src = render_source("decode_splitkv")
    assert "int kL2Prefetch = 0" in src and ("bool kWarpLoads = false, bool kPageGather = false, bool kLean = false, int kBulk = 0,\n"
                                                 "          bool kEarlyMerge = false, int kRingFill = 0") in src
    assert "if (!kWarpLoads || iter == 0) __syncthreads();" in src


NVCC = shutil.which("nvcc")
POINTS = [BASE.replace(l2_prefetch=256), BASE.replace(warp_loads=True),
          BASE.replace(warps=4, l2_prefetch=128, warp_loads=True),
          BASE.replace(m_tiles=2, warp_loads=True, fused_combine=True, page_prefetch=True),
          BASE.replace(head_dim=64, dtype="fp16", l2_prefetch=64, warp_loads=True),
          BASE.replace(head_dim=256, warps=4, stages=2, warp_loads=True),
          BASE.replace(head_dim=96, warp_loads=True)]


@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_nvcc_zero_spills(arch):
    for cfg, rep in zip(POINTS, nvcc_compile(POINTS, arch)):
        assert rep.spill_stores == 0 and rep.spill_loads == 0 and rep.stack_bytes == 0, (cfg.name, rep)
        assert not rep.warnings, (cfg.name, rep.warnings)


def test_paged_split_rule_fills_the_resident_slots(monkeypatch):
    """Paged caches with two CTAs per SM (4 warps x 3 stages): the split rule fills both slots
    (their CTAs stream side by side); contiguous caches and one-CTA configs keep the shared model."""
    w4s3 = BASE.replace(warps=4, stages=3)
    assert mod.ctas_per_sm(w4s3, 232448) == 2 and mod.ctas_per_sm(BASE, 232448) == 1
    assert mod.PAGED_SPLIT_RULE_RESIDENT            # on (with SMALL_PAGE_WARPS = 4): measured
    monkeypatch.setattr(mod, "PAGED_SPLIT_RULE_RESIDENT", False)
    assert mod.num_splits_for(w4s3, P.replace(features=("paged_kv",)), 132) == 16
    monkeypatch.setattr(mod, "PAGED_SPLIT_RULE_RESIDENT", True)
    for batch, ctx, want_paged, want_contig in ((1, 32768, 32, 16), (8, 32768, 4, 2), (32, 32768, 1, 1)):
        flat = Problem("decode", "bf16", batch, 1, ctx, 32, 8, 128)
        paged = flat.replace(features=("paged_kv",))
        assert mod.num_splits_for(w4s3, paged, 132) == want_paged, (batch, ctx)
        assert mod.num_splits_for(w4s3, flat, 132) == want_contig, (batch, ctx)
        assert mod.num_splits_for(BASE, paged, 132) == mod.num_splits_for(BASE, flat, 132)
        groups = batch * 8
        assert groups * want_paged <= 2 * 132  # never more than one round of both slots


def test_small_page_warps(monkeypatch):
    paged = P.replace(features=("paged_kv",))
    cfg = FAM.heuristic(paged, (9, 0))
    monkeypatch.setattr(mod, "TMA_PAGED_DEFAULT", False)
    monkeypatch.setattr(mod, "SMALL_PAGE_TMA_MAX_KEYS", 0)   # this test: the 4-warp rule alone
    assert mod.SMALL_PAGE_WARPS == 4                          # on: measured (session 15 round B)
    monkeypatch.setattr(mod, "SMALL_PAGE_WARPS", 8)
    assert FAM.call_config(cfg, paged, (9, 0), 16, chosen=True, heuristic=True) == cfg   # 8: off
    monkeypatch.setattr(mod, "SMALL_PAGE_WARPS", 4)
    small = FAM.call_config(cfg, paged, (9, 0), 16, chosen=True, heuristic=True)
    assert (small.warps, small.stages, small.tma) == (4, 3, False) and not small.problems(232448)
    assert FAM.call_config(cfg, paged, (8, 0), 48, chosen=True, heuristic=True).warps == 4
    assert FAM.call_config(cfg, paged, (9, 0), 256, chosen=True, heuristic=True) == cfg   # large pages
    assert FAM.call_config(cfg, P, (9, 0), 0, chosen=True, heuristic=True).warps == cfg.warps  # contiguous
    assert FAM.call_config(cfg, paged, (9, 0), 16, chosen=True, heuristic=False) == cfg  # a tuned entry
    assert FAM.call_config(cfg, paged, (9, 0), 16, chosen=False) == cfg                  # a given config
    monkeypatch.setattr(mod, "TMA_PAGED_DEFAULT", True)                                  # the Hopper loop first
    assert FAM.call_config(cfg, paged, (9, 0), 16, chosen=True, heuristic=True).tma
