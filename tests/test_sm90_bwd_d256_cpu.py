"""CPU checks of sm90_bwd's head-dim-256 tile (issue 14): BM 64, BN 64, 2 consumer warpgroups
sharing the K/V block's 64 keys (kSharedKeys). dK_j, dV_j (64 keys x 256 fp32 each) do not fit
one warpgroup's registers, so each warpgroup keeps 128 of their columns; it computes Sᵀ, dPᵀ for
32 of the 64 queries (wgmma m64n32k16), and Pᵀ, dSᵀ go through shared memory (stmatrix) as the A
operands of dV, dK (SS); dQ_i's 128 columns per warpgroup in two 64-column pieces by red.add.
Head dims 129..256 run it (192 with zero-filled columns).

Config rules, names, shared memory, the space, the heuristic, for_problem, supports / selection
with the one-line switch D256_ABOVE_FA2, the kernel source, and nvcc -cubin sm_90a of every d256
instantiation the family allows (features, deterministic, overlap_sdp, varlen): zero spills, no
stack, no serialized wgmma. No GPU needed.
"""
import itertools
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from cuflash import registry
from cuflash.compile import kernel_dir, nvcc_compile
from cuflash.families import sm90_bwd
from cuflash.families.base import ConfigError
from cuflash.families.sm90_bwd import MAX_ACCUM_REGS, Sm90BwdConfig
from cuflash.problem import Problem
from cuflash.select import choose

from test_sm90_cpu import serialized  # noqa: E402

NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
FAM = registry.get("sm90_bwd")
MAX_SMEM = 227 * 1024
D256 = Sm90BwdConfig(64, 64, 2, 2, 256, "bf16", False)


def heur256(causal=False, deterministic=False, dtype="bf16", **kw):
    """The d256 heuristic's config of a plain call as the module's switches set it (dq_writer for
    unordered calls: HEURISTIC_D256_DQ_WRITER; with it roles: HEURISTIC_D256_ROLES)."""
    dqw = not deterministic and sm90_bwd.HEURISTIC_D256_DQ_WRITER
    return D256.replace(dtype=dtype, causal=causal, deterministic=deterministic, dq_writer=dqw,
                        roles=dqw and dtype in sm90_bwd.HEURISTIC_D256_ROLES, **kw)


def problem(head_dim=256, dtype="bf16", causal=False, deterministic=False, features=(), **kw):
    p = Problem("bwd", dtype, 2, 300, 200, 8, 2, head_dim, causal, deterministic)
    return p.replace(features=tuple(features), **kw) if features or kw else p


def test_tile_names_split_and_shared_memory():
    assert D256.problems() == [] and D256.shared_keys
    assert (D256.s_cols, D256.dkv_cols, D256.dq_cols) == (32, 128, 128)
    assert D256.name == "sm90bwd_bf16_d256_full_BM64_BN64_s2_c2"
    assert D256.kernel_name() == "cuflash::sm90_bwd<64, 64, 2, 2, 256, cuflash::bf16, false, false>"
    # K, V 32 KB each; 2 x (Q, dO) 32 KB each; dS, Pᵀ, dSᵀ 8 KB each; LSE, D; barriers; alignment
    assert D256.smem_bytes == 2 * 32768 + 4 * 32768 + 3 * 8192 + 4 * 256 + 8 * 5 + 1024 <= MAX_SMEM
    # the words of softcap and dropout stay in registers (no shared memory added); dq_writer
    # stages dQ_i's part in the Q/dO ring slot (no tile of its own)
    assert D256.replace(dq_writer=True).smem_bytes == D256.smem_bytes
    assert D256.replace(dq_writer=True).dq_writer_bufs == 0
    assert D256.replace(softcap=True, dropout=True).smem_bytes == D256.smem_bytes
    # dK, dV 64 + 64; Sᵀ, dPᵀ 16 + 16; Pᵀ, dSᵀ fragments 8 + 8; dQ 64 (the kernel: two pieces of 32)
    assert D256.accum_regs == 128 + 32 + 16 + 64 <= MAX_ACCUM_REGS
    # the other tiles keep their split
    other = Sm90BwdConfig(64, 128, 2, 2, 128, "bf16", False)
    assert not other.shared_keys and (other.s_cols, other.dkv_cols) == (64, 128)


