"""decode_splitkv's Hopper loop (``tma``: decode_splitkv_tma, a producer warp streaming K/V by TMA
into an mbarrier ring) without a GPU: the config field, names, threads, shared memory and rules,
the space and heuristic switch, the tensor-map arguments and the per-call writer through
launch.Plan (fake encoder, fake launches), a NumPy mirror of the producer's box plan (every key
row lands where the consumers read it, the announced bytes equal the copies' bytes), and nvcc
builds of the kernel for sm_90a (zero spills) and sm_80 (a trap stub)."""
import ctypes
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from cuflash import _gpu, launch
from cuflash.compile import kernel_param_decl, nvcc_compile
from cuflash.families import decode_splitkv as mod
from cuflash.families import sm90_fwd
from cuflash.families.decode_splitkv import DecodeConfig, tma_box_rows, tma_map_args
from cuflash.problem import Problem
from cuflash.registry import get

FAM = get("decode_splitkv")
TMA = DecodeConfig(8, 16, 3, 1, 4, 128, "bf16", False, tma=True)


def problem(batch=2, seqlen_q=1, ctx=4096, h=32, hk=8, d=128, features=()):
    return Problem("decode", "bf16", batch, seqlen_q, ctx, h, hk, d, False, False, tuple(features))


def test_config_field_names_threads_smem():
    plain = TMA.replace(tma=False)
    assert [f.name for f in __import__("dataclasses").fields(DecodeConfig)][-23:] == ["tma", "l2_prefetch", "warp_loads", "page_gather", "lean", "bulk", "early_merge",
                                                                                    "ring_fill", "dynamic", "stream", "light_fence", "regs",
                                                                                    "regs_prefetch", "regs_ahead", "regs_ahead_l1", "regs_order",
                                                                                    "regs_prefetch_blocks", "regs_cluster", "regs_page_table",
                                                                                    "pdl", "regs_staged", "regs_spec", "regs_page_shift"]
    assert TMA.name == plain.name + "_tma" and plain.threads == 256 and TMA.threads == 288
    assert TMA.smem_bytes == plain.smem_bytes + 2 * 3 * 8         # full + empty mbarriers
    assert TMA.kernel_name() == "cuflash::decode_splitkv_tma<8, 16, 3, 1, 128, cuflash::bf16>"
    assert plain.kernel_name() == "cuflash::decode_splitkv<8, 16, 3, 1, 128, cuflash::bf16, false, false, 0, false>"
    assert TMA.template_args() == (8, 16, 3, 1, 128, "bf16")
    assert not TMA.problems(232448)
    assert FAM.kernel_names(TMA)["main"] == TMA.kernel_name()
    assert kernel_param_decl(FAM, "main", TMA.kernel_name()) == \
        "const __grid_constant__ cuflash::DecodeTmaParams"
    assert kernel_param_decl(FAM, "main", plain.kernel_name()) == "const cuflash::DecodeParams"
    assert kernel_param_decl(FAM, "combine") == "const cuflash::DecodeParams"
    assert FAM.decode(FAM.encode(TMA), "bf16", False) == TMA


def test_config_rules():
    why = " ".join(TMA.replace(head_dim=256).problems())
    assert "tma: head_dim must be <= 240" in why
    why = " ".join(TMA.replace(warps=16, warp_n=32, m_tiles=1).problems())
    assert "must be <= 256" in why
    why = " ".join(TMA.replace(m_tiles=2).problems())             # d128, two row tiles, 8 warps
    assert "exceed the budget of 96" in why and not TMA.replace(m_tiles=2, warps=4).problems()
    for flag, value in (("fused_combine", True), ("page_prefetch", True), ("l2_prefetch", 256),
                        ("warp_loads", True), ("page_gather", True)):
        assert "no fused_combine, no page_prefetch, no l2_prefetch, no warp_loads, no page_gather and no lean" in " ".join(
            TMA.replace(**{flag: value}).problems())
    # 4 warps x 64-key blocks x 3 stages: two CTAs per SM (threads and shared memory)
    small = TMA.replace(warps=4, stages=3)
    assert not small.problems(232448) and mod.ctas_per_sm(small, 232448) == 2
    assert mod.ctas_per_sm(TMA, 232448) == 1


