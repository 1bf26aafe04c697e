"""sm90_fwd's dynamic persistent scheduler (``dynamic``, kDynamic) and TMA-store epilogue
(``tma_store``, kTmaStore) without a GPU: the configs (rules, names, template arguments, shared
memory, encoding, the space), O's tensor map written per call, the tile order's host mirror (a
permutation of the tiles, heaviest Q blocks first within each section, sections aligned to KV
heads), the section size, the plan's zeroed counter, and the sm_90a builds (nvcc -cubin: no
spills, no "wgmma serialized" warnings)."""
import ctypes
import itertools
import os
import re
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from cuflash import _gpu, launch, registry
from cuflash.families import sm90_fwd
from cuflash.families.sm90_fwd import SCHED_L2_BYTES, Sm90FwdConfig, sched_section, sectioned_tile
from cuflash.problem import Problem

FAM = registry.get("sm90_fwd")
NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
DYN = Sm90FwdConfig(BM=128, BN=176, stages=2, consumers=2, pingpong=True, persistent=True, head_dim=128,
                    dtype="bf16", causal=True, dynamic=True)


def problem(head_dim=128, causal=True, batch=4, seqlen=2048, nheads=16, nheads_kv=16, **kw):
    return Problem("fwd", "bf16", batch, seqlen, kw.get("seqlen_k", seqlen), nheads, nheads_kv,
                   head_dim, causal)


def test_config_name_and_template_arguments():
    assert DYN.validate(227 * 1024) is DYN
    assert DYN.name == "sm90fwd_bf16_d128_causal_BM128_BN176_s2_c2_pp_persist_dyn"
    # kDropout and kEmuExp2 spelled out, kDynamic last
    assert DYN.kernel_name() == ("cuflash::sm90_fwd<128, 176, 2, 2, true, true, 128, cuflash::bf16, true, "
                                 "false, false, false, false, 0, true>")
    args = dict(zip(type(DYN).__dataclass_fields__, DYN.template_args()))   # (kVarlen and the feature
    assert (args["dynamic"], args["tma_store"]) == (True, False)              # variants after them)
    assert len(DYN.template_args()) == len(type(DYN).__dataclass_fields__) - 3   # (section: run time; cluster: the entry point; even_waves: the grid)
    plain = DYN.replace(dynamic=False)
    assert plain.kernel_name() == "cuflash::sm90_fwd<128, 176, 2, 2, true, true, 128, cuflash::bf16, true, false, false, false>"
    # the ring: 4 mbarriers and 2 tile indices on top of the plain kernel's shared memory
    assert DYN.smem_bytes == plain.smem_bytes + 40
    assert FAM.encode(DYN).endswith(",dynamic=1") and "dynamic" not in FAM.encode(plain)
    assert FAM.decode(FAM.encode(DYN), "bf16", True) == DYN
    assert FAM.decode(FAM.encode(plain), "bf16", True) == plain


def test_tma_store_config():
    tma = DYN.replace(BN=160, tma_store=True)
    assert tma.validate(227 * 1024) is tma
    assert tma.name == "sm90fwd_bf16_d128_causal_BM128_BN160_s2_c2_pp_persist_dyn_tmao"
    assert tma.kernel_name().endswith("true, false, false, false, false, 0, true, true>")
    assert tma.replace(dynamic=False).kernel_name().endswith("true, false, false, false, false, 0, false, true>")
    # the staging tiles: 64 rows x 128 columns x 2 bytes per consumer warpgroup
    assert tma.smem_bytes == DYN.replace(BN=160).smem_bytes + 2 * 64 * 128 * 2
    assert tma.replace(head_dim=96).o_stage_bytes == 2 * 64 * 128 * 2      # d96: d128's layout
    assert FAM.decode(FAM.encode(tma), "bf16", True) == tma and FAM.encode(tma).endswith("dynamic=1,tma_store=1")
    # d128 at the tuned BN 176 and d256 at BN 80 do not fit shared memory with the staging tiles
    (why,) = DYN.replace(tma_store=True).problems(227 * 1024)
    assert re.search(r"needs \d+ bytes of shared memory", why)
    assert DYN.replace(head_dim=256, BN=80, tma_store=True).problems(227 * 1024)
    assert not DYN.replace(head_dim=256, BM=64, consumers=1, pingpong=False, BN=64, tma_store=True).problems(227 * 1024)
    point = {k: getattr(DYN, k) for k in FAM.space if k != "tma_store"}
    assert FAM.make(point, problem()).tma_store is False


