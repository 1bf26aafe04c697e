"""--mode ring: context parallelism, cuflash ring attention over P GPUs (NCCL), against
single-GPU cuflash on the same per-GPU shard and torch's own context parallel.

One process per GPU (``torch.multiprocessing.spawn``, NCCL, NVLink multicast off:
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1). Problems:
batch 1, d 128, bf16, --ring-heads heads (default 8), total seqlen --ring-seqlens (default
256k, 512k, 1M), at each seqlen causal (zigzag layout) then non-causal (--causal); each rank
holds seqlen / P positions (in the order given: descending puts the largest first, so that a
tight budget skips the small ones; ring.json / .csv are rewritten after every problem). A
problem is skipped, with a record saying so, when the run's
estimated time would pass --ring-budget-s (default 270 s; the estimate: the last problem of that
mask, less its --ring-ab variants' time (ab_seconds), scaled by seqlen², and by LIGHT_COST when it
is light and that one was not, by 1 / LIGHT_COST the other way round). Problems above
--ring-light-from (default 524288) run light, to fit the 1M problems in a ~5-minute run: one
timed repetition after a warm-up on a small ring (WARM_LOCAL positions per rank, the same
kernels) and one full forward and backward (a process's first full-size backward is slow), no
transfer-free runs (comm_exposed_ms from the trace's waits instead), no peak-memory run (its 1/P
scaling is measured at the smaller seqlens), torch CP on its cuDNN backend only (flash runs at
0.6x its speed, measured every earlier run).

Records (results/<gpu>x<P>/ring.{json,csv}), impl:
  ring           fwd_ms, bwd_ms (ring_forward / ring_backward, no autograd), tflops_per_gpu
                 (fwd + bwd FLOPs of the whole problem / P / (fwd_ms + bwd_ms)), fwd_tflops_per_gpu,
                 bwd_tflops_per_gpu, peak_bytes_per_gpu (max over ranks of the peak allocated
                 during one autograd forward + backward, above the inputs), comm_exposed_ms
                 (fwd + bwd time minus the same steps' computation without transfers,
                 compute_only_ms; light problems: the traced waits, trace_wait_ms),
                 efficiency (tflops_per_gpu / single-GPU cuflash's on the shard), P, seqlen,
                 causal, d, nheads, batch
  cuflash_shard  single-GPU cuflash (flash_attn_func) forward and backward on one rank's
                 shard as its own sequence (seqlen / P, the same causal): fwd_ms, bwd_ms,
                 tflops
  cuflash_1gpu   single-GPU cuflash on the whole sequence (rank 0), for seqlen <= 256k
                 (--ring-full-max): fwd_ms, bwd_ms, tflops, peak_bytes (as peak_bytes_per_gpu),
                 inputs_bytes
  torch_cp       torch.distributed.tensor.experimental.context_parallel around SDPA, one record
                 per --ring-cp-backends entry (backend: flash, cudnn; default both):
                 fwd_ms, bwd_ms, tflops_per_gpu, load_balance (torch's own head-tail layout,
                 which it supports for causal only: off without causal); or error: why it did
                 not run
                 With --ring-breakdown (always on light problems: it gives their
                 comm_exposed_ms), one more forward and backward run with
                 cuflash.distributed.TRACE on: per phase, the max over ranks of the rank's
                 sum over steps (ms), and every rank's steps ("r0 a/b r1 c/d"): fwd_compute_ms
                 (cuflash's kernels), fwd_merge_ms (LSE merges), fwd_wait_ms (the compute stream
                 waiting for a transfer: exposed), fwd_final_ms (conversions), bwd_compute_ms,
                 bwd_accum_ms (dQ / dK / dV additions), bwd_wait_ms, bwd_final_ms (the dK/dV
                 hop home, and waiting for the neighbour to finish its last step); trace_wait_ms
                 = max over ranks of fwd_wait + bwd_wait + bwd_final.
                 The breakdown also prints every rank's timeline (GPU, per step: kernels'
                 start and time, wait, the transfers' stretch on the side stream; timeline_lines)
                 and the config of every call.
                 With --ring-ab NAME ...: alt_NAME_fwd_ms, alt_NAME_bwd_ms,
                 alt_NAME_tflops_per_gpu of the same ring with something changed, in the same
                 run (AB_VARIANTS, or several joined by '+'; --ring-ab-max: only up to that
                 seqlen, --ring-ab-seqlens: only at those, --ring-ab-causal yes / no: only with
                 that mask). --ring-set NAME: the whole run with a variant (ring_set in the
                 records; the settings it ran with: reverse_bwd, fwd_dynamic, priority_group,
                 ring_max_ctas, early_send, fwd_grid_steps, dkv_home, bwd_low_memory,
                 fwd_full_grid_steps, dq_in_workspace, home_lazy_fp32, bwd_head_groups,
                 fwd_head_groups).
                 --ring-rotate K: process r on GPU (r + K) mod the GPU count.
Times are medians over ranks' CUDA-event timings of max-over-ranks per repetition; FLOPs are
cuflash.registry.op_flops (4·b·h·s²·d, ÷2 causal, ×2.5 backward).
"""
from __future__ import annotations

import datetime
import math
import os
import socket
import time

STEM = "ring"
SEQLENS = (262144, 524288, 1048576)
LIGHT_FROM = 524288  # problems above run light (see the module doc)
LIGHT_COST = 0.45    # a light problem's time / a full one's of the same size (estimate)
PHASES = ("fwd_compute", "fwd_merge", "fwd_wait", "fwd_final", "bwd_compute", "bwd_accum",
          "bwd_wait", "bwd_final")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