def test_space_and_heuristic_switch(monkeypatch):
    assert FAM.space["tma"] == (False, True)
    point = {k: v for k, v in FAM.point(TMA).items() if k != "tma"}   # a table from before tma
    assert FAM.make(point, problem()) == TMA.replace(tma=False)
    p = problem()
    assert FAM.heuristic(p, (9, 0)).tma == mod.TMA_DEFAULT
    monkeypatch.setattr(mod, "TMA_DEFAULT", False)
    assert not FAM.heuristic(p, (9, 0)).tma
    monkeypatch.setattr(mod, "TMA_DEFAULT", True)
    cfg = FAM.heuristic(p, (9, 0))
    assert cfg.tma and not cfg.fused_combine and not cfg.page_prefetch and not cfg.problems(232448)
    assert not FAM.heuristic(p, (8, 0)).tma                 # sm_80: the cp.async loop
    assert not FAM.heuristic(p.replace(head_dim=120), (9, 0)).tma   # the box has no column mask
    assert not FAM.heuristic(p.replace(head_dim=256), (9, 0)).tma
    assert FAM.heuristic(p.replace(head_dim=64, seqlen_q=5), (9, 0)).tma
    two = FAM.heuristic(p.replace(seqlen_q=5), (9, 0))         # 20 packed rows: two row tiles
    assert two.tma and two.m_tiles == 2 and two.warps == 4 and two.stages == 6


def test_tma_problem_reasons():
    p = problem()
    assert FAM.tma_problem(TMA, p, (9, 0), 0) == "" and FAM.tma_problem(TMA, p, (9, 0), 16) == ""
    assert FAM.tma_problem(TMA.replace(tma=False), p, (8, 0), 7) == ""
    assert FAM.tma_problem(TMA, p, (8, 0), 0).startswith("config: ")
    assert FAM.tma_problem(TMA, p.replace(head_dim=120), (9, 0), 0).startswith("q: the tma loop")
    assert FAM.tma_problem(TMA, p, (9, 0), 8).startswith("k_cache: the tma loop needs a page_block_size")
    # an empty contiguous cache: no tensor map (a zero extent); the chosen config falls back
    empty = p.replace(seqlen_k=0)
    assert FAM.tma_problem(TMA, empty, (9, 0), 0).startswith("k_cache: the tma loop needs a cache of at least one row")
    assert FAM.tma_problem(TMA, empty, (9, 0), 16) == ""
    assert not FAM.call_config(TMA, empty, (9, 0), 0, chosen=True).tma


