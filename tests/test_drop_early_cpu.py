"""sm90_fwd's drop_early (kDropEarly, kernels_cu/dropout_packed.cuh) without a GPU: the SWAR keep
test against byte >= threshold for every byte and threshold (compiled for the host), the
draw / apply walk lane by lane (NumPy, prmt's sign replication spelled out) against the mirror's
keep mask, the config flag, and the instantiations' ptxas reports (no spills, no serialization)."""
import os
import shutil
import subprocess

import numpy as np
import pytest

from cuflash import dropout, registry
from cuflash.compile import kernel_dir
from cuflash.families import sm90_fwd
from cuflash.problem import Problem

NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
FAM = registry.get("sm90_fwd")


def drop_problem(causal=True, d=128, p=0.1, **kw):
    return Problem("fwd", "bf16", 2, 8192, 8192, 16, 16, d, causal, features=("dropout",), dropout_p=p, **kw)


def swar_signs(words, threshold):
    """KeepSwar's arithmetic in NumPy (uint32 words -> byte-sign flags)."""
    lo = 0x80 if threshold >= 256 else threshold & 0x7F
    m = np.uint32(0xFFFFFFFF if threshold < 128 else 0)
    w = np.asarray(words, np.uint32)
    d = (w | np.uint32(0x80808080)) - np.uint32(lo * 0x01010101)
    return (d & w) | ((d | w) & m)


def test_swar_keep_test_is_byte_ge_threshold_numpy():
    b = np.arange(256, dtype=np.uint32)
    words = b | (np.roll(b, 1) << 8) | (np.roll(b, 7) << 16) | (np.roll(b, 100) << 24)
    for thr in range(257):
        s = swar_signs(words, thr)
        for k in range(4):
            got = (s >> np.uint32(8 * k + 7)) & 1
            want = ((words >> np.uint32(8 * k)) & 0xFF) >= thr
            assert np.array_equal(got.astype(bool), want), (thr, k)


@needs_nvcc
def test_swar_keep_test_is_byte_ge_threshold_cuh(tmp_path):
    """KeepSwar (dropout_packed.cuh) compiled for the host: every byte in every lane position, every
    threshold 0..256, against Dropout::keeps."""
    src = tmp_path / "t.cu"
    src.write_text('''#include "dropout_packed.cuh"
#include <cstdio>
using namespace cuflash;
int main() {
    for (u32 thr = 0; thr <= 256; ++thr) {
        const KeepSwar swar = KeepSwar::make(thr);
        Dropout d = Dropout::make(0, 0, 0.f);
        d.threshold = thr;
        for (u32 b = 0; b < 256; ++b) {
            const u32 w = b | ((b * 7u + 3u) & 255u) << 8 | ((b ^ 0x5Au) << 16) | ((255u - b) << 24);
            const u32 s = swar.signs(w);
            for (int k = 0; k < 4; ++k)
                if (((s >> (8 * k + 7)) & 1u) != (d.keeps(w, k) ? 1u : 0u)) { printf("bad %u %u %d\\n", thr, b, k); return 1; }
        }
    }
    printf("ok\\n");
}
''')
    exe = tmp_path / "t"
    subprocess.run([NVCC, "-std=c++17", "-I", str(kernel_dir()), "-o", str(exe), str(src)], check=True,
                   capture_output=True)
    assert subprocess.run([str(exe)], capture_output=True, text=True).stdout.strip() == "ok"


def prmt_sign(a, sel):
    """prmt.b32 d, a, 0, sel with each selector nibble's bit 3 set: byte i of d is byte
    (nibble i & 7) of (a, 0)'s sign replicated."""
    out = 0
    for i in range(4):
        src = (sel >> (4 * i)) & 7
        byte = (a >> (8 * src)) & 0xFF if src < 4 else 0
        out |= (0xFF if byte & 0x80 else 0) << (8 * i)
    return out


