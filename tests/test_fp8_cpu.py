"""CPU checks of the FP8 Hopper forward family sm90_fwd_fp8 (cuflash/families/sm90_fwd_fp8.py,
kernels_cu/sm90_fwd_fp8.cu, kernels_cu/ptx_sm90_fp8.cuh) and of cuflash.fp8 (e4m3 codec,
reference, error baseline, the Vᵀ mirror, argument checks): the generated wgmma block, config
rules, the dtype claim, the params struct and tensor maps (fake encoder), a NumPy model of the
P fragment / Vᵀ key order, and the nvcc/ptxas build (no spills, no "wgmma serialized"). No GPU.

`python tests/test_fp8_cpu.py --write` regenerates the wgmma block of ptx_sm90_fp8.cuh.
"""
import itertools
import math
import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# ---------------------------------------------------------------------------------------
# the generated wgmma wrappers of ptx_sm90_fp8.cuh

# Tile widths N of the m64nNk32 e4m3 wrappers: S's BN (128) and every head dim (P V's N).
WGMMA_FP8_N = (64, 128, 256)
BEGIN = "// ---- generated fp8 wgmma wrappers: begin ----\n"
END = "// ---- generated fp8 wgmma wrappers: end ----\n"


def wgmma_fp8_wrappers() -> str:
    """The WgmmaE4m3<N> specializations (ss and rs forms) for every N of WGMMA_FP8_N. FP8
    wgmma has no transpose immediates: both operands K-major."""
    out = []
    for n in WGMMA_FP8_N:
        r = n // 2
        regs = ", ".join(f"%{i}" for i in range(r))
        ops = ",\n".join("          " + ", ".join(f'"+f"(d[{i}])' for i in range(j, min(j + 8, r)))
                         for j in range(0, r, 8))
        shape = f"m64n{n}k32.f32.e4m3.e4m3"
        out += [
            f"template <> struct WgmmaE4m3<{n}> {{",
            f"    static __device__ __forceinline__ void ss(float (&d)[{r}], u64 desc_a, u64 desc_b, int scale_d) {{",
            f'        asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{r + 2}, 0;\\n"',
            f'            "wgmma.mma_async.sync.aligned.{shape} {{{regs}}}, "',
            f'            "%{r}, %{r + 1}, p, 1, 1;\\n}}\\n"',
            f"          :\n{ops}",
            '          : "l"(desc_a), "l"(desc_b), "r"(scale_d));',
            "    }",
            f"    static __device__ __forceinline__ void rs(float (&d)[{r}], const u32 (&a)[4], u64 desc_b, int scale_d) {{",
            f'        asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{r + 5}, 0;\\n"',
            f'            "wgmma.mma_async.sync.aligned.{shape} {{{regs}}}, "',
            f'            "{{%{r}, %{r + 1}, %{r + 2}, %{r + 3}}}, %{r + 4}, p, 1, 1;\\n}}\\n"',
            f"          :\n{ops}",
            '          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));',
            "    }",
            "};",
        ]
    return "\n".join(out) + "\n"


def _header_path():
    return ROOT / "kernels_cu" / "ptx_sm90_fp8.cuh"


def write_wrappers():
    path = _header_path()
    head, rest = path.read_text().split(BEGIN)
    _, tail = rest.split(END)
    path.write_text(head + BEGIN + wgmma_fp8_wrappers() + END + tail)


from cuflash import fp8, launch, registry  # noqa: E402
from cuflash.compile import nvcc_compile  # noqa: E402
from cuflash.families import sm90_fwd  # noqa: E402
from cuflash.families.base import ConfigError  # noqa: E402
from cuflash.families.sm90_fwd_fp8 import (BN, HEAD_DIMS, PERM16, Sm90FwdFp8Config,  # noqa: E402
                                           vt_shape)
from cuflash.problem import Problem  # noqa: E402
from cuflash.select import UnsupportedProblem, choose  # noqa: E402

FAM = registry.get("sm90_fwd_fp8")
NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
GOOD = Sm90FwdFp8Config(BM=128, BN=128, stages=2, consumers=2, pingpong=True, persistent=False,
                        head_dim=128, dtype="e4m3", causal=False)


def problem(head_dim=128, dtype="e4m3", causal=False, **kw):
    shape = dict(batch=2, seqlen_q=300, seqlen_k=200, nheads=8, nheads_kv=2)
    shape.update(kw)
    return Problem("fwd", dtype, shape["batch"], shape["seqlen_q"], shape["seqlen_k"],
                   shape["nheads"], shape["nheads_kv"], head_dim, causal)


def test_wgmma_block_is_generated():
    text = _header_path().read_text()
    assert text.split(BEGIN)[1].split(END)[0] == wgmma_fp8_wrappers(), \
        "ptx_sm90_fp8.cuh's wgmma block is stale: python tests/test_fp8_cpu.py --write"
    assert {BN} | set(HEAD_DIMS) <= set(WGMMA_FP8_N)


