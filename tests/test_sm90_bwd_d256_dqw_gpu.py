"""sm90_bwd's head-dim-256 tile with dq_writer (dQ staged in the Q/dO ring slot) and the lpt
launch order, on an H100 (issue 14; tests/test_sm90_bwd_d256_cpu.py has the rules and ptxas checks).

dq_writer at d256: no staging tile fits next to the tile's 217 KB, so each consumer warpgroup
stores its dQ_i part (64 rows x 128 fp32, four 32-column boxes, 128-byte swizzle) into the column
chunks of Q_i, dO_i that only its own dV, dK read (kernels_cu/sm90_bwd.cu Sm90BwdSlotDqStage),
once they are done; the writer warp adds the 8 boxes by tensor bulk reduce-adds (map tma_dq) and
then releases the slot (q_empty, one arrival) to the producer. lpt: the longest-first launch order
of causal calls (K/V block 0 of a group of pairs first).

Cases: seqlens 1, 17, 113, 1023, 2049, s_q != s_k both ways, MHA / GQA / MQA in turn, causal (with
lpt) and not, bf16; fp16 GQA / MQA at d256 and d192; lpt alone (red.add) causal; dropout, and
window + softcap + ALiBi, with the d256 switches on (the heuristic then adds dq_writer and lpt).
Errors: the 3x gradient rule against float64, outputs poisoned (NaN) before each launch.

cluster: the d256 tile in clusters of 2 CTAs (kCluster), odd seqlens (a CTA past seqlen_k),
causal (one hidden Q block more), GQA / MQA, fp16, d192, with dq_writer and with red.add.

Compiles: 10 backward kernels and their forwards (python tests/test_sm90_bwd_d256_dqw_gpu.py
--precompile compiles them all in parallel first).

Run: CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q -x tests/test_sm90_bwd_d256_dqw_gpu.py
"""
import os
import sys

if __name__ == "__main__":   # --precompile: cuflash and the tests' helpers from this checkout
    sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import pytest  # noqa: E402

from cuflash.families import sm90_bwd  # noqa: E402
from cuflash.families.sm90_bwd import Sm90BwdConfig  # noqa: E402

import test_sm90_bwd_features_gpu as feat  # noqa: E402
from test_sm90_bwd_d256_gpu import FP16_D192_CASES, forward_problems, precompile_main, tile  # noqa: E402,F401
from test_sm90_bwd_gpu import HEADS, SEQLENS, problem, run_case  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

D = 256


@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dq_writer_odd_seqlens(causal, seqlens):
    heads = list(HEADS)[SEQLENS.index(seqlens) % len(HEADS)]   # MHA, GQA, MQA in turn
    p = problem("bf16", causal, D, seqlens, heads)
    run_case(p, tile(p, dq_writer=True, lpt=causal))


def test_dq_writer_fp16_and_d192():
    for d, heads, seqlens in FP16_D192_CASES:
        p = problem("fp16", True, d, seqlens, heads)
        run_case(p, tile(p, dq_writer=True, lpt=True))


def test_lpt_alone():
    """The lpt order with the consumers' red.add (causal; a grid of several pairs and K/V blocks)."""
    for heads, seqlens in (("mha", (2049, 2049)), ("gqa", (1023, 1100)), ("mqa", (301, 113))):
        p = problem("bf16", True, D, seqlens, heads)
        run_case(p, tile(p, lpt=True))


@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cluster_odd_seqlens(causal, seqlens):
    """cluster (2 CTAs on K/V blocks 2c, 2c + 1 sharing the Q/dO loads by multicast) with dq_writer:
    an odd K/V-block count (seqlen_k 1, 17, 113 -> 1, 1, 2 blocks; 2049 -> 33) gives a CTA past
    seqlen_k; under the causal mask the odd CTA runs one hidden Q block more."""
    heads = list(HEADS)[SEQLENS.index(seqlens) % len(HEADS)]
    p = problem("bf16", causal, D, seqlens, heads)
    run_case(p, tile(p, dq_writer=True, cluster=True))


def test_cluster_fp16_d192_and_red_add():
    for d, heads, seqlens in ((D, "gqa", (300, 333)), (192, "mqa", (1023, 257)), (D, "mha", (2049, 2049))):
        p = problem("fp16", True, d, seqlens, heads)
        run_case(p, tile(p, dq_writer=True, cluster=True))
    for heads, seqlens in (("mha", (2049, 2049)), ("gqa", (113, 301))):   # the consumers' red.add
        p = problem("bf16", True, D, seqlens, heads)
        run_case(p, tile(p, cluster=True))


@pytest.fixture
def d256_switches(monkeypatch):
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_D256_DQ_WRITER", True)
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_D256_LPT", True)


def test_dropout_dq_writer(d256_switches):
    assert feat.sm90_config("bf16", D, True).dq_writer
    feat.test_dropout(D, True, False)


def test_window_softcap_alibi_dq_writer(d256_switches):
    assert feat.sm90_config("bf16", D, False).dq_writer
    for window in feat.WINDOWS[:3]:
        feat.check_case("bf16", D, False, window, 10.0, "bh", feat.SHAPES[2:5])


def suite_configs():
    """The backward kernels this file runs (as the calls run them), for --precompile."""
    base = Sm90BwdConfig(64, 64, 2, 2, D, "bf16", False, dq_writer=True)
    return [base, base.replace(causal=True, lpt=True), base.replace(dtype="fp16", causal=True, lpt=True),
            base.replace(causal=True, lpt=True, dq_writer=False),
            base.replace(causal=True, lpt=True, dropout=True),
            base.replace(window=True, softcap=True, alibi=True),
            base.replace(cluster=True), base.replace(causal=True, cluster=True),
            base.replace(dtype="fp16", causal=True, cluster=True), base.replace(causal=True, dq_writer=False, cluster=True)]


if __name__ == "__main__" and "--precompile" in sys.argv:
    # (forward_problems: test_sm90_bwd_d256_gpu's, which cover this file's forwards)
    sys.exit(precompile_main(suite_configs()))
