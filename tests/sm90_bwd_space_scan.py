"""Compile every valid point of sm90_bwd's tuning space (head dims 64 / 128 / 256, bf16 / fp16, causal and
not; sm_90a, nvcc) and write the clean ones (zero spills, no stack, no serialized wgmma) to
tests/sm90_bwd_space_clean.txt, which tests/test_sm90_bwd_dqconv_cpu.py checks the space against; prints the
unclean ones (make a rule refuse them: Sm90BwdConfig._problems). Not a test; about 700 kernels, ~10 min on
16 cores, an hour on 2.

    python tests/sm90_bwd_space_scan.py [--processes N] [--check]

--check: compile only the valid points the record lacks, and add the clean ones.
"""
import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]

from cuflash.compile import nvcc_compile  # noqa: E402

import test_sm90_bwd_dqconv_cpu as t  # noqa: E402
from test_sm90_bwd_sched_cpu import serialized  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    kernels = t.space_kernels()
    have = t.recorded_clean() if args.check and os.path.exists(t.RECORD) else set()
    todo = [c for n, c in sorted(kernels.items()) if n not in have]
    t0 = time.time()
    chunks = [todo[i:i + 4] for i in range(0, len(todo), 4)]
    clean, bad = set(have), []
    with ThreadPoolExecutor(args.processes) as pool:
        for chunk, reports in zip(chunks, pool.map(lambda c: nvcc_compile(c, "sm_90a"), chunks)):
            for cfg, r in zip(chunk, reports):
                if r.spill_stores or r.spill_loads or r.stack_bytes or serialized(r):
                    bad.append(f"{cfg.name}: {r}")
                else:
                    clean.add(cfg.name)
    print(f"{len(todo)} compiled in {time.time() - t0:.0f} s; {len(bad)} unclean", flush=True)
    print("\n".join(bad))
    with open(t.RECORD, "w") as f:
        f.write("# sm90_bwd kernels compiled clean (sm_90a, nvcc 13.0: zero spills, no stack, no serialized\n"
                "# wgmma), one name a line: tests/sm90_bwd_space_scan.py writes it, test_sm90_bwd_dqconv_cpu.py\n"
                "# checks every valid point of the tuning space against it\n")
        f.write("\n".join(sorted(clean)) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
