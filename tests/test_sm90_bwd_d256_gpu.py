"""sm90_bwd's head-dim-256 tile on an H100 (issue 14), forced with bwd_config=
(tests/test_sm90_bwd_d256_cpu.py has its rules and ptxas checks).

The tile: BM 64, BN 64, 2 consumer warpgroups sharing the K/V block's 64 keys (kSharedKeys):
each computes Sᵀ, dPᵀ for 32 of the 64 queries (wgmma m64n32k16), stores its Pᵀ, dSᵀ (keys x
queries, stmatrix) and dS (queries x keys, stmatrix.trans) to shared memory, then dV_j, dK_j for
its 128 of the 256 columns (SS, both warpgroups reading all of Pᵀ, dSᵀ) and dQ_i's 128 columns in
two 64-column pieces, added by red.add (ordered when deterministic). Head dim 192 runs the d256
kernel with zero-filled columns (TMA boxes 3 entirely past the head dim).

Cases: seqlens 1, 17, 113, 1023, 2049, s_q != s_k both ways, MHA / GQA / MQA in turn, causal and
not (bf16); fp16 GQA / MQA at d256 and d192; deterministic bitwise over 3 runs; window + softcap
+ ALiBi together (several windows); dropout (causal). Errors: the 3x gradient rule against
float64, outputs poisoned (NaN) before each launch.

Compiles: 6 backward kernels and their forwards (python tests/test_sm90_bwd_d256_gpu.py
--precompile compiles them all in parallel first).

Run first: CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q -x tests/test_sm90_bwd_d256_gpu.py
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
from cuflash.families import sm90_bwd  # noqa: E402
from cuflash.families.sm90_bwd import Sm90BwdConfig  # noqa: E402

import test_sm90_bwd_features_gpu as feat  # noqa: E402
from test_flash_bwd_gpu import check_grads, grads, inputs, reference_grads  # noqa: E402
from test_sm90_bwd_gpu import HEADS, SEQLENS, problem, run_case  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

FAM = registry.get("sm90_bwd")
D = 256


def tile(p, **flags):
    """The d256 tile for problem p (head dim <= 256) with `flags`, as the call runs it (for_problem
    must keep it)."""
    import torch

    if tuple(torch.cuda.get_device_capability()) != (9, 0):
        pytest.skip("sm_90 only")
    cfg = Sm90BwdConfig(64, 64, 2, 2, D, p.dtype, p.causal, p.deterministic, **flags)
    run = FAM.for_problem(cfg, p)
    assert run == cfg and run.problems() == [], (run.name, run.problems())
    return cfg


@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_odd_seqlens(causal, seqlens):
    heads = list(HEADS)[SEQLENS.index(seqlens) % len(HEADS)]   # MHA, GQA, MQA in turn
    p = problem("bf16", causal, D, seqlens, heads)
    run_case(p, tile(p))


def test_fp16_gqa_mqa():
    for heads, seqlens in (("gqa", (300, 333)), ("mqa", (1023, 257))):
        p = problem("fp16", True, D, seqlens, heads)
        run_case(p, tile(p))


def test_deterministic_bitwise():
    import torch

    p = problem("bf16", True, D, (1023, 1100), "gqa", deterministic=True)
    cfg = tile(p)
    q, k, v, dout = inputs(p)
    first = None
    for _ in range(3):
        _, g = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=True, deterministic=True,
                                                             bwd_config=cfg), q, k, v, dout)
        if first is None:
            first = g
            ref, low = reference_grads(q, k, v, dout, True, 1 / math.sqrt(D))
            check_grads(g, ref, low, what=f"{cfg.name} ")
        else:
            for a, b in zip(first, g):
                assert torch.equal(a, b), f"{cfg.name}: deterministic backward differs between runs"


def test_window_softcap_alibi():
    """The three score / mask flags in one kernel (its heuristic config at d256: the call sets the
    flags), non-causal, over several windows, then a shape set with softcap and ALiBi alone."""
    for window in feat.WINDOWS[:4]:
        feat.check_case("bf16", D, False, window, 10.0, "bh", feat.SHAPES[2:5])
    feat.check_case("bf16", D, False, (300, 30), 20.0, "h", feat.SHAPES[::2])


def test_dropout():
    feat.test_dropout(D, True, False)


# head dim 192 last: the d256 kernel with TMA boxes entirely past the head dim (columns 192..255,
# zero-filled; their bytes count toward the ring's mbarrier): a hang here leaves the rest run

def test_d192_fp16_gqa_mqa():
    for heads, seqlens in (("gqa", (300, 333)), ("mqa", (1023, 257))):
        p = problem("fp16", True, 192, seqlens, heads)
        run_case(p, tile(p))


def test_d192_bf16_odd_seqlens():
    for i, seqlens in enumerate([(17, 17), (113, 301), (2049, 2049)]):
        p = problem("bf16", False, 192, seqlens, list(HEADS)[i % len(HEADS)])
        run_case(p, tile(p))


# fp16 at d256 and d192 (GQA / MQA, odd lengths): the cases the dq_writer and roles files share
FP16_D192_CASES = ((D, "gqa", (300, 333)), (D, "mqa", (1023, 257)), (192, "gqa", (2049, 2049)),
                   (192, "mqa", (113, 301)))


def suite_configs():
    """The backward kernels this file runs (as the calls run them), for --precompile."""
    base = Sm90BwdConfig(64, 64, 2, 2, D, "bf16", False)
    return [base, base.replace(causal=True), base.replace(dtype="fp16", causal=True),
            base.replace(causal=True, deterministic=True),
            # (the window / softcap / ALiBi and dropout tests run the heuristic: dq_writer while
            # HEURISTIC_D256_DQ_WRITER is on)
            base.replace(window=True, softcap=True, alibi=True, dq_writer=sm90_bwd.HEURISTIC_D256_DQ_WRITER),
            base.replace(causal=True, dropout=True, dq_writer=sm90_bwd.HEURISTIC_D256_DQ_WRITER)]


def forward_problems():
    """Forward problems whose kernels the tests' forwards pick (one per kernel they need)."""
    from cuflash.problem import Problem

    out = []
    for dtype, causal, d in (("bf16", False, 256), ("bf16", True, 256), ("fp16", True, 256),
                             ("fp16", True, 192), ("bf16", False, 192)):
        out.append(Problem("fwd", dtype, 2, 1023, 1023, 4, 2, d, causal))
    out.append(Problem("fwd", "bf16", 2, 1023, 1023, 4, 2, D, False, features=("alibi", "softcap", "window"),
                       window=(300, 30), softcap=20.0))
    out.append(Problem("fwd", "bf16", 2, 1023, 1023, 4, 2, D, True, features=("dropout",), dropout_p=0.17))
    return out


