"""CPU checks of the Hopper forward family sm90_fwd (cuflash/families/sm90_fwd.py,
kernels_cu/sm90_fwd.cu, kernels_cu/ptx_sm90.cuh): config rules and space, supports(), the
params struct with its tensor maps (layout against nvcc, packing with a fake encoder), the
generated wgmma wrappers, and the nvcc/ptxas build of the space (no spills, no "wgmma ...
serialized" warnings). No GPU is needed.

`python tests/test_sm90_cpu.py --write` regenerates the wgmma block of ptx_sm90.cuh.
"""
import ctypes
import itertools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# ---------------------------------------------------------------------------------------
# the generated wgmma wrappers of ptx_sm90.cuh

# Tile widths N of the m64nNk16 wrappers: every Sm90FwdConfig BN and every head dim.
WGMMA_N = (64, 80, 96, 112, 128, 144, 160, 176, 192, 256)
# Widths only sm90_bwd instantiates, generated into ptx_sm90_bwd.cuh (its own file, so that
# sm90_fwd's code hash stays): 32 for the dQ part at head dim 64 split over two consumer
# warpgroups (Sm90BwdConfig.dq_cols).
WGMMA_N_BWD = (32,)
# Widths only sm90_fwd's row sum on the tensor cores takes (kFoldCap 3 / 4 with the fixed max:
# Σ P̃ as P̃ times a column block of ones), generated into ptx_sm90_rowsum.cuh (its own file, so that
# the other sm90 families' code hashes stay).
WGMMA_N_ROWSUM = (8,)
_TYPES = (("bf16", "bf16"), ("fp16", "f16"))
BEGIN = "// ---- generated wgmma wrappers: begin ----\n"
END = "// ---- generated wgmma wrappers: end ----\n"


def wgmma_wrappers(widths=WGMMA_N) -> str:
    """The Wgmma<N, Elem> specializations (ss and rs forms) for every N of `widths`."""
    out = []
    for n in widths:
        r = n // 2
        regs = ", ".join(f"%{i}" for i in range(r))
        ops = ",\n".join("          " + ", ".join(f'"+f"(d[{i}])' for i in range(j, min(j + 8, r)))
                         for j in range(0, r, 8))
        for tag, ptx in _TYPES:
            shape = f"m64n{n}k16.f32.{ptx}.{ptx}"
            out += [
                f"template <> struct Wgmma<{n}, {tag}> {{",
                "    template <int kTransB>",
                f"    static __device__ __forceinline__ void ss(float (&d)[{r}], u64 desc_a, u64 desc_b, int scale_d) {{",
                f'        asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{r + 2}, 0;\\n"',
                f'            "wgmma.mma_async.sync.aligned.{shape} {{{regs}}}, "',
                f'            "%{r}, %{r + 1}, p, 1, 1, 0, %{r + 3};\\n}}\\n"',
                f"          :\n{ops}",
                '          : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransB));',
                "    }",
                "    template <int kTransB>",
                f"    static __device__ __forceinline__ void rs(float (&d)[{r}], const u32 (&a)[4], u64 desc_b, int scale_d) {{",
                f'        asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{r + 5}, 0;\\n"',
                f'            "wgmma.mma_async.sync.aligned.{shape} {{{regs}}}, "',
                f'            "{{%{r}, %{r + 1}, %{r + 2}, %{r + 3}}}, %{r + 4}, p, 1, 1, %{r + 6};\\n}}\\n"',
                f"          :\n{ops}",
                '          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB));',
                "    }",
                "};",
            ]
    return "\n".join(out) + "\n"


def _header_path(name="ptx_sm90.cuh"):
    return ROOT / "kernels_cu" / name


def write_wrappers():
    for name, widths in (("ptx_sm90.cuh", WGMMA_N), ("ptx_sm90_bwd.cuh", WGMMA_N_BWD),
                         ("ptx_sm90_rowsum.cuh", WGMMA_N_ROWSUM)):
        path = _header_path(name)
        text = path.read_text()
        head, rest = text.split(BEGIN)
        _, tail = rest.split(END)
        path.write_text(head + BEGIN + wgmma_wrappers(widths) + END + tail)



