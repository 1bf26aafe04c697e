"""CPU checks of dropout in the Hopper forward family sm90_fwd (kDropout; issue 12): selection
on sm_90 (sm90_fwd for the forward, fa2_fwd elsewhere and where sm90_fwd lacks a feature),
config names and kernel names (the plain ones unchanged), the params fields, and the nvcc
build of the dropout heuristics (zero spills, no wgmma serialization). No GPU is needed; the
mask itself is checked on the GPU (tests/test_sm90_dropout_gpu.py)."""
import itertools
import os
import shutil

import numpy as np
import pytest

from cuflash import dropout, registry
from cuflash.families.sm90_fwd import DROPOUT_BN, HEAD_DIMS, Sm90FwdConfig
from cuflash.problem import Problem
from cuflash.select import choose

FAM = registry.get("sm90_fwd")
NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")


def drop_problem(op="fwd", d=128, causal=True, p=0.1, dtype="bf16", **kw):
    return Problem(op, dtype, 2, 1000, 1000, 8, 2, d, causal, features=("dropout",), dropout_p=p, **kw)


def test_selection_runs_the_dropout_forward_on_sm90():
    fam, cfg, source = choose(drop_problem(), (9, 0), dirs=[])
    assert fam.name == "sm90_fwd" and cfg.dropout and source.startswith("heuristic")
    assert cfg.name == "sm90fwd_bf16_d128_causal_BM128_BN160_s2_c2_pp_drop"
    # elsewhere fa2_fwd, with its own dropout flag
    fam, cfg, _ = choose(drop_problem(), (8, 0), dirs=[])
    assert fam.name == "fa2_fwd" and cfg.dropout
    # varlen with dropout runs here too (tests/test_sm90_varlen_cpu.py); what sm90_fwd has not:
    # dropout with softcap at d128 (it spills: fa2_fwd runs it); dropout with window / ALiBi it
    # runs (tests/test_dropmix_cpu.py)
    varlen = drop_problem().replace(features=("dropout", "varlen"))
    assert FAM.supports((9, 0), varlen) == ""
    for f in ("window", "softcap", "alibi"):
        mixed = drop_problem().replace(features=tuple(sorted(("dropout", f))))
        assert (f"'{f}' with dropout" in FAM.supports((9, 0), mixed)) == (f == "softcap")
        assert registry.get("fa2_fwd").supports((9, 0), mixed) == ""   # the fallback runs it
    # the backward keeps its own family's choice (fa2_bwd regenerates the same mask)
    fam, cfg, _ = choose(drop_problem("bwd"), (9, 0), dirs=[])
    assert cfg.dropout


def test_dropout_heuristic_config_and_kernel_names():
    for d, dtype, causal in itertools.product(HEAD_DIMS, ("bf16", "fp16"), (False, True)):
        p = drop_problem(d=d, causal=causal, dtype=dtype)
        cfg = FAM.for_problem(FAM.heuristic(p), p)
        assert cfg.dropout and cfg.BN == DROPOUT_BN[d] and cfg.problems(227 * 1024) == []
        assert cfg.name.endswith("_pp_drop")
        assert cfg.kernel_name().endswith(f"cuflash::{dtype}, {str(causal).lower()}, false, false, false, true>")
        # kDropout, then kEmuExp2 (0 with dropout: tests/test_sm90_softcap_cpu.py)
        # (then kDynamic, kTmaStore and kVarlen, appended after them)
        assert cfg.template_args()[-5:-3] == (True, 0) and len(cfg.template_args()) == 17
        # the call sets the flag both ways; the encoded form carries none (as the feature flags)
        plain = FAM.for_problem(cfg, p.replace(features=()))
        assert not plain.dropout and FAM.for_problem(plain, p) == cfg
        assert "dropout" not in FAM.encode(cfg)
        assert FAM.for_problem(FAM.decode(FAM.encode(cfg), dtype, causal), p) == cfg
    # a plain config's names are what they were before kDropout (its tuned entries name them)
    plain = Sm90FwdConfig(128, 176, 2, 2, True, False, 128, "bf16", True)
    assert plain.name == "sm90fwd_bf16_d128_causal_BM128_BN176_s2_c2_pp"
    assert plain.kernel_name() == ("cuflash::sm90_fwd<128, 176, 2, 2, true, false, 128, cuflash::bf16, "
                                   "true, false, false, false>")
    assert FAM.encode(plain) == ("sm90_fwd:BM=128,BN=176,stages=2,consumers=2,pingpong=1,"
                                 "persistent=0,head_dim=128")
    assert plain.replace(dropout=True).name == "sm90fwd_bf16_d128_causal_BM128_BN176_s2_c2_pp_drop"