# ---------------------------------------------------------------------------------------
# config, dtype claim, selection

def test_good_config():
    assert GOOD.validate(227 * 1024) is GOOD
    assert GOOD.name == "sm90fwdfp8_e4m3_d128_full_BM128_BN128_s2_c2_pp"
    assert GOOD.kernel_name() == ("cuflash::sm90_fwd_fp8<128, 128, 2, 2, true, false, 128, cuflash::bf16, "
                                  "false>")
    # Q 128 x 128 B, 2 x K 128 x 128 B, 2 x Vᵀ 128 x 128 B, 10 mbarriers, 1024 alignment
    assert GOOD.smem_bytes == 128 * 128 + 2 * 128 * 128 + 2 * 128 * 128 + 80 + 1024
    d256 = GOOD.replace(head_dim=256)
    assert d256.smem_bytes == 2 * 128 * 128 * 3 + 2 * 256 * 128 + 80 + 1024 <= 227 * 1024


@pytest.mark.parametrize("change, pattern", [
    ({"dtype": "bf16"}, "dtype must be one of"),
    ({"BN": 64}, "BN must be 128"),
    ({"BM": 64}, "BM=64 must be 64 \\* consumers"),
    ({"head_dim": 192}, "head_dim must be one of"),
    ({"pingpong": True, "consumers": 1, "BM": 64}, "pingpong needs"),
    ({"consumers": 3, "BM": 192}, "would spill"),
    ({"stages": 1}, "stages must be >= 2"),
])
def test_each_rule(change, pattern):
    with pytest.raises(ConfigError, match=pattern):
        GOOD.replace(**change).validate()


def test_dtype_claim_and_selection():
    assert FAM.dtypes == ("e4m3",) and Sm90FwdFp8Config.dtypes == ("e4m3",)
    assert registry.families("fwd", "e4m3") == [FAM]
    assert FAM not in registry.families("fwd", "bf16")
    fam, cfg, _ = choose(problem(), (9, 0))
    assert fam is FAM and cfg == GOOD
    assert choose(problem(dtype="bf16"), (9, 0))[0].name == "sm90_fwd"    # bf16 never reaches fp8
    with pytest.raises(UnsupportedProblem, match="needs sm_90 exactly"):
        choose(problem(), (8, 0))
    assert "multiple of 16" in FAM.supports((9, 0), problem(72))


def test_heuristic_every_head_dim():
    for d, causal in itertools.product(range(16, 257, 16), (False, True)):
        cfg = FAM.heuristic(problem(d, causal=causal))
        assert cfg.head_dim == FAM.head_dim_of(d) >= d and cfg.problems(227 * 1024) == []


def test_space_valid_points():
    valid = FAM.valid(problem(64), 227 * 1024)
    assert any(c.consumers == 3 for c in valid)
    assert not any(c.consumers == 3 for c in FAM.valid(problem(128), 227 * 1024))


# ---------------------------------------------------------------------------------------
# params struct, workspace, tensor maps

