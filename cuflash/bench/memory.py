"""--mode memory: peak GPU memory of one forward + backward, against SDPA flash and math.

batch 1, 16 heads, d 128, bf16, causal, seqlen 1k .. 64k (--mem-seqlens). Impls: every
family of op ``bwd`` that runs the problem ("cuflash:<family>": flash_attn_func with that
family's config as bwd_config, through torch autograd), sdpa_flash, sdpa_cudnn and sdpa_math
(standard attention: the s x s matrix in memory). One step is
``torch.autograd.grad(f(q, k, v), (q, k, v), dout)`` after one warm-up step;
peak_bytes = torch.cuda.max_memory_allocated() during it minus what was allocated before
(q, k, v, dout), so it counts out, lse, saved tensors, workspaces and dq, dk, dv. An
out-of-memory error gives a record with "oom": true.

Writes results/<gpu>/memory.{json,csv,png}; prints peak MiB with ratios to sdpa_flash and
sdpa_math.
"""
from __future__ import annotations

from .. import _gpu
from ..problem import Problem
from .common import (family_choices, fields, impl_fn, inputs, is_oom, ratio_table, release,
                     results_dir, short, write)

STEM = "memory"
SEQLENS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
SDPA = ("sdpa_flash", "sdpa_cudnn", "sdpa_math")
MIB = 2.0 ** 20


def problem(seqlen: int, batch=1, nheads=16, hdim=128, dtype="bf16", causal=True) -> Problem:
    return Problem("bwd", dtype, batch, seqlen, seqlen, nheads, nheads, hdim, causal)


def measure_peak(impl: str, p: Problem, **cuflash_kw) -> dict:
    """One record: the peak memory of a forward + backward of impl on p."""
    import torch

    rec = dict(impl=impl, **{k: v for k, v in fields(p).items() if k != "op"}, **{
        k: getattr(v, "name", v) for k, v in cuflash_kw.items()}, oom=False)
    try:
        q, k, v, dout = tensors = inputs(p, 4)
        rec["inputs_bytes"] = sum(x.numel() * x.element_size() for x in tensors)
        f = impl_fn(impl, p.causal, **cuflash_kw)
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]

        def step():
            return torch.autograd.grad(f(*leaves), leaves, dout)

        step()  # warm-up: compile, persistent library workspaces are not per-step memory
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        grads = step()
        end.record()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        del grads
        rec.update(peak_bytes=peak - before, peak_mib=(peak - before) / MIB,
                   peak_total_bytes=peak, before_bytes=before, fwdbwd_ms=start.elapsed_time(end))
    except Exception as exc:  # noqa: BLE001
        rec.update(oom=is_oom(exc), error=short(exc))
    finally:
        tensors = step = leaves = f = None  # noqa: F841 - drop the references first
        release()
    return rec


def line(recs: list) -> str:
    parts = [f"{r['impl']}=OOM" if r.get("oom") else f"{r['impl']}=error" if "peak_mib" not in r
             else f"{r['impl']}={r['peak_mib']:9.1f}" for r in recs]
    r0 = recs[0]
    return (f"s={r0['seqlen']:6} b={r0['batch']} h={r0['nheads']} d={r0['hdim']} peak MiB above "
            "inputs: " + "  ".join(parts))


def tables(records: list) -> str:
    cuflash = [i for i in dict.fromkeys(r["impl"] for r in records) if i.startswith("cuflash")]
    return "\n\n".join(ratio_table(records, "peak_mib", impl, ("sdpa_flash", "sdpa_math"), digits=1)
                       for impl in cuflash)


def run(seqlens=SEQLENS, batch=1, nheads=16, hdim=128, dtype="bf16", causal=True,
        sdpa_impls=SDPA, out="results", log=print) -> list:
    import torch

    _gpu.require("bench --mode memory")
    records = []
    for s in seqlens:
        p = problem(s, batch, nheads, hdim, dtype, causal)
        recs = [measure_peak(f"cuflash:{fam.name}", p, bwd_config=cfg)
                for fam, cfg, _ in family_choices(p)]
        recs += [measure_peak(impl, p) for impl in sdpa_impls]
        records += recs
        log(line(recs))
    total = torch.cuda.get_device_properties(0).total_memory
    write(records, results_dir(out), STEM,
          dict(metrics="peak_mib", logy=True, ylabel="peak MiB above inputs",
               title=f"forward + backward peak memory on {_gpu.name()} "
                     f"(b={batch} h={nheads} d={hdim} {dtype} {'causal' if causal else 'full'}; "
                     f"x: out of memory)"),
          log, total_memory_bytes=total)
    log("\n" + tables(records))
    return records
