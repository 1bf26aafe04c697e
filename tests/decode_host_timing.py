"""Host time of one eager decode step on the GPU machine (issue 13's host budget: <= 1.3x SDPA's),
and where it goes. Not a test; prints a table and writes JSON (--out).

1. ``bench --mode overhead``'s torch_decode records (cuflash.bench.overhead.host_records: bf16 d 128,
   one query row of 32 heads over 256 cached keys on 8 KV heads, ``flash_attn_with_kvcache(q,
   k_cache, v_cache, cache_seqlens=<int32 tensor>)`` against SDPA cuDNN and flash on the same
   problem, interleaved rounds, best and median round), ``--repeat`` times;
2. in one more interleaved run: that call, the call with ``return_softmax_lse=True`` (an LSE tensor
   made and written), and the pieces of the repeat call on the same CUDA tensors: the plan key,
   its dict lookup, the entry's run with the launch replaced by a no-op, the plan's launch alone,
   one ``new_empty`` of the output, torch's raw-stream query and the CUDA runtime's getDevice; and the
   repeat call and the plan's launch with pdl 1 (``run_cached_pdl1``, ``plan_run_pdl1``: cuLaunchKernelEx by
   ctypes, next to ``run_cached`` and ``plan_run`` as the heuristic chose).

    python tests/decode_host_timing.py --out /tmp/dec9_host.json [--calls 2000] [--repeat 2]
        [--old-decode OLD.py]   # another checkout's cuflash/decode.py (git show REV:cuflash/decode.py),
                                # loaded as cuflash._decode_old: its call timed in the same rounds
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import contextlib  # noqa: E402

import torch  # noqa: E402

from cuflash import decode  # noqa: E402
from cuflash.bench.overhead import DECODE_CTX, host_records  # noqa: E402
from cuflash.timing import host_us_interleaved  # noqa: E402


class _NoLaunch:
    """Stands in for an entry's plan: the entry's own host work without the launch."""

    def run(self, ptrs, ws, stream):
        return None


def load_decode(path: str):
    """A cuflash/decode.py file (another revision's) as the module cuflash._decode_old: its
    relative imports resolve to this checkout's cuflash (plans, launches, kernels)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cuflash._decode_old", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def pieces(old=None) -> dict:
    """{name: (fn, context)} of the decode call's pieces (see the docstring)."""
    from cupy_backends.cuda.api import runtime

    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(1, 1, 32, 128, device=dev, dtype=dt)
    kc, vc = (torch.randn(1, DECODE_CTX, 8, 128, device=dev, dtype=dt) for _ in range(2))
    lens = torch.full((1,), DECODE_CTX, device=dev, dtype=torch.int32)
    args = (q, kc, vc, None, None, None, None, lens, None, None, None, None)
    scalars = (None, False, (-1, -1), 0.0, True, 0)
    decode.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
    key = decode._gpu_key(args, *scalars)
    entry = decode._gpu_plans[key]
    stub = decode._GpuEntry()
    for name in decode._GpuEntry.__slots__:
        setattr(stub, name, getattr(entry, name))
    stub.plan = _NoLaunch()
    out = torch.empty(1, 1, 32, 128, device=dev, dtype=dt)
    ptrs = (q.data_ptr(), kc.data_ptr(), vc.data_ptr(), 0, 0, 0, 0, lens.data_ptr(), 0, 0, 0, 0,
            out.data_ptr(), 0)
    stream = torch._C._cuda_getCurrentRawStream(q.device.index)
    plans, plan = decode._gpu_plans, entry.plan
    null = contextlib.nullcontext
    more = {}
    # the same call with pdl 1 (its own plan cache, made under PDL_DEFAULT 1: cuLaunchKernelEx through ctypes)
    from cuflash.families import decode_splitkv as fam

    plans_pdl, was = {}, fam.PDL_DEFAULT
    fam.PDL_DEFAULT, fam_rules, fam.PDL_RULES = 1, fam.PDL_RULES, ()
    try:
        decode._run_cached(plans_pdl, args, scalars, want_lse=False)
    finally:
        fam.PDL_DEFAULT, fam.PDL_RULES = was, fam_rules
    plan_pdl = next(iter(plans_pdl.values())).plan
    if plan_pdl.config.pdl:
        more["run_cached_pdl1"] = (lambda: decode._run_cached(plans_pdl, args, scalars, want_lse=False), null)
        more["plan_run_pdl1"] = (lambda: plan_pdl.run(ptrs, 0, stream), null)
    if old is not None:  # the other revision's call on the same tensors (its own plan cache)
        old.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
        more["old_call"] = (lambda: old.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens), null)
    return {**more,
        "cuflash_call": (lambda: decode.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens), null),
        "cuflash_call_lse": (lambda: decode.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                                                    return_softmax_lse=True), null),
        "run_cached": (lambda: decode._run_cached(plans, args, scalars, want_lse=False), null),
        "key": (lambda: decode._gpu_key(args, *scalars), null),
        "key_get": (lambda: plans.get(key), null),
        "entry_run_no_launch": (lambda: stub.run(args, False), null),
        "plan_run": (lambda: plan.run(ptrs, 0, stream), null),
        "new_empty_out": (lambda: q.new_empty(1, 1, 32, 128), null),
        "raw_stream": (lambda: torch._C._cuda_getCurrentRawStream(0), null),
        "get_device": (runtime.getDevice, null),
    }


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="JSON file for the records")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--old-decode", help="another revision's cuflash/decode.py, timed beside this one")
    a = ap.parse_args(argv)
    old = load_decode(a.old_decode) if a.old_decode and os.path.getsize(a.old_decode) else None
    records = []
    for r in range(a.repeat):
        recs = host_records("torch_decode", calls=a.calls)
        for rec in recs:
            rec["repeat"] = r
        records += recs
        us = {rec["impl"]: rec.get("us_per_call") for rec in recs}
        med = {rec["impl"]: rec.get("us_median") for rec in recs}
        print(f"bench overhead torch_decode #{r}: " + ", ".join(
            f"{k} {v:.1f} (median {med[k]:.1f})" for k, v in us.items() if v)
              + (f"; cuflash / cudnn {us['cuflash'] / us['sdpa_cudnn']:.2f} (median "
                 f"{med['cuflash'] / med['sdpa_cudnn']:.2f})" if us.get("cuflash") and us.get("sdpa_cudnn") else ""))
    fns = pieces(old)
    from cuflash.bench.overhead import decode_call
    for impl in ("sdpa_cudnn", "sdpa_flash"):
        fn, _, context = decode_call(impl)
        fns[impl] = (fn, context)
    res = host_us_interleaved(fns, max(1, a.calls // 5), 15, torch.cuda.synchronize)
    print("| piece | best us | median us |\n| --- | --- | --- |")
    for name, (best, med) in res.items():
        print(f"| {name} | {best:.2f} | {med:.2f} |")
        records.append(dict(impl=name, path="pieces", us_per_call=best, us_median=med))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(records, f, indent=1)
        print("wrote", a.out)


if __name__ == "__main__":
    main()
