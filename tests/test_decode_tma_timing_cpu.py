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
    grid = {(b, c) for b in (1, 8, 32) for c in (8192, 32768, 131072)}
    warm = {(b, c) for b, c, rotate in dt.CELLS.values() if rotate == 1}
    assert grid <= warm and dt.PAGES == (0, 16, 256)
    sizes = [2 * b * c for b, c, _ in dt.CELLS.values()]
    assert sizes == sorted(sizes), "cells run smallest first (--max-seconds drops the largest)"
    assert all(c % 256 == 0 for _, c, _ in dt.CELLS.values()), "paged cells view the same memory"


def test_candidates_are_valid_and_named():
    base = dt.base_config(problem())
    assert not (base.tma or base.fused_combine or base.page_prefetch or base.l2_prefetch or base.warp_loads)
    labels = [label for label, _, _ in dt.candidates(base, 1, 0)]
    assert labels == ["base", "base_l2p256", "base_l2p128", "base_wl", "base_wl_l2p256", "tma"]
    paged = {label: (cfg, mults) for label, cfg, mults in dt.candidates(base, 1, 16)}
    assert list(paged) == ["base", "base_wl", "w4s3", "tma_w4s3"]
    assert paged["w4s3"][1] == (1, 0.5) and dt.candidates(base, 32, 16)[2][2] == (1,)
    assert paged["tma_w4s3"][0].tma and (paged["tma_w4s3"][0].warps, paged["tma_w4s3"][0].stages) == (4, 3)
    assert [x[0] for x in dt.candidates(base, 1, 0, cold=True)] == ["base", "base_l2p256", "base_l2p128",
                                                                    "base_wl"]
    for page in (0, 16):
        for label, cfg, _ in dt.candidates(base, 1, page):
            assert not cfg.problems(232448), (label, cfg.problems(232448))


def test_proposals():
    assert dt.parse_switches("L2_PREFETCH_DEFAULT=256 SMALL_PAGE_WARPS=4 TMA_PAGED_DEFAULT=false") == \
        {"L2_PREFETCH_DEFAULT": 256, "SMALL_PAGE_WARPS": 4, "TMA_PAGED_DEFAULT": False}
    with pytest.raises(ValueError, match="--propose"):
        dt.parse_switches("NOT_A_SWITCH=1")
    before = {k: getattr(mod, k) for k in dt.SWITCH_NAMES}
    prop = dt.parse_switches("L2_PREFETCH_DEFAULT=256 SMALL_PAGE_WARPS=4")
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
    assert len(configs) <= 12 and len(set(configs)) == len(configs)
    assert all(c.splits == 0 for c in configs)
    assert {c.tma for c in configs} == {False, True}


def rec(cell, page, label, us, impl="cuflash", **kw):
    return dict(cell=cell, page_size=page, label=label, us=us, kv_TBps=1.0, impl=impl,
                caches=1, config="", splits=1, spread=1.0, **kw)


def test_summary_proposes_switches():
    records = []
    for cell in ("1x8k", "1x32k", "8x32k"):
        records += [rec(cell, 0, "sdpa_cudnn", 90.0, impl="sdpa_cudnn"), rec(cell, 0, "sdpa_flash", 99.0,
                                                                              impl="sdpa_flash"),
                    rec(cell, 0, "base", 100.0), rec(cell, 0, "heuristic", 100.0), rec(cell, 0, "prop", 97.5),
                    rec(cell, 0, "base_l2p256", 97.5), rec(cell, 0, "base_l2p128", 100.5),
                    rec(cell, 0, "tma", 104.0), rec(cell, 0, "base_wl", 100.2)]
        records += [rec(cell, 16, "base", 110.0), rec(cell, 16, "w4s3", 104.0), rec(cell, 16, "tma_w4s3", 105.0),
                    rec(cell, 16, "heuristic", 110.0), rec(cell, 16, "prop", 104.0), rec(cell, 16, "base_wl", 110.0)]
    records.append(rec("1x8k", 0, "w4s3_x16", 50.0, error="BAD: ..."))    # a broken variant counts nowhere
    records.append(dict(rec("1x8k_cold", 0, "base_l2p256", 1.0), caches=4))  # the cold cell neither
    s = dt.summary(records)
    assert "w4s3_x16" not in s["per_label"]
    l2 = s["per_label"]["base_l2p256"]
    assert math.isclose(l2["geomean"], 100 / 97.5) and l2["cells"] == 3
    sw = s["switches"]
    assert sw["L2_PREFETCH_DEFAULT"]["value"] == 256 and sw["L2_PREFETCH_DEFAULT"]["cells"] == 3
    assert sw["SMALL_PAGE_WARPS"]["value"] == 4
    assert not sw["TMA_PAGED_DEFAULT"]["flip"]                # loses to w4s3
    assert not sw["TMA_DEFAULT"]["flip"] and not sw["WARP_LOADS_DEFAULT"]["flip"]
    cell = s["cells"]["1x32k/p0"]
    assert math.isclose(cell["prop_x_cudnn"], 90 / 97.5) and math.isclose(cell["heuristic_x_cudnn"], 0.9)
    assert math.isclose(s["cells"]["1x32k/p16"]["prop_over_contiguous"], 104 / 97.5)
    text = dt.print_summary(s)
    assert "L2_PREFETCH_DEFAULT = 256" in text and "SMALL_PAGE_WARPS = 4" in text
    assert dt.table(records)  # renders


def test_summary_keeps_a_switch_off_when_a_cell_loses():
    records = [rec("1x8k", 0, "base", 100.0), rec("1x8k", 0, "base_l2p256", 90.0),
               rec("1x32k", 0, "base", 100.0), rec("1x32k", 0, "base_l2p256", 103.0)]
    sw = dt.summary(records)["switches"]
    assert sw["L2_PREFETCH_DEFAULT"]["value"] == 0 and sw["TMA_PAGED_DEFAULT"] is None


def test_switch_names_exist():
    for name in dt.SWITCH_NAMES:
        assert hasattr(mod, name), name
