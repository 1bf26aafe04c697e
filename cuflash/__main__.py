"""python -m cuflash {demo,bench,info}"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def demo(argv=None) -> int:
    """Compile, run, check against the float64 reference, time next to torch SDPA."""
    from . import _gpu, reference
    from .config import default_fwd_config

    reason = _gpu.why_unavailable()
    if reason:
        print(f"cuflash demo: no GPU here ({reason}).")
        print("Running the NumPy reference instead (float64, the oracle every kernel is tested against):")
        rng = np.random.default_rng()
        q = rng.standard_normal((2, 203, 4, 64))
        k = rng.standard_normal((2, 113, 2, 64))
        v = rng.standard_normal((2, 113, 2, 64))
        for causal in (False, True):
            t0 = time.perf_counter()
            o_naive, lse_naive = reference.attention_naive(q, k, v, causal=causal, return_lse=True)
            o_tiled, lse_tiled = reference.attention_tiled(q, k, v, causal=causal)
            dt = time.perf_counter() - t0
            diff = np.abs(o_naive - o_tiled).max()
            print(f"  q{q.shape} k{k.shape} GQA causal={causal}: tiled FA2 vs naive "
                  f"max|dO| = {diff:.2e}  ({dt * 1e3:.0f} ms)")
        cfg = default_fwd_config(128, "bf16", True)
        print(f"  default H100 config for bf16 d=128 causal: {cfg.name} ({cfg.smem_bytes} B smem)")
        return 0

    import cupy

    from .bench import flops, time_ms
    from .interface import config_for, flash_attn_func

    print(f"cuflash demo on {_gpu.name()} (sm_{''.join(map(str, _gpu.arch()))})")
    rng = np.random.default_rng()
    import ml_dtypes

    b, s, h, d = 2, 1024, 8, 128
    q, k, v = (rng.standard_normal((b, s, h, d)).astype(ml_dtypes.bfloat16) for _ in range(3))
    for causal in (False, True):
        t0 = time.perf_counter()
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        dt = time.perf_counter() - t0
        ref = reference.attention_naive(q, k, v, causal=causal)
        low = reference.lowp_attention(q, k, v, causal=causal, dtype=ml_dtypes.bfloat16)
        err, base = np.abs(out.astype(np.float64) - ref).max(), np.abs(low - ref).max()
        print(f"  bf16 {q.shape} causal={causal}: config {config_for(d, 'bf16', causal).name}, "
              f"first call {dt:.2f} s (compile+run); max err {err:.2e} vs plain bf16 {base:.2e} "
              f"-> {'OK' if err <= 2 * base + 1e-5 else 'FAIL'}")
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("  (torch not installed: no SDPA comparison)")
        return 0
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, s, h, d = 4, 4096, 16, 128
    for causal in (False, True):
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        f = flops(b, h, s, s, d, causal)
        ours = time_ms(lambda: flash_attn_func(q, k, v, causal=causal))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            theirs = time_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
        print(f"  b={b} s={s} h={h} d={d} causal={causal}: cuflash {f / ours / 1e9:.0f} TFLOPs/s, "
              f"SDPA flash {f / theirs / 1e9:.0f} TFLOPs/s")
    cupy.cuda.Device().synchronize()
    return 0


def info(argv=None) -> int:
    from . import __version__, _gpu
    from .interface import config_for
    from .kernels import source_hash

    print(f"cuflash {__version__}, kernel source flash_fwd {source_hash('flash_fwd')}")
    reason = _gpu.why_unavailable()
    if reason:
        print(f"GPU: none ({reason})")
        return 0
    print(f"GPU: {_gpu.name()}, sm_{''.join(map(str, _gpu.arch()))}, "
          f"{_gpu.max_smem()} B shared memory per block")
    for dtype in ("bf16", "fp16"):
        for d in (64, 128, 256):
            for causal in (False, True):
                print(f"  fwd {dtype} d={d:3} causal={causal!s:5}: {config_for(d, dtype, causal).name}"
                      "  (heuristic)")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m cuflash")
    parser.add_argument("command", choices=["demo", "bench", "info"])
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        from .bench import main as bench_main

        bench_main(rest)
        return 0
    return {"demo": demo, "info": info}[args.command](rest)


if __name__ == "__main__":
    sys.exit(main())