@pytest.mark.parametrize("change,pattern", [
    (dict(BN=128), "head_dim=256 takes BN=64 with consumers=2"),
    (dict(consumers=1), "head_dim=256 takes BN=64 with consumers=2"),
    (dict(head_dim=128), "shared keys\\) is the head_dim=256 tile"),
    (dict(BM=128), "takes BM=64"),
    (dict(stages=3), "more than the 232448"),
    (dict(dq_writer=True, deterministic=True), "dq_writer with deterministic"),
    (dict(dq_bulk=True), "more than the 232448"),
    (dict(dropout=True, window=True), "dropout with a window, softcap or ALiBi at head_dim=256"),
    (dict(dropout=True, softcap=True, causal=True), "dropout with a window, softcap or ALiBi"),
    (dict(dropout=True, alibi=True), "dropout with a window, softcap or ALiBi"),
    (dict(dropout=True, overlap_sdp=True), "overlap_sdp at head_dim=256 with dropout"),
    (dict(dynamic=True), "dynamic at head_dim=256"),
    (dict(dynamic=True, dq_writer=True), "dynamic at head_dim=256"),
    (dict(lpt=True), "lpt without causal"),
    (dict(dq_writer=True, roles=True, dynamic=True, deterministic=True), "dq_writer with deterministic"),
    (dict(wide_epi=True, alibi=True), "wide_epi: the 16-byte"),
    (dict(wide_epi=True, deterministic=True), "wide_epi: the 16-byte"),
])
def test_each_rule(change, pattern):
    with pytest.raises(ConfigError, match=pattern):
        D256.replace(**change).validate()


def test_what_it_allows():
    for flags in (dict(causal=True, deterministic=True), dict(overlap_sdp=True),
                  dict(overlap_sdp=True, window=True, softcap=True, alibi=True),
                  dict(window=True, softcap=True, alibi=True, deterministic=True), dict(dropout=True),
                  dict(dropout=True, deterministic=True), dict(dropout=True, causal=True, varlen=True),
                  dict(varlen=True, deterministic=True),
                  dict(dtype="fp16", causal=True), dict(dq_writer=True), dict(dq_writer=True, causal=True, lpt=True),
                  dict(dq_writer=True, dropout=True), dict(dq_writer=True, varlen=True, window=True),
                  dict(causal=True, lpt=True), dict(causal=True, lpt=True, deterministic=True),
                  dict(dq_writer=True, roles=True, dynamic=True), dict(dq_writer=True, roles=True, dynamic=True,
                                                                       causal=True, dq_first=True, wide_epi=True)):
        assert D256.replace(**flags).problems() == [], flags


def test_space_heuristic_and_for_problem():
    for causal, det in itertools.product((False, True), (False, True)):
        p = problem(causal=causal, deterministic=det)
        valid = FAM.valid(p, MAX_SMEM)
        # (the space's points are unordered: dq_writer on and off while its heuristic switch is on;
        # off, the dq_writer kernel (racecheck hazards) is outside the space; for_problem drops it
        # for det)
        writers = (False, True) if sm90_bwd.HEURISTIC_D256_DQ_WRITER else (False,)
        # (roles: with dq_writer, without overlap_sdp, with and without s_ahead)
        split = [c for c in valid if not c.roles]
        assert sorted(c.overlap_sdp for c in split) == sorted([False, True] * len(writers))
        assert {(c.BM, c.BN, c.stages, c.consumers, c.dq_writer, c.dq_bulk) for c in split} == \
            {(64, 64, 2, 2, w, False) for w in writers}
        assert sorted((c.dq_writer, c.overlap_sdp, c.s_ahead) for c in valid if c.roles) == \
            ([(True, False, False)] if writers == (False, True) else [])
        assert all("racecheck" in " ".join(why) for c, why in FAM.enumerate(p, MAX_SMEM)
                   if c.shared_keys and c.dq_writer and not c.problems(MAX_SMEM)) or writers == (False, True)
        assert all(FAM.for_problem(c, p).problems() == [] for c in valid)
    for d in range(136, 257, 8):
        for dtype, causal, det in itertools.product(("bf16", "fp16"), (False, True), (False, True)):
            p = problem(d, dtype, causal, det)
            assert FAM.supports((9, 0), p) == ""
            cfg = FAM.for_problem(FAM.heuristic(p), p)
            # (dq_writer where the call is unordered: HEURISTIC_D256_DQ_WRITER, measured)
            assert cfg == heur256(causal, det, dtype), cfg
            assert FAM.head_dim_of(d) == 256 and FAM.fits(cfg, p) == ""
    # dropout keeps red.add at d256 (for_problem moves only d128's dQ path) and drops overlap_sdp
    # (that kernel spills); softcap / ALiBi keep it
    drop = problem(features=("dropout",), dropout_p=0.1)
    cfg = FAM.for_problem(D256.replace(overlap_sdp=True), drop)
    assert cfg.dropout and not cfg.overlap_sdp and not cfg.dq_writer and not cfg.dq_bulk and cfg.problems() == []
    cap = problem(features=("alibi", "softcap"), softcap=5.0)
    cfg = FAM.for_problem(D256.replace(overlap_sdp=True), cap)
    assert cfg.softcap and cfg.alibi and cfg.overlap_sdp and cfg.problems() == []
    # a deterministic call with a tuned-style dq_writer config: red.add, ordered
    cfg = FAM.for_problem(D256.replace(dq_writer=True), problem(deterministic=True))
    assert cfg.deterministic and not cfg.dq_writer and cfg.problems() == []


