"""sm90_bwd (Hopper backward, wgmma + TMA) on an H100, forced with bwd_config=.

The registry-driven tests (test_flash_bwd_gpu.py: the grid, every point of the space,
deterministic mode) cover this family too; these add the odd shapes the family's index
arithmetic must survive, per config of its space: seqlens 1, 17, 113, 1023, 2049, s_q != s_k
both ways, causal, GQA / MQA, head dims 64 and 128 (and a smaller real head dim, zero-filled by
TMA), bf16 / fp16, a dout that TMA cannot read in place (the preprocess's copy), and bitwise
reproducible deterministic mode. Errors: the 3x gradient rule against float64 (check_grads).

Run first: CUDA_LAUNCH_BLOCKING=1 timeout 300 python tests/sm90_bwd_check.py --quick
"""
import math

import pytest

import cuflash
from cuflash import registry
from cuflash.problem import Problem

from conftest import torch_dtype  # noqa: E402
from test_flash_bwd_gpu import check_grads, grads, inputs, reference_grads  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

FAM = registry.get("sm90_bwd")

SEQLENS = [(1, 1), (17, 17), (113, 113), (1023, 1023), (2049, 2049), (113, 301), (301, 113), (1, 257), (257, 1)]
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


def problem(dtype, causal, hdim, seqlens, heads="mha", batch=2, deterministic=False):
    (sq, sk), (h, hkv) = seqlens, HEADS[heads]
    return Problem("bwd", dtype, batch, sq, sk, h, hkv, hdim, causal, deterministic)


def heuristic(p):
    import torch

    cc = torch.cuda.get_device_capability()
    why = FAM.supports(cc, p)
    if why:
        pytest.skip(why)
    return FAM.for_problem(FAM.heuristic(p, cc), p)


def run_case(p, cfg=None):
    cfg = cfg or heuristic(p)
    q, k, v, dout = inputs(p)
    _, ours = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=p.causal, bwd_config=cfg),
                    q, k, v, dout)
    ref, low = reference_grads(q, k, v, dout, p.causal, 1 / math.sqrt(p.head_dim))
    check_grads(ours, ref, low, what=f"{cfg.name} ")


@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", [64, 128])
def test_odd_seqlens(hdim, causal, seqlens):
    run_case(problem("bf16", causal, hdim, seqlens))


@pytest.mark.parametrize("heads", ["gqa", "mqa"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("hdim", [64, 128])
def test_gqa_mqa(hdim, dtype, heads):
    run_case(problem(dtype, True, hdim, (300, 333), heads))


@pytest.mark.parametrize("hdim", [40, 96, 120])
def test_smaller_real_head_dims(hdim):
    """Real head dims below the kernel's (64 or 128): TMA zero-fills the missing columns."""
    run_case(problem("fp16", False, hdim, (200, 190), "gqa"))


# wide_epi (session 20: the epilogue's 16-byte dK / dV stores, quad_transpose; MHA with 16-byte aligned dk, dv),
# forced on the heuristic's kernels: real head dims below the kernel's (a lane's 8-column group past head_dim is
# not stored), keys past seqlen_k in the last K/V block, both dtypes, causal or not, the dynamic / plain grid /
# roles tiles; a GQA row keeps the 4-byte fp32 stores (the runtime check)
WIDE = [(40, "bf16", False, "mha"), (72, "fp16", True, "mha"), (120, "fp16", False, "mha"),
        (160, "bf16", True, "mha"), (192, "fp16", False, "mha"), (256, "bf16", True, "mha"),
        (128, "bf16", False, "mha"), (128, "bf16", True, "mha"), (128, "fp16", True, "gqa")]


def wide_case(hdim, dtype, causal, heads):
    p = problem(dtype, causal, hdim, (200, 190) if not causal else (190, 200), heads)
    cfg = heuristic(p).replace(wide_epi=True)
    assert not cfg.problems(), cfg.problems()
    return p, cfg


@pytest.mark.parametrize("hdim,dtype,causal,heads", WIDE, ids=lambda x: str(x))
def test_wide_epilogue(hdim, dtype, causal, heads):
    run_case(*wide_case(hdim, dtype, causal, heads))


def wide_configs():
    """The kernels test_wide_epilogue runs, and the forwards selection picks there (for
    cuflash.compile.precompile)."""
    from cuflash import _gpu, select

    out = []
    for row in WIDE:
        p, cfg = wide_case(*row)
        out += [cfg, select.choose(p.replace(op="fwd"), _gpu.arch(), _gpu.name(), _gpu.max_smem())[1]]
    return list(dict.fromkeys(out))


def _space():
    out = []
    for d in (64, 128):
        for causal in (False, True):
            p = problem("bf16", causal, d, (333, 301), "gqa", batch=1)
            out += [pytest.param(p, c, id=c.name) for c in FAM.valid(p, 227 * 1024)]
    return out


@pytest.mark.parametrize("p,cfg", _space())
def test_every_point_of_the_space(p, cfg):
    run_case(p, cfg)


@pytest.mark.parametrize("hdim", [64, 128])
def test_dout_copy(hdim):
    """A dout with a non-contiguous head dim: the preprocess copies it, TMA reads the copy."""
    import torch

    p = problem("bf16", True, hdim, (257, 257), "gqa")
    cfg = heuristic(p)
    q, k, v, dout = inputs(p)
    dout_t = dout.transpose(-1, -2).contiguous().transpose(-1, -2)   # head dim stride != 1
    assert dout_t.stride(-1) != 1
    _, ours = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=True, bwd_config=cfg),
                    q, k, v, dout_t)
    ref, low = reference_grads(q, k, v, dout, True, 1 / math.sqrt(hdim))
    check_grads(ours, ref, low)
    assert torch.equal(dout_t, dout)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", [64, 128])
def test_deterministic_bitwise(hdim, causal):
    import torch

    p = problem("bf16", causal, hdim, (1023, 1100), "gqa", deterministic=True)
    cfg = heuristic(p)
    assert cfg.deterministic
    q, k, v, dout = inputs(p)
    first = None
    for _ in range(10):
        _, g = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=causal, deterministic=True,
                                                             bwd_config=cfg), q, k, v, dout)
        if first is None:
            first = g
            ref, low = reference_grads(q, k, v, dout, causal, 1 / math.sqrt(hdim))
            check_grads(g, ref, low)
        else:
            for a, b in zip(first, g):
                assert torch.equal(a, b), "deterministic backward differs between runs"


def test_dtype_of_the_grads():
    import torch

    p = problem("fp16", False, 64, (64, 64))
    cfg = heuristic(p)
    q, k, v, dout = inputs(p)
    _, g = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, bwd_config=cfg), q, k, v, dout)
    assert all(x.dtype == torch_dtype("fp16") for x in g)
