"""Pick the ring variant a later bench run should use (--ring-set), from a ring.json that
``bench --mode ring --ring-ab ...`` wrote (not a test; the GPU request's glue).

    python tests/ring_pick_variant.py RING_JSON [--candidates lib_priority fwd_dyn ...]

Prints one name on stdout: the candidate whose alt_<name>_tflops_per_gpu, as a ratio to the
ring as run, has the best geometric mean over the ring records that timed it, if that mean is
at least --min-gain (default 1.005); else "none" (the ring as it is). Every candidate's ratios
go to stderr. Candidates: variants the library can run by its own settings (EARLY_SEND,
RING_MAX_CTAS; FWD_DYNAMIC and PRIORITY_GROUP are on since session 16's first 4-GPU run), so
that a run with --ring-set measures what a default would be.
"""
import argparse
import json
import math
import sys

CANDIDATES = ("lib_ctas2", "lib_ctas4", "lib_ctas8", "early_send")


def ratios(records, name) -> list:
    """alt_<name>'s TFLOPs / the ring's, per ring record that has both."""
    out = []
    for r in records:
        alt = r.get(f"alt_{name}_tflops_per_gpu")
        if r.get("impl") == "ring" and alt and r.get("tflops_per_gpu"):
            out.append(alt / r["tflops_per_gpu"])
    return out


def pick(records, candidates=CANDIDATES, min_gain=1.005, log=None) -> str:
    best, best_gain = "none", min_gain
    for name in candidates:
        rs = ratios(records, name)
        if not rs:
            if log:
                log(f"{name}: not timed")
            continue
        gain = math.exp(sum(math.log(x) for x in rs) / len(rs))
        if log:
            log(f"{name}: x{gain:.3f} ({', '.join(f'{x:.3f}' for x in rs)})")
        if gain >= best_gain:
            best, best_gain = name, gain
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("ring_json")
    ap.add_argument("--candidates", nargs="+", default=list(CANDIDATES))
    ap.add_argument("--min-gain", type=float, default=1.005)
    ap.add_argument("--summary", action="store_true",
                    help="only print every record in one short line (stdout), no pick")
    a = ap.parse_args(argv)
    with open(a.ring_json) as f:
        records = json.load(f)
    if isinstance(records, dict):  # {"records": [...], ...}
        records = records.get("records", [])
    if a.summary:
        for r in records:
            print(summary(r))
        return 0
    print(pick(records, a.candidates, a.min_gain, log=lambda m: print(m, file=sys.stderr)))
    return 0


def summary(r) -> str:
    """One record in a line: impl, problem, TFLOPs (per GPU), efficiency, the variants'."""
    tf = r.get("tflops_per_gpu", r.get("tflops"))
    line = (f"{r.get('impl')}{'[' + r['backend'] + ']' if r.get('backend') else ''} P={r.get('P')} "
            f"s={r.get('seqlen')} causal={r.get('causal')}: "
            + (f"{tf:.0f} TFLOPs/GPU" if tf else r.get("error") or r.get("skipped") or "-"))
    if r.get("efficiency"):
        line += f", eff {r['efficiency']:.3f}"
    if r.get("ring_set"):
        line += f", as run {r['ring_set']}"
    alts = sorted(k[4:-len("_tflops_per_gpu")] for k in r if k.startswith("alt_")
                  and k.endswith("_tflops_per_gpu"))
    line += "".join(f"; {n} {r[f'alt_{n}_tflops_per_gpu']:.0f}" for n in alts)
    errs = [f"; {k[4:-6]} error {r[k]}" for k in r if k.startswith("alt_") and k.endswith("_error")]
    return line + "".join(errs)


if __name__ == "__main__":
    sys.exit(main())
