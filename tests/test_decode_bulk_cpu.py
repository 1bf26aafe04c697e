"""decode_splitkv's ``bulk`` (whole K/V rows by cp.async.bulk on per-slot mbarriers, sm_90) and
``early_merge`` (the fused combine's early partial-O loads) without a GPU: names, template
arguments, validation, the heuristic's switches, and zero spills on sm_90a."""
import shutil

import pytest

from cuflash.compile import nvcc_compile
from cuflash.families import decode_splitkv as mod
from cuflash.families.decode_splitkv import DecodeConfig
from cuflash.problem import Problem
from cuflash.registry import get

FAM = get("decode_splitkv")
BASE = DecodeConfig(8, 16, 3, 1, 4, 128, "bf16", False, fused_combine=True)
P = Problem("decode", "bf16", 1, 1, 8192, 32, 8, 128)


def test_names_template_arguments_smem():
    bk = BASE.replace(bulk=1)
    assert bk.name == "decode_bf16_d128_w8_n16_s3_m1_c4_fc_bk1"
    assert BASE.replace(bulk=2, early_merge=True).name.endswith("_fc_bk2_em")
    assert bk.kernel_name().endswith("cuflash::bf16, true, false, 0, false, false, false, 1>")
    assert BASE.replace(early_merge=True).kernel_name().endswith("false, false, false, 0, true>")
    assert BASE.kernel_name().endswith("cuflash::bf16, true, false, 0, false>")   # plain names unchanged
    assert BASE.replace(lean=True).kernel_name().endswith("0, false, false, true>")
    assert bk.template_args()[-5:-3] == (1, False) and BASE.template_args()[-5:-3] == (0, False)
    assert bk.smem_bytes == BASE.smem_bytes + 3 * 8        # one mbarrier per ring slot
    for cfg in (bk, bk.replace(bulk=2, early_merge=True, splits=7)):
        assert FAM.decode(FAM.encode(cfg), "bf16", False) == cfg
    old = {k: v for k, v in FAM.point(BASE).items() if k not in ("bulk", "early_merge")}
    assert FAM.make(old, P).bulk == 0 and not FAM.make(old, P).early_merge


def test_validation():
    assert not BASE.replace(bulk=1).problems(232448)
    assert any("bulk must be one of" in x for x in BASE.replace(bulk=3).problems(232448))
    for bad in (BASE.replace(bulk=1, warp_loads=True), BASE.replace(bulk=1, page_gather=True),
                BASE.replace(bulk=1, tma=True, fused_combine=False)):
        assert any("bulk:" in x for x in bad.problems(232448)), bad.name
    assert any("early_merge" in x for x in BASE.replace(fused_combine=False, early_merge=True).problems(232448))
    assert "sm_90" in FAM.tma_problem(BASE.replace(bulk=1), P, (8, 0))
    assert FAM.tma_problem(BASE.replace(bulk=1), P, (9, 0)) == ""
    with pytest.raises(ValueError, match="bulk"):                      # a given config on sm_80
        FAM.call_config(BASE.replace(bulk=1), P, (8, 0), 0, chosen=False)
    assert FAM.call_config(BASE.replace(bulk=1), P, (8, 0), 0, chosen=True).bulk == 0   # a chosen one


def test_heuristic_switches(monkeypatch):
    assert mod.BULK_DEFAULT == 0 and mod.BULK_PAGED_DEFAULT == 0 and mod.EARLY_MERGE_DEFAULT   # measured
    assert FAM.space["bulk"] == (0,) and FAM.space["early_merge"] == (False, True)
    heur = FAM.heuristic(P, (9, 0))
    assert heur.bulk == 0 and heur.early_merge and heur.fused_combine and not heur.problems(232448)
    monkeypatch.setattr(mod, "FUSED_COMBINE_DEFAULT", False)
    assert not FAM.heuristic(P, (9, 0)).early_merge          # an option of the fused combine only
    monkeypatch.setattr(mod, "FUSED_COMBINE_DEFAULT", True)
    monkeypatch.setattr(mod, "BULK_DEFAULT", 1)
    monkeypatch.setattr(mod, "EARLY_MERGE_DEFAULT", True)
    flat = FAM.heuristic(P, (9, 0))
    assert flat.bulk == 1 and flat.l2_prefetch == 0 and flat.early_merge and not flat.problems(232448)
    assert FAM.heuristic(P, (8, 0)).bulk == 0                          # sm_90 only
    paged = P.replace(features=("paged_kv",))
    assert FAM.heuristic(paged, (9, 0)).bulk == 0                      # BULK_PAGED_DEFAULT
    monkeypatch.setattr(mod, "BULK_PAGED_DEFAULT", 1)
    small = FAM.call_config(FAM.heuristic(paged, (9, 0)), paged, (9, 0), 16, chosen=True, heuristic=True)
    assert small.tma and small.bulk == 0 and not small.early_merge     # the Hopper loop drops both
    monkeypatch.setattr(mod, "SMALL_PAGE_TMA_MAX_KEYS", 0)
    small = FAM.call_config(FAM.heuristic(paged, (9, 0)), paged, (9, 0), 16, chosen=True, heuristic=True)
    assert (small.warps, small.bulk, small.tma) == (4, 1, False) and not small.problems(232448)


def test_kernel_source():
    from cuflash.compile import render_source

    src = render_source("decode_splitkv")
    assert "if constexpr (kBulk) mbarrier_wait(ring_bar(slot), (iter / kStages) & 1);" in src
    assert "combine_row<kHeadDim, Elem, true, kEarlyMerge>" in src


POINTS = [BASE.replace(bulk=1), BASE.replace(bulk=2, early_merge=True), BASE.replace(bulk=1, warps=4),
          BASE.replace(bulk=1, warps=4, stages=6), BASE.replace(bulk=1, m_tiles=2),
          BASE.replace(bulk=1, head_dim=64, dtype="fp16"), BASE.replace(bulk=1, head_dim=256, warps=4, stages=2),
          BASE.replace(early_merge=True, l2_prefetch=256)]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_nvcc_zero_spills_sm90a():
    for cfg, rep in zip(POINTS, nvcc_compile(POINTS, "sm_90a")):
        assert rep.spill_stores == 0 and rep.spill_loads == 0 and rep.stack_bytes == 0, (cfg.name, rep)
        assert not rep.warnings, (cfg.name, rep.warnings)
