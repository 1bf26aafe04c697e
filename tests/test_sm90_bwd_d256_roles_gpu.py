"""sm90_bwd's head-dim-256 tile with roles (kRoles) on an H100 (issue 14; tests/test_sm90_bwd_d256_cpu.py
has its rules and ptxas checks).

roles: the consumer warpgroups split the products by operand: warpgroup 0 computes Sᵀ = K_j Q_iᵀ for
all 64 queries (wgmma m64n64), Pᵀ, and dV_j += Pᵀ dO_i for all 256 columns (RS: Pᵀ from registers);
warpgroup 1 computes dPᵀ = V_j dO_iᵀ, reads Pᵀ from warpgroup 0 through shared memory (16 words per
thread, thread c's to thread c), dSᵀ, dK_j += dSᵀ Q_i (RS) and stores dS (transposed); both compute
dQ_i's part for their 128 columns, staged in the ring slot for the writer warp (dq_writer: warpgroup
0's boxes in dO_i's chunks, warpgroup 1's in Q_i's).

Cases: seqlens 1, 17, 113, 1023, 2049, s_q != s_k both ways, MHA / GQA / MQA in turn, causal and not
(bf16); fp16 GQA / MQA at d256 and d192; the 2-CTA cluster (odd K/V-block counts, causal). Errors:
the 3x gradient rule against float64, outputs poisoned (NaN) before each launch; repeated calls give
bitwise equal dK, dV (their sums are per CTA, in a fixed order).

Compiles: 5 backward kernels and their forwards (python tests/test_sm90_bwd_d256_roles_gpu.py
--precompile compiles them all in parallel first).

Run: CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q -x tests/test_sm90_bwd_d256_roles_gpu.py
"""
import os
import sys

if __name__ == "__main__":   # --precompile: cuflash and the tests' helpers from this checkout
    sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import pytest  # noqa: E402

import cuflash  # noqa: E402
from cuflash.families.sm90_bwd import Sm90BwdConfig  # noqa: E402

from test_flash_bwd_gpu import grads, inputs  # noqa: E402
from test_sm90_bwd_d256_gpu import FP16_D192_CASES, precompile_main, tile  # noqa: E402
from test_sm90_bwd_gpu import HEADS, SEQLENS, problem, run_case  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

D = 256


@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_roles_odd_seqlens(causal, seqlens):
    heads = list(HEADS)[SEQLENS.index(seqlens) % len(HEADS)]   # MHA, GQA, MQA in turn
    p = problem("bf16", causal, D, seqlens, heads)
    run_case(p, tile(p, dq_writer=True, roles=True))


def test_roles_fp16_and_d192():
    for d, heads, seqlens in FP16_D192_CASES:
        p = problem("fp16", True, d, seqlens, heads)
        run_case(p, tile(p, dq_writer=True, roles=True))


def test_roles_cluster():
    """With the 2-CTA cluster: odd K/V-block counts (a CTA past seqlen_k), causal and not."""
    for causal, heads, seqlens in ((False, "mha", (113, 113)), (True, "gqa", (1023, 1100)), (True, "mqa", (301, 113)),
                                   (False, "gqa", (2049, 2049))):
        p = problem("bf16", causal, D, seqlens, heads)
        run_case(p, tile(p, dq_writer=True, roles=True, cluster=True))


def test_roles_dkv_repeatable():
    """dK, dV bitwise equal over 3 calls (per-CTA sums in a fixed order; dQ's additions are unordered)."""
    p = problem("bf16", True, D, (1023, 1100), "gqa")
    assert_dkv_repeatable(p, tile(p, dq_writer=True, roles=True))


def assert_dkv_repeatable(p, cfg):
    """dK, dV of 3 calls of config cfg on problem p (causal) bitwise equal."""
    import torch

    q, k, v, dout = inputs(p)
    first = None
    for _ in range(3):
        _, g = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=True, bwd_config=cfg), q, k, v, dout)
        if first is None:
            first = g
        else:
            assert torch.equal(first[1], g[1]) and torch.equal(first[2], g[2]), cfg.name


def suite_configs():
    """The backward kernels this file runs (as the calls run them), for --precompile."""
    base = Sm90BwdConfig(64, 64, 2, 2, D, "bf16", False, dq_writer=True, roles=True)
    return [base, base.replace(causal=True), base.replace(dtype="fp16", causal=True),
            base.replace(cluster=True), base.replace(causal=True, cluster=True)]


if __name__ == "__main__" and "--precompile" in sys.argv:
    sys.exit(precompile_main(suite_configs()))
