"""What every benchmark mode shares: where results go, the problems, the callables under
comparison, timing, tables, records on disk and plots.

Shapes follow the FlashAttention convention (``Problem.fa_convention``: heads = 2048 / head
dim, batch · seqlen = 16k tokens); FLOPs are ``cuflash.registry.op_flops`` (4·b·h·s_q·s_k·d,
÷2 causal, ×2.5 for the backward). All timing is ``cuflash.timing``: CUDA events, samples
of back-to-back calls (``flush_l2=True`` for single calls after an L2 flush), and every
comparison interleaves the implementations' samples in one process on the same inputs.

Implementation names in records: ``cuflash:<family>`` (that family forced, with the config
selection gives it: tuned table for this GPU, else its heuristic), ``cuflash`` (the
default dispatch), ``sdpa_flash`` / ``sdpa_cudnn`` / ``sdpa_math`` (torch SDPA pinned to one
backend through ``torch.nn.attention.sdpa_kernel``, on (b, h, s, d) transposes of the same
tensors; SDPA's causal mask is top-left aligned, the same as cuflash's bottom-right one when
s_q = s_k, as everywhere here).
"""
from __future__ import annotations

import csv
import gc
import json
import math
import platform
from pathlib import Path
from typing import Callable, Iterable, Optional

from .. import _gpu
from ..problem import SEQLEN_BUCKETS, Problem
from ..registry import families, op_flops

SEQLENS = SEQLEN_BUCKETS                 # 512 .. 16k
HDIMS = (64, 128, 256)
SDPA_IMPLS = ("sdpa_flash", "sdpa_cudnn")
REF = "sdpa_flash"                       # what ratios are taken against


# ---------------------------------------------------------------------------------------
# the GPU and the results directory

def gpu_dir_name(device: int = 0) -> str:
    """The results subdirectory of this GPU: its name with '_' for spaces."""
    return _gpu.name(device).replace(" ", "_")


def gpu_label(device: int = 0) -> str:
    """The GPU's name for titles; never raises (plots are drawn without a GPU too)."""
    try:
        return _gpu.name(device) if _gpu.available() else "no GPU"
    except Exception:  # noqa: BLE001
        return "unknown GPU"


def results_dir(out="results", device: int = 0) -> Path:
    """results/<gpu name with _>/, created."""
    path = Path(out) / gpu_dir_name(device)
    path.mkdir(parents=True, exist_ok=True)
    return path


def env_record(device: int = 0) -> dict:
    """Device, compute capability, driver and library versions; a field that cannot be
    read holds why."""
    import cuflash

    env = {"cuflash": cuflash.__version__, "python": platform.python_version()}

    def field(name, get):
        try:
            env[name] = get()
        except Exception as exc:  # noqa: BLE001 - an environment record never fails
            env[name] = f"unavailable ({exc.__class__.__name__})"

    def torch_versions():
        import torch

        return {"version": torch.__version__, "cuda": torch.version.cuda,
                "cudnn": torch.backends.cudnn.version()}

    def cupy_version():
        import cupy

        return cupy.__version__

    def driver():
        import cupy

        v = cupy.cuda.runtime.driverGetVersion()
        return f"{v // 1000}.{v % 1000 // 10}"

    def runtime():
        import cupy

        v = cupy.cuda.runtime.runtimeGetVersion()
        return f"{v // 1000}.{v % 1000 // 10}"

    field("device", lambda: _gpu.name(device))
    field("cc", lambda: "{}.{}".format(*_gpu.arch(device)))
    field("driver", driver)
    field("cuda_runtime", runtime)
    field("torch", torch_versions)
    field("cupy", cupy_version)
    return env


# ---------------------------------------------------------------------------------------
# problems and records

def problems(op: str, dtypes=("bf16",), hdims=HDIMS, causals=(False, True),
             seqlens=SEQLENS) -> list:
    """The convention's problems, in (dtype, hdim, causal, seqlen) order."""
    return [Problem.fa_convention(op, dtype, d, causal, s)
            for dtype in dtypes for d in hdims for causal in causals for s in seqlens]


