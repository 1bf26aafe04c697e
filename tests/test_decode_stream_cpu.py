"""decode_splitkv's ``stream`` option (decode_splitkv_stream, stream-K) without a GPU: names,
template arguments, validation, shared memory, counters and workspace, the heuristic's switch and
call_config's checks, zero spills on sm_90a, and a Python mirror of the kernel's partition (the
items of each batch row, each CTA's range and segments, the workspace slot of each piece, the
owner rule the merging CTA reads them back by): every item is streamed once, every group is written
once (directly or merged from exactly the pieces written), and no two pieces share a slot."""
import shutil

import numpy as np
import pytest

from cuflash.compile import nvcc_compile
from cuflash.families import decode_splitkv as mod
from cuflash.families.decode_splitkv import DecodeConfig, stream_problem
from cuflash.problem import Problem
from cuflash.registry import get

FAM = get("decode_splitkv")
BASE = DecodeConfig(8, 16, 3, 1, 4, 128, "bf16", False, fused_combine=True, l2_prefetch=256, early_merge=True)
STREAM = BASE.replace(stream=True)
P = Problem("decode", "bf16", 1, 1, 32768, 32, 8, 128)


def test_names_template_arguments_smem_counters_workspace():
    assert STREAM.name == "decode_bf16_d128_w8_n16_s3_m1_c4_fc_l2p256_em_stk"
    assert STREAM.kernel_name() == "cuflash::decode_splitkv_stream<8, 16, 3, 1, 128, cuflash::bf16, 256>"
    assert STREAM.template_args() == (8, 16, 3, 1, 128, "bf16", 256)
    assert BASE.kernel_name().endswith("256, false, false, false, 0, true>")   # unchanged without it
    # the ring, a Q tile per slot, the per-row prefix (4 arrays of 128 ints and 2)
    assert STREAM.smem_bytes == BASE.smem_bytes + 2 * 16 * 136 * 2 + 4 * (4 * 128 + 2) == 224008
    # the resident slots, or their largest multiple of the groups (STREAM_WHOLE_GROUPS): 8 groups -> 128
    assert FAM.split_count(STREAM, P, 132) == 128 and FAM.split_count(STREAM, P.replace(batch=32), 132) == 132
    assert FAM.split_count(STREAM, P.replace(batch=3, seqlen_k=1000), 132) == 120
    assert FAM.launches(STREAM, P, 132)[-1].grid == (128, 1, 1) and len(FAM.launches(STREAM, P, 132)) == 1
    assert FAM.counters(STREAM, P) == 8
    ws = FAM.workspace(STREAM, P.replace(batch=64))
    assert ws["lse_partial"] == mod.STREAM_MAX_CTAS * 2 * 16 * 128 * 4   # 2 pieces of 16 rows per CTA, any batch
    assert FAM.decode(FAM.encode(STREAM), "bf16", False) == STREAM
    old = {k: v for k, v in FAM.point(BASE).items() if k != "stream"}
    assert not FAM.make(old, P).stream


def test_validation_and_call_checks():
    assert not STREAM.problems(232448)
    for bad in (STREAM.replace(fused_combine=False, early_merge=False), STREAM.replace(ring_fill=1),
                STREAM.replace(ring_fill=1, dynamic=1), STREAM.replace(lean=True), STREAM.replace(bulk=1, l2_prefetch=0)):
        assert any("stream:" in x for x in bad.problems(232448)), bad.name
    assert any("ring slot" in x for x in STREAM.replace(m_tiles=2).problems(232448))
    assert any("splits (CTAs)" in x for x in STREAM.replace(splits=161).problems(232448))
    assert not STREAM.replace(splits=150).problems(232448)   # more than MAX_SPLITS CTAs is fine
    assert stream_problem(STREAM, P) == "" and stream_problem(BASE, P.replace(batch=1000)) == ""
    assert "window" in stream_problem(STREAM, P.replace(features=("window",)))
    assert "causal" in stream_problem(STREAM, P.replace(seqlen_q=2, causal=True))
    assert stream_problem(STREAM, P.replace(causal=True)) == ""    # seqlen_q 1: every key visible
    assert "batch" in stream_problem(STREAM, P.replace(batch=129))
    with pytest.raises(ValueError, match="window_size"):
        FAM.call_config(STREAM, P.replace(features=("window",)), (9, 0), 0, chosen=False)
    assert not FAM.call_config(STREAM, P.replace(features=("window",)), (9, 0), 0, chosen=True).stream


def test_heuristic_switch(monkeypatch):
    assert (mod.STREAM_DEFAULT, mod.STREAM_PAGED, mod.STREAM_FORCE_CTAS) == (False, False, 0)
    assert not FAM.heuristic(P, (9, 0)).stream
    monkeypatch.setattr(mod, "STREAM_DEFAULT", True)
    for b, ctx in ((1, 8192), (1, 131072), (8, 32768), (64, 8192)):
        cfg = FAM.heuristic(P.replace(batch=b, seqlen_k=ctx), (9, 0))
        assert cfg.stream and (cfg.warps, cfg.stages) == (8, 3) and not cfg.dynamic and not cfg.ring_fill, cfg.name
        assert not cfg.problems(232448)
    assert not FAM.heuristic(P.replace(features=("paged_kv",)), (9, 0)).stream
    assert not FAM.heuristic(P.replace(features=("window",)), (9, 0)).stream
    assert not FAM.heuristic(P.replace(seqlen_q=8), (9, 0)).stream          # two row tiles
    monkeypatch.setattr(mod, "STREAM_PAGED", True)
    assert FAM.heuristic(P.replace(features=("paged_kv",)), (9, 0)).stream


