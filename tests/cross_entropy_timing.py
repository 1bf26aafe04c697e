"""Time cuflash's cross-entropy kernels (cuflash.ops.cross_entropy on CUDA tensors) against the
torch composition they replace (``USE_KERNELS = False``) and ``F.cross_entropy``, interleaved in
one process (cuflash.timing.time_interleaved: CUDA events, warm-up, median), bf16 logits:

* forward: per-row losses (``F.cross_entropy(reduction="none")`` on the bf16 logits), no autograd;
* forward + backward of the mean over the kept rows (``F.cross_entropy`` on bf16, and on the
  logits upcast to fp32: flash-attn's fp32 losses), cuflash also with ``inplace_backward``;
  ``--compile`` adds ``torch.compile(F.cross_entropy)``;
* GB/s against the logits' bytes (forward: one read; forward + backward: two reads and a write);
* host µs per eager call on a small shape (the launch path, cuflash.timing.host_us_interleaved).

Writes a JSON summary (--out). Speed is reported, never asserted."""
import argparse
import json
import time

import torch
import torch.nn.functional as F

from cuflash.ops import cross_entropy as ops
from cuflash.timing import host_us_interleaved, time_interleaved

SHAPES = ((8192, 32000), (8192, 50257), (4096, 128256), (2048, 256000))


class composition:
    """Context: cuflash.ops.cross_entropy on the torch composition."""

    def __enter__(self):
        ops.USE_KERNELS = False

    def __exit__(self, *exc):
        ops.USE_KERNELS = True


def kernel_loss(lg, labels, inplace=False):
    loss, _ = ops.cross_entropy_loss(lg, labels, inplace_backward=inplace)
    return loss


def composed_loss(lg, labels):
    with composition():
        return kernel_loss(lg, labels)


def case(rows, vocab, compile_fn=None):
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16).mul_(3).requires_grad_(True)
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    labels[::9] = -100
    kept = (labels != -100).sum()
    nbytes = logits.numel() * logits.element_size()

    def fwd(fn):
        def run():
            with torch.no_grad():
                fn()
        return run

    fwd_fns = {"cuflash": fwd(lambda: kernel_loss(logits, labels)),
               "composition": fwd(lambda: composed_loss(logits, labels)),
               "torch_bf16": fwd(lambda: F.cross_entropy(logits, labels, reduction="none")),
               "torch_fp32": fwd(lambda: F.cross_entropy(logits.float(), labels, reduction="none"))}

    def fb(fn):
        def run():
            fn(logits).backward()
            logits.grad = None
        return run

    # in place: the gradient overwrites the storage of a separate buffer (its values turn into
    # gradients after the first call, which the kernels' time does not depend on), returned by
    # autograd.grad: a leaf's .grad would be a copy here (AccumulateGrad clones a gradient that
    # aliases its variable), while logits from a projection pass it straight to the matmul's backward
    buf = logits.detach().clone()

    def inplace_run():
        x = buf.detach().requires_grad_(True)
        torch.autograd.grad(kernel_loss(x, labels, True).sum() / kept, x)

    fb_fns = {"cuflash": fb(lambda lg: kernel_loss(lg, labels).sum() / kept),
              "cuflash_inplace": inplace_run,
              "composition": fb(lambda lg: composed_loss(lg, labels).sum() / kept),
              "torch_bf16": fb(lambda lg: F.cross_entropy(lg, labels)),
              "torch_fp32": fb(lambda lg: F.cross_entropy(lg.float(), labels))}
    if compile_fn is not None:
        fwd_fns["torch_compiled"] = fwd(lambda: compile_fn(logits, labels))
        fb_fns["torch_compiled"] = fb(lambda lg: compile_fn(lg, labels).sum() / kept)
    t0 = time.time()
    ft = time_interleaved(fwd_fns, reps=15, back_to_back=5)
    bt = time_interleaved(fb_fns, reps=11, back_to_back=3)
    # a copy of the logits (one read, one write: what the backward moves), for scale
    copy_ms = time_interleaved({"copy": lambda: logits.detach() * 1}, reps=11, back_to_back=3)["copy"].median_ms
    out = {"rows": rows, "vocab": vocab, "logits_mib": round(nbytes / 2**20, 1),
           "fwd_ms": {k: round(v.median_ms, 4) for k, v in ft.items()},
           "fwd_spread": {k: round(v.spread, 3) for k, v in ft.items()},
           "fwd_gbs": {k: round(nbytes / v.median_ms / 1e6, 1) for k, v in ft.items()},
           "fwd_bwd_ms": {k: round(v.median_ms, 4) for k, v in bt.items()},
           "fwd_bwd_spread": {k: round(v.spread, 3) for k, v in bt.items()},
           "fwd_bwd_gbs": {k: round(3 * nbytes / v.median_ms / 1e6, 1) for k, v in bt.items()},
           "copy_ms": round(copy_ms, 4), "copy_gbs": round(2 * nbytes / copy_ms / 1e6, 1), "wall_s": round(time.time() - t0, 1)}
    return out


