"""Time the fused LayerNorm / RMSNorm kernels (cuflash.ops.layer_norm.layer_norm_fn on CUDA
tensors) against the torch composition that runs without them (``USE_KERNELS = False``), torch's
own ``F.rms_norm`` / ``F.layer_norm`` and, with ``--compile``, ``torch.compile`` of the
composition, interleaved in one process (cuflash.timing.time_interleaved: CUDA events, warm-up,
median). Speed is reported, never asserted.

Cases (x, weight and the residual in --dtype; ``res32``: an fp32 residual stream):

* ``rms``: rms_norm_fn(x, w);  ``ln``: layer_norm_fn(x, w, b);
* ``rms_res``: rms_norm_fn(x, w, residual=r, prenorm=True) (a transformer block's norm);
* ``rms_res32``: the same with an fp32 residual r (flash-attn's residual_in_fp32 stream).

Forward (no autograd) and forward + backward (dx, dweight [, dbias, dresidual]; the gradient of y
only). The fused backward (``FUSED_DW``, the default) and the two-pass one are timed. GB/s count the bytes
that must move: forward x [+ r] read, y [+ residual_out] written; backward dy and h (x [+ r], or
an fp32 residual_out) read, dx [+ dresidual] written. ``copy`` is x.clone() (2 bytes read and
written per element of a 16-bit x): the ceiling.

``--host``: host microseconds per eager forward call (a small shape) of the fused route,
F.rms_norm and the composition.

Writes a JSON summary (--out); ``--summarize FILE`` prints one as a markdown table."""
import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from cuflash import layer_norm as ln_kernels
from cuflash.ops import layer_norm as ops
from cuflash.timing import host_us_interleaved, time_interleaved

SHAPES = ((16384, 2048), (16384, 4096), (16384, 8192), (4096, 12288))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
EPS = 1e-6


class _Flag:
    """A context that sets a module attribute for the duration of a call."""

    def __init__(self, mod, name, value):
        self.mod, self.name, self.value = mod, name, value

    def __enter__(self):
        self.old = getattr(self.mod, self.name)
        setattr(self.mod, self.name, self.value)

    def __exit__(self, *exc):
        setattr(self.mod, self.name, self.old)


def with_flag(fn, mod, name, value):
    def run():
        with _Flag(mod, name, value):
            return fn()
    return run


def case_fns(case, x, w, b, r, n, compile_fns):
    """{peer: forward callable returning y} for one case."""
    if case == "rms":
        def fused():
            return ops.rms_norm_fn(x, w, None, eps=EPS)
        torch_fn = lambda: F.rms_norm(x, (n,), w, EPS)  # noqa: E731
    elif case == "ln":
        def fused():
            return ops.layer_norm_fn(x, w, b, eps=EPS)
        torch_fn = lambda: F.layer_norm(x, (n,), w, b, EPS)  # noqa: E731
    else:
        def fused():
            return ops.rms_norm_fn(x, w, None, residual=r, prenorm=True, eps=EPS)[0]
        torch_fn = None
    fns = {"cuflash": fused, "composition": with_flag(fused, ops, "USE_KERNELS", False)}
    if torch_fn is not None:
        fns["torch"] = torch_fn
    if compile_fns:
        def plain(x, w, b, r):   # traced with USE_KERNELS False (set around each call): the composition
            if case == "rms":
                return ops.rms_norm_fn(x, w, None, eps=EPS)
            if case == "ln":
                return ops.layer_norm_fn(x, w, b, eps=EPS)
            return ops.rms_norm_fn(x, w, None, residual=r, prenorm=True, eps=EPS)[0]
        compiled = torch.compile(plain)
        fns["compiled"] = with_flag(lambda: compiled(x, w, b, r), ops, "USE_KERNELS", False)
    return fns


def nbytes(case, rows, n, dt):
    e = torch.finfo(dt).bits // 8
    el = rows * n
    if case in ("rms", "ln"):
        return 2 * e * el, 3 * e * el   # fwd: x, y; bwd: x, dy, dx
    r = 4 if case == "rms_res32" else e
    fwd = (2 * e + 2 * r) * el          # x, r read; y, residual_out written
    h = 4 if r == 4 else 2 * e          # the backward's h: fp32 residual_out, else x + r
    bwd = (2 * e + h + r) * el          # dy, h read; dx, dresidual written
    return fwd, bwd


