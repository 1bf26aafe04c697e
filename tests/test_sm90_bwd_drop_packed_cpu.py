"""sm90_bwd's drop_packed (kDropPacked, kernels_cu/dropout_transposed.cuh) without a GPU: the draw /
apply walk lane by lane in NumPy (prmt and the lane shuffle spelled out) against the mirror's keep
mask (cuflash.dropout), the config flag, and the instantiations' ptxas reports (no spills)."""
import itertools
import os
import shutil

import numpy as np
import pytest

from cuflash import dropout, registry
from cuflash.families import sm90_bwd
from cuflash.problem import Problem

NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
BWD = registry.get("sm90_bwd")
M32 = 0xFFFFFFFF


def prmt(a, b, sel):
    """prmt.b32 d, a, b, sel (default mode): byte i of d is byte (nibble i & 7) of {b, a} (a: bytes
    0..3), or, where nibble i has bit 3 set, that byte's top bit replicated."""
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = src[nib & 7]
        out |= ((0xFF if byte & 0x80 else 0) if nib & 8 else byte) << (8 * i)
    return out


def swar_signs(w, threshold):
    """KeepSwar::signs (dropout_packed.cuh)."""
    lo = 0x80 if threshold >= 256 else threshold & 0x7F
    m = M32 if threshold < 128 else 0
    d = ((w | 0x80808080) - lo * 0x01010101) & M32
    return (d & w) | ((d | w) & m)


