"""decode_splitkv's compile-time options without a GPU: the fused combine (fused_combine) and the
paged page-id prefetch (page_prefetch): configs, names, the space, launches, the persistent split
counters and their params field, the split heuristic's model, and nvcc builds (sm_80, sm_90a)
of the new instantiations with zero spills."""
import shutil
from types import SimpleNamespace

import pytest

from cuflash import _gpu, registry
from cuflash.families import decode_splitkv as mod
from cuflash.families.decode_splitkv import DecodeConfig, ctas_per_sm, num_splits_for
from cuflash.problem import Problem

FAM = registry.get("decode_splitkv")
P = Problem("decode", "bf16", 1, 1, 131072, 32, 8, 128)


def test_config_flags_are_appended_and_named():
    plain = DecodeConfig(8, 16, 3, 1, 4, 128, "bf16", False)
    assert (plain.fused_combine, plain.page_prefetch) == (False, False)
    assert plain.name == "decode_bf16_d128_w8_n16_s3_m1_c4"  # plain names unchanged
    both = plain.replace(fused_combine=True, page_prefetch=True)
    assert both.name.endswith("_fc_pp") and plain.replace(fused_combine=True).name.endswith("_c4_fc")
    assert plain.template_args() == (8, 16, 3, 1, 128, "bf16", False, False, 0, False, False, False, 0, False, 0, False,
                                    False)
    assert both.template_args()[-11:-3] == (True, True, 0, False, False, False, 0, False)
    assert both.kernel_name() == "cuflash::decode_splitkv<8, 16, 3, 1, 128, cuflash::bf16, true, true, 0, false>"
    assert plain.kernel_name().endswith("cuflash::bf16, false, false, 0, false>")
    for cfg in (plain, both, both.replace(splits=17)):
        assert FAM.decode(FAM.encode(cfg), "bf16", False) == cfg
    assert both.smem_bytes == plain.smem_bytes  # the flag fits in the dead Q tile


def test_space_has_both_options():
    assert FAM.space["fused_combine"] == (False, True)
    assert FAM.space["page_prefetch"] == (False, True)
    valid = FAM.valid(P, 227 * 1024)
    assert {(c.fused_combine, c.page_prefetch) for c in valid} == {(a, b) for a in (0, 1) for b in (0, 1)}
    cfg = FAM.make({**FAM.point(FAM.heuristic(P)), "fused_combine": True}, P)
    assert cfg.fused_combine and not cfg.page_prefetch


@pytest.fixture(autouse=True)
def _cp_async_loop(monkeypatch):
    """These options belong to the cp.async loop: the heuristic must not pick the Hopper loop."""
    monkeypatch.setattr(mod, "TMA_DEFAULT", False)


def test_heuristic_switches(monkeypatch):
    assert FAM.heuristic(P).fused_combine and not FAM.heuristic(P).page_prefetch   # measured: fused on
    monkeypatch.setattr(mod, "FUSED_COMBINE_DEFAULT", False)
    assert not FAM.heuristic(P).fused_combine
    monkeypatch.setattr(mod, "FUSED_COMBINE_DEFAULT", True)
    monkeypatch.setattr(mod, "PAGE_PREFETCH_DEFAULT", True)
    assert FAM.heuristic(P).fused_combine and not FAM.heuristic(P).page_prefetch  # not paged
    paged = FAM.heuristic(P.replace(features=("paged_kv",)))
    assert paged.fused_combine and paged.page_prefetch


def test_launches_and_counters():
    p = P.replace(batch=3, seqlen_q=5, nheads=32, nheads_kv=4)  # 40 packed rows: 2 row blocks
    for fused, splits, roles in ((False, 7, ["main", "combine"]), (True, 7, ["main"]),
                                 (True, 1, ["main"]), (False, 1, ["main"])):
        cfg = FAM.heuristic(p).replace(fused_combine=fused, splits=splits)
        assert [s.role for s in FAM.launches(cfg, p, 132)] == roles
        groups = 3 * 4 * mod.row_blocks(cfg, p)
        assert FAM.counters(cfg, p) == (groups if fused and splits > 1 else 0)
        main = FAM.launches(cfg, p, 132)[0]
        assert main.grid[1] * main.grid[2] == groups  # counter index b · gridDim.y + blockIdx.y
    # the partials stay per-call workspace; the counters are not in it
    cfg = FAM.heuristic(p).replace(fused_combine=True, splits=7)
    assert "split_counters" not in FAM.workspace(cfg, p) and "o_partial" in FAM.workspace(cfg, p)


