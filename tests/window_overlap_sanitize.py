"""Shapes for compute-sanitizer over a window's tile_overlap forward (sm90_fwd kTileOverlap with kWindow: the next
tile's S_0 issued behind the last P V; with the dynamic scheduler the next tile taken from the ring there) and its
backward variants (sm90_bwd dq_first, wide_epi, dq_convert with kWindow): run under it, not under pytest.

    compute-sanitizer --tool racecheck python tests/window_overlap_sanitize.py
    compute-sanitizer --tool synccheck python tests/window_overlap_sanitize.py

Batch 4 x 8 heads x 1100 (288 forward tiles on 132 persistent CTAs: several per CTA), window (256, 0) causal /
(200, 100) full, each call twice, outputs NaN-poisoned and compared with the window heuristic's kernel (forward: O
equal bit for bit, the same arithmetic; backward: dk, dv bit for bit, dq within 1e-2 relative). --quick: the
dynamic TMA-store forward and the dq_first + wide_epi backward only.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _gpu, api, registry  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

FWD_SCHEDULES = [dict(dynamic=True, tma_store=True), dict(dynamic=False, tma_store=False),
                 dict(dynamic=True, tma_store=True, q_double=True)]
BWD_VARIANTS = [dict(dq_first=True, wide_epi=True), dict(dq_first=True, wide_epi=True, dq_convert=True)]
WINDOWS = {True: (256, 0), False: (200, 100)}


def main():
    api.POISON_OUTPUTS = True
    quick = "--quick" in sys.argv
    fwd, bwd = registry.get("sm90_fwd"), registry.get("sm90_bwd")
    b, s, h, d = 4, 1100, 8, 128
    for causal in (True, False):
        window = WINDOWS[causal]
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        fp = Problem("fwd", "bf16", b, s, s, h, h, d, causal, features=("window",), window=window)
        heur = fwd.for_problem(fwd.heuristic(fp, _gpu.arch()), fp)
        want = cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window, config=heur)
        for sched in FWD_SCHEDULES[:1] if quick else FWD_SCHEDULES:
            cfg = fwd.for_problem(heur.replace(persistent=True, tile_overlap=True, **sched), fp)
            assert cfg.tile_overlap and not cfg.problems(), cfg.name
            for _ in range(2):
                got = cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window, config=cfg)
                assert torch.equal(got, want), f"{cfg.name}: O differs from {heur.name}"
            torch.cuda.synchronize()
            print("ok", cfg.name, flush=True)
        bp = fp.replace(op="bwd")
        base = bwd.for_problem(bwd.heuristic(bp, _gpu.arch()), bp)
        o = cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window, bwd_config=base)
        ref = torch.autograd.grad(o, (q, k, v), dout)
        for extra in BWD_VARIANTS[:1] if quick else BWD_VARIANTS:
            cfg = bwd.for_problem(base.replace(**extra), bp)
            assert all(getattr(cfg, f) for f in extra) and not cfg.problems(), cfg.name
            for _ in range(2):
                o = cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window, bwd_config=cfg)
                g = torch.autograd.grad(o, (q, k, v), dout)
                assert not any(x.isnan().any() for x in g), f"{cfg.name}: NaN"
                assert torch.equal(g[1], ref[1]) and torch.equal(g[2], ref[2]), f"{cfg.name}: dk / dv differ"
                err = ((g[0].float() - ref[0].float()).abs().max() / ref[0].float().abs().max()).item()
                assert err < 1e-2, f"{cfg.name}: dq {err}"
            torch.cuda.synchronize()
            print("ok", cfg.name, f"dq diff {err:.1e}", flush=True)
    print("window overlap sanitize done")


if __name__ == "__main__":
    main()