def flops(batch, nheads, seqlen, d, causal, op="fwd") -> float:
    f = 4.0 * batch * nheads * seqlen * seqlen * d / (2 if causal else 1)
    return f * (2.5 if op == "bwd" else 1.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CP_BACKENDS = ("flash", "cudnn")


def run(seqlens=SEQLENS, causals=(True, False), procs=None, nheads=8, d=128, reps=3,
        budget_s=270.0, torch_cp=True, full_max=262144, out="results", cp_backends=CP_BACKENDS,
        breakdown=False, light_from=LIGHT_FROM, ab=(), ab_max=None, rotate=0, ring_set=None,
        ab_seqlens=None, ab_causals=(True, False)):
    """Spawn one process per GPU and run the mode; rank 0 writes the records."""
    import torch
    import torch.multiprocessing as mp

    from .. import _gpu

    reason = _gpu.why_unavailable()
    if reason:
        raise _gpu.NoGPUError(reason)
    n = torch.cuda.device_count()
    procs = procs or n
    if procs < 2 or procs > n:
        raise _gpu.NoGPUError(f"bench ring needs 2 <= P <= {n} GPUs here, asked for P = {procs}")
    os.environ.update(NO_MULTICAST)  # inherited by the children before NCCL starts
    ab = tuple(name for name in ab if name)
    for name in ab + ((ring_set,) if ring_set else ()):
        parse_variant(name)  # an unknown name fails here, not in every process
    opts = dict(seqlens=tuple(seqlens), causals=tuple(causals), nheads=nheads, d=d, reps=reps,
                budget_s=budget_s, torch_cp=torch_cp, full_max=full_max, out=out,
                cp_backends=tuple(cp_backends), breakdown=bool(breakdown),
                light_from=light_from, ab=tuple(ab), ab_max=ab_max, rotate=int(rotate),
                ab_seqlens=None if ab_seqlens is None else tuple(ab_seqlens),
                ab_causals=tuple(bool(c) for c in ab_causals),
                ring_set=ring_set or None)
    print(f"bench ring: P = {procs} processes, seqlens {list(seqlens)}, causal {list(causals)}, "
          f"budget {budget_s:.0f} s" + (f", rank r on GPU (r + {rotate}) % {n}" if rotate else ""),
          flush=True)
    mp.spawn(_worker, args=(procs, _free_port(), opts), nprocs=procs, join=True)


# ---------------------------------------------------------------------------------------
# in each process

def _init(rank, world, port, rotate=0):
    """This process's GPU (rank + rotate, modulo the GPUs) and the NCCL group."""
    import torch
    import torch.distributed as dist

    os.environ.update(NO_MULTICAST)
    gpu = (rank + rotate) % torch.cuda.device_count()
    torch.cuda.set_device(gpu)
    # a rank that fails leaves the others in a collective: they time out instead of hanging
    kw = dict(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
              timeout=datetime.timedelta(seconds=600))
    try:
        dist.init_process_group("nccl", device_id=torch.device("cuda", gpu), **kw)
    except TypeError:  # an older torch: no device_id
        dist.init_process_group("nccl", **kw)


def _timed(fn, reps: int) -> float:
    """Median over reps of the max over ranks of one call's CUDA-event time (ms)."""
    import torch
    import torch.distributed as dist

    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        t = torch.tensor([start.elapsed_time(end)], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    times.sort()
    return times[len(times) // 2]


def _agree(value: bool) -> bool:
    """Rank 0's decision, on every rank."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([1 if value else 0], device="cuda")
    dist.broadcast(t, 0)
    return bool(t.item())


def _max_over_ranks(x: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(x)], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _short(exc) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{exc.__class__.__name__}: {text}"[:300]


def _worker(rank, world, port, opts):
    import torch
    import torch.distributed as dist

    _init(rank, world, port, opts.get("rotate", 0))
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    if opts.get("ring_set"):  # the whole run with a variant (flags flipped, its group)
        spec = parse_variant(opts["ring_set"])
        from .. import distributed as cfd

        apply_variant(spec)
        _MAIN["group"] = _variant_group(spec, world)
        log(f"bench ring: as run = {opts['ring_set']} (flipped {spec['flags']}, group "
            f"{'default' if _MAIN['group'] is None else 'its own'})")
    records, t_start = [], time.perf_counter()
    last = {}  # causal -> (seqlen, seconds) of the last problem measured
    try:
        # seqlens in the order given, at each causal first (long-context training), then the
        # next mask
        for seqlen in opts["seqlens"]:
            for causal in opts["causals"]:
                spent = time.perf_counter() - t_start
                prev = last.get(causal)
                if prev is None and last.get(not causal) is not None:  # from the other mask
                    other = last[not causal]  # (a causal problem is half a full one's work)
                    prev = (other[0], other[1] * (0.5 if causal else 2.0))
                light = seqlen > opts.get("light_from", LIGHT_FROM)
                est = None if prev is None else prev[1] * (seqlen / prev[0]) ** 2 * _light_factor(
                    light, prev[0] > opts.get("light_from", LIGHT_FROM))
                go = _agree(est is None or spent + est <= opts["budget_s"])
                base = dict(P=world, seqlen=seqlen, causal=causal, d=opts["d"],
                            nheads=opts["nheads"], batch=1)
                if not go:
                    records.append(dict(impl="ring", **base, skipped=(
                        f"estimated {est:.0f} s would pass the {opts['budget_s']:.0f} s budget "
                        f"({spent:.0f} s spent)")))
                    log(f"ring s={seqlen} causal={causal}: skipped (estimated {est:.0f} s, "
                        f"{spent:.0f} s spent of {opts['budget_s']:.0f})")
                    continue
                t0 = time.perf_counter()
                new = _measure(rank, world, seqlen, causal, opts, log, base)
                if seqlen <= opts["full_max"]:
                    new += _full(rank, seqlen, causal, opts, base, log)
                records += new
                # the estimates scale the problem's own time: --ring-ab's variants (timed on
                # chosen problems only) are left out
                ab_s = sum(r.get("ab_seconds", 0.0) for r in new)
                last[causal] = (seqlen, _max_over_ranks(time.perf_counter() - t0 - ab_s))
                torch.cuda.empty_cache()
                if rank == 0:  # the records so far (a run cut short by a timeout keeps them)
                    try:
                        _write(records, world, opts["out"], lambda *a: None, png=False)
                    except Exception as exc:  # noqa: BLE001 - the run goes on; the end writes again
                        log(f"bench ring: could not write the records so far ({_short(exc)})")
        if rank == 0:
            _write(records, world, opts["out"], log)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _light_factor(light: bool, prev_light: bool) -> float:
    """The budget estimate's factor for a problem scaled from one of another kind: LIGHT_COST
    from a full problem to a light one, its inverse from a light one to a full one."""
    return 1.0 if light == prev_light else LIGHT_COST if light else 1.0 / LIGHT_COST


def _write(records, world, out, log, png: bool = True):
    from pathlib import Path

    from .common import gpu_dir_name, write

    path = write(records, Path(out) / f"{gpu_dir_name(0)}x{world}", STEM, log=log, P=world)
    if png and plot(records, path / f"{STEM}.png"):
        log(f"wrote {path / STEM}.png")


def plot_rows(records) -> list:
    """The records as plot rows: impl (ring, cuflash shard, cuflash 1 GPU, torch_cp[backend]),
    seqlen, causal, tflops_per_gpu (each impl's own TFLOPs per GPU) and peak_gib_per_gpu."""
    rows = []
    for r in records:
        if r.get("error") or r.get("skipped"):
            continue
        impl = r["impl"] + (f"[{r['backend']}]" if r.get("backend") else "")
        tf = r.get("tflops_per_gpu", r.get("tflops"))
        peak = r.get("peak_bytes_per_gpu", r.get("peak_bytes"))
        if tf is None:
            continue
        rows.append(dict(impl=impl, seqlen=r["seqlen"], causal=r["causal"], tflops_per_gpu=tf,
                         peak_gib_per_gpu=None if peak is None else peak / 2**30))
    return rows


def plot(records, path, title=None) -> bool:
    """ring.png: fwd+bwd TFLOPs per GPU and peak memory per GPU vs total seqlen, a column per
    mask, a line per impl (the shard baseline: single-GPU cuflash on seqlen / P)."""
    from .common import plot as plot_lines

    P = next((r["P"] for r in records if r.get("impl") == "ring"), "?")
    return plot_lines(plot_rows(records), path, ("tflops_per_gpu", "peak_gib_per_gpu"),
                      panels=("causal",), ref="cuflash_shard",
                      title=title or f"ring attention, P = {P}, bf16 d128 8 heads (fwd + bwd)")


def gpu_of_dir(name: str) -> tuple:
    """(GPU short name, P) of a results folder name: "NVIDIA_H200x4" -> ("H200", 4),
    "NVIDIA_H100_80GB_HBM3x2" -> ("H100", 2); (the name, None) when it has no "x<P>" end."""
    import re

    m = re.fullmatch(r"(.*)x(\d+)", name)
    base, P = (m.group(1), int(m.group(2))) if m else (name, None)
    words = [w for w in base.replace("_", " ").split() if w.upper() != "NVIDIA"]
    short = next((w for w in words if re.fullmatch(r"[A-Z]+\d+[A-Za-z]*", w)), " ".join(words))
    return short or name, P


def _seqlen_label(n: int) -> str:
    return f"{n >> 20}M" if n % (1 << 20) == 0 else f"{n >> 10}k" if n % 1024 == 0 else str(n)


def table_lines(runs) -> list:
    """Markdown rows of the README's ring table from bench ring records. runs: [(gpu, P, note,
    records)], e.g. ("H200", 4, "", ring.json's records). One row per ring record that ran:
    | GPUs | seqlen | mask | cuflash ring | efficiency | torch CP, flash | torch CP, cuDNN |
    peak GiB/GPU |, TFLOPs/s per GPU (fwd + bwd); "—" where the run has no such record (torch
    CP records from before --ring-cp-backends name no backend: SDPA's default ran, flash at
    these shapes, ~315 TFLOPs/GPU in every such run). Skipped problems: a row saying so."""
    lines = ["| GPUs | seqlen | mask | cuflash ring | efficiency | torch CP, flash | "
             "torch CP, cuDNN | peak GiB/GPU |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    dash = "—"
    for gpu, P, note, records in runs:
        who = f"{P} {gpu}" + (f" ({note})" if note else "")
        cp = {}
        for r in records:
            if r.get("impl") == "torch_cp" and r.get("tflops_per_gpu") is not None:
                cp[(r["seqlen"], bool(r["causal"]), r.get("backend", "flash"))] = r["tflops_per_gpu"]
        rings = [r for r in records if r.get("impl") == "ring"]
        for r in sorted(rings, key=lambda r: (r["seqlen"], not r["causal"])):
            key = (r["seqlen"], bool(r["causal"]))
            mask = "causal" if r["causal"] else "non-causal"
            if r.get("tflops_per_gpu") is None:
                why = r.get("skipped") and "skipped" or r.get("error") and "error" or "not run"
                lines.append(f"| {who} | {_seqlen_label(r['seqlen'])} | {mask} | {why} | {dash} | "
                             f"{dash} | {dash} | {dash} |")
                continue
            eff = r.get("efficiency")
            peak = r.get("peak_bytes_per_gpu")
            cells = [f"{r['tflops_per_gpu']:.0f}", dash if eff is None else f"{eff:.2f}"]
            cells += [dash if (*key, b) not in cp else f"{cp[(*key, b)]:.0f}" for b in ("flash", "cudnn")]
            cells.append(dash if peak is None else f"{peak / 2**30:.2f}")
            lines.append(f"| {who} | {_seqlen_label(r['seqlen'])} | {mask} | " + " | ".join(cells) + " |")
    return lines


def memory_lines(runs) -> list:
    """Markdown rows of peak memory per GPU against P (the 1/P check): per GPU kind, seqlen and
    mask, the single-GPU whole-sequence peak (cuflash_1gpu) and each P's ring peak_bytes_per_gpu
    in GiB, with (ratio) = peak x P / (the smallest P's peak x that P): 1.00 is exactly 1/P."""
    table: dict = {}
    for gpu, P, _note, records in runs:
        for r in records:
            key = (gpu, r.get("seqlen"), bool(r.get("causal")))
            if r.get("impl") == "ring" and r.get("peak_bytes_per_gpu") is not None:
                table.setdefault(key, {})[P] = r["peak_bytes_per_gpu"]
            elif r.get("impl") == "cuflash_1gpu" and r.get("peak_bytes") is not None:
                table.setdefault(key, {})[1] = r["peak_bytes"]
    Ps = sorted({p for row in table.values() for p in row})
    lines = ["| GPU | seqlen | mask | " + " | ".join(f"P = {p}" for p in Ps) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in Ps) + " |"]
    for (gpu, seqlen, causal), row in sorted(table.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                            not kv[0][2])):
        if len(row) < 2:
            continue
        p0 = min(row)
        cells = []
        for p in Ps:
            if p not in row:
                cells.append("—")
                continue
            ratio = row[p] * p / (row[p0] * p0)
            cells.append(f"{row[p] / 2**30:.2f}" + ("" if p == p0 else f" ({ratio:.2f})"))
        lines.append(f"| {gpu} | {_seqlen_label(seqlen)} | {'causal' if causal else 'non-causal'} | "
                     + " | ".join(cells) + " |")
    return lines


README_START, README_END = "<!-- ring-table: start -->", "<!-- ring-table: end -->"


def replace_block(text: str, lines: list) -> str:
    """text with the lines between README_START and README_END replaced by ``lines``;
    ValueError when the markers are missing or out of order."""
    a, b = text.find(README_START), text.find(README_END)
    if a < 0 or b < a:
        raise ValueError(f"readme: expected the markers {README_START!r} ... {README_END!r}")
    a += len(README_START)
    return text[:a] + "\n" + "\n".join(lines) + "\n" + text[b:]


def main(argv=None) -> int:
    """python -m cuflash.bench.ring ring.json ...: re-plot each run's records (ring.png beside
    it). --table [--readme README.md]: print the README's ring table (and the peak-memory table)
    from the given ring.json files, each as PATH or PATH=NOTE (NOTE: the row's note, e.g. "earlier
    ring"); GPU kind and P from the folder name (results/NVIDIA_H200x4/ring.json), or from a
    folder above it for a copy under logs/; with --readme, the block between its ring-table
    markers is rewritten instead."""
    import argparse
    from pathlib import Path

    from .common import read_records

    ap = argparse.ArgumentParser(prog="python -m cuflash.bench.ring")
    ap.add_argument("files", nargs="+", help="ring.json files (PATH or PATH=NOTE with --table)")
    ap.add_argument("--table", action="store_true", help="print the markdown tables, no plots")
    ap.add_argument("--readme", default=None, help="with --table: rewrite this file's ring table")
    a = ap.parse_args(argv)
    if not a.table:
        for name in a.files:
            recs = read_records(name)
            gpu = Path(name).resolve().parent.name
            P = next((r["P"] for r in recs if r["impl"] == "ring"), "?")
            if plot(recs, Path(name).with_suffix(".png"), title=f"ring attention on {gpu}, bf16 "
                    f"d128 8 heads, fwd + bwd (P = {P})"):
                print(f"wrote {Path(name).with_suffix('.png')}")
        return 0
    runs = []
    for spec in a.files:
        path, _, note = spec.partition("=")
        recs = read_records(path)
        gpu, P = None, None
        for folder in Path(path).resolve().parents:
            gpu, P = gpu_of_dir(folder.name)
            if P is not None:
                break
        P = next((r["P"] for r in recs if r.get("impl") == "ring"), P)
        runs.append((gpu, P, note, recs))
    lines = table_lines(runs) + ["", "Peak memory per GPU (GiB; in brackets: peak x P over the "
                                      "smallest P's, 1.00 = exactly 1/P):", ""] + memory_lines(runs)
    if a.readme:
        text = Path(a.readme).read_text()
        Path(a.readme).write_text(replace_block(text, lines))
        print(f"wrote {a.readme} ({len(lines)} lines between the ring-table markers)")
    else:
        print("\n".join(lines))
    return 0


def _measure(rank, world, seqlen, causal, opts, log, base) -> list:
    import torch

    from .. import distributed as cfd
    from ..api import flash_attn_func

    b, h, d, reps = 1, opts["nheads"], opts["d"], opts["reps"]
    light = seqlen > opts.get("light_from", LIGHT_FROM)
    if light:
        reps = 1
    s_local = seqlen // world
    scale = 1 / math.sqrt(d)
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    q, k, v, dout = (torch.randn(b, s_local, h, d, device="cuda", dtype=dt, generator=g)
                     for _ in range(4))
    f_fwd, f_bwd = flops(b, h, seqlen, d, causal), flops(b, h, seqlen, d, causal, "bwd")
    recs = []

    # the ring, no autograd: forward, backward, and both without transfers
    rec = dict(impl="ring", **base)
    try:
        # the forward keeps its last K/V block for the backward when REVERSE_BWD is on (as
        # ring_flash_attn_func does); res: (out, lse[, k_last, v_last]). n: the first n local
        # positions only (a small ring with the same kernels: a variant's warm-up)
        def fwd_g(group=None, comm=True, n=None):
            return cfd.ring_forward(*(x[:, :n] for x in (q, k, v)), scale, causal, group,
                                    "zigzag", comm, keep_last=cfd.REVERSE_BWD)

        def bwd_g(res, group=None, comm=True, n=None):
            return cfd.ring_backward(*(x[:, :n] for x in (dout, q, k, v)), res[0], res[1], scale,
                                     causal, group, "zigzag", False, comm,
                                     kv_last=tuple(res[2:]) or None)

        main = _MAIN["group"]  # --ring-set's group, or None: the default one
        if light:  # warm-up (compiles, the group's first transfers) on a small ring
            n = min(s_local, WARM_LOCAL)
            bwd_g(fwd_g(main, n=n), main, n=n)
        res = fwd_g(main)  # (the full problem's warm-up)
        fwd = lambda comm=True: fwd_g(main, comm=comm)  # noqa: E731
        bwd = lambda comm=True: bwd_g(res, main, comm=comm)  # noqa: E731
        bwd()  # (light too: a first full-size backward in the process ran 3222 ms where the
        # same ring warm took 2691-2769, session 18 round 1, 4 x H200 1M causal)
        rec["fwd_ms"] = fwd_ms = _timed(fwd, reps)
        rec["bwd_ms"] = bwd_ms = _timed(bwd, reps)
        rec["reverse_bwd"] = cfd.REVERSE_BWD
        rec["fwd_dynamic"] = cfd.FWD_DYNAMIC and world >= cfd.FWD_DYNAMIC_MIN_WORLD
        rec["priority_group"] = cfd.PRIORITY_GROUP
        rec["ring_max_ctas"] = cfd.RING_MAX_CTAS
        rec["early_send"] = cfd.EARLY_SEND
        rec["fwd_grid_steps"] = cfd.FWD_GRID_STEPS
        rec["dkv_home"] = cfd.DKV_HOME
        rec["bwd_low_memory"] = cfd.BWD_LOW_MEMORY
        rec["dq_in_workspace"] = cfd.DQ_IN_WORKSPACE
        rec["home_lazy_fp32"] = cfd.HOME_LAZY_FP32
        rec["bwd_head_groups"] = cfd.BWD_HEAD_GROUPS
        rec["fwd_head_groups"] = cfd.FWD_HEAD_GROUPS
        rec["fwd_full_grid_steps"] = cfd.FWD_FULL_GRID_STEPS
        if opts.get("ring_set"):
            rec["ring_set"] = opts["ring_set"]
        t_ab = time.perf_counter()
        for name in opts.get("ab", ()) if ab_here(opts, seqlen, causal) else ():
            rec.update(_variant(name, world, reps, f_fwd + f_bwd, rec, log, fwd_g, bwd_g,
                                min(s_local, WARM_LOCAL), bool(opts.get("breakdown"))))
            rec["ab_seconds"] = time.perf_counter() - t_ab  # (left out of the budget's estimates)
        if opts.get("breakdown") or light:
            rec.update(_breakdown(world, fwd, bwd))
            log(_breakdown_line(rec))
            for line in rec.pop("timeline_lines"):
                log(line)
        if light:
            rec["comm_exposed_ms"] = rec["trace_wait_ms"]
        else:
            compute_ms = _timed(lambda: fwd(False), reps) + _timed(lambda: bwd(False), reps)
            rec["compute_only_ms"] = compute_ms
            rec["comm_exposed_ms"] = max(0.0, fwd_ms + bwd_ms - compute_ms)
        rec["fwd_tflops_per_gpu"] = f_fwd / world / fwd_ms / 1e9
        rec["bwd_tflops_per_gpu"] = f_bwd / world / bwd_ms / 1e9
        rec["tflops_per_gpu"] = (f_fwd + f_bwd) / world / (fwd_ms + bwd_ms) / 1e9
        del res
        if light:  # (its 1/P scaling is measured below light_from)
            raise _Done
        # peak memory of one autograd forward + backward
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        o = cfd.ring_flash_attn_func(*leaves, causal=causal, group=main)
        torch.autograd.grad(o, leaves, dout)
        torch.cuda.synchronize()
        del o, leaves
        rec["peak_bytes_per_gpu"] = int(_max_over_ranks(torch.cuda.max_memory_allocated() - before))
        rec["inputs_bytes_per_gpu"] = 4 * q.numel() * q.element_size()
    except _Done:
        pass
    except Exception as exc:  # noqa: BLE001 - a record says why
        rec["error"] = _short(exc)
    torch.cuda.empty_cache()

    # single-GPU cuflash on the same per-GPU shard (every rank at once, on its own GPU)
    shard = dict(impl="cuflash_shard", **base, shard_seqlen=s_local)
    try:
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        holder = {}

        def sfwd():
            holder["o"] = flash_attn_func(*leaves, causal=causal)

        def sbwd():
            torch.autograd.grad(holder["o"], leaves, dout, retain_graph=True)

        sfwd()  # a full-size warm-up, light problems too (as the ring's)
        sbwd()
        shard["fwd_ms"] = _timed(sfwd, reps)
        shard["bwd_ms"] = _timed(sbwd, reps)
        sf, sb = flops(b, h, s_local, d, causal), flops(b, h, s_local, d, causal, "bwd")
        shard["tflops"] = (sf + sb) / (shard["fwd_ms"] + shard["bwd_ms"]) / 1e9
        shard["fwd_tflops"] = sf / shard["fwd_ms"] / 1e9
        holder.clear()
        del leaves
        if "tflops_per_gpu" in rec:
            rec["efficiency"] = rec["tflops_per_gpu"] / shard["tflops"]
            rec["fwd_efficiency"] = rec["fwd_tflops_per_gpu"] / shard["fwd_tflops"]
    except Exception as exc:  # noqa: BLE001
        shard["error"] = _short(exc)
    torch.cuda.empty_cache()
    recs += [rec, shard]
    log(_line(rec, shard))

    if opts["torch_cp"]:
        for backend in opts.get("cp_backends", CP_BACKENDS):
            if light and backend != "cudnn":
                continue
            recs.append(_torch_cp(rank, world, seqlen, causal, dict(opts, reps=reps), base, log,
                                  backend))
    return recs


def ab_here(opts: dict, seqlen: int, causal: bool) -> bool:
    """Whether --ring-ab's variants run on this problem: seqlen <= --ring-ab-max, seqlen in
    --ring-ab-seqlens and the mask in --ring-ab-causal, each where given."""
    ab_max, ab_seqlens = opts.get("ab_max"), opts.get("ab_seqlens")
    return ((ab_max is None or seqlen <= ab_max) and (ab_seqlens is None or seqlen in ab_seqlens)
            and bool(causal) in opts.get("ab_causals", (True, False)))


AB_VARIANTS = {
    "early_send": "cuflash.distributed.EARLY_SEND flipped",
    "nccl_priority": "the ring on a second NCCL group whose streams have high priority "
                     "(ProcessGroupNCCL.Options.is_high_priority_stream)",
    "nccl_ctasN": "the ring on a second NCCL group whose kernels take at most N CTAs "
                  "(ProcessGroupNCCL.Options.config.max_ctas; e.g. nccl_ctas4)",
    "rotate": "the ring on a second NCCL group whose rank order is rotated by one (process r is "
              "ring rank r - 1): a slow ring position moves to the next GPU, a slow GPU stays",
    "split_q": "cuflash.distributed.SPLIT_Q flipped (multi-chunk non-causal calls per q chunk)",
    "reverse_bwd": "cuflash.distributed.REVERSE_BWD flipped (the backward the other way round, "
                   "no last hop)",
    "fwd_dyn": "cuflash.distributed.FWD_DYNAMIC flipped (from FWD_DYNAMIC_MIN_WORLD ranks up: "
               "static persistent forward calls on the "
               "dynamic scheduler)",
    "dkv_home": "cuflash.distributed.DKV_HOME flipped (the backward's dK/dV shares sent "
                "straight to the block's owner in k's dtype, summed there in fp32, instead of an "
                "fp32 accumulator travelling with the block)",
    "bwd_lowmem": "cuflash.distributed.BWD_LOW_MEMORY flipped (the shares sent home as with "
                  "DKV_HOME, right after their step, waited for: none in flight during a step)",
    "dq_ws": "cuflash.distributed.DQ_IN_WORKSPACE flipped (the backward's dQ summed in the "
             "kernels' own fp32 accumulator, one workspace for every step, one convert at the end)",
    "home_lazy": "cuflash.distributed.HOME_LAZY_FP32 flipped (the home dK/dV sums kept in k's "
                 "dtype until a second share arrives)",
    "bwd_groupsN": "cuflash.distributed.BWD_HEAD_GROUPS = N (the backward's ring run once per "
                   "group of heads, N groups; e.g. bwd_groups1: all heads at once)",
    "fwd_groupsN": "cuflash.distributed.FWD_HEAD_GROUPS = N (the forward's ring run once per group "
                   "of heads, N groups; e.g. fwd_groups4)",
    "fwd_fullgridN": "cuflash.distributed.FWD_FULL_GRID_STEPS = N (non-causal rings from "
                     "FWD_DYNAMIC_MIN_WORLD ranks up: the first N forward steps on a grid of one "
                     "CTA per tile, the later ones static persistent; e.g. fwd_fullgrid1)",
    "lib_priority": "cuflash.distributed.PRIORITY_GROUP flipped (the ring's own high-priority "
                    "twin of the default group, made by the library)",
    "lib_ctasN": "cuflash.distributed.RING_MAX_CTAS = N (the library's high-priority twin group "
                 "with NCCL kernels of at most N CTAs; e.g. lib_ctas4)",
    "fwd_gridN": "cuflash.distributed.FWD_GRID_STEPS = N (the forward's first N steps run their "
                 "non-causal calls on a grid of one CTA per tile, not persistent; e.g. fwd_grid1; "
                 "fwd_grid0: none)",
}
FLAG_VARIANTS = {"early_send": "EARLY_SEND", "split_q": "SPLIT_Q", "reverse_bwd": "REVERSE_BWD",
                 "fwd_dyn": "FWD_DYNAMIC", "lib_priority": "PRIORITY_GROUP", "dkv_home": "DKV_HOME",
                 "bwd_lowmem": "BWD_LOW_MEMORY", "dq_ws": "DQ_IN_WORKSPACE",
                 "home_lazy": "HOME_LAZY_FP32"}
_MAIN: dict = {"group": None}  # the process's ring group under --ring-set (None: the default)
WARM_LOCAL = 32768  # a variant's warm-up ring: this many local positions (the same kernels as
# the bench's shards from 64k tokens per rank up: the heuristic's tiles change below 16k keys)
_groups: dict = {}


def parse_variant(name: str) -> dict:
    """{"flags": [cuflash.distributed flags to flip], "priority": bool, "max_ctas": int or None,
    "rotate": bool, "lib_ctas": int or None, "grid_steps": int or None} of a --ring-ab name:
    AB_VARIANTS' names, several joined by '+'; ValueError naming the part it does not know."""
    out = {"flags": [], "priority": False, "max_ctas": None, "rotate": False, "lib_ctas": None,
           "grid_steps": None}
    if not isinstance(name, str) or not name:
        raise ValueError(f"ab: expected a variant name, got {name!r}")
    for part in name.split("+"):
        if part in FLAG_VARIANTS:
            out["flags"].append(FLAG_VARIANTS[part])
        elif part == "nccl_priority":
            out["priority"] = True
        elif part == "rotate":
            out["rotate"] = True
        elif part.startswith("nccl_ctas") and part[9:].isdigit() and int(part[9:]) >= 1:
            out["max_ctas"] = int(part[9:])
        elif part.startswith("lib_ctas") and part[8:].isdigit() and int(part[8:]) >= 1:
            out["lib_ctas"] = int(part[8:])
        elif part.startswith("fwd_grid") and part[8:].isdigit() and out["grid_steps"] is None:
            out["grid_steps"] = int(part[8:])
        elif part.startswith("fwd_fullgrid") and part[12:].isdigit() \
                and out.get("full_grid_steps") is None:
            out["full_grid_steps"] = int(part[12:])
        elif part.startswith("bwd_groups") and part[10:].isdigit() and int(part[10:]) >= 1 \
                and out.get("head_groups") is None:
            out["head_groups"] = int(part[10:])
        elif part.startswith("fwd_groups") and part[10:].isdigit() and int(part[10:]) >= 1 \
                and out.get("fwd_head_groups") is None:
            out["fwd_head_groups"] = int(part[10:])
        else:
            raise ValueError(f"ab: unknown variant {part!r} in {name!r} (known: "
                             f"{', '.join(sorted(AB_VARIANTS))}; nccl_ctasN, lib_ctasN with N >= 1, "
                             "fwd_gridN, fwd_fullgridN with N >= 0, bwd_groupsN, fwd_groupsN "
                             "with N >= 1, once; several joined by '+')")
    if len(set(out["flags"])) != len(out["flags"]):
        raise ValueError(f"ab: {name!r} names a flag twice")
    return out


def apply_variant(spec: dict) -> None:
    """Set cuflash.distributed's module settings to a parsed variant's (flags flipped from their
    current values, RING_MAX_CTAS, FWD_GRID_STEPS); the caller saves and restores them."""
    from .. import distributed as cfd

    for flag in spec["flags"]:
        setattr(cfd, flag, not getattr(cfd, flag))
    if spec["lib_ctas"] is not None:
        cfd.RING_MAX_CTAS = spec["lib_ctas"]
    if spec.get("grid_steps") is not None:
        cfd.FWD_GRID_STEPS = spec["grid_steps"]
    if spec.get("full_grid_steps") is not None:
        cfd.FWD_FULL_GRID_STEPS = spec["full_grid_steps"]
    if spec.get("head_groups") is not None:
        cfd.BWD_HEAD_GROUPS = spec["head_groups"]
    if spec.get("fwd_head_groups") is not None:
        cfd.FWD_HEAD_GROUPS = spec["fwd_head_groups"]


def _variant_group(spec: dict, world: int):
    """The NCCL group of a variant (None: the default group), made once per kind (every rank
    makes the same ones in the same order)."""
    import torch.distributed as dist

    key = (spec["priority"], spec["max_ctas"], spec["rotate"])
    if key == (False, None, False):
        return None
    if key not in _groups:
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = spec["priority"]
        if spec["max_ctas"] is not None:
            opts.config.max_ctas = spec["max_ctas"]
        ranks = list(range(world))
        kw = {}
        if spec["rotate"]:  # process r is the group's rank r - 1
            import inspect

            if "sort_ranks" not in inspect.signature(dist.new_group).parameters:  # every rank alike
                raise ValueError("rotate: this torch's new_group has no sort_ranks (it orders "
                                 "a group's ranks itself)")
            ranks, kw = ranks[1:] + ranks[:1], {"sort_ranks": False}
        _groups[key] = dist.new_group(ranks=ranks, backend="nccl", pg_options=opts, **kw)
    return _groups[key]


class _Done(Exception):
    """The ring's record is complete (a light problem skips the peak-memory run)."""


def _variant(name, world, reps, flops_total, rec, log, fwd, bwd, warm_local,
             breakdown=False) -> dict:
    """alt_<name>_fwd_ms, alt_<name>_bwd_ms, alt_<name>_tflops_per_gpu: the ring timed with the
    variant ``name`` (parse_variant), after a warm-up ring of warm_local positions per rank (a
    new group's first transfers, a new config's first load); or alt_<name>_error. breakdown:
    one more traced forward and backward, its timeline logged (alt_<name>_trace_wait_ms)."""
    from .. import distributed as cfd

    key = f"alt_{name}"
    out = {}
    flags = ("EARLY_SEND", "SPLIT_Q", "REVERSE_BWD", "FWD_DYNAMIC", "PRIORITY_GROUP",
             "RING_MAX_CTAS", "FWD_GRID_STEPS", "DKV_HOME", "FWD_FULL_GRID_STEPS",
             "BWD_LOW_MEMORY", "DQ_IN_WORKSPACE", "HOME_LAZY_FP32", "BWD_HEAD_GROUPS",
             "FWD_HEAD_GROUPS")
    saved = {f: getattr(cfd, f) for f in flags}
    try:
        spec = parse_variant(name)
        apply_variant(spec)
        own = spec["priority"] or spec["max_ctas"] is not None or spec["rotate"]
        group = _variant_group(spec, world) if own else _MAIN["group"]
        bwd(fwd(group, n=warm_local), group, n=warm_local)
        res = fwd(group)
        out[f"{key}_fwd_ms"] = _timed(lambda: fwd(group), reps)
        out[f"{key}_bwd_ms"] = _timed(lambda: bwd(res, group), reps)
        out[f"{key}_tflops_per_gpu"] = flops_total / world / (out[f"{key}_fwd_ms"] +
                                                              out[f"{key}_bwd_ms"]) / 1e9
        what = "; ".join(AB_VARIANTS.get(p) or AB_VARIANTS[p.rstrip("0123456789") + "N"]
                         for p in name.split("+"))
        log(f"  {name} ({what}): fwd {out[f'{key}_fwd_ms']:.1f} ms bwd "
            f"{out[f'{key}_bwd_ms']:.1f} ms, {out[f'{key}_tflops_per_gpu']:.0f} TFLOPs/GPU "
            f"(as run: {rec['fwd_ms']:.1f} / {rec['bwd_ms']:.1f} ms)")
        if breakdown:
            bd = _breakdown(world, lambda: fwd(group), lambda: bwd(res, group))
            out[f"{key}_trace_wait_ms"] = bd["trace_wait_ms"]
            for line in bd["timeline_lines"]:
                log(f"  [{name}]{line[1:]}")
        del res
    except Exception as exc:  # noqa: BLE001 - a field says why
        out[f"{key}_error"] = _short(exc)
        log(f"  {name}: {out[f'{key}_error']}")
    finally:
        for flag, value in saved.items():
            setattr(cfd, flag, value)
    return out


def _breakdown(world, fwd, bwd) -> dict:
    """One forward and one backward with cuflash.distributed.TRACE on: per phase (PHASES),
    <phase>_ms the max over ranks of the rank's sum over steps, <phase>_steps_ms every rank's
    steps ("r0 a/b r1 c/d"), and trace_wait_ms (the max over ranks of the waits and the last
    hop: exposed communication, and waiting for a slower neighbour)."""
    import torch
    import torch.distributed as dist

    from .. import distributed as cfd

    times: dict = {}
    mine_tl = {"gpu": torch.cuda.current_device()}
    for name, fn in (("fwd", fwd), ("bwd", bwd)):
        dist.barrier()
        torch.cuda.synchronize()
        cfd.TRACE = []
        try:
            fn()
        finally:
            trace, cfd.TRACE = cfd.TRACE, None
        times.update(cfd.trace_summary(trace))
        mine_tl[name] = cfd.trace_timeline(trace)
    timelines = [None] * world
    dist.all_gather_object(timelines, mine_tl)
    mine = torch.zeros(len(PHASES), world, dtype=torch.float64, device="cuda")
    for i, phase in enumerate(PHASES):
        for step, ms in enumerate(times.get(phase, [])[:world]):
            mine[i, step] = ms
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    per_rank = [t.tolist() for t in every]  # [rank][phase][step]
    out = {}
    for i, phase in enumerate(PHASES):
        out[f"{phase}_ms"] = max(sum(r[i]) for r in per_rank)
        out[f"{phase}_steps_ms"] = " ".join(f"r{j} " + "/".join(f"{x:.2f}" for x in r[i])
                                            for j, r in enumerate(per_rank))
    waits = [PHASES.index(p) for p in ("fwd_wait", "bwd_wait", "bwd_final")]
    out["trace_wait_ms"] = max(sum(sum(r[i]) for i in waits) for r in per_rank)
    out["timeline_lines"] = timeline_lines(timelines)
    return out


def _steps(spans, phase) -> dict:
    """{step: (first start, last end, summed ms)} of one phase's spans."""
    out: dict = {}
    for ph, step, t0, t1 in spans:
        if ph == phase:
            a, b, total = out.get(step, (t0, t1, 0.0))
            out[step] = (min(a, t0), max(b, t1), total + (t1 - t0))
    return out


def _runs(configs, phase) -> str:
    """A phase's config names by step, equal neighbours joined: "s0 A; s1-3 B"."""
    by_step: dict = {}
    for ph, step, name in configs:
        if ph == phase:
            by_step.setdefault(step, [])
            if name not in by_step[step]:
                by_step[step].append(name)
    runs: list = []  # [first step, last step, names]
    for step in sorted(by_step):
        names = " + ".join(by_step[step])
        if runs and runs[-1][2] == names and runs[-1][1] == step - 1:
            runs[-1][1] = step
        else:
            runs.append([step, step, names])
    return "; ".join(f"s{a}" + (f"-{b}" if b > a else "") + f" {n}" for a, b, n in runs)


def timeline_lines(timelines) -> list:
    """The traced forward and backward of every rank as lines, times in ms from the rank's own
    origin (its ring call's first event): per step "s1 k28.3+53.1 w0.0 x3.2-80.9": the compute
    stream's kernels start at 28.3 and run 53.1 ms in all, it waits 0.0 ms for the transfer,
    and the side stream reaches the step's K/V transfer at 3.2 and sees it done at 80.9 (a
    stretch much longer than its bytes need: it waited for its peer's kernel, or for SMs);
    a..: the backward's dK/dV accumulator transfer, h..: the last hop home. Then each rank's
    configs per step ("same on every rank" when they are)."""
    lines = []
    cfgs = {}
    for r, tl in enumerate(timelines):
        for op in ("fwd", "bwd"):
            spans, configs = tl[op]
            comp, wait = _steps(spans, f"{op}_compute"), _steps(spans, f"{op}_wait")
            xfer = _steps(spans, f"{op}_xfer")
            acc, home = _steps(spans, "bwd_acc_xfer"), _steps(spans, "bwd_home_xfer")
            parts = []
            for step in sorted(set(comp) | set(xfer) | set(acc) | set(home)):
                p = f"s{step}"
                if step in comp:
                    p += f" k{comp[step][0]:.1f}+{comp[step][2]:.1f}"
                if step in wait:
                    p += f" w{wait[step][2]:.1f}"
                for tag, d in (("x", xfer), ("a", acc), ("h", home)):
                    if step in d:
                        p += f" {tag}{d[step][0]:.1f}-{d[step][1]:.1f}"
                parts.append(p)
            lines.append(f"  timeline r{r} (GPU {tl['gpu']}) {op}: " + " | ".join(parts))
            cfgs.setdefault(op, []).append(_runs(configs, f"{op}_config"))
    for op, per_rank in cfgs.items():
        if len(set(per_rank)) == 1:
            lines.append(f"  configs {op} (same on every rank): {per_rank[0]}")
        else:
            lines += [f"  configs {op} r{r}: {c}" for r, c in enumerate(per_rank)]
    return lines


def _breakdown_line(rec) -> str:
    parts = [f"{p} {rec[p + '_ms']:.2f} [{rec[p + '_steps_ms']}]" for p in PHASES]
    return (f"  breakdown P={rec['P']} s={rec['seqlen']} causal={rec['causal']} (ms; max over "
            f"ranks of the sum over steps [each rank's steps]): " + "; ".join(parts))


def _line(rec, shard) -> str:
    if "error" in rec:
        return f"ring s={rec['seqlen']} causal={rec['causal']}: error {rec['error']}"
    eff = rec.get("efficiency")
    return (f"ring P={rec['P']} s={rec['seqlen']} causal={rec['causal']}: fwd {rec['fwd_ms']:.1f} ms "
            f"bwd {rec['bwd_ms']:.1f} ms, {rec['tflops_per_gpu']:.0f} TFLOPs/GPU, comm exposed "
            f"{rec['comm_exposed_ms']:.1f} ms, peak "
            + (f"{rec['peak_bytes_per_gpu'] / 2**30:.2f} GiB/GPU; " if "peak_bytes_per_gpu" in rec
               else "not run; ") +
            f"1-GPU shard {shard.get('tflops', float('nan')):.0f} TFLOPs -> efficiency "
            f"{eff if eff is not None else float('nan'):.3f}")


def _full(rank, seqlen, causal, opts, base, log) -> list:
    """Single-GPU cuflash on the whole sequence, on rank 0 (the others wait)."""
    import torch
    import torch.distributed as dist

    from ..api import flash_attn_func

    rec = dict(base, impl="cuflash_1gpu", P=1)
    if rank == 0:
        b, h, d = 1, opts["nheads"], opts["d"]
        try:
            g = torch.Generator(device="cuda").manual_seed(7)
            q, k, v, dout = (torch.randn(b, seqlen, h, d, device="cuda", dtype=torch.bfloat16,
                                         generator=g) for _ in range(4))
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            times = {"fwd_ms": [], "bwd_ms": []}
            for i in range(1 + opts["reps"]):
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                ev[0].record()
                o = flash_attn_func(*leaves, causal=causal)
                ev[1].record()
                torch.autograd.grad(o, leaves, dout)
                ev[2].record()
                torch.cuda.synchronize()
                if i:  # the first: warm-up
                    times["fwd_ms"].append(ev[0].elapsed_time(ev[1]))
                    times["bwd_ms"].append(ev[1].elapsed_time(ev[2]))
            for key, ts in times.items():
                rec[key] = sorted(ts)[len(ts) // 2]
            f = flops(b, h, seqlen, d, causal) + flops(b, h, seqlen, d, causal, "bwd")
            rec["tflops"] = f / (rec["fwd_ms"] + rec["bwd_ms"]) / 1e9
            # peak memory of one autograd forward + backward, counted as the ring's is (above
            # what the inputs and dout already hold), so per-GPU memory compares with 1/P
            del o
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            o = flash_attn_func(*leaves, causal=causal)
            torch.autograd.grad(o, leaves, dout)
            torch.cuda.synchronize()
            rec["peak_bytes"] = int(torch.cuda.max_memory_allocated() - before)
            rec["inputs_bytes"] = 4 * q.numel() * q.element_size()
            log(f"cuflash 1 GPU s={seqlen} causal={causal}: fwd {rec['fwd_ms']:.1f} ms bwd "
                f"{rec['bwd_ms']:.1f} ms, {rec['tflops']:.0f} TFLOPs, peak {rec['peak_bytes'] / 2**30:.2f} GiB")
            del q, k, v, dout, leaves, o
        except Exception as exc:  # noqa: BLE001
            rec["error"] = _short(exc)
            log(f"cuflash 1 GPU s={seqlen} causal={causal}: {rec['error']}")
        torch.cuda.empty_cache()
    dist.barrier()
    return [rec] if rank == 0 else []


_meshes: dict = {}


def _cp_options():
    """torch's context-parallel options object (its module moved between releases)."""
    import importlib

    for name in ("torch.distributed.tensor.experimental._context_parallel._attention",
                 "torch.distributed.tensor.experimental._attention"):
        try:
            return importlib.import_module(name)._cp_options
        except (ImportError, AttributeError):
            continue
    return None


def _torch_cp(rank, world, seqlen, causal, opts, base, log, backend="flash") -> dict:
    """torch's context parallel around SDPA (``backend``: flash or cudnn) on the same problem.
    torch balances causal work with its head-tail layout; it refuses that layout without
    causal, so non-causal runs with load balancing off (every pair is full there anyway)."""
    import torch
    import torch.nn.functional as F

    cp_opts = _cp_options()
    # None: this torch has no options object to set, so its own default ran
    rec = dict(impl="torch_cp", **base, backend=backend,
               load_balance=None if cp_opts is None else bool(causal))
    saved = None if cp_opts is None else cp_opts.enable_load_balance
    b, h, d, reps = 1, opts["nheads"], opts["d"], opts["reps"]
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if cp_opts is not None:
            cp_opts.enable_load_balance = bool(causal)
        sdpa_backend = {"flash": SDPBackend.FLASH_ATTENTION,
                        "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
        mesh = _meshes.get(world)
        if mesh is None:  # one mesh for the run (each is a collective setup)
            mesh = _meshes[world] = init_device_mesh("cuda", (world,))
        g = torch.Generator(device="cuda").manual_seed(99)
        # full (b, h, s, d) buffers on every rank: the context shards them in place
        q, k, v, dout = (torch.randn(b, h, seqlen, d, device="cuda", dtype=torch.bfloat16,
                                     generator=g) for _ in range(4))
        with sdpa_kernel(sdpa_backend), \
                context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2],
                                 no_restore_buffers={q, k, v, dout}):
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            holder = {}

            def fwd():
                holder["o"] = F.scaled_dot_product_attention(*leaves, is_causal=causal)

            def bwd():
                torch.autograd.grad(holder["o"], leaves, dout, retain_graph=True)

            fwd()
            bwd()
            rec["fwd_ms"] = _timed(fwd, reps)
            rec["bwd_ms"] = _timed(bwd, reps)
            holder.clear()
        f = flops(b, h, seqlen, d, causal) + flops(b, h, seqlen, d, causal, "bwd")
        rec["tflops_per_gpu"] = f / world / (rec["fwd_ms"] + rec["bwd_ms"]) / 1e9
        log(f"torch_cp[{backend}] P={world} s={seqlen} causal={causal}: fwd {rec['fwd_ms']:.1f} ms "
            f"bwd {rec['bwd_ms']:.1f} ms, {rec['tflops_per_gpu']:.0f} TFLOPs/GPU")
    except Exception as exc:  # noqa: BLE001 - record why it did not run
        rec["error"] = _short(exc)
        log(f"torch_cp[{backend}] P={world} s={seqlen} causal={causal}: did not run ({rec['error']})")
    finally:
        if cp_opts is not None:
            cp_opts.enable_load_balance = saved
    torch.cuda.empty_cache()
    return rec


if __name__ == "__main__":
    import sys

    sys.exit(main())