def test_params_field_and_refusal():
    from cuflash.launch import struct_dtype

    dtype = struct_dtype("DecodeParams")
    assert dtype.names[-1] == "split_counters" and dtype.fields["split_counters"][0].itemsize == 8
    assert dtype.names[:len(FAM.pointer_fields)] == FAM.pointer_fields
    p = P
    strides = {"call": {}}
    cfg = FAM.heuristic(p).replace(fused_combine=True, splits=4, dynamic=0)   # dynamic 1: twice (the claims)
    # the plan writes each launch's stream's counters there (zeroed_counters)
    assert FAM.static_params(cfg, p, strides, {}, 0.1, 132)["split_counters"] == 0
    assert FAM.zeroed_counters(cfg, p) == {"split_counters": 8}
    assert FAM.zeroed_counters(cfg.replace(fused_combine=False), p) == {}
    assert FAM.zeroed_counters(cfg.replace(splits=1), p) == {}
    plain = FAM.static_params(cfg.replace(fused_combine=False), p, strides, {}, 0.1, 132)
    assert plain["split_counters"] == 0
    assert FAM.static_params(cfg.replace(splits=1), p, strides, {}, 0.1, 132)["num_splits"] == 1


def test_plan_packs_the_counters_address_per_stream(monkeypatch):
    """The plan keeps the fused combine's counters, one zeroed buffer per CUDA stream (a spare made
    with the plan, for a stream first seen in a capture): each launch carries its stream's."""
    from cuflash import launch

    calls, allocs = [], []

    def record(fn, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        calls.append(((gx, gy, gz), stream, int(plan._record[0]["split_counters"])))

    def zeroed(n, device, what):
        allocs.append((n, what))
        return SimpleNamespace(ptr=0x7000 + 0x100 * len(allocs))

    monkeypatch.setattr(launch, "get_kernels", lambda config, device: {
        role: SimpleNamespace(kernel=SimpleNamespace(ptr=1000 + i))
        for i, role in enumerate(FAM.kernel_names(config))})
    monkeypatch.setattr(_gpu, "sm_count", lambda device=0: 132)
    monkeypatch.setattr(launch, "_driver_launch", lambda: record)
    monkeypatch.setattr(launch, "_device_fns", lambda: (lambda: 0, lambda device: None))
    monkeypatch.setattr(launch, "_zeroed_i32", zeroed)
    monkeypatch.setattr(launch, "_stream_capturing", lambda stream: False)
    cfg = FAM.heuristic(P).replace(fused_combine=True, splits=9, dynamic=0)   # dynamic 1: twice (the claims)
    plan = launch.Plan(FAM, cfg, P, {"call": {}}, 0.1, 0)
    assert allocs == [(8, f"{cfg.name} (split_counters)")]          # the spare, with the plan
    ptrs = tuple(range(0x1000, 0x1000 + 14 * 0x100, 0x100))
    for stream in (5, 5, 6, 5, 6):
        plan.run(ptrs, 0x900000, stream)
    assert [c[0] for c in calls] == [(9, 8, 1)] * 5                 # main only
    by_stream = {}
    for _, stream, addr in calls:
        assert by_stream.setdefault(stream, addr) == addr            # one buffer per stream
    assert by_stream[5] != by_stream[6] and len(allocs) == 3         # spare taken, refilled per new stream
    assert set(plan.counters["split_counters"].buffers) == {5, 6}
    assert int(plan._record[0]["o_partial"]) == 0x900000
    plain = launch.Plan(FAM, cfg.replace(fused_combine=False), P, {"call": {}}, 0.1, 0)
    assert plain.counters == {} and len(allocs) == 3


def test_stream_counters_in_a_capture(monkeypatch):
    """A stream first seen while it captures takes the spare (no zeroing in a capture) and makes
    no new one; a second such stream is refused with a clear error, until an eager first use on
    another stream has made a spare again."""
    from cuflash import launch

    allocs, capturing = [], set()
    monkeypatch.setattr(launch, "_zeroed_i32", lambda n, device, what: allocs.append(n) or
                        SimpleNamespace(ptr=0x100 * len(allocs)))
    monkeypatch.setattr(launch, "_stream_capturing", lambda stream: stream in capturing)
    sc = launch.StreamCounters(4, 0, "cfg (split_counters)")
    capturing.update({11, 12})
    assert sc.address(11) == 0x100 and allocs == [4]                # the spare
    assert sc.address(11) == 0x100
    with pytest.raises(RuntimeError, match="before capturing"):
        sc.address(12)
    assert sc.address(3) == 0x200 and len(allocs) == 3              # eager: a buffer and a new spare
    assert sc.address(12) == 0x300 and len(allocs) == 3


def test_split_counters_not_in_a_capture():
    from cuflash import decode

    class Arrays:
        capturing_now = False

        def capturing(self):
            return self.capturing_now

    arrays = Arrays()
    cfg = FAM.heuristic(P).replace(fused_combine=True, splits=16)
    decode._check_counters(FAM, cfg, P, arrays)
    arrays.capturing_now = True
    decode._check_counters(FAM, cfg.replace(fused_combine=False), P, arrays)   # none needed
    decode._check_counters(FAM, cfg.replace(splits=1), P, arrays)
    with pytest.raises(RuntimeError, match="before capturing"):
        decode._check_counters(FAM, cfg, P, arrays)
    assert "counters" in decode._GpuEntry.__slots__


def test_split_model():
    cfg = FAM.heuristic(P).replace(fused_combine=False)
    assert ctas_per_sm(cfg, 227 * 1024) == 1
    # one resident CTA: ceil(groups·s / SMs) waves of (blocks / s + split_cost), as measured
    assert num_splits_for(cfg, P, 132) == 16
    assert num_splits_for(cfg, P.replace(batch=8, seqlen_k=32768), 132) == 2
    assert num_splits_for(cfg, P.replace(batch=32, seqlen_k=8192), 132) == 1
    # the separate combine's launch weighs against splitting; the fused combine does not pay it
    small_ctx = P.replace(seqlen_k=8192)  # 64 blocks: 16 splits of 4
    assert num_splits_for(cfg, small_ctx, 132) == 16
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mod, "COMBINE_LAUNCH_COST", 100)  # a combine launch dearer than the whole row
        assert num_splits_for(cfg, small_ctx, 132) == 1
        assert num_splits_for(cfg.replace(fused_combine=True), small_ctx, 132) == 16
    # three resident CTAs share the SM's bandwidth: 512 groups on 132 SMs split to even out the
    # busiest SM's load (4 CTAs of 512 blocks vs 35 of 57), not to fill more slots
    w4 = cfg.replace(warps=4, stages=2)
    assert ctas_per_sm(w4, 227 * 1024) == 3
    assert num_splits_for(w4, P.replace(batch=64, seqlen_k=32768), 132) == 9
    assert num_splits_for(w4, P.replace(batch=32, seqlen_k=8192), 132) == 1


