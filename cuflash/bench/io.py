"""--mode io: the FlashAttention paper's IO table (its Figure 2, left), measured here.

Setting: GPT-2 medium attention, batch 64, 16 heads, seqlen 1024, head dim 64, bf16, not
causal (--io-causal for the mask), forward + backward, for

* standard: plain torch attention, ``softmax(Q Kᵀ · scale) V`` as three bf16 ops
  (matmul, softmax, matmul), backward by autograd;
* sdpa_flash: torch SDPA pinned to its flash backend;
* cuflash: ``cuflash.flash_attn_func`` (torch autograd).

Per impl:

1. GFLOPs of one forward + backward, counting the backward's recompute (multiply-add = 2
   FLOPs; softmax and other elementwise work not counted):
   standard: forward 4·b·h·s²·d (Q Kᵀ and P V), backward 8·b·h·s²·d (dV, dP, dQ, dK);
   flash (sdpa_flash, cuflash): the same plus the backward's recompute of S = Q Kᵀ,
   2·b·h·s²·d, i.e. 14·b·h·s²·d. Causal: the flash kernels skip the masked half (÷2);
   standard attention computes the whole matrix and masks it (no ÷2).
2. HBM bytes read and written, by Nsight Compute: the mode runs one child process per
   (impl, shape) under ``ncu --metrics dram__bytes_read.sum,dram__bytes_write.sum --csv
   --print-units base --target-processes all --profile-from-start off``; the child runs
   one untimed warm-up step, then one step between cudaProfilerStart and cudaProfilerStop
   (torch.cuda.profiler), so ncu profiles exactly the kernels of that step, and the parent
   sums the metrics over them. ncu flushes the caches before each profiled kernel (its
   default --cache-control all): each kernel's inputs come from HBM, as they mostly do at
   these sizes. Without ncu (not on PATH nor in /usr/local/cuda/bin), or when this process
   already runs under a profiler (CUDA_INJECTION64_PATH set), the bytes are null with a note.
3. Runtime: one forward + backward (``torch.autograd.grad``), cuflash.timing back to back.

Then the same as the sequence grows: batch 1, 16 heads, d 64, seqlen 1k .. 16k
(--io-seqlens), all three impls; an out-of-memory error gives null numbers and "oom": true.

Writes results/<gpu>/io_table.json and io_table.md (the paper's A100 numbers beside:
standard 66.6 GFLOPs, 40.3 GB, 41.7 ms; FlashAttention 75.2 GFLOPs, 4.4 GB, 7.3 ms).
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .. import _gpu
from .common import (gpu_label, is_oom, release, results_dir, sdpa, cuflash as cuflash_fn, short,
                     synchronize, write_json)
from .startup import parse_child

IMPLS = ("standard", "sdpa_flash", "cuflash")
MAIN = dict(batch=64, nheads=16, seqlen=1024, hdim=64)        # GPT-2 medium
GROWTH_SEQLENS = (1024, 2048, 4096, 8192, 16384)
GROWTH = dict(batch=1, nheads=16, hdim=64)
METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
PAPER_A100 = {"standard": dict(gflops=66.6, hbm_gb=40.3, runtime_ms=41.7),
              "flash": dict(gflops=75.2, hbm_gb=4.4, runtime_ms=7.3)}
NAMES = {"standard": "Standard attention", "sdpa_flash": "SDPA flash", "cuflash": "cuflash"}
FORMULA = ("GFLOPs of forward + backward, multiply-add = 2 FLOPs, elementwise work not counted: "
           "standard 4·b·h·s²·d (fwd) + 8·b·h·s²·d (bwd) = 12·b·h·s²·d; flash adds the "
           "backward's recompute of S = QKᵀ, 2·b·h·s²·d, = 14·b·h·s²·d, halved under a causal "
           "mask (masked blocks skipped; standard attention computes the full matrix).")
MARK = "CUFLASH_IO "
UNITS = {"byte": 1.0, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12}


def gflops(impl: str, batch: int, nheads: int, seqlen: int, hdim: int, causal: bool = False) -> float:
    """GFLOPs of one forward + backward (see FORMULA)."""
    unit = batch * nheads * seqlen * seqlen * hdim
    if impl == "standard":
        return 12 * unit / 1e9
    return 14 * unit / (2 if causal else 1) / 1e9


# ---------------------------------------------------------------------------------------
# the step

def standard_attention(q, k, v, causal: bool):
    """Plain attention in three bf16 ops on (b, s, h, d) tensors; returns (b, s, h, d)."""
    import torch

    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    s = (qt @ kt.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), -math.inf)
    return (torch.softmax(s, dim=-1) @ vt).transpose(1, 2)


def step_fn(impl: str, batch: int, nheads: int, seqlen: int, hdim: int, causal: bool):
    """A callable running one forward + backward of impl on fresh bf16 inputs."""
    import torch

    f = {"standard": lambda q, k, v: standard_attention(q, k, v, causal),
         "sdpa_flash": sdpa("sdpa_flash", causal),
         "cuflash": cuflash_fn(causal)}[impl]
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(batch, seqlen, nheads, hdim, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    leaves = [x.requires_grad_() for x in (q, k, v)]
    return lambda: torch.autograd.grad(f(*leaves), leaves, dout)


def child_main(argv=None) -> int:
    """Under ncu: one warm-up step, then one step inside cudaProfilerStart/Stop."""
    import torch

    ap = argparse.ArgumentParser(prog="python -m cuflash.bench.io")
    ap.add_argument("--child", required=True, choices=IMPLS)
    for name in ("batch", "nheads", "seqlen", "hdim"):
        ap.add_argument(f"--{name}", type=int, required=True)
    ap.add_argument("--causal", action="store_true")
    a = ap.parse_args(argv)
    rec = {"impl": a.child}
    try:
        step = step_fn(a.child, a.batch, a.nheads, a.seqlen, a.hdim, a.causal)
        step()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        step()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    except Exception as exc:  # noqa: BLE001
        rec.update(oom=is_oom(exc), error=short(exc))
    print(MARK + __import__("json").dumps(rec), flush=True)
    return 0


# ---------------------------------------------------------------------------------------
# ncu

def ncu_path():
    found = shutil.which("ncu")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/ncu")
    return str(default) if default.exists() else None


def under_profiler() -> bool:
    return bool(os.environ.get("CUDA_INJECTION64_PATH"))


def parse_ncu_csv(text: str) -> dict:
    """Sum each metric over the kernels of ncu's --csv output: {"read_bytes", "write_bytes",
    "kernels"}. Lines before the CSV header (ncu's ==PROF== notes, the program's output) are
    skipped; values may carry thousands separators and a unit (byte, Kbyte, ... as SI)."""
    lines = text.splitlines()
    start = next((i for i, x in enumerate(lines) if x.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no CSV table in ncu's output (no kernel profiled?)")
    sums = {m: 0.0 for m in METRICS}
    ids = set()
    for row in csv.DictReader(lines[start:]):
        name = row.get("Metric Name")
        if name not in sums:
            continue
        value = float(str(row["Metric Value"]).replace(",", ""))
        sums[name] += value * UNITS.get(str(row.get("Metric Unit", "byte")).strip().lower(), 1.0)
        ids.add(row.get("ID"))
    return {"read_bytes": sums[METRICS[0]], "write_bytes": sums[METRICS[1]], "kernels": len(ids)}


def child_cmd(impl: str, shape: dict, causal: bool) -> list:
    cmd = [sys.executable, "-m", "cuflash.bench.io", "--child", impl]
    for name in ("batch", "nheads", "seqlen", "hdim"):
        cmd += [f"--{name}", str(shape[name])]
    return cmd + (["--causal"] if causal else [])


def hbm_bytes(impl: str, shape: dict, causal: bool, ncu: str, timeout: float = 600.0) -> dict:
    """{"read_bytes", "write_bytes", "kernels"} of one step of impl, or {"error"} / {"oom"}."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        x for x in (root, os.environ.get("PYTHONPATH", "")) if x))
    with tempfile.TemporaryDirectory(prefix="cuflash_io_") as tmp:
        log_file = Path(tmp) / "ncu.csv"
        cmd = [ncu, "--metrics", ",".join(METRICS), "--csv", "--print-units", "base",
               "--target-processes", "all", "--profile-from-start", "off",
               "--log-file", str(log_file)] + child_cmd(impl, shape, causal)
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"ncu child timed out after {timeout:.0f} s"}
        rec = parse_child(r.stdout, MARK) or {}
        if rec.get("oom"):
            return {"oom": True, "error": rec.get("error", "out of memory")}
        if "error" in rec:
            return {"error": rec["error"]}
        text = log_file.read_text() if log_file.exists() else ""
        try:
            return parse_ncu_csv(text)
        except ValueError as exc:
            tail = " | ".join((text or r.stderr or r.stdout).strip().splitlines()[-3:])
            return {"error": f"{exc}; exit {r.returncode}: {tail}"[:400]}


