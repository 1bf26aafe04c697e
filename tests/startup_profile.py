"""Where a fresh process's first call spends its time: one child per call (cuflash.bench.startup's
child script) with its first call under cProfile, CuPy's cache warm (filled first by one throwaway
child per call, in parallel). Prints each call's first-call time and the top functions by
cumulative and by own time.

    python tests/startup_profile.py --calls window softcap --cache /tmp/warm --out DIR
"""
from __future__ import annotations

import argparse
import io
import os
import pstats
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuflash.bench import startup  # noqa: E402


def report(path: str, top: int) -> str:
    buf = io.StringIO()
    st = pstats.Stats(path, stream=buf)
    st.sort_stats("cumulative").print_stats(top)
    st.sort_stats("tottime").print_stats(top)
    text = buf.getvalue()
    return "\n".join(x for x in text.splitlines() if x.strip() and "Ordered by" not in x)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", nargs="+", default=list(startup.CALLS))
    ap.add_argument("--cache", required=True, help="the warm CUPY_CACHE_DIR (kept)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--no-fill", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.cache, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    with ThreadPoolExecutor(len(a.calls)) as pool:
        if not a.no_fill:
            for rec in pool.map(lambda c: startup.child("cuflash", a.cache, call=c), a.calls):
                print("fill", rec, flush=True)
    paths = {c: os.path.join(a.out, f"first_{c}.prof") for c in a.calls}
    with ThreadPoolExecutor(a.jobs) as pool:
        recs = list(pool.map(lambda c: startup.profile_child(c, a.cache, paths[c]), a.calls))
    for call, rec in zip(a.calls, recs):
        print(f"==== {call}: {rec}", flush=True)
        if "error" not in rec:
            text = report(paths[call], a.top)
            Path(a.out, f"first_{call}.txt").write_text(text)
            print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
