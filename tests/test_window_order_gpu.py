"""A window's block order in the forward and the dQ convert at the backward's tile boundaries (session 23,
issue 12's window overhead), on an H100, forced with config= / bwd_config=.

* sm90_fwd unmasked_first (kUnmaskedFirst: 1, a band's masked last block visited second; 2, visited last),
  on the window heuristic's schedule, causal and not, several bands (a block-aligned one, odd ones, one
  narrower than three blocks: the order unchanged there), s_q != s_k both ways, GQA, several tiles per CTA;
  a second call of the plan gives the same output.
* sm90_bwd convert_early (kConvertEarly: dq_convert's jobs by ticket at the dynamic loop's tile boundaries,
  Sm90BwdDqTickets), on the window backward's heuristic config: odd shapes and bands; 3 calls of one plan
  (the tickets' counters reset by the launch's last warp); dK / dV bit for bit the kernel's without it.

Errors vs the float64 reference within 2x (forward) / 3x (gradients) of plain attention with the same window
in the same low precision (test_features_gpu's rule), outputs NaN-poisoned before each launch.

    CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q -x tests/test_window_order_gpu.py
"""

import pytest

import cuflash
from cuflash import registry

from conftest import device_heuristic  # noqa: E402
from test_features_gpu import grads, inputs, problem_of  # noqa: E402
from test_features_opt_gpu import check_forward  # noqa: E402
from test_window_overlap_gpu import case_of, check_grads, reference_grads  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

FWD = registry.get("sm90_fwd")
BWD = registry.get("sm90_bwd")
BANDS = {True: [(1024, 0), (300, 0), (100, 0)], False: [(1024, 1024), (300, 129), (0, 0)]}
SHAPES = [(2049, 2049), (1500, 2049), (2049, 1500)]
BWD_BANDS = {True: [(1024, 0), (257, 0)], False: [(300, 129), (1024, 1024)]}
PLAIN_CAUSAL = [(2049, 2049), (1500, 2049), (2049, 1500), (4096, 4096)]


@pytest.mark.parametrize("form", [1, 2])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_forward_unmasked_first(causal, form):
    import torch

    for window in BANDS[causal]:
        for sq, sk in SHAPES:
            q, k, v, _ = inputs(4, sq, sk, "gqa", 128, "bf16")
            p = problem_of("fwd", q, k, case_of(causal, window))
            cfg = FWD.for_problem(device_heuristic(FWD, p).replace(unmasked_first=form), p)
            assert cfg.unmasked_first == form and cfg.problems() == [], cfg.name
            what = f"{cfg.name} window={window} {sq}x{sk}"
            out = check_forward(cfg, q, k, v, causal, window, 0.0, None, what)
            out2 = cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window, config=cfg)
            assert torch.equal(out2, out), f"{what}: second call differs"


@pytest.mark.parametrize("form", [1, 2])
def test_forward_unmasked_first_plain_causal(form):
    """The plain causal call (no window) on selection's tile: its last block is the masked diagonal too."""
    import torch

    for sq, sk in PLAIN_CAUSAL:
        q, k, v, _ = inputs(2, sq, sk, "gqa", 128, "bf16")
        p = problem_of("fwd", q, k, case_of(True, (-1, -1)))
        cfg = FWD.for_problem(device_heuristic(FWD, p).replace(unmasked_first=form), p)
        assert cfg.unmasked_first == form and cfg.problems() == [], cfg.name
        what = f"{cfg.name} {sq}x{sk}"
        out = check_forward(cfg, q, k, v, True, (-1, -1), 0.0, None, what)
        out2 = cuflash.flash_attn_func(q, k, v, causal=True, config=cfg)
        assert torch.equal(out2, out), f"{what}: second call differs"


def convert_early_config(p):
    cfg = BWD.for_problem(device_heuristic(BWD, p).replace(dq_convert=True, convert_early=True), p)
    assert cfg.convert_early and cfg.dq_convert and cfg.dynamic and cfg.problems() == [], cfg.name
    return cfg


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_backward_convert_early(causal):
    import torch

    for window in BWD_BANDS[causal]:
        for sq, sk in [(113, 1023), (1023, 113), (1023, 1023)]:
            q, k, v, dout = inputs(2, sq, sk, "gqa", 128, "bf16")
            p = problem_of("bwd", q, k, case_of(causal, window))
            cfg = convert_early_config(p)
            base = cfg.replace(convert_early=False, dq_convert=False)
            kw = dict(causal=causal, window_size=window)
            want = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, bwd_config=base, **kw), q, k, v, dout)
            got = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, bwd_config=cfg, **kw), q, k, v, dout)
            what = f"{cfg.name} window={window} {sq}x{sk}"
            check_grads(got, reference_grads(q, k, v, dout, causal, window), what)
            assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), f"{what}: dk / dv differ"


def test_backward_convert_early_repeated_calls():
    """2 x 8 heads x 4097, causal window (1024, 0): 33 K/V blocks a pair, several tiles per CTA, 1040 jobs
    of 64 rows; 3 calls of one plan (the tickets' counters back at 0 after each launch)."""
    import torch

    q, k, v, dout = inputs(2, 4097, 4097, "mha", 128, "bf16")
    p = problem_of("bwd", q, k, case_of(True, (1024, 0)))
    cfg = convert_early_config(p)
    kw = dict(causal=True, window_size=(1024, 0))
    refs = reference_grads(q, k, v, dout, True, (1024, 0))
    base = cfg.replace(convert_early=False, dq_convert=False)
    want = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, bwd_config=base, **kw), q, k, v, dout)
    for call in range(3):
        got = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, bwd_config=cfg, **kw), q, k, v, dout)
        check_grads(got, refs, f"{cfg.name} call {call}")
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), f"call {call}: dk / dv differ"
        assert (got[0].float() - want[0].float()).abs().max().item() <= 1e-2 * want[0].float().abs().max().item()


def all_test_configs():
    """The kernels these tests launch (for precompile; no GPU needed)."""
    from cuflash.problem import Problem

    out = []
    for causal in (True, False):
        for sq, sk in ((2049, 2049), (1023, 1023), (4097, 4097)):
            for heads in ((6, 2), (8, 8)):
                fp = Problem("fwd", "bf16", 2, sq, sk, *heads, 128, causal, features=("window",),
                             window=BANDS[causal][0])
                heur = FWD.for_problem(FWD.heuristic(fp), fp)
                out += [FWD.for_problem(heur.replace(unmasked_first=f), fp) for f in (1, 2)]
                out.append(heur)
                bp = fp.replace(op="bwd")
                base = BWD.for_problem(BWD.heuristic(bp), bp)
                cve = BWD.for_problem(base.replace(dq_convert=True, convert_early=True), bp)
                out += [base, cve, cve.replace(convert_early=False, dq_convert=False)]
    for sq, sk in PLAIN_CAUSAL:
        fp = Problem("fwd", "bf16", 2, sq, sk, 6, 2, 128, True)
        out += [FWD.for_problem(FWD.heuristic(fp).replace(unmasked_first=f), fp) for f in (1, 2)]
    return list(dict.fromkeys(out))
