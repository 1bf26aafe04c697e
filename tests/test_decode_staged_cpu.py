"""decode_splitkv's ``regs_staged`` (decode_splitkv_regs' kStaged: a per-warp cp.async ring of K/V blocks past the
two register sets) without a GPU: the field's name tag, template tail (kStaged last), validation, shared memory
and residency, make() of an older point, the heuristic's switches (REGS_STAGED_DEFAULT, REGS_STAGED_RULES), the
co-resident split count, and nvcc: the staged kernels compile for sm_90a and sm_80 without spills
(results/.../scripts/staged_sass_check.py compares the default kernels' SASS with an older tree's)."""
import shutil

import pytest

from cuflash.compile import nvcc_compile
from cuflash.families import decode_splitkv as mod
from cuflash.families.decode_splitkv import DecodeConfig, ctas_per_sm, num_splits_for
from cuflash.problem import Problem
from cuflash.registry import get

FAM = get("decode_splitkv")
BASE = DecodeConfig(8, 16, 3, 1, 4, 128, "bf16", False, fused_combine=True, light_fence=True)
REGS = BASE.replace(regs=1)
W4 = REGS.replace(warps=4, regs_staged=2)
P8K = Problem("decode", "bf16", 1, 1, 8192, 32, 8, 128)


def _no_spec(monkeypatch):
    """REGS_BATCH1_RULES' 8k entry without regs_order 2 / regs_spec (session 28), which the staged ring excludes."""
    first = {k: v for k, v in mod.REGS_BATCH1_RULES[0][1].items() if k not in ("regs_order", "regs_spec")}
    monkeypatch.setattr(mod, "REGS_BATCH1_RULES", ((mod.REGS_BATCH1_RULES[0][0], first),) + mod.REGS_BATCH1_RULES[1:])


def test_field_name_template_tail_smem():
    assert W4.name == "decode_bf16_d128_w4_n16_s3_m1_c4_fc_lf_rg1_rst2"
    assert W4.kernel_name() == ("cuflash::decode_splitkv_regs<4, 16, 1, 128, cuflash::bf16, true, true, 0, false, "
                                "0, false, 0, 1, 0, 0, 0, 2>")
    assert REGS.kernel_name() == "cuflash::decode_splitkv_regs<8, 16, 1, 128, cuflash::bf16, true, true, 0>"
    assert W4.template_args()[-3] == 2 and REGS.template_args()[-3] == 0   # kSpec, kPageShift follow
    assert W4.replace(warps=8).template_args()[:-3] == REGS.template_args()[:-3]
    # a slot: per lane 16 bytes per load, 8 K and 8 V loads per 16-key tile at d 128 (4 and 4 at d 64)
    assert W4.smem_bytes == REGS.replace(warps=4).smem_bytes + 4 * 2 * 16 * 32 * 16
    d64 = W4.replace(head_dim=64)
    assert d64.smem_bytes == REGS.replace(warps=4, head_dim=64).smem_bytes + 4 * 2 * 8 * 32 * 16
    assert ctas_per_sm(W4, 232448) == 2 and ctas_per_sm(REGS.replace(regs_staged=2), 232448) == 1
    assert FAM.decode(FAM.encode(W4), "bf16", False) == W4
    assert FAM.make({k: v for k, v in FAM.point(REGS).items() if k != "regs_staged"}, P8K).regs_staged == 0


def test_validation():
    for ok in (W4, W4.replace(regs_staged=1), W4.replace(regs_staged=4), REGS.replace(regs_staged=3), W4.replace(regs_order=1),
               W4.replace(regs=6, regs_prefetch=True, regs_prefetch_blocks=3), W4.replace(fused_combine=False,
                                                                                        light_fence=False),
               W4.replace(head_dim=64, m_tiles=2), W4.replace(regs_page_table=1), W4.replace(pdl=1)):
        assert not ok.problems(232448), ok.name
    assert any("regs_staged must be one of" in x for x in W4.replace(regs_staged=5).problems(232448))
    assert any("shared memory" in x for x in REGS.replace(regs_staged=4).problems(232448))   # 8 warps x 4 x 8 KB
    for bad in (BASE.replace(regs_staged=2), W4.replace(regs_ahead=2), W4.replace(regs_order=2),
                W4.replace(regs=6, regs_cluster=16, fused_combine=False, light_fence=False)):
        assert any("regs_staged: an option of the regs kernel" in x for x in bad.problems(232448)), bad.name


