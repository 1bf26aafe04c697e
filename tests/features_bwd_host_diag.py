"""Where a feature call's backward spends host time beyond the plain one's (issue 12; session 24 found
the window (64, 0) forward + backward on bench's tiny problem 40-60 us above the causal call's): per case,
the tensor maps encoded per forward + backward (cuflash.families.sm90_fwd's encoder; cached per pointer
set, so a steady loop should encode none) and the host us of the backward alone (torch.autograd.grad
of one forward's output, retained), interleaved in rounds. Not a test:

    timeout 30 python tests/features_bwd_host_diag.py
"""
import os
import statistics
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_here)]

import torch  # noqa: E402

from cuflash.bench import overhead  # noqa: E402
from cuflash.families import sm90_fwd  # noqa: E402

CASES = ("causal", "window", "softcap", "alibi", "dropout")


def main():
    encoded = [0]
    encoder = sm90_fwd._encoder

    def counting(*a):
        encoded[0] += 1
        return encoder(*a)

    sm90_fwd._encoder = counting
    fns = {}
    for case in CASES:
        fn, sync, _ = overhead.feature_call("cuflash", case, True)
        for _ in range(10):
            fn()
        sync()
        encoded[0] = 0
        for _ in range(50):
            fn()
        sync()
        print(f"{case}: {encoded[0] / 50:.2f} tensor maps encoded per forward + backward", flush=True)
        # the backward alone: one forward's graph, retained
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 128, 4, 64, generator=g).to("cuda", torch.bfloat16).requires_grad_()
                   for _ in range(3))
        kw = {"window": dict(window_size=overhead.feature_window(overhead.TINY)),
              "softcap": dict(softcap=30.0), "dropout": dict(dropout_p=0.1),
              "alibi": dict(alibi_slopes=torch.rand(4, device="cuda"))}.get(case, {})
        import cuflash

        out = cuflash.flash_attn_func(q, k, v, causal=True, **kw)
        dout = torch.randn_like(out)
        fns[case] = lambda out=out, q=q, k=k, v=v, dout=dout: torch.autograd.grad(
            out, (q, k, v), dout, retain_graph=True)
        for _ in range(20):
            fns[case]()
    per = {c: [] for c in fns}
    for _ in range(7):
        for c, f in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(100):
                f()
            per[c].append((time.perf_counter() - t0) / 100 * 1e6)
    torch.cuda.synchronize()
    for c, v in per.items():
        print(f"{c}: backward alone {statistics.median(v):.1f} us (median of 7 rounds), best {min(v):.1f}")


if __name__ == "__main__":
    main()
