"""Shapes for compute-sanitizer over the kernels tests/test_drp8_gpu.py adds (the drop_packed 2 backward
with the plain speed fields), so that a CuPy cache filled by tests/drp8_precompile.py compiles nothing here; run
under it, not under pytest:

    compute-sanitizer --tool racecheck python tests/drp8_sanitize.py [--causal yes|no|both]
    compute-sanitizer --tool synccheck python tests/drp8_sanitize.py

One small MHA shape (ragged last blocks, s_q != s_k: the 16-byte dK / dV stores run), d128 bf16, after
selection's forward: the backwards with the fields against the one without (dK, dV bit for bit, dQ within
bf16 rounding); outputs poisoned (NaN) before each launch.
"""
import argparse
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import api  # noqa: E402

import test_drp8_gpu as t  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--causal", choices=("yes", "no", "both"), default="both")
    ap.add_argument("--new-only", action="store_true",
                    help="the backward with the fields only (no comparison with the one without: shorter)")
    ap.add_argument("--precompile", action="store_true", help="compile the kernels in parallel, then exit")
    args = ap.parse_args()
    causals = {"yes": (True,), "no": (False,), "both": (False, True)}[args.causal]
    if args.precompile:
        from cuflash.compile import precompile

        todo = list(dict.fromkeys(c for causal in causals for c in t.configs("bf16", causal)))
        res = precompile(todo, 0, processes=min(8, os.cpu_count() or 1))
        print("compiled", len(todo), "failed:", [c.name for c, _, e in res if e])
        return
    api.POISON_OUTPUTS = True
    torch.manual_seed(0)
    b, sq, sk, h = 1, 300, 257, 4
    q = torch.randn(b, sq, h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, sk, h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    for causal in causals:
        f0, b0, b1 = t.configs("bf16", causal)
        runs = {}
        for bcfg in (b1,) if args.new_only else (b0, b1):
            out = cuflash.flash_attn_func(q, k, v, t.P_DROP, causal=causal, dropout_seed=t.SEED, config=f0,
                                          bwd_config=bcfg)
            grads = torch.autograd.grad(out, (q, k, v), dout)
            torch.cuda.synchronize()
            assert not out.isnan().any() and not any(g.isnan().any() for g in grads), bcfg.name
            runs[bcfg.name] = grads
        if args.new_only:
            print(f"ok {'causal' if causal else 'full'} {b1.name} (no NaN)", flush=True)
            continue
        ref = runs[b0.name]
        for bcfg in (b1,):
            new = runs[bcfg.name]
            assert torch.equal(new[1], ref[1]) and torch.equal(new[2], ref[2]), f"{bcfg.name}: dK / dV differ"
            err = ((new[0].float() - ref[0].float()).abs().max() / ref[0].float().abs().max().clamp_min(1e-6)).item()
            assert err < 3e-2, f"{bcfg.name} dq: differs from {b0.name}'s by {err:.3g} (relative)"
            print(f"ok {'causal' if causal else 'full'} {bcfg.name}", flush=True)
    print("done")


if __name__ == "__main__":
    main()
