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
from cuflash.families import sm90_fwd
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
    # DROPOUT_DYNAMIC; DROPOUT_PACKED at d128: the keep mask on P's packed fragments (_dpk), drawn in
    # the wait for S_j (DROPOUT_EARLY: _dpe)
    assert cfg.name == "sm90fwd_bf16_d128_causal_BM128_BN160_s2_c2_pp_persist_dyn_drop_dpk_dpe"
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
        # DROPOUT_DYNAMIC: the persistent grid with the dynamic scheduler, no TMA store
        # (DROPOUT_PACKED's head dims: the same with drop_packed, _dpk, the last template argument)
        # (DROPOUT_EARLY's: then drop_early, _dpe, its form the last template argument)
        packed = d in sm90_fwd.DROPOUT_PACKED
        early = sm90_fwd.DROPOUT_EARLY.get(d, 0) if packed else 0
        assert cfg.drop_packed == packed and cfg.drop_early == early
        assert cfg.kernel_name().endswith(f", true, {early}>" if early else ", true>" if packed else ", 0, true>")
        cfg_kernel = cfg.replace(drop_packed=False, drop_early=0)
        assert cfg.name == cfg_kernel.name + ("_dpk" if packed else "") + ("_dpe" if early == 1 else f"_dpe{early}" if early else "")
        assert cfg_kernel.name.endswith("_pp_persist_dyn_drop") and cfg.persistent and cfg.dynamic
        assert not cfg.tma_store
        assert cfg_kernel.kernel_name().endswith(f"cuflash::{dtype}, {str(causal).lower()}, false, false, false, true, 0, true>")
        # kDropout, then kEmuExp2 (0 with dropout: tests/test_sm90_softcap_cpu.py)
        # (then kDynamic, kTmaStore, kVarlen and the feature variants, appended after them)
        args = dict(zip(type(cfg).__dataclass_fields__, cfg.template_args()))
        assert (args["dropout"], args["emu_exp2"]) == (True, 0)
        assert len(cfg.template_args()) == len(type(cfg).__dataclass_fields__) - 3   # (section: run time; cluster: the entry point; even_waves: the grid)
        with pytest.MonkeyPatch.context() as mp:   # the switch off: the static tiles of before
            mp.setattr(sm90_fwd, "DROPOUT_DYNAMIC", False)
            static = FAM.for_problem(FAM.heuristic(p), p)
            assert static == cfg.replace(persistent=False, dynamic=False)
            static = static.replace(drop_packed=False, drop_early=0)
            assert static.name.endswith("_pp_drop")
            assert static.kernel_name().endswith(f"cuflash::{dtype}, {str(causal).lower()}, false, false, false, true>")
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


def test_kernel_source_applies_dropout_after_the_softmax_and_before_the_pack():
    """The order that makes l and the LSE plain attention's (FA2's Algorithm 2): softmax_step,
    then Dropout::zero_dropped, then the P fragments; the same Dropout::zero_dropped as fa2_fwd,
    and 1 / (1 - p) with 1 / l in the epilogue."""
    from cuflash.compile import kernel_dir

    src = (kernel_dir() / "sm90_fwd.cu").read_text()
    assert "bool kDropout = false" in src and '#include "philox.cuh"' in src
    # the K/V loop (sm90_fwd_common.cuh sm90_consume_blocks) runs softmax_s, then to_p, at j = 0 and
    # in every later step; sm90_fwd's to_p is drop_p, pack_p, drop_packed
    loop = (kernel_dir() / "sm90_fwd_common.cuh").read_text()
    loop = loop[loop.index("void sm90_consume_blocks("):]
    body = loop[loop.index("for (int j = 1; j < n_blocks; ++j)"):]
    assert body.index("softmax_s(slot, j)") < body.index("to_p(j)")
    first = loop[loop.index("softmax_s(slot_of(0), 0);"):]
    assert first.index("to_p(0)") < first.index("for (int j = 1;")
    to_p = src[src.index("auto to_p = [&](int j) {"):]
    to_p = to_p[:to_p.index("};")]
    assert to_p.index("drop_p(j)") < to_p.index("pack_p()") < to_p.index("drop_packed(j)")
    pack_p = src[src.index("auto pack_p = [&]() {"):]
    assert "pack_a_frags<1, kBN / 16, Elem>(p_frag, s_acc);" in pack_p[:pack_p.index("\n    };")]
    assert "dropout.zero_dropped(s_acc, at.batch * p.nheads + at.head, warp_row0," in src
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
    # d128 applies the mask to P's packed fragments (DROPOUT_PACKED), which takes BN 192
    # (DROPOUT_PACKED_BN); at d96 (fp32 form, DROPOUT_BN 160) a forced BN 192 is refused
    assert fam.for_problem(wide, p).drop_packed and not fam.for_problem(wide, p).problems(227 * 1024)
    p96 = p.replace(head_dim=96)
    wide96 = fam.heuristic(p96.replace(features=(), dropout_p=0.0)).replace(BN=192, tma_store=False)
    with pytest.raises(ConfigError, match="DROPOUT_BN"):
        fam.for_problem(wide96, p96).validate()