def test_plain_grid_only(monkeypatch):
    """The shared-keys tile runs one CTA per K/V block: with main's schedule switches on at every
    head dim, the d256 heuristic stays plain (its own switches HEURISTIC_D256_LPT /
    HEURISTIC_D256_DQ_WRITER decide lpt and dq_writer there), and for_problem drops a tuned-style
    dynamic; lpt (causal) stays."""
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_DYNAMIC", frozenset({(256, False), (256, True)}))
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_LPT", True)
    for causal in (False, True):
        p = problem(causal=causal)
        cfg = FAM.for_problem(FAM.heuristic(p), p)
        assert cfg == heur256(causal) and cfg.problems() == [], cfg
        cfg = FAM.for_problem(D256.replace(causal=causal, dynamic=True, lpt=causal), p)
        assert not cfg.dynamic and cfg.lpt == causal and cfg.problems() == [], cfg
        assert not any(c.dynamic or c.ds_double or c.lpt for c in FAM.valid(p, MAX_SMEM))


def test_d256_switches(monkeypatch):
    """HEURISTIC_D256_DQ_WRITER (on: measured faster, racecheck-clean since the consumers release the
    slot too) / HEURISTIC_D256_LPT (off, measured slower): on, the heuristic adds dq_writer (unordered
    calls) and lpt (causal calls) at head dims 129..256, nowhere else; off, neither (roles, which
    needs dq_writer, off here)."""
    assert sm90_bwd.HEURISTIC_D256_DQ_WRITER and not sm90_bwd.HEURISTIC_D256_LPT
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_D256_DQ_WRITER", False)
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_D256_ROLES", frozenset())
    for causal in (False, True):
        p = problem(causal=causal)
        assert FAM.for_problem(FAM.heuristic(p), p) == D256.replace(causal=causal)
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_D256_DQ_WRITER", True)
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_D256_LPT", True)
    for d, causal, det in itertools.product((192, 256), (False, True), (False, True)):
        p = problem(d, causal=causal, deterministic=det)
        cfg = FAM.for_problem(FAM.heuristic(p), p)
        assert cfg == D256.replace(causal=causal, deterministic=det, dq_writer=not det, lpt=causal), cfg
        assert cfg.problems() == [] and FAM.fits(cfg, p) == ""
    d128 = FAM.for_problem(FAM.heuristic(problem(128, causal=True)), problem(128, causal=True))
    assert not d128.lpt
    # varlen keeps the plain order; dropout, features keep dq_writer (they compile clean)
    for feats, kw in ((("varlen",), {}), (("dropout",), dict(dropout_p=0.1)),
                      (("alibi", "softcap", "window"), dict(window=(30, 4), softcap=10.0))):
        if feats == ("varlen",) and not sm90_bwd.VARLEN_BWD:
            continue
        p = problem(causal=True, features=feats, **kw)
        cfg = FAM.for_problem(FAM.heuristic(p), p)
        assert cfg.dq_writer and cfg.lpt == ("varlen" not in feats) and cfg.problems() == [], cfg


