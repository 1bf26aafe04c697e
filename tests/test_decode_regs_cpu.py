"""decode_splitkv's ``regs`` option (decode_splitkv_regs: K/V straight into registers) without a
GPU: names, template arguments, validation, shared memory and residency, the heuristic's switch
and call_config's checks, zero spills on sm_90a, and a NumPy mirror of the kernel's fragment
layout (each lane's K / V columns and keys, the mma.sync fragments of Sᵀ = K Qᵀ, movmatrix, the
prmt pairs of Vᵀ, Oᵀ's columns) against plain matrix products."""
import shutil

import numpy as np
import pytest

from cuflash.compile import kernel_dir, nvcc_compile
from cuflash.families import decode_splitkv as mod
from cuflash.families.decode_splitkv import DecodeConfig, ctas_per_sm, row_blocks
from cuflash.problem import Problem
from cuflash.registry import get

FAM = get("decode_splitkv")
BASE = DecodeConfig(8, 16, 3, 1, 4, 128, "bf16", False, fused_combine=True, light_fence=True)
REGS = BASE.replace(regs=2)
P = Problem("decode", "bf16", 1, 1, 32768, 32, 8, 128)


def test_names_template_arguments_smem_residency():
    assert REGS.name == "decode_bf16_d128_w8_n16_s3_m1_c4_fc_lf_rg2"
    assert REGS.kernel_name() == "cuflash::decode_splitkv_regs<8, 16, 1, 128, cuflash::bf16, true, true, 1>"
    assert REGS.template_args() == (8, 16, 1, 128, "bf16", True, True, 1, False, 0, False, 0, 1, 0, 0, 0, 0, 0, 0)
    assert BASE.kernel_name() == ("cuflash::decode_splitkv<8, 16, 3, 1, 128, cuflash::bf16, true, false, 0, false, "
                                  "false, false, 0, false, 0, 0, true>")   # unchanged without it
    assert REGS.rows == 8 and BASE.rows == 16 and REGS.replace(m_tiles=2).rows == 16
    assert REGS.smem_bytes == 8 * 8 * (128 + 6) * 4 + 16   # the warps' merge and the flag
    assert ctas_per_sm(REGS, 232448) == 1 and ctas_per_sm(REGS.replace(warps=4), 232448) == 2
    assert row_blocks(REGS, P) == 1 and row_blocks(REGS, P.replace(seqlen_q=3)) == 2
    assert FAM.decode(FAM.encode(REGS), "bf16", False) == REGS
    old = {k: v for k, v in FAM.point(BASE).items() if k != "regs"}
    assert FAM.make(old, P).regs == 0


def test_validation_and_call_checks():
    assert not REGS.problems(232448) and not REGS.replace(head_dim=64, m_tiles=2, warp_n=32).problems(232448)
    for bad in (REGS.replace(tma=True), REGS.replace(l2_prefetch=256), REGS.replace(lean=True),
                REGS.replace(ring_fill=1), REGS.replace(stream=True), REGS.replace(early_merge=True)):
        assert any("regs:" in x for x in bad.problems(232448)), bad.name
    assert any("head_dim must be one of" in x for x in REGS.replace(head_dim=96).problems(232448))
    assert any("warp_n * head_dim" in x for x in REGS.replace(warp_n=32).problems(232448))
    assert any("m_tiles * head_dim" in x for x in REGS.replace(m_tiles=2).problems(232448))
    assert any("regs must be one of" in x for x in REGS.replace(regs=8).problems(232448))
    assert any("regs_prefetch" in x for x in BASE.replace(regs_prefetch=True).problems(232448))
    pf = REGS.replace(regs_prefetch=True)
    assert pf.name.endswith("_rg2_rpf") and pf.kernel_name().endswith(", 1, true>") and pf.template_args()[-11] is True
    ra = REGS.replace(regs_ahead=3)
    assert ra.name.endswith("_rg2_ra3") and ra.kernel_name().endswith(", 1, false, 3>")
    assert ra.template_args()[-11:] == (False, 3, False, 0, 1, 0, 0, 0, 0, 0, 0) and not ra.problems(232448)
    pb = pf.replace(regs_prefetch_blocks=2)
    assert pb.name.endswith("_rpf_pb2") and pb.kernel_name().endswith(", 1, true, 0, false, 0, 2>") and not pb.problems(232448)
    assert any("needs regs_prefetch" in x for x in REGS.replace(regs_prefetch_blocks=2).problems(232448))
    ro = REGS.replace(regs_order=2)
    assert ro.name.endswith("_rg2_ro2") and ro.kernel_name().endswith(", 1, false, 0, false, 2>") and not ro.problems(232448)
    assert any("regs_order must be one of" in x for x in REGS.replace(regs_order=3).problems(232448))
    assert any("regs_order: an option" in x for x in BASE.replace(regs_order=1).problems(232448))
    ral1 = ra.replace(regs_ahead_l1=True)
    assert ral1.name.endswith("_rg2_ra3l1") and ral1.kernel_name().endswith(", 1, false, 3, true>")
    assert any("regs_ahead must be one of" in x for x in REGS.replace(regs_ahead=1).problems(232448))
    assert any("regs_ahead, regs_ahead_l1" in x for x in BASE.replace(regs_ahead=2).problems(232448))
    assert any("needs regs_ahead" in x for x in REGS.replace(regs_ahead_l1=True).problems(232448))
    assert FAM.decode(FAM.encode(ral1), "bf16", False) == ral1
    with pytest.raises(ValueError, match="^q: the regs kernel"):
        FAM.call_config(REGS, P.replace(head_dim=120), (9, 0), 0, chosen=False)
    assert FAM.call_config(REGS, P.replace(head_dim=120), (9, 0), 0, chosen=True).regs == 0
    assert FAM.call_config(REGS, P.replace(features=("paged_kv",)), (9, 0), 16, chosen=True, heuristic=True) == REGS