from conftest import nvcc_all  # noqa: E402
from cuflash import _gpu, launch, registry  # noqa: E402
from cuflash.compile import PtxasReport, nvcc_compile, parse_ptxas  # noqa: E402
from cuflash.families import fa2_fwd, sm90_fwd  # noqa: E402
from cuflash.families.base import ConfigError  # noqa: E402
from cuflash.families.sm90_fwd import HEAD_DIMS, Sm90FwdConfig  # noqa: E402
from cuflash.problem import DTYPES, Problem  # noqa: E402
from cuflash.select import choose  # noqa: E402

FAM = registry.get("sm90_fwd")
NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
GOOD = Sm90FwdConfig(BM=128, BN=128, stages=2, consumers=2, pingpong=True, persistent=False, head_dim=128,
                      dtype="bf16", causal=False)


def problem(head_dim=64, dtype="bf16", causal=False, **kw):
    shape = dict(batch=2, seqlen_q=300, seqlen_k=200, nheads=8, nheads_kv=2)
    shape.update(kw)
    return Problem("fwd", dtype, shape["batch"], shape["seqlen_q"], shape["seqlen_k"],
                   shape["nheads"], shape["nheads_kv"], head_dim, causal)


def test_wgmma_block_is_generated():
    text = _header_path().read_text()
    assert text.split(BEGIN)[1].split(END)[0] == wgmma_wrappers(), \
        "ptx_sm90.cuh's wgmma block is stale: python tests/test_sm90_cpu.py --write"
    bwd = _header_path("ptx_sm90_bwd.cuh").read_text()
    assert bwd.split(BEGIN)[1].split(END)[0] == wgmma_wrappers(WGMMA_N_BWD), \
        "ptx_sm90_bwd.cuh's wgmma block is stale: python tests/test_sm90_cpu.py --write"
    rowsum = _header_path("ptx_sm90_rowsum.cuh").read_text()
    assert rowsum.split(BEGIN)[1].split(END)[0] == wgmma_wrappers(WGMMA_N_ROWSUM), \
        "ptx_sm90_rowsum.cuh's wgmma block is stale: python tests/test_sm90_cpu.py --write"
    assert not set(WGMMA_N) & set(WGMMA_N_BWD) and not set(WGMMA_N_ROWSUM) & (set(WGMMA_N) | set(WGMMA_N_BWD))
    # every S width (BN) and every O width (head dim) the family can instantiate has a wrapper
    assert set(FAM.space["BN"]) | set(HEAD_DIMS) <= set(WGMMA_N)


# ---------------------------------------------------------------------------------------
# the config and its rules

def test_registered_above_fa2_fwd():
    assert FAM.priority > registry.get("fa2_fwd").priority
    assert registry.families("fwd")[0].name == "sm90_fwd"
    assert FAM.min_arch == (9, 0) and FAM.arch_suffix == "a"
    p = problem(128)
    assert choose(p, (9, 0))[0].name == "sm90_fwd"                     # the default on sm_90
    assert choose(p, (8, 0))[0].name == "fa2_fwd"                      # and fa2_fwd elsewhere
    fa2 = registry.get("fa2_fwd").heuristic(p, (9, 0))
    assert choose(p, (9, 0), config=fa2)[0].name == "fa2_fwd"          # config= forces either


def test_good_config_and_name():
    assert GOOD.validate(227 * 1024) is GOOD
    assert GOOD.name == "sm90fwd_bf16_d128_full_BM128_BN128_s2_c2_pp"
    assert GOOD.warps == 12 and GOOD.threads == 384
    assert GOOD.kernel_name() == "cuflash::sm90_fwd<128, 128, 2, 2, true, false, 128, cuflash::bf16, false, false, false, false>"
    assert GOOD.replace(persistent=True).name == "sm90fwd_bf16_d128_full_BM128_BN128_s2_c2_pp_persist"
    assert GOOD.smem_bytes == (128 + 4 * 128) * 128 * 2 + 8 * 10 + 1024
    assert FAM.encode(GOOD) == "sm90_fwd:BM=128,BN=128,stages=2,consumers=2,pingpong=1,persistent=0,head_dim=128"
    assert FAM.decode(FAM.encode(GOOD), "bf16", False) == GOOD


