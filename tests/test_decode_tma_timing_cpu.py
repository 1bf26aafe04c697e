"""tests/decode_tma_timing.py without a GPU: its cells, candidates, proposals and kernel list, and
the summary that proposes decode_splitkv's module switches, on made-up records."""
import math

import pytest

import decode_tma_timing as dt
from cuflash.families import decode_splitkv as mod
from cuflash.problem import Problem


def problem(batch=1, ctx=8192, page=0):
    return Problem("decode", "bf16", batch, 1, ctx, dt.HQ, dt.HK, dt.D, False, False,
                   ("paged_kv",) if page else ())


def test_cells_cover_the_issue_grid():
    grid = {(b, c) for b in (1, 8, 32, 64) for c in (8192, 32768, 131072)}
    warm = {(b, c) for b, c, rotate in dt.CELLS.values() if rotate == 1}
    assert grid <= warm and dt.PAGES == (0, 16, 256)
    sizes = [2 * b * c for b, c, _ in dt.CELLS.values()]
    assert sizes == sorted(sizes), "cells run smallest first (--max-seconds drops the largest)"
    assert all(c % 256 == 0 for _, c, _ in dt.CELLS.values()), "paged cells view the same memory"


def test_candidates_are_valid_and_named():
    base = dt.base_config(problem())
    assert not (base.tma or base.fused_combine or base.page_prefetch or base.l2_prefetch or base.warp_loads)
    flat = {label: (cfg, mults) for label, cfg, mults in dt.candidates(base, 1, 0, ctx=8192)}
    assert list(flat) == ["base", "em", "w4em", "w4n32em"]
    for label, warps, warp_n, stages in (("em", 8, 16, 3), ("w4em", 4, 16, 3), ("w4n32em", 4, 32, 2)):
        cfg = flat[label][0]
        assert (cfg.warps, cfg.warp_n, cfg.stages, cfg.fused_combine, cfg.l2_prefetch, cfg.early_merge) == \
            (warps, warp_n, stages, True, 256, True), label
    assert flat["w4em"][1] == ("res", 33 / 16)
    assert [mod.ctas_per_sm(flat[k][0], 232448) for k in ("em", "w4em", "w4n32em")] == [1, 2, 1]
    assert {label: m for label, _, m in dt.candidates(base, 8, 0, ctx=32768)}["w4em"] == ("res",)
    assert [x[0] for x in dt.candidates(base, 32, 0, ctx=32768)] == ["base"]
    small = dt.base_config(problem(64, 8192))                        # CONTIGUOUS_SMALL_TILE_MIN_GROUPS
    assert (small.warps, small.stages) == (4, 3)
    assert [(x[0], x[1].warps) for x in dt.candidates(small, 64, 0, ctx=8192)] == [("base", 4), ("w8s3", 8)]
    assert [x[0] for x in dt.candidates(base, 1, 16, ctx=8192)] == ["base"]
    large = {label: cfg for label, cfg, _ in dt.candidates(base, 1, 256, ctx=8192)}
    assert list(large) == ["base", "tma4"] and large["tma4"].tma and large["tma4"].warps == 4
    assert "tma4" not in {x[0] for x in dt.candidates(base, 32, 256, ctx=32768)}
    assert [x[0] for x in dt.candidates(base, 1, 0, cold=True)] == ["base", "em"]
    for page in (0, 16, 256):
        for label, cfg, _ in dt.candidates(base, 1, page, ctx=8192) + dt.candidates(base, 64, page, ctx=131072):
            assert not cfg.problems(232448), (label, cfg.problems(232448))


def test_resident_splits_fill_the_slots():
    base = dt.base_config(problem(1, 32768))
    w4s3 = base.replace(warps=4, stages=3, fused_combine=True, l2_prefetch=256)
    before = (mod.SPLIT_RULE_RESIDENT_CONTIGUOUS, mod.PAGED_SPLIT_RULE_RESIDENT)
    assert mod.num_splits_for(w4s3, problem(1, 32768), 132) == 16       # 128 CTAs: one per SM
    assert dt.resident_splits(w4s3, problem(1, 32768), 132) == 32       # 256: two per SM
    assert (mod.SPLIT_RULE_RESIDENT_CONTIGUOUS, mod.PAGED_SPLIT_RULE_RESIDENT) == before


def test_proposals():
    assert dt.parse_switches("L2_PREFETCH_DEFAULT=256 SMALL_PAGE_WARPS=4 TMA_PAGED_DEFAULT=false") == \
        {"L2_PREFETCH_DEFAULT": 256, "SMALL_PAGE_WARPS": 4, "TMA_PAGED_DEFAULT": False}
    with pytest.raises(ValueError, match="--propose"):
        dt.parse_switches("NOT_A_SWITCH=1")
    before = {k: getattr(mod, k) for k in dt.SWITCH_NAMES}
    prop = dt.parse_switches("L2_PREFETCH_DEFAULT=256 SMALL_PAGE_WARPS=4 PAGED_SPLIT_RULE_RESIDENT=true")
    flat = dt.proposal_config(prop, problem(1, 32768), 0)
    assert flat.l2_prefetch == 256 and flat.warps == 8 and flat.splits == 16
    small = dt.proposal_config(prop, problem(1, 32768, 16), 16)
    assert (small.warps, small.stages, small.l2_prefetch, small.splits) == (4, 3, 0, 32)
    assert dt.proposal_config(prop, problem(1, 32768, 256), 256).warps == 8
    assert {k: getattr(mod, k) for k in dt.SWITCH_NAMES} == before       # switches restored
    assert dt.proposal_config({}, problem(1, 32768), 0).l2_prefetch == mod.L2_PREFETCH_DEFAULT