def test_call_config(monkeypatch):
    """What the call knows refines the config: a given tma config that cannot run raises, a chosen
    one falls back; the heuristic's choice takes the Hopper loop (4 warps, 3 stages) for pages
    below TMA_PAGED_MAX_PAGE on sm_90 only (with TMA_PAGED_DEFAULT on; the small-page 4-warp rule
    off, as it was)."""
    monkeypatch.setattr(mod, "TMA_PAGED_DEFAULT", True)
    monkeypatch.setattr(mod, "SMALL_PAGE_WARPS", 8)
    monkeypatch.setattr(mod, "SMALL_PAGE_TMA_MAX_KEYS", 0)
    monkeypatch.setattr(mod, "LARGE_PAGE_TMA_MAX_KEYS", 0)
    p = problem(features=("paged_kv",))
    plain = TMA.replace(tma=False)
    with pytest.raises(ValueError, match="^k_cache: the tma loop"):
        FAM.call_config(TMA, p, (9, 0), 8, chosen=False)
    assert FAM.call_config(TMA, p, (9, 0), 8, chosen=True) == plain
    assert FAM.call_config(TMA, p, (9, 0), 16, chosen=False) == TMA
    small = FAM.call_config(plain, p, (9, 0), 16, chosen=True, heuristic=True)
    assert small.tma and (small.warps, small.stages) == (4, 3) and not small.problems(232448)
    assert FAM.call_config(plain, p, (9, 0), 256, chosen=True, heuristic=True) == plain
    assert FAM.call_config(plain, p, (9, 0), 0, chosen=True, heuristic=True) == plain
    assert FAM.call_config(plain, p, (8, 0), 16, chosen=True, heuristic=True) == plain
    assert FAM.call_config(plain, p, (9, 0), 16, chosen=True, heuristic=False) == plain   # tuned
    assert FAM.call_config(plain, p, (9, 0), 8, chosen=True, heuristic=True) == plain     # page % 16
    assert FAM.call_config(plain, p.replace(head_dim=120), (9, 0), 16, chosen=True, heuristic=True) == plain
    fused = plain.replace(fused_combine=True)   # the heuristic's (FUSED_COMBINE_DEFAULT): the Hopper loop drops it
    assert FAM.call_config(fused, p, (9, 0), 16, chosen=True, heuristic=True) == small
    two = FAM.call_config(plain.replace(m_tiles=2), p, (9, 0), 16, chosen=True, heuristic=True)
    assert two.tma and two.m_tiles == 2 and not two.problems(232448)
    monkeypatch.setattr(mod, "TMA_PAGED_DEFAULT", False)
    assert FAM.call_config(plain, p, (9, 0), 16, chosen=True, heuristic=True) == plain
    # page 256 takes the Hopper loop up to LARGE_PAGE_TMA_MAX_KEYS keys in all (batch x capacity)
    keys = p.batch * p.seqlen_k
    monkeypatch.setattr(mod, "LARGE_PAGE_TMA_MAX_KEYS", keys)
    large = FAM.call_config(plain, p, (9, 0), 256, chosen=True, heuristic=True)
    assert large.tma and (large.warps, large.stages) == (4, 3) and not large.fused_combine
    assert FAM.call_config(plain, p, (8, 0), 256, chosen=True, heuristic=True) == plain
    assert FAM.call_config(plain, p, (9, 0), 256, chosen=True, heuristic=False) == plain   # tuned
    monkeypatch.setattr(mod, "LARGE_PAGE_TMA_MAX_KEYS", keys - 1)
    assert FAM.call_config(plain, p, (9, 0), 256, chosen=True, heuristic=True) == plain


def test_box_rows_and_map_args():
    assert tma_box_rows(TMA.replace(tma=False), 16) == 0
    assert tma_box_rows(TMA, 0) == 128 and tma_box_rows(TMA, 16) == 16
    assert tma_box_rows(TMA, 256) == 128 and tma_box_rows(TMA, 48) == 16
    assert tma_box_rows(TMA.replace(warps=4), 256) == 64
    p = problem(ctx=5000)
    # contiguous (batch_cache 3, capacity 5000, 8 heads, d 128): strides in elements
    dims, st, box = tma_map_args(TMA, p, (5000 * 8 * 128, 8 * 128, 128), 0, 3)
    assert dims == (128, 5000, 8, 3) and st == (2 * 8 * 128, 2 * 128, 2 * 5000 * 8 * 128)
    assert box == (136, 128, 1, 1)
    # paged (40 pages of 16 keys), a strided (non-contiguous) page stride is honoured
    dims, st, box = tma_map_args(TMA, p, (16 * 8 * 128 + 64, 8 * 128, 128), 16, 40)
    assert dims == (128, 16, 8, 40) and st == (2 * 8 * 128, 2 * 128, 2 * (16 * 8 * 128 + 64))
    assert box == (136, 16, 1, 1)
    # extent-1 dimensions get a 16-byte stride (MQA: one KV head)
    dims, st, _ = tma_map_args(TMA, p.replace(nheads_kv=1), (5000 * 128, 128, 128), 0, 1)
    assert dims == (128, 5000, 1, 1) and st == (256, 16, 16)


@pytest.fixture
def fake_encoder(monkeypatch):
    calls = []

    def encode(dtype_code, ptr, dims, strides_bytes, box, swizzle, l2, oob):
        calls.append((dtype_code, ptr, dims, strides_bytes, box, swizzle, l2, oob))
        return bytes((len(calls) + j) % 256 for j in range(128))

    monkeypatch.setattr(sm90_fwd, "_encoder", encode)
    monkeypatch.setattr(mod, "_MAP_CACHE", {})
    return calls


