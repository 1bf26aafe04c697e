"""Forward benchmark, FlashAttention convention, side by side with torch SDPA.

dim 2048, heads = 2048 / headdim, batch * seqlen = 16384; FLOPs = 4 * b * h * s_q * s_k * d,
halved under a causal mask. Each implementation is timed in this process on the same
inputs with CUDA events: warm-up, then the median of `reps` launches.

    python -m cuflash bench [--hdims 64 128] [--seqlens 512 ... 16384] [--dtypes bf16]
                            [--sweep] [--out results]

Writes results/<gpu>/bench_fwd.{json,csv,png}; --sweep also times every valid config of
the tuning space (records with impl "cuflash[<config name>]") to guide the heuristic.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
from pathlib import Path

from . import _gpu
from .config import valid_fwd_configs

TOTAL_TOKENS = 16384
MODEL_DIM = 2048


def flops(batch, nheads, seqlen_q, seqlen_k, head_dim, causal, mode="fwd"):
    f = 4 * batch * nheads * seqlen_q * seqlen_k * head_dim
    if causal:
        f //= 2
    return f * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]


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


def run(hdims=(64, 128), seqlens=(512, 1024, 2048, 4096, 8192, 16384), dtypes=("bf16",),
        causals=(False, True), sweep=False, out_dir="results", reps=20, log=print):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

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
                                         config_for(hdim, dtype, causal).name)}
                    if sweep:
                        for cfg in valid_fwd_configs(hdim, dtype, causal, _gpu.max_smem()):
                            impls[f"cuflash[{cfg.name}]"] = (
                                lambda cfg=cfg: flash_attn_func(q, k, v, causal=causal, config=cfg),
                                cfg.name)
                    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                                          ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                        def sdpa(backend=backend):
                            with sdpa_kernel(backend):
                                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                        impls[name] = (sdpa, "")
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


def write(records, out: Path, stem: str, metric: str, log=print):
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(records, indent=1))
    keys = sorted({k for r in records for k in r})
    with open(out / f"{stem}.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(records)
    plot(records, out / f"{stem}.png", metric)
    log(f"wrote {out / stem}.json, .csv, .png")


def plot(records, path: Path, metric: str):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = sorted({(r["dtype"], r["hdim"], r["causal"]) for r in records})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, (dtype, hdim, causal) in zip(axes[0], panels):
        sel = [r for r in records if (r["dtype"], r["hdim"], r["causal"]) == (dtype, hdim, causal)]
        for impl in ("cuflash", "sdpa_flash", "sdpa_cudnn"):
            pts = sorted((r["seqlen"], r[metric]) for r in sel if r["impl"] == impl)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{dtype} d={hdim} {'causal' if causal else 'full'}")
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOPs/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{metric} on {_gpu.name()}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m cuflash bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--dtypes", nargs="+", default=["bf16"], choices=["bf16", "fp16"])
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--sweep", action="store_true", help="also time every valid config")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="results")
    a = ap.parse_args(argv)
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[a.causal]
    run(a.hdims, a.seqlens, a.dtypes, causals, a.sweep, a.out, a.reps)
