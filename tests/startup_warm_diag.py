"""What a first call compiles in a fresh process (not a test): every NVRTC compile CuPy runs
(cupy.cuda.compiler.compile_using_nvrtc: a disk-cache miss) with its name expressions and
seconds, and every cuflash module the call's plans load (cuflash.launch.get_kernels) with its
config and seconds; then the first call's wall time. Run it with CUPY_CACHE_DIR set to a cache
that ``python -m cuflash warmup ...`` filled: a compile listed is a kernel the warmup missed.

    CUPY_CACHE_DIR=DIR CUFLASH_CACHE_DIR=DIR python tests/startup_warm_diag.py CALL [CALL ...]

CALL: deterministic (causal forward + backward, deterministic=True), causal_fwdbwd, mix (causal,
window 1024, softcap 30), at bench --mode startup's shape (2 x 2048 x 16 x 128, bf16).
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

torch.cuda.init()
import cupy.cuda.compiler as cc  # noqa: E402

import cuflash  # noqa: E402
from cuflash import launch  # noqa: E402

# the CUDA path's call on a disk-cache miss (CuPy 13 / 14); older CuPy: the public name
_NAME = "_compile_using_nvrtc_no_warning" if hasattr(cc, "_compile_using_nvrtc_no_warning") else "compile_using_nvrtc"
_nvrtc = getattr(cc, _NAME)


def nvrtc(source, options=(), arch=None, filename="kern.cu", name_expressions=None, *args, **kw):
    t0 = time.perf_counter()
    try:
        return _nvrtc(source, options, arch, filename, name_expressions, *args, **kw)
    finally:
        names = list(name_expressions or [])
        print(f"  NVRTC compile {time.perf_counter() - t0:.2f} s: "
              + (", ".join(names[:2]) if names else source[:160].replace("\n", " ")), flush=True)


setattr(cc, _NAME, nvrtc)
_get = launch.get_kernels


def get_kernels(config, device):
    t0 = time.perf_counter()
    out = _get(config, device)
    print(f"  module {config.name}: {time.perf_counter() - t0:.2f} s", flush=True)
    return out


launch.get_kernels = get_kernels

b, s, h, d = 2, 2048, 16, 128
calls = [c for c in sys.argv[1:] if c != "--symbolic-first"]
if "--symbolic-first" in sys.argv:   # what a first backward imports (sympy with it), timed apart
    t0 = time.perf_counter()
    import torch.fx.experimental.symbolic_shapes  # noqa: E402,F401
    print(f"import torch.fx.experimental.symbolic_shapes: {time.perf_counter() - t0:.3f} s", flush=True)
for call in calls:
    grad = call in ("deterministic", "causal_fwdbwd")
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=grad) for _ in range(3))
    kw = {"causal": True}
    if call == "deterministic":
        kw["deterministic"] = True
    elif call == "mix":
        kw.update(window_size=(1024, 0), softcap=30.0)
    torch.cuda.synchronize()
    print(f"{call}:", flush=True)
    t0 = time.perf_counter()
    out = cuflash.flash_attn_func(q, k, v, **kw)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    if grad:
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(f"{call}: forward {t1 - t0:.3f} s, backward {t2 - t1:.3f} s", flush=True)
