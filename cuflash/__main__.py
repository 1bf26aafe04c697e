"""python -m cuflash {demo,bench,info,tune}"""
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
        print(f"  bf16 {q.shape} causal={causal}: config {config_for(d, 'bf16', causal, seqlen=s).name}, "
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
    """The GPU, the tuned tables found, and the config in force with where it came from."""
    from tuning.cli import info_lines

    print("\n".join(info_lines()))
    return 0


def tune(argv=None) -> int:
    """python -m cuflash tune [...]: see tuning/cli.py (exit 2 where tuning is impossible)."""
    from tuning.cli import tune_main

    return tune_main(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m cuflash")
    parser.add_argument("command", choices=["demo", "bench", "info", "tune"])
    args, rest = parser.parse_args(argv[:1]), argv[1:]  # the rest (--help too) is the command's
    if args.command == "bench":
        from .bench import main as bench_main

        bench_main(rest)
        return 0
    return {"demo": demo, "info": info, "tune": tune}[args.command](rest)


if __name__ == "__main__":
    sys.exit(main())
