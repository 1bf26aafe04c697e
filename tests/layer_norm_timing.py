"""Time the fused LayerNorm / RMSNorm kernels (cuflash.ops.layer_norm.layer_norm_fn on CUDA
tensors) against the torch composition they replace (``USE_KERNELS = False``) and torch's own
``F.rms_norm`` / ``F.layer_norm``, interleaved in one process (cuflash.timing.time_interleaved:
CUDA events, warm-up, median), bf16 x and weight:

* forward (no autograd) and forward + backward (dx and dweight [and dbias]);
* RMSNorm, LayerNorm (with bias), and RMSNorm with a bf16 residual, prenorm, residual_in_fp32
  (flash-attn's Block: no torch peer, the composition only);
* GB/s against the minimal traffic: forward reads x and writes y (2 · rows · n · 2 bytes);
  forward + backward also reads x and dy and writes dx (5 · rows · n · 2 bytes).

Writes a JSON summary (--out). Speed is reported, never asserted."""
import argparse
import json
import time

import torch
import torch.nn.functional as F

from cuflash.ops import layer_norm as ops
from cuflash.timing import time_interleaved

SHAPES = ((16384, 4096), (8192, 8192))


def composed(fn):
    def run(*a, **k):
        ops.USE_KERNELS = False
        try:
            return fn(*a, **k)
        finally:
            ops.USE_KERNELS = True
    return run


def case(rows, n):
    dt = torch.bfloat16
    x = torch.randn(rows, n, device="cuda", dtype=dt, requires_grad=True)
    r = torch.randn(rows, n, device="cuda", dtype=dt, requires_grad=True)
    w = torch.randn(n, device="cuda", dtype=dt, requires_grad=True)
    b = torch.randn(n, device="cuda", dtype=dt, requires_grad=True)
    dy = torch.randn(rows, n, device="cuda", dtype=dt)
    nbytes = rows * n * 2

    def rms():
        return ops.layer_norm_fn(x, w, None, is_rms_norm=True)

    def ln():
        return ops.layer_norm_fn(x, w, b)

    def rms_res():
        return ops.layer_norm_fn(x, w, None, residual=r, prenorm=True, residual_in_fp32=True, is_rms_norm=True)[0]

    fns = {"rms_cuflash": rms, "rms_composition": composed(rms),
           "rms_torch": lambda: F.rms_norm(x, (n,), w, 1e-6),
           "ln_cuflash": ln, "ln_composition": composed(ln),
           "ln_torch": lambda: F.layer_norm(x, (n,), w, b, 1e-6),
           "rms_res_prenorm_cuflash": rms_res, "rms_res_prenorm_composition": composed(rms_res)}

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

    t0 = time.time()
    ft = time_interleaved({k: fwd(f) for k, f in fns.items()}, reps=15, back_to_back=5)
    bt = time_interleaved({k: fb(f) for k, f in fns.items()}, reps=11, back_to_back=3)
    copy_ms = time_interleaved({"copy": lambda: x.detach() * 1}, reps=11, back_to_back=3)["copy"].median_ms
    return {"rows": rows, "n": n, "x_mib": round(nbytes / 2**20, 1),
            "fwd_ms": {k: round(v.median_ms, 4) for k, v in ft.items()},
            "fwd_spread": {k: round(v.spread, 3) for k, v in ft.items()},
            "fwd_gbs": {k: round(2 * nbytes / v.median_ms / 1e6, 1) for k, v in ft.items()},
            "fwd_bwd_ms": {k: round(v.median_ms, 4) for k, v in bt.items()},
            "fwd_bwd_spread": {k: round(v.spread, 3) for k, v in bt.items()},
            "fwd_bwd_gbs": {k: round(5 * nbytes / v.median_ms / 1e6, 1) for k, v in bt.items()},
            "copy_ms": round(copy_ms, 4), "copy_gbs": round(2 * nbytes / copy_ms / 1e6, 1),
            "wall_s": round(time.time() - t0, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="layer_norm_timing.json")
    a = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for rows, n in SHAPES:
        res["rows"].append(case(rows, n))
        print(json.dumps(res["rows"][-1]), flush=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