def test_params_carry_threshold_scale_and_an_rng_pointer():
    from cuflash.launch import struct_dtype

    dt = struct_dtype("Sm90FwdParams")
    # appended after the features (the scheduler's and varlen's fields come after them)
    i = dt.names.index("rng_state")
    assert dt.names[i:i + 3] == ("rng_state", "dropout_threshold", "dropout_scale")
    assert dt.fields["dropout_scale"][1] + 4 <= 576   # inside the 64-byte tail padding of the plain layout
    assert dt.fields["rng_state"][0] == np.uint64   # a per-call pointer field for Plan.run_with
    p = drop_problem(p=0.17)
    cfg = FAM.for_problem(FAM.heuristic(p), p)
    strides = {n: (1000 * 8 * 128, 8 * 128, 128, 1) for n in ("q", "o")}
    strides.update({n: (1000 * 2 * 128, 2 * 128, 128, 1) for n in ("k", "v")})
    static = FAM.static_params(cfg, p, strides, FAM.workspace(cfg, p, strides), 0.125, 132)
    assert static["dropout_threshold"] == 44 == dropout.drop_threshold(0.17)
    assert static["dropout_scale"] == float(np.float32(1) / (np.float32(1) - np.float32(0.17)))
    assert static["rng_state"] == 0
    plain = FAM.static_params(cfg.replace(dropout=False), p.replace(features=()), strides, {}, 0.125, 132)
    assert plain["dropout_threshold"] == 0


def test_kernel_source_applies_dropout_after_the_softmax_and_before_the_pv():
    """The order that makes l and the LSE plain attention's (FA2's Algorithm 2): the keep words
    of block j drawn under its GEMMs (after the issue, before the wait for S_j), softmax_step,
    then P_j packed and the keep words applied to the packed fragments (before O += P_j V_j);
    the keys warp-uniform; 1 / (1 - p) with 1 / l in the epilogue."""
    from cuflash.compile import kernel_dir

    src = (kernel_dir() / "sm90_fwd.cu").read_text()
    assert "bool kDropout = false" in src and '#include "philox.cuh"' in src
    body = src[src.index("for (int j = 1; j < n_blocks; ++j)"):]
    order = ["issue_pv(prev);", "turn.end();", "draw_keep(j);", "wgmma_wait<1>();", "softmax_s(slot, j)",
             "pack_a_frags", "drop_p();"]
    at = [body.index(x) for x in order]
    assert at == sorted(at), order
    first = src[src.index("issue_s(slot_of(0));"):]
    order = ["turn.end();", "draw_keep(0);", "wgmma_wait<0>();", "softmax_s(slot_of(0), 0);", "pack_a_frags",
             "drop_p();"]
    at = [first.index(x) for x in order]
    assert at == sorted(at), order
    assert "dropout.keep_words(keep, at.batch * p.nheads + at.head, warp_row0," in src
    assert "Dropout::apply_keep_words(p_frag, keep)" in src
    assert "Dropout::load_uniform(p.rng_state" in src
    assert "if constexpr (kDropout) inv_l *= dropout.scale;" in src   # 1 / (1 - p) with 1 / l


@needs_nvcc
def test_dropout_instantiations_compile_without_spills():
    """The dropout heuristics, every head dim (64, 96, 128, 192, 256), both masks, both dtypes
    across them, for sm_90a: no spills, no stack, no wgmma serialization (~20 s on 2 cores)."""
    from concurrent.futures import ThreadPoolExecutor

    from cuflash.compile import nvcc_compile

    cfgs = []
    for i, (d, causal) in enumerate(itertools.product(HEAD_DIMS, (False, True))):
        p = drop_problem(d=d, causal=causal, dtype=("bf16", "fp16")[i % 2])
        cfgs.append(FAM.for_problem(FAM.heuristic(p), p))
    chunks = [cfgs[i:i + 4] for i in range(0, len(cfgs), 4)]
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        reports = [r for rs in pool.map(lambda c: nvcc_compile(c, "sm_90a", NVCC), chunks) for r in rs]
    bad = [f"{c.name}: {r}" for c, r in zip(cfgs, reports)
           if r.spill_stores or r.spill_loads or r.stack_bytes
           or any("C751" in w or "serialized" in w for w in r.warnings)]
    assert all(c.dropout for c in cfgs) and not bad, "\n".join(bad)


