"""Run pytest with sm90_bwd's varlen switches set for the process (issue 12): VARLEN_SMALL_D (plain varlen
backwards at kernel head dims 64 / 96 on sm90_bwd) and VARLEN_SMALL_D_FEATURES (with window / softcap /
ALiBi / dropout), so that the GPU tests run through selection what the switches would ship. Not a test:

    python tests/sm90_varlen_bwd_switches.py --small-d 64,96 --features-d 64 -- -q tests/test_varlen_features_gpu.py

--parallel N runs the collected test ids N processes at a time (each compiles its own kernels: a cold
cache's compiles overlap), printing each one's summary line.
"""
import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout


def dims(text):
    return frozenset(int(x) for x in text.split(",") if x)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small-d", default="64", help="sm90_bwd.VARLEN_SMALL_D, kernel head dims (64, 96)")
    ap.add_argument("--features-d", default="", help="sm90_bwd.VARLEN_SMALL_D_FEATURES, kernel head dims")
    ap.add_argument("--parallel", type=int, default=0, help="run the test ids this many processes at a time")
    ap.add_argument("pytest_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    rest = [a for a in args.pytest_args if a != "--"]
    if args.parallel:
        ids = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *rest], capture_output=True,
                             text=True).stdout.split()
        ids = [i for i in ids if "::" in i]
        me = [sys.executable, os.path.abspath(__file__), "--small-d", args.small_d, "--features-d", args.features_d,
              "--", "-q", "-p", "no:cacheprovider"]
        procs, bad = [], 0
        for i in range(0, len(ids), args.parallel):
            batch = [(t, subprocess.Popen(me + [t], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
                     for t in ids[i:i + args.parallel]]
            for t, p in batch:
                out = p.communicate()[0]
                last = out.strip().splitlines()[-1] if out.strip() else "(no output)"
                print(f"{t}: rc {p.returncode}: {last}", flush=True)
                if p.returncode:
                    bad += 1
                    print("\n".join(out.strip().splitlines()[-25:]), flush=True)
            procs += batch
        print(f"{len(procs) - bad} of {len(procs)} test ids passed")
        sys.exit(1 if bad else 0)
    from cuflash.families import sm90_bwd

    sm90_bwd.VARLEN_SMALL_D = dims(args.small_d)
    sm90_bwd.VARLEN_SMALL_D_FEATURES = dims(args.features_d)
    print(f"sm90_bwd.VARLEN_SMALL_D = {sorted(sm90_bwd.VARLEN_SMALL_D)}, "
          f"VARLEN_SMALL_D_FEATURES = {sorted(sm90_bwd.VARLEN_SMALL_D_FEATURES)}", flush=True)
    import pytest

    sys.exit(pytest.main(rest))


if __name__ == "__main__":
    main()
