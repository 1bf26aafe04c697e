"""Fill CuPy's kernel cache for the GPU test grids, in parallel (not a test; run it first).

    CUPY_CACHE_DIR=... python tests/gpu_precompile.py [--space]
"""
import sys
import time

from cuflash import _gpu
from cuflash.config import (DTYPES, default_bwd_config, default_fwd_config, valid_bwd_configs,
                            valid_fwd_configs)
from cuflash.kernels import precompile


def main():
    HDIMS = (32, 40, 64, 72, 96, 128, 160, 256)
    arch, smem = _gpu.arch(), _gpu.max_smem()
    configs = []
    for d in HDIMS:
        for dtype in DTYPES:
            for causal in (False, True):
                configs.append(default_fwd_config(d, dtype, causal, arch, smem))
                configs.append(default_bwd_config(d, dtype, causal, arch, smem))
    configs.append(default_bwd_config(128, "bf16", True, arch, smem, deterministic=True))
    if "--space" in sys.argv:
        for d in (64, 128):
            for causal in (False, True):
                configs += valid_fwd_configs(d, "bf16", causal, smem) + valid_bwd_configs(d, "bf16", causal, smem)
    start = time.perf_counter()
    results = precompile(configs)
    errors = [(c.name, e) for c, _, e in results if e]
    slowest = max(results, key=lambda r: r[1])
    print(f"precompiled {len(results)} kernels in {time.perf_counter() - start:.1f} s "
          f"(slowest {slowest[0].name}: {slowest[1]:.1f} s)")
    for name, e in errors:
        print(f"  FAILED {name}: {e[:2000]}")
    return 1 if errors else 0


if __name__ == "__main__":  # spawned workers re-import this file: only the parent compiles
    sys.exit(main())