def test_all_configs_is_a_short_compile_list():
    prop = [dt.parse_switches("L2_PREFETCH_DEFAULT=256 SMALL_PAGE_WARPS=4")]
    configs = dt.all_configs(list(dt.CELLS), list(dt.PAGES), proposals=prop)
    assert len(configs) <= 16 and len(set(configs)) == len(configs)   # 16: the heuristic's light_fence kernels besides the candidates'
    assert all(c.splits == 0 for c in configs)


def rec(cell, page, label, us, impl="cuflash", **kw):
    return {**dict(cell=cell, page_size=page, label=label, us=us, kv_TBps=1.0, impl=impl,
                   caches=1, config="", splits=1, spread=1.0), **kw}


def test_summary_judges_proposals():
    records = []
    for cell in ("1x8k", "1x32k", "8x32k"):
        records += [rec(cell, 0, "sdpa_cudnn", 90.0, impl="sdpa_cudnn"), rec(cell, 0, "sdpa_flash", 99.0,
                                                                              impl="sdpa_flash"),
                    rec(cell, 0, "base", 100.0), rec(cell, 0, "base_l2p256", 97.5), rec(cell, 0, "base_wl", 100.2),
                    rec(cell, 0, "heuristic", 100.0, config="h"), rec(cell, 0, "prop", 97.5, config="p"),
                    rec(cell, 0, "prop2", 100.0, config="h")]
        records += [rec(cell, 16, "base", 110.0), rec(cell, 16, "w4s3", 104.0),
                    rec(cell, 16, "heuristic", 110.0, config="h"), rec(cell, 16, "prop", 110.0, config="h"),
                    rec(cell, 16, "prop2", 104.0, config="q")]
    records.append(rec("1x8k", 0, "base_x16", 50.0, error="BAD: ..."))      # a broken variant counts nowhere
    records += [dict(rec("1x8k_cold", 0, "heuristic", 22.0), caches=4),    # the cold cell: its own ratio
                dict(rec("1x8k_cold", 0, "prop", 21.5), caches=4), dict(rec("1x8k_cold", 0, "prop2", 22.0), caches=4)]
    s = dt.summary(records)
    assert "base_x16" not in s["per_label"]
    l2 = s["per_label"]["base_l2p256"]
    assert math.isclose(l2["geomean"], 100 / 97.5) and l2["cells"] == 3
    prop, prop2 = s["proposals"]["prop"], s["proposals"]["prop2"]
    assert prop["flip"] and prop["paged"] is None and prop["contiguous"]["cells"] == 3
    assert math.isclose(prop["cold"], 22 / 21.5)
    assert prop2["flip"] and prop2["contiguous"] is None and math.isclose(prop2["paged"]["geomean"], 110 / 104)
    cell = s["cells"]["1x32k/p0"]
    assert math.isclose(cell["prop_x_cudnn"], 90 / 97.5) and math.isclose(cell["heuristic_x_cudnn"], 0.9)
    assert math.isclose(s["cells"]["1x32k/p16"]["prop2_over_contiguous"], 104 / 100)
    text = dt.print_summary(s)
    assert "prop   FLIP" in text and "prop2  FLIP" in text
    assert dt.table(records)  # renders


def test_summary_keeps_a_proposal_off_when_a_cell_loses():
    records = [rec("1x8k", 0, "heuristic", 100.0, config="h"), rec("1x8k", 0, "prop", 90.0, config="p"),
               rec("1x32k", 0, "heuristic", 100.0, config="h"), rec("1x32k", 0, "prop", 103.0, config="p")]
    assert not dt.summary(records)["proposals"]["prop"]["flip"]
    cold = records + [dict(rec("1x8k_cold", 0, "heuristic", 22.0), caches=4),
                      dict(rec("1x8k_cold", 0, "prop", 29.0), caches=4)]
    cold[3] = rec("1x32k", 0, "prop", 97.0, config="p")
    assert not dt.summary(cold)["proposals"]["prop"]["flip"]     # the cold cell lost


def test_switch_names_exist():
    for name in dt.SWITCH_NAMES:
        assert hasattr(mod, name), name


def test_compact_lines():
    records = [rec("1x8k", 0, "sdpa_flash", 21.0, impl="sdpa_flash"), rec("1x8k", 0, "sdpa_cudnn", 12.1, impl="sdpa_cudnn"),
               rec("1x8k", 0, "heuristic", 18.0), rec("1x8k", 0, "l2p_fc", 12.9, error="BAD: x"),
               rec("1x8k", 16, "base", 22.0), rec("1x8k", 16, "base_pg", None, error="RuntimeError: y")]
    lines = dt.compact(records).splitlines()
    assert lines == ["1x8k/p0: cudnn 12.1, flash 21.0, l2p_fc 12.9!BAD, heuristic 18.0",
                     "1x8k/p16: base 22.0, base_pg -!ERR"]
