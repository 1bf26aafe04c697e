"""python -m cuflash {demo, info, bench, tune, warmup}

Every command that needs a GPU says so in one line and exits with code 2 when there is none.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from . import _gpu


def demo(argv=None) -> int:
    """Compile, run, check against the float64 reference, time next to torch SDPA."""
    from . import reference

    reason = _gpu.why_unavailable()
    if reason:
        from .problem import Problem
        from .registry import families

        print(f"cuflash demo: no GPU here ({reason}).")
        print("Running the NumPy reference instead (float64, the oracle every kernel is tested against):")
        rng = np.random.default_rng()
        q = rng.standard_normal((2, 203, 4, 64))
        k = rng.standard_normal((2, 113, 2, 64))
        v = rng.standard_normal((2, 113, 2, 64))
        for causal in (False, True):
            t0 = time.perf_counter()
            o_naive = reference.attention_naive(q, k, v, causal=causal)
            o_tiled, _ = reference.attention_tiled(q, k, v, causal=causal)
            dt = time.perf_counter() - t0
            print(f"  q{q.shape} k{k.shape} GQA causal={causal}: tiled FA2 vs naive "
                  f"max|dO| = {np.abs(o_naive - o_tiled).max():.2e}  ({dt * 1e3:.0f} ms)")
        problem = Problem("fwd", "bf16", 1, 4096, 4096, 16, 16, 128, True)
        for fam in families("fwd"):
            cfg = fam.heuristic(problem, (9, 0))
            print(f"  {fam.name} heuristic for an H100, bf16 d=128 causal: {cfg.name} ({cfg.smem_bytes} B smem)")
        return 0

    import ml_dtypes

    from .api import flash_attn_func
    from .select import choose_on_device
    from .problem import Problem

    print(f"cuflash demo on {_gpu.name()} (sm_{''.join(map(str, _gpu.arch()))})")
    rng = np.random.default_rng()
    b, s, h, d = 2, 1024, 8, 128
    q, k, v = (rng.standard_normal((b, s, h, d)).astype(ml_dtypes.bfloat16) for _ in range(3))
    for causal in (False, True):
        t0 = time.perf_counter()
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        dt = time.perf_counter() - t0
        ref = reference.attention_naive(q, k, v, causal=causal)
        low = reference.lowp_attention(q, k, v, causal=causal, dtype=ml_dtypes.bfloat16)
        err, base = np.abs(out.astype(np.float64) - ref).max(), np.abs(low - ref).max()
        fam, cfg, _ = choose_on_device(Problem("fwd", "bf16", b, s, s, h, h, d, causal), 0)
        print(f"  bf16 {q.shape} causal={causal}: {fam.name} {cfg.name}, first call {dt:.2f} s "
              f"(compile or load + run); max err {err:.2e} vs plain bf16 {base:.2e} "
              f"-> {'within' if err <= 2 * base + 1e-5 else 'OUTSIDE'} the 2x rule")
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        print("  (torch not installed: no SDPA comparison)")
        return 0
    from .registry import op_flops
    from .timing import time_ms

    b, s, h, d = 4, 4096, 16, 128
    for causal in (False, True):
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        f = op_flops(Problem("fwd", "bf16", b, s, s, h, h, d, causal))
        ours = time_ms(lambda: flash_attn_func(q, k, v, causal=causal)).median_ms
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            theirs = time_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)).median_ms
        print(f"  b={b} s={s} h={h} d={d} causal={causal}: cuflash {f / ours / 1e9:.0f} TFLOPs/s, "
              f"SDPA flash {f / theirs / 1e9:.0f} TFLOPs/s")
    return 0


def info(argv=None) -> int:
    """The GPU, the tuned tables found, the config in force; --families: the registry."""
    parser = argparse.ArgumentParser(prog="python -m cuflash info")
    parser.add_argument("--families", action="store_true",
                        help="list the registered kernel families, their ops and archs")
    args = parser.parse_args(argv)
    from .tuning.cli import info_families_lines, info_lines

    print("\n".join(info_families_lines() if args.families else info_lines()))
    return 0


def tune(argv=None) -> int:
    """python -m cuflash tune [...]: see tuning/cli.py."""
    from .tuning.cli import tune_main

    return tune_main(argv)


def bench(argv=None) -> int:
    from .bench import main as bench_main

    return bench_main(argv) or 0


def warmup(argv=None) -> int:
    """Precompile this GPU's tuned configs (and the heuristics) in parallel, with progress."""
    from .warmup import main as warmup_main

    return warmup_main(argv)


COMMANDS = {"demo": demo, "info": info, "bench": bench, "tune": tune, "warmup": warmup}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m cuflash")
    parser.add_argument("command", choices=list(COMMANDS))
    args, rest = parser.parse_args(argv[:1]), argv[1:]  # the rest (--help too) is the command's
    try:
        return COMMANDS[args.command](rest) or 0
    except _gpu.NoGPUError as exc:
        print(f"cuflash {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