# ---------------------------------------------------------------------------------------
# one row

def measure(impl: str, shape: dict, causal: bool, ncu, reps: int, note: str, log=print) -> dict:
    from ..timing import time_ms

    rec = dict(impl=impl, **shape, causal=causal, dtype="bf16",
               gflops=gflops(impl, shape["batch"], shape["nheads"], shape["seqlen"], shape["hdim"],
                             causal), oom=False)
    step = None
    try:
        step = step_fn(impl, shape["batch"], shape["nheads"], shape["seqlen"], shape["hdim"], causal)
        rec["runtime_ms"] = time_ms(step, warmup=2, reps=reps).median_ms
    except Exception as exc:  # noqa: BLE001
        rec.update(runtime_ms=None, oom=is_oom(exc), error=short(exc))
    finally:
        step = None  # noqa: F841
        release()
    if ncu and not rec["oom"]:
        b = hbm_bytes(impl, shape, causal, ncu)
        if "read_bytes" in b:
            rec.update(hbm_read_gb=b["read_bytes"] / 1e9, hbm_write_gb=b["write_bytes"] / 1e9,
                       hbm_gb=(b["read_bytes"] + b["write_bytes"]) / 1e9, kernels=b["kernels"])
        else:
            rec.update(hbm_gb=None, hbm_error=b["error"], oom=rec["oom"] or b.get("oom", False))
    else:
        rec.update(hbm_gb=None, hbm_note=note or "out of memory")
    log(f"  {impl:>10} b={shape['batch']} s={shape['seqlen']}: " + _fmt_row(rec))
    return rec


