"""A window's edge halves (sm90_fwd kEdgeHalf, edge_half: a band's edge blocks' S at wgmma n = 64 and P V on the
4 k16 steps of the one 64-key half a consumer warpgroup sees; the body compiled once per consumer warpgroup), on an
H100, forced with config=.

Three schedules (the window heuristic's static persistent grid with the TMA-store epilogue and tile_overlap, the
static grid without either, the dynamic scheduler with both; and edge_half 2, the P V halves alone, on the first),
causal and not; bands wide and narrow, odd, a side
unbounded, narrower than a half; s_q != s_k both ways; GQA (batch 4 x 6 heads x 17 Q blocks: several tiles per
CTA). Errors vs the float64 reference within 2x of plain attention with the same window in the same precision
(test_features_gpu's rule), outputs NaN-poisoned; O equal bit for bit to the same config without edge_half (the
skipped half's P is 0), and a second call equal (deterministic). The backward through such a forward: gradients
equal bit for bit to the plain config's. (Varlen calls: for_problem drops it,
tests/test_window_tiles_cpu.py.)

    CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q -x tests/test_window_tiles_gpu.py
"""

import pytest

import cuflash
from cuflash import registry
from cuflash.problem import Problem

from conftest import device_heuristic  # noqa: E402
from test_features_gpu import inputs, problem_of  # noqa: E402
from test_features_opt_gpu import check_forward  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

FWD = registry.get("sm90_fwd")
BANDS = {True: [(1024, 0), (256, 0), (100, 0), (17, 0), (-1, 0)],
         False: [(300, 129), (0, 0), (-1, 37), (200, -1), (64, 64), (40, 200)]}
SHAPES = [(2049, 2049), (1500, 2049), (2049, 1500)]
SCHEDULES = {"static_tmao_tov": dict(dynamic=False, tma_store=True, tile_overlap=True),   # (the heuristic's)
             "static": dict(dynamic=False, tma_store=False, tile_overlap=False),
             "dyn_tmao_tov": dict(dynamic=True, tma_store=True, tile_overlap=True),
             # edge_half 2 (the P V halves alone, S at n = 128), on the heuristic's schedule
             "static_tmao_tov_eh2": dict(dynamic=False, tma_store=True, tile_overlap=True, edge_half=2)}


def case_of(causal, window):
    return ("", causal, window, 0.0, None)


def edge_config(p, sched, heuristic=device_heuristic):
    cfg = heuristic(FWD, p).replace(**dict(dict(persistent=True, edge_half=1), **SCHEDULES[sched]))
    return FWD.for_problem(cfg, p)


def all_test_configs(scheds=tuple(SCHEDULES)):
    """The kernels these tests launch (for precompile): per mask and schedule, with and without edge_half."""
    out = []
    for causal in (True, False):
        p = Problem("fwd", "bf16", 4, 2049, 2049, 6, 2, 128, causal, features=("window",),
                    window=(256, 0) if causal else (300, 129))
        for sched in scheds:
            cfg = edge_config(p, sched, lambda fam, pr: fam.heuristic(pr, (9, 0)))
            out += [cfg, cfg.replace(edge_half=0)]
    return list(dict.fromkeys(out))


@pytest.mark.parametrize("sched", list(SCHEDULES))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_forward_edge_half(causal, sched):
    import torch

    checked = 0
    for window in BANDS[causal]:
        for sq, sk in SHAPES:
            q, k, v, _ = inputs(4, sq, sk, "gqa", 128, "bf16")
            p = problem_of("fwd", q, k, case_of(causal, window))
            cfg = edge_config(p, sched)
            if not cfg.edge_half:   # (a band the API runs as the plain call)
                continue
            assert cfg.problems() == [], cfg.name
            what = f"{cfg.name} window={window} {sq}x{sk}"
            out = check_forward(cfg, q, k, v, causal, window, 0.0, None, what)
            base = cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                           config=cfg.replace(edge_half=0))
            assert torch.equal(out, base), f"{what}: O differs from the kernel without edge_half"
            out2 = cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window, config=cfg)
            assert torch.equal(out2, out), f"{what}: second call differs"
            checked += 1
    assert checked >= 10, checked


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_backward_through_edge_half(causal):
    import torch

    window = (256, 0) if causal else (300, 129)
    q, k, v, dout = inputs(4, 2049, 1500, "gqa", 128, "bf16")
    p = problem_of("fwd", q, k, case_of(causal, window))
    cfg = edge_config(p, "static_tmao_tov")
    assert cfg.edge_half
    got = []
    for c in (cfg, cfg.replace(edge_half=0)):
        qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
        o = cuflash.flash_attn_func(qg, kg, vg, causal=causal, window_size=window, config=c, deterministic=True)
        got.append((o,) + torch.autograd.grad(o, (qg, kg, vg), dout))
    for name, a, b in zip(("o", "dq", "dk", "dv"), *got):
        assert torch.equal(a, b), f"{cfg.name}: {name} differs from the kernel without edge_half"

