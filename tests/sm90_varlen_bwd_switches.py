"""Run pytest with sm90_bwd's varlen switches set for the process (issue 12): VARLEN_SMALL_D (plain varlen
backwards at kernel head dims 64 / 96 on sm90_bwd) and VARLEN_SMALL_D_FEATURES (with window / softcap /
ALiBi / dropout), so that the GPU tests run through selection what the switches would ship. Not a test:

    python tests/sm90_varlen_bwd_switches.py --small-d 64,96 --features 64:window,softcap,alibi -- -q \
        tests/test_varlen_features_gpu.py

(without --small-d / --features the module's own values: what ships).

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


def feature_sets(text):
    """'64:window,softcap;96:alibi' -> {64: {("window",), ("softcap",)}, 96: {("alibi",)}} (single features)."""
    out = {}
    for part in filter(None, text.split(";")):
        d, feats = part.split(":")
        out[int(d)] = frozenset((f,) for f in feats.split(",") if f)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small-d", default=None, help="sm90_bwd.VARLEN_SMALL_D, kernel head dims (64,96)")
    ap.add_argument("--features", default=None,
                    help="sm90_bwd.VARLEN_SMALL_D_FEATURES as 'd:feature,feature;d:...' (single features)")
    ap.add_argument("--parallel", type=int, default=0, help="run the test ids this many processes at a time")
    ap.add_argument("pytest_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    rest = [a for a in args.pytest_args if a != "--"]
    if args.parallel:
        ids = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *rest], capture_output=True,
                             text=True).stdout.split()
        ids = [i for i in ids if "::" in i]
        me = [sys.executable, os.path.abspath(__file__)]
        me += ["--small-d", args.small_d] if args.small_d is not None else []
        me += ["--features", args.features] if args.features is not None else []
        me += ["--", "-q", "-p", "no:cacheprovider"]
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

    if args.small_d is not None:
        sm90_bwd.VARLEN_SMALL_D = dims(args.small_d)
    if args.features is not None:
        sm90_bwd.VARLEN_SMALL_D_FEATURES = feature_sets(args.features)
    print(f"sm90_bwd.VARLEN_SMALL_D = {sorted(sm90_bwd.VARLEN_SMALL_D)}, "
          f"VARLEN_SMALL_D_FEATURES = {sm90_bwd.VARLEN_SMALL_D_FEATURES}", flush=True)
    import pytest

    sys.exit(pytest.main(rest))


if __name__ == "__main__":
    main()