def _fmt_row(rec: dict) -> str:
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)
    return (f"{rec['gflops']:.1f} GFLOPs, HBM {f(rec.get('hbm_gb'), '.2f')} GB, "
            f"{f(rec.get('runtime_ms'), '.2f')} ms" + (" (OOM)" if rec.get("oom") else ""))


# ---------------------------------------------------------------------------------------
# the tables

def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def markdown(main: list, growth: list, setting: str, device: str, notes: list) -> str:
    """io_table.md: the paper's table for this GPU, with its A100 numbers beside, then the
    growth table."""
    lines = [f"# Attention IO: {setting}", "", f"Measured on {device}.", "",
             "| | GFLOPs | HBM R/W (GB) | Runtime (ms) | paper A100: GFLOPs | HBM R/W (GB) | Runtime (ms) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in main:
        paper = PAPER_A100["standard" if r["impl"] == "standard" else "flash"]
        lines.append(f"| {NAMES.get(r['impl'], r['impl'])} | {r['gflops']:.1f} | "
                     f"{_num(r.get('hbm_gb'), '.2f')} | {_num(r.get('runtime_ms'), '.2f')} | "
                     f"{paper['gflops']} | {paper['hbm_gb']} | {paper['runtime_ms']} |")
    lines += ["", "The paper's A100 column: its standard attention row, and its FlashAttention "
              "row beside both flash implementations. The paper does not state its FLOP "
              "convention; ours is below.", ""]
    if growth:
        seqlens = sorted({r["seqlen"] for r in growth})
        impls = list(dict.fromkeys(r["impl"] for r in growth))
        by = {(r["impl"], r["seqlen"]): r for r in growth}
        r0 = growth[0]
        lines += [f"## HBM traffic as the sequence grows (batch {r0['batch']}, {r0['nheads']} heads, "
                  f"d {r0['hdim']})", "",
                  "| seqlen | " + " | ".join(f"{NAMES.get(i, i)} GB" for i in impls) + " | "
                  + " | ".join(f"{NAMES.get(i, i)} ms" for i in impls) + " |",
                  "| --- | " + " | ".join("---" for _ in range(2 * len(impls))) + " |"]
        for s in seqlens:
            cells = []
            for key in ("hbm_gb", "runtime_ms"):
                for i in impls:
                    r = by.get((i, s), {})
                    cells.append("OOM" if r.get("oom") else _num(r.get(key), ".3f" if key == "hbm_gb" else ".2f"))
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## How", "", f"- {FORMULA}"] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def run(growth_seqlens=GROWTH_SEQLENS, causal: bool = False, use_ncu: bool = True, reps: int = 10,
        out="results", log=print) -> dict:
    _gpu.require("bench --mode io")
    ncu, note = None, ""
    if not use_ncu:
        note = "HBM bytes not measured (--no-ncu)"
    elif under_profiler():
        note = "already under a profiler (CUDA_INJECTION64_PATH): bytes are in its report"
    else:
        ncu = ncu_path()
        if ncu is None:
            note = "ncu not found on PATH or in /usr/local/cuda/bin: HBM bytes not measured"
    if note:
        log(f"  {note}")
    log(f"io: GPT-2 medium attention {MAIN}, {'causal' if causal else 'not causal'}")
    main = [dict(measure(impl, dict(MAIN), causal, ncu, reps, note, log), table="main")
            for impl in IMPLS]
    log(f"io: growth {GROWTH}, seqlens {list(growth_seqlens)}")
    growth = [dict(measure(impl, dict(GROWTH, seqlen=s), causal, ncu, reps, note, log),
                   table="growth") for s in growth_seqlens for impl in IMPLS]
    notes = [("HBM bytes: ncu dram__bytes_read.sum + dram__bytes_write.sum summed over the "
              "kernels of one forward + backward step (a child process per impl and shape; "
              "the step between cudaProfilerStart/Stop after one warm-up step; caches "
              "flushed before each kernel, ncu's default)") if ncu else note,
             "Runtime: cuflash.timing, median of CUDA-event samples of one forward + backward "
             "(torch.autograd.grad), bf16."]
    setting = (f"GPT-2 medium, batch {MAIN['batch']}, {MAIN['nheads']} heads, seqlen "
               f"{MAIN['seqlen']}, head dim {MAIN['hdim']}, forward + backward, bf16"
               + (", causal" if causal else ""))
    path = results_dir(out)
    write_json(path / "io_table.json", main + growth, setting=setting, formula=FORMULA, notes=notes,
               paper_a100=PAPER_A100, ncu=ncu)
    md = markdown(main, growth, setting, gpu_label(), notes)
    (path / "io_table.md").write_text(md)
    log(md)
    log(f"wrote {path / 'io_table'}.json, .md")
    synchronize()
    return {"main": main, "growth": growth}


if __name__ == "__main__":
    sys.exit(child_main())