def test_heuristic_switch(monkeypatch):
    assert mod.REGS_DEFAULT == 6 and FAM.heuristic(P, (9, 0)).regs == 6
    assert not FAM.heuristic(P, (8, 0)).regs                                # sm_90 only (timed there)
    assert not FAM.heuristic(P.replace(head_dim=64), (9, 0)).regs          # d 64: not timed
    monkeypatch.setattr(mod, "REGS_DEFAULT", 0)
    assert not FAM.heuristic(P, (9, 0)).regs
    monkeypatch.setattr(mod, "REGS_DEFAULT", 2)
    monkeypatch.setattr(mod, "REGS_HEAD_DIM_DEFAULT", (64, 128))
    monkeypatch.setattr(mod, "REGS_BATCH1_HINT", ())   # (batch 1 at 8k keys: plain loads)
    for b, ctx, feats in ((1, 8192, ()), (8, 32768, ()), (64, 8192, ("paged_kv",)), (2, 4096, ("window", "softcap"))):
        cfg = FAM.heuristic(P.replace(batch=b, seqlen_k=ctx, features=feats), (9, 0))
        assert cfg.regs == 2 and (cfg.warps, cfg.warp_n, cfg.m_tiles) == (8, 16, 1), cfg.name
        # the fused merge with light_fence, but one contiguous row of at most 8k keys (REGS_BATCH1_RULES: separate)
        assert cfg.light_fence == cfg.fused_combine == (b > 1 or bool(feats)), cfg.name
        assert not cfg.problems(232448)
    assert FAM.heuristic(P.replace(head_dim=64, nheads=8, nheads_kv=2, seqlen_q=4), (9, 0)).m_tiles == 2
    assert not FAM.heuristic(P.replace(seqlen_q=4), (9, 0)).regs            # 16 rows at d 128: the cp.async loop
    assert not FAM.heuristic(P.replace(head_dim=96), (9, 0)).regs
    assert not FAM.heuristic(P.replace(head_dim=120), (9, 0)).regs          # rounded up to 128: no column mask


