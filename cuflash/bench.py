"""Benchmarks, FlashAttention convention, side by side with torch SDPA in one process.

dim 2048, heads = 2048 / headdim, batch * seqlen = 16384; FLOPs = 4 * b * h * s_q * s_k * d,
halved under a causal mask; backward FLOPs = 2.5x forward. Each implementation is timed in
this process on the same inputs with CUDA events: warm-up, then the median of `reps`
samples of 10 back-to-back calls.

    python -m cuflash bench [--mode fwd|fwdbwd|memory|tuned|all ...] [--hdims 64 128]
                            [--seqlens 512 ... 16384] [--dtypes bf16 fp16] [--causal both]
                            [--kernels fwd bwd] [--sweep] [--deterministic] [--reps N]
                            [--out results]

Modes (several may be given, e.g. --mode fwdbwd memory; the default is fwd):
  fwd     forward only: results/<gpu>/bench_fwd.{json,csv,png}; --sweep also times every
          valid config of the tuning space (impl "cuflash[<config name>]").
  fwdbwd  forward and backward: results/<gpu>/bench_fwdbwd.{json,csv,png}. The backward is
          timed alone (forward once, then the backward call): cuflash through
          interface.flash_attn_backward on torch tensors, SDPA (flash, cuDNN backends) as
          torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) on (b, h, s, d)
          views. Records as bench_fwd.json's plus bwd_ms, bwd_tflops, fwdbwd_tflops; a
          backend that refuses a shape gets a record with an "error" field.
          cuflash records also carry bwd_autograd_ms (the same backward through
          torch autograd) and grad_rel_diff_vs_sdpa_flash (a sanity check).
          --deterministic adds impl "cuflash[det]" (deterministic=True).
  memory  peak memory of one forward+backward through autograd, batch 1, 16 heads,
          d 128, bf16, causal, seqlen 1k..64k (--mem-seqlens): cuflash, sdpa_flash,
          sdpa_cudnn, sdpa_math (standard attention). results/<gpu>/memory.{json,png};
          peak_bytes = torch.cuda.max_memory_allocated() during the step minus what was
          allocated before it (q, k, v, dout), so it counts out, lse, saved tensors,
          workspaces and dq, dk, dv; inputs_bytes and peak_total_bytes are recorded too.
          torch.OutOfMemoryError gives a record with "oom": true.
  tuned   the tuned configs against the heuristic defaults and SDPA, per kernel (--kernels,
          default fwd bwd), dtype (default here bf16 and fp16), hdim, causal and seqlen:
          cuflash_tuned (the config in force: config_for / bwd_config_for with the seqlen;
          its name and source recorded), cuflash_heuristic (default_fwd_config /
          default_bwd_config for this GPU's arch and shared memory, as the tuned-table
          lookup falls back to), sdpa_flash and sdpa_cudnn. fwd times the forward alone,
          bwd the backward alone as fwdbwd does (cuflash: flash_attn_backward with the
          explicit config; SDPA: torch.autograd.grad). Where the two cuflash configs are
          the same kernel it is timed once and both records carry that time with
          same_config true; where they differ their samples are interleaved (A B, B A, ...)
          and each gets its median. results/<gpu>/bench_tuned.{json,csv,png}; records:
          impl, kernel, dtype, hdim, causal, batch, seqlen, nheads, ms, tflops, config,
          source, same_config (an "error" field where a backend refused). Prints a table of
          tuned/heuristic and tuned/sdpa_flash per cell and the verdict line
          "tuned >= heuristic in N/M cells (min ratio X)".
  all     fwd, fwdbwd and memory (not tuned).
"""
from __future__ import annotations

import argparse
import csv
import gc
import json
import math
import statistics
import time
from pathlib import Path

from . import _gpu
from .config import valid_fwd_configs

TOTAL_TOKENS = 16384
MODEL_DIM = 2048
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
MEM_SEQLENS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
FWDBWD_IMPLS = ("cuflash", "sdpa_flash", "sdpa_cudnn")
TUNED_KERNELS = ("fwd", "bwd")
TUNED_SDPA = ("sdpa_flash", "sdpa_cudnn")
TUNED_IMPLS = ("cuflash_tuned", "cuflash_heuristic") + TUNED_SDPA
MEMORY_IMPLS = ("cuflash", "sdpa_flash", "sdpa_cudnn", "sdpa_math")
PLOT_IMPLS = ("cuflash", "cuflash[det]", "cuflash_tuned", "cuflash_heuristic", "sdpa_flash",
              "sdpa_cudnn", "sdpa_math")
# The bar (H100, bf16, seqlen >= 2k): backward >= 0.9x SDPA flash, memory <= 1.1x.
BAR_MIN_SEQLEN, BAR_BWD_RATIO, BAR_MEM_RATIO = 2048, 0.9, 1.1


def flops(batch, nheads, seqlen_q, seqlen_k, head_dim, causal, mode="fwd"):
    f = 4 * batch * nheads * seqlen_q * seqlen_k * head_dim
    if causal:
        f //= 2
    return f * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]