def precompile_main(configs, forwards=True) -> int:
    """Compile ``configs`` (and with `forwards` the forwards of forward_problems()) in parallel worker
    processes (the --precompile entry of this file, test_sm90_bwd_d256_dqw_gpu.py and
    test_sm90_bwd_d256_dyn_gpu.py); prints one line per kernel, returns the exit code."""
    import time

    from cuflash import _gpu, select
    from cuflash.compile import precompile

    t0 = time.time()
    assert all(c.problems() == [] for c in configs), [c.name for c in configs if c.problems()]
    arch, smem, name = _gpu.arch(), _gpu.max_smem(), _gpu.name()
    for fp in forward_problems() if forwards else ():
        try:
            configs.append(select.choose(fp, arch, name, smem)[1])
        except ValueError as e:
            print(f"forward {fp}: {e}")
    configs = list(dict.fromkeys(configs))
    res = precompile(configs)
    for c, secs, err in res:
        print(f"{c.name:<60} {secs:6.1f} s {err[:300] if err else 'ok'}")
    print(f"{len(configs)} kernels in {time.time() - t0:.0f} s; errors: {sum(bool(e) for _, _, e in res)}")
    return 1 if any(e for _, _, e in res) else 0


if __name__ == "__main__" and "--precompile" in sys.argv:
    sys.exit(precompile_main(suite_configs()))
