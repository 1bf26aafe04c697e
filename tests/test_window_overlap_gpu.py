"""A window's tile_overlap forward and dq_first backward (session 21, issue 12's window overhead), on an H100,
forced with config= / bwd_config=.

* sm90_fwd tile_overlap with a window (kTileOverlap with kWindow: the next tile's S_0 = Q' K'_0ᵀ issued behind
  the last P V), in its four schedules: persistent static or dynamic (the next tile taken from the ring behind
  the last P V), with and without the TMA-store epilogue, causal and not. Several tiles per CTA (batch 4 x 6
  heads x 17 Q blocks: 408 tiles on 132 SMs), odd lengths, s_q != s_k both ways, GQA. Where a tile would have
  no K/V block (causal with s_q > s_k, a narrow band off the keys) the plan drops tile_overlap
  (sm90_fwd.py for_bounds) and the call stays right.
* sm90_bwd dq_first with a window (the accumulator zeroed by the first K/V block to reach a Q block), on the
  window backward's heuristic config: odd shapes and bands, s_q != s_k both ways; dropped by for_bounds where a
  Q block gets no dQ part; 3 calls of one plan, dK / dV equal bit for bit to the kernel without dq_first.
* sm90_bwd wide_epi (16-byte dK / dV stores) and dq_convert (the dQ convert in the main kernel) with a window.

Errors vs the float64 reference within 2x (forward) / 3x (gradients) of plain attention with the same window
in the same low precision (test_features_gpu's rule), outputs NaN-poisoned before each launch.

Run first: CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q -x tests/test_window_overlap_gpu.py
"""

import pytest

import cuflash
from cuflash import registry
from cuflash.band import Band, every_q_block_has_keys, every_q_block_visited

from conftest import device_heuristic  # noqa: E402
from test_features_gpu import check_close, feature_attention, grads, inputs, problem_of  # noqa: E402
from test_features_opt_gpu import check_forward  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

FWD = registry.get("sm90_fwd")
BWD = registry.get("sm90_bwd")
# (causal, window): the band of each mask's kernels
BANDS = {True: [(256, 0), (1024, 0)], False: [(300, 129), (0, 0)]}
# (the backward's test also walks bands a side unbounded and narrower than a block)
BWD_BANDS = {True: [(256, 0), (17, 0)], False: [(300, 129), (0, 0), (-1, 37), (200, -1)]}
SHAPES = [(2049, 2049), (1500, 2049), (2049, 1500)]
SCHEDULES = {"dyn_tmao": dict(dynamic=True, tma_store=True), "dyn": dict(dynamic=True, tma_store=False),
             "static_tmao": dict(dynamic=False, tma_store=True), "static": dict(dynamic=False, tma_store=False),
             "dyn_tmao_q2": dict(dynamic=True, tma_store=True, q_double=True),
             "dyn_s3": dict(dynamic=True, tma_store=False, stages=3)}


def case_of(causal, window):
    return ("", causal, window, 0.0, None)


@pytest.mark.parametrize("sched", list(SCHEDULES))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_forward_tile_overlap(causal, sched):
    import torch

    checked = dropped = 0
    for window in BANDS[causal]:
        for sq, sk in SHAPES:
            q, k, v, _ = inputs(4, sq, sk, "gqa", 128, "bf16")
            p = problem_of("fwd", q, k, case_of(causal, window))
            cfg = device_heuristic(FWD, p).replace(persistent=True, tile_overlap=True, **SCHEDULES[sched])
            cfg = FWD.for_problem(cfg, p)
            assert cfg.tile_overlap and cfg.problems() == [], cfg.name
            band = Band(sq, sk, causal, window)
            keeps = every_q_block_has_keys(band, cfg.BM, cfg.BN)
            assert FWD.for_bounds(cfg, p).tile_overlap == keeps
            checked, dropped = checked + keeps, dropped + (not keeps)
            what = f"{cfg.name} window={window} {sq}x{sk} (tile_overlap {keeps})"
            out = check_forward(cfg, q, k, v, causal, window, 0.0, None, what)
            # the same plan again (the dynamic scheduler's counter reset by the launch's last claim)
            out2 = cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window, config=cfg)
            assert torch.equal(out2, out), f"{what}: second call differs"
    assert checked and dropped, (checked, dropped)   # both paths walked


def reference_grads(q, k, v, dout, causal, window):
    """(float64 gradients, low-precision gradients) of plain attention with the window (head dim 128)."""
    import torch

    scale = 128 ** -0.5
    ref = grads(lambda q, k, v: feature_attention(q, k, v, scale, causal, window, 0.0, None, torch.float64)[0],
                q, k, v, dout.double())
    low = grads(lambda q, k, v: feature_attention(q, k, v, scale, causal, window, 0.0, None, q.dtype)[0],
                q, k, v, dout)
    return ref, low