def shapes(hdims=(64, 128), seqlens=SEQLENS, total_tokens=TOTAL_TOKENS, model_dim=MODEL_DIM):
    """The benchmark's problems: (hdim, seqlen, batch, nheads), batch * seqlen = total_tokens."""
    return [dict(hdim=h, seqlen=s, batch=max(1, total_tokens // s), nheads=model_dim // h)
            for h in hdims for s in seqlens]


def time_ms(fn, warmup=3, reps=20, inner=10):
    """Median milliseconds per call of fn(), timed with CUDA events.

    Each sample times `inner` back-to-back calls, so the GPU runs from a full queue and the
    number is the kernel's, not the host's per-call overhead (measured separately).
    """
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def host_overhead_us(fn, calls=200):
    """Host microseconds per call (what a caller pays before the GPU sees the launch)."""
    import time

    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / calls * 1e6


def gpu_dir_name(device: int = 0) -> str:
    return _gpu.name(device).replace(" ", "_")


def gpu_label(device: int = 0) -> str:
    """The GPU's name for plot titles; never raises (plots are also drawn without a GPU)."""
    try:
        return _gpu.name(device) if _gpu.available() else "no GPU"
    except Exception:  # noqa: BLE001
        return "unknown GPU"


def _short(exc: BaseException, n: int = 200) -> str:
    return f"{exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:n]


# ---------------------------------------------------------------------------------------
# forward

def run(hdims=(64, 128), seqlens=SEQLENS, dtypes=("bf16",),
        causals=(False, True), sweep=False, out_dir="results", reps=20, log=print):
    import torch

    from .interface import config_for, flash_attn_func

    _gpu.require("the benchmark")
    records = []
    for dtype in dtypes:
        tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        for hdim in hdims:
            nheads = MODEL_DIM // hdim
            for causal in causals:
                for seqlen in seqlens:
                    batch = max(1, TOTAL_TOKENS // seqlen)
                    q, k, v = (torch.randn(batch, seqlen, nheads, hdim, device="cuda", dtype=tdtype)
                               for _ in range(3))
                    f = flops(batch, nheads, seqlen, seqlen, hdim, causal)
                    base = dict(dtype=dtype, hdim=hdim, causal=causal, batch=batch, seqlen=seqlen,
                                nheads=nheads)
                    impls = {"cuflash": (lambda: flash_attn_func(q, k, v, causal=causal),
                                         config_for(hdim, dtype, causal, seqlen=seqlen).name)}
                    if sweep:
                        for cfg in valid_fwd_configs(hdim, dtype, causal, _gpu.max_smem()):
                            impls[f"cuflash[{cfg.name}]"] = (
                                lambda cfg=cfg: flash_attn_func(q, k, v, causal=causal, config=cfg),
                                cfg.name)
                    for name in ("sdpa_flash", "sdpa_cudnn"):
                        impls[name] = (_sdpa_kernel("fwd", name, q, k, v, None, causal), "")
                    row = {}
                    for impl, (fn, cfg_name) in impls.items():
                        try:
                            ms = time_ms(fn, reps=reps)
                        except Exception as exc:  # noqa: BLE001 - a backend may refuse a shape
                            log(f"  {impl}: failed ({exc.__class__.__name__}: {str(exc)[:120]})")
                            continue
                        rec = dict(impl=impl, **base, config=cfg_name, fwd_ms=ms,
                                   fwd_tflops=f / ms / 1e9)
                        if impl in ("cuflash", "sdpa_flash"):
                            rec["host_us"] = host_overhead_us(fn, calls=50)
                        records.append(rec)
                        row[impl] = rec["fwd_tflops"]
                    ratio = row.get("cuflash", math.nan) / row.get("sdpa_flash", math.nan)
                    log(f"{dtype} d={hdim} causal={causal!s:5} s={seqlen:5} b={batch:2}: "
                        + "  ".join(f"{k}={v:6.1f}" for k, v in row.items() if "[" not in k)
                        + f"  cuflash/flash={ratio:.2f}")
    out = Path(out_dir) / gpu_dir_name()
    write(records, out, "bench_fwd", "fwd_tflops", log)
    return records


# ---------------------------------------------------------------------------------------
# forward + backward

def _sdpa_backend(impl):
    from torch.nn.attention import SDPBackend

    return {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa_math": SDPBackend.MATH}[impl]


def _fwdbwd_fns(impl, q, k, v, dout, causal):
    """(forward callable, backward callable, {config names}) for one impl on these inputs.

    q, k, v, dout: (b, s, h, d) CUDA tensors without requires_grad. The backward callable
    returns (dq, dk, dv) in (b, s, h, d); it reuses one forward's saved state.
    """
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    if impl.startswith("cuflash"):
        from . import interface

        deterministic = impl == "cuflash[det]"
        dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}[q.dtype]
        names = {}
        try:  # the names are informative only (and need a GPU)
            seqlen = max(q.shape[1], k.shape[1])
            names["config"] = interface.config_for(q.shape[3], dtype, causal, seqlen=seqlen).name
            names["bwd_config"] = interface.bwd_config_for(q.shape[3], dtype, causal, deterministic,
                                                           seqlen=seqlen).name
        except Exception:  # noqa: BLE001
            pass
        out, lse, _ = interface.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)

        def fwd():
            return interface.flash_attn_func(q, k, v, causal=causal)

        def bwd():
            return interface.flash_attn_backward(dout, q, k, v, out, lse, causal=causal,
                                                 deterministic=deterministic)
        return fwd, bwd, names

    backend = _sdpa_backend(impl)
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    dt = dout.transpose(1, 2)  # same memory layout as SDPA's output for these views

    def fwd():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    out = fwd()

    def bwd():
        with sdpa_kernel(backend):
            g = torch.autograd.grad(out, (qt, kt, vt), dt, retain_graph=True)
        return tuple(x.transpose(1, 2) for x in g)
    return fwd, bwd, {}


def _cuflash_autograd_bwd(q, k, v, dout, causal):
    """The backward through cuflash's torch autograd bridge (for bwd_autograd_ms)."""
    import torch

    from .interface import flash_attn_func

    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    out = flash_attn_func(qg, kg, vg, causal=causal)
    return lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True)


def grad_rel_diff(a, b) -> float:
    """max over (dq, dk, dv) of max|a - b| / max|b| (float32)."""
    worst = 0.0
    for x, y in zip(a, b):
        x, y = x.float(), y.float()
        worst = max(worst, float((x - y).abs().max()) / max(float(y.abs().max()), 1e-30))
    return worst


def run_fwdbwd(hdims=(64, 128), seqlens=SEQLENS, dtypes=("bf16",), causals=(False, True),
               impls=FWDBWD_IMPLS, out_dir="results", reps=10, deterministic=False,
               autograd=True, log=print, device="cuda", total_tokens=TOTAL_TOKENS):
    """Forward and backward timings; writes results/<gpu>/bench_fwdbwd.{json,csv,png}.

    device and total_tokens exist for the CPU test of this loop (with time_ms replaced)."""
    import torch

    if device == "cuda":
        _gpu.require("the benchmark")
    impls = list(impls)
    if deterministic and "cuflash[det]" not in impls:
        impls.insert(impls.index("cuflash") + 1 if "cuflash" in impls else 0, "cuflash[det]")
    records = []
    for dtype in dtypes:
        tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        combos = [(c, shp) for h in hdims for c in causals
                  for shp in shapes((h,), seqlens, total_tokens)]
        for causal, shp in combos:  # (hdim, causal, seqlen) order, as the forward's
            hdim, seqlen, batch, nheads = shp["hdim"], shp["seqlen"], shp["batch"], shp["nheads"]
            torch.manual_seed(0)
            q, k, v, dout = (torch.randn(batch, seqlen, nheads, hdim, device=device, dtype=tdtype)
                             for _ in range(4))
            f = flops(batch, nheads, seqlen, seqlen, hdim, causal)
            base = dict(dtype=dtype, hdim=hdim, causal=causal, batch=batch, seqlen=seqlen,
                        nheads=nheads)
            ref_grads = None
            shape_recs = []
            for impl in impls:
                rec = dict(impl=impl, **base, config="")
                try:
                    fwd, bwd, names = _fwdbwd_fns(impl, q, k, v, dout, causal)
                    rec.update(names)
                    ms = time_ms(fwd, reps=reps)
                    rec.update(fwd_ms=ms, fwd_tflops=f / ms / 1e9)
                    grads = bwd()
                    ms = time_ms(bwd, reps=reps)
                    rec.update(bwd_ms=ms, bwd_tflops=2.5 * f / ms / 1e9,
                               fwdbwd_tflops=3.5 * f / (rec["fwd_ms"] + ms) / 1e9)
                    if impl == "sdpa_flash":
                        ref_grads = grads
                    elif ref_grads is not None:
                        rec["grad_rel_diff_vs_sdpa_flash"] = grad_rel_diff(grads, ref_grads)
                    elif impl.startswith("cuflash"):
                        rec["_grads"] = grads  # compared once sdpa_flash has run
                    if impl == "cuflash" and autograd:
                        try:
                            ms = time_ms(_cuflash_autograd_bwd(q, k, v, dout, causal),
                                         reps=max(3, reps // 2))
                            rec["bwd_autograd_ms"] = ms
                        except Exception as exc:  # noqa: BLE001
                            rec["bwd_autograd_error"] = _short(exc)
                    del grads
                except Exception as exc:  # noqa: BLE001 - a backend may refuse a shape
                    rec["error"] = _short(exc)
                    log(f"  {impl}: failed ({rec['error']})")
                fwd = bwd = None
                shape_recs.append(rec)
            for rec in shape_recs:
                g = rec.pop("_grads", None)
                if g is not None and ref_grads is not None:
                    rec["grad_rel_diff_vs_sdpa_flash"] = grad_rel_diff(g, ref_grads)
            records += shape_recs
            log(fwdbwd_line(shape_recs))
            del q, k, v, dout, ref_grads, shape_recs
            gc.collect()
    out = Path(out_dir) / (gpu_dir_name() if device == "cuda" else device)
    write(records, out, "bench_fwdbwd", ("bwd_tflops", "fwdbwd_tflops"), log)
    for metric in ("bwd_tflops", "fwdbwd_tflops"):
        log("")
        log(ratio_table(records, metric))
    log("")
    log(bar_summary(records))
    return records


def fwdbwd_line(recs) -> str:
    """One log line per shape: fwd/bwd TFLOPs of each impl and cuflash's bwd ratio to flash."""
    if not recs:
        return ""
    r0 = recs[0]
    parts = []
    for r in recs:
        if "error" in r and "bwd_tflops" not in r:
            parts.append(f"{r['impl']}=error")
        else:
            parts.append(f"{r['impl']}={r.get('fwd_tflops', math.nan):5.1f}/{r.get('bwd_tflops', math.nan):5.1f}")
    by = {r["impl"]: r.get("bwd_tflops", math.nan) for r in recs}
    ratio = by.get("cuflash", math.nan) / by.get("sdpa_flash", math.nan)
    return (f"{r0['dtype']} d={r0['hdim']} causal={r0['causal']!s:5} s={r0['seqlen']:5} "
            f"b={r0['batch']:2} fwd/bwd TFLOPs: " + "  ".join(parts)
            + f"  bwd cuflash/flash={ratio:.2f}")


def ratio_table(records, metric="bwd_tflops", impl="cuflash", ref="sdpa_flash") -> str:
    """Markdown table: one row per (dtype, hdim, causal), one column per seqlen,
    cells 'value (ratio x)' of `impl` against `ref` in the same run; '-' where missing."""
    key = lambda r: (r["dtype"], r["hdim"], r["causal"])  # noqa: E731
    val = {(key(r), r["seqlen"], r["impl"]): r.get(metric) for r in records}
    seqlens = sorted({r["seqlen"] for r in records})
    rows = sorted({key(r) for r in records})
    lines = [f"{metric} of {impl} (ratio to {ref})", "",
             "| dtype | d | causal | " + " | ".join(_fmt_seqlen(s) for s in seqlens) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in seqlens) + " |"]
    for row in rows:
        cells = []
        for s in seqlens:
            a, b = val.get((row, s, impl)), val.get((row, s, ref))
            if a is None:
                cells.append("-")
            elif b:
                cells.append(f"{a:.0f} ({a / b:.2f}×)")
            else:
                cells.append(f"{a:.0f}")
        lines.append(f"| {row[0]} | {row[1]} | {'yes' if row[2] else 'no'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt_seqlen(s: int) -> str:
    return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


def bar_summary(records, impl="cuflash", ref="sdpa_flash", min_seqlen=BAR_MIN_SEQLEN,
                bar=BAR_BWD_RATIO) -> str:
    """The issue's backward bar: bwd TFLOPs >= bar x ref at seqlen >= min_seqlen."""
    by = {(r["impl"], r["dtype"], r["hdim"], r["causal"], r["seqlen"]): r.get("bwd_tflops")
          for r in records}
    ratios, missing = [], []
    for (name, dtype, hdim, causal, s), v in sorted(by.items(), key=lambda kv: str(kv[0])):
        if name != impl or s < min_seqlen:
            continue
        b = by.get((ref, dtype, hdim, causal, s))
        if v is None or not b:
            missing.append((dtype, hdim, causal, s))
        else:
            ratios.append((v / b, dtype, hdim, causal, s))
    if not ratios:
        return f"backward bar: no {impl}/{ref} pairs at seqlen >= {min_seqlen}"
    worst = min(ratios)
    ok = worst[0] >= bar and not missing
    txt = (f"backward bar ({impl} >= {bar}x {ref}, seqlen >= {min_seqlen}): "
           f"{'PASS' if ok else 'FAIL'}; worst {worst[0]:.2f}x at {worst[1]} d={worst[2]} "
           f"causal={worst[3]} s={worst[4]}; {sum(r[0] >= bar for r in ratios)}/{len(ratios)} "
           "shapes meet it")
    if missing:
        txt += f"; {len(missing)} shapes without a number (errors)"
    return txt


# ---------------------------------------------------------------------------------------
# tuned configs against the heuristic defaults (and SDPA)

def tuned_configs(kernel, hdim, dtype, causal, seqlen, device=0):
    """(tuned config, its source, heuristic config, its source) for one benchmark cell.

    tuned: the config cuflash runs for this problem, config_for / bwd_config_for at this
    seqlen (a tuned-table entry, or the heuristic where there is none). heuristic: the
    default a tuned entry overrides, made as the lookup's fallback makes it
    (tuning.table.choose): default_fwd_config / default_bwd_config for this GPU's arch and
    opt-in shared memory; the backward non-deterministic, as the tuner tunes it."""
    from .config import default_bwd_config, default_fwd_config
    from .interface import bwd_config_for, config_for

    arch, smem = _gpu.arch(device), _gpu.max_smem(device)
    if kernel == "fwd":
        tuned, source = config_for(hdim, dtype, causal, device=device, seqlen=seqlen,
                                   with_source=True)
        heur = default_fwd_config(hdim, dtype, causal, arch=arch, max_smem=smem)
    elif kernel == "bwd":
        tuned, source = bwd_config_for(hdim, dtype, causal, False, device=device, seqlen=seqlen,
                                       with_source=True)
        heur = default_bwd_config(hdim, dtype, causal, arch=arch, max_smem=smem)
    else:
        raise ValueError(f"kernel must be one of {TUNED_KERNELS}, got {kernel!r}")
    return (tuned, source, heur,
            f"heuristic (default_{kernel}_config, sm_{arch[0]}{arch[1]}, {smem} B shared memory)")


def time_interleaved(fns, warmup=3, reps=20, inner=10):
    """Median ms per call of each of `fns`, their samples taken in alternating rounds
    (A B, B A, A B, ...) so that clock, thermal and neighbour drift hit all alike. A
    sample is time_ms of `inner` back-to-back calls, as time_ms's own samples are."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    samples = [[] for _ in fns]
    order = list(range(len(fns)))
    for r in range(reps):
        for i in (order if r % 2 == 0 else order[::-1]):
            samples[i].append(time_ms(fns[i], warmup=0, reps=1, inner=inner))
    return [statistics.median(s) for s in samples]


def _cuflash_kernel(kernel, q, k, v, dout, causal):
    """config -> callable running one cuflash kernel with that explicit config on these
    inputs: the forward, or the backward alone on one forward's out and lse (as run_fwdbwd
    times bwd_ms: interface.flash_attn_backward on the torch tensors, no autograd)."""
    from . import interface

    if kernel == "fwd":
        return lambda cfg: (lambda: interface.flash_attn_func(q, k, v, causal=causal, config=cfg))
    out, lse, _ = interface.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    return lambda cfg: (lambda: interface.flash_attn_backward(
        dout, q, k, v, out, lse, causal=causal, deterministic=False, config=cfg))


def _sdpa_kernel(kernel, impl, q, k, v, dout, causal):
    """SDPA's forward alone (as run times it, no autograd) or backward alone (as
    run_fwdbwd: torch.autograd.grad on one forward's graph)."""
    if kernel == "bwd":
        return _fwdbwd_fns(impl, q, k, v, dout, causal)[1]
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    backend = _sdpa_backend(impl)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def fwd():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    return fwd


def measure_tuned_cell(kernel, q, k, v, dout, causal, base, kernel_flops, reps=20,
                       sdpa=TUNED_SDPA, log=print):
    """The records of one cell: cuflash_tuned, cuflash_heuristic, then the SDPA impls.

    Identical configs are one kernel: timed once, both records get the time. Different
    ones run once each first (compile; a config that fails gets an "error" record), then
    are timed interleaved (time_interleaved)."""
    recs = []

    def new(impl, **kw):
        rec = dict(impl=impl, **base, config="", source="", same_config=None)
        rec.update(kw)
        recs.append(rec)
        return rec

    def timed(rec, ms):
        rec.update(ms=ms, tflops=kernel_flops / ms / 1e9)

    def failed(rec, exc):
        rec["error"] = _short(exc)
        log(f"  {rec['impl']}: failed ({rec['error']})")

    try:
        tuned, source, heur, heur_source = tuned_configs(base["kernel"], base["hdim"],
                                                         base["dtype"], causal, base["seqlen"])
        same = tuned == heur
        t = new("cuflash_tuned", config=tuned.name, source=source, same_config=same)
        h = new("cuflash_heuristic", config=heur.name, source=heur_source, same_config=same)
    except Exception as exc:  # noqa: BLE001 - no config, no cuflash numbers
        for impl in ("cuflash_tuned", "cuflash_heuristic"):
            failed(new(impl), exc)
    else:
        try:
            make = _cuflash_kernel(kernel, q, k, v, dout, causal)
            if same:
                ms = time_ms(make(tuned), reps=reps)
                timed(t, ms)
                timed(h, ms)
            else:
                live = []
                for rec, cfg in ((t, tuned), (h, heur)):
                    try:
                        fn = make(cfg)
                        fn()  # compile and run once: a failing config is not timed
                        live.append((rec, fn))
                    except Exception as exc:  # noqa: BLE001
                        failed(rec, exc)
                if len(live) == 2:
                    for (rec, _), ms in zip(live, time_interleaved([fn for _, fn in live], reps=reps)):
                        timed(rec, ms)
                        rec["interleaved"] = True
                elif live:
                    timed(live[0][0], time_ms(live[0][1], reps=reps))
        except Exception as exc:  # noqa: BLE001
            for rec in (t, h):
                if "ms" not in rec and "error" not in rec:
                    failed(rec, exc)
    for impl in sdpa:
        rec = new(impl)
        try:
            timed(rec, time_ms(_sdpa_kernel(kernel, impl, q, k, v, dout, causal), reps=reps))
        except Exception as exc:  # noqa: BLE001 - a backend may refuse a shape
            failed(rec, exc)
    return recs


def run_tuned(hdims=(64, 128), seqlens=SEQLENS, dtypes=("bf16", "fp16"), causals=(False, True),
              kernels=TUNED_KERNELS, out_dir="results", reps=20, sdpa=TUNED_SDPA, log=print,
              device="cuda", total_tokens=TOTAL_TOKENS):
    """Tuned vs heuristic vs SDPA; writes results/<gpu>/bench_tuned.{json,csv,png}, logs the
    ratio table and the verdict. device and total_tokens exist for the CPU test."""
    import torch

    if device == "cuda":
        _gpu.require("the benchmark")
    records = []
    for kernel in kernels:
        for dtype in dtypes:
            tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
            for hdim in hdims:
                for causal in causals:
                    for shp in shapes((hdim,), seqlens, total_tokens):
                        seqlen, batch, nheads = shp["seqlen"], shp["batch"], shp["nheads"]
                        torch.manual_seed(0)
                        q, k, v, *rest = (torch.randn(batch, seqlen, nheads, hdim,
                                                      device=device, dtype=tdtype)
                                          for _ in range(4 if kernel == "bwd" else 3))
                        dout = rest[0] if rest else None
                        f = flops(batch, nheads, seqlen, seqlen, hdim, causal, kernel)
                        base = dict(kernel=kernel, dtype=dtype, hdim=hdim, causal=causal,
                                    batch=batch, seqlen=seqlen, nheads=nheads)
                        recs = measure_tuned_cell(kernel, q, k, v, dout, causal, base, f, reps,
                                                  sdpa, log)
                        records += recs
                        log(tuned_line(recs))
                        del q, k, v, dout, rest, recs
                        gc.collect()
    out = Path(out_dir) / (gpu_dir_name() if device == "cuda" else device)
    write(records, out, "bench_tuned", "tflops", log, plotter=plot_tuned)
    log("")
    log(tuned_table(records))
    log("")
    log(tuned_verdict(records))
    return records


def _cell_key(r) -> tuple:
    return (r["kernel"], r["dtype"], r["hdim"], r["causal"], r["seqlen"])


def _kernel_order(kernel) -> int:
    return TUNED_KERNELS.index(kernel) if kernel in TUNED_KERNELS else len(TUNED_KERNELS)


def tuned_cells(records) -> dict:
    """{(kernel, dtype, hdim, causal, seqlen): {impl: record}}, in benchmark order."""
    cells = {}
    for r in records:
        cells.setdefault(_cell_key(r), {})[r["impl"]] = r
    return dict(sorted(cells.items(), key=lambda kv: (_kernel_order(kv[0][0]), kv[0][1:])))


def _ratio(cell: dict, impl: str, ref: str) -> float:
    """TFLOPs of impl / ref in one cell (= ref's ms / impl's ms); nan without both."""
    a, b = cell.get(impl, {}).get("tflops"), cell.get(ref, {}).get("tflops")
    return a / b if a and b else math.nan


def _fmt_ratio(x: float, digits: int) -> str:
    return "-" if math.isnan(x) else f"{x:.{digits}f}"


def tuned_line(recs) -> str:
    """One log line per cell: TFLOPs per impl, tuned/heuristic, tuned/sdpa_flash, config."""
    if not recs:
        return ""
    r0 = recs[0]
    cell = {r["impl"]: r for r in recs}
    parts = [f"{r['impl']}={r['tflops']:6.1f}" if "tflops" in r else f"{r['impl']}=error"
             for r in recs]
    t = cell.get("cuflash_tuned", {})
    same = " (same config)" if t.get("same_config") else ""
    return (f"{r0['kernel']} {r0['dtype']} d={r0['hdim']} causal={r0['causal']!s:5} "
            f"s={r0['seqlen']:5} b={r0['batch']:2} TFLOPs: " + "  ".join(parts)
            + f"  tuned/heuristic={_fmt_ratio(_ratio(cell, 'cuflash_tuned', 'cuflash_heuristic'), 3)}"
            + same + f"  tuned/flash={_fmt_ratio(_ratio(cell, 'cuflash_tuned', 'sdpa_flash'), 2)}"
            + (f"  [{t['config']}]" if t.get("config") else ""))


def tuned_table(records, ref="sdpa_flash") -> str:
    """Markdown table: one row per (kernel, dtype, hdim, causal), one column per seqlen;
    cells 'tuned/heuristic / tuned/ref' (TFLOPs ratios), '=' marking the cells where the
    tuned config is the heuristic's (one kernel, timed once), '-' a missing number."""
    cells = tuned_cells(records)
    seqlens = sorted({key[4] for key in cells})
    rows = list(dict.fromkeys(key[:4] for key in cells))
    lines = [f"tuned/heuristic / tuned/{ref} (TFLOPs ratios; '=': the tuned config is the "
             "heuristic's, timed once; '-': no number)", "",
             "| kernel | dtype | d | causal | " + " | ".join(_fmt_seqlen(s) for s in seqlens) + " |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in seqlens) + " |"]
    for row in rows:
        out = []
        for s in seqlens:
            cell = cells.get(row + (s,))
            if cell is None:
                out.append("")
                continue
            same = "=" if cell.get("cuflash_tuned", {}).get("same_config") else ""
            out.append(f"{_fmt_ratio(_ratio(cell, 'cuflash_tuned', 'cuflash_heuristic'), 3)}{same}"
                       f" / {_fmt_ratio(_ratio(cell, 'cuflash_tuned', ref), 2)}")
        lines.append(f"| {row[0]} | {row[1]} | {row[2]} | {'yes' if row[3] else 'no'} | "
                     + " | ".join(out) + " |")
    return "\n".join(lines)


def tuned_verdict(records, noise=0.01) -> str:
    """The issue's bar, one line: "tuned >= heuristic in N/M cells (min ratio X)", M the
    cells with a cuflash record (a cell without both numbers does not meet it), then the
    worst cell, how many cells run the heuristic's own config, how many of the misses
    are within `noise`, and PASS (N == M) or FAIL."""
    cells = [(key, c) for key, c in tuned_cells(records).items()
             if "cuflash_tuned" in c or "cuflash_heuristic" in c]
    ratios = [(_ratio(c, "cuflash_tuned", "cuflash_heuristic"), key) for key, c in cells]
    ratios = [(x, key) for x, key in ratios if not math.isnan(x)]
    m = len(cells)
    if not ratios:
        return f"tuned >= heuristic in 0/{m} cells (no tuned/heuristic pairs) -> FAIL"
    n = sum(x >= 1.0 for x, _ in ratios)
    worst, (kernel, dtype, hdim, causal, seqlen) = min(ratios)
    same = sum(bool(c.get("cuflash_tuned", {}).get("same_config")) for _, c in cells)
    near = sum(1.0 - noise <= x < 1.0 for x, _ in ratios)
    txt = (f"tuned >= heuristic in {n}/{m} cells (min ratio {worst:.3f}); worst: {kernel} "
           f"{dtype} d={hdim} {'causal' if causal else 'full'} s={seqlen}; {same} cells run "
           "the heuristic's own config")
    if near:
        txt += f"; {near} of the misses within {noise * 100:g}% (timing noise)"
    if m - len(ratios):
        txt += f"; {m - len(ratios)} cells without both numbers (errors)"
    return txt + (" -> PASS" if n == m else " -> FAIL")


def plot_tuned(records, path: Path, metric="tflops", title=None):
    """TFLOPs vs seqlen, one line per impl; one row of panels per (kernel, dtype), one
    column per (hdim, causal)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = sorted({(r["kernel"], r["dtype"]) for r in records},
                  key=lambda x: (_kernel_order(x[0]), x[1]))
    cols = sorted({(r["hdim"], r["causal"]) for r in records})
    if not rows or not cols:
        return
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(4.3 * len(cols), 3.5 * len(rows)),
                             squeeze=False)
    impls = [i for i in TUNED_IMPLS if any(r["impl"] == i for r in records)]
    impls += sorted({r["impl"] for r in records} - set(impls))
    for ax_row, (kernel, dtype) in zip(axes, rows):
        for ax, (hdim, causal) in zip(ax_row, cols):
            sel = [r for r in records if (r["kernel"], r["dtype"], r["hdim"], r["causal"])
                   == (kernel, dtype, hdim, causal)]
            for impl in impls:
                pts = sorted((r["seqlen"], r[metric]) for r in sel if r["impl"] == impl and metric in r)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], label=impl,
                            **STYLES.get(impl, dict(marker="o")))
            same = sorted(r["seqlen"] for r in sel
                          if r["impl"] == "cuflash_tuned" and r.get("same_config"))
            _seqlen_axis(ax, sorted({r["seqlen"] for r in sel}))
            ax.set_title(f"{kernel} {dtype} d={hdim} {'causal' if causal else 'full'}"
                         + (f" ({len(same)}/{len({r['seqlen'] for r in sel})} heuristic)"
                            if same else ""), fontsize=9)
            ax.set_ylabel(f"{kernel} TFLOPs/s")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(title or f"tuned vs heuristic configs vs SDPA on {gpu_label()} "
                          "('(n/m heuristic)': seqlens where the tuned config is the heuristic's)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------
# memory

def _memory_step(impl, q, k, v, dout, causal):
    """(step, leaves): step() runs one forward + backward through autograd, the gradients
    land in the leaves' .grad (set them to None to free them)."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    if impl == "cuflash":
        from .interface import flash_attn_func

        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

        def step():
            flash_attn_func(qg, kg, vg, causal=causal).backward(dout)
        return step, (qg, kg, vg)

    backend = _sdpa_backend(impl)
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    dt = dout.transpose(1, 2)

    def step():
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).backward(dt)
    return step, (qt, kt, vt)


def _is_oom(exc) -> bool:
    import torch

    oom_types = tuple({getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),
                       torch.cuda.OutOfMemoryError})
    return isinstance(exc, oom_types) or "out of memory" in str(exc).lower()


def measure_memory(impl, seqlen, batch=1, nheads=16, hdim=128, dtype="bf16", causal=True):
    """One record: peak memory of a forward + backward (after one warm-up step)."""
    import torch

    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    rec = dict(impl=impl, dtype=dtype, hdim=hdim, causal=causal, batch=batch, nheads=nheads,
               seqlen=seqlen)
    try:
        torch.manual_seed(0)
        q, k, v, dout = (torch.randn(batch, seqlen, nheads, hdim, device="cuda", dtype=tdtype)
                         for _ in range(4))
        rec["inputs_bytes"] = 4 * q.numel() * q.element_size()
        step, leaves = _memory_step(impl, q, k, v, dout, causal)
        step()  # warm-up: kernel compile, persistent workspaces (cuBLAS) are not per-step memory
        for x in leaves:
            x.grad = None  # the measured step allocates dq, dk, dv afresh
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        rec.update(peak_bytes=peak - before, peak_total_bytes=peak, before_bytes=before,
                   fwdbwd_ms=start.elapsed_time(end), oom=False)
    except Exception as exc:  # noqa: BLE001
        if _is_oom(exc):
            rec.update(oom=True, error=_short(exc))
        else:
            rec.update(oom=False, error=_short(exc))
    finally:
        q = k = v = dout = step = leaves = None  # noqa: F841 - drop the references first
        gc.collect()
        torch.cuda.empty_cache()
    return rec


def run_memory(seqlens=MEM_SEQLENS, impls=MEMORY_IMPLS, out_dir="results", batch=1, nheads=16,
               hdim=128, dtype="bf16", causal=True, log=print):
    """Peak memory of fwd+bwd vs seqlen; writes results/<gpu>/memory.{json,png}."""
    import torch

    _gpu.require("the memory benchmark")
    records = []
    for seqlen in seqlens:
        for impl in impls:
            rec = measure_memory(impl, seqlen, batch, nheads, hdim, dtype, causal)
            records.append(rec)
        log(memory_line([r for r in records if r["seqlen"] == seqlen]))
    total = torch.cuda.get_device_properties(0).total_memory
    out = Path(out_dir) / gpu_dir_name()
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.json").write_text(json.dumps(records, indent=1))
    plot_memory(records, out / "memory.png", total_bytes=total)
    log(f"wrote {out / 'memory'}.json, .png")
    log(memory_bar_summary(records))
    return records


def memory_line(recs) -> str:
    if not recs:
        return ""
    parts = []
    for r in recs:
        if r.get("oom"):
            parts.append(f"{r['impl']}=OOM")
        elif "peak_bytes" not in r:
            parts.append(f"{r['impl']}=error")
        else:
            parts.append(f"{r['impl']}={r['peak_bytes'] / 2**20:9.1f}")
    by = {r["impl"]: r.get("peak_bytes") for r in recs}
    ratio = (by["cuflash"] / by["sdpa_flash"]) if by.get("cuflash") and by.get("sdpa_flash") else math.nan
    r0 = recs[0]
    return (f"s={r0['seqlen']:6} b={r0['batch']} h={r0['nheads']} d={r0['hdim']} "
            f"peak MiB above inputs: " + "  ".join(parts) + f"  cuflash/flash={ratio:.2f}")


def memory_bar_summary(records, impl="cuflash", ref="sdpa_flash", bar=BAR_MEM_RATIO) -> str:
    by = {(r["impl"], r["seqlen"]): r.get("peak_bytes") for r in records}
    ratios = [(by[(impl, s)] / by[(ref, s)], s) for (i, s) in by
              if i == impl and by[(i, s)] and by.get((ref, s))]
    if not ratios:
        return f"memory bar: no {impl}/{ref} pairs"
    worst = max(ratios)
    return (f"memory bar ({impl} <= {bar}x {ref}): {'PASS' if worst[0] <= bar else 'FAIL'}; "
            f"worst {worst[0]:.2f}x at s={worst[1]}")


STYLES = {"cuflash": dict(marker="o", lw=2.2), "cuflash[det]": dict(marker="s", ls="-."),
          "sdpa_flash": dict(marker="s", ls="--"), "sdpa_cudnn": dict(marker="^", ls=":"),
          "sdpa_math": dict(marker="D"), "cuflash_tuned": dict(marker="o", lw=2.2),
          "cuflash_heuristic": dict(marker="o", ls="-.", mfc="none", ms=9)}


def _seqlen_axis(ax, seqlens):
    ax.set_xscale("log", base=2)
    if seqlens:
        ax.set_xticks(sorted(seqlens))
        ax.set_xticklabels([_fmt_seqlen(s) for s in sorted(seqlens)])
        ax.minorticks_off()
    ax.set_xlabel("seqlen")


def plot_memory(records, path: Path, total_bytes=None, title=None, ref="sdpa_flash"):
    """Left: peak memory vs seqlen (log-log, OOM marked x at the top); right: ratio to ref."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    gib = 2.0 ** 30
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11.5, 4.4), gridspec_kw=dict(width_ratios=[3, 2]))
    impls = [i for i in PLOT_IMPLS if any(r["impl"] == i for r in records)]
    impls += sorted({r["impl"] for r in records} - set(impls))
    top = max([r["peak_bytes"] for r in records if "peak_bytes" in r] + [total_bytes or 0] + [gib])
    seqlens = sorted({r["seqlen"] for r in records})
    by = {(r["impl"], r["seqlen"]): r.get("peak_bytes") for r in records}
    for impl in impls:
        sel = [r for r in records if r["impl"] == impl]
        pts = sorted((r["seqlen"], r["peak_bytes"] / gib) for r in sel if "peak_bytes" in r)
        line = ax.plot([p[0] for p in pts], [p[1] for p in pts], label=impl, **STYLES.get(impl, {}))
        color = line[0].get_color()
        oom = sorted(r["seqlen"] for r in sel if r.get("oom"))
        if oom:
            ax.scatter(oom, [top / gib * 1.15] * len(oom), marker="x", s=60, color=color,
                       label=f"{impl}: out of memory", zorder=3)
        ratio = [(s, by[(impl, s)] / by[(ref, s)]) for s in seqlens
                 if by.get((impl, s)) and by.get((ref, s))]
        if ratio and impl != ref and impl != "sdpa_math":
            ax2.plot([p[0] for p in ratio], [p[1] for p in ratio], color=color, label=impl,
                     **STYLES.get(impl, {}))
    if total_bytes:
        ax.axhline(total_bytes / gib, color="gray", ls="--", lw=1, label="GPU memory")
    ax2.axhline(1.0, color="gray", lw=1)
    ax2.axhline(BAR_MEM_RATIO, color="tab:red", ls="--", lw=1, label=f"bar {BAR_MEM_RATIO}x")
    for a in (ax, ax2):
        _seqlen_axis(a, seqlens)
        a.grid(alpha=0.3, which="both")
        a.legend(fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("peak GiB above inputs (q, k, v, dout)")
    ax2.set_ylabel(f"peak bytes / {ref}'s")
    r0 = records[0] if records else {}
    fig.suptitle(title or f"forward + backward peak memory on {gpu_label()}: "
                 f"b={r0.get('batch')} h={r0.get('nheads')} d={r0.get('hdim')} {r0.get('dtype')} "
                 f"{'causal' if r0.get('causal') else 'full'}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------
# output

def write(records, out: Path, stem: str, metric, log=print, title=None, plotter=None):
    """stem.json, stem.csv (one column per key of any record) and stem.png, drawn by
    plotter(records, path, metric, title=title) (default: plot)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(records, indent=1))
    keys = sorted({k for r in records for k in r})
    with open(out / f"{stem}.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(records)
    (plotter or plot)(records, out / f"{stem}.png", metric, title=title)
    log(f"wrote {out / stem}.json, .csv, .png")


def plot(records, path: Path, metric, title=None):
    """TFLOPs vs seqlen per impl; one panel per (dtype, hdim, causal), one row per metric."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    metrics = (metric,) if isinstance(metric, str) else tuple(metric)
    panels = sorted({(r["dtype"], r["hdim"], r["causal"]) for r in records})
    if not panels:
        return
    fig, axes = plt.subplots(len(metrics), len(panels), figsize=(4.5 * len(panels), 3.8 * len(metrics)),
                             squeeze=False)
    for row, m in zip(axes, metrics):
        for ax, (dtype, hdim, causal) in zip(row, panels):
            sel = [r for r in records if (r["dtype"], r["hdim"], r["causal"]) == (dtype, hdim, causal)]
            for impl in PLOT_IMPLS:
                pts = sorted((r["seqlen"], r[m]) for r in sel if r["impl"] == impl and m in r)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], label=impl,
                            **STYLES.get(impl, dict(marker="o")))
            _seqlen_axis(ax, sorted({r["seqlen"] for r in sel}))
            ax.set_title(f"{dtype} d={hdim} {'causal' if causal else 'full'}")
            ax.set_ylabel(f"{m.replace('_tflops', '')} TFLOPs/s")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title or f"{', '.join(metrics)} on {gpu_label()}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m cuflash bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", nargs="+", default=["fwd"],
                    choices=["fwd", "fwdbwd", "memory", "tuned", "all"])
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=list(SEQLENS))
    ap.add_argument("--dtypes", nargs="+", default=None, choices=["bf16", "fp16"],
                    help="default bf16 (tuned mode: bf16 fp16)")
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--kernels", nargs="+", default=list(TUNED_KERNELS), choices=list(TUNED_KERNELS),
                    help="tuned: the kernels to compare (default fwd bwd)")
    ap.add_argument("--sweep", action="store_true", help="fwd: also time every valid config")
    ap.add_argument("--deterministic", action="store_true",
                    help="fwdbwd: also time cuflash's deterministic backward (impl cuflash[det])")
    ap.add_argument("--no-autograd", action="store_true",
                    help="fwdbwd: skip timing cuflash's backward through torch autograd")
    ap.add_argument("--impls", nargs="+", default=None,
                    help=f"fwdbwd impls (default {' '.join(FWDBWD_IMPLS)}); memory impls "
                         f"(default {' '.join(MEMORY_IMPLS)})")
    ap.add_argument("--mem-seqlens", type=int, nargs="+", default=list(MEM_SEQLENS))
    ap.add_argument("--reps", type=int, default=None,
                    help="samples per timing (fwd 20, fwdbwd 10, tuned 20: interleaved rounds)")
    ap.add_argument("--out", default="results")
    a = ap.parse_args(argv)
    modes = {"fwd", "fwdbwd", "memory"} if "all" in a.mode else set(a.mode)
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[a.causal]
    dtypes = a.dtypes or ["bf16"]
    out = {}
    for mode in ("fwd", "fwdbwd", "memory", "tuned"):
        if mode not in modes:
            continue
        t0 = time.perf_counter()
        if mode == "fwd":
            out[mode] = run(a.hdims, a.seqlens, dtypes, causals, a.sweep, a.out, a.reps or 20)
        elif mode == "fwdbwd":
            out[mode] = run_fwdbwd(a.hdims, a.seqlens, dtypes, causals, a.impls or FWDBWD_IMPLS,
                                   a.out, a.reps or 10, a.deterministic, not a.no_autograd)
        elif mode == "tuned":
            out[mode] = run_tuned(a.hdims, a.seqlens, a.dtypes or ["bf16", "fp16"], causals,
                                  a.kernels, a.out, a.reps or 20)
        else:
            out[mode] = run_memory(a.mem_seqlens, a.impls or MEMORY_IMPLS, a.out)
        print(f"bench {mode}: {time.perf_counter() - t0:.0f} s")
    return out