def test_forced_dropout_config_wider_than_dropout_bn_is_refused():
    """A config= with dropout at a BN above DROPOUT_BN (d128 BN 192) would spill: refused,
    naming the limit, before any launch; the tuned plain d128 tile (BN 176) is refused with
    dropout too, as BN is not a multiple of 32 (a Philox call covers 32 keys)."""
    from cuflash import registry
    from cuflash.families.base import ConfigError
    from cuflash.families.sm90_fwd import DROPOUT_BN
    from cuflash.problem import Problem

    fam = registry.get("sm90_fwd")
    p = Problem("fwd", "bf16", 1, 1024, 1024, 4, 4, 128, True, features=("dropout",), dropout_p=0.1)
    odd = fam.heuristic(p.replace(features=(), dropout_p=0.0)).replace(BN=176, tma_store=False)
    assert any("multiple of 32" in why for why in odd.replace(dropout=True).problems(227 * 1024))
    assert not odd.problems(227 * 1024)   # the plain kernel keeps its tile
    wide = odd.replace(BN=192)
    assert wide.replace(dropout=True).problems(227 * 1024)
    assert any("DROPOUT_BN" in why for why in wide.replace(dropout=True).problems(227 * 1024))
    ok = fam.for_problem(fam.heuristic(p), p)
    assert ok.dropout and ok.BN == DROPOUT_BN[128] and not ok.problems(227 * 1024)
    with pytest.raises(ConfigError, match="DROPOUT_BN"):
        fam.for_problem(wide, p).validate()


@needs_nvcc
def test_keep_signs_is_the_byte_test_for_every_threshold(tmp_path):
    """philox.cuh's Dropout::keep_signs (the byte-parallel keep test of sm90_fwd's packed
    dropout), compiled for the host with nvcc and run: for every threshold 0..256 (p rounded to
    1/256; 256 drops everything) and every byte value in each of the four byte positions, with
    random neighbours (no borrow may cross a byte), bit 7 of the result's byte is byte >=
    threshold; and the prmt selectors of pair_mask (0x9988, 0xBBAA: the sign of bytes 0, 1 / 2, 3
    replicated over the 16-bit halves) as prmt defines them."""
    import subprocess

    from cuflash.compile import kernel_dir

    src = tmp_path / "signs.cu"
    src.write_text('#include "philox.cuh"\n#include <cstdio>\n#include <cstdlib>\n'
                   "int main() {\n"
                   "  unsigned bad = 0, n = 0; srand(7);\n"
                   "  for (unsigned thr = 0; thr <= 256; ++thr) {\n"
                   "    cuflash::Dropout d = cuflash::Dropout::make(0, 0, 0.f); d.threshold = thr;\n"
                   "    for (int pos = 0; pos < 4; ++pos)\n"
                   "      for (unsigned b = 0; b < 256; ++b)\n"
                   "        for (int rep = 0; rep < 4; ++rep) {\n"
                   "          unsigned w = (unsigned)rand() ^ ((unsigned)rand() << 16);\n"
                   "          w = (w & ~(0xFFu << (8 * pos))) | (b << (8 * pos));\n"
                   "          unsigned s = d.keep_signs(w);\n"
                   "          for (int i = 0; i < 4; ++i) {\n"
                   "            unsigned byte = (w >> (8 * i)) & 0xFFu;\n"
                   "            bool want = byte >= thr, got = (s >> (8 * i + 7)) & 1u;\n"
                   "            bad += want != got; ++n;\n"
                   "          }\n"
                   "        }\n"
                   "  }\n"
                   '  printf("%u %u\\n", bad, n);\n'
                   "  return 0;\n}\n")
    exe = tmp_path / "signs"
    subprocess.run([NVCC, "-std=c++17", "-I", str(kernel_dir()), "-o", str(exe), str(src)], check=True,
                   capture_output=True)
    bad, n = map(int, subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split())
    assert n == 257 * 4 * 256 * 4 * 4 and bad == 0, f"{bad} of {n} byte tests wrong"

    # prmt (default mode): result byte i takes byte c_i & 7 of {b, a}; c_i & 8 replicates its sign
    def prmt(a, b, c):
        src_bytes = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
        out = 0
        for i in range(4):
            sel = (c >> (4 * i)) & 0xF
            byte = src_bytes[sel & 7]
            out |= ((0xFF if byte & 0x80 else 0) if sel & 8 else byte) << (8 * i)
        return out

    for signs in range(16):   # the four sign bits of a keep_signs word
        word = sum(((signs >> i) & 1) << (8 * i + 7) for i in range(4)) | 0x15253545
        for pair, sel in ((0, 0x9988), (1, 0xBBAA)):
            lo, hi = (signs >> (2 * pair)) & 1, (signs >> (2 * pair + 1)) & 1
            assert prmt(word, 0, sel) == (0xFFFF if lo else 0) | ((0xFFFF if hi else 0) << 16)
    text = (kernel_dir() / "philox.cuh").read_text()
    assert "pair ? 0xBBAAu : 0x9988u" in text


