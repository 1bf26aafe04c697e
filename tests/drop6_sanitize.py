"""Shapes for compute-sanitizer over sm90_bwd's drop_packed kernels (those of
tests/test_sm90_bwd_drop_packed_gpu.py, so a CuPy cache filled by tests/drop6_precompile.py compiles
nothing here): run under it, not under pytest:

    compute-sanitizer --tool racecheck python tests/drop6_sanitize.py
    compute-sanitizer --tool synccheck python tests/drop6_sanitize.py

One small shape (a ragged last block, GQA), d128 bf16, causal and not: the drop_packed backwards
after selection's forward; outputs poisoned (NaN) and checked against the backward without it (dK
bit for bit, dQ and dV within bf16 rounding).
"""
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import api  # noqa: E402

import test_sm90_bwd_drop_packed_gpu as packed_test  # noqa: E402

SEED = packed_test.SEED


def main():
    from cuflash.families import sm90_bwd

    api.POISON_OUTPUTS = True
    sm90_bwd.DROPOUT_PACKED = {}   # the backward without drop_packed too (a config's 0 would take the default)
    torch.manual_seed(0)
    b, sq, sk, h, hkv, p = 1, 300, 257, 4, 2, packed_test.P_DROP
    q = torch.randn(b, sq, h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, sk, hkv, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    for causal in (False, True):
        fcfg, packed, base = packed_test.configs(128, "bf16", causal)
        runs = {}
        for fwd, bwd in [(fcfg, base), *((fcfg, c) for c in packed)]:
            out = cuflash.flash_attn_func(q, k, v, p, causal=causal, dropout_seed=SEED, config=fwd, bwd_config=bwd)
            grads = torch.autograd.grad(out, (q, k, v), dout)
            torch.cuda.synchronize()
            assert not out.isnan().any() and not any(g.isnan().any() for g in grads), (fwd.name, bwd.name)
            runs[fwd.name, bwd.name] = (out, *grads)
        ref = runs[fcfg.name, base.name]
        for (fname, bname), res in runs.items():
            # the forward's output (one kernel) and dK bit for bit (the same signed Pᵀ words)
            assert torch.equal(res[0], ref[0]) and torch.equal(res[2], ref[2]), (fname, bname)
            for name, a, r in zip(("dq", "dv"), (res[1], res[3]), (ref[1], ref[3])):
                err = ((a.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-6)).item()
                assert err < 3e-2, f"{fname} + {bname} {name}: differs from {base.name}'s by {err:.3g} (relative)"
            print(f"ok {fname} + {bname}", flush=True)
    print("done")


if __name__ == "__main__":
    main()
