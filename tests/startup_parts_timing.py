"""The parts of a warm first call's selection, timed on this host (no GPU needed; issue 12,
start-up): the shipped tuned table's YAML parse against its parsed copy (JSON), the SHA-256 that
names the copy, strip_code (the code hash) as main had it against today's, and importing yaml
and CuPy in fresh processes. Median of --reps calls.

    PYTHONPATH=$PWD python tests/startup_parts_timing.py [--reps 7]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import statistics
import subprocess
import sys
import time

from cuflash import compile as compile_mod
from cuflash import select


def median_s(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def strip_code_main(source: str) -> str:
    """strip_code as main had it (a template expansion per punctuation match)."""
    return re.sub(r" ?([^\w ]) ?", r"\1", compile_mod.code_words(source)).strip().replace("\0", "\n")


def fresh_import_s(module: str, reps: int) -> float:
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    return statistics.median(float(subprocess.run([sys.executable, "-c", code], capture_output=True,
                                                  text=True, check=True).stdout) for _ in range(reps))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    for path in sorted(select.shipped_dir().glob("*.yaml")):
        text = path.read_text()
        data = select._yaml_load(text)
        dumped = json.dumps(data)
        print(f"{path.name} ({len(text)} chars): YAML parse {1e3 * median_s(lambda: select._yaml_load(text), a.reps):.1f} ms, "
              f"parsed copy (json.loads) {1e3 * median_s(lambda: json.loads(dumped), a.reps):.2f} ms, "
              f"SHA-256 of the text {1e3 * median_s(lambda: hashlib.sha256(text.encode()).hexdigest(), a.reps):.2f} ms")
    for family in ("sm90_fwd", "sm90_bwd", "decode_splitkv"):
        src = compile_mod.render_source(family)
        assert strip_code_main(src) == compile_mod.strip_code(src)
        print(f"strip_code {family} ({len(src)} chars): main {1e3 * median_s(lambda: strip_code_main(src), a.reps):.1f} ms, "
              f"today {1e3 * median_s(lambda: compile_mod.strip_code(src), a.reps):.1f} ms (same text)")
    for module in ("yaml", "cupy"):
        print(f"import {module} in a fresh process: {1e3 * fresh_import_s(module, 3):.0f} ms (median of 3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