def _fake_gpu(monkeypatch, struct_name):
    launches = []

    def record(fn, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        ptr = ctypes.c_uint64.from_address(argv).value
        launches.append(dict(fn=fn, grid=(gx, gy, gz), block=bx, smem=smem,
                             raw=ctypes.string_at(ptr, launch.struct_dtype(struct_name).itemsize)))

    monkeypatch.setattr(launch, "get_kernels", lambda config, device: {
        role: SimpleNamespace(kernel=SimpleNamespace(ptr=1000 + i))
        for i, role in enumerate(FAM.kernel_names(config))})
    monkeypatch.setattr(_gpu, "sm_count", lambda device=0: 132)
    monkeypatch.setattr(launch, "_driver_launch", lambda: record)
    monkeypatch.setattr(launch, "_device_fns", lambda: (lambda: 0, lambda device: None))
    return launches


def _strides(page):
    kv = (page * 8 * 128, 8 * 128, 128) if page else (4096 * 8 * 128, 8 * 128, 128)
    return {"q": (32 * 128, 32 * 128, 128), "k_cache": kv, "v_cache": kv,
            "o": (32 * 128, 32 * 128, 128),
            "call": dict(page_size=page, num_pages=40 if page else 2, block_table_stride=4096 // (page or 1),
                         cache_seqlen_fixed=4096)}


@pytest.mark.parametrize("page", [0, 16, 256])
def test_plan_writes_the_cache_maps_per_call(monkeypatch, fake_encoder, page):
    launches = _fake_gpu(monkeypatch, "DecodeTmaParams")
    p = problem(features=("paged_kv",) if page else ())
    cfg = TMA.replace(splits=4)
    plan = launch.Plan(FAM, cfg, p, _strides(page), 0.125, 0)
    dt = launch.struct_dtype("DecodeTmaParams")
    assert dt.names[:len(FAM.pointer_fields)] == FAM.pointer_fields
    assert dt.fields["tma_k"][1] % 64 == 0 and dt.fields["tma_v"][1] == dt.fields["tma_k"][1] + 128
    # DecodeParams is DecodeTmaParams' prefix (the other kernels read it)
    base = launch.struct_dtype("DecodeParams")
    assert all(dt.fields[n][1] == base.fields[n][1] for n in base.names)
    ptrs = tuple(0x10000 * (i + 1) for i in range(14))
    plan.run(ptrs, 0x900000, 7)
    main = launches[0]
    assert main["block"] == 288 and main["smem"] == cfg.smem_bytes and main["grid"] == (4, 8, 2)
    assert [c["fn"] - 1000 for c in launches] == [0, 2]       # main, combine
    rec = np.frombuffer(main["raw"], dt)[0]
    assert int(rec["tma_box_rows"]) == tma_box_rows(cfg, page) and int(rec["page_size"]) == page
    assert [c[1] for c in fake_encoder] == [ptrs[1], ptrs[2]]        # k_cache, v_cache
    rows = page or 4096
    assert fake_encoder[0][2] == (128, rows, 8, 40 if page else 2)
    assert fake_encoder[0][4] == (136, tma_box_rows(cfg, page), 1, 1)
    assert fake_encoder[0][0] == sm90_fwd.CU_TENSOR_MAP_DATA_TYPE["bf16"]
    assert fake_encoder[0][5:] == (0, 3, 0)                           # no swizzle, L2 256B, zeros
    off = dt.fields["tma_k"][1]
    assert main["raw"][off:off + 128] == bytes((1 + j) % 256 for j in range(128))
    assert main["raw"][off + 128:off + 256] == bytes((2 + j) % 256 for j in range(128))
    plan.run(ptrs, 0x900000, 7)                                       # same caches: cached maps
    assert len(fake_encoder) == 2 and launches[2]["raw"] == main["raw"]
    plan.run(ptrs[:1] + (0xAB0000,) + ptrs[2:], 0x900000, 7)          # a new k_cache
    assert len(fake_encoder) == 3 and fake_encoder[-1][1] == 0xAB0000
    assert launches[-2]["raw"][off:off + 128] == bytes((3 + j) % 256 for j in range(128))
    plan.run(ptrs, 0x900000, 7)                                       # back: the first maps again
    assert len(fake_encoder) == 3 and launches[-2]["raw"] == main["raw"]


def test_plain_plans_write_no_maps(monkeypatch, fake_encoder):
    launches = _fake_gpu(monkeypatch, "DecodeTmaParams")
    plan = launch.Plan(FAM, TMA.replace(tma=False, splits=1), problem(), _strides(0), 0.125, 0)
    assert plan._write_call is None
    plan.run(tuple(0x10000 * (i + 1) for i in range(14)), 0, 7)
    assert not fake_encoder and launches[0]["block"] == 256


# ---- a NumPy mirror of decode_splitkv_tma's producer (one K/V block) ----------------------------

def producer_block(n, block_n, box, keys, start, page_size, table, num_pages, capacity):
    """What the producer loads for block n: {ring row: (page or cache row, row in it)} for the rows
    it copies, and the bytes it announces / copies (kRowBytes = 136 * 2 per TMA row, 256 per
    bulk row: d 128)."""
    row_bytes, bulk_bytes = 272, 256
    j0 = n * block_n
    landed, announced, copied = {}, 0, 0
    if not page_size:
        for r in range(block_n):
            pos = start + j0 + r
            landed[r] = ("row", pos) if pos < capacity else ("zero", None)
        return landed, 2 * block_n * row_bytes, 2 * block_n * row_bytes
    n_boxes = min(block_n // box, -(-(keys - j0) // box))
    for k in range(n_boxes):
        pos0 = start + j0 + k * box
        page = min(max(table[pos0 // page_size], 0), num_pages - 1)
        in_page = pos0 % page_size
        if in_page + box <= page_size:
            announced += 2 * box * row_bytes
            copied += 2 * box * row_bytes
            for r in range(box):
                landed[k * box + r] = (page, in_page + r)
        else:
            announced += 2 * box * bulk_bytes
            for r in range(box):
                pos = start + j0 + k * box + r
                pg = min(max(table[min(pos // page_size, len(table) - 1)], 0), num_pages - 1)
                landed[k * box + r] = (pg, pos % page_size)
                copied += 2 * bulk_bytes
    return landed, announced, copied


@pytest.mark.parametrize("seed", range(30))
def test_producer_mirror_lands_every_key(seed):
    rng = np.random.default_rng(seed)
    block_n = int(rng.choice([64, 128]))
    page = int(rng.choice([0, 16, 32, 48, 256]))
    cap_blocks = int(rng.integers(1, 12))
    capacity = cap_blocks * (page or 1) * (1 if page else int(rng.integers(1, 500)))
    capacity = max(capacity, 1)
    end = int(rng.integers(0, capacity + 1))
    start = int(rng.integers(0, end + 1)) if rng.integers(2) else 0
    keys = end - start
    num_pages = 50
    table = rng.integers(0, num_pages, max(1, -(-capacity // (page or 1)))) if page else None
    cfg = TMA.replace(warps=block_n // 16)
    box = tma_box_rows(cfg, page)
    assert block_n % box == 0 and (not page or page % box == 0)
    for n in range(-(-keys // block_n)):
        landed, announced, copied = producer_block(n, block_n, box, keys, start, page, table,
                                                   num_pages, capacity)
        assert announced == copied, "the full barrier's bytes must equal the copies' bytes"
        for r in range(block_n):
            j = n * block_n + r
            if j >= keys:
                continue     # masked (K) and zeroed (V) by the consumers
            pos = start + j
            want = (table[pos // page], pos % page) if page else ("row", pos)
            assert landed.get(r) == want, (n, r, landed.get(r), want)


# ---- nvcc: the kernel compiles without spills ----------------------------------------------------

NVCC = shutil.which("nvcc")
TMA_POINTS = [TMA, TMA.replace(warp_n=32), TMA.replace(stages=2), TMA.replace(warps=4, stages=6),
              TMA.replace(warps=4, stages=6, m_tiles=2), TMA.replace(warps=4, stages=3, m_tiles=2),
              TMA.replace(head_dim=64, dtype="fp16"), TMA.replace(head_dim=64, m_tiles=2),
              TMA.replace(head_dim=96, m_tiles=2, warps=4, stages=6),
              TMA.replace(head_dim=96, m_tiles=2, warps=4, stages=3)]  # racecheck's call (session 13)


@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
def test_nvcc_sm90a_zero_spills():
    for cfg, rep in zip(TMA_POINTS, nvcc_compile(TMA_POINTS, "sm_90a")):
        assert rep.spill_stores == 0 and rep.spill_loads == 0 and rep.stack_bytes == 0, (cfg.name, rep)
        assert rep.registers * cfg.threads <= 65536, (cfg.name, rep.registers)
        assert not rep.warnings, (cfg.name, rep.warnings)


@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
def test_nvcc_sm80_builds_a_stub():
    """The family's source still builds for sm_80 with a tma instantiation in it (a trap: the host
    never launches it there), next to the plain kernel."""
    plain = TMA.replace(tma=False)
    reps = nvcc_compile([TMA, plain], "sm_80")
    assert reps[0].registers < 16 and reps[1].spill_stores == 0


# ---- the ring's release protocol (compute-sanitizer racecheck, session 13) -----------------------

def _tma_kernel_source() -> str:
    from cuflash.compile import render_source

    src = render_source("decode_splitkv")
    start = src.index("decode_splitkv_tma(const __grid_constant__")
    return src[start:src.index("// ---- decode_splitkv: one split", start)]


def test_ring_release_is_per_thread():
    """Racecheck (H100, session 13) reported the producer's bulk copies into a reused ring slot
    against the consumers' reads of it while one lane per warp released the slot after a
    __syncwarp. Now every consumer thread arrives on empty (count: the consumer threads), and one
    producer thread (lane 0) announces and issues every copy of a slot."""
    src = _tma_kernel_source()
    assert "mbarrier_init(empty(s), kConsumers)" in src
    assert "mbarrier_init(empty(s), kWarps)" not in src
    assert "if (lane == 0) mbarrier_arrive(empty" not in src
    assert src.count("mbarrier_arrive(empty(slot))") == 1
    # every copy into the ring is issued under `if (lane == 0)`: the TMA box and bulk-copy calls
    # of the producer sit in lane-0 blocks
    producer = src[src.index("// ---- producer warp"):src.index("// ---- consumer warps")]
    for call in ("tma_load_4d(", "bulk_load_1d("):
        for at in [i for i in range(len(producer)) if producer.startswith(call, i)]:
            block = producer[:at]
            assert block.rfind("if (lane == 0)") > block.rfind("}\n"), (call, producer[at - 200:at])


def test_sanitize_runs_the_hopper_loop(monkeypatch):
    """tests/gpu_sanitize.py --families decode_splitkv runs the Hopper loop on sm_90 both ways the
    heuristic can pick it, whatever TMA_DEFAULT / TMA_PAGED_DEFAULT say, and restores them."""
    import gpu_sanitize

    monkeypatch.setattr(gpu_sanitize._gpu, "arch", lambda *a: (9, 0))
    loops = gpu_sanitize.decode_loops(FAM)
    # (REGS_DEFAULT 0: the option passes run the older loops, not decode_splitkv_regs; {} is the default)
    assert loops[0] == {} and dict(TMA_DEFAULT=True, TMA_PAGED_DEFAULT=False, REGS_DEFAULT=0) in loops
    assert dict(TMA_DEFAULT=False, TMA_PAGED_DEFAULT=True, REGS_DEFAULT=0) in loops
    assert any(d.get("WARP_LOADS_DEFAULT") and d.get("L2_PREFETCH_DEFAULT") for d in loops)
    before = (mod.TMA_DEFAULT, mod.TMA_PAGED_DEFAULT)
    with gpu_sanitize.decode_loop(dict(TMA_DEFAULT=True, TMA_PAGED_DEFAULT=True)):
        assert mod.TMA_DEFAULT and mod.TMA_PAGED_DEFAULT
        assert FAM.heuristic(problem(), (9, 0)).tma
    assert (mod.TMA_DEFAULT, mod.TMA_PAGED_DEFAULT) == before
    monkeypatch.setattr(gpu_sanitize._gpu, "arch", lambda *a: (8, 0))
    assert [d.get("TMA_DEFAULT") for d in gpu_sanitize.decode_loops(FAM)] == [None, False, False, False, False, False]
    assert any(d.get("CONTIGUOUS_WARPS") == 4 and d.get("LARGE_PAGE_TMA_MAX_KEYS") for d in loops)
