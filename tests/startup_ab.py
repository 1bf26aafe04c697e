"""Two cuflash trees' first calls in fresh processes, interleaved (before / after a change): each
repeat runs every call once per tree, the trees' order alternating, one child at a time (--paired:
the two at once), CuPy's
cache warm (one shared CUPY_CACHE_DIR, filled first by throwaways of both trees in parallel: the
kernel sources are the same). The children are cuflash.bench.startup's (this tree's bench).

    python tests/startup_ab.py --before DIR --after DIR --calls causal window --repeats 3 --cache W
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuflash.bench import startup  # noqa: E402
from cuflash.bench.common import median  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--calls", nargs="+", default=list(startup.CALLS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--json", default="")
    ap.add_argument("--no-fill", action="store_true")
    ap.add_argument("--shape", type=int, nargs=4, default=list(startup.SHAPE))
    ap.add_argument("--paired", action="store_true",
                    help="run each call's two children at the same time (a paired comparison: "
                         "both share the host's load)")
    a = ap.parse_args()
    trees = {"before": os.path.abspath(a.before), "after": os.path.abspath(a.after)}
    os.makedirs(a.cache, exist_ok=True)

    def run(tree, call):
        env = {"PYTHONPATH": os.pathsep.join(x for x in (trees[tree], os.environ.get("PYTHONPATH", "")) if x)}
        rec = startup.child("cuflash", a.cache, tuple(a.shape), call=call, env=env)
        rec["tree"] = tree
        return rec

    if not a.no_fill:
        jobs = [(t, c) for c in a.calls for t in trees]
        with ThreadPoolExecutor(len(jobs)) as pool:
            for rec in pool.map(lambda j: run(*j), jobs):
                if "error" in rec:
                    print("fill", rec, flush=True)
    runs = {(t, c): [] for t in trees for c in a.calls}
    pair = ThreadPoolExecutor(2) if a.paired else None
    for i in range(a.repeats):
        for j, call in enumerate(a.calls):
            order = list(trees) if (i + j) % 2 == 0 else list(trees)[::-1]
            recs = list(pair.map(lambda t: run(t, call), order)) if pair else [run(t, call) for t in order]
            for tree, rec in zip(order, recs):
                runs[(tree, call)].append(rec)
                print(f"  {i + 1}/{a.repeats} {call:>13} {tree:>6}: "
                      + (rec["error"] if "error" in rec else
                         f"first call {rec['first_call_s']:.3f} s, import {rec['import_s']:.3f} s"), flush=True)
    print("| call | before: first call (import) s | after: first call (import) s |")
    print("| --- | --- | --- |")
    out = []
    for call in a.calls:
        cells = []
        for tree in trees:
            rs = [r for r in runs[(tree, call)] if "first_call_s" in r]
            f, im = median(r["first_call_s"] for r in rs), median(r["import_s"] for r in rs)
            out.append(dict(call=call, tree=tree, first_call_s=f, import_s=im,
                            first_call_runs=[r["first_call_s"] for r in rs]))
            cells.append("-" if f is None else f"{f:.3f} ({im:.3f})")
        print(f"| {call} | {cells[0]} | {cells[1]} |")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