@pytest.mark.parametrize("p", [0.17, 0.6])
def test_draw_and_apply_walk_is_the_mirrors_mask(p):
    """draw_keep_flags + and_keep_flags lane by lane on a warp's 16 x 64 tile at (query0, key0):
    the fragment words' 16-bit masks (pack_a_frags' layout: tile nt's rows g / g + 8 in
    frag[nt / 2][2 (nt % 2) + half], element e in the low / high 16 bits) are the mirror's mask."""
    seed, offset, bh, query0, key0 = 0x1234_5678_9ABC_DEF0, (3 << 32) + 16, 5, 48, 96
    thr = dropout.drop_threshold(p)
    k0, k1 = seed & 0xFFFFFFFF, (seed >> 32) ^ (offset >> 32)
    got = np.zeros((16, 64), bool)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for blk in range(2):
            row, col = query0 + g, key0 + 32 * blk + 2 * t
            words = dropout.philox4x32(4 * (col // 32) + (col % 8) // 2, 8 * (row // 16) + row % 8, bh,
                                       offset & 0xFFFFFFFF, k0, k1)
            for ct in range(4):
                s = int(swar_signs(int(words[ct]), thr))
                for half, sel in ((0, 0x9988), (1, 0xBBAA)):
                    mask = prmt_sign(s, sel)
                    nt = 4 * blk + ct
                    for e in range(2):
                        lanes16 = (mask >> (16 * e)) & 0xFFFF
                        assert lanes16 in (0, 0xFFFF)
                        got[g + 8 * half, 8 * nt + 2 * t + e] = lanes16 == 0xFFFF
    want = dropout.keep_mask(seed, offset, p, 1, bh + 1, query0 + 16, key0 + 64)[0, bh, query0:, key0:]
    assert np.array_equal(got, want)


def test_drop_early_flag():
    """Set with drop_packed from DROPOUT_EARLY (a config's own True kept), named _dpe, refused without
    drop_packed, off without dropout; the kernel's last template argument."""
    p = drop_problem()
    heur = FAM.for_problem(FAM.heuristic(p), p)
    assert heur.drop_packed and heur.drop_early == sm90_fwd.DROPOUT_EARLY.get(128, 0)
    early = FAM.for_problem(heur.replace(drop_early=1), p)
    assert early.drop_early == 1 and early.name.endswith("_dpk_dpe") and not early.problems(227 * 1024)
    assert early.kernel_name().endswith(", true, 1>")
    assert any("drop_early 2" in w for w in heur.replace(drop_early=2).problems(227 * 1024))   # BN 160
    two = FAM.for_problem(heur.replace(drop_early=2, BN=sm90_fwd.DROP_EARLY_MASKS_BN), p)
    assert two.name.endswith("_dpk_dpe2") and two.kernel_name().endswith(", true, 2>") and not two.problems(227 * 1024)
    assert early.replace(drop_early=3).problems(227 * 1024)
    assert any("needs drop_packed" in w for w in early.replace(drop_packed=False).problems(227 * 1024))
    plain = p.replace(features=(), dropout_p=0.0)
    assert not FAM.for_problem(early, plain).drop_early
    assert "dpe" not in FAM.for_problem(FAM.heuristic(plain), plain).kernel_name()


@needs_nvcc
def test_drop_early_instantiations_compile_without_spills():
    from concurrent.futures import ThreadPoolExecutor

    from cuflash.compile import nvcc_compile

    cfgs = [FAM.for_problem(FAM.heuristic(p), p).replace(drop_early=form, **bn)
            for p in (drop_problem(True), drop_problem(False))
            for form, bn in ((1, {}), (2, dict(BN=sm90_fwd.DROP_EARLY_MASKS_BN)))]
    # form 4 (the producer warpgroup draws): the static grid, non-causal
    cfgs.append(FAM.for_problem(FAM.heuristic(drop_problem(False)), drop_problem(False)).replace(
        drop_early=4, dynamic=False))
    with ThreadPoolExecutor(max_workers=2) as pool:
        reports = list(pool.map(lambda c: nvcc_compile([c], "sm_90a", NVCC)[0], cfgs))
    bad = [f"{c.name}: {r}" for c, r in zip(cfgs, reports)
           if r.spill_stores or r.spill_loads or r.stack_bytes
           or any("C751" in w or "serialized" in w for w in r.warnings)]
    assert not bad, "\n".join(bad)


def test_dropout_plain_flags_bwd_config(monkeypatch):
    """sm90_bwd DROPOUT_PLAIN: off, a d128 dropout call keeps the dropout backward's own flags; on,
    the non-causal one takes DROPOUT_PLAIN_FLAGS (valid: dropout_plain), the causal one not; any
    other subset of the flags with dropout stays refused."""
    from cuflash.families import sm90_bwd
    from cuflash.select import choose

    p = drop_problem(False).replace(op="bwd")
    monkeypatch.setattr(sm90_bwd, "DROPOUT_FAST", {})   # (on: the drop_packed 2 kernel with the fields, test_drp8_cpu)
    off = choose(p, (9, 0), "", 227 * 1024)[1]
    assert off.family == "sm90_bwd" and not off.dynamic and not off.dropout_plain()
    monkeypatch.setattr(sm90_bwd, "DROPOUT_PLAIN", True)
    on = choose(p, (9, 0), "", 227 * 1024)[1]
    assert on.dropout_plain() and not on.problems(227 * 1024)
    assert all(getattr(on, k) == v for k, v in sm90_bwd.DROPOUT_PLAIN_FLAGS.items())
    causal = choose(drop_problem(True).replace(op="bwd"), (9, 0), "", 227 * 1024)[1]
    assert not causal.dynamic and not causal.dropout_plain()
    assert on.replace(frag_pin=False).problems(227 * 1024)
    # the per-element keep bits' kernel (drop_packed 0) is built non-causal only; with drop_packed 2 the
    # fields are the drop_packed_fast tile's (DROPOUT_FAST_SETS), causal too
    assert on.replace(causal=True, drop_packed=0).problems(227 * 1024)
    assert on.drop_packed == 2 and not on.replace(causal=True).problems(227 * 1024)


@needs_nvcc
def test_dropout_plain_flags_bwd_compiles_without_spills():
    from cuflash.compile import nvcc_compile
    from cuflash.families import sm90_bwd

    p = drop_problem(False).replace(op="bwd")
    fam = registry.get("sm90_bwd")
    cfg = fam.for_problem(fam.heuristic(p), p).replace(**sm90_bwd.DROPOUT_PLAIN_FLAGS)
    assert cfg.dropout_plain()
    r = nvcc_compile([cfg], "sm_90a", NVCC)[0]
    assert not (r.spill_stores or r.spill_loads or r.stack_bytes), f"{cfg.name}: {r}"
    assert not any("C751" in w or "serialized" in w for w in r.warnings), r.warnings


def test_varlen_small_head_dims_rank(monkeypatch):
    """sm90_bwd VARLEN_SMALL_D ({64, 96}: measured faster than fa2_bwd): the varlen backward at d <= 96 ranks
    above fa2_bwd; with the set empty below it (fa2_bwd). VARLEN_SMALL_D_FEATURES ({64: window, softcap,
    ALiBi and their mixes; 96: those, dropout, dropout + window}): those rank above fa2_bwd; dropout and its
    mixes at d <= 64, dropout with softcap or ALiBi at 65..96 below it."""
    from cuflash.families import sm90_bwd
    from cuflash.select import choose

    fam = registry.get("sm90_bwd")
    p64 = Problem("bwd", "bf16", 4, 2048, 2048, 16, 16, 64, True, features=("varlen",))
    p96 = p64.replace(head_dim=96)
    assert fam.rank(p64) >= 0 and fam.rank(p96) >= 0
    want = "sm90_bwd" if sm90_bwd.VARLEN_BWD else "fa2_bwd"
    assert choose(p64, (9, 0), "", 227 * 1024)[1].family == want
    assert choose(p96, (9, 0), "", 227 * 1024)[1].family == want
    monkeypatch.setattr(sm90_bwd, "VARLEN_SMALL_D", frozenset({64}))
    assert fam.rank(p96) < 0 and choose(p96, (9, 0), "", 227 * 1024)[1].family == "fa2_bwd"
    monkeypatch.setattr(sm90_bwd, "VARLEN_SMALL_D", frozenset())
    assert fam.rank(p64) < 0 and choose(p64, (9, 0), "", 227 * 1024)[1].family == "fa2_bwd"
    assert fam.rank(p64.replace(head_dim=128)) >= 0
    feat = lambda *f, **kw: p64.replace(features=tuple(sorted(f + ("varlen",))), **kw)  # noqa: E731
    for f, kw in ((("window",), dict(window=(256, 0))), (("softcap",), dict(softcap=30.0)), (("alibi",), {})):
        assert fam.rank(feat(*f, **kw)) >= 0, f                      # (VARLEN_SMALL_D_FEATURES: on at d64)
        assert fam.rank(feat(*f, **kw).replace(head_dim=96)) >= 0, f  # (65..96: session 25)
    assert fam.rank(feat("dropout", dropout_p=0.1)) < 0                # (measured no faster: fa2_bwd)
    assert fam.rank(feat("dropout", dropout_p=0.1).replace(head_dim=96)) >= 0
    assert fam.rank(feat("alibi", "window", window=(256, 0)).replace(head_dim=96)) >= 0
    assert fam.rank(feat("dropout", "softcap", dropout_p=0.1, softcap=30.0).replace(head_dim=96)) < 0
    assert fam.rank(feat("alibi", "dropout", dropout_p=0.1).replace(head_dim=96)) < 0
    assert fam.rank(feat("softcap", "window", softcap=30.0, window=(256, 0))) >= 0   # (pairs without dropout: timed)
    assert fam.rank(feat("dropout", "window", dropout_p=0.1, window=(256, 0))) < 0    # (with dropout: no faster)
    monkeypatch.setattr(sm90_bwd, "VARLEN_SMALL_D_FEATURES", {})
    assert fam.rank(feat("window", window=(256, 0))) < 0


@pytest.mark.parametrize("form", [1, 2])
def test_dropout_early_switch(monkeypatch, form):
    """DROPOUT_EARLY {128: form}: dropout alone at d128 takes it (form 2 at DROP_EARLY_MASKS_BN), a
    mix (a window too) or varlen does not; every config valid."""
    monkeypatch.setattr(sm90_fwd, "DROPOUT_EARLY", {128: form})
    for causal in (False, True):
        p = drop_problem(causal)
        cfg = FAM.for_problem(FAM.heuristic(p, (9, 0)), p)
        assert cfg.drop_early == form and not cfg.problems(227 * 1024), cfg.name
        assert cfg.BN == (sm90_fwd.DROP_EARLY_MASKS_BN if form == 2 else sm90_fwd.DROPOUT_BN[128])
        mix = p.replace(features=("dropout", "window"), window=(256, 0))
        mcfg = FAM.for_problem(FAM.heuristic(mix, (9, 0)), mix)
        assert mcfg.drop_early == 0 and mcfg.drop_packed
    d64 = drop_problem(d=64)
    assert FAM.for_problem(FAM.heuristic(d64, (9, 0)), d64).drop_early == 0


def test_drop_early_bn_limits():
    """Form 1 up to DROP_EARLY_SIGNS_BN, form 2 up to DROP_EARLY_MASKS_BN; a wider dropout config
    (drop_packed's BN 192, forced) keeps drop_early 0 under DROPOUT_EARLY."""
    p = drop_problem(False)
    heur = FAM.for_problem(FAM.heuristic(p), p)
    wide = FAM.for_problem(heur.replace(BN=192, drop_early=0), p)
    assert wide.drop_packed and wide.drop_early == 0 and not wide.problems(227 * 1024)
    assert any("drop_early 1" in w for w in wide.replace(drop_early=1).problems(227 * 1024))


def test_timing_form_is_refused_unless_asked(monkeypatch):
    """drop_early 3 (form 1 without the Philox rounds: not the mask) only with DROP_EARLY_TIMING."""
    p = drop_problem(False)
    heur = FAM.for_problem(FAM.heuristic(p), p)
    assert any("timing form" in w for w in heur.replace(drop_early=3).problems(227 * 1024))
    monkeypatch.setattr(sm90_fwd, "DROP_EARLY_TIMING", True)
    three = heur.replace(drop_early=3)
    assert not three.problems(227 * 1024) and three.name.endswith("_dpe3") and three.kernel_name().endswith(", 3>")


def test_drop_early_producer_form_rules():
    """drop_early 4: the static tile order, 2 consumers, non-causal; its shared memory counted."""
    p = drop_problem(False)
    heur = FAM.for_problem(FAM.heuristic(p), p)
    four = heur.replace(drop_early=4, dynamic=False)
    assert not four.problems(227 * 1024) and four.name.endswith("_dpk_dpe4")
    assert four.smem_bytes == heur.replace(dynamic=False).smem_bytes + 2 * 128 * 5 * 16 + 2 * 16 + 16
    for bad in (dict(dynamic=True), dict(causal=True)):
        assert any("drop_early 4" in w for w in four.replace(**bad).problems(227 * 1024)), bad