def run_case(case, rows, n, dt, compile_fns, reps):
    torch.manual_seed(0)
    dev = "cuda"
    x = torch.randn(rows, n, device=dev, dtype=dt, requires_grad=True)
    w = (1 + 0.1 * torch.randn(n, device=dev)).to(dt).requires_grad_(True)
    b = (0.1 * torch.randn(n, device=dev)).to(dt).requires_grad_(True)
    r = torch.randn(rows, n, device=dev, dtype=torch.float32 if case == "rms_res32" else dt, requires_grad=True)
    dy = torch.randn(rows, n, device=dev, dtype=dt)
    fns = case_fns(case, x, w, b, r, n, compile_fns)

    def fwd(fn):
        def run():
            with torch.no_grad():
                fn()
        return run

    def fb(fn):
        def run():
            fn().backward(dy)
            x.grad = w.grad = b.grad = r.grad = None
        return run

    fb_fns = {k: fb(f) for k, f in fns.items()}
    fb_fns["cuflash_two_pass"] = with_flag(fb(fns["cuflash"]), ln_kernels, "FUSED_DW", False)
    t0 = time.time()
    ft = time_interleaved({k: fwd(f) for k, f in fns.items()}, reps=reps, back_to_back=3)
    bt = time_interleaved(fb_fns, reps=reps, back_to_back=2)
    # the fused backwards and the two-pass one agree (their dweight sums in another order)
    gr = []
    for fused in (True, False):
        with _Flag(ln_kernels, "FUSED_DW", fused):
            x.grad = w.grad = None
            fns["cuflash"]().backward(dy)
            gr.append((x.grad.clone(), w.grad.clone()))
    x.grad = w.grad = b.grad = r.grad = None
    agree = {"dx_max_diff": (gr[0][0].float() - gr[1][0].float()).abs().max().item(),
             "dw_max_rel_diff": ((gr[0][1].float() - gr[1][1].float()).abs().max()
                                 / gr[1][1].float().abs().max()).item()}
    fwd_b, bwd_b = nbytes(case, rows, n, dt)
    return {"case": case, "rows": rows, "n": n, "dtype": str(dt).split(".")[-1],
            "fwd_bytes": fwd_b, "fwd_bwd_bytes": fwd_b + bwd_b,
            "fwd_ms": {k: round(v.median_ms, 4) for k, v in ft.items()},
            "fwd_gbs": {k: round(fwd_b / v.median_ms / 1e6, 1) for k, v in ft.items()},
            "fwd_spread": {k: round(v.spread, 3) for k, v in ft.items()},
            "fwd_bwd_ms": {k: round(v.median_ms, 4) for k, v in bt.items()},
            "fwd_bwd_gbs": {k: round((fwd_b + bwd_b) / v.median_ms / 1e6, 1) for k, v in bt.items()},
            "fwd_bwd_spread": {k: round(v.spread, 3) for k, v in bt.items()},
            "fused_vs_two_pass": agree, "wall_s": round(time.time() - t0, 1)}


def copy_gbs(rows, n, dt):
    x = torch.randn(rows, n, device="cuda", dtype=dt)
    t = time_interleaved({"copy": lambda: x.clone()}, reps=9, back_to_back=3)["copy"].median_ms
    return {"rows": rows, "n": n, "dtype": str(dt).split(".")[-1], "copy_ms": round(t, 4),
            "copy_gbs": round(2 * x.numel() * x.element_size() / t / 1e6, 1)}


