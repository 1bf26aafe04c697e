"""A/B on the H100: the refactored kernels vs the pre-refactor ones (renames + BwdParams order only), d128 bf16."""
import cupy, json, os, sys
from cuflash import api, compile as c
from cuflash.problem import Problem
from cuflash.select import choose_on_device
from cuflash.timing import time_interleaved
out = []
for op, causal, s in (("fwd", False, 16384), ("bwd", True, 16384), ("fwd", True, 4096), ("bwd", False, 4096)):
    p = Problem.fa_convention(op, "bf16", 128, causal, s)
    _, cfg, src = choose_on_device(p, 0)
    shape = (p.batch, s, p.nheads, 128)
    x = [(cupy.random.standard_normal(shape, dtype=cupy.float32) * 0.5).astype(cupy.float16).view(cupy.uint16) for _ in range(6)]
    lse = cupy.zeros((p.batch, p.nheads, s), cupy.float32)
    st = api.out_strides(shape)
    names = ("q", "k", "v", "o") if op == "fwd" else ("dout", "q", "k", "v", "o", "dq", "dk", "dv")
    strides = {n: st for n in names}
    plans = {}
    for tag, d in (("new", None), ("old", ".dev/kold")):
        c.set_kernel_dir(d)
        plans[tag] = api.make_plan(p, strides, 128 ** -0.5, 0, cfg)
    c.set_kernel_dir(None)
    ws = cupy.empty(max(plans["new"].workspace_bytes, 1), cupy.uint8)
    stream = cupy.cuda.get_current_stream().ptr
    if op == "fwd":
        ptrs = (x[0].data.ptr, x[1].data.ptr, x[2].data.ptr, x[3].data.ptr, lse.data.ptr)
    else:
        ptrs = (x[5].data.ptr, x[0].data.ptr, x[1].data.ptr, x[2].data.ptr, x[3].data.ptr, lse.data.ptr,
                x[4].data.ptr, x[5].data.ptr, x[1].data.ptr)
        ptrs = ptrs[:6] + (x[4].data.ptr, cupy.empty_like(x[1]).data.ptr, cupy.empty_like(x[2]).data.ptr)
    fns = {t: (lambda pl=pl: pl.run(ptrs, ws.data.ptr, stream)) for t, pl in plans.items()}
    t = time_interleaved(fns, reps=15)
    flops = __import__("cuflash.registry", fromlist=["x"]).op_flops(p)
    rec = dict(op=op, causal=causal, seqlen=s, config=cfg.name, source=src[:40],
               **{f"{k}_ms": v.median_ms for k, v in t.items()},
               **{f"{k}_tflops": flops / v.median_ms / 1e9 for k, v in t.items()})
    print(rec, flush=True)
    out.append(rec)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "ab_kernels.json"), "w"), indent=1)
