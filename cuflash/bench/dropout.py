"""--mode dropout: attention dropout's cost (issue 12 item 6), at seqlen 8k by default.

For each problem of the convention (batch · seqlen = 16k, heads = 2048 / head dim): cuflash
with dropout_p = 0.1 against the same call without dropout, and SDPA's flash backend with and
without dropout_p = 0.1 (SDPA draws its mask inside the kernel too); the forward alone and
forward + backward (``torch.autograd.grad``), samples interleaved.

Writes results/<gpu>/bench_dropout.{json,csv}; records: impl ("cuflash", "cuflash[drop0.1]",
"sdpa_flash", "sdpa_flash[drop0.1]"), dtype, hdim, causal, batch, seqlen, nheads, dropout_p,
fwd_ms, fwd_tflops, fwdbwd_ms, fwdbwd_tflops (FLOPs as the other modes: dropout's own work
uncounted), slowdown (ms with dropout / ms without, same impl), error where an impl refused.
"""
from __future__ import annotations

from .. import _gpu
from ..registry import op_flops
from .common import inputs, measure, problems, release, results_dir, write

STEM = "bench_dropout"
DROPOUT_P = 0.1
IMPLS = ("cuflash", "sdpa_flash")


def impl_name(impl: str, p: float) -> str:
    return f"{impl}[drop{p:g}]" if p else impl


def forward_fn(impl: str, causal: bool, p: float):
    """f(q, k, v) -> out, (b, s, h, d) layout, dropout_p = p."""
    if impl == "cuflash":
        from ..api import flash_attn_func

        return lambda q, k, v: flash_attn_func(q, k, v, p, causal=causal)
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from .common import sdpa_backend

    def f(q, k, v):
        with sdpa_kernel(sdpa_backend(impl)):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  dropout_p=p, is_causal=causal).transpose(1, 2)
    return f


def records_for(problem, fwd_t: dict, both_t: dict, p: float) -> list:
    out = []
    for impl in IMPLS:
        for drop in (0.0, p):
            name = impl_name(impl, drop)
            rec = dict(impl=name, dtype=problem.dtype, hdim=problem.head_dim, causal=problem.causal,
                       batch=problem.batch, seqlen=problem.seqlen_q, nheads=problem.nheads,
                       dropout_p=drop)
            f, b = fwd_t.get(name), both_t.get(name)
            errors = [x for x in (f, b) if isinstance(x, str)]
            if errors:
                rec["error"] = "; ".join(dict.fromkeys(errors))
            if f is not None and not isinstance(f, str):
                rec.update(fwd_ms=f.median_ms, fwd_tflops=op_flops(problem) / f.median_ms / 1e9)
            if b is not None and not isinstance(b, str):
                flops = op_flops(problem) + op_flops(problem.replace(op="bwd"))
                rec.update(fwdbwd_ms=b.median_ms, fwdbwd_tflops=flops / b.median_ms / 1e9)
            out.append(rec)
    base = {r["impl"]: r for r in out}
    for r in out:
        plain = base.get(r["impl"].split("[")[0], {})
        if r["dropout_p"] and r.get("fwdbwd_ms") and plain.get("fwdbwd_ms"):
            r["slowdown"] = round(r["fwdbwd_ms"] / plain["fwdbwd_ms"], 3)
    return out


def run(hdims=(64, 128), seqlens=(8192,), dtypes=("bf16",), causals=(False, True), out="results",
        reps: int = 10, flush_l2: bool = False, p: float = DROPOUT_P, log=print) -> list:
    import torch

    _gpu.require("bench --mode dropout")
    recs = []
    for problem in problems("fwd", dtypes, hdims, causals, seqlens):
        q, k, v, dout = inputs(problem, 4)
        fwd_fns, both_fns = {}, {}
        for impl in IMPLS:
            for drop in (0.0, p):
                f = forward_fn(impl, problem.causal, drop)
                fwd_fns[impl_name(impl, drop)] = (lambda f=f: f(q, k, v))
                qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
                both_fns[impl_name(impl, drop)] = (
                    lambda f=f, qg=qg, kg=kg, vg=vg: torch.autograd.grad(f(qg, kg, vg), (qg, kg, vg), dout))
        with torch.no_grad():
            fwd_t = measure(fwd_fns, reps=reps, flush_l2=flush_l2, log=log)
        both_t = measure(both_fns, reps=reps, flush_l2=flush_l2, log=log)
        new = records_for(problem, fwd_t, both_t, p)
        for r in new:
            log(f"  d{r['hdim']} {'causal' if r['causal'] else 'full'} s{r['seqlen']} {r['impl']}: "
                f"fwd {r.get('fwd_ms', float('nan')):.3f} ms, fwd+bwd {r.get('fwdbwd_ms', float('nan')):.3f} ms"
                f"{', x%.2f' % r['slowdown'] if 'slowdown' in r else ''}{' ' + r['error'] if 'error' in r else ''}")
        recs += new
        release()
    write(recs, results_dir(out), STEM, log=log)
    return recs