def host_times(dt):
    rows, n = 8, 2048
    x = torch.randn(rows, n, device="cuda", dtype=dt)
    w = torch.ones(n, device="cuda", dtype=dt)
    r = torch.randn(rows, n, device="cuda", dtype=dt)
    nullc = lambda: _Flag(ops, "USE_KERNELS", True)  # noqa: E731
    comp = lambda: _Flag(ops, "USE_KERNELS", False)  # noqa: E731
    with torch.no_grad():
        fns = {"cuflash_rms": (lambda: ops.rms_norm_fn(x, w, None, eps=EPS), nullc),
               "torch_rms": (lambda: F.rms_norm(x, (n,), w, EPS), nullc),
               "composition_rms": (lambda: ops.rms_norm_fn(x, w, None, eps=EPS), comp),
               "cuflash_rms_res": (lambda: ops.rms_norm_fn(x, w, None, residual=r, prenorm=True, eps=EPS), nullc),
               "composition_rms_res": (lambda: ops.rms_norm_fn(x, w, None, residual=r, prenorm=True, eps=EPS),
                                       comp)}
        res = host_us_interleaved(fns, calls=300, rounds=7, sync=torch.cuda.synchronize)
    return {k: {"best_us": round(v[0], 2), "median_us": round(v[1], 2)} for k, v in res.items()}


def summarize(path) -> str:
    """A markdown table of a timing JSON (no GPU needed)."""
    d = json.load(open(path))
    copy = {(c["dtype"], c["rows"], c["n"]): c["copy_gbs"] for c in d.get("copy", [])}
    peers = ("cuflash", "torch", "compiled", "composition", "cuflash_two_pass")
    peers += tuple(sorted({k for c in d["cases"] for k in c["fwd_bwd_ms"]} - set(peers)))   # older runs' peers
    out = [f"{d['device']}, torch {d['torch']}; ms (GB/s of the bytes that must move); copy = x.clone() GB/s", "",
           "| dtype | rows x n | case | copy | " + " | ".join(f"fwd {p}" for p in peers[:4]) + " | "
           + " | ".join(f"fwd+bwd {p}" for p in peers) + " |",
           "|" + "---|" * (4 + 4 + len(peers))]
    for c in d["cases"]:
        def cell(kind, p):
            ms = c[f"{kind}_ms"].get(p)
            return "" if ms is None else f"{ms:.3f} ({c[f'{kind}_gbs'][p]:.0f})"
        ceiling = copy.get((c["dtype"], c["rows"], c["n"]), "")
        out.append(f"| {c['dtype']} | {c['rows']}x{c['n']} | {c['case']} | {ceiling} | "
                   + " | ".join(cell("fwd", p) for p in peers[:4]) + " | "
                   + " | ".join(cell("fwd_bwd", p) for p in peers) + " |")
    if "host_us" in d:
        out += ["", "host us per eager forward call (best / median of rounds): "
                + ", ".join(f"{k} {v['best_us']} / {v['median_us']}" for k, v in d["host_us"].items())]
    return "\n".join(out)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--summarize":
        print(summarize(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="layer_norm_timing.json")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--shapes", default=",".join(f"{r}x{n}" for r, n in SHAPES))
    ap.add_argument("--cases", default="rms,ln,rms_res,rms_res32")
    ap.add_argument("--extra", default="fp32:16384x4096",
                    help="more (dtype:shape) jobs after --dtypes x --shapes, comma-separated ('': none)")
    ap.add_argument("--compile", action="store_true", help="time torch.compile of the composition too")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--host", action="store_true")
    a = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",") if s]
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy": [], "cases": []}
    if a.host:
        res["host_us"] = host_times(torch.bfloat16)
        print(json.dumps(res["host_us"]), flush=True)
    jobs = [(dt, s) for dt in a.dtypes.split(",") for s in shapes]
    for item in filter(None, a.extra.split(",")):
        dname, shape = item.split(":")
        jobs.append((dname, tuple(int(v) for v in shape.split("x"))))
    for dname, (rows, n) in jobs:
        dt = DTYPES[dname]
        res["copy"].append(copy_gbs(rows, n, dt))
        print(json.dumps(res["copy"][-1]), flush=True)
        for case in a.cases.split(","):
            res["cases"].append(run_case(case, rows, n, dt, a.compile, a.reps))
            print(json.dumps(res["cases"][-1]), flush=True)
            torch.cuda.empty_cache()
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