@pytest.mark.parametrize("change,pattern", [
    ({"head_dim": 80}, r"head_dim must be one of \(64, 96, 128, 192, 256\), got 80"),
    ({"consumers": 4, "BM": 256}, r"consumers must be 1, 2 or 3, got 4"),
    ({"BM": 64}, r"BM=64 must be 64 \* consumers = 128"),
    ({"BN": 72}, r"BN must be a multiple of 16 in 64\.\.192"),
    ({"BN": 48}, r"BN must be a multiple of 16 in 64\.\.192"),
    ({"BN": 208}, r"BN must be a multiple of 16 in 64\.\.192"),
    ({"stages": 1}, r"stages must be >= 2, got 1"),
    ({"head_dim": 256, "stages": 3}, r"bytes of shared memory, more than the 232448"),
    ({"dtype": "fp32"}, r"dtype must be one of"),
])
def test_each_rule(change, pattern):
    cfg = GOOD.replace(**change)
    problems = cfg.problems()
    assert len(problems) == 1, problems
    assert re.search(pattern, problems[0]), problems[0]
    with pytest.raises(ConfigError, match="invalid sm90 forward config"):
        cfg.validate()


def test_register_rule(monkeypatch):
    # in today's space shared memory binds first (d256: BN <= 80); the rule guards new points
    monkeypatch.setitem(sm90_fwd.MAX_ACCUM_REGS, 2, 120)
    (why,) = GOOD.problems()
    assert re.search(r"128 fp32 accumulator registers per consumer thread .* budget of 120 with 2", why)


def test_space():
    assert FAM.space == {"BM": (64, 128, 192), "BN": (64, 80, 96, 112, 128, 144, 160, 176, 192),
                         "stages": (2, 3), "consumers": (1, 2, 3), "pingpong": (False, True),
                         "persistent": (False, True), "emu_exp2": sm90_fwd.EMU_EXP2_SPACE,
                         "dynamic": (False, True), "tma_store": (False, True), "p_smem": (False, True)}
    counts = {}
    for d in HEAD_DIMS:
        valid = FAM.valid(problem(d), 227 * 1024)
        counts[d] = len(valid)
        assert all(c.BM == 64 * c.consumers and c.head_dim == d for c in valid)
    # d64: every BN, both stages, 1 consumer or 2 with and without pingpong, and 3 (with and
    # without pingpong) for BN <= 128 (registers); d256 is held by smem and registers
    # x persistent off / on / on with the dynamic scheduler (emu_exp2 > 0 only with softcap:
    # test_sm90_softcap_cpu.py; dynamic needs persistent: test_sm90_sched_cpu.py) x the TMA-store
    # epilogue off / on (its staging tiles fit every d64 point); plus p_smem (3 consumers only,
    # without tma_store: test_sm90_psmem_cpu.py), pingpong off / on, at every BN and both stages
    # but BN 176 and 192 with 3 stages (shared memory); less 3 consumers at BN 128 with the TMA store
    # (TMA_STORE_C3_REGS: 2 stages x pingpong off / on x 3 schedules)
    assert counts[64] == (9 * 2 * 3 + 5 * 2 * 2) * 3 * 2 + (9 * 2 - 2) * 2 * 3 - 2 * 2 * 3
    assert counts[256] > 0 and counts[256] < counts[128] <= counts[64]
    # d96 takes d128's shared memory but fewer registers (O: 48 per thread, not 64)
    assert counts[128] < counts[96] < counts[64]


def test_d96_is_exact_in_registers_and_d128_in_shared_memory():
    d96 = GOOD.replace(head_dim=96)
    assert d96.validate(227 * 1024) is d96
    assert d96.name == "sm90fwd_bf16_d96_full_BM128_BN128_s2_c2_pp"
    assert d96.kernel_name() == GOOD.kernel_name().replace(", 128, cuflash::bf16", ", 96, cuflash::bf16")
    assert d96.smem_cols == 128 and GOOD.smem_cols == 128 and GOOD.replace(head_dim=64).smem_cols == 64
    assert d96.smem_bytes == GOOD.smem_bytes                  # two 64-column chunks, as d128
    assert d96.accum_regs == 48 + 64 and GOOD.accum_regs == 64 + 64
    # the tile the d128 budget refuses with 3 consumers at BN 96 fits at d96 (48 + 48 = 96)
    c3 = Sm90FwdConfig(192, 96, 2, 3, True, False, 96, "fp16", True)
    assert c3.problems(227 * 1024) == [] and c3.replace(head_dim=128).problems(227 * 1024)
    (why,) = c3.replace(BN=112).problems(227 * 1024)
    assert "104 fp32 accumulator registers" in why
    # the shared-memory rule is d128's: BN 192 with 3 stages fits neither
    assert c3.replace(BM=128, consumers=2, BN=192, stages=3).problems(227 * 1024)
    # every real head dim 65..96 runs on the d96 kernel, zero-filling the columns past it
    for d in range(72, 97, 8):
        p = problem(d)
        cfg = FAM.heuristic(p, (9, 0))
        assert cfg.head_dim == 96 and FAM.fits(cfg, p) == "" and choose(p, (9, 0))[0].name == "sm90_fwd"


