"""tests/decode_tma_timing.py without a GPU: its cells, candidates and kernel list, and the summary
that proposes decode_splitkv's module switches, on made-up records."""
import math

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
    assert labels == ["base", "w4s3", "base_l2p256", "w4s3_l2p256", "base_wl", "w4s3_wl", "tma",
                      "tma_w4s3", "base_fc", "w4s2"]
    for label, cfg, mults in dt.candidates(base, 1, 0):
        assert not cfg.problems(232448), (label, cfg.problems(232448))
        assert mults[0] == 1
    assert "base_fc" not in [x[0] for x in dt.candidates(base, 8, 0)]
    assert "base_fc" not in [x[0] for x in dt.candidates(base, 1, 16)]
    cold = [x[0] for x in dt.candidates(base, 1, 0, cold=True)]
    assert cold == ["base", "w4s3", "base_l2p256", "base_wl", "tma"]
    by_label = {label: cfg for label, cfg, _ in dt.candidates(base, 1, 16)}
    assert by_label["tma_w4s3"].tma and (by_label["tma_w4s3"].warps, by_label["tma_w4s3"].stages) == (4, 3)
    assert by_label["base_l2p256"].l2_prefetch == 256 and by_label["w4s3_wl"].warp_loads


def test_all_configs_is_a_short_compile_list():
    configs = dt.all_configs(list(dt.CELLS), list(dt.PAGES))
    assert len(configs) <= 10 and len(set(configs)) == len(configs)
    assert all(c.splits == 0 for c in configs)
    assert {c.tma for c in configs} == {False, True}


def rec(cell, page, label, us, impl="cuflash", **kw):
    return dict(cell=cell, page_size=page, label=label, us=us, kv_TBps=1.0, impl=impl,
                layout="interleaved", caches=1, config="", splits=1, **kw)


def test_summary_proposes_switches():
    records = []
    for cell in ("1x8k", "1x32k", "8x32k"):
        records += [rec(cell, 0, "sdpa_cudnn", 90.0, impl="sdpa_cudnn"), rec(cell, 0, "base", 100.0),
                    rec(cell, 0, "tma", 97.0), rec(cell, 0, "base_l2p256", 99.5),
                    rec(cell, 0, "base_l2p128", 100.5)]
        records += [rec(cell, 16, "base", 110.0), rec(cell, 16, "tma_w4s3", 104.0),
                    rec(cell, 16, "base_l2p256", 110.0)]
    records.append(rec("1x8k", 0, "w4s3", 50.0, error="BAD: ..."))       # a broken variant counts nowhere
    records.append(dict(rec("1x8k_cold", 0, "tma", 1.0), caches=4))      # the cold cell neither
    s = dt.summary(records)
    assert "w4s3" not in s["per_label"]
    tma = s["per_label"]["tma"]
    assert math.isclose(tma["geomean"], 100 / 97) and tma["cells"] == 3
    assert set(tma["fastest_in"]) == {"1x8k/p0", "1x32k/p0", "8x32k/p0"}
    sw = s["switches"]
    assert sw["TMA_DEFAULT"]["flip"] and sw["TMA_PAGED_DEFAULT"]["flip"]
    l2 = sw["L2_PREFETCH_DEFAULT"]
    assert l2["value"] == 0 and not l2["flip"]   # +0.3% on contiguous, 0 on paged: not enough
    text = dt.print_summary(s)
    assert "TMA_DEFAULT = True" in text and "L2_PREFETCH_DEFAULT = 0" in text
    assert dt.table(records)  # renders


def test_summary_keeps_a_switch_off_when_a_cell_loses():
    records = [rec("1x8k", 0, "base", 100.0), rec("1x8k", 0, "tma", 90.0),
               rec("1x32k", 0, "base", 100.0), rec("1x32k", 0, "tma", 103.0)]
    sw = dt.summary(records)["switches"]
    assert not sw["TMA_DEFAULT"]["flip"] and sw["TMA_PAGED_DEFAULT"] is None


def test_switch_names_exist():
    for name in ("TMA_DEFAULT", "TMA_PAGED_DEFAULT", "L2_PREFETCH_DEFAULT", "WARP_LOADS_DEFAULT"):
        assert hasattr(mod, name)
