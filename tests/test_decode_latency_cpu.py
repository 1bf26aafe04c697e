"""decode_splitkv's batch-1 latency and small-page options without a GPU (issue 13): the
``page_gather`` config field (name, template arguments, rules, space, the heuristic's switch, points
from before it), the split merge's batched loads in the source, and nvcc builds for sm_80 and
sm_90a with zero spills (the plain kernel's template arguments gain a trailing default: its code is
what it was)."""
import re
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
PAGED = P.replace(features=("paged_kv",))


def test_page_gather_names_and_template_arguments():
    pg = BASE.replace(page_gather=True)
    assert pg.name == BASE.name + "_pg"
    assert BASE.template_args()[10] is False and pg.template_args()[10] is True  # kPageGather
    # the plain kernel's name expression is what it was (the trailing default is left out)
    assert BASE.kernel_name() == "cuflash::decode_splitkv<8, 16, 3, 1, 128, cuflash::bf16, false, false, 0, false>"
    assert pg.kernel_name() == ("cuflash::decode_splitkv<8, 16, 3, 1, 128, cuflash::bf16, false, false, 0, "
                                "false, true>")
    for cfg in (pg, pg.replace(warps=4, splits=7, fused_combine=True)):
        assert FAM.decode(FAM.encode(cfg), "bf16", False) == cfg
    assert pg.smem_bytes == BASE.smem_bytes and pg.threads == BASE.threads


def test_page_gather_rules_space_points():
    assert not BASE.replace(page_gather=True, warps=4).problems(232448)
    assert "no page_gather" in " ".join(BASE.replace(tma=True, page_gather=True).problems())
    assert FAM.space["page_gather"] == mod.PAGE_GATHER_SPACE == (False,)   # measured slower: out
    point = {k: getattr(BASE, k) for k in FAM.space if k != "page_gather"}
    assert FAM.make(point, P).page_gather is False  # a tuned entry / study point from before it


def test_page_gather_heuristic_switch(monkeypatch):
    assert FAM.heuristic(PAGED, (9, 0)).page_gather is False   # off until a GPU timing says on
    monkeypatch.setattr(mod, "PAGE_GATHER_DEFAULT", True)
    assert FAM.heuristic(PAGED, (9, 0)).page_gather is True
    assert FAM.heuristic(P, (9, 0)).page_gather is False      # contiguous caches: nothing to gather
    # the small-page variants keep it; the Hopper loop drops it (its own loads)
    cfg = FAM.heuristic(PAGED, (9, 0))
    monkeypatch.setattr(mod, "SMALL_PAGE_WARPS", 4)
    monkeypatch.setattr(mod, "SMALL_PAGE_TMA_MAX_KEYS", 0)
    small = FAM.call_config(cfg, PAGED, (9, 0), 16, chosen=True, heuristic=True)
    assert (small.warps, small.page_gather) == (4, True)
    monkeypatch.setattr(mod, "TMA_PAGED_DEFAULT", True)
    tma = FAM.call_config(cfg, PAGED, (9, 0), 16, chosen=True, heuristic=True)
    assert tma.tma and not tma.page_gather and not tma.problems(232448)


def test_kernel_source():
    src = render_source("decode_splitkv")
    assert ("bool kWarpLoads = false, bool kPageGather = false, bool kLean = false, int kBulk = 0,\n"
            "          bool kEarlyMerge = false, int kRingFill = 0, int kDynamic = 0, bool kLightFence = false>") in src
    # the split merge: a batch's loads, then a fence that keeps ptxas from sinking them, then sums
    merge = src[src.index("void combine_row("):src.index("// ---- decode_splitkv_tma")]
    loads, fence, sums = (merge.index("load_partial4<kL2Only>(o_s"), merge.index("__threadfence_block();"),
                          merge.index("acc[0] += wt[i] * x[i].x"))
    assert loads < fence < sums
    assert re.search(r"constexpr int kLoadBatch = 16;", merge)