def fields(problem: Problem) -> dict:
    """A problem as record fields."""
    p = problem
    return dict(op=p.op, dtype=p.dtype, hdim=p.head_dim, causal=p.causal, batch=p.batch,
                seqlen=p.seqlen_q, nheads=p.nheads)


def tflops(problem: Problem, ms: Optional[float]) -> Optional[float]:
    return None if not ms else op_flops(problem) / ms / 1e9


def fmt_seqlen(s: int) -> str:
    return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


def short(exc: BaseException, n: int = 200) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{exc.__class__.__name__}: {text}"[:n]


def is_oom(exc: BaseException) -> bool:
    return "OutOfMemoryError" in type(exc).__name__ or "out of memory" in str(exc).lower()


# ---------------------------------------------------------------------------------------
# inputs and the callables under comparison

def torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


DEVICE = "cuda"   # where inputs() puts tensors (the CPU tests set "cpu")


def inputs(problem: Problem, n: int = 3, device=None, seed: int = 0):
    """n random tensors in cuflash's layout: q (and dout, the 4th) (b, s_q, h, d), k and v
    (b, s_k, h_kv, d); on DEVICE unless device is given."""
    import torch

    p = problem
    device = device or DEVICE
    torch.manual_seed(seed)
    shapes = [(p.batch, p.seqlen_q, p.nheads, p.head_dim),
              (p.batch, p.seqlen_k, p.nheads_kv, p.head_dim),
              (p.batch, p.seqlen_k, p.nheads_kv, p.head_dim),
              (p.batch, p.seqlen_q, p.nheads, p.head_dim)][:n]
    return [torch.randn(s, device=device, dtype=torch_dtype(p.dtype)) for s in shapes]


def sdpa_backend(impl: str):
    from torch.nn.attention import SDPBackend

    return {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa_math": SDPBackend.MATH}[impl]


def sdpa(impl: str, causal: bool) -> Callable:
    """f(q, k, v) -> out in cuflash's (b, s, h, d) layout, by SDPA pinned to impl's backend
    (sdpa_kernel entered on every call) on (b, h, s, d) views."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    backend = sdpa_backend(impl)

    def f(q, k, v):
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                 v.transpose(1, 2), is_causal=causal)
        return out.transpose(1, 2)
    return f


def cuflash(causal: bool, config=None, bwd_config=None, deterministic=False) -> Callable:
    """f(q, k, v) -> out through cuflash.flash_attn_func (torch autograd when inputs require
    grad)."""
    from ..api import flash_attn_func

    return lambda q, k, v: flash_attn_func(q, k, v, causal=causal, deterministic=deterministic,
                                           config=config, bwd_config=bwd_config)


def impl_fn(impl: str, causal: bool, **cuflash_kw) -> Callable:
    """f(q, k, v) -> out of a named impl ("cuflash", "sdpa_*")."""
    return cuflash(causal, **cuflash_kw) if impl.startswith("cuflash") else sdpa(impl, causal)


def grad_fn(f: Callable, q, k, v, dout) -> Callable:
    """A callable running the backward alone, (dq, dk, dv) of one forward's graph:
    torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)."""
    import torch

    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = f(*leaves)
    return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)


def family_choices(problem: Problem, device: int = 0) -> list:
    """(family, config, source) for every registered family of the problem's op that runs it
    on this GPU: the config selection gives that family (tuned for this GPU, else heuristic)."""
    from ..select import choose

    arch, name, smem = _gpu.arch(device), _gpu.name(device), _gpu.max_smem(device)
    out = []
    for fam in families(problem.op):
        if not fam.supports(arch, problem):
            out.append(choose(problem, arch, name, smem, family=fam))
    return out


def heuristic_config(family, problem: Problem, device: int = 0):
    """The family's heuristic config for problem on this GPU (what a tuned entry overrides)."""
    arch, smem = _gpu.arch(device), _gpu.max_smem(device)
    return family.for_problem(family.heuristic(problem, arch, smem), problem)