def test_batch1_rules(monkeypatch):
    """REGS_BATCH1_RULES: one contiguous batch row above 8k keys takes the early L1 prefetch of 3
    blocks; 8k keys and less, paged caches, batch 2 and REGS_BATCH1 False keep the heuristic's.
    REGS_BATCH1_HINT: one batch row of at most 8k keys, contiguous or paged, takes plain loads."""
    monkeypatch.setattr(mod, "REGS_SHAPE_RULES", ())   # (their own test below)
    cfg = FAM.heuristic(P, (9, 0))   # 1 x 32k
    assert cfg.regs == 6 and cfg.regs_prefetch and cfg.regs_prefetch_blocks == 3 and not cfg.problems(232448)
    assert cfg.regs_order == 1   # the interleaved order's first blocks (independent of the row's length)
    assert cfg.kernel_name() == "cuflash::decode_splitkv_regs<8, 16, 1, 128, cuflash::bf16, true, true, 5, true, 0, false, 1, 3>"
    for p in (P.replace(seqlen_k=8192), P.replace(batch=2), P.replace(features=("paged_kv",))):
        c = FAM.heuristic(p, (9, 0))
        assert not c.regs_prefetch and c.regs_prefetch_blocks == 1, (p, c.name)
        assert c.regs == (1 if p.seqlen_k == 8192 else 6), (p, c.name)   # REGS_BATCH1_HINT: plain loads up to 8k keys
    assert FAM.heuristic(P.replace(seqlen_k=8193), (9, 0)).regs_prefetch
    for p in (P.replace(seqlen_k=4096, features=("paged_kv",)), P.replace(seqlen_k=100)):
        assert FAM.heuristic(p, (9, 0)).regs == 1, p
    assert FAM.heuristic(P.replace(seqlen_k=8192, batch=2), (9, 0)).regs == 6
    for b, ctx, tma in ((1, 8192, False), (1, 4096, False), (2, 4096, True)):   # page 16: the hint's calls stay on regs
        p = P.replace(batch=b, seqlen_k=ctx, features=("paged_kv",))
        c = FAM.call_config(FAM.heuristic(p, (9, 0)), p, (9, 0), 16, chosen=True, heuristic=True)
        assert bool(c.tma) == tma and c.regs == (0 if tma else 1), (p, c.name)
    monkeypatch.setattr(mod, "REGS_BATCH1", False)
    assert not FAM.heuristic(P, (9, 0)).regs_prefetch
    assert FAM.heuristic(P.replace(seqlen_k=8192), (9, 0)).regs == 6


def test_page_table_config(monkeypatch):
    """regs_page_table: name, the kernel's last template argument (the others written out), shared
    memory (REGS_PAGE_IDS ids, matching kPageIds), validation, and the heuristic's switch: paged
    calls only, with REGS_PAGED_BATCH1_PREFETCH's early prefetch at batch 1."""
    pt = REGS.replace(regs_page_table=1)
    assert pt.name.endswith("_rg2_rpt1") and pt.template_args()[-5] == 1 and not pt.problems(232448)
    assert pt.kernel_name().endswith(", 1, false, 0, false, 0, 1, 0, 1>")
    assert pt.smem_bytes == REGS.smem_bytes + 4 * mod.REGS_PAGE_IDS
    src = (kernel_dir() / "decode_splitkv.cu").read_text()
    assert f"constexpr int kPageIds = {mod.REGS_PAGE_IDS};" in src
    assert any("regs_page_table must be 0, 1 or 2" in x for x in REGS.replace(regs_page_table=3).problems(232448))
    assert not REGS.replace(regs_page_table=2).problems(232448)
    assert any("regs_page_table: an option of the regs kernel" in x for x in BASE.replace(regs_page_table=1).problems(232448))
    assert FAM.decode(FAM.encode(pt), "bf16", False) == pt
    paged = P.replace(features=("paged_kv",))
    assert mod.REGS_PAGE_TABLE_DEFAULT in (0, 1)
    monkeypatch.setattr(mod, "REGS_SHAPE_RULES", ())
    monkeypatch.setattr(mod, "REGS_PAGE_TABLE_DEFAULT", 1)
    monkeypatch.setattr(mod, "REGS_PAGED_BATCH1_PREFETCH", ((8192, 0), (1 << 31, 2)))
    assert FAM.heuristic(P, (9, 0)).regs_page_table == 0                      # contiguous: none
    c = FAM.heuristic(paged, (9, 0))                                            # 1 x 32k paged
    assert c.regs_page_table == 1 and c.regs_prefetch and c.regs_prefetch_blocks == 2 and not c.problems(232448)
    c8 = FAM.heuristic(paged.replace(seqlen_k=8192), (9, 0))
    assert c8.regs_page_table == 1 and not c8.regs_prefetch
    cb = FAM.heuristic(paged.replace(batch=8), (9, 0))
    assert cb.regs_page_table == 1 and not cb.regs_prefetch
    assert FAM.call_config(c, paged.replace(head_dim=120), (9, 0), 16, chosen=True).regs_page_table == 0