def test_d96_kernel_source():
    """The kernel's rules admit head dim 96 (and only the compiled ones) and size d96's tiles by
    whole 64-column chunks, so the TMA byte count (expect_tx) covers the zero-filled columns."""
    src = (ROOT / "kernels_cu" / "sm90_fwd.cu").read_text()
    assert "kChunks = (kHeadDim + 63) / 64" in src
    assert "kQBytes = kChunks * kQChunkBytes" in src and "kKVBytes = kChunks * kKVChunkBytes" in src
    assert "(kHeadDim % 64 == 0 || kHeadDim == 96)" in src
    assert "static constexpr int kOCols = kHeadDim;" in src     # O's columns: exactly the head dim
    assert "Wgmma<kOCols, Elem>::template rs<1>" in src        # P V: one m64n96k16 per k16 step


def test_head_dim_of_and_heuristic():
    assert [FAM.head_dim_of(d) for d in (8, 64, 72, 96, 104, 128, 136, 192, 200, 256)] == \
        [64, 64, 96, 96, 128, 128, 192, 192, 256, 256]
    assert {FAM.head_dim_of(d) for d in range(65, 97)} == {96}
    for d, dtype, causal in itertools.product(range(8, 257, 8), DTYPES, (False, True)):
        p = problem(d, dtype, causal)
        cfg = FAM.heuristic(p, (9, 0))
        assert cfg.problems(227 * 1024) == [], cfg.name
        assert cfg.head_dim == FAM.head_dim_of(d) and FAM.fits(cfg, p) == ""
        assert FAM.point(cfg) in [FAM.point(c) for c in FAM.valid(p, 227 * 1024)]
    dyn = dict(persistent=True, dynamic=True)   # HEURISTIC_DYNAMIC: the dynamic persistent scheduler
    assert FAM.heuristic(problem(256)).BN == 80
    # d128 below 16k keys: BN 160 with the TMA-store epilogue; from 16k BN 176 without it
    assert FAM.heuristic(problem(128)) == GOOD.replace(BN=160, tma_store=True, **dyn)
    assert FAM.heuristic(problem(128, seqlen_k=16384, causal=True)) == GOOD.replace(BN=176, causal=True, **dyn)
    # (non-causal from the 2048 bucket: HEURISTIC_NC's static persistent schedule, tests/test_sm90_fwdnc_cpu.py;
    # at 16k with stream_tail, HEURISTIC_STREAM_TAIL: tests/test_sm90_stream_tail_cpu.py)
    assert FAM.heuristic(problem(128, seqlen_k=16384)) == GOOD.replace(BN=176, persistent=True, stream_tail=True)
    # d64: BN 192, but for up to SHORT_KEYS_MAX keys (non-causal) the width of the least padding (short_keys_bn),
    # and causal below the 2048 bucket BN 128 (SHORT_CAUSAL_FIELDS)
    assert FAM.heuristic(problem(64)).BN == 112 == sm90_fwd.short_keys_bn(200)
    assert FAM.heuristic(problem(64, seqlen_k=800)).BN == 192
    assert FAM.heuristic(problem(64, causal=True)).BN == 128 == sm90_fwd.SHORT_CAUSAL_FIELDS["BN"]
    assert FAM.heuristic(problem(192)).BN == 112
    assert FAM.heuristic(problem(96)) == GOOD.replace(head_dim=96, BN=176, **dyn)
    assert FAM.heuristic(problem(80).replace(features=("window", "alibi"))).BN == 128   # window_tiles
    # a smaller shared memory shrinks the tile (the staging tiles of O go first)
    assert FAM.heuristic(problem(128), max_smem=100 * 1024) == GOOD.replace(BN=64, **dyn)
    # HEURISTIC_DYNAMIC off: the static tiles of before
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sm90_fwd, "HEURISTIC_DYNAMIC", False)
        assert FAM.heuristic(problem(128)) == GOOD.replace(BN=176)


