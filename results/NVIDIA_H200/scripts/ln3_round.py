"""Session 29 (ln3): the GPU round's kernel steps for issue 12's layer_norm.cu change.

``precompile``: fills CuPy's kernel cache in parallel processes with the modules the round loads:
tests/layer_norm_precompile.py's (the GPU tests, the sanitizer workload), the cross-entropy modules
(bf16, fp16, fp32: the host timing, tests/test_cross_entropy_gpu.py), rotary's bf16 ones, the A/B
widths' modules of main's layer_norm.cu (``ln3_layer_norm_main.cu.txt``, run from a copy of kernels_cu/
with it as layer_norm.cu).

``ab``: kernel time of main's layer_norm.cu against this branch's, in one process, CUDA events,
interleaved (cuflash.timing.time_interleaved), RMSNorm bf16, x and weight bf16, no residual: the
forward, the fused backward (the default) and the two-pass backward (FUSED_DW = False: its dx
kernel is the one whose SASS moved), launched by their plans directly (no host path); and
F.rms_norm forward / forward + backward (autograd) as the peer. Round 2 (07be461) ran an experiment
here: the fused backward at 2 chunks a thread, twice the threads (128 registers a thread at 4 chunks,
16 warps an SM); it became the branch's default (cuflash.layer_norm.BWD_CHUNKS) for round 3, whose
fused backward rows compare main's 4-chunk kernel with it (outputs: their largest difference).

    python results/NVIDIA_H200/scripts/ln3_round.py precompile|ab [--out ab.json]
"""
import argparse
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

SHAPES = ((16384, 1024), (16384, 2048), (16384, 4096), (16384, 8192), (4096, 12288))


def main_kernel_dir() -> Path:
    """A copy of kernels_cu/ with main's layer_norm.cu (the same path in every process of a run)."""
    from cuflash.compile import kernel_dir

    d = Path(tempfile.gettempdir()) / "ln3_main_kernels"
    if not (d / "layer_norm.cu").exists():
        shutil.copytree(kernel_dir(), d, dirs_exist_ok=True)
        shutil.copy(HERE / "ln3_layer_norm_main.cu.txt", d / "layer_norm.cu")
    return d


def ab_names():
    import torch

    from cuflash.layer_norm import kernel_names, threads_for

    bf = torch.bfloat16
    return [kernel_names(bf, bf, bf, threads_for(n), True) for _, n in SHAPES]   # main's: 4 chunks everywhere


def _compile(job):
    kdir, names = job
    from cuflash import compile as cm

    cm.set_kernel_dir(kdir)
    t0 = time.perf_counter()
    try:
        cm.get_helper_kernels(names[0], names[1], 0)
        return names[1][0], time.perf_counter() - t0, ""
    except Exception as exc:  # noqa: BLE001 - reported
        return names[1][0], time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"


def precompile():
    import torch

    import layer_norm_precompile
    from cuflash import cross_entropy, rotary

    jobs = [(None, ("layer_norm", tuple(m))) for m in layer_norm_precompile.modules()]
    jobs += [(None, (m.source, m.names)) for m in cross_entropy.warm_modules([torch.bfloat16, torch.float16,
                                                                              torch.float32])
             + rotary.warm_modules([torch.bfloat16])]
    main_dir = str(main_kernel_dir())
    jobs += [(main_dir, ("layer_norm", tuple(m))) for m in ab_names()]
    t0, failed = time.perf_counter(), 0
    with multiprocessing.get_context("spawn").Pool(min(16, os.cpu_count() or 4)) as pool:
        for name, seconds, error in pool.imap_unordered(_compile, jobs):
            print(f"{name}: {seconds:.1f} s {error}", flush=True)
            failed += bool(error)
    print(f"{len(jobs)} modules in {time.perf_counter() - t0:.1f} s, {failed} failed")
    sys.exit(1 if failed else 0)


