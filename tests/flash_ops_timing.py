"""Time cuflash's versions of flash-attn's building blocks (forward + backward: the fused norm and
cross-entropy kernels on CUDA tensors) next to the plain torch code they replace, interleaved in
one process (cuflash.timing.time_interleaved):

* prenorm residual add + RMSNorm / LayerNorm (Llama / GPT block shapes, bf16, the residual stream
  in fp32): ``rms_norm_fn`` / ``layer_norm_fn(residual=..., prenorm=True, residual_in_fp32=True)``
  against flash-attn's unfused Block path (``residual = x + residual``, ``F.rms_norm`` /
  ``F.layer_norm`` on it, the residual kept in fp32), optionally the composition under
  ``torch.compile`` (``--compile``);
* cross-entropy over a 32k / 128k vocab in bf16: ``cross_entropy_loss(...)`` (mean over the kept
  rows, fp32 losses) against ``F.cross_entropy`` on the bf16 logits (bf16 log-softmax) and on the
  logits upcast to fp32; with the peak memory of one forward + backward.

Writes a JSON summary (--out). Speed is reported, never asserted."""
import argparse
import json
import time

import torch
import torch.nn.functional as F

from cuflash.ops import layer_norm as ln
from cuflash.ops.cross_entropy import cross_entropy_loss
from cuflash.timing import time_interleaved


def fwd_bwd(fn, inputs):
    def run():
        outs = fn(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.backward([o.float().sum() if o.dim() else o for o in outs])
    return run


def peak_mib(run):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def norm_case(rows, n, rms, compile_too):
    dev = "cuda"
    x = torch.randn(rows, n, device=dev, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(rows, n, device=dev, dtype=torch.float32, requires_grad=True)
    w = torch.randn(n, device=dev, dtype=torch.bfloat16, requires_grad=True)
    b = None if rms else torch.randn(n, device=dev, dtype=torch.bfloat16, requires_grad=True)

    def cuflash_fn(x, r, w):
        return ln.layer_norm_fn(x, w, b, residual=r, eps=1e-5, prenorm=True, residual_in_fp32=True, is_rms_norm=rms)

    def torch_fn(x, r, w):
        res = x + r
        h = F.rms_norm(res.to(w.dtype), (n,), w, 1e-5) if rms else F.layer_norm(res.to(w.dtype), (n,), w, b, 1e-5)
        return h, res.float()

    fns = {"cuflash": fwd_bwd(cuflash_fn, (x, r, w)), "torch_unfused": fwd_bwd(torch_fn, (x, r, w))}
    if compile_too:
        fns["cuflash_compiled"] = fwd_bwd(torch.compile(cuflash_fn), (x, r, w))
    t0 = time.time()
    times = time_interleaved(fns, reps=15, back_to_back=5)
    return {"what": f"{'rms' if rms else 'layer'} norm, prenorm residual add, fwd+bwd, bf16 x, fp32 residual",
            "rows": rows, "n": n, "ms": {k: v.median_ms for k, v in times.items()},
            "spread": {k: round(v.spread, 3) for k, v in times.items()},
            "peak_mib": {k: round(peak_mib(f), 1) for k, f in fns.items()}, "wall_s": round(time.time() - t0, 1)}


def ce_case(rows, vocab):
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    labels[::9] = -100

    def cuflash_fn(lg):
        loss, _ = cross_entropy_loss(lg, labels)
        return loss.sum() / (labels != -100).sum()

    def torch_fn(lg):
        return F.cross_entropy(lg, labels)

    def torch_fp32_fn(lg):       # fp32 losses as cuflash's (and flash-attn's): the logits upcast first
        return F.cross_entropy(lg.float(), labels)

    fns = {"cuflash": fwd_bwd(cuflash_fn, (logits,)), "torch_bf16": fwd_bwd(torch_fn, (logits,)),
           "torch_fp32": fwd_bwd(torch_fp32_fn, (logits,))}
    times = time_interleaved(fns, reps=15, back_to_back=5)
    return {"what": "cross entropy, mean, fwd+bwd, bf16 logits", "rows": rows, "vocab": vocab,
            "ms": {k: v.median_ms for k, v in times.items()}, "spread": {k: round(v.spread, 3) for k, v in times.items()},
            "peak_mib": {k: round(peak_mib(f), 1) for k, f in fns.items()}}


def chunk_sweep(rows, vocab, mibs):
    """cuflash's cross entropy alone at several CHUNK_BYTES (the default's choice)."""
    from cuflash.ops import cross_entropy as ce
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    default = ce.CHUNK_BYTES
    out = {}
    try:
        for mib in mibs:
            ce.CHUNK_BYTES = int(mib * 2**20)
            run = fwd_bwd(lambda lg: cross_entropy_loss(lg, labels)[0].mean(), (logits,))
            t = time_interleaved({"c": run}, reps=10, back_to_back=3)["c"]
            out[str(mib)] = {"ms": t.median_ms, "chunks": len(ce._row_chunks(rows, vocab)), "peak_mib": round(peak_mib(run), 1)}
    finally:
        ce.CHUNK_BYTES = default
    return {"what": "cuflash cross entropy fwd+bwd by CHUNK_BYTES (MiB)", "rows": rows, "vocab": vocab,
            "default_mib": default / 2**20, "by_mib": out}


def profile_ce(rows, vocab):
    """One cuflash cross-entropy forward + backward under torch.profiler: GPU time per kernel."""
    from torch.profiler import ProfilerActivity, profile
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    run = fwd_bwd(lambda lg: cross_entropy_loss(lg, labels)[0].mean(), (logits,))
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70)
    print(table, flush=True)
    return {"what": "profile of one cuflash CE fwd+bwd", "rows": rows, "vocab": vocab, "table": table}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="flash_ops_timing.json")
    ap.add_argument("--compile", action="store_true", help="add the torch.compile'd composition to the norm rows")
    ap.add_argument("--chunk-sweep", action="store_true", help="also time cross entropy at several CHUNK_BYTES")
    ap.add_argument("--profile-ce", action="store_true", help="also profile one cross entropy call by kernel")
    ap.add_argument("--ce-only", action="store_true", help="only the cross-entropy rows")
    a = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for rows, n, rms in () if a.ce_only else ((16384, 4096, True), (16384, 4096, False), (8192, 8192, True)):
        res["rows"].append(norm_case(rows, n, rms, a.compile))
        print(json.dumps(res["rows"][-1]), flush=True)
    for rows, vocab in ((8192, 32000), (4096, 128256)):
        res["rows"].append(ce_case(rows, vocab))
        print(json.dumps(res["rows"][-1]), flush=True)
    if a.profile_ce:
        res["rows"].append(profile_ce(4096, 128256))
    if a.chunk_sweep:
        for rows, vocab in ((8192, 32000), (4096, 128256)):
            res["rows"].append(chunk_sweep(rows, vocab, (32, 256, 4096)))
            print(json.dumps(res["rows"][-1]), flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