def test_split_count_co_resident():
    """A staged config takes the co-resident model: 32 splits of 256 keys at 1 x 8k on 132 SMs (cuDNN's grid),
    the plain 4-warp config the shared-bandwidth model's 16; an explicit count stays."""
    assert num_splits_for(W4, P8K, 132) == 32 and num_splits_for(REGS.replace(warps=4), P8K, 132) == 16
    assert num_splits_for(W4, P8K.replace(seqlen_k=4096), 132) == 32
    assert num_splits_for(W4, P8K.replace(batch=8), 132) == 4
    assert mod._splits(W4.replace(splits=7), P8K) == 7


def test_heuristic_switches(monkeypatch):
    _no_spec(monkeypatch)
    h = FAM.heuristic(P8K, (9, 0))
    assert h.regs_staged == 0 and h.warps == 8   # off by default
    monkeypatch.setattr(mod, "REGS_STAGED_RULES", ((1, 8192, {"warps": 4, "regs_staged": 2}),))
    c = FAM.heuristic(P8K, (9, 0))
    assert (c.warps, c.regs_staged, c.regs) == (4, 2, 1) and not c.problems(232448)
    assert FAM.heuristic(P8K.replace(seqlen_k=8193), (9, 0)).regs_staged == 0       # past max keys
    assert FAM.heuristic(P8K.replace(batch=2), (9, 0)).regs_staged == 0             # past max batch
    paged = P8K.replace(features=("paged_kv",))
    assert FAM.heuristic(paged, (9, 0)).regs_staged == 0                            # rules: contiguous only
    monkeypatch.setattr(mod, "REGS_STAGED_RULES", ())
    monkeypatch.setattr(mod, "REGS_STAGED_DEFAULT", 2)
    assert FAM.heuristic(P8K, (9, 0)).regs_staged == 2
    assert FAM.heuristic(paged, (9, 0)).regs_staged == 2                            # tests: the fallback loop
    monkeypatch.setattr(mod, "REGS_CLUSTER_DEFAULT", 4)
    cl = FAM.heuristic(P8K, (9, 0))
    assert cl.regs_cluster == 4 and cl.regs_staged == 0 and not cl.problems(232448)


POINTS = [W4, W4.replace(regs_staged=1), W4.replace(regs_staged=3), W4.replace(regs_staged=4),
          REGS.replace(regs_staged=2), REGS.replace(regs_staged=3), W4.replace(fused_combine=False, light_fence=False),
          W4.replace(regs=6, regs_order=1, regs_prefetch=True, regs_prefetch_blocks=3),
          W4.replace(head_dim=64), W4.replace(head_dim=64, m_tiles=2), W4.replace(dtype="fp16")]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_nvcc_zero_spills(arch):
    """No spills on sm_90a (where the heuristic runs the regs kernel) and, for the plain-load points, on sm_80
    (there the evict-first policy register with the early prefetch spills 12 bytes: the regs kernel is sm_90's)."""
    points = POINTS if arch == "sm_90a" else [c for c in POINTS if c.regs == 1]
    for cfg, rep in zip(points, nvcc_compile(points, arch)):
        assert rep.spill_stores == 0 and rep.spill_loads == 0, (cfg.name, rep)


def test_separate_combine_early_merge(monkeypatch):
    """With regs, early_merge is the separate decode_combine's kEarly (after kPdl); the fused merge always loads
    early, so regs with fused_combine refuses it."""
    sep = W4.replace(fused_combine=False, light_fence=False)
    em = sep.replace(early_merge=True)
    assert em.name == "decode_bf16_d128_w4_n16_s3_m1_c4_em_rg1_rst2" and not em.problems(232448)
    assert FAM.kernel_names(sep)["combine"] == "cuflash::decode_combine<128, cuflash::bf16>"
    assert FAM.kernel_names(em)["combine"] == "cuflash::decode_combine<128, cuflash::bf16, false, true>"
    assert FAM.kernel_names(em.replace(pdl=1))["combine"] == "cuflash::decode_combine<128, cuflash::bf16, true, true>"
    assert FAM.kernel_names(sep.replace(pdl=1))["combine"] == "cuflash::decode_combine<128, cuflash::bf16, true>"
    assert em.kernel_name() == sep.kernel_name()   # the main kernel does not see it
    assert any("regs: early_merge" in x for x in W4.replace(early_merge=True).problems(232448))
    _no_spec(monkeypatch)
    monkeypatch.setattr(mod, "REGS_STAGED_RULES", ((1, 8192, {"warps": 4, "regs_staged": 2, "fused_combine": False,
                                                             "light_fence": False, "early_merge": True, "pdl": 1}),))
    c = FAM.heuristic(P8K, (9, 0))
    assert (c.warps, c.regs_staged, c.fused_combine, c.early_merge, c.pdl) == (4, 2, False, True, 1)
    assert [s.role for s in FAM.launches(c, P8K, 132)] == ["main", "combine"]
    assert FAM.launches(c, P8K, 132)[0].grid == (32, 8, 1)