def test_shape_rules(monkeypatch):
    """REGS_SHAPE_RULES as shipped: paged batch 1 takes the page table (with the early prefetch of 3
    blocks above 8k keys; the table alone only for pages under 128 keys, call_config), paged batches 2-16
    up to 32k keys the table with the prefetch, contiguous batches 2-64 from 8k keys the interleaved
    order with its first 3 blocks prefetched (contiguous batch 1: REGS_BATCH1_RULES, the same above 8k
    keys); other shapes keep the heuristic's."""
    def call(b, ctx, page):
        p = P.replace(batch=b, seqlen_k=ctx, features=("paged_kv",) if page else ())
        c = FAM.call_config(FAM.heuristic(p, (9, 0)), p, (9, 0), page, chosen=True, heuristic=True)
        assert not c.problems(232448), c.name
        return (c.regs_page_table, c.regs_prefetch, c.regs_prefetch_blocks, c.regs_order)
    assert call(1, 8192, 16) == (1, False, 1, 0) and call(1, 8192, 256) == (0, False, 1, 0)
    assert call(1, 4096, 32) == (1, False, 1, 0)
    for ctx in (8193, 32768, 131072):
        assert call(1, ctx, 16) == call(1, ctx, 256) == (1, True, 3, 0), ctx
    for b, ctx in ((8, 8192), (8, 32768), (2, 32768), (16, 8192)):
        assert call(b, ctx, 16) == call(b, ctx, 256) == (1, True, 3, 0), (b, ctx)
    for b, ctx in ((8, 131072), (32, 8192), (64, 8192)):
        assert call(b, ctx, 16) == call(b, ctx, 256) == (0, False, 1, 0), (b, ctx)
    for b, ctx in ((2, 32768), (8, 8192), (8, 131072), (32, 8192), (64, 32768)):
        assert call(b, ctx, 0) == (0, True, 3, 1), (b, ctx)
    assert call(8, 4096, 0) == call(128, 8192, 0) == (0, False, 1, 0)
    assert call(1, 32768, 0) == (0, True, 3, 1) and call(1, 8192, 0) == (0, False, 1, 2)   # REGS_BATCH1_RULES
    monkeypatch.setattr(mod, "REGS_SHAPE_RULES", ())
    assert call(8, 32768, 0) == call(8, 32768, 16) == call(1, 8192, 16) == (0, False, 1, 0)


CL16 = REGS.replace(regs=6, regs_cluster=16, fused_combine=False, light_fence=False)


def test_cluster_config():
    """regs_cluster: names, the kernel's last template argument, shared memory, validation, the split
    count, the cluster launch (no combine launch, no partials' workspace, no counters) and the
    non-portable cluster size's kernel attribute."""
    assert CL16.name == "decode_bf16_d128_w8_n16_s3_m1_c4_rg6_cl16"
    assert CL16.kernel_name() == ("cuflash::decode_splitkv_regs<8, 16, 1, 128, cuflash::bf16, false, false, 5, false, "
                                  "0, false, 0, 1, 16>")
    assert CL16.template_args()[-6] == 16 and not CL16.problems(232448)
    assert CL16.smem_bytes == 8 * 8 * (128 + 6) * 4 + 16 + 8 * 129 * 4   # + the split's O and LSE
    for bad, why in ((CL16.replace(fused_combine=True), "no fused_combine"), (CL16.replace(regs=0), "regs;"),
                     (CL16.replace(splits=8), "splits 0 or 16"), (CL16.replace(regs_cluster=3), "must be one of"),
                     (CL16.replace(head_dim=64, regs_cluster=32), "must be one of")):
        assert any(why in x for x in bad.problems(232448)), (bad.name, bad.problems(232448))
    assert not CL16.replace(head_dim=64, m_tiles=2).problems(232448)   # 4 columns a CTA
    assert mod.num_splits_for(CL16, P, 132) == 16 and FAM.split_count(CL16, P, 132) == 16
    p8k = P.replace(seqlen_k=8192)
    launches = FAM.launches(CL16, p8k, 132)
    assert [(s.role, s.grid, s.threads, s.cluster) for s in launches] == [("main", (16, 8, 1), 256, 16)]
    assert [s.cluster for s in FAM.launches(CL16.replace(regs_cluster=0, fused_combine=True), p8k, 132)] == [0]
    ws = FAM.workspace(CL16, p8k)
    assert "o_partial" not in ws and ws["total"] == 0 and FAM.counters(CL16, p8k) == 0
    assert FAM.kernel_attributes(CL16) == {"main": {mod.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED: 1}}
    assert FAM.kernel_attributes(CL16.replace(regs_cluster=8)) == {}
    plain = FAM.without_cluster(CL16)
    assert plain.regs_cluster == 0 and plain.fused_combine == mod.FUSED_COMBINE_DEFAULT and not plain.problems(232448)
    assert FAM.decode(FAM.encode(CL16), "bf16", False) == CL16
    # call_config: the Hopper loop for small pages drops the cluster, as a head dim the kernel cannot run
    small = FAM.call_config(CL16, P.replace(batch=2, seqlen_k=2048, features=("paged_kv",)), (9, 0), 16, chosen=True,
                            heuristic=True)
    assert small.tma and small.regs_cluster == 0 and not small.problems(232448)
    assert FAM.call_config(CL16, P.replace(head_dim=120), (9, 0), 0, chosen=True).regs_cluster == 0


