"""CPU checks of sm90_fwd_fp8's prepare kernel (kernels_cu/sm90_fwd_fp8.cu sm90_fwd_fp8_prepare:
Vᵀ and the descales in the launch's workspace) and of the FP8 host path around it: the launch
list, the appended params fields, the per-call descale fields (fake driver), a NumPy model of
the kernel's thread mapping (shared-memory tile, byte permutes) against cuflash.fp8.vt_mirror,
and the nvcc build of the kernel (no spills). No GPU.
"""
import os
import shutil

import numpy as np
import pytest

from cuflash import fp8, launch, registry
from cuflash.compile import kernel_param_decl, parse_ptxas, render_source
from cuflash.families import sm90_fwd
from cuflash.families.sm90_fwd_fp8 import (PERM16, PREP_COLS, PREP_KEYS, PREP_THREADS,
                                           Sm90FwdFp8Config, vt_shape)
from cuflash.problem import Problem

FAM = registry.get("sm90_fwd_fp8")
NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
GOOD = Sm90FwdFp8Config(BM=128, BN=128, stages=2, consumers=2, pingpong=True, persistent=False,
                        head_dim=128, dtype="e4m3", causal=False)


def problem(head_dim=128, batch=2, seqlen_q=300, seqlen_k=200, nheads=8, nheads_kv=2, causal=False):
    return Problem("fwd", "e4m3", batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, causal)


# ---------------------------------------------------------------------------------------
# launch list and params