NVCC = shutil.which("nvcc")
POINTS = [BASE.replace(page_gather=True), BASE.replace(page_gather=True, warps=4),
          BASE.replace(page_gather=True, m_tiles=2), BASE.replace(l2_prefetch=256, fused_combine=True),
          BASE.replace(head_dim=64, dtype="fp16", page_gather=True, fused_combine=True),
          BASE.replace(head_dim=256, stages=2, page_gather=True, fused_combine=True)]


@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_nvcc_zero_spills(arch):
    for cfg, rep in zip(POINTS, nvcc_compile(POINTS, arch)):
        assert rep.spill_stores == 0 and rep.spill_loads == 0 and rep.stack_bytes == 0, (cfg.name, rep)
        assert not rep.warnings, (cfg.name, rep.warnings)


def test_small_page_rule_by_call_size(monkeypatch):
    """SMALL_PAGE_TMA_MAX_KEYS (on: 32768, measured): small paged calls take the Hopper loop,
    larger ones the 4-warp cp.async loop (SMALL_PAGE_WARPS = 4); 0 leaves the 4-warp rule alone."""
    def cfg_for(batch, ctx, page=16, arch=(9, 0)):
        p = Problem("decode", "bf16", batch, 1, ctx, 32, 8, 128, False, False, ("paged_kv",))
        return FAM.call_config(FAM.heuristic(p, arch), p, arch, page, chosen=True, heuristic=True)

    assert (mod.SMALL_PAGE_TMA_MAX_KEYS, mod.SMALL_PAGE_WARPS, mod.PAGED_SPLIT_RULE_RESIDENT) == (32768, 4, True)
    monkeypatch.setattr(mod, "TMA_PAGED_DEFAULT", False)
    small, large = cfg_for(1, 32768), cfg_for(8, 32768)
    assert not cfg_for(1, 65536).tma and not cfg_for(8, 8192).tma   # 65536 keys: the 4-warp rule
    assert small.tma and (small.warps, small.stages) == (4, 3) and not small.fused_combine
    assert not large.tma and large.warps == 4 and large.fused_combine
    assert not cfg_for(1, 16384, page=256).tma             # large pages: the contiguous tiles, but
    assert cfg_for(1, 8192, page=256).tma                  # up to LARGE_PAGE_TMA_MAX_KEYS (8192)
    assert not cfg_for(1, 8192, page=256, arch=(8, 0)).tma
    assert cfg_for(1, 8192, arch=(8, 0)).warps == 4         # no TMA below sm_90: the 4-warp rule
    assert not cfg_for(1, 8192, arch=(8, 0)).tma
    monkeypatch.setattr(mod, "SMALL_PAGE_TMA_MAX_KEYS", 0)
    assert not cfg_for(1, 8192).tma and cfg_for(1, 8192).warps == 4


def test_small_tiles_from_many_groups(monkeypatch):
    """Contiguous calls with at least CONTIGUOUS_SMALL_TILE_MIN_GROUPS (batch, KV head, row block)
    groups take 4 warps x 3 stages (two CTAs per SM; measured at batch 64 x 8 KV heads); fewer
    groups, paged caches and head dims above 128 keep their tiles; 0 turns it off."""
    def heur(batch, seqlen_q=1, features=(), d=128):
        return FAM.heuristic(Problem("decode", "bf16", batch, seqlen_q, 8192, 32, 8, d, False, False, features), (9, 0))

    assert mod.CONTIGUOUS_SMALL_TILE_MIN_GROUPS == 512
    assert (heur(64).warps, heur(64).stages) == (4, 3) and heur(64).fused_combine
    assert heur(32).warps == 8 and heur(64, features=("paged_kv",)).warps == 8
    d256 = heur(64, d=256)                          # above d 128: the heuristic's own shrink rule
    two = heur(64, seqlen_q=5)                      # 20 packed rows: two row tiles, 512 groups
    assert (two.warps, two.m_tiles) == (4, 2) and not two.problems(232448)
    assert mod.ctas_per_sm(heur(64), 232448) == 2
    monkeypatch.setattr(mod, "CONTIGUOUS_SMALL_TILE_MIN_GROUPS", 0)
    assert heur(64).warps == 8 and heur(64, d=256) == d256
