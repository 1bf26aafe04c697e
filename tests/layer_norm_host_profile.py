"""Host time of cuflash.ops.layer_norm's eager calls without a GPU (issue 12): rms_norm_fn /
layer_norm_fn on torch CPU tensors passed off as the kernels' (kernel_takes faked), the plans faked
(a launch records its pointers and steps), the fast path (cuflash.layer_norm.Entry, a repeat call
of a cached key) against the checked route it skips (``EAGER_CACHE = False``: the argument checks,
the route, cuflash.layer_norm.forward / backward), interleaved in rounds, CPU time per call. CPU
allocations and autograd stand in for CUDA ones (tests/layer_norm_host_timing.py measures on a GPU).

    PYTHONPATH=$PWD python tests/layer_norm_host_profile.py [--calls 2000] [--profile CASE]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats

import torch

from cuflash import layer_norm as ln
from cuflash.ops import layer_norm as ops
from cuflash.timing import host_us_interleaved


class FakePlan:
    """A plan whose launches record (pointers, steps); keep=False: counts them only."""
    keep = True
    device, threads, smem, fused, dw_grid, splits = 0, 64, 0, True, 1, 4
    fwd, bwd_dx, bwd_dw, finish, bwd = 1, 2, 3, 4, 5

    def __init__(self, args, made):
        self.args, self.launches, self.count = args, [], 0
        self.fused = bool(args[-1]) if len(args) > 11 else False
        made.append(self)

    def run(self, ptrs, steps, stream):
        self.count += 1
        if self.keep:
            self.launches.append((ptrs, steps))


def stub_gpu(set_attr=setattr) -> list:
    """CPU tensors take the kernel route (kernel_takes without its is_cuda), the plans faked, the
    caches fresh: returns the list of plans made."""
    made = []
    real = ln.kernel_takes

    class _Cpu:   # x as kernel_takes sees it, on "CUDA"
        def __init__(self, x):
            self.x = x

        def __getattr__(self, name):
            return True if name == "is_cuda" else getattr(self.x, name)

    set_attr(ln, "kernel_takes", lambda x, *a: real(_Cpu(x), *a))
    plans = {}
    set_attr(ln, "_plan", lambda *args: plans.get(args) or plans.setdefault(args, FakePlan(args, made)))
    set_attr(ln, "_raw_stream", lambda index: 0)
    ln._drop_plans()
    return made


def cases(rows=8, n=2048, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, n, generator=g).to(dtype)
    r = torch.randn(rows, n, generator=g).to(dtype)
    w = torch.ones(n, dtype=dtype)
    b = torch.zeros(n, dtype=dtype)
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    dy = torch.randn(rows, n, generator=g).to(dtype)
    return {
        "rms": lambda: ops.rms_norm_fn(x, w, None),
        "ln": lambda: ops.layer_norm_fn(x, w, b),
        "rms_res": lambda: ops.rms_norm_fn(x, w, None, residual=r, prenorm=True),
        "rms_res32": lambda: ops.rms_norm_fn(x, w, None, residual=r, prenorm=True, residual_in_fp32=True),
        "rms_fwdbwd": lambda: ops.rms_norm_fn(xg, wg, None).backward(dy),
    }


class _Flag:
    def __init__(self, value):
        self.value = value

    def __enter__(self):
        self.old, ops.EAGER_CACHE = ops.EAGER_CACHE, self.value

    def __exit__(self, *exc):
        ops.EAGER_CACHE = self.old


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--profile", default="", help="cProfile one case's fast path (a name of cases())")
    a = ap.parse_args()
    made = stub_gpu()
    FakePlan.keep = False
    fns = cases()
    if a.profile:
        fn = fns[a.profile]
        for _ in range(100):
            fn()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.calls):
            fn()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
        return
    timed = {}
    for name, fn in fns.items():
        timed[f"{name} fast"] = (fn, lambda: _Flag(True))
        timed[f"{name} checked"] = (fn, lambda: _Flag(False))
    res = host_us_interleaved(timed, calls=a.calls, rounds=a.rounds)
    print(f"CPU µs per call (best / median of {a.rounds} rounds; {len(made)} fake plans made)")
    for name, (best, med) in res.items():
        print(f"{name:22s} {best:7.2f} {med:7.2f}")


if __name__ == "__main__":
    main()
