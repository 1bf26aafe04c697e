"""The backward's preprocess (fa2_bwd.cu fa2_bwd_preprocess: D = rowsum(dO∘O), LSE·log2e, the
zeroed dQ accumulator), shared by fa2_bwd and sm90_bwd, on the GPU.

The preprocess has two paths: 16-byte loads with four threads per row when O and dO allow
them, and the any-strides path (a warp per row) that also copies a dout the main kernel cannot
read in place. Both must give the same D to the bit (one summation order, fa2_bwd.cu); here:
each family's gradients against the float64 reference (the 3x gradient rule, check_grads) over
odd seqlens (1, 17, 113, 1023, 2049), s_q != s_k, GQA / MQA, head dims 64, 128, 59 and 200 (the
API zero-pads 59 to 64), fp16 once, varlen once (fa2_bwd), and deterministic mode twice bitwise:
run to run, and the 16-byte path against the copy path (the same dout values through strides
the main kernel cannot read). About 14 backward kernel builds and their forwards.

Run: python tests/test_bwd_pre_gpu.py --precompile   (compiles them in parallel, with the timing
     script's: tests/sm90_bwd_pre_timing.py), then
     CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q -x tests/test_bwd_pre_gpu.py
"""
import math

import pytest

import cuflash
from cuflash import registry
from cuflash.problem import Problem

from conftest import device_heuristic  # noqa: E402
from test_flash_bwd_gpu import check_grads, grads, inputs, reference_grads  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

FAMILIES = ["fa2_bwd", "sm90_bwd"]
SEQLENS = [(1, 1), (17, 17), (113, 113), (1023, 1023), (2049, 2049), (113, 301), (301, 113)]
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


def problem(dtype, causal, hdim, seqlens, heads="gqa", batch=2, deterministic=False):
    (sq, sk), (h, hkv) = seqlens, HEADS[heads]
    return Problem("bwd", dtype, batch, sq, sk, h, hkv, hdim, causal, deterministic)


def config(family, p):
    """The family's heuristic for p (head dim zero-padded to a multiple of 8, as the API runs it)."""
    return device_heuristic(registry.get(family), p.replace(head_dim=-(-p.head_dim // 8) * 8))


def run_case(family, p, dout_of=None):
    cfg = config(family, p)
    q, k, v, dout = inputs(p)
    d_in = dout if dout_of is None else dout_of(dout)
    _, ours = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=p.causal,
                                                            deterministic=p.deterministic, bwd_config=cfg),
                    q, k, v, d_in)
    ref, low = reference_grads(q, k, v, dout, p.causal, 1 / math.sqrt(p.head_dim))
    check_grads(ours, ref, low, what=f"{cfg.name} ")
    return cfg, (q, k, v, dout), ours


ODD_HEAD_DIMS = [("bf16", 59), ("fp16", 200), ("fp16", 64)]
DET_CASES = [("fa2_bwd", 64), ("sm90_bwd", 128)]


@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("hdim", [64, 128])
@pytest.mark.parametrize("family", FAMILIES)
def test_odd_seqlens(family, hdim, seqlens):
    run_case(family, problem("bf16", False, hdim, seqlens, "gqa" if seqlens[0] % 2 else "mha"))


@pytest.mark.parametrize("dtype,hdim", ODD_HEAD_DIMS)
@pytest.mark.parametrize("family", FAMILIES)
def test_odd_head_dims_causal(family, dtype, hdim):
    """59 (the API pads to 64: the padded columns of O and dO are zeros), 200 (a head dim past
    128: two groups of 16-byte chunks per thread, and not a multiple of 32), fp16."""
    run_case(family, problem(dtype, True, hdim, (113, 301), "mqa"))


def test_varlen_once():
    from test_varlen_gpu import LENS, check_varlen

    check_varlen(*LENS, 6, 2, 64, "bf16", True, what="varlen d64 causal gqa: ")


def _strided(dout):
    """The same values as dout, in a tensor whose row stride is not whole 16-byte chunks: the
    preprocess takes its any-strides path and copies dout for the main kernel."""
    import torch

    b, s, h, d = dout.shape
    wide = torch.empty(b, s, h, d + 3, dtype=dout.dtype, device=dout.device)
    wide[..., :d] = dout
    out = wide[..., :d]
    assert out.stride(2) % 8 and torch.equal(out, dout)
    return out


@pytest.mark.parametrize("family,hdim", DET_CASES)
def test_deterministic_bitwise_both_paths(family, hdim):
    """deterministic=True: the same gradients to the bit run after run, and with dout read by
    the 16-byte path or by the any-strides path (so both paths give D to the bit)."""
    import torch

    p = problem("bf16", True, hdim, (1023, 1100), "gqa", deterministic=True)
    cfg, (q, k, v, dout), first = run_case(family, p)
    assert cfg.deterministic
    fn = lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=True, deterministic=True,  # noqa: E731
                                                 bwd_config=cfg)
    for d_in in (dout, _strided(dout), dout):
        _, g = grads(fn, q, k, v, d_in)
        for name, a, b in zip(("dq", "dk", "dv"), first, g):
            assert torch.equal(a, b), f"{name}: deterministic backward differs (dout strides {d_in.stride()})"


