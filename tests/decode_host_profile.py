"""Host time of the eager decode call without a GPU (issue 13's host budget): the torch-tensor path
of ``flash_attn_with_kvcache`` (plan-cache key, entry, outputs, pointers, ``Plan.run``) on torch CPU
tensors, with the GPU-facing pieces stubbed (kernels, the driver launch: a no-op; the device and
stream queries: constants). What it measures is the Python a repeat call runs; the CUDA caching
allocator and the real driver launch add their own time on a GPU machine (``bench --mode overhead``).

    PYTHONPATH=$PWD python tests/decode_host_profile.py [--keys 256] [--calls 20000] [--profile]
        [--ab DIR]   # DIR/cuflash_old: a copy of another checkout's cuflash/, timed interleaved
                     # with this one in the same process (rounds alternate; CPU time per call)
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from types import SimpleNamespace

import torch

import cuflash


def stub_gpu(pkg=cuflash, monkeypatch_attr=setattr):
    """Replace the GPU queries and the launch with constants and a no-op (H100 values)."""
    import importlib

    _gpu, decode, launch = (importlib.import_module(f"{pkg.__name__}.{m}") for m in ("_gpu", "decode", "launch"))
    fam = importlib.import_module(f"{pkg.__name__}.registry").get("decode_splitkv")
    for name, value in (("require", lambda what: None), ("arch", lambda device=0: (9, 0)),
                        ("name", lambda device=0: "NVIDIA H100 80GB HBM3"),
                        ("max_smem", lambda device=0: 232448), ("sm_count", lambda device=0: 132)):
        monkeypatch_attr(_gpu, name, value)
    monkeypatch_attr(launch, "get_kernels", lambda config, device: {
        role: SimpleNamespace(kernel=SimpleNamespace(ptr=1000 + i))
        for i, role in enumerate(fam.kernel_names(config))})
    monkeypatch_attr(launch, "_driver_launch", lambda: (lambda *a: None))

    def launch_ex(*args):   # cuLaunchKernelEx (pdl plans): a no-op
        return 0

    monkeypatch_attr(launch, "libcuda", lambda: SimpleNamespace(cuLaunchKernelEx=launch_ex))
    monkeypatch_attr(launch, "_device_fns", lambda: ((lambda: 0), (lambda device: None)))
    monkeypatch_attr(launch, "_zeroed_i32", lambda n, device, what: SimpleNamespace(ptr=0x7000000))
    monkeypatch_attr(launch, "_stream_capturing", lambda stream: False)
    monkeypatch_attr(decode._TorchArrays, "capturing", staticmethod(lambda: False))
    orig_init = decode._TorchArrays.__init__

    def init(self):
        orig_init(self)
        self.raw_stream = lambda device: 0  # torch's current raw stream, a constant here

    monkeypatch_attr(decode._TorchArrays, "__init__", init)
    return decode


def decode_args(keys: int, batch: int = 1):
    dt = torch.bfloat16
    q = torch.randn(batch, 1, 32, 128, dtype=dt)
    kc, vc = (torch.randn(batch, keys, 8, 128, dtype=dt) for _ in range(2))
    lens = torch.full((batch,), keys, dtype=torch.int32)
    return (q, kc, vc, None, None, None, None, lens, None, None, None, None)


def caller(decode, args, scalars):
    """One repeat call of the torch path, as flash_attn_with_kvcache runs it (made once first)."""
    run, plans = decode._run_cached, decode._gpu_plans

    if "want_lse" in run.__code__.co_varnames:  # flash_attn_with_kvcache without return_softmax_lse
        def call():
            return run(plans, args, scalars, want_lse=False)
    else:
        def call():
            return run(plans, args, scalars)

    call()
    return call


def per_call_us(fn, calls: int) -> float:
    t0 = time.process_time_ns()
    for _ in range(calls):
        fn()
    return (time.process_time_ns() - t0) / calls / 1e3


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--ab", help="a directory holding cuflash_old/ (another checkout's cuflash)")
    a = ap.parse_args(argv)
    args = decode_args(a.keys, a.batch)
    scalars = (None, False, (-1, -1), 0.0, True, 0)
    fns = {"this": caller(stub_gpu(), args, scalars)}
    if a.ab:
        import importlib
        import sys

        sys.path.insert(0, a.ab)
        fns["old"] = caller(stub_gpu(importlib.import_module("cuflash_old")), args, scalars)
    decode = sys_modules_decode = __import__("cuflash.decode").decode
    entry = next(iter(decode._gpu_plans.values()))
    print("config:", entry.plan.config.name, "launches:", len(entry.plan._calls),
          "workspace:", entry.ws_bytes)
    per = {name: [] for name in fns}
    for _ in range(a.rounds):
        for name, fn in fns.items():
            per[name].append(per_call_us(fn, a.calls))
    for name, v in per.items():
        v.sort()
        print(f"{name}: _run_cached best {v[0]:.2f} us, median {v[len(v) // 2]:.2f} us per call (CPU time)")
    if a.ab:
        ratios = sorted(n / o for n, o in zip(per["this"], per["old"]))
        print(f"this / old per round: median {ratios[len(ratios) // 2]:.3f}, best-of {min(per['this']) / min(per['old']):.3f}")
    del sys_modules_decode
    if a.profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.calls):
            fns["this"]()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