# ---------------------------------------------------------------------------------------
# timing

def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(fns: dict, reps: int = 20, flush_l2: bool = False, log=print) -> dict:
    """{name: Timing or error string}: each callable runs once first (compile; one that
    raises gets its error and is not timed), then the rest are timed by
    cuflash.timing.time_interleaved (samples A B C A B C ..., back-to-back unless flush_l2)."""
    from ..timing import time_interleaved

    out, live = {}, {}
    for name, fn in fns.items():
        try:
            fn()
            synchronize()
            live[name] = fn
        except Exception as exc:  # noqa: BLE001 - a backend may refuse a shape
            out[name] = short(exc)
            log(f"  {name}: {out[name]}")
    if live:
        try:
            out.update(time_interleaved(live, reps=reps, flush_l2=flush_l2))
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory with all of them live
            out.update({name: short(exc) for name in live})
            log(f"  {', '.join(live)}: {short(exc)}")
    return {name: out[name] for name in fns}


def release() -> None:
    """Drop freed tensors between problems."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def op_callable(impl: str, problem: Problem, tensors, config=None) -> Callable:
    """A callable running problem's op once on tensors (q, k, v[, dout]) by impl: the forward
    (no autograd), or the backward alone on one forward's results (cuflash:
    flash_attn_backward with out and lse; SDPA: torch.autograd.grad, graph retained)."""
    q, k, v = tensors[:3]
    causal = problem.causal
    if impl.startswith("cuflash"):
        from ..api import flash_attn_backward, flash_attn_func

        if problem.op == "fwd":
            return lambda: flash_attn_func(q, k, v, causal=causal, config=config)
        dout = tensors[3]
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        return lambda: flash_attn_backward(dout, q, k, v, out, lse, causal=causal,
                                           deterministic=problem.deterministic, config=config)
    f = sdpa(impl, causal)
    if problem.op == "fwd":
        return lambda: f(q, k, v)
    return grad_fn(f, q, k, v, tensors[3])


def timed_record(problem: Problem, impl: str, timing, **kw) -> dict:
    """A record: impl, the problem's fields, kw, then ms, tflops, spread (a Timing) or error
    (a string)."""
    rec = dict(impl=impl, **fields(problem), **kw)
    if isinstance(timing, str):
        rec["error"] = timing
    else:
        rec.update(ms=timing.median_ms, tflops=tflops(problem, timing.median_ms),
                   spread=round(timing.spread, 4))
    return rec


def compare_op(problem: Problem, tensors, reps: int = 20, flush_l2: bool = False, log=print,
               sdpa_impls=SDPA_IMPLS, suffix: str = "", callables: Optional[dict] = None,
               extra: Optional[dict] = None) -> list:
    """Records of problem's op by every registered family that runs it here
    (impl "cuflash:<family><suffix>", with family, config and source) and by the SDPA
    impls, timed interleaved on the same tensors. ``callables`` (a dict) receives the
    timed callables by impl. ``extra``: {impl: (callable, record fields)} timed with them
    (bench --mode fwd --fp8: the e4m3 families on the same problem)."""
    fns, meta, errors = {}, {}, {}
    for fam, cfg, source in family_choices(problem):
        name = f"cuflash:{fam.name}{suffix}"
        meta[name] = dict(family=fam.name, config=cfg.name, source=source)
        try:
            fns[name] = op_callable("cuflash", problem, tensors, cfg)
        except Exception as exc:  # noqa: BLE001
            errors[name] = short(exc)
    for impl in sdpa_impls:
        meta[impl] = {}
        try:
            fns[impl] = op_callable(impl, problem, tensors)
        except Exception as exc:  # noqa: BLE001 - a backend may refuse a shape
            errors[impl] = short(exc)
    for name, (fn, kw) in (extra or {}).items():
        fns[name], meta[name] = fn, kw
    timings = {**measure(fns, reps, flush_l2, log), **errors}
    if callables is not None:
        callables.update(fns)
    return [timed_record(problem, name, timings[name], **kw) for name, kw in meta.items()]


# ---------------------------------------------------------------------------------------
# tables

ROW_KEYS = ("dtype", "hdim", "causal")


def _order(values: tuple) -> tuple:
    """Sort key of a tuple of record values: numbers (and bools) by value, then the rest by text."""
    return tuple((0, x, "") if isinstance(x, (int, float)) else (1, 0, str(x)) for x in values)


def _cell(x) -> str:
    return "yes" if x is True else "no" if x is False else str(x)


def ratio_table(records: list, metric: str, impl: str, refs=REF, rows=ROW_KEYS,
                col: str = "seqlen", digits: int = 0, ratio_digits: int = 2) -> str:
    """Markdown: one row per distinct `rows` values, one column per `col` value; cells
    'value (ratio× / ratio×)' of impl against each of refs (a name or names; same row and
    column), '-' where a number is missing."""
    refs = (refs,) if isinstance(refs, str) else tuple(refs)
    val = {(tuple(r.get(k) for k in rows), r.get(col), r["impl"]): r.get(metric) for r in records}
    cols = sorted({r.get(col) for r in records if r.get(col) is not None})
    keys = sorted({tuple(r.get(k) for k in rows) for r in records if r["impl"] == impl},
                  key=_order)
    head = [fmt_seqlen(c) if col == "seqlen" else str(c) for c in cols]
    lines = [f"{metric} of {impl} (ratio to {' / '.join(refs)})", "",
             "| " + " | ".join(rows) + " | " + " | ".join(head) + " |",
             "| " + " | ".join("---" for _ in list(rows) + cols) + " |"]
    for key in keys:
        cells = []
        for c in cols:
            a = val.get((key, c, impl))
            if a is None:
                cells.append("-")
                continue
            ratios = []
            for ref in refs:
                b = val.get((key, c, ref))
                ratios.append(f"{a / b:.{ratio_digits}f}×" if b else "-")
            cells.append(f"{a:.{digits}f} ({' / '.join(ratios)})")
        lines.append("| " + " | ".join(_cell(x) for x in key) + " | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def impls_of(records: list, prefix: str = "") -> list:
    """The impl names in records (first-seen order), those starting with prefix."""
    return [i for i in dict.fromkeys(r["impl"] for r in records) if i.startswith(prefix)]


def ratio_tables(records: list, metric: str, refs=SDPA_IMPLS, rows=ROW_KEYS, digits=0) -> str:
    """ratio_table of every cuflash impl against the refs present in records."""
    have = impls_of(records)
    refs = [ref for ref in refs if ref in have]
    return "\n\n".join(ratio_table(records, metric, impl, refs, rows, digits=digits)
                       for impl in impls_of(records, "cuflash"))


def line(problem: Problem, recs: list, metric: str, ref: str = REF) -> str:
    """One log line per problem: metric of each impl, and each non-SDPA impl's ratio to ref."""
    by = {r["impl"]: r.get(metric) for r in recs}
    parts = [f"{i}={v:6.1f}" if v is not None else f"{i}=error" for i, v in by.items()]
    ratios = [f"{i}/{ref}={by[i] / by[ref]:.2f}" for i in by
              if not i.startswith("sdpa") and by[i] and by.get(ref)]
    p = problem
    return (f"{p.op} {p.dtype} d={p.head_dim} causal={p.causal!s:5} s={p.seqlen_q:5} b={p.batch:2} "
            f"{metric}: " + "  ".join(parts + ratios))