def test_prepare_launches_first():
    p = problem(96, seqlen_k=1023)
    specs = FAM.launches(FAM.heuristic(p), p, 132)
    assert [s.role for s in specs] == ["prepare", "main"]
    prep = specs[0]
    key_tiles = -(-1024 // PREP_KEYS)                      # seqlen_k rounded to 16 = 1024
    assert prep.grid == (2 * 2 * 2 * key_tiles, 1, 1)      # batch x kv heads x 2 column tiles (96)
    assert prep.threads == PREP_THREADS == 128 and prep.smem == 0
    names = FAM.kernel_names(GOOD)
    assert names["prepare"] == f"cuflash::sm90_fwd_fp8_prepare<{PREP_KEYS}, {PREP_COLS}>"
    assert names["main"] == GOOD.kernel_name()
    with pytest.raises(ValueError, match="too many Vᵀ tiles"):
        FAM.launches(GOOD, problem(128, batch=2 ** 24, nheads=8, nheads_kv=8, seqlen_k=2 ** 12,
                                   seqlen_q=1), 132)


def test_params_appended_fields():
    """The prepare kernel's fields come after the main kernel's (whose offsets, and so whose
    code, stay as they were)."""
    st = launch.struct_dtype("Sm90FwdFp8Params")
    names = st.names
    tail = ("v_batch_stride", "v_row_stride", "v_head_stride", "v_col_stride", "q_descale_in",
            "k_descale_in", "v_descale_in", "vt_keys", "descale_per_head")
    assert names[-len(tail):] == tail
    assert names.index("scale_log2") == len(names) - len(tail) - 1
    p = problem(128, seqlen_k=37)
    sv = (37 * 2 * 384, 2 * 384, 384, 3)                   # strided V: every third byte
    static = FAM.static_params(GOOD, p, {"q": (1, 1, 1, 1), "k": (1, 1, 1, 1), "v": sv,
                                         "o": (1, 1, 1, 1)}, FAM.workspace(GOOD, p), 0.1, 132)
    assert (static["v_batch_stride"], static["v_row_stride"], static["v_head_stride"],
            static["v_col_stride"]) == sv
    assert static["vt_keys"] == 48 == vt_shape(p)[3]
    assert static["q_descale_in"] == static["k_descale_in"] == static["v_descale_in"] == 0


def _fake_plan(monkeypatch, p, strides):
    monkeypatch.setattr(sm90_fwd, "_encoder", lambda *a: bytes(128))
    kern = lambda ptr: type("K", (), {"kernel": type("k", (), {"ptr": ptr})})  # noqa: E731
    monkeypatch.setattr(launch, "get_kernels", lambda cfg, dev: {"main": kern(2), "prepare": kern(1)})
    monkeypatch.setattr(launch._gpu, "sm_count", lambda dev: 132)
    calls = []
    monkeypatch.setattr(launch, "_driver_launch", lambda: (lambda *a: calls.append(a)))
    monkeypatch.setattr(launch, "_device_fns", lambda: (lambda: 0, lambda d: None))
    return launch.Plan(FAM, GOOD, p, strides, 0.1, 0), calls


def test_run_plan_writes_descale_fields(monkeypatch):
    """run_plan: prepare then main on one stream; the caller's descale addresses and per-head
    bits in the params (a None descale: address 0, the kernel writes 1)."""
    p = problem(128)
    sq = (300 * 8 * 128, 8 * 128, 128, 1)
    sk = (200 * 2 * 128, 2 * 128, 128, 1)
    plan, calls = _fake_plan(monkeypatch, p, {"q": sq, "k": sk, "v": sk, "o": sq})

    class Dev:   # a stand-in for a torch tensor: only what run_plan reads
        def __init__(self, ptr, shape):
            self.ptr, self.shape, self.ndim = ptr, shape, len(shape)

        def is_contiguous(self):
            return True

        def data_ptr(self):
            return self.ptr

    seen = []
    orig = plan.run

    def spy(ptrs, ws, stream):
        rec = plan._record
        seen.append((int(rec["q_descale_in"][0]), int(rec["k_descale_in"][0]),
                     int(rec["v_descale_in"][0]), int(rec["descale_per_head"][0])))
        return orig(ptrs, ws, stream)

    monkeypatch.setattr(plan, "run", spy)
    fp8.run_plan(plan, (0x1000, 0x2000, 0x3000, 0x4000, 0x5000), 0x10000,
                 (Dev(0xA00, (1,)), Dev(0xB00, (2, 2)), None), "torch", 7)
    assert seen == [(0xA00, 0xB00, 0, 0b010)]
    assert [c[0] for c in calls] == [1, 2]                  # prepare, then main
    assert all(c[8] == 7 for c in calls)                    # one stream
    assert calls[0][1] == FAM.launches(GOOD, p, 132)[0].grid[0] and calls[0][4] == 128
    # the workspace pointers the prepare kernel writes
    rec, ws = plan._record, FAM.workspace(GOOD, p)
    assert int(rec["vt"][0]) == 0x10000 + ws["vt"] and int(rec["v_descale"][0]) == 0x10000 + ws["v_descale"]
    # a 0-d descale is per tensor
    fp8.run_plan(plan, (0x1000, 0x2000, 0x3000, 0x4000, 0x5000), 0x10000,
                 (None, None, Dev(0xC00, ())), "torch", 7)
    assert seen[-1] == (0, 0, 0xC00, 0)


# ---------------------------------------------------------------------------------------
# a NumPy model of the prepare kernel, thread by thread

def _byte_perm(x: int, y: int, s: int) -> int:
    """CUDA's __byte_perm: result byte n = byte (s >> 4n) & 7 of the 8 bytes y:x."""
    b = (x | (y << 32))
    return sum(((b >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n) for n in range(4))


def prepare_model(v8: np.ndarray, vt_keys: int, keys=PREP_KEYS, cols=PREP_COLS) -> np.ndarray:
    """sm90_fwd_fp8_prepare's index math, CTA by CTA and thread by thread, on a poisoned Vᵀ."""
    b_, sk, hkv, d = v8.shape
    vt = np.full((b_, hkv, d, vt_keys), 0xEE, np.uint8)
    row_words, groups = cols // 4, keys // 16
    group_words = 16 * row_words + 4
    key_tiles, col_tiles = -(-vt_keys // keys), -(-d // cols)
    for cta in range(b_ * hkv * col_tiles * key_tiles):
        key0 = (cta % key_tiles) * keys
        c = cta // key_tiles
        col0 = (c % col_tiles) * cols
        bh = c // col_tiles
        b, h = bh // hkv, bh % hkv
        tile = np.zeros(groups * group_words * 4, np.uint8)      # bytes of the u32 words
        for it in range(keys * cols // 16):
            key, piece = it // (cols // 16), it % (cols // 16)
            col = col0 + 16 * piece
            x = np.zeros(16, np.uint8)
            if key0 + key < sk and col < d:
                x = v8[b, key0 + key, h, col:col + 16]
            w0 = (key // 16) * group_words + (key % 16) * row_words + 4 * piece
            assert w0 % 4 == 0                                   # the 16-byte shared store
            tile[4 * w0:4 * w0 + 16] = x
        words = tile.view("<u4")
        for tid in range(PREP_THREADS):
            grp, w = tid % groups, tid // groups
            col, key = col0 + 4 * w, key0 + 16 * grp
            if col >= d or key >= vt_keys:
                continue
            g = grp * group_words + w
            out = np.zeros((4, 4), np.uint32)
            for i in range(4):
                a, bb = int(words[g + 2 * i * row_words]), int(words[g + (2 * i + 1) * row_words])
                cc, dd = int(words[g + (8 + 2 * i) * row_words]), int(words[g + (9 + 2 * i) * row_words])
                ab_lo, ab_hi = _byte_perm(a, bb, 0x5140), _byte_perm(a, bb, 0x7362)
                cd_lo, cd_hi = _byte_perm(cc, dd, 0x5140), _byte_perm(cc, dd, 0x7362)
                out[0, i] = _byte_perm(ab_lo, cd_lo, 0x5410)
                out[1, i] = _byte_perm(ab_lo, cd_lo, 0x7632)
                out[2, i] = _byte_perm(ab_hi, cd_hi, 0x5410)
                out[3, i] = _byte_perm(ab_hi, cd_hi, 0x7632)
            for j in range(4):
                vt[b, h, col + j, key:key + 16] = out[j].astype("<u4").view(np.uint8)
    return vt


@pytest.mark.parametrize("sk,hkv,d", [(1, 1, 64), (17, 2, 48), (113, 1, 256), (300, 2, 80)])
def test_prepare_model_matches_vt_mirror(sk, hkv, d):
    rng = np.random.default_rng(sk * 1000 + d)
    v8 = rng.integers(0, 256, (2, sk, hkv, d)).astype(np.uint8)
    s_pad = -(-sk // 16) * 16
    got = prepare_model(v8, s_pad)
    want = fp8.vt_mirror(v8)
    assert np.array_equal(got, want), np.argwhere(got != want)[:5]


def test_byte_perm_model():
    assert _byte_perm(0x03020100, 0x07060504, 0x5140) == 0x05010400
    assert _byte_perm(0x03020100, 0x07060504, 0x3210) == 0x03020100
    assert _byte_perm(0x03020100, 0x07060504, 0x7654) == 0x07060504
    assert PERM16[:4] == (0, 1, 8, 9)


# ---------------------------------------------------------------------------------------
# nvcc / ptxas

@needs_nvcc
def test_prepare_kernel_builds_without_spills(tmp_path):
    import subprocess

    expr = FAM.kernel_names(GOOD)["prepare"]
    src = tmp_path / "prep.cu"
    src.write_text(render_source(FAM.name) + '\n#line 1 "instantiations"\n'
                   + f"template __global__ void {expr}({kernel_param_decl(FAM, 'prepare')});\n")
    proc = subprocess.run([NVCC, "-cubin", "-arch=sm_90a", "-std=c++17", "-Xptxas", "-v",
                           "-o", str(tmp_path / "prep.cubin"), str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    (rep,) = parse_ptxas(proc.stderr + proc.stdout)
    assert "sm90_fwd_fp8_prepare" in rep.kernel
    assert rep.spill_stores == rep.spill_loads == rep.stack_bytes == 0 and not rep.warnings, rep
    assert rep.registers <= 64, rep
