"""Shapes for compute-sanitizer over a window's edge halves (sm90_fwd kEdgeHalf, edge_half: the edge blocks' S
and P V on the 64-key half a consumer warpgroup sees, the body compiled once per consumer warpgroup): run under it,
not under pytest.

    compute-sanitizer --tool racecheck python tests/window_tiles_sanitize.py
    compute-sanitizer --tool synccheck python tests/window_tiles_sanitize.py

Batch 4 x 8 heads x 1100 (288 forward tiles on 132 persistent CTAs: several per CTA), window (256, 0) causal /
(200, 100) full, edge_half 1 and 2, on the window heuristic's schedule (static, TMA store, tile_overlap) and the
static one without either (--quick: the heuristic's only; --eh N: edge_half N alone, 0 the heuristic's kernel
alone), each call twice, outputs NaN-poisoned and compared with the heuristic's
kernel: O equal bit for bit (the skipped half's P is 0).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _gpu, api, registry  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

SCHEDULES = [dict(), dict(tma_store=False, tile_overlap=False)]
WINDOWS = {True: (256, 0), False: (200, 100)}


def main():
    api.POISON_OUTPUTS = True
    quick = "--quick" in sys.argv
    # --eh N: edge_half N alone (0: the heuristic's kernel alone, the baseline of a sanitizer's report)
    only = int(sys.argv[sys.argv.index("--eh") + 1]) if "--eh" in sys.argv else None
    fwd = registry.get("sm90_fwd")
    b, s, h, d = 4, 1100, 8, 128
    for causal in (True, False):
        window = WINDOWS[causal]
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        fp = Problem("fwd", "bf16", b, s, s, h, h, d, causal, features=("window",), window=window)
        heur = fwd.for_problem(fwd.heuristic(fp, _gpu.arch()), fp)
        want = cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window, config=heur.replace(edge_half=0))
        if only == 0:
            torch.cuda.synchronize()
            print("ok", heur.name, flush=True)
            continue
        for sched, eh in [(sc, e) for sc in (SCHEDULES[:1] if quick else SCHEDULES) for e in ((only,) if only else (1, 2))]:
            cfg = fwd.for_problem(heur.replace(edge_half=eh, **sched), fp)
            assert cfg.edge_half and not cfg.problems(), cfg.name
            for _ in range(2):
                got = cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window, config=cfg)
                assert torch.equal(got, want), f"{cfg.name}: O differs from {heur.name}"
            torch.cuda.synchronize()
            print("ok", cfg.name, flush=True)
    print("window tiles sanitize done")


if __name__ == "__main__":
    main()