def words_of(seed, offset, bh, row, col):
    k0, k1 = seed & M32, (seed >> 32) ^ (offset >> 32)
    return [int(x) for x in dropout.philox4x32(4 * (col // 32) + (col % 8) // 2, 8 * (row // 16) + row % 8, bh,
                                               offset & M32, k0, k1)]


@pytest.mark.parametrize("p", [0.001, 0.17, 0.6, 0.999])
def test_transposed_flags_and_packed_words_are_the_mirrors_mask(p):
    """keep_flags_transposed + drop_packed_word for one warp's 16-key tile of Pᵀ x 64 queries (the
    four 16-query blocks of BM 64), lane by lane: lane g draws the call of query parity g % 2 and
    sends lane g ^ 1 (lane ^ 4) the other key parity's bytes; the packed words' keep masks and
    signs are the mirror's mask (keys x queries)."""
    seed, offset, bh, query0 = 0x1234_5678_9ABC_DEF0, (3 << 32) + 16, 5, 64
    thr = dropout.drop_threshold(p)
    for key0 in (96, 112):   # the two 16-key halves of a 32-key block (words 0, 1 / 2, 3)
        flags, sent = [0] * 32, {}
        for qb in range(4):
            own, other = {}, {}
            for lane in range(32):
                g, t = lane // 4, lane % 4
                gp, key = g & 1, key0 + g
                w = words_of(seed, offset, bh, query0 + 16 * qb + 2 * t + gp, key)
                w0, w1 = (w[2], w[3]) if key & 16 else (w[0], w[1])
                own[lane] = prmt(w0, w1, 0x7531 if gp else 0x6420)
                sent[lane] = prmt(w0, w1, 0x6420 if gp else 0x7531)
            for lane in range(32):
                other[lane] = sent[lane ^ 4]
                gp = (lane // 4) & 1
                s0 = swar_signs(other[lane] if gp else own[lane], thr)
                s1 = swar_signs(own[lane] if gp else other[lane], thr)
                flags[lane] |= ((s0 & 0x80808080) | ((s1 >> 1) & 0x40404040)) >> (2 * qb)
        got = np.zeros((16, 64), bool)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for nt in range(8):
                for half in range(2):
                    qb, j = nt // 2, 2 * half + nt % 2
                    x, y = (flags[lane] << (2 * qb)) & M32, (flags[lane] << (2 * qb + 1)) & M32
                    keep = prmt(x, y, (0xC + j) << 12 | (0xC + j) << 8 | (0x8 + j) << 4 | (0x8 + j))
                    word = 0x3F80_3F80   # two bf16 1.0: Pᵀ ∘ Z and the signed Pᵀ
                    signed = word ^ (~keep & 0x80008000)
                    for e in range(2):
                        lane16 = (keep >> (16 * e)) & 0xFFFF
                        assert lane16 in (0, 0xFFFF)
                        assert ((word & keep) >> (16 * e)) & 0xFFFF == (0x3F80 if lane16 else 0)
                        assert ((signed >> (16 * e)) & 0xFFFF) == (0x3F80 if lane16 else 0xBF80)
                        got[g + 8 * half, 8 * nt + 2 * t + e] = lane16 == 0xFFFF
        want = dropout.keep_mask(seed, offset, p, 1, bh + 1, query0 + 64, key0 + 16)[0, bh, query0:, key0:]
        assert np.array_equal(got, want.T), (p, key0)


def drop_problem(op="bwd", causal=True, d=128, dtype="bf16", features=("dropout",), **kw):
    return Problem(op, dtype, 2, 1000, 1000, 8, 2, d, causal, features=features, dropout_p=0.1, **kw)


def test_drop_packed_flag(monkeypatch):
    """Set by for_problem from DROPOUT_PACKED (by head dim, a config's own form kept), named _dpk /
    _dpk2, the kernel's last template argument; refused with window / softcap / ALiBi, varlen,
    deterministic and head dim 256; off without dropout."""
    p = drop_problem()
    heur = BWD.for_problem(BWD.heuristic(p), p)
    assert heur.drop_packed == sm90_bwd.DROPOUT_PACKED.get(128, 0)
    for form, suffix in ((1, "_dpk"), (2, "_dpk2")):
        cfg = BWD.for_problem(heur.replace(drop_packed=form), p)
        assert cfg.drop_packed == form and cfg.name.endswith(suffix) and not cfg.problems(227 * 1024)
        assert cfg.kernel_name().endswith(f", {form}>")
        assert cfg.template_args()[-3] == form   # (kCapFold, kDqTail last)
        assert BWD.for_problem(cfg, p.replace(features=())).drop_packed == 0   # no dropout: off
        assert "drop_packed" not in BWD.encode(cfg.replace(drop_packed=0))
        for other in (("dropout", "window"), ("alibi", "dropout"), ("dropout", "softcap")):
            mixed = cfg.replace(**{f: True for f in other})
            assert any("drop_packed" in w for w in mixed.problems(227 * 1024)), other
        assert any("drop_packed" in w for w in cfg.replace(deterministic=True).problems(227 * 1024))
        # with the plain call's speed fields (DROPOUT_PLAIN_FLAGS) form 2 only (drop_packed_fast: the sets
        # checked, DROPOUT_FAST_SETS); form 1's kernels are unchecked
        fast = cfg.replace(**sm90_bwd.DROPOUT_PLAIN_FLAGS)
        assert (not fast.problems(227 * 1024)) if form == 2 else any("drop_packed" in w for w in fast.problems(227 * 1024))
        assert any("drop_packed" in w for w in fast.replace(frag_pin=False).problems(227 * 1024))
    monkeypatch.setattr(sm90_bwd, "DROPOUT_PACKED", {128: 2})
    assert BWD.for_problem(BWD.heuristic(p), p).drop_packed == 2
    assert BWD.for_problem(BWD.heuristic(drop_problem(d=64)), drop_problem(d=64)).drop_packed == 0
    # a plain config's kernel name is what it was before the flag
    plain = BWD.for_problem(heur, p.replace(features=()))
    assert not plain.kernel_name().endswith(", 0>")


@needs_nvcc
def test_drop_packed_instantiations_compile_without_spills():
    """drop_packed 2 (DROPOUT_PACKED's form) at head dims 64 and 128, bf16 and fp16, causal and not, and
    form 1 at d128 bf16 causal: no spills (ptxas, sm_90a)."""
    from concurrent.futures import ThreadPoolExecutor

    from cuflash.compile import nvcc_compile

    cfgs = []
    for d, dtype, causal in itertools.product((64, 128), ("bf16", "fp16"), (False, True)):
        p = drop_problem(causal=causal, d=d, dtype=dtype)
        base = BWD.for_problem(BWD.heuristic(p), p)
        cfgs += [BWD.for_problem(base.replace(drop_packed=f), p)
                 for f in ((1, 2) if (d, dtype, causal) == (128, "bf16", True) else (2,))]
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        reports = list(pool.map(lambda c: nvcc_compile([c], "sm_90a", NVCC)[0], cfgs))
    for c, r in zip(cfgs, reports):
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0, (c.name, r)