def test_cluster_rules(monkeypatch):
    """REGS_CLUSTER_RULES: one contiguous batch row within a rule's keys, where the groups' CTAs fit
    REGS_CLUSTER_MAX_CTAS; REGS_CLUSTER_DEFAULT (tests) puts every regs call on it."""
    p8k = P.replace(seqlen_k=8192)
    monkeypatch.setattr(mod, "REGS_CLUSTER_RULES", ((8192, 16), (1 << 31, 0)))
    cfg = FAM.heuristic(p8k, (9, 0))
    assert cfg.regs_cluster == 16 and not cfg.fused_combine and not cfg.light_fence and not cfg.problems(232448)
    for p in (P, p8k.replace(batch=2), p8k.replace(features=("paged_kv",)), p8k.replace(nheads=64, nheads_kv=16)):
        assert FAM.heuristic(p, (9, 0)).regs_cluster == 0, p   # 32k keys; batch 2; paged; 256 CTAs
    monkeypatch.setattr(mod, "REGS_CLUSTER_RULES", ())
    monkeypatch.setattr(mod, "REGS_CLUSTER_DEFAULT", 8)
    for p in (P, p8k.replace(batch=4, features=("paged_kv",))):
        assert FAM.heuristic(p, (9, 0)).regs_cluster == 8


def test_cluster_launch_structs():
    """cuflash.launch's ctypes mirrors of cuda.h's CUlaunchAttribute and CUlaunchConfig (cuLaunchKernelEx)."""
    import ctypes

    from cuflash.launch import LaunchAttribute, LaunchConfig

    assert ctypes.sizeof(LaunchAttribute) == 72 and LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(LaunchConfig) == 56
    assert (LaunchConfig.smem.offset, LaunchConfig.stream.offset, LaunchConfig.attrs.offset,
            LaunchConfig.num_attrs.offset) == (24, 32, 40, 48)


POINTS = [REGS, REGS.replace(regs=1, fused_combine=False, light_fence=False), REGS.replace(regs=3), REGS.replace(regs=4),
          REGS.replace(regs=1, regs_prefetch=True),
          REGS.replace(regs=5), REGS.replace(regs=6),
          REGS.replace(head_dim=64, dtype="fp16"), REGS.replace(head_dim=64, m_tiles=2), REGS.replace(warps=4),
          REGS.replace(regs=7), REGS.replace(regs=6, regs_ahead=2), REGS.replace(regs=6, regs_ahead=4, regs_ahead_l1=True),
          REGS.replace(head_dim=64, regs_ahead=3), REGS.replace(regs=6, regs_order=1),
          REGS.replace(regs=6, regs_order=2, regs_ahead=2), REGS.replace(head_dim=64, m_tiles=2, regs_order=2),
          REGS.replace(regs=6, regs_prefetch=True, regs_prefetch_blocks=2), CL16,
          CL16.replace(head_dim=64, m_tiles=2), CL16.replace(regs_prefetch=True, regs_prefetch_blocks=3),
          REGS.replace(regs=1, regs_page_table=1), REGS.replace(regs=6, regs_page_table=1, regs_prefetch=True,
                                                                  regs_prefetch_blocks=3),
          REGS.replace(head_dim=64, m_tiles=2, regs_page_table=1), REGS.replace(warps=4, regs_page_table=1),
          REGS.replace(regs=6, regs_order=1, regs_prefetch=True, regs_prefetch_blocks=3),
          REGS.replace(regs=6, regs_order=2, regs_prefetch=True, regs_prefetch_blocks=3)]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_nvcc_zero_spills_sm90a():
    for cfg, rep in zip(POINTS, nvcc_compile(POINTS, "sm_90a")):
        assert rep.spill_stores == 0 and rep.spill_loads == 0, (cfg.name, rep)


