"""decode_splitkv's ``regs_spec`` (decode_splitkv_regs' kSpec: regs_order 2's early loads and Q's issued before
cache_seqlens is read, that read ordered after them) without a GPU: the field's name tag, template tail (kSpec
last), validation, the switch REGS_SPEC_DEFAULT (only with regs_order 2; the shipped heuristic unchanged), and nvcc:
the kSpec kernels compile for sm_90a without spills and issue the early 16-byte loads before the length's 32-bit
load (results/.../scripts/spec_sass_check.py also compares the default kernels' SASS with an older tree's)."""
import re
import shutil

import pytest

from cuflash.families import decode_splitkv as mod
from cuflash.families.decode_splitkv import DecodeConfig
from cuflash.problem import Problem
from cuflash.registry import get

FAM = get("decode_splitkv")
REGS = DecodeConfig(8, 16, 3, 1, 4, 128, "bf16", False, regs=1)
SPEC = REGS.replace(regs_order=2, regs_spec=1, early_merge=True, pdl=1)
P8K = Problem("decode", "bf16", 1, 1, 8192, 32, 8, 128)


def test_field_name_template_tail():
    assert SPEC.name == "decode_bf16_d128_w8_n16_s3_m1_c4_em_rg1_ro2_pdl1_rsp1"
    assert SPEC.kernel_name() == ("cuflash::decode_splitkv_regs<8, 16, 1, 128, cuflash::bf16, false, false, 0, false, "
                                  "0, false, 2, 1, 0, 0, 1, 0, 1>")
    assert SPEC.template_args()[-2] == 1 and REGS.template_args()[-2] == 0   # kSpec, then kPageShift
    assert SPEC.replace(regs_spec=0).template_args()[:-2] == SPEC.template_args()[:-2]
    assert SPEC.replace(regs_spec=0).kernel_name() == ("cuflash::decode_splitkv_regs<8, 16, 1, 128, cuflash::bf16, "
                                                       "false, false, 0, false, 0, false, 2, 1, 0, 0, 1>")
    assert SPEC.smem_bytes == SPEC.replace(regs_spec=0).smem_bytes
    assert FAM.decode(FAM.encode(SPEC), "bf16", False) == SPEC
    assert FAM.make({k: v for k, v in FAM.point(REGS).items() if k != "regs_spec"}, P8K).regs_spec == 0


def test_validation():
    for ok in (SPEC, SPEC.replace(regs_spec=2), SPEC.replace(pdl=0), SPEC.replace(fused_combine=True, light_fence=True, early_merge=False, pdl=0),
               SPEC.replace(head_dim=64, m_tiles=2), SPEC.replace(regs_page_table=1), SPEC.replace(regs=6)):
        assert not ok.problems(232448), ok.name
    assert any("regs_spec must be 0, 1 or 2" in x for x in SPEC.replace(regs_spec=3).problems(232448))
    for bad in (SPEC.replace(regs_order=1), SPEC.replace(regs_order=0), REGS.replace(regs=0, regs_spec=1, regs_order=2)):
        assert any("regs_spec: an option of the regs kernel's regs_order 2" in x for x in bad.problems(232448)), bad.name


def test_heuristic_switch(monkeypatch):
    h = FAM.heuristic(P8K, (9, 0))
    assert (h.regs_spec, h.regs_order, h.pdl, h.early_merge, h.fused_combine) == (1, 2, 1, True, False)   # the rule
    for p in (P8K.replace(seqlen_k=8193), P8K.replace(batch=2), P8K.replace(features=("paged_kv",))):
        assert FAM.heuristic(p, (9, 0)).regs_spec == 0, p   # past the rule's keys, batch 2, paged: none
    monkeypatch.setattr(mod, "REGS_BATCH1_RULES", ((8192, {"pdl": 1}),))
    assert FAM.heuristic(P8K, (9, 0)).regs_spec == 0
    monkeypatch.setattr(mod, "REGS_SPEC_DEFAULT", 1)
    assert FAM.heuristic(P8K, (9, 0)).regs_spec == 0                      # only with regs_order 2
    monkeypatch.setattr(mod, "REGS_BATCH1_RULES", ((8192, {"regs_order": 2, "pdl": 1}),))
    c = FAM.heuristic(P8K, (9, 0))
    assert (c.regs_order, c.regs_spec) == (2, 1) and not c.problems(232448)
    monkeypatch.setattr(mod, "REGS_SPEC_DEFAULT", 0)
    assert FAM.heuristic(P8K, (9, 0)).regs_spec == 0
    monkeypatch.setattr(mod, "REGS_BATCH1_RULES", ((8192, {"regs_order": 2, "regs_spec": 1}),))
    assert FAM.heuristic(P8K, (9, 0)).regs_spec == 1                      # a rule may set it


POINTS = [SPEC, SPEC.replace(regs_spec=2), SPEC.replace(pdl=0), SPEC.replace(fused_combine=True, light_fence=True, early_merge=False, pdl=0),
          SPEC.replace(head_dim=64, m_tiles=2), SPEC.replace(dtype="fp16"), SPEC.replace(regs_page_table=1)]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_nvcc_zero_spills_sm90a():
    from cuflash.compile import nvcc_compile

    for cfg, rep in zip(POINTS, nvcc_compile(POINTS, "sm_90a")):
        assert rep.spill_stores == 0 and rep.spill_loads == 0, (cfg.name, rep)