POINTS = [STREAM, BASE.replace(light_fence=True), BASE.replace(ring_fill=1, dynamic=1, light_fence=True), STREAM.replace(head_dim=64, dtype="fp16", l2_prefetch=0), STREAM.replace(warps=4, l2_prefetch=0),
          STREAM.replace(stages=2)]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_nvcc_zero_spills_sm90a():
    for cfg, rep in zip(POINTS, nvcc_compile(POINTS, "sm_90a")):
        assert rep.spill_stores == 0 and rep.spill_loads == 0 and rep.stack_bytes == 0, (cfg.name, rep)
        assert not rep.warnings, (cfg.name, rep.warnings)


# ---- a mirror of decode_splitkv_stream's partition (integer math as the kernel's) ----
def partition(keys, per_row, block_n, ctas):
    """Per CTA: its segments (group gi, first block index j0, last j1, whole, slot); the groups'
    pieces as the merging CTA reads them (slot list); the items each CTA streams."""
    blocks = [-(-k // block_n) if k > 0 else 0 for k in keys]
    prefix = [0]
    for nb in blocks:
        prefix.append(prefix[-1] + nb * per_row)
    total = prefix[-1]
    ctas = min(ctas, total)   # no empty range

    def owner(w):
        return ((w + 1) * ctas + total - 1) // total - 1

    writes, items = {}, []
    for c in range(ctas):
        w0, w1 = c * total // ctas, (c + 1) * total // ctas
        seg = -1
        for w in range(w0, w1):
            b = max(i for i in range(len(keys)) if prefix[i] <= w)
            local = w - prefix[b]
            gl, j = divmod(local, blocks[b])
            gi = b * per_row + gl
            items.append((gi, j))
            if w == w0 or j == 0:
                seg += 1
                j0 = j
            if w == w1 - 1 or j == blocks[b] - 1:
                whole = j0 == 0 and j == blocks[b] - 1
                slot = None if whole else 2 * c + (0 if seg == 0 else 1)
                writes.setdefault(gi, []).append((c, whole, slot))
    reads = {}
    for b, nb in enumerate(blocks):
        for gl in range(per_row if nb else 0):
            gi = b * per_row + gl
            w_first = prefix[b] + gl * nb
            c_first = owner(w_first)
            pieces = owner(w_first + nb - 1) - c_first + 1
            first_later = c_first * total // ctas < w_first
            reads[gi] = (pieces, [2 * (c_first + s) + (1 if s == 0 and first_later else 0) for s in range(pieces)])
    return blocks, items, writes, reads


@pytest.mark.parametrize("seed", range(120))
def test_partition_mirror(seed):
    rng = np.random.default_rng(seed)
    batch = int(rng.integers(1, 12))
    keys = [int(x) for x in rng.integers(0, 3000, size=batch)]
    if seed % 4 == 0:
        keys[int(rng.integers(0, batch))] = 0
    per_row = int(rng.choice([1, 2, 8]))
    block_n = int(rng.choice([64, 128]))
    ctas = int(rng.choice([2, 3, 7, 132]))
    blocks, items, writes, reads = partition(keys, per_row, block_n, ctas)
    expect = sorted((b * per_row + gl, j) for b, nb in enumerate(blocks) for gl in range(per_row) for j in range(nb))
    assert sorted(items) == expect and len(set(items)) == len(items)      # every item once
    slots = [s for ws in writes.values() for _, whole, s in ws if not whole]
    assert len(slots) == len(set(slots)) and all(0 <= s < 2 * ctas for s in slots)
    assert set(writes) == set(reads)
    for gi, ws in writes.items():
        pieces, read_slots = reads[gi]
        if len(ws) == 1:
            assert ws[0][1] and pieces == 1, (gi, ws)                      # whole: written directly
        else:
            assert not any(w for _, w, _ in ws) and pieces == len(ws) and pieces <= ctas
            assert sorted(read_slots) == sorted(s for _, _, s in ws), (gi, ws, read_slots)


def test_light_fence_names_validation_switch(monkeypatch):
    """light_fence (kLightFence, the split kernel's fused combine counted without per-thread fences):
    a trailing template argument (left out when false), validation, the heuristic's switch."""
    lf = BASE.replace(light_fence=True)
    assert lf.name.endswith("_em_lf") and lf.kernel_name().endswith("0, true, 0, 0, true>")
    assert lf.template_args()[-1] is True and BASE.template_args()[-1] is False
    assert not lf.problems(232448) and FAM.decode(FAM.encode(lf), "bf16", False) == lf
    for bad in (lf.replace(fused_combine=False, early_merge=False), lf.replace(stream=True)):
        assert any("light_fence" in x for x in bad.problems(232448)), bad.name
    assert mod.LIGHT_FENCE_DEFAULT is True and FAM.heuristic(P, (9, 0)).light_fence   # contiguous caches
    assert not FAM.heuristic(P.replace(features=("paged_kv",)), (9, 0)).light_fence    # paged: not timed
    assert not FAM.heuristic(P.replace(batch=64), (9, 0)).problems(232448)
    monkeypatch.setattr(mod, "STREAM_DEFAULT", True)
    assert not FAM.heuristic(P, (9, 0)).light_fence   # the stream kernel has no such option
