"""Shapes for compute-sanitizer over session 23's window kernels: sm90_fwd unmasked_first 1 / 2 (kUnmaskedFirst)
and sm90_bwd convert_early (kConvertEarly, Sm90BwdDqTickets); run under it, not under pytest.

    compute-sanitizer --tool racecheck python tests/window_order_sanitize.py
    compute-sanitizer --tool synccheck python tests/window_order_sanitize.py
    compute-sanitizer --tool memcheck python tests/window_order_sanitize.py

Batch 2 x 4 heads x 1100, window (256, 0) causal / (200, 100) full: forward on the window heuristic's schedule
(static persistent, TMA store, tile_overlap; 72 tiles), O compared with the heuristic kernel's; backward on the
window heuristic's (dynamic, dq_first, wide_epi) with dq_convert + convert_early, twice (the tickets' counters
reset by each launch), dK / dV equal bit for bit to the heuristic's and dQ close. --fwd / --bwd: one side only.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _gpu, api, registry  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

WINDOWS = {True: (256, 0), False: (200, 100)}


def main():
    api.POISON_OUTPUTS = True
    fwd, bwd = registry.get("sm90_fwd"), registry.get("sm90_bwd")
    b, s, h, d = 2, 1100, 4, 128
    for causal in (True, False):
        window = WINDOWS[causal]
        kw = dict(causal=causal, window_size=window)
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        do = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        fp = Problem("fwd", "bf16", b, s, s, h, h, d, causal, features=("window",), window=window)
        heur = fwd.for_problem(fwd.heuristic(fp, _gpu.arch()), fp)
        if "--bwd" not in sys.argv:
            want = cuflash.flash_attn_func(q, k, v, config=heur, **kw)
            for form in (1, 2):
                cfg = fwd.for_problem(heur.replace(unmasked_first=form), fp)
                assert cfg.unmasked_first == form and not cfg.problems(), cfg.name
                got = cuflash.flash_attn_func(q, k, v, config=cfg, **kw)
                torch.cuda.synchronize()
                print("ok", cfg.name, f"O max diff {(got.float() - want.float()).abs().max().item():.3g}", flush=True)
        if "--fwd" not in sys.argv:
            bp = fp.replace(op="bwd")
            bheur = bwd.for_problem(bwd.heuristic(bp, _gpu.arch()), bp)
            cve = bwd.for_problem(bheur.replace(dq_convert=True, convert_early=True), bp)
            assert cve.convert_early and not cve.problems(), cve.name
            o = cuflash.flash_attn_func(q, k, v, config=heur, bwd_config=bheur, **kw)
            want = torch.autograd.grad(o, (q, k, v), do)
            for call in range(2):
                o = cuflash.flash_attn_func(q, k, v, config=heur, bwd_config=cve, **kw)
                got = torch.autograd.grad(o, (q, k, v), do)
                torch.cuda.synchronize()
                dq = (got[0].float() - want[0].float()).abs().max().item()
                same = torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
                print("ok" if same else "DIFF", cve.name, f"call {call}: dk, dv equal {same}, dq max diff {dq:.3g}",
                      flush=True)


if __name__ == "__main__":
    main()