def test_selection_and_the_switch(monkeypatch):
    """D256_ABOVE_FA2 / D192_ABOVE_FA2 (both on, measured on the H100): sm90_bwd with the d256 tile
    at head dims 193..256 / 129..192; off: fa2_bwd there, bwd_config= forces sm90_bwd."""
    assert sm90_bwd.D256_ABOVE_FA2 and sm90_bwd.D192_ABOVE_FA2
    for d in (136, 160, 192, 200, 256):
        fam, cfg, source = choose(problem(d), (9, 0))
        assert fam is FAM and cfg == heur256() and source.startswith("heuristic"), (d, cfg, source)
    # past 256 neither Hopper kernel: fa2_bwd's refusal names the head dim
    with pytest.raises(Exception, match="256"):
        choose(problem(264), (9, 0))
    for d, switch in ((136, "D192_ABOVE_FA2"), (192, "D192_ABOVE_FA2"), (200, "D256_ABOVE_FA2"),
                      (256, "D256_ABOVE_FA2")):
        p = problem(d)
        assert choose(p, (9, 0))[0].name == ("sm90_bwd" if getattr(sm90_bwd, switch) else "fa2_bwd")
        fam, cfg, _ = choose(p, (9, 0), config=D256)
        assert fam is FAM and cfg == D256
    monkeypatch.setattr(sm90_bwd, "D192_ABOVE_FA2", True)
    monkeypatch.setattr(sm90_bwd, "D256_ABOVE_FA2", False)
    assert choose(problem(192), (9, 0))[0].name == "sm90_bwd" and choose(problem(200), (9, 0))[0].name == "fa2_bwd"
    monkeypatch.setattr(sm90_bwd, "D192_ABOVE_FA2", False)
    monkeypatch.setattr(sm90_bwd, "D256_ABOVE_FA2", True)
    assert choose(problem(192), (9, 0))[0].name == "fa2_bwd" and choose(problem(200), (9, 0))[0].name == "sm90_bwd"
    monkeypatch.setattr(sm90_bwd, "D192_ABOVE_FA2", True)
    for d in (136, 192, 256):
        for feats, kw in (((), {}), (("alibi", "softcap", "window"), dict(window=(30, 4), softcap=10.0)),
                          (("dropout",), dict(dropout_p=0.1))):
            fam, cfg, _ = choose(problem(d, features=feats, **kw), (9, 0))
            assert fam is FAM and cfg.shared_keys and cfg.head_dim == 256
    # the d128 and d64 choices stay
    assert choose(problem(128), (9, 0))[1].BN == 128
    monkeypatch.setattr(sm90_bwd, "D256_ABOVE_FA2", False)
    monkeypatch.setattr(sm90_bwd, "D192_ABOVE_FA2", False)
    assert choose(problem(128), (9, 0))[0].name == "sm90_bwd"


def test_refusals_fall_back_to_fa2_with_a_reason(monkeypatch):
    monkeypatch.setattr(sm90_bwd, "D192_ABOVE_FA2", True)
    p = problem(192, features=("dropout", "window"), dropout_p=0.1, window=(40, 0))
    why = FAM.supports((9, 0), p)
    assert "with dropout at head dim 192 (the d256 instantiations spill)" in why
    assert choose(p, (9, 0))[0].name == "fa2_bwd"
    # deterministic dropout and deterministic varlen run here at d256 (they compile clean)
    assert FAM.supports((9, 0), problem(features=("dropout",), dropout_p=0.1, deterministic=True)) == ""
    if sm90_bwd.VARLEN_BWD:
        assert FAM.supports((9, 0), problem(features=("varlen",), deterministic=True)) == ""


def test_kernel_source():
    src = (kernel_dir() / "sm90_bwd.cu").read_text()
    assert "static constexpr bool kSharedKeys = kBN == 64 && kConsumers == 2;" in src
    assert "static_assert(!kDqBulk, \"shared keys (head dim 256): dQ by red.add or the slot staging (dq_writer)\");" in src
    # dq_writer there: staged in the ring slot, released by the consumer threads (after their last
    # LSE / D / wgmma reads, unconditionally: the racecheck WAR on LSE) and by the writer warp
    assert "mbarrier_init(q_empty(s), (kConsumerThreads + (kSlotDq ? 1 : 0)) * (kCluster ? 2 : 1));" in src
    assert "if constexpr (!kSlotDq) mbarrier_arrive(q_empty(slot));" not in src
    # cluster: the multicast halves, the remote releases (not for the last kStages Q blocks)
    assert "tma_load_4d_multicast(q_smem + off, &p.tma_q, q_full(slot)" in src
    # (the writer warp's, the consumers' of the shared-keys path and of roles)
    assert src.count("if (it + kStages < n_iters)") == 3 and src.count("mbarrier_arrive_remote(mapa_shared(q_empty(") == 3
    assert "__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__((kConsumers + 1) * 128, 1)" in src
    assert "if constexpr (kSlotDq) mbarrier_arrive(q_empty(q % kStages));" in src
    # the Pᵀ / dSᵀ stores, then the SS products of dV and dK from them, after the barrier
    # (whatever the indentation: the tile loop nests the Q-block loop)
    loop = src[re.search(r"if constexpr \(kSharedKeys\) \{\n\s*// kSharedKeys: this warpgroup's Pᵀ", src).start():]
    order = ["stmatrix_x4(smem + Shape::kPOffset", "stmatrix_x4(smem + Shape::kDstOffset",
             "fence_proxy_async_smem()", "named_barrier_sync(1, kConsumerThreads)",
             "fresh(p_desc)", "fresh(dst_desc)", "wgmma_commit()", "Wgmma<64, Elem>::template ss<1>(dq_part",
             "mbarrier_arrive(q_empty(slot))", "red_add_tile_16x16(dq_rows + piece * 64"]
    pos = 0
    for token in order:
        pos = loop.index(token, pos) + 1
    ptx = (kernel_dir() / "ptx_sm90_bwd.cuh").read_text()
    # stmatrix_x4 lives in ptx_sm90_store.cuh (shared with the dropout backward), included here
    store = (kernel_dir() / "ptx_sm90_store.cuh").read_text()
    assert '#include "ptx_sm90_store.cuh"' in ptx and "u32 opaque_u32(u32 x)" in ptx
    assert "stmatrix.sync.aligned.m8n8.x4.shared.b16" in store
    # sm90_fwd's headers (its code hash) untouched
    assert "opaque_u32" not in (kernel_dir() / "ptx_sm90.cuh").read_text()


