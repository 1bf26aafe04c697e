"""decode_splitkv's ``regs_page_shift`` (decode_splitkv_regs' kPageShift: a power-of-two page size's page index by a
shift) without a GPU: the field's name tag, template tail (kPageShift last), validation, call_config (a chosen config
drops it at other page sizes, a given one raises naming k_cache; REGS_PAGE_SHIFT_DEFAULT only at powers of two; the
paged batch-1 rule takes it), and nvcc: the kernels compile for sm_90a without spills
(results/NVIDIA_H200/scripts/dec26_sass_check.py also compares the default kernels' SASS with an older tree's)."""
import shutil

import pytest

from cuflash.families import decode_splitkv as mod
from cuflash.families.decode_splitkv import DecodeConfig
from cuflash.problem import Problem
from cuflash.registry import get

FAM = get("decode_splitkv")
REGS = DecodeConfig(8, 16, 3, 1, 4, 128, "bf16", False, regs=1, early_merge=True, pdl=1)
SHIFT = REGS.replace(regs_page_shift=1)
P8K = Problem("decode", "bf16", 1, 1, 8192, 32, 8, 128, False, False, ("paged_kv",))
ARCH = (9, 0)


def test_field_name_template_tail():
    assert SHIFT.name == "decode_bf16_d128_w8_n16_s3_m1_c4_em_rg1_pdl1_rps"
    assert SHIFT.kernel_name() == ("cuflash::decode_splitkv_regs<8, 16, 1, 128, cuflash::bf16, false, false, 0, false, "
                                   "0, false, 0, 1, 0, 0, 1, 0, 0, 1>")
    assert SHIFT.template_args()[-1] == 1 and REGS.template_args()[-1] == 0   # kPageShift last
    assert REGS.kernel_name() == ("cuflash::decode_splitkv_regs<8, 16, 1, 128, cuflash::bf16, false, false, 0, false, "
                                  "0, false, 0, 1, 0, 0, 1>")   # the default: no trailing kPageShift
    assert SHIFT.smem_bytes == REGS.smem_bytes
    assert FAM.decode(FAM.encode(SHIFT), "bf16", False) == SHIFT


def test_validation():
    for ok in (SHIFT, SHIFT.replace(regs_order=1), SHIFT.replace(regs_page_table=1), SHIFT.replace(head_dim=64, m_tiles=2)):
        assert not ok.problems(232448), ok.name
    assert any("regs_page_shift must be 0 or 1" in x for x in SHIFT.replace(regs_page_shift=2).problems(232448))
    bad = SHIFT.replace(regs=0, early_merge=False, pdl=0)
    assert any("regs_page_shift: an option of the regs kernel" in x for x in bad.problems(232448))


def test_call_config(monkeypatch):
    for page in (16, 256, 1, 0):
        assert FAM.call_config(SHIFT, P8K, ARCH, page, chosen=False).regs_page_shift == 1
    with pytest.raises(ValueError, match=r"^k_cache: the config's regs_page_shift needs a page_block_size .* got 40"):
        FAM.call_config(SHIFT, P8K, ARCH, 40, chosen=False)
    assert FAM.call_config(SHIFT, P8K, ARCH, 40, chosen=True).regs_page_shift == 0
    h = FAM.heuristic(P8K, ARCH)   # the paged batch-1 rule (REGS_BATCH1_PAGED_RULES) takes it at powers of two
    assert [FAM.call_config(h, P8K, ARCH, pg, chosen=True, heuristic=True).regs_page_shift
            for pg in (16, 256, 32, 40, 48)] == [1, 1, 1, 0, 0]
    for p in (P8K.replace(batch=8), P8K.replace(seqlen_k=8193), P8K.replace(features=())):
        c = FAM.heuristic(p, ARCH)   # past the rule (batch 8, more keys), contiguous: none
        assert FAM.call_config(c, p, ARCH, 16 if p.features else 0, chosen=True, heuristic=True).regs_page_shift == 0
    p8 = P8K.replace(batch=8)
    monkeypatch.setattr(mod, "REGS_PAGE_SHIFT_DEFAULT", 1)
    h8 = FAM.heuristic(p8, ARCH)
    assert FAM.call_config(h8, p8, ARCH, 16, chosen=True, heuristic=True).regs_page_shift == 1
    assert FAM.call_config(h8, p8, ARCH, 48, chosen=True, heuristic=True).regs_page_shift == 0


POINTS = [SHIFT, SHIFT.replace(regs_order=1), SHIFT.replace(regs_page_table=1, regs_prefetch=True, regs_prefetch_blocks=3),
          SHIFT.replace(fused_combine=True, light_fence=True, early_merge=False, pdl=0),
          SHIFT.replace(head_dim=64, m_tiles=2), SHIFT.replace(dtype="fp16")]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_nvcc_zero_spills_sm90a():
    from cuflash.compile import nvcc_compile

    for cfg, rep in zip(POINTS, nvcc_compile(POINTS, "sm_90a")):
        assert rep.spill_stores == 0 and rep.spill_loads == 0, (cfg.name, rep)