def ab(out_path, reps):
    import torch
    import torch.nn.functional as F

    from cuflash import compile as cm
    from cuflash import layer_norm as ln
    from cuflash.timing import time_interleaved

    dev = torch.device("cuda", 0)
    bf = torch.bfloat16
    stream = lambda: ln._raw_stream(0)  # noqa: E731
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": "bf16", "case": "rms",
               "rows": []}
    for rows, n in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(rows + n)
        x = torch.randn(rows, n, device="cuda", generator=g).to(bf)
        w = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(bf)
        dy = torch.randn(rows, n, device="cuda", generator=g).to(bf)
        y, dx, dw = torch.empty_like(x), torch.empty_like(x), torch.empty_like(w)
        stats = torch.empty(2 * rows, device="cuda")
        mp, rp = stats.data_ptr(), stats.data_ptr() + 4 * rows
        fns, outs = {}, {}
        for tag, kdir in (("main", str(main_kernel_dir())), ("branch", None)):
            cm.set_kernel_dir(kdir)
            bwd_chunks = ln.BWD_CHUNKS
            if tag == "main":   # main's fused backward: CHUNKS chunks a thread, as every kernel there
                ln.BWD_CHUNKS = ln.CHUNKS
            try:
                fwd = ln._Plan(rows, n, bf, bf, bf, dev, True, True, 1e-6, False, False)
                fused = ln._Plan(rows, n, bf, bf, bf, dev, True, True, 0.0, False, False, True)
                two = ln._Plan(rows, n, bf, bf, bf, dev, True, True, 0.0, False, False, False)
            finally:
                ln.BWD_CHUNKS = bwd_chunks
            fptrs = (x.data_ptr(), 0, w.data_ptr(), 0, y.data_ptr(), 0, mp, rp, 0, 0, 0, 0, 0, 0, 0)
            parts = {k: torch.empty(p.splits * 2 * n, device="cuda") for k, p in (("fused", fused), ("two", two))}

            def bptrs(kind):
                return (x.data_ptr(), 0, w.data_ptr(), 0, 0, 0, mp, rp, dy.data_ptr(), 0, dx.data_ptr(), 0,
                        parts[kind].data_ptr(), dw.data_ptr(), 0)

            fin = lambda p: (p.finish, -(-n // ln._FINISH_COLS), 1, ln._FINISH_THREADS, 0)  # noqa: E731
            fsteps = ((fwd.fwd, rows, 1, fwd.threads, 0),)
            bsteps = ((fused.bwd, fused.splits, 1, fused.threads, fused.smem), fin(fused))
            tsteps = ((two.bwd_dx, rows, 1, two.threads, 0), (two.bwd_dw, two.dw_grid, two.splits, ln._DW_THREADS, 0),
                      fin(two))
            fb, tb = bptrs("fused"), bptrs("two")
            fns[f"fwd {tag}"] = lambda fwd=fwd, fp=fptrs, fs=fsteps: fwd.run(fp, fs, stream())
            fns[f"bwd_fused {tag}"] = lambda p=fused, b=fb, s=bsteps: p.run(b, s, stream())
            fns[f"bwd_two_pass {tag}"] = lambda p=two, b=tb, s=tsteps: p.run(b, s, stream())
            # the outputs of each, for a bitwise comparison of main's and the branch's kernels
            fns[f"fwd {tag}"]()
            fns[f"bwd_fused {tag}"]()
            torch.cuda.synchronize()
            o = [y.clone(), stats.clone(), dx.clone(), dw.clone()]
            fns[f"bwd_two_pass {tag}"]()
            torch.cuda.synchronize()
            outs[tag] = o + [dx.clone(), dw.clone()]
        cm.set_kernel_dir(None)
        same = [torch.equal(a, b) for a, b in zip(outs["main"], outs["branch"])]
        # the branch's fused backward sums in another order (BWD_CHUNKS): its largest difference from main's
        diff = {k: (outs["main"][i].float() - outs["branch"][i].float()).abs().max().item()
                for k, i in (("dx_fused", 2), ("dw_fused", 3))}
        xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        fns["fwd torch"] = lambda: F.rms_norm(x, (n,), w, 1e-6)
        fns["fwdbwd torch"] = lambda: torch.autograd.grad(F.rms_norm(xg, (n,), wg, 1e-6), (xg, wg), dy)
        t = time_interleaved(fns, reps=reps, back_to_back=3)
        ms = {k: round(v.median_ms, 4) for k, v in t.items()}
        for tag in ("main", "branch"):
            ms[f"fwdbwd {tag}"] = round(ms[f"fwd {tag}"] + ms[f"bwd_fused {tag}"], 4)
        row = {"rows": rows, "n": n, "ms": ms, "bitwise_same_main_branch": dict(zip(
            ("y", "stats", "dx_fused", "dw_fused", "dx_two_pass", "dw_two_pass"), same)),
            "max_abs_diff_main_branch": diff, "branch_fused_threads": fused.threads,
            "branch_fused_splits": fused.splits}
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
        del fns, outs
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("precompile", "ab"))
    ap.add_argument("--out", default="ln3_ab.json")
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    if a.what == "precompile":
        precompile()
    else:
        ab(a.out, a.reps)


if __name__ == "__main__":
    main()