# ---------------------------------------------------------------------------------------
# supports()

def test_supports():
    assert FAM.supports((9, 0), problem(64)) == ""
    assert FAM.supports((9, 0), problem(72, "fp16", True, nheads_kv=8)) == ""
    for arch in ((7, 5), (8, 0), (8, 6), (8, 9), (10, 0), (12, 0)):
        why = FAM.supports(arch, problem(64))
        assert why.startswith(f"sm90_fwd needs sm_90 exactly") and f"sm_{arch[0]}{arch[1]}" in why
    assert FAM.supports((9, 0), problem(64).replace(features=("alibi", "softcap", "window"))) == ""
    # dropout runs here (tests/test_sm90_dropout_cpu.py), with a window too at d64 / d128
    # (tests/test_dropmix_cpu.py); not at the head dims whose mixed kernels are unchecked
    assert FAM.supports((9, 0), problem(64).replace(features=("dropout",))) == ""
    assert FAM.supports((9, 0), problem(64).replace(features=("dropout", "window"))) == ""
    assert "'window' with dropout" in FAM.supports((9, 0), problem(256).replace(features=("dropout", "window")))
    assert FAM.supports((9, 0), problem(60)).startswith("q: headdim must be a multiple of 8")
    assert "implements op 'fwd', not 'bwd'" in FAM.supports((9, 0), problem(64).replace(op="bwd"))


# ---------------------------------------------------------------------------------------
# the params struct and its tensor maps

def test_params_struct_mirror():
    dt = launch.struct_dtype("Sm90FwdParams")
    assert dt.names[:5] == FAM.pointer_fields
    assert [dt.fields[n][1] for n in ("tma_q", "tma_k", "tma_v")] == [64, 192, 320]
    assert all(dt.fields[n][0].itemsize == 128 for n in ("tma_q", "tma_k", "tma_v"))
    assert dt.fields["o_batch_stride"][1] == 448
    # the dynamic scheduler's counter and section, then the TMA-store epilogue's map of o (64-aligned)
    assert [dt.fields[n][1] for n in ("tile_counter", "sched_section", "tma_o")] == [552, 560, 576]
    # varlen's fields after them (cu_seqlens_q, cu_seqlens_k, total_q), in the 64-byte aligned tail
    assert [dt.fields[n][1] for n in ("cu_seqlens_q", "cu_seqlens_k", "total_q")] == [704, 712, 720]
    assert dt.itemsize == 768
    # the structs without a tensor map keep NumPy's aligned layout
    assert launch.struct_dtype("FwdParams").isalignedstruct


def test_tensor_map_args():
    shape, strides = (2, 300, 8, 72), (300 * 8 * 72, 8 * 72, 72, 1)   # contiguous (b, s, h, d)
    args = sm90_fwd.tensor_map_args("bf16", 0x1000, shape, strides, 128)
    assert args == (9, 0x1000, (72, 300, 8, 2), (2 * 8 * 72, 2 * 72, 2 * 300 * 8 * 72),
                    (64, 128, 1, 1), 3, 2, 0)
    # fp16; a packed qkv view (strides of the caller, not of a fresh array); extent-1 dims
    args = sm90_fwd.tensor_map_args("fp16", 0x2000, (1, 50, 1, 64), (7 * 64, 3 * 64, 999, 1), 80)
    assert args[0] == 6 and args[2] == (64, 50, 1, 1) and args[3] == (2 * 3 * 64, 16, 16)
    assert args[4] == (64, 80, 1, 1)


@pytest.fixture
def fake_encoder(monkeypatch):
    calls = []

    def encode(*args):
        calls.append(args)
        return bytes((len(calls) + i) % 256 for i in range(128))

    monkeypatch.setattr(sm90_fwd, "_encoder", encode)
    monkeypatch.setattr(sm90_fwd, "_MAP_CACHE", {})
    return calls