def test_backward_keep_signs_layout_is_the_mirrors_mask():
    """sm90_bwd's keep signs (philox.cuh keep_signs_transposed, pair_mask_of_signs), their steps
    mirrored in NumPy for a whole warp (the lane ^ 4 shuffle included): the mask that
    pair_mask_of_signs builds for fragment pair i of lane (g, t) keeps element e iff the mirror
    keeps its (query, key) (key key0 + g + 8·hk, query query0 + 8·nt + 2t + e, i = 2·nt + hk), for
    keys in both halves of a 32-key block and thresholds across the byte range."""
    from cuflash.compile import kernel_dir

    seed, offset, bh = 0x1234_5678_9ABC_DEF0, (3 << 32) + 77, 5
    text = (kernel_dir() / "philox.cuh").read_text()
    assert "const int qb = i / 4, hr = (i / 2) % 2, hk = i % 2, j = 2 * hk + hr;" in text
    assert "const u32 sel = (8u | j) * 0x11u | ((8u | (4 + j)) * 0x1100u);" in text
    assert "words[2 * qb] = keep_signs(gp ? other : own);" in text and "words[2 * qb + 1] = keep_signs(gp ? own : other);" in text

    def prmt(a, b, c):   # default mode; selector bit 3 replicates the byte's sign
        src = [(a >> (8 * k)) & 0xFF for k in range(4)] + [(b >> (8 * k)) & 0xFF for k in range(4)]
        out = 0
        for k in range(4):
            sel = (c >> (4 * k)) & 0xF
            byte = src[sel & 7]
            out |= ((0xFF if byte & 0x80 else 0) if sel & 8 else byte) << (8 * k)
        return out

    def pair_mask_of_signs(words, i):
        qb, hr, hk = i // 4, (i // 2) % 2, i % 2
        j = 2 * hk + hr
        sel = (8 | j) * 0x11 | ((8 | (4 + j)) * 0x1100)
        return prmt(words[2 * qb], words[2 * qb + 1], sel)

    for p, key0, query0 in ((0.17, 0, 0), (0.6, 16, 64), (0.05, 48, 1040)):
        thr = dropout.drop_threshold(p)
        keep = dropout.keep_mask(seed, offset, p, 1, bh + 1, query0 + 64, key0 + 48)[0, bh]
        k0, k1 = seed & 0xFFFFFFFF, ((seed >> 32) ^ (offset >> 32)) & 0xFFFFFFFF

        def signs(x):   # keep_signs: bit 7 of byte k is byte k >= threshold
            return sum((((x >> (8 * k)) & 0xFF) >= thr) << (8 * k + 7) for k in range(4))

        words = [[0] * 8 for _ in range(32)]
        for qb in range(4):
            own, send = [0] * 32, [0] * 32
            for lane in range(32):
                g, t = lane // 4, lane % 4
                gp, key, row = g & 1, key0 + g, query0 + 16 * qb + 2 * t + (g & 1)
                c0 = 4 * (key // 32) + (key % 8) // 2
                c1 = 8 * (row // 16) + row % 8
                w = [int(x) for x in dropout.philox4x32_10(c0, c1, bh, offset & 0xFFFFFFFF, k0, k1)]
                w0, w1 = (w[2], w[3]) if key & 16 else (w[0], w[1])
                own[lane] = prmt(w0, w1, 0x7531 if gp else 0x6420)
                send[lane] = prmt(w0, w1, 0x6420 if gp else 0x7531)
            for lane in range(32):
                gp = (lane // 4) & 1
                words[lane][2 * qb + gp] = signs(own[lane])
                words[lane][2 * qb + 1 - gp] = signs(send[lane ^ 4])
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for i in range(16):
                nt, hk = i // 2, i % 2
                mask = pair_mask_of_signs(words[lane], i)
                for e in range(2):
                    got = (mask >> (16 * e)) & 0xFFFF
                    q, k = query0 + 8 * nt + 2 * t + e, key0 + g + 8 * hk
                    assert got == (0xFFFF if keep[q, k] else 0), (p, key0, lane, i, e)
