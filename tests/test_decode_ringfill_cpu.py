"""decode_splitkv's ``ring_fill`` (the cp.async loop's prologue fills every ring slot; 2: each
iteration's load before S) and ``dynamic`` (a group's splits claim its K/V blocks one at a time
from a counter) without a GPU: names, template arguments, validation, counters, shared memory,
the heuristic's switches, the capture fallback, and zero spills on sm_90a."""
import shutil

import pytest

from cuflash.compile import nvcc_compile
from cuflash.families import decode_splitkv as mod
from cuflash.families.decode_splitkv import DecodeConfig
from cuflash.problem import Problem
from cuflash.registry import get

FAM = get("decode_splitkv")
BASE = DecodeConfig(8, 16, 3, 1, 4, 128, "bf16", False, fused_combine=True, l2_prefetch=256, early_merge=True)
P = Problem("decode", "bf16", 1, 1, 8192, 32, 8, 128)


def test_names_template_arguments_smem_counters():
    rf = BASE.replace(ring_fill=2)
    dyn = BASE.replace(ring_fill=1, dynamic=True)
    assert rf.name == "decode_bf16_d128_w8_n16_s3_m1_c4_fc_l2p256_em_rf2"
    assert dyn.name.endswith("_em_rf1_dyn") and BASE.replace(ring_fill=1, dynamic=2).name.endswith("_rf1_ilv")
    assert BASE.kernel_name().endswith("256, false, false, false, 0, true>")   # unchanged without them
    assert rf.kernel_name().endswith("256, false, false, false, 0, true, 2>")
    assert dyn.kernel_name().endswith("0, true, 1, 1>")
    assert rf.template_args()[-3:-1] == (2, False) and dyn.template_args()[-3:-1] == (1, True)
    assert rf.smem_bytes == BASE.smem_bytes and dyn.smem_bytes == BASE.smem_bytes + 2 * 3 * 4
    groups = P.batch * P.nheads_kv
    assert FAM.counters(BASE, P) == groups and FAM.counters(dyn, P) == 2 * groups
    assert FAM.counters(dyn.replace(splits=1), P) == 0 and FAM.counters(dyn.replace(dynamic=2), P) == groups
    for cfg in (rf, dyn, dyn.replace(splits=7, lean=True)):
        assert FAM.decode(FAM.encode(cfg), "bf16", False) == cfg
    old = {k: v for k, v in FAM.point(BASE).items() if k not in ("ring_fill", "dynamic")}
    made = FAM.make(old, P)
    assert made.ring_fill == 0 and not made.dynamic


def test_validation():
    for ok in (BASE.replace(ring_fill=1), BASE.replace(ring_fill=2, fused_combine=False, early_merge=False),
               BASE.replace(ring_fill=2, dynamic=True), BASE.replace(ring_fill=1, bulk=1, l2_prefetch=0)):
        assert not ok.problems(232448), ok.name
    assert any("ring_fill must be one of" in x for x in BASE.replace(ring_fill=3).problems(232448))
    assert any("ring_fill" in x for x in BASE.replace(ring_fill=1, tma=True, fused_combine=False, early_merge=False,
                                                      l2_prefetch=0).problems(232448))
    assert not BASE.replace(ring_fill=1, dynamic=2, fused_combine=False, early_merge=False).problems(232448)
    assert any("dynamic must be one of" in x for x in BASE.replace(ring_fill=1, dynamic=3).problems(232448))
    for bad in (BASE.replace(dynamic=True), BASE.replace(ring_fill=1, dynamic=True, fused_combine=False, early_merge=False),
                BASE.replace(ring_fill=1, dynamic=True, bulk=1, l2_prefetch=0),
                BASE.replace(ring_fill=1, dynamic=True, warp_loads=True),
                BASE.replace(ring_fill=1, dynamic=True, page_prefetch=True)):
        assert any("dynamic:" in x for x in bad.problems(232448)), bad.name


def test_heuristic_switches(monkeypatch):
    assert (mod.RING_FILL_DEFAULT, mod.DYNAMIC_DEFAULT, mod.DYNAMIC_MAX_GROUPS, mod.DYNAMIC_MIN_KEYS) == (0, 1, 8, 65536)
    heur = FAM.heuristic(P, (9, 0))                                     # 1 x 8k: neither
    assert heur.ring_fill == 0 and heur.dynamic == 0
    long = P.replace(seqlen_k=65536)
    heur = FAM.heuristic(long, (9, 0))                                  # 1 x 64k: the claims, ring_fill 1
    assert heur.dynamic == 1 and heur.ring_fill == 1 and not heur.problems(232448)
    assert FAM.heuristic(long.replace(batch=2), (9, 0)).dynamic == 0   # 16 groups
    assert FAM.heuristic(long.replace(features=("paged_kv",)), (9, 0)).dynamic == 0
    assert FAM.space["ring_fill"] == mod.RING_FILL_SPACE and FAM.space["dynamic"] == mod.DYNAMIC_SPACE
    monkeypatch.setattr(mod, "RING_FILL_DEFAULT", 2)
    monkeypatch.setattr(mod, "DYNAMIC_MIN_KEYS", 0)
    heur = FAM.heuristic(P, (9, 0))
    assert heur.ring_fill == 2 and heur.dynamic == 1 and not heur.problems(232448)
    monkeypatch.setattr(mod, "FUSED_COMBINE_DEFAULT", False)
    assert FAM.heuristic(P, (9, 0)).dynamic == 0                        # 1 needs the fused combine
    monkeypatch.setattr(mod, "DYNAMIC_DEFAULT", 2)
    assert FAM.heuristic(P, (9, 0)).dynamic == 2                        # 2 does not
    monkeypatch.setattr(mod, "FUSED_COMBINE_DEFAULT", True)
    paged = P.replace(features=("paged_kv",))
    small = FAM.call_config(FAM.heuristic(paged, (9, 0)), paged, (9, 0), 16, chosen=True, heuristic=True)
    assert small.tma and small.ring_fill == 0 and not small.dynamic   # the Hopper loop drops both


POINTS = [BASE.replace(ring_fill=1), BASE.replace(ring_fill=2), BASE.replace(ring_fill=2, dynamic=True),
          BASE.replace(ring_fill=1, dynamic=True, lean=True), BASE.replace(ring_fill=2, warps=4, m_tiles=2),
          BASE.replace(ring_fill=1, dynamic=True, head_dim=64, dtype="fp16", warps=4),
          BASE.replace(ring_fill=2, dynamic=True, head_dim=256, warps=4, stages=2),
          BASE.replace(ring_fill=1, dynamic=2, fused_combine=False, early_merge=False)]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_nvcc_zero_spills_sm90a():
    for cfg, rep in zip(POINTS, nvcc_compile(POINTS, "sm_90a")):
        assert rep.spill_stores == 0 and rep.spill_loads == 0 and rep.stack_bytes == 0, (cfg.name, rep)
        assert not rep.warnings, (cfg.name, rep.warnings)