def variant_case(rows, vocab, variants, ctas_per_sm=()):
    """cuflash alone at (threads, unroll) variants (forward and backward alike) and at other
    CTAS_PER_SM (row splits), forward and forward + backward, interleaved."""
    from cuflash import cross_entropy as ce

    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16).mul_(3).requires_grad_(True)
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    nbytes = logits.numel() * logits.element_size()
    default = (ce.FWD, ce.BWD, ce.CTAS_PER_SM)

    def with_setting(fn, fwd_bwd, cps):
        def run():
            ce.FWD = ce.BWD = fwd_bwd
            ce.CTAS_PER_SM = cps
            try:
                fn()
            finally:
                ce.FWD, ce.BWD, ce.CTAS_PER_SM = default
        return run

    def fwd():
        with torch.no_grad():
            kernel_loss(logits, labels)

    def fb():
        kernel_loss(logits, labels).sum().backward()
        logits.grad = None

    settings = {f"{t}x{u}": ((t, u), default[2]) for t, u in variants}
    settings.update({f"cps{c}": (default[0], c) for c in ctas_per_sm})
    ft = time_interleaved({k: with_setting(fwd, *v) for k, v in settings.items()}, reps=15, back_to_back=5)
    bt = time_interleaved({k: with_setting(fb, *v) for k, v in settings.items()}, reps=11, back_to_back=3)
    return {"what": "cuflash variants (threads x unroll, CTAS_PER_SM)", "rows": rows, "vocab": vocab,
            "default": f"{default[0][0]}x{default[0][1]} cps{default[2]}",
            "fwd_ms": {k: round(v.median_ms, 4) for k, v in ft.items()},
            "fwd_gbs": {k: round(nbytes / v.median_ms / 1e6, 1) for k, v in ft.items()},
            "fwd_bwd_ms": {k: round(v.median_ms, 4) for k, v in bt.items()},
            "fwd_bwd_gbs": {k: round(3 * nbytes / v.median_ms / 1e6, 1) for k, v in bt.items()}}


def host_times():
    """Host µs per eager call (GPU work tiny: 8 x 512), forward only and forward + backward."""
    logits = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 512, (8,), device="cuda")
    from contextlib import nullcontext

    def fb(fn):
        def run():
            fn(logits).sum().backward()
        return run

    def nograd(fn):
        def run():
            with torch.no_grad():
                fn()
        return run

    fns = {"fwd_cuflash": (nograd(lambda: kernel_loss(logits, labels)), nullcontext),
           "fwd_composition": (nograd(lambda: kernel_loss(logits, labels)), composition),
           "fwd_torch": (nograd(lambda: F.cross_entropy(logits, labels, reduction="none")), nullcontext),
           "fwd_bwd_cuflash": (fb(lambda lg: kernel_loss(lg, labels)), nullcontext, 200),
           "fwd_bwd_composition": (fb(lambda lg: kernel_loss(lg, labels)), composition, 200),
           "fwd_bwd_torch": (fb(lambda lg: F.cross_entropy(lg, labels, reduction="none")), nullcontext, 200)}
    res = host_us_interleaved(fns, calls=400, rounds=7, sync=torch.cuda.synchronize)
    return {k: {"best_us": round(b, 2), "median_us": round(m, 2)} for k, (b, m) in res.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="cross_entropy_timing.json")
    ap.add_argument("--compile", action="store_true", help="add torch.compile(F.cross_entropy)")
    ap.add_argument("--shapes", default="", help="rows x vocab list, e.g. 8192x32000,2048x256000")
    ap.add_argument("--no-host", action="store_true")
    ap.add_argument("--variants", default="", help="only cuflash at (threads x unroll) variants, e.g. 256x4,512x2")
    ap.add_argument("--cps", default="", help="with --variants: CTAS_PER_SM values too, e.g. 8,16")
    a = ap.parse_args()
    shapes = SHAPES if not a.shapes else tuple(tuple(int(v) for v in s.split("x")) for s in a.shapes.split(","))
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    if a.variants:
        variants = [tuple(int(x) for x in v.split("x")) for v in a.variants.split(",")]
        cps = [int(c) for c in a.cps.split(",") if c]
        for rows, vocab in shapes:
            res["rows"].append(variant_case(rows, vocab, variants, cps))
            print(json.dumps(res["rows"][-1]), flush=True)
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
        return
    compile_fn = None
    if a.compile:
        compile_fn = torch.compile(lambda lg, lb: F.cross_entropy(lg, lb, reduction="none"), dynamic=False)
    if not a.no_host:
        res["host_us"] = host_times()
        print(json.dumps(res["host_us"]), flush=True)
    for rows, vocab in shapes:
        res["rows"].append(case(rows, vocab, compile_fn))
        print(json.dumps(res["rows"][-1]), flush=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
