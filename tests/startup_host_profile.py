"""The Python of a first call without a GPU (issue 12, start-up): the feature calls' first call on
torch CPU tensors described as CUDA ones, with selection, the plans (struct packing, launch
tables) and the validation real, and the GPU parts faked: the device queries (an H100's), the
kernels (get_kernels returns stand-ins: no CuPy, no NVRTC), the counters and the launches. What
it leaves out is what the GPU run adds: importing CuPy, loading modules from its cache, torch's
CUDA allocator, the launches (tests/startup_profile.py on a GPU).

    PYTHONPATH=$PWD python tests/startup_host_profile.py [--calls window softcap] [--profile CALL]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

import cuflash
from cuflash import _gpu, api, compile as compile_mod, launch, select, torch_ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from features_host_profile import stub_gpu  # noqa: E402  (torch CPU tensors described as CUDA)

H100 = "NVIDIA H100 80GB HBM3"


class _Fn:
    ptr = 1


class _Kernel:
    kernel = _Fn()
    max_dynamic_shared_size_bytes = 0


class _Counters:
    def __init__(self, n, device, what):
        pass

    def address(self, stream):
        return 0


def stub_device(set_=setattr) -> None:
    """An H100's device queries, stand-in kernels and counters, launches that do nothing (with
    stub_gpu's descriptions: the plans real, not faked)."""
    for name, fn in (("require", lambda what: None), ("arch", lambda device=0: (9, 0)),
                     ("name", lambda device=0: H100), ("max_smem", lambda device=0: 232448),
                     ("sm_count", lambda device=0: 132), ("available", lambda: True)):
        set_(_gpu, name, fn)
    set_(compile_mod, "get_kernels", lambda config, device: _AnyRole())
    set_(launch, "get_kernels", lambda config, device: _AnyRole())
    set_(launch, "StreamCounters", _Counters)
    set_(launch, "_device_fns", lambda: ((lambda: 0), (lambda d: None)))
    for run in ("run", "run_fields", "run_with", "run_varlen", "run_roles", "run_current"):
        if hasattr(launch.Plan, run):
            set_(launch.Plan, run, lambda self, *a, **k: None)
    set_(launch.Plan, "_run", property(lambda self: (lambda *a, **k: None), lambda self, v: None))
    set_(launch.Plan, "run_current", property(lambda self: (lambda *a, **k: None), lambda self, v: None))
    set_(api, "_capturing", lambda: False)


class _AnyRole(dict):
    def __missing__(self, role):
        return _Kernel()


def call_of(name: str, shape=(2, 2048, 16, 128)):
    b, s, h, d = shape
    dt = torch.bfloat16
    grad = name == "causal_fwdbwd"
    if name == "varlen":
        lens = [s + s // 2 if i % 2 == 0 else s - s // 2 for i in range(b)]
        cu = torch.tensor([sum(lens[:i]) for i in range(b + 1)], dtype=torch.int32)
        q, k, v = (torch.randn(sum(lens), h, d, dtype=dt) for _ in range(3))
        return lambda: cuflash.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    q, k, v = (torch.randn(b, s, h, d, dtype=dt, requires_grad=grad) for _ in range(3))
    kw = {"causal": True}
    if name == "window":
        kw["window_size"] = (1024, 0)
    elif name == "softcap":
        kw["softcap"] = 30.0
    elif name == "alibi":
        kw["alibi_slopes"] = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)])
    elif name == "dropout":
        kw["dropout_p"] = 0.1
    if grad:
        dout = torch.randn(b, s, h, d, dtype=dt)
        return lambda: cuflash.flash_attn_func(q, k, v, **kw).backward(dout)
    return lambda: cuflash.flash_attn_func(q, k, v, **kw)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", nargs="+", default=["causal", "window", "softcap", "alibi"])
    ap.add_argument("--profile", default="")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    make_plan = api.make_plan
    stub_gpu()
    api.make_plan = make_plan   # (stub_gpu fakes the plans: here they are real)
    stub_device()
    for name in a.calls:
        fn = call_of(name)
        prof = cProfile.Profile() if name == a.profile else None
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        try:
            fn()
            err = ""
        except Exception as exc:  # noqa: BLE001 - a stand-in the path does not take: say so
            err = f" ({type(exc).__name__}: {str(exc)[:150]})"
        if prof:
            prof.disable()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            fn()
        except Exception:  # noqa: BLE001
            pass
        print(f"{name:>13}: first call {first * 1e3:7.1f} ms, repeat {1e3 * (time.perf_counter() - t0):6.1f} ms{err}")
        if prof:
            pstats.Stats(prof).sort_stats("cumulative").print_stats(a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
