"""Issue 12's short-sequence kernels on an H100 / H200 (tests/short_seq_timing.py times them):

* sm90_bwd's head-dim-64 kernels with wide_epi (the 16-byte dK / dV epilogue stores; the heuristic's tile,
  dynamic scheduler, dq_first where it covers): odd lengths 1, 17, 113, 197, 257 and s_q != s_k both ways,
  causal or not, bf16 and fp16; a GQA call (the kernel's run-time check keeps the 4-byte stores) and a real
  head dim below 64 (40: the lanes' 8-column groups past it not stored);
* sm90_fwd's head-dim-64 tile with the K/V block widths of short keys (SHORT_BNS: BN 112 .. 176 beside the
  default 192), on the same lengths;
* the default route's head-dim-64 forward (session 31's short-call schedule: tma_store, causal BN 128 + q_double)
  on those lengths, GPT-2's 128 .. 1024 and calls with more Q tiles than SMs.

The 3x gradient rule / 2x output rule against float64 (test_flash_bwd_gpu.check_grads, test_flash_fwd_gpu.
check_forward), outputs poisoned (NaN) before each launch, fresh random inputs.
"""
import math
import os
import sys

if __name__ == "__main__":   # --precompile: cuflash and the tests' helpers from this checkout
    sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import pytest  # noqa: E402

import cuflash  # noqa: E402
from cuflash import registry  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

from test_flash_fwd_gpu import check_forward, inputs as fwd_inputs  # noqa: E402
from test_sm90_bwd_gpu import HEADS, problem, run_case  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

SEQLENS = [(1, 1), (17, 17), (113, 113), (197, 197), (257, 257), (113, 301), (301, 113)]
SHORT_BNS = (112, 128, 144, 160, 176)
GPT_SEQLENS = [(128, 128), (256, 256), (512, 512), (1024, 1024)]
MANY_TILES = [(24, 197, 197), (8, 1024, 1024)]   # (batch, seqlen_q, seqlen_k) at 12 heads: 576 / 768 Q tiles of 128
BWD = registry.get("sm90_bwd")
FWD = registry.get("sm90_fwd")


def _cc():
    import torch

    cc = tuple(torch.cuda.get_device_capability())
    if cc != (9, 0):
        pytest.skip("sm_90 only")
    return cc


def wide_d64(p):
    """The heuristic's head-dim-64 backward for p with wide_epi, as the call runs it."""
    cfg = BWD.for_problem(BWD.heuristic(p, (9, 0)), p).replace(wide_epi=True)
    assert not cfg.problems() and BWD.for_problem(cfg, p) == cfg, (cfg.name, cfg.problems())
    return cfg


def fwd_bn(p, bn):
    """The heuristic's head-dim-64 forward for p with K/V blocks of bn keys."""
    cfg = FWD.for_problem(FWD.heuristic(p, (9, 0)), p).replace(BN=bn)
    assert not cfg.problems() and FWD.for_problem(cfg, p) == cfg, (cfg.name, cfg.problems())
    return cfg


@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_wide_epi_d64(dtype, causal, seqlens):
    _cc()
    p = problem(dtype, causal, 64, seqlens, batch=3)
    run_case(p, wide_d64(p))


@pytest.mark.parametrize("hdim,heads", [(64, "gqa"), (40, "mha")])
def test_wide_epi_d64_gqa_and_small_head_dim(hdim, heads):
    _cc()
    p = problem("bf16", False, hdim, (197, 197), heads, batch=3)
    run_case(p, wide_d64(p))


def test_wide_epi_d64_many_tiles():
    """More K/V tiles than SMs (the dynamic scheduler's claims carry across tiles), at the ViT length."""
    _cc()
    p = Problem("bwd", "bf16", 24, 197, 197, 12, 12, 64, False)
    run_case(p, wide_d64(p))


@pytest.mark.parametrize("bn", SHORT_BNS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_forward_short_bn(dtype, causal, bn):
    _cc()
    for i, (sq, sk) in enumerate(SEQLENS + [(577, 577), (512, 512)]):
        h, hk = list(HEADS.values())[i % 3]
        p = Problem("fwd", dtype, 3, sq, sk, h, hk, 64, causal)
        cfg = fwd_bn(p, bn)
        q, k, v = fwd_inputs(p)
        out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, config=cfg)
        check_forward(out, lse, q, k, v, causal, 1 / math.sqrt(64), f"{cfg.name} {sq}x{sk}: ")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_forward_short_default(dtype, causal):
    """The default route's head-dim-64 forward (the heuristic's short-call schedule, session 31) on odd lengths,
    GPT-2's 128..1024, calls with more tiles than SMs (the persistent CTAs' tile-to-tile hand-over) and a real head
    dim of 40 (the d64 kernel: O's TMA store clipped at the row's end)."""
    _cc()
    cases = [(3, *s, 64) for s in SEQLENS + GPT_SEQLENS] + [(*c, 64) for c in MANY_TILES]
    cases += [(3, 197, 197, 40), (3, 300, 300, 40)]
    for i, (b, sq, sk, d) in enumerate(cases):
        h, hk = (12, 12) if b > 3 else list(HEADS.values())[i % 3]
        p = Problem("fwd", dtype, b, sq, sk, h, hk, d, causal)
        q, k, v = fwd_inputs(p)
        out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        check_forward(out, lse, q, k, v, causal, 1 / math.sqrt(d), f"default {dtype} {b}x{sq}x{sk} d{d}: ")


def configs(forward_bns=True):
    """Every kernel the tests above run (for cuflash.compile.precompile), with the forwards of the backward
    tests' calls and the backwards without wide_epi (tests/short_seq_sanitize.py's references); forward_bns=False
    (--default-only): without test_forward_short_bn's."""
    from cuflash import _gpu, select

    out = []
    for dtype in ("bf16", "fp16"):
        for causal in (False, True):
            for s in SEQLENS:
                p = problem(dtype, causal, 64, s, batch=3)
                out += [wide_d64(p), wide_d64(p).replace(wide_epi=False),
                        select.choose(p.replace(op="fwd"), _gpu.arch(), _gpu.name(), _gpu.max_smem())[1]]
                for bn in SHORT_BNS if forward_bns else ():
                    out.append(fwd_bn(p.replace(op="fwd"), bn))
            for b, sq, sk in [(3, *s) for s in GPT_SEQLENS] + MANY_TILES:
                pf = Problem("fwd", dtype, b, sq, sk, 12, 12, 64, causal)
                out.append(select.choose(pf, _gpu.arch(), _gpu.name(), _gpu.max_smem())[1])
    for hdim, heads in ((64, "gqa"), (40, "mha")):
        out.append(wide_d64(problem("bf16", False, hdim, (197, 197), heads, batch=3)))
    out.append(wide_d64(Problem("bwd", "bf16", 24, 197, 197, 12, 12, 64, False)))
    return list(dict.fromkeys(out))


if __name__ == "__main__" and "--precompile" in sys.argv:
    from cuflash.compile import precompile

    todo = configs(forward_bns="--default-only" not in sys.argv)
    errors = [(c.name, e) for c, _, e in precompile(todo) if e]
    print(f"{len(todo)} kernels, {len(errors)} errors", errors[:3])