def check_grads(got, refs, what):
    for name, a, r, b in zip(("dq", "dk", "dv"), got, *refs):
        check_close(a, r, b, 3, f"{what} {name}")


def window_bwd_config(p):
    cfg = device_heuristic(BWD, p).replace(dq_first=True)
    return BWD.for_problem(cfg, p)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_backward_dq_first(causal):
    checked = dropped = 0
    for window in BWD_BANDS[causal]:
        for sq, sk in [(113, 1023), (1023, 113), (1023, 1023)]:
            q, k, v, dout = inputs(2, sq, sk, "gqa", 128, "bf16")
            p = problem_of("bwd", q, k, case_of(causal, window))
            cfg = window_bwd_config(p)
            keeps = every_q_block_visited(Band(sq, sk, causal, window), cfg.BM, cfg.BN)
            assert cfg.dq_first == keeps and cfg.problems() == [], cfg.name
            checked, dropped = checked + keeps, dropped + (not keeps)
            kw = dict(causal=causal, window_size=window)
            ours = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, bwd_config=cfg, **kw), q, k, v, dout)
            check_grads(ours, reference_grads(q, k, v, dout, causal, window), f"{cfg.name} window={window} {sq}x{sk}")
    assert checked and dropped, (checked, dropped)


def test_backward_dq_first_repeated_calls():
    """2 x 8 heads x 4097, causal window (1024, 0): 33 K/V blocks a pair, several tiles per CTA; 3 calls of
    one plan (an unzeroed Q block would add to the last call's sums); dk, dv bit for bit the kernel's
    without dq_first."""
    import torch

    case = case_of(True, (1024, 0))
    q, k, v, dout = inputs(2, 4097, 4097, "gqa", 128, "bf16")
    p = problem_of("bwd", q, k, case)
    cfg = window_bwd_config(p)
    base = cfg.replace(dq_first=False)
    assert cfg.dq_first
    kw = dict(causal=True, window_size=(1024, 0))
    refs = reference_grads(q, k, v, dout, True, (1024, 0))
    want = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, bwd_config=base, **kw), q, k, v, dout)
    for call in range(3):
        got = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, bwd_config=cfg, **kw), q, k, v, dout)
        check_grads(got, refs, f"{cfg.name} call {call}")
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), f"call {call}: dk / dv differ"


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_backward_wide_epi(causal):
    """wide_epi (16-byte dK / dV stores) with a window, alone, with dq_first and with dq_convert too (the dQ
    convert in the main kernel), MHA (the kernel's 16-byte path) and GQA (its 4-byte fallback): gradients
    within the 3x rule, dk / dv bit for bit the heuristic kernel's (only the stores and dQ's path change)."""
    import torch

    for window in BWD_BANDS[causal][:2]:
        for (sq, sk), heads in (((1023, 1023), "mha"), ((113, 1023), "mha"), ((1023, 1023), "gqa")):
            q, k, v, dout = inputs(2, sq, sk, heads, 128, "bf16")
            p = problem_of("bwd", q, k, case_of(causal, window))
            base = device_heuristic(BWD, p)
            kw = dict(causal=causal, window_size=window)
            want = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, bwd_config=base, **kw), q, k, v, dout)
            refs = reference_grads(q, k, v, dout, causal, window)
            for extra in (dict(wide_epi=True), dict(wide_epi=True, dq_first=True),
                          dict(wide_epi=True, dq_first=True, dq_convert=True)):
                cfg = BWD.for_problem(base.replace(**extra), p)
                assert cfg.wide_epi and cfg.problems() == [], cfg.name
                got = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, bwd_config=cfg, **kw), q, k, v, dout)
                what = f"{cfg.name} window={window} {sq}x{sk} {heads}"
                check_grads(got, refs, what)
                assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), f"{what}: dk / dv differ"


def all_test_configs():
    """The kernels these tests launch (for precompile; no GPU needed): every forward schedule by mask, the
    forward those backward tests run (the window heuristic's), and the backward variants."""
    from cuflash.problem import Problem

    out = []
    for causal in (True, False):
        window = BANDS[causal][0]
        for sq, sk in ((2049, 2049), (1023, 1023)):
            fp = Problem("fwd", "bf16", 2, sq, sk, 6, 2, 128, causal, features=("window",), window=window)
            heur = FWD.for_problem(FWD.heuristic(fp), fp)
            out.append(heur)
            out += [FWD.for_problem(heur.replace(persistent=True, tile_overlap=True, **s), fp)
                    for s in SCHEDULES.values()]
            bp = fp.replace(op="bwd")
            base = BWD.for_problem(BWD.heuristic(bp), bp)
            out += [base] + [BWD.for_problem(base.replace(**x), bp)
                             for x in (dict(dq_first=True), dict(wide_epi=True), dict(wide_epi=True, dq_first=True),
                                       dict(wide_epi=True, dq_first=True, dq_convert=True))]
    return list(dict.fromkeys(out))