def test_plan_writes_o_map_per_call(monkeypatch):
    calls = []

    def encode(*args):
        calls.append(args)
        return bytes((len(calls) + i) % 256 for i in range(128))

    launches = []

    def record(fn, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        ptr = ctypes.c_uint64.from_address(argv).value
        launches.append(ctypes.string_at(ptr, launch.struct_dtype("Sm90FwdParams").itemsize))

    monkeypatch.setattr(sm90_fwd, "_encoder", encode)
    monkeypatch.setattr(sm90_fwd, "_MAP_CACHE", {})
    monkeypatch.setattr(launch, "get_kernels", lambda config, device: {"main": SimpleNamespace(
        kernel=SimpleNamespace(ptr=1000))})
    monkeypatch.setattr(_gpu, "sm_count", lambda device=0: 132)
    monkeypatch.setattr(launch, "_driver_launch", lambda: record)
    monkeypatch.setattr(launch, "_device_fns", lambda: (lambda: 0, lambda device: None))
    monkeypatch.setattr(launch, "_zeroed_i32", lambda n, device, what: SimpleNamespace(ptr=0xC0DE00))
    p = Problem("fwd", "bf16", 2, 300, 200, 8, 2, 72, True)
    cfg = FAM.heuristic(p).replace(BN=128, tma_store=True)
    q_st, k_st, o_st = (300 * 8 * 72, 8 * 72, 72, 1), (200 * 2 * 72, 2 * 72, 72, 1), (300 * 8 * 80, 8 * 80, 80, 1)
    plan = launch.Plan(FAM, cfg, p, {"q": q_st, "k": k_st, "v": k_st, "o": o_st}, 0.125, 0)
    ptrs = (0x10000, 0x20000, 0x30000, 0x40000, 0x50000)
    plan.run(ptrs, 0, stream=7)
    assert [a[1] for a in calls] == list(ptrs[:4])                    # q, k, v, then o
    assert calls[3][2] == (72, 300, 8, 2) and calls[3][3] == (2 * 8 * 80, 2 * 80, 2 * 300 * 8 * 80)
    assert calls[3][4] == (64, 64, 1, 1)                               # one warpgroup's 64 rows
    dt = launch.struct_dtype("Sm90FwdParams")
    off = dt.fields["tma_o"][1]
    assert launches[0][off:off + 128] == bytes((4 + j) % 256 for j in range(128))
    plan.run(ptrs[:3] + (0x60000, ptrs[4]), 0, stream=7)              # a new output: a new o map
    assert len(calls) == 5 and calls[-1][1] == 0x60000
    plan.run(ptrs, 0, stream=7)                                        # the first one, cached
    assert len(calls) == 5 and launches[2] == launches[0]


def test_dynamic_needs_persistent():
    (why,) = DYN.replace(persistent=False).problems(227 * 1024)
    assert re.search(r"dynamic .* needs persistent", why)


def test_space_and_old_points():
    assert FAM.space["dynamic"] == FAM.space["tma_store"] == (False, True)
    assert list(FAM.space)[-3:-1] == ["dynamic", "tma_store"]
    p = problem()
    valid = FAM.valid(p, 227 * 1024)
    assert all(c.persistent for c in valid if c.dynamic)
    assert sum(c.dynamic for c in valid) == sum(c.persistent and not c.dynamic for c in valid)
    # a tuned entry's point from before the flag: dynamic off
    point = {k: getattr(DYN, k) for k in FAM.space if k != "dynamic"}
    assert FAM.make(point, p).dynamic is False
    assert FAM.heuristic(p).dynamic is sm90_fwd.HEURISTIC_DYNAMIC   # plain calls: the dynamic scheduler


def test_section_size():
    # d128 at 2k: 1 MB of K and V per KV head -> 32 heads' worth, capped by the pairs there are
    assert sched_section(problem(128, seqlen=2048, batch=8)) == 32
    assert sched_section(problem(128, seqlen=2048, batch=1)) == 16
    # 16k d128: 8 MB per KV head -> 4; GQA 4:1 -> 4 KV heads = 16 query heads
    assert sched_section(problem(128, seqlen=16384)) == 4
    assert sched_section(problem(128, seqlen=16384, nheads=16, nheads_kv=4)) == 16
    # K/V of one head beyond the budget: one KV head
    big = SCHED_L2_BYTES // (64 * 4) * 2
    assert sched_section(problem(64, seqlen=big, batch=1)) == 1
    # a power of two of KV heads
    for s in (1000, 3000, 5000, 12345):
        n = sched_section(problem(64, seqlen=s, batch=64))
        assert n & (n - 1) == 0


@pytest.mark.parametrize("m_blocks,nheads,batch,section", [(16, 16, 8, 32), (17, 16, 3, 32), (5, 6, 7, 4),
                                                           (1, 3, 1, 1), (9, 4, 5, 8), (3, 12, 2, 6)])
def test_tile_order_is_a_permutation_heaviest_first(m_blocks, nheads, batch, section):
    n_hb = nheads * batch
    n_tiles = m_blocks * n_hb
    tiles = [sectioned_tile(t, m_blocks, nheads, n_hb, section) for t in range(n_tiles)]
    assert sorted(tiles) == sorted(itertools.product(range(m_blocks), range(nheads), range(batch)))
    assert len(set(tiles)) == n_tiles
    # inside each section the Q block never increases (heaviest causal tiles first), and a
    # section covers `section` consecutive (head, batch) pairs
    per = section * m_blocks
    for start in range(0, n_tiles, per):
        chunk = tiles[start:start + per]
        m = [t[0] for t in chunk]
        assert m == sorted(m, reverse=True)
        hbs = {t[1] + nheads * t[2] for t in chunk}
        first = start // per * section
        assert hbs == set(range(first, min(first + section, n_hb)))


def test_plan_allocates_a_zeroed_counter(monkeypatch):
    """The plan keeps its counter per CUDA stream (zeroed_counters -> launch.StreamCounters ->
    launch._zeroed_i32: a spare with the plan, taken by a stream's first use and made again) and
    writes the launch's stream's address into the params; the plain config allocates none."""
    launches, allocs = [], []

    def record(fn, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        ptr = ctypes.c_uint64.from_address(argv).value
        launches.append(dict(grid=(gx, gy, gz), raw=ctypes.string_at(
            ptr, launch.struct_dtype("Sm90FwdParams").itemsize)))

    def zeroed(n, device, what):
        allocs.append((n, device, what))
        return SimpleNamespace(ptr=0xC0DE00 + len(allocs))

    monkeypatch.setattr(launch, "get_kernels", lambda config, device: {"main": SimpleNamespace(
        kernel=SimpleNamespace(ptr=1000))})
    monkeypatch.setattr(_gpu, "sm_count", lambda device=0: 132)
    monkeypatch.setattr(launch, "_driver_launch", lambda: record)
    monkeypatch.setattr(launch, "_device_fns", lambda: (lambda: 0, lambda device: None))
    monkeypatch.setattr(launch, "_zeroed_i32", zeroed)
    monkeypatch.setattr(sm90_fwd, "_encoder", lambda *a: bytes(128))
    p = problem(128, batch=8, seqlen=2048)
    st = (2048 * 16 * 128, 16 * 128, 128, 1)
    strides = {"q": st, "k": st, "v": st, "o": st}
    plan = launch.Plan(FAM, DYN, p, strides, 0.1, 0)
    assert allocs == [(1, 0, f"{DYN.name} (tile_counter)")]
    plan.run((1 << 20, 2 << 20, 3 << 20, 4 << 20, 5 << 20), 0, stream=7)
    plan.run((1 << 20, 2 << 20, 3 << 20, 4 << 20, 5 << 20), 0, stream=7)
    assert len(allocs) == 2                                  # once per stream, not per call
    plan.run((1 << 20, 2 << 20, 3 << 20, 4 << 20, 5 << 20), 0, stream=8)
    assert len(allocs) == 3
    dt = launch.struct_dtype("Sm90FwdParams")
    recs = [np.frombuffer(x["raw"], dt)[0] for x in launches]
    assert int(recs[0]["tile_counter"]) == 0xC0DE01 and int(recs[0]["sched_section"]) == 32
    assert int(recs[1]["tile_counter"]) == 0xC0DE01 and int(recs[2]["tile_counter"]) == 0xC0DE02
    assert launches[0]["grid"] == (132, 1, 1)                # one CTA per SM
    launch.Plan(FAM, DYN.replace(dynamic=False), p, strides, 0.1, 0)
    assert len(allocs) == 3


def test_counter_allocation_names_the_plan_when_it_fails(monkeypatch):
    import cupy

    monkeypatch.setattr(cupy.cuda, "alloc", lambda n: (_ for _ in ()).throw(RuntimeError("no device")))

    class Dev:
        def __init__(self, i):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    monkeypatch.setattr(cupy.cuda, "Device", Dev)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: SimpleNamespace(is_capturing=lambda: False))
    with pytest.raises(RuntimeError, match=r"sm90fwd_.*_dyn \(tile_counter\).*before capturing"):
        launch._zeroed_i32(1, 0, f"{DYN.name} (tile_counter)")


def sched_configs():
    """The heuristic of every head dim x mask, persistent and dynamic, plus the GPU test's layout
    changes and feature kernels."""
    out = []
    for d, causal in itertools.product(sm90_fwd.HEAD_DIMS, (False, True)):
        p = Problem("fwd", "bf16", 2, 2048, 2048, 16, 16, d, causal)
        out.append(FAM.heuristic(p).replace(persistent=True, dynamic=True, stream_tail=False))
    base = DYN
    out += [base.replace(pingpong=False), base.replace(head_dim=64, BM=192, consumers=3, BN=96),
            base.replace(BM=64, consumers=1, pingpong=False, BN=128, causal=False),
            base.replace(window=True, BN=128), base.replace(softcap=True, causal=False),
            base.replace(alibi=True), base.replace(dropout=True, BN=128),
            base.replace(dtype="fp16", causal=False),
            base.replace(head_dim=64, BN=192, causal=False, tma_store=True), base.replace(BN=160, tma_store=True),
            base.replace(head_dim=96, BN=128, dtype="fp16", causal=False, dynamic=False, persistent=False,
                         tma_store=True),
            base.replace(head_dim=256, BM=64, consumers=1, pingpong=False, BN=64, tma_store=True),
            base.replace(BM=64, consumers=1, pingpong=False, BN=128, causal=False, dynamic=False, tma_store=True)]
    for c in out:
        c.validate(227 * 1024)
    return list(dict.fromkeys(out))


@needs_nvcc
def test_ptxas_no_spills_no_serialized_wgmma():
    from concurrent.futures import ThreadPoolExecutor

    from cuflash.compile import nvcc_compile

    configs = sched_configs()
    chunks = [configs[i:i + 5] for i in range(0, len(configs), 5)]
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        reports = [r for rs in pool.map(lambda c: nvcc_compile(c, "sm_90a", NVCC), chunks) for r in rs]
    bad = [f"{c.name}: {r}" for c, r in zip(configs, reports)
           if r.spill_stores or r.spill_loads or r.stack_bytes
           or [w for w in r.warnings if re.search(r"C75(1[0-5])\b", w) or "serialized" in w]]
    assert not bad, "\n".join(bad)
