"""Compile, in parallel worker processes, every kernel of tests/test_sm90_psmem_gpu.py and
tests/sm90_fwd_d64_timing.py (bf16 and fp16) into CuPy's disk cache (not a test; run it first):

    python tests/sm90_fwd_d64_precompile.py
"""
import os
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]  # the tests; cuflash from the checkout

from cuflash.compile import precompile  # noqa: E402

import sm90_fwd_d64_timing  # noqa: E402
import test_sm90_psmem_gpu  # noqa: E402


def main():
    configs = list(dict.fromkeys(test_sm90_psmem_gpu.configs() + sm90_fwd_d64_timing.all_configs("bf16")
                                 + ([] if "--bf16-only" in sys.argv else sm90_fwd_d64_timing.all_configs("fp16"))))
    t0 = time.time()
    results = precompile(configs)
    bad = [(c.name, e) for c, _, e in results if e]
    for c, secs, e in results:
        print(f"{secs:6.1f} s  {c.name}{'  FAILED' if e else ''}")
    print(f"{len(configs)} kernels in {time.time() - t0:.0f} s")
    if bad:
        for name, e in bad:
            print(name, e[-2000:])
        sys.exit(1)


if __name__ == "__main__":
    main()