def test_plan_writes_tensor_maps_per_call(monkeypatch, fake_encoder):
    launches = []

    def record(fn, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        ptr = ctypes.c_uint64.from_address(argv).value
        launches.append(dict(grid=(gx, gy, gz), block=bx, smem=smem,
                             raw=ctypes.string_at(ptr, launch.struct_dtype("Sm90FwdParams").itemsize)))

    monkeypatch.setattr(launch, "get_kernels", lambda config, device: {"main": SimpleNamespace(
        kernel=SimpleNamespace(ptr=1000))})
    monkeypatch.setattr(_gpu, "sm_count", lambda device=0: 132)
    monkeypatch.setattr(launch, "_driver_launch", lambda: record)
    monkeypatch.setattr(launch, "_device_fns", lambda: (lambda: 0, lambda device: None))
    p = problem(72, "fp16", True)
    cfg = FAM.heuristic(p).replace(persistent=False, dynamic=False, tma_store=False)  # the plain tiles
    q_st, k_st = (300 * 8 * 72, 8 * 72, 72, 1), (200 * 2 * 72, 2 * 72, 72, 1)
    plan = launch.Plan(FAM, cfg, p, {"q": q_st, "k": k_st, "v": k_st, "o": q_st}, 0.125, 0)
    dt = launch.struct_dtype("Sm90FwdParams")

    ptrs = (0x10000, 0x20000, 0x30000, 0x40000, 0x50000)
    plan.run(ptrs, 0, stream=7)
    (call,) = launches
    assert call["grid"] == (-(-300 // cfg.BM) * 8 * 2, 1, 1) and call["block"] == cfg.threads  # a CTA per tile
    assert call["smem"] == cfg.smem_bytes
    rec = np.frombuffer(call["raw"], dt)[0]
    assert tuple(int(rec[n]) for n in FAM.pointer_fields) == ptrs
    assert [a[1] for a in fake_encoder] == list(ptrs[:3])               # q, k, v maps, in order
    assert [a[2] for a in fake_encoder] == [(72, 300, 8, 2), (72, 200, 2, 2), (72, 200, 2, 2)]
    assert [a[4][1] for a in fake_encoder] == [cfg.BM, cfg.BN, cfg.BN]
    persistent = cfg.replace(persistent=True)
    assert FAM.launches(persistent, p, 132)[0].grid == (3 * 8 * 2, 1, 1)         # 48 tiles < 132 SMs
    assert FAM.launches(persistent, p.replace(batch=20), 132)[0].grid == (132, 1, 1)
    for i, field in enumerate(("tma_q", "tma_k", "tma_v")):
        off = dt.fields[field][1]
        assert call["raw"][off:off + 128] == bytes((i + 1 + j) % 256 for j in range(128)), field
    assert rec["head_dim"] == 72 and rec["seqlen_k"] == 200 and rec["o_row_stride"] == 8 * 72
    assert rec["scale_log2"] == np.float32(0.125 * fa2_fwd.LOG2E)

    plan.run(ptrs, 0, stream=7)                     # same pointers: the cached maps
    assert len(fake_encoder) == 3 and launches[1]["raw"] == call["raw"]
    plan.run((0x90000,) + ptrs[1:], 0, stream=7)    # a new q: one new map
    assert len(fake_encoder) == 4 and fake_encoder[-1][1] == 0x90000
    off = dt.fields["tma_q"][1]
    assert launches[2]["raw"][off:off + 128] == bytes((4 + j) % 256 for j in range(128))


def test_families_without_a_writer_keep_the_fast_path(monkeypatch):
    monkeypatch.setattr(launch, "get_kernels", lambda config, device: {"main": SimpleNamespace(
        kernel=SimpleNamespace(ptr=1000))})
    monkeypatch.setattr(_gpu, "sm_count", lambda device=0: 132)
    monkeypatch.setattr(launch, "_driver_launch", lambda: None)
    monkeypatch.setattr(launch, "_device_fns", lambda: (lambda: 0, lambda device: None))
    fa2 = registry.get("fa2_fwd")
    p = problem(64)
    st = (300 * 8 * 64, 8 * 64, 64, 1)
    plan = launch.Plan(fa2, fa2.heuristic(p), p, {"q": st, "k": st, "v": st, "o": st}, 0.1, 0)
    assert plan._write_call is None and plan._run == plan._run_plain


def test_family_imports_without_a_driver():
    code = ("import sys, cuflash.registry as r; f = r.get('sm90_fwd'); "
            "print('cupy' in sys.modules, f.heuristic(f.config_cls and __import__('cuflash.problem', "
            "fromlist=['Problem']).Problem('fwd', 'bf16', 1, 64, 64, 1, 1, 64)).name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    # (64 keys: short_keys_bn, static persistent with the TMA store: SHORT_KEYS_FIELDS)
    assert out.stdout.split() == ["False", "sm90fwd_bf16_d64_full_BM128_BN112_s2_c2_pp_persist_tmao"]


# ---------------------------------------------------------------------------------------
# ptxas: registers, spills and the "wgmma ... serialized" warnings

WGMMA_WARNING_LOG = """\
ptxas info    : Compiling entry function '_ZN7cuflash8sm90_fwdILi128ELi128ELi2ELi2ELi128ENS_4bf16ELb0EEEvNS_13Sm90FwdParamsE' for 'sm_90a'
ptxas info    : Function properties for _ZN7cuflash8sm90_fwdILi128ELi128ELi2ELi2ELi128ENS_4bf16ELb0EEEvNS_13Sm90FwdParamsE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas warning : (C7510) Potential Performance Loss: wgmma.mma_async instructions are serialized due to the presence of Extern calls in the function '_ZN7cuflash8sm90_fwdILi128ELi128ELi2ELi2ELi128ENS_4bf16ELb0EEEvNS_13Sm90FwdParamsE'
ptxas info    : Used 168 registers, used 1 barriers
ptxas info    : Compiling entry function '_ZN7cuflash8sm90_fwdILi64ELi64ELi2ELi1ELi64ENS_4fp16ELb1EEEvNS_13Sm90FwdParamsE' for 'sm_90a'
ptxas info    : Used 255 registers, used 1 barriers
"""


def test_parse_ptxas_surfaces_wgmma_serialization():
    a, b = parse_ptxas(WGMMA_WARNING_LOG)
    assert a.registers == 168 and len(a.warnings) == 1 and "C7510" in a.warnings[0]
    assert b.warnings == () and b.registers == 255
    assert serialized(a) and not serialized(b)


def serialized(report: PtxasReport) -> list:
    """The report's ptxas warnings about wgmma serialization (C7510..C7515)."""
    return [w for w in report.warnings if re.search(r"C75(1[0-5])\b", w) or "serialized" in w]


FEATURE_SETS = (("window", "alibi"), ("softcap",), ("alibi", "softcap", "window"))


def build_configs(full: bool) -> list:
    """The heuristic for every head dim x dtype x mask, d96's also with features (its window +
    ALiBi BN is held to what does not spill), plus (full) every valid point."""
    out = []
    for d, dtype, causal in itertools.product(HEAD_DIMS, DTYPES, (False, True)):
        p = problem(d, dtype, causal)
        out.append(FAM.heuristic(p))
        if d == 96:
            out += [FAM.for_problem(FAM.heuristic(p.replace(features=f)), p.replace(features=f))
                    for f in FEATURE_SETS]
        if full:
            out += FAM.valid(p, 227 * 1024)
    return list(dict.fromkeys(out))


@needs_nvcc
def test_ptxas_no_spills_no_serialized_wgmma(request):
    """sm_90a builds: no spills, no stack, no wgmma serialization warnings. By default the
    heuristics; with --nvcc-all every valid point of the space (280 instantiations, ~3 minutes
    on 2 cores)."""
    configs = build_configs(nvcc_all(request.config))
    chunks = [configs[i:i + 12] for i in range(0, len(configs), 12)]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        reports = [r for rs in pool.map(lambda c: nvcc_compile(c, "sm_90a", NVCC), chunks) for r in rs]
    bad = []
    print(f"\n  {'config':<48} {'regs':>4} {'spill st':>8} {'spill ld':>8} warnings")
    for cfg, rep in zip(configs, reports):
        print(f"  {cfg.name:<48} {rep.registers:>4} {rep.spill_stores:>8} {rep.spill_loads:>8} "
              f"{len(rep.warnings)}")
        if rep.spill_stores or rep.spill_loads or rep.stack_bytes or serialized(rep):
            bad.append(f"{cfg.name}: {rep}")
    assert not bad, "\n".join(bad)


if __name__ == "__main__" and "--write" in sys.argv:
    write_wrappers()
    sys.exit(0)