def suite_problems():
    """(family, problem) of every backward the tests above run (varlen aside), and the timing
    script's shapes (family None: what selection picks)."""
    out = []
    for family in FAMILIES:
        for hdim in (64, 128):
            out += [(family, problem("bf16", False, hdim, s, "gqa" if s[0] % 2 else "mha")) for s in SEQLENS]
        out += [(family, problem(dtype, True, hdim, (113, 301), "mqa")) for dtype, hdim in ODD_HEAD_DIMS]
    out += [(family, problem("bf16", True, hdim, (1023, 1100), "gqa", deterministic=True))
            for family, hdim in DET_CASES]
    for d in (64, 128):
        for s in (2048, 16384):
            out += [(None, Problem("bwd", "bf16", 16384 // s, s, s, 2048 // d, 2048 // d, d, c))
                    for c in (False, True)]
    return out


def suite_configs():
    """The kernels of suite_problems: each backward and the forward selection picks for it."""
    from cuflash import _gpu, select

    arch, smem, name = _gpu.arch(), _gpu.max_smem(), _gpu.name()
    out = []
    for family, p in suite_problems():
        p = p.replace(head_dim=-(-p.head_dim // 8) * 8)
        if family is None:
            out.append(select.choose(p, arch, name, smem)[1])
        else:
            fam = registry.get(family)
            if not fam.supports(arch, p):
                out.append(fam.for_problem(fam.heuristic(p, arch, smem), p))
        out.append(select.choose(p.replace(op="fwd", deterministic=False), arch, name, smem)[1])
    # sm90_bwd's store paths in other kernels (tests/test_sm90_bwd_sched_gpu.py, the feature
    # tests): dq_writer / overlap_sdp alone and together, softcap (the lane's stmatrix address
    # recomputed), window + softcap + ALiBi with dq_writer, dropout (16-bit dS stores)
    fam = registry.get("sm90_bwd")
    for d in (64, 128):
        for causal in (False, True):
            p = problem("bf16", causal, d, (333, 301))
            base = fam.heuristic(p, arch, smem).replace(dq_writer=False, overlap_sdp=False)
            for change in ({}, {"dq_writer": True}, {"overlap_sdp": True}, {"overlap_sdp": True, "dq_writer": True},
                           {"softcap": True}, {"window": True, "softcap": True, "alibi": True, "dq_writer": True},
                           {"dropout": True}):
                cfg = base.replace(**change)
                if not cfg.problems(smem):
                    out.append(cfg)
    return list(dict.fromkeys(out))


if __name__ == "__main__" and "--precompile" in __import__("sys").argv:
    import os
    import sys
    import time

    sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    from cuflash.compile import precompile

    t0 = time.time()
    configs = suite_configs()
    res = precompile(configs)
    for c, secs, err in res:
        print(f"{c.name:<60} {secs:6.1f} s {err[:300] if err else 'ok'}")
    print(f"{len(configs)} kernels in {time.time() - t0:.0f} s; errors: {sum(bool(e) for _, _, e in res)}")
    sys.exit(1 if any(e for _, _, e in res) else 0)
