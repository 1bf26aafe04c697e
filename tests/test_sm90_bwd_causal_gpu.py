"""sm90_bwd's launch order and scheduler on an H100, forced with bwd_config= (issue 14, the causal
and short backward):

* lpt (kLpt): K/V block 0 of a group of (head, batch) pairs first, then block 1, ... (fa2_bwd's
  grouped order; longest CTAs first under the causal mask);
* dynamic (kDynamic): a CTA per SM (at most one per tile) claiming tiles from a counter, the next
  tile's loads overlapping the last one's epilogue; with lpt under the causal mask;
* ds_double (kDsDouble, d128): two dS buffers, no barrier before the dS stores.

The heuristic's causal kernel with lpt on the odd shapes of test_sm90_bwd_gpu.py (seqlens 1, 17,
113, 1023, 2049, s_q != s_k both ways; MHA / GQA / MQA in turn), head dims 64 and 128; groups
that do not divide the pairs (CUFLASH_BWD_HEAD_GROUP=3 over 2 x 4 pairs: 3, 3, 2); a deterministic
call (its turns need K/V block n - 1 launched before block n: bitwise reproducible). The dynamic
kernels (non-causal: dynamic; causal: dynamic + lpt) on the same shapes, head dims 64 and 128, and
at 128 with ds_double too; many tiles per CTA (2 x 8 heads x 33 K/V blocks, GQA, ds_double at
d128; a claim per tile, K/V reloaded per tile, the
tile ring's and the Q/dO ring's phases across tiles); the claim counter's reset: consecutive calls
give equal dk, dv bit for bit (dq: within the rule; its fp32 additions come in any order), and a
CUDA graph of flash_attn_backward captured after a first call replays on new inputs like an eager
call. Errors: the 3x gradient rule against float64, outputs poisoned (NaN) before each launch.

Compiles: 9 backward kernels and their forwards (tests/sm90_bwd_causal_precompile.py first).

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


# ---------------------------------------------------------------------------------------
# the dynamic scheduler

def dynamic_config(p, **flags):
    """The heuristic's kernel with the dynamic scheduler (and lpt under the causal mask)."""
    return with_flags(p, dynamic=True, lpt=bool(p.causal), **flags)


@pytest.mark.parametrize("seqlens", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim,ds2", [(64, False), (128, False), (128, True)], ids=["64", "128", "128-ds2"])
def test_dynamic_odd_seqlens(hdim, ds2, causal, seqlens):
    """ds2: with two dS buffers (ds_double, d128)."""
    heads = list(HEADS)[SEQLENS.index(seqlens) % len(HEADS)]   # MHA, GQA, MQA in turn
    p = problem("bf16", causal, hdim, seqlens, heads)
    run_case(p, dynamic_config(p, ds_double=True) if ds2 else dynamic_config(p))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", [64, 128])
def test_dynamic_many_tiles_per_cta(hdim, causal):
    """2 x 8 heads x 33 K/V blocks at d128 (s 4097: a ragged last block) = 528 tiles over 132 CTAs
    (d64: 1056 over 132)."""
    from cuflash.problem import Problem

    p = Problem("bwd", "bf16", 2, 4097, 4097, 8, 2, hdim, causal)
    run_case(p, dynamic_config(p, ds_double=hdim == 128))


def test_dynamic_counter_resets_and_cuda_graph():
    """Consecutive calls: dk, dv equal bit for bit, dq within the rule (a stale counter would skip
    tiles: NaN from the poisoning); a CUDA graph of flash_attn_backward captured after a first call
    (the plan and its zeroed counter exist) replays 3 times on new inputs, each equal to an eager
    call on them (dk, dv bit for bit, dq within 1e-2 of its scale: fp32 additions in any order)."""
    import torch

    p = problem("bf16", True, 128, (2049, 2049), "gqa", batch=3)
    cfg = dynamic_config(p)
    q, k, v, dout = inputs(p)
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    bwd = lambda: cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, config=cfg)  # noqa: E731
    first, second = bwd(), bwd()
    ref, low = reference_grads(q, k, v, dout, True, 1 / math.sqrt(128))
    for g in (first, second):
        check_grads(g, ref, low, what=f"{cfg.name} ")
    assert torch.equal(first[1], second[1]) and torch.equal(first[2], second[2])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm-up on the capture stream, as torch's graph docs ask
        bwd()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = bwd()
    for _ in range(3):
        for x in (q, k, v, dout):
            x.copy_(torch.randn_like(x))
        o2, l2, _ = cuflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        out.copy_(o2)
        lse.copy_(l2)
        for g in static:
            g.fill_(math.nan)
        graph.replay()
        eager = bwd()
        torch.cuda.synchronize()
        assert not any(g.isnan().any() for g in static), "graph replay left unwritten (NaN) gradients"
        assert torch.equal(static[1], eager[1]) and torch.equal(static[2], eager[2])
        dq_diff = (static[0].float() - eager[0].float()).abs().max() / eager[0].float().abs().max()
        assert dq_diff <= 1e-2, f"graph replay's dq differs from the eager call's by {dq_diff:.2e}"
