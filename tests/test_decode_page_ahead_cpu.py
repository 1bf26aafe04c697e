"""decode_splitkv's ``regs_page_ahead`` (decode_splitkv_regs' kPageAhead: a window of page ids per warp, each block's
taken by shuffles; 2: the first window read before cache_seqlens) without a GPU: the field's name tag, template tail
(kPageAhead last), validation, the switch REGS_PAGE_AHEAD_DEFAULT (paged calls only; the shipped heuristic
unchanged), and nvcc: the kernels compile for sm_90a without spills (results/NVIDIA_H200/scripts/dec26_sass_check.py
also compares the default kernels' SASS with an older tree's)."""
import shutil

import pytest

from cuflash.families import decode_splitkv as mod
from cuflash.families.decode_splitkv import DecodeConfig
from cuflash.problem import Problem
from cuflash.registry import get

FAM = get("decode_splitkv")
REGS = DecodeConfig(8, 16, 3, 1, 4, 128, "bf16", False, regs=1, early_merge=True, pdl=1)
AHEAD = REGS.replace(regs_page_ahead=2)
P8K = Problem("decode", "bf16", 1, 1, 8192, 32, 8, 128, False, False, ("paged_kv",))


def test_field_name_template_tail():
    assert AHEAD.name == "decode_bf16_d128_w8_n16_s3_m1_c4_em_rg1_pdl1_rpa2"
    assert AHEAD.kernel_name() == ("cuflash::decode_splitkv_regs<8, 16, 1, 128, cuflash::bf16, false, false, 0, false, "
                                   "0, false, 0, 1, 0, 0, 1, 0, 0, 2>")
    assert AHEAD.template_args()[-1] == 2 and REGS.template_args()[-1] == 0   # kPageAhead last
    assert AHEAD.replace(regs_page_ahead=0).template_args()[:-1] == AHEAD.template_args()[:-1]
    assert REGS.kernel_name() == ("cuflash::decode_splitkv_regs<8, 16, 1, 128, cuflash::bf16, false, false, 0, false, "
                                  "0, false, 0, 1, 0, 0, 1>")   # the default: no trailing kPageAhead
    assert AHEAD.smem_bytes == REGS.smem_bytes
    assert FAM.decode(FAM.encode(AHEAD), "bf16", False) == AHEAD
    assert FAM.make({k: v for k, v in FAM.point(REGS).items() if k != "regs_page_ahead"}, P8K).regs_page_ahead == 0


def test_validation():
    for ok in (AHEAD, AHEAD.replace(regs_page_ahead=1), AHEAD.replace(regs_order=1), AHEAD.replace(regs_order=2),
               AHEAD.replace(regs_page_table=1), AHEAD.replace(head_dim=64, m_tiles=2), AHEAD.replace(pdl=3)):
        assert not ok.problems(232448), ok.name
    assert any("regs_page_ahead must be one of (0, 1, 2)" in x for x in AHEAD.replace(regs_page_ahead=3).problems(232448))
    bad = AHEAD.replace(regs=0, early_merge=False, pdl=0)
    assert any("regs_page_ahead: an option of the regs kernel" in x for x in bad.problems(232448))


def test_heuristic_switch(monkeypatch):
    for p in (P8K, P8K.replace(features=()), P8K.replace(batch=8)):
        assert FAM.heuristic(p, (9, 0)).regs_page_ahead == 0, p   # shipped: none
    monkeypatch.setattr(mod, "REGS_PAGE_AHEAD_DEFAULT", 2)
    assert FAM.heuristic(P8K, (9, 0)).regs_page_ahead == 2
    assert FAM.heuristic(P8K.replace(batch=8), (9, 0)).regs_page_ahead == 2
    assert FAM.heuristic(P8K.replace(features=()), (9, 0)).regs_page_ahead == 0   # contiguous: none


POINTS = [AHEAD, AHEAD.replace(regs_page_ahead=1), AHEAD.replace(regs_order=1),
          AHEAD.replace(fused_combine=True, light_fence=True, early_merge=False, pdl=0),
          AHEAD.replace(head_dim=64, m_tiles=2), AHEAD.replace(dtype="fp16", regs_page_table=1),
          AHEAD.replace(head_dim=64, warp_n=32)]   # two tiles per warp: 16 blocks a window


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_nvcc_zero_spills_sm90a():
    from cuflash.compile import nvcc_compile

    for cfg, rep in zip(POINTS, nvcc_compile(POINTS, "sm_90a")):
        assert rep.spill_stores == 0 and rep.spill_loads == 0, (cfg.name, rep)