# ---- a NumPy mirror of the fragment layout (kernels_cu/decode_splitkv.cu, decode_splitkv_regs) ----
def _mma(a_frags, b_frags):
    """m16n8k16 from per-lane fragments (pairs of values per 32-bit register; ptx.cuh's layout)."""
    a, b = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        (a[g, 2 * t], a[g, 2 * t + 1]), (a[g + 8, 2 * t], a[g + 8, 2 * t + 1]) = a_frags[lane][0], a_frags[lane][1]
        (a[g, 2 * t + 8], a[g, 2 * t + 9]), (a[g + 8, 2 * t + 8], a[g + 8, 2 * t + 9]) = a_frags[lane][2], a_frags[lane][3]
        (b[2 * t, g], b[2 * t + 1, g]), (b[2 * t + 8, g], b[2 * t + 9, g]) = b_frags[lane]
    d = a @ b
    return [(d[l // 4, 2 * (l % 4)], d[l // 4, 2 * (l % 4) + 1], d[l // 4 + 8, 2 * (l % 4)], d[l // 4 + 8, 2 * (l % 4) + 1])
            for l in range(32)]


def _load16(row, col):  # a 16-byte load: 8 columns as 4 registers of 2
    return [(row[col + 2 * r], row[col + 2 * r + 1]) for r in range(4)]


@pytest.mark.parametrize("d", [64, 128])
def test_fragment_layout_mirror(d):
    rng = np.random.default_rng(1)
    k, v, q = rng.standard_normal((16, d)), rng.standard_normal((16, d)), rng.standard_normal((8, d))
    k_loads, o_tiles = d // 32, d // 16
    lanes = [(l // 4, l % 4) for l in range(32)]
    kr = [[[_load16(k[g + 8 * j], 32 * i + 8 * t) for i in range(k_loads)] for j in range(2)] for g, t in lanes]
    qf = []
    for g, t in lanes:
        steps = []
        for i in range(k_loads):
            x = _load16(q[g], 32 * i + 8 * t)
            steps += [(x[0], x[1]), (x[2], x[3])]
        qf.append(steps)
    s = np.zeros((32, 4))
    for c in range(d // 16):
        i, r = c // 2, 2 * (c % 2)
        s += np.array(_mma([[kr[l][0][i][r], kr[l][1][i][r], kr[l][0][i][r + 1], kr[l][1][i][r + 1]] for l in range(32)],
                           [qf[l][c] for l in range(32)]))
    st = k @ q.T   # Sᵀ: keys x query rows
    for l, (g, t) in enumerate(lanes):
        for e in range(4):
            assert abs(s[l, e] - st[g + 8 * (e >> 1), 2 * t + (e & 1)]) < 1e-9

    def movmatrix_trans(pairs):
        m = np.zeros((8, 8))
        for l in range(32):
            m[l // 4, 2 * (l % 4)], m[l // 4, 2 * (l % 4) + 1] = pairs[l]
        return [(m.T[l // 4, 2 * (l % 4)], m.T[l // 4, 2 * (l % 4) + 1]) for l in range(32)]

    pb = list(zip(movmatrix_trans([(s[l, 0], s[l, 1]) for l in range(32)]),
                  movmatrix_trans([(s[l, 2], s[l, 3]) for l in range(32)])))
    vr = [[[_load16(v[2 * t + (q_ & 1) + 8 * (q_ >> 1)], 64 * h + 8 * g) for h in range(d // 64)] for q_ in range(4)]
          for g, t in lanes]

    def prmt(a, b, u):   # 0x5410 (even column u: low halves) / 0x7632 (odd: high halves)
        return (a[u % 2], b[u % 2])

    o = [[None] * o_tiles for _ in range(32)]
    for mt in range(o_tiles):
        u0, u1 = mt, o_tiles + mt
        frags = []
        for l in range(32):
            x = vr[l]
            reg = lambda key, u: x[key][u // 8][(u % 8) // 2]   # noqa: E731
            frags.append([prmt(reg(0, u0), reg(1, u0), u0), prmt(reg(0, u1), reg(1, u1), u1),
                          prmt(reg(2, u0), reg(3, u0), u0), prmt(reg(2, u1), reg(3, u1), u1)])
        for l, out in enumerate(_mma(frags, pb)):
            o[l][mt] = out
    ot = st.T @ v   # query rows x columns
    for l, (g, t) in enumerate(lanes):
        for mt in range(o_tiles):
            for half in range(2):
                u = half * o_tiles + mt
                col = 64 * (u // 8) + 8 * g + u % 8
                for j in range(2):
                    assert abs(o[l][mt][2 * half + j] - ot[2 * t + j, col]) < 1e-9
