"""sm90_bwd's launch order on an H100, forced with bwd_config= (issue 14, the causal and short
backward):

* lpt (kLpt): K/V block 0 of a group of (head, batch) pairs first, then block 1, ... (fa2_bwd's
  grouped order; longest CTAs first under the causal mask).

The heuristic's causal kernel with the flag (lpt is causal only) on the odd shapes of
test_sm90_bwd_gpu.py (seqlens 1, 17, 113, 1023, 2049, s_q != s_k both ways; MHA / GQA / MQA in
turn), head dims 64 and 128;
groups that do not divide the pairs (CUFLASH_BWD_HEAD_GROUP=3 over 2 x 4 pairs: 3, 3, 2); a
deterministic call (its turns need K/V block n - 1 launched before block n: bitwise reproducible).
Errors: the 3x gradient rule against float64, outputs poisoned (NaN) before each launch.

Compiles: 4 backward kernels and their forwards.

Run first: CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q -x tests/test_sm90_bwd_causal_gpu.py
"""
import math

import pytest

import cuflash
from cuflash import registry

from test_flash_bwd_gpu import check_grads, grads, inputs, reference_grads  # noqa: E402
from test_sm90_bwd_gpu import HEADS, SEQLENS, heuristic, problem, run_case  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

FAM = registry.get("sm90_bwd")
SHAPES = [(1, 1), (17, 17), (113, 113), (1023, 1023), (2049, 2049), (113, 301), (301, 113)]


def with_flags(p, **flags):
    """The heuristic's config of the call class with `flags`, as the call runs it."""
    cfg = FAM.for_problem(heuristic(p).replace(**flags), p)
    assert all(getattr(cfg, k) == v for k, v in flags.items()) and cfg.problems() == [], cfg.name
    return cfg


@pytest.mark.parametrize("seqlens", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("hdim", [64, 128])
def test_lpt_odd_seqlens(hdim, seqlens):
    heads = list(HEADS)[SEQLENS.index(seqlens) % len(HEADS)]   # MHA, GQA, MQA in turn
    p = problem("bf16", True, hdim, seqlens, heads)
    run_case(p, with_flags(p, lpt=True))


def test_lpt_partial_groups(monkeypatch):
    """Groups of 3 pairs over 2 x 4 (3, 3, 2: the last one narrower), GQA, causal, d128."""
    monkeypatch.setenv("CUFLASH_BWD_HEAD_GROUP", "3")
    p = problem("bf16", True, 128, (1000, 1000), "gqa")   # a shape of its own: a fresh plan
    run_case(p, with_flags(p, lpt=True))


def test_lpt_deterministic_bitwise():
    import torch

    p = problem("bf16", True, 128, (1023, 1100), "gqa", deterministic=True)
    cfg = with_flags(p, lpt=True)
    assert cfg.deterministic
    q, k, v, dout = inputs(p)
    first = None
    for _ in range(3):
        _, g = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=True, deterministic=True,
                                                             bwd_config=cfg), q, k, v, dout)
        if first is None:
            first = g
            ref, low = reference_grads(q, k, v, dout, True, 1 / math.sqrt(128))
            check_grads(g, ref, low)
        else:
            for a, b in zip(first, g):
                assert torch.equal(a, b), "deterministic backward differs between runs"