# ---------------------------------------------------------------------------------------
# output

def write_json(path: Path, records: list, **extra) -> None:
    """{"env": env_record(), **extra, "records": records}."""
    path.write_text(json.dumps({"env": env_record(), **extra, "records": records}, indent=1,
                               default=str))


def read_records(path) -> list:
    data = json.loads(Path(path).read_text())
    return data["records"] if isinstance(data, dict) else data


def write(records: list, out_dir, stem: str, plot_kw: Optional[dict] = None, log=print,
          **extra) -> Path:
    """out_dir/stem.json (env, extra, records), stem.csv (a column per key of any record) and
    stem.png (``plot(records, path, **plot_kw)``; no plot_kw: no png)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"{stem}.json", records, **extra)
    keys = list(dict.fromkeys(k for r in records for k in r))
    with open(out / f"{stem}.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(records)
    made = ".json, .csv"
    if plot_kw is not None and plot(records, out / f"{stem}.png", **plot_kw):
        made += ", .png"
    log(f"wrote {out / stem}{made}")
    return out


STYLES = {"sdpa_flash": dict(marker="s", ls="--"), "sdpa_cudnn": dict(marker="^", ls=":"),
          "sdpa_math": dict(marker="D", ls="-."), "cuflash": dict(marker="o", lw=2.2)}


def _style(impl: str) -> dict:
    if impl in STYLES:
        return STYLES[impl]
    if impl.startswith("heuristic"):
        return dict(marker="o", ls="-.", mfc="none", ms=9)
    return dict(marker="o", lw=2.2) if "cuflash" in impl or impl.startswith("tuned") else dict(marker="x")


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(records: list, path, metrics, panels=ROW_KEYS, ref: Optional[str] = REF,
         logy: bool = False, ylabel: Optional[str] = None, title: Optional[str] = None) -> bool:
    """metric vs seqlen, a line per impl; a column of panels per distinct `panels` values,
    a row per metric, and (ref given) a last row of each impl's ratio to ref. Records with
    "oom" true are marked x at the top of their panel. False when matplotlib is missing or
    there is nothing to draw."""
    plt = _pyplot()
    metrics = (metrics,) if isinstance(metrics, str) else tuple(metrics)
    keys = sorted({tuple(r.get(k) for k in panels) for r in records}, key=_order)
    if plt is None or not keys:
        return False
    impls = impls_of(records)
    colors = {impl: f"C{i % 10}" for i, impl in enumerate(impls)}
    rows = [(m, False) for m in metrics] + ([(metrics[0], True)] if ref else [])
    fig, axes = plt.subplots(len(rows), len(keys), figsize=(4.4 * len(keys), 3.6 * len(rows)),
                             squeeze=False)
    for c, key in enumerate(keys):
        sel = [r for r in records if tuple(r.get(k) for k in panels) == key]
        seqlens = sorted({r["seqlen"] for r in sel})
        for (metric, as_ratio), ax in zip(rows, axes[:, c]):
            base = {r["seqlen"]: r.get(metric) for r in sel if r["impl"] == ref}
            for impl in impls:
                if as_ratio and impl == ref:
                    continue
                mine = [r for r in sel if r["impl"] == impl]
                pts = [(r["seqlen"], r[metric]) for r in mine if r.get(metric) is not None]
                if as_ratio:
                    pts = [(s, v / base[s]) for s, v in pts if base.get(s)]
                pts.sort()
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], label=impl,
                            color=colors[impl], **_style(impl))
                oom = sorted(r["seqlen"] for r in mine if r.get("oom"))
                if oom and not as_ratio:
                    ax.scatter(oom, [1.0] * len(oom), marker="x", s=60, color=colors[impl],
                               transform=ax.get_xaxis_transform(), clip_on=False, zorder=3,
                               label=f"{impl}: out of memory")
            if as_ratio:
                ax.axhline(1.0, color="gray", lw=1)
            ax.set_xscale("log", base=2)
            if seqlens:
                ax.set_xticks(seqlens)
                ax.set_xticklabels([fmt_seqlen(s) for s in seqlens])
                ax.minorticks_off()
            if logy:
                ax.set_yscale("log")
            ax.set_xlabel("seqlen")
            ax.set_ylabel(f"{metric} / {ref}'s" if as_ratio else (ylabel or metric))
            ax.set_title(" ".join(f"{k}={_cell(v)}" for k, v in zip(panels, key)), fontsize=9)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    fig.suptitle(title or f"{', '.join(metrics)} on {gpu_label()}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def median(xs: Iterable) -> Optional[float]:
    xs = sorted(x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x)))
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2