def compile_clean(configs):
    chunks = [configs[i::2] for i in range(2) if configs[i::2]]
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(lambda c: list(zip(c, nvcc_compile(c, "sm_90a", NVCC))), chunks))
    return [f"{c.name}: {r}" for rs in done for c, r in rs
            if r.spill_stores or r.spill_loads or r.stack_bytes or serialized(r)]


@needs_nvcc
def test_ptxas_d256_plain_and_schedule():
    """bf16 / fp16 x causal / not, plain and overlap_sdp; deterministic; dq_writer (+ lpt when causal),
    lpt (8 + 2 + 4 + 3 instantiations)."""
    configs = [D256.replace(dtype=dt, causal=c, overlap_sdp=o)
               for dt, c, o in itertools.product(("bf16", "fp16"), (False, True), (False, True))]
    configs += [D256.replace(deterministic=True), D256.replace(causal=True, deterministic=True)]
    # dq_writer (dQ staged in the ring slot) and lpt: bf16 / fp16 x causal / not, overlap_sdp
    configs += [D256.replace(dtype=dt, causal=c, dq_writer=True, lpt=c)
                for dt, c in itertools.product(("bf16", "fp16"), (False, True))]
    configs += [D256.replace(causal=True, lpt=True), D256.replace(causal=True, lpt=True, deterministic=True),
                D256.replace(dq_writer=True, overlap_sdp=True)]
    assert all(c.problems() == [] for c in configs)
    bad = compile_clean(configs)
    assert not bad, "\n".join(bad)


@needs_nvcc
def test_ptxas_d256_features():
    """Window, softcap, ALiBi alone and together (causal and not, deterministic, overlap_sdp);
    dropout alone (causal and not), deterministic, fp16, varlen; varlen; dq_writer with them (18)."""
    configs = [D256.replace(window=True), D256.replace(causal=True, softcap=True), D256.replace(alibi=True),
               D256.replace(window=True, softcap=True, alibi=True),
               D256.replace(causal=True, window=True, softcap=True, alibi=True, deterministic=True),
               D256.replace(overlap_sdp=True, window=True, softcap=True, alibi=True),
               D256.replace(dropout=True), D256.replace(causal=True, dropout=True),
               D256.replace(dtype="fp16", causal=True, dropout=True),
               D256.replace(causal=True, dropout=True, deterministic=True),
               D256.replace(causal=True, dropout=True, varlen=True),
               D256.replace(varlen=True), D256.replace(varlen=True, causal=True, deterministic=True),
               D256.replace(varlen=True, window=True, softcap=True, alibi=True)]
    # dq_writer with the features: dropout (causal and not), window + softcap + ALiBi, varlen
    configs += [D256.replace(dq_writer=True, dropout=True), D256.replace(dq_writer=True, dropout=True, causal=True),
                D256.replace(dq_writer=True, window=True, softcap=True, alibi=True),
                D256.replace(dq_writer=True, varlen=True, causal=True, window=True, softcap=True, alibi=True)]
    assert all(c.problems() == [] for c in configs), [c.problems() for c in configs]
    assert len(set(configs)) == 18
    bad = compile_clean(configs)
    assert not bad, "\n".join(bad)