def test_params_struct_and_workspace():
    st = launch.struct_dtype("Sm90FwdFp8Params")
    assert st.names[:9] == FAM.pointer_fields
    offs = [st.fields[f"tma_{t}"][1] for t in "qkv"]
    assert offs[0] % 64 == 0 and offs == [offs[0], offs[0] + 128, offs[0] + 256]
    p = problem(100 // 16 * 16 + 16)
    ws = FAM.workspace(GOOD, p)
    assert ws["q_descale"] == 0 and ws["k_descale"] == 256 and ws["v_descale"] == 512
    assert vt_shape(p) == (2, 2, 112, 208)
    assert ws["total"] == ws["vt"] + 2 * 2 * 112 * 208 and ws["vt"] % 256 == 0


def test_plan_writes_fp8_tensor_maps(monkeypatch):
    calls = []

    def encode(*args):
        calls.append(args)
        return bytes([len(calls)]) * 128

    monkeypatch.setattr(sm90_fwd, "_encoder", encode)
    kern = type("K", (), {"kernel": type("k", (), {"ptr": 1})})
    monkeypatch.setattr(launch, "get_kernels", lambda cfg, dev: {"main": kern, "prepare": kern})
    monkeypatch.setattr(launch._gpu, "sm_count", lambda dev: 132)
    monkeypatch.setattr(launch, "_driver_launch", lambda: (lambda *a: None))
    monkeypatch.setattr(launch, "_device_fns", lambda: (lambda: 0, lambda d: None))
    p = problem(128)
    sq = (300 * 8 * 128, 8 * 128, 128, 1)
    sk = (200 * 2 * 128, 2 * 128, 128, 1)
    plan = launch.Plan(FAM, GOOD, p, {"q": sq, "k": sk, "v": sk, "o": sq}, 0.1, 0)
    plan.run((0x1000, 0x2000, 0x3000, 0x4000, 0x5000), 0x10000, 0)
    ws = FAM.workspace(GOOD, p)
    assert [c[1] for c in calls] == [0x1000, 0x2000, 0x10000 + ws["vt"]]
    assert [c[0] for c in calls] == [0, 0, 0]                              # U8
    assert calls[0][2] == (128, 300, 8, 2) and calls[0][4] == (128, 128, 1, 1)
    assert calls[1][2] == (128, 200, 2, 2) and calls[1][3] == (256, 128, 200 * 256)
    assert calls[2][2] == (208, 128, 2, 2) and calls[2][3] == (208, 208 * 128, 208 * 128 * 2)
    assert calls[2][4] == (128, 128, 1, 1)
    rec = plan._record
    assert rec["q_descale"][0] == 0x10000 and rec["vt"][0] == 0x10000 + ws["vt"]
    assert bytes(rec["tma_v"][0].view(np.uint8)[:1]) == b"\x03"


# ---------------------------------------------------------------------------------------
# e4m3 codec, the fragment model, reference and baseline

def test_e4m3_table_and_rounding():
    t = fp8.e4m3_table()
    assert t[0x7E] == 448 and t[0x01] == 2.0 ** -9 and t[0x38] == 1.0 and np.isnan(t[0x7F])
    assert t[0xB8] == -1.0 and np.isnan(t[0xFF])
    codes = np.array([c for c in range(256) if (c & 0x7F) != 0x7F], np.uint8)
    assert np.array_equal(fp8.quantize_e4m3(t[codes]), np.where(codes == 0x80, 0, codes))   # -0 -> +0
    assert fp8.quantize_e4m3(1000.0) == 0x7E and fp8.quantize_e4m3(-1000.0) == 0xFE   # satfinite
    assert fp8.quantize_e4m3(1.0625) == 0x38                  # a tie: to the even mantissa (1.0)
    assert fp8.quantize_e4m3(1.1875) == 0x3A                  # tie between 1.125 and 1.25 -> 1.25
    ml = pytest.importorskip("ml_dtypes")
    x = np.random.default_rng(0).standard_normal(10000) * 30
    assert np.array_equal(fp8.quantize_e4m3(x), np.clip(x, -448, 448).astype(ml.float8_e4m3fn).view(np.uint8))


def test_perm16_makes_the_accumulators_the_a_fragment():
    """Model of the kernel's pack_p and of wgmma's e4m3 A fragment: thread (g, t) of a warp
    holds S accumulator [nt][2·half + e] = row g + 8·half, key 8·nt + 2t + e; fragment
    register r, byte i is row g + 8·(r % 2), k = 16·(r // 2) + 4t + i of a k32 step. P V
    through the fragments, with Vᵀ's keys in PERM16 order, equals P V."""
    rng = np.random.default_rng(1)
    P, V = rng.random((16, BN)), rng.random((BN, 8))
    vt = np.empty((8, BN))                      # Vᵀ as the host writes it
    for key0 in range(0, BN, 16):
        for pos in range(16):
            vt[:, key0 + pos] = V[key0 + PERM16[pos]]
    O = np.zeros((16, 8))
    for g, t in itertools.product(range(8), range(4)):
        acc = {(nt, 2 * h + e): P[g + 8 * h, 8 * nt + 2 * t + e]
               for nt in range(BN // 8) for h in range(2) for e in range(2)}
        for kk in range(BN // 32):
            for r in range(4):                  # the kernel's pack_p
                a = [acc[(4 * kk + 2 * (r // 2), 2 * (r % 2) + e)] for e in range(2)]
                b = [acc[(4 * kk + 2 * (r // 2) + 1, 2 * (r % 2) + e)] for e in range(2)]
                for i, x in enumerate(a + b):   # byte i: k index of the wgmma A layout
                    k = 32 * kk + 16 * (r // 2) + 4 * t + i
                    O[g + 8 * (r % 2)] += x * vt[:, k]
    assert np.allclose(O, P @ V)


def test_reference_and_baseline():
    rng = np.random.default_rng(2)
    b, sq, sk, h, hkv, d = 2, 37, 53, 4, 2, 64
    q8, k8, v8 = (fp8.quantize_e4m3(rng.standard_normal(s) * 2) for s in
                  ((b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d)))
    qd, kd, vd = np.float32(0.5), rng.random((b, hkv)).astype(np.float32) + 0.5, np.float32(2.0)
    for causal in (False, True):
        out, lse = fp8.reference_fp8(q8, k8, v8, qd, kd, vd, 0.125, causal)
        base = fp8.lowp_fp8_attention(q8, k8, v8, qd, kd, vd, 0.125, causal)
        ok, err, base_err = fp8.error_ok(base, out, base)
        assert ok and 0 < base_err < 0.1 * np.abs(out).max()
        # the scale folding the kernel does: softmax_scale · dq · dk on the raw e4m3 products,
        # q head h with kv head h // 2 (GQA) and that kv head's descales
        qf, kf = fp8.dequantize_e4m3(q8), np.repeat(fp8.dequantize_e4m3(k8), h // hkv, axis=2)
        kdh = np.repeat(kd, h // hkv, axis=1)
        s = np.einsum("bqhd,bkhd->bhqk", qf, kf) * 0.125 * qd * kdh[:, :, None, None]
        if causal:
            s = np.where(np.tril(np.ones((sq, sk), bool), sk - sq), s, -np.inf)
        lse0 = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
        assert np.allclose(lse, lse0)


def test_vt_mirror_and_descale_mirror():
    """cuflash.fp8.vt_mirror (the layout the prepare kernel is held to on the GPU) against the
    definition, key by key; descale_mirror's three forms."""
    rng = np.random.default_rng(3)
    p = problem(32, batch=2, seqlen_q=5, seqlen_k=37, nheads=4, nheads_kv=2)
    v8 = rng.integers(0, 0x7E, (2, 37, 2, 32)).astype(np.uint8)
    vt = fp8.vt_mirror(v8)
    b, hkv, d, s_pad = vt_shape(p)
    assert vt.shape == (b, hkv, d, s_pad) and vt.dtype == np.uint8
    v_padded = np.zeros((b, s_pad, hkv, d), np.uint8)
    v_padded[:, :37] = v8
    for key in range(s_pad):     # position key of Vᵀ holds key PERM16[key % 16] of its group
        src = (key // 16) * 16 + PERM16[key % 16]
        assert np.array_equal(vt[:, :, :, key], v_padded[:, src]), key
    kd = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    assert fp8.descale_mirror(None, 2, 2).tolist() == [[1, 1], [1, 1]]
    assert fp8.descale_mirror(np.float32([0.5]), 2, 2).tolist() == [[0.5, 0.5], [0.5, 0.5]]
    assert fp8.descale_mirror(kd, 2, 2).tolist() == kd.tolist()


def test_api_checks_name_the_argument():
    torch = pytest.importorskip("torch")
    import cuflash

    q = torch.zeros((1, 16, 2, 64), dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="^q: fp8 torch tensors must be on a CUDA device"):
        cuflash.flash_attn_func(q, q, q)
    with pytest.raises(NotImplementedError, match="^dropout_p: not implemented for FP8"):
        cuflash.flash_attn_func(q, q, q, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="^window_size: not implemented for FP8"):
        cuflash.flash_attn_func(q, q, q, window_size=(3, -1))
    with pytest.raises(ValueError, match="^q: fp8 torch tensors must be on a CUDA device"):
        cuflash.flash_attn_func(q, q, q, window_size=[-1, -1])   # the default, as a list
    with pytest.raises(TypeError, match="^window_size must be a pair"):
        cuflash.flash_attn_func(q, q, q, window_size=None)
    with pytest.raises(TypeError, match="^k: dtype must be torch.float8_e4m3fn"):
        fp8.check_fp8_qkv(q, torch.zeros((1, 16, 2, 64), dtype=torch.bfloat16), q, None, False)


def test_bench_fwd_fp8_flag():
    from cuflash import bench
    from cuflash.bench import fwd

    a = bench.parser().parse_args(["--mode", "fwd", "--fp8"])
    assert a.fp8 and not bench.parser().parse_args(["--mode", "fwd"]).fp8
    assert "fp8" in fwd.run.__code__.co_varnames and callable(fwd.fp8_callables)


# ---------------------------------------------------------------------------------------
# nvcc / ptxas

@needs_nvcc
def test_ptxas_no_spills_no_serialized_wgmma():
    """The heuristic for every head dim x mask, and the 3-consumer d64 point, build for sm_90a
    with no spill, no stack and no wgmma serialization warning."""
    configs = [FAM.heuristic(problem(d, causal=c)) for d in HEAD_DIMS for c in (False, True)]
    configs.append(GOOD.replace(head_dim=64, consumers=3, BM=192))
    configs.append(GOOD.replace(head_dim=256, persistent=True))
    configs = list(dict.fromkeys(configs))
    reports = nvcc_compile(configs, "sm_90a", NVCC)
    bad = [f"{c.name}: {r}" for c, r in zip(configs, reports)
           if r.spill_stores or r.spill_loads or r.stack_bytes
           or any(re.search(r"C75(1[0-5])\b", w) or "serialized" in w for w in r.warnings)]
    assert not bad, "\n".join(bad)


if __name__ == "__main__" and "--write" in sys.argv:
    write_wrappers()
    sys.exit(0)
