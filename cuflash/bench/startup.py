"""--mode startup: what the first call costs, in fresh processes.

Each measurement is a fresh child (``sys.executable -c ...``) that imports torch, runs
``torch.cuda.init()``, makes q, k, v (batch 2, seqlen 2k, 16 heads, d 128, bf16) and
synchronizes, then times

* cuflash: (a) ``import cuflash`` (import_s) and (b) the first
  ``cuflash.flash_attn_func(q, k, v, causal=True)`` + synchronize (first_call_s);
* sdpa_flash / sdpa_cudnn: the first ``scaled_dot_product_attention(..., is_causal=True)``
  pinned to that backend + synchronize (first_call_s).

cuflash's cache: warm = its kernels already in CuPy's disk cache (a CUPY_CACHE_DIR that
one throwaway child filled first); cold = a fresh empty CUPY_CACHE_DIR per child, so NVRTC
compiles. SDPA compiles nothing at run time (cache "n/a"). Each (impl, cache) runs
--repeats times (default 3), the children interleaved; records carry the median and every
run. Writes results/<gpu>/startup.json; records: impl, cache, first_call_s, import_s
(cuflash), first_call_runs, import_runs, child_wall_s; prints the comparison of cuflash's
warm first call with SDPA's first call + 0.5 s.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .. import _gpu
from .common import median, results_dir, write_json

SHAPE = (2, 2048, 16, 128)      # batch, seqlen, heads, head dim
BUDGET_S = 0.5                  # cuflash's warm first call against SDPA's first call + this
MARK = "CUFLASH_STARTUP "

CHILD = r'''
import json, sys, time
impl, b, s, h, d = sys.argv[1], *map(int, sys.argv[2:6])
import torch
torch.cuda.init()
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
torch.cuda.synchronize()
rec = {"impl": impl}
if impl == "cuflash":
    t0 = time.perf_counter()
    import cuflash
    rec["import_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    cuflash.flash_attn_func(q, k, v, causal=True)
    torch.cuda.synchronize()
else:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION,
               "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[impl]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    t0 = time.perf_counter()
    with sdpa_kernel(backend):
        F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    torch.cuda.synchronize()
rec["first_call_s"] = time.perf_counter() - t0
print("''' + MARK + r'''" + json.dumps(rec), flush=True)
'''


def child_env(cache_dir: str) -> dict:
    """The environment of a child: CUPY_CACHE_DIR set, this cuflash first on the path."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(x for x in (root, os.environ.get("PYTHONPATH", "")) if x)
    return dict(os.environ, CUPY_CACHE_DIR=cache_dir, PYTHONPATH=path)


def parse_child(stdout: str, mark: str = MARK):
    """The child's JSON record (the last line starting with mark), or None."""
    lines = [x for x in stdout.splitlines() if x.startswith(mark)]
    return json.loads(lines[-1][len(mark):]) if lines else None


def child(impl: str, cache_dir: str, shape=SHAPE, timeout: float = 300.0) -> dict:
    """One fresh process's record, with child_wall_s (its whole life) or an error."""
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-c", CHILD, impl, *map(str, shape)],
                           env=child_env(cache_dir), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"impl": impl, "error": f"timed out after {timeout:.0f} s"}
    rec = parse_child(r.stdout)
    if rec is None:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        return {"impl": impl, "error": f"exit {r.returncode}: " + " | ".join(tail)}
    rec["child_wall_s"] = time.perf_counter() - t0
    return rec


def summarize(impl: str, cache: str, runs: list) -> dict:
    """One record from the runs of (impl, cache): medians, and every run."""
    ok = [r for r in runs if "first_call_s" in r]
    rec = dict(impl=impl, cache=cache, first_call_s=median(r["first_call_s"] for r in ok),
               first_call_runs=[r["first_call_s"] for r in ok],
               child_wall_s=median(r["child_wall_s"] for r in ok))
    if impl == "cuflash":
        rec.update(import_s=median(r["import_s"] for r in ok), import_runs=[r["import_s"] for r in ok])
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        rec["errors"] = errors
    return rec


def comparison(records: list, budget_s: float = BUDGET_S) -> dict:
    """cuflash's warm first call against each SDPA impl's first call + budget_s."""
    by = {(r["impl"], r["cache"]): r for r in records}
    mine = by.get(("cuflash", "warm"), {}).get("first_call_s")
    out = {"cuflash_warm_first_call_s": mine, "budget_s": budget_s}
    for (impl, _), r in by.items():
        theirs = r.get("first_call_s")
        if impl.startswith("sdpa") and theirs is not None:
            out[impl] = {"first_call_s": theirs, "plus_budget_s": theirs + budget_s,
                         "cuflash_minus_that_s": None if mine is None else mine - theirs - budget_s}
    return out


def comparison_lines(cmp_: dict) -> list:
    mine = cmp_["cuflash_warm_first_call_s"]
    out = []
    for impl, c in cmp_.items():
        if not isinstance(c, dict):
            continue
        if mine is None:
            out.append(f"cuflash warm first call: no number; {impl} first call {c['first_call_s']:.3f} s")
            continue
        out.append(f"cuflash warm first call {mine:.3f} s vs {impl} first call + {cmp_['budget_s']} s "
                   f"= {c['plus_budget_s']:.3f} s: difference {c['cuflash_minus_that_s']:+.3f} s")
    return out


def run(repeats: int = 3, shape=SHAPE, out="results", log=print) -> list:
    _gpu.require("bench --mode startup")
    warm = tempfile.mkdtemp(prefix="cuflash_startup_warm_")
    cold_dirs = []
    plan = [("cuflash", "warm"), ("cuflash", "cold"), ("sdpa_flash", "n/a"), ("sdpa_cudnn", "n/a")]
    runs = {key: [] for key in plan}
    try:
        first = child("cuflash", warm, shape)  # throwaway: fills the warm cache
        if "error" in first:
            log(f"  throwaway cuflash child: {first['error']}")
        for i in range(repeats):
            for impl, cache in plan:
                if cache == "cold":
                    cold_dirs.append(tempfile.mkdtemp(prefix="cuflash_startup_cold_"))
                    rec = child(impl, cold_dirs[-1], shape)
                else:
                    rec = child(impl, warm, shape)
                runs[(impl, cache)].append(rec)
                log(f"  run {i + 1}/{repeats} {impl} cache={cache}: "
                    + (rec["error"] if "error" in rec else f"first call {rec['first_call_s']:.3f} s"
                       + (f", import {rec['import_s']:.3f} s" if "import_s" in rec else "")))
    finally:
        for d in [warm] + cold_dirs:
            shutil.rmtree(d, ignore_errors=True)
    records = [summarize(impl, cache, runs[(impl, cache)]) for impl, cache in plan]
    cmp_ = comparison(records)
    path = results_dir(out) / "startup.json"
    write_json(path, records, shape=dict(zip(("batch", "seqlen", "nheads", "hdim"), shape)),
               causal=True, dtype="bf16", repeats=repeats, comparison=cmp_)
    for r in records:
        log(f"{r['impl']:>10} cache={r['cache']:4}: first call "
            + (f"{r['first_call_s']:.3f} s" if r["first_call_s"] is not None else "-")
            + (f", import cuflash {r['import_s']:.3f} s" if r.get("import_s") is not None else "")
            + f" (median of {len(r['first_call_runs'])})")
    for text in comparison_lines(cmp_):
        log(text)
    log(f"wrote {path}")
    return records