def slot_box(slot, box):
    """Host mirror of Sm90BwdSlotDqStage::box (sm90_bwd.cu) for the d256 tile: the byte offset
    (from the aligned base) of dQ box `box` (columns 32·box..+31) staged in ring slot `slot`."""
    kv_bytes, q_bytes, chunk = 64 * 256 * 2, 64 * 256 * 2, 64 * 128
    q_offset, do_offset = 2 * kv_bytes, 2 * kv_bytes + 2 * q_bytes   # K, V; then 2 stages of Q; of dO
    b = box % 4
    return (q_offset if b < 2 else do_offset) + slot * q_bytes + (2 * (box // 4) + b % 2) * chunk


def test_slot_dq_stores_are_the_tma_swizzle():
    """dq_writer at d256 (kSlotDq): the consumers' stores of both 64-column pieces (the base of box
    4wg + 2·piece + nt / 4, the unit 2·(nt % 4) ^ (t / 2 ^ g), odd rows g storing fragment nt ^ 2)
    put element (row, col) of the 64 x 256 fp32 part where the tensor map's 128B swizzle reads box
    col / 32 (row, 16-byte unit (col % 32) / 4 ^ row % 8), every element exactly once; warpgroup
    wg writes only the chunks its own dV, dK read (Q_i's and dO_i's column chunks 2wg, 2wg + 1 of
    the slot); a half warp's float2 stores hit each bank at most twice."""
    chunk = 64 * 128
    for slot in (0, 1):
        seen, banks = {}, {}
        for wg, warp, lane in itertools.product(range(2), range(4), range(32)):
            g, t = lane // 4, lane % 4
            odd = g % 2
            sw = ((t // 2) ^ g ^ (4 if odd else 0)) << 4
            row_off = (warp * 16 + g) * 128 + (t % 2) * 8
            own = {slot_box(slot, 0) + c * chunk for c in (2 * wg, 2 * wg + 1)} | \
                  {slot_box(slot, 2) + c * chunk for c in (2 * wg, 2 * wg + 1)}
            for piece, nt, half in itertools.product(range(2), range(8), range(2)):
                base = slot_box(slot, 4 * wg + 2 * piece + nt // 4)
                assert base in own, (wg, piece, nt)
                off = base + row_off + (sw ^ ((2 * (nt % 4)) << 4)) + half * 8 * 128
                frag = nt ^ 2 if odd else nt
                row, col = warp * 16 + g + 8 * half, 128 * wg + 64 * piece + 8 * frag + 2 * t
                for e in range(2):
                    c = col + e
                    want = slot_box(slot, c // 32) + row * 128 + (((c % 32) // 4) ^ (row % 8)) * 16 + (c % 4) * 4
                    assert off + 4 * e == want, (slot, wg, warp, lane, piece, nt, half, e)
                    seen[want] = seen.get(want, 0) + 1
                if lane < 16 and warp == 0 and wg == 0 and half == 0:   # one store instruction's half warp
                    banks.setdefault((piece, nt), []).extend((off // 4 + e) % 32 for e in range(2))
        assert len(seen) == 64 * 256 and all(n == 1 for n in seen.values())
        assert all(max(b.count(x) for x in b) <= 2 for b in banks.values())
        # the 8 boxes: whole chunks of this slot's Q_i (boxes 0, 1, 4, 5) and dO_i (2, 3, 6, 7)
        boxes = sorted(slot_box(slot, b) for b in range(8))
        q0, do0 = slot_box(slot, 0), slot_box(slot, 2)
        assert boxes == sorted([q0 + c * chunk for c in range(4)] + [do0 + c * chunk for c in range(4)])


def test_cluster_config_and_launch():
    """cluster (kCluster): the d256 tile in clusters of 2 CTAs (sm90_bwd_cluster), named _cl2, its
    own template arguments (the cluster size first), an even K/V-block grid; refused or dropped
    with a window, varlen, deterministic, dynamic, lpt, and off the shared-keys tile."""
    cfg = D256.replace(dq_writer=True, cluster=True)
    assert cfg.problems() == [] and cfg.name == "sm90bwd_bf16_d256_full_BM64_BN64_s2_c2_dqw_cl2"
    assert cfg.kernel_name() == ("cuflash::sm90_bwd_cluster<2, 64, 64, 2, 2, 256, cuflash::bf16, false, false, "
                                 "false, false, false, false, false, false, true, false, false, false, false>")
    # (no main-loop flags but kRoles, last)
    assert cfg.template_args() == (2,) + D256.replace(dq_writer=True).template_args()[:19] + (False, False)
    assert cfg.smem_bytes == D256.smem_bytes
    for change in (dict(window=True), dict(varlen=True), dict(deterministic=True, dq_writer=False),
                   dict(lpt=True, causal=True)):
        assert any("cluster" in w for w in cfg.replace(**change).problems()), change
    other = Sm90BwdConfig(64, 128, 2, 2, 128, "bf16", False, cluster=True)
    assert any("cluster" in w for w in other.problems())
    # the grid: K/V blocks per (head, batch) rounded up to even (seqlen_k 200: 4 blocks; 130: 3 -> 4)
    for sk, n in ((200, 4), (130, 4), (17, 2), (64, 2)):
        p = problem(seqlen_k=sk)
        main = [ls for ls in FAM.launches(cfg, p, 132) if ls.role == "main"][0]
        assert main.grid == (p.batch * p.nheads * n, 1, 1), (sk, main.grid)
        plain = [ls for ls in FAM.launches(cfg.replace(cluster=False), p, 132) if ls.role == "main"][0]
        assert plain.grid[0] == p.batch * p.nheads * -(-sk // 64)
    # for_problem: a window, varlen, deterministic call runs one CTA per K/V block
    for p in (problem(features=("window",), window=(30, 4)), problem(deterministic=True)):
        out = FAM.for_problem(cfg, p)
        assert not out.cluster and out.problems() == [], out
    # the encoded form carries cluster only when on; the heuristic switch (off until measured)
    assert "cluster" not in dict(FAM._fields(D256)) and dict(FAM._fields(cfg))["cluster"] is True
    assert not sm90_bwd.HEURISTIC_D256_CLUSTER


def test_cluster_switch(monkeypatch):
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_D256_CLUSTER", True)
    for causal in (False, True):
        p = problem(causal=causal)
        assert FAM.for_problem(FAM.heuristic(p), p) == heur256(causal, cluster=True)
    for p in (problem(deterministic=True), problem(features=("softcap",), softcap=5.0), problem(128)):
        assert not FAM.for_problem(FAM.heuristic(p), p).cluster


@needs_nvcc
def test_ptxas_d256_cluster():
    """cluster with dq_writer (bf16 / fp16, causal and not), with red.add, with softcap + ALiBi and
    dropout (7)."""
    configs = [D256.replace(dtype=dt, causal=c, dq_writer=True, cluster=True)
               for dt, c in itertools.product(("bf16", "fp16"), (False, True))]
    configs += [D256.replace(causal=True, cluster=True),
                D256.replace(dq_writer=True, cluster=True, softcap=True, alibi=True, dropout=False),
                D256.replace(dq_writer=True, cluster=True, dropout=True, causal=True)]
    assert all(c.problems() == [] for c in configs), [c.problems() for c in configs]
    bad = compile_clean(configs)
    assert not bad, "\n".join(bad)


def test_roles_config(monkeypatch):
    """roles (kRoles): the warpgroups split by operand; named _rol, kRoles the last template argument
    (sm90_bwd's and sm90_bwd_cluster's); dq_writer only, plain unordered calls (for_problem drops it
    for deterministic calls and calls with features); in the space; in the heuristic per HEURISTIC_D256_ROLES."""
    cfg = D256.replace(dq_writer=True, roles=True)
    assert cfg.problems() == [] and cfg.name == "sm90bwd_bf16_d256_full_BM64_BN64_s2_c2_dqw_rol"
    assert cfg.kernel_name().endswith(", false, false, false, false, false, true>")
    assert cfg.template_args()[-7] is True and len(cfg.template_args()) == len(D256.template_args())   # (kDqConvert, kDqFirst, kWideEpi, kDropPacked, kCapFold, kDqTail last)
    cl = cfg.replace(cluster=True, causal=True)
    assert cl.problems() == [] and cl.kernel_name().endswith(", false, false, false, false, true, false>")
    assert cl.template_args()[-2:] == (True, False)
    for change in (dict(dq_writer=False), dict(deterministic=True), dict(window=True), dict(softcap=True),
                   dict(dropout=True), dict(varlen=True), dict(overlap_sdp=True)):
        assert any("roles" in w for w in cfg.replace(**change).problems()), change
    assert any("roles" in w for w in Sm90BwdConfig(64, 128, 2, 2, 128, "bf16", False, dq_writer=True,
                                                   roles=True).problems())
    for p in (problem(deterministic=True), problem(features=("softcap",), softcap=5.0)):
        out = FAM.for_problem(cfg, p)
        assert not out.roles and out.problems() == [], out
    assert FAM.for_problem(cfg, problem()) == cfg
    assert "roles" not in dict(FAM._fields(D256)) and dict(FAM._fields(cfg))["roles"] is True
    assert FAM.space["roles"] == (False, True)
    valid = FAM.valid(problem(), MAX_SMEM)
    assert {(c.dq_writer, c.s_ahead) for c in valid if c.roles} == {(True, False)}
    assert not any(c.roles for c in FAM.valid(problem(128), MAX_SMEM))
    assert FAM.make({k: v for k, v in FAM.point(cfg).items() if k != "roles"}, problem()) == cfg.replace(roles=False)
    # s_ahead at d256: built for roles only, refused (ptxas serializes its wgmmas, C7518); for_problem drops it
    sah = cfg.replace(s_ahead=True)
    assert any("C7518" in w for w in sah.problems()) and FAM.for_problem(sah, problem()) == cfg
    assert any("shared-keys" in w for w in D256.replace(dq_writer=True, s_ahead=True).problems())
    assert sah.replace(cluster=True).kernel_name().endswith(", true, true>")
    assert FAM.for_problem(sah, problem(features=("softcap",), softcap=5.0)) == D256.replace(dq_writer=True, softcap=True)
    for causal in (False, True):
        assert FAM.heuristic(problem(causal=causal)).roles == ("bf16" in sm90_bwd.HEURISTIC_D256_ROLES
                                                               and sm90_bwd.HEURISTIC_D256_DQ_WRITER)
    assert FAM.heuristic(problem(dtype="fp16")).roles == ("fp16" in sm90_bwd.HEURISTIC_D256_ROLES)
    # the switch: roles for plain unordered calls with dq_writer, not deterministic or with features
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_D256_DQ_WRITER", True)
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_D256_ROLES", frozenset({"bf16", "fp16"}))
    for causal in (False, True):
        p = problem(causal=causal)
        assert FAM.for_problem(FAM.heuristic(p), p) == D256.replace(causal=causal, dq_writer=True, roles=True)
    for p in (problem(deterministic=True), problem(features=("softcap",), softcap=5.0), problem(128)):
        assert not FAM.for_problem(FAM.heuristic(p), p).roles


def test_roles_kernel_source():
    src = (kernel_dir() / "sm90_bwd.cu").read_text()
    body = src[src.index("if constexpr (kRoles) {"):]
    body = body[:body.index("if (wg == 0) run(Sm90BwdSide<true>{});")]
    # the barrier pairs: each arrival where its wait follows
    assert "if (it > 0) named_barrier_sync(kPFreeBar, kConsumerThreads);" in body
    assert "if (it + 1 < n_iters) named_barrier_arrive(kPFreeBar, kConsumerThreads);" in body
    assert "if (it > 0) named_barrier_sync(kDsFreeBar, kConsumerThreads);" in body
    assert "if (kPSide && it + 1 < n_iters) named_barrier_arrive(kDsFreeBar, kConsumerThreads);" in body
    # kDsFullBar: the dSᵀ side arrives, the P side waits (a barrier bar.sync'd at two instructions
    # is "divergent thread(s) in block" to synccheck); the dSᵀ side waits on its own kDsOwnBar
    assert body.count("named_barrier_sync(kDsFullBar, kConsumerThreads);") == 1
    assert body.count("named_barrier_arrive(kDsFullBar, kConsumerThreads);") == 1
    assert body.count("named_barrier_sync(kDsOwnBar, 128);") == 1
    # every consumer thread releases the slot once its GEMMs are done; the staging boxes of roles
    assert "mbarrier_arrive(q_empty(slot));" in body and "store_slot_dq_r2s<Sm90BwdSlotDqStage<Shape, true>>(" in body
    assert "Sm90BwdSlotDqStage<Shape, kRoles>::box(smem, slot_off, b)" in src


@needs_nvcc
def test_ptxas_d256_roles():
    """roles with dq_writer: bf16 / fp16 x causal / not, and in the cluster (6)."""
    configs = [D256.replace(dtype=dt, causal=c, dq_writer=True, roles=True)
               for dt, c in itertools.product(("bf16", "fp16"), (False, True))]
    configs += [D256.replace(dq_writer=True, roles=True, cluster=True),
                D256.replace(dtype="fp16", causal=True, dq_writer=True, roles=True, cluster=True)]
    assert all(c.problems() == [] for c in configs), [c.problems() for c in configs]
    bad = compile_clean(configs)
    assert not bad, "\n".join(bad)