NEW = [DecodeConfig(8, 16, 3, 1, 4, 128, "bf16", False, fused_combine=True),
       DecodeConfig(8, 16, 3, 1, 4, 128, "bf16", False, page_prefetch=True),
       DecodeConfig(8, 16, 3, 1, 4, 128, "bf16", False, fused_combine=True, page_prefetch=True),
       DecodeConfig(8, 16, 3, 2, 4, 128, "bf16", False, fused_combine=True, page_prefetch=True),
       DecodeConfig(4, 16, 2, 1, 4, 128, "bf16", False, fused_combine=True, page_prefetch=True),
       DecodeConfig(4, 16, 3, 1, 4, 128, "bf16", False, fused_combine=True, page_prefetch=True),
       DecodeConfig(8, 16, 3, 1, 4, 64, "fp16", False, fused_combine=True, page_prefetch=True),
       DecodeConfig(2, 16, 2, 1, 4, 256, "bf16", False, fused_combine=True, page_prefetch=True)]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_new_instantiations_compile_without_spills(arch):
    from cuflash.compile import nvcc_compile

    for cfg, rep in zip(NEW, nvcc_compile(NEW, arch)):
        assert rep.spill_stores == 0 and rep.spill_loads == 0 and rep.stack_bytes == 0, (cfg.name, rep)
