"""--mode overhead: what a call costs the host, and what one eager call delivers.

Host cost per call (cuflash.timing.host_us_interleaved: CPU clock, the implementations
interleaved in 15 rounds of --calls / 5 calls each, default 2000; the best round, and the
median round as us_median) on a tiny problem where the GPU work is negligible: batch 1, seqlen 128, 4
heads, d 64, causal, bf16. Paths:

* torch_fwd:    out = f(q, k, v), inputs without grad;
* torch_fwdbwd: inputs requiring grad, ``out = f(q, k, v); out.sum().backward()``;
* cupy_fwd:     CuPy arrays, fp16 (cuflash only: SDPA has no CuPy path; CuPy has no
                bf16 type of its own).
* cupy_fwdbwd:  the same, ``out, lse, _ = flash_attn_func(q, k, v, causal=True,
                return_attn_probs=True)`` then ``flash_attn_backward(dout, q, k, v, out, lse,
                causal=True)`` (cuflash only).
* torch_decode: one decode step (issue 13's host budget: <= 1.3x SDPA's), bf16 d 128, one
                query row of 32 heads over a cache of DECODE_CTX keys on 8 KV heads:
                ``flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=<int32 tensor>)``
                against SDPA on (1, 32, 1, 128) queries over (1, 32, DECODE_CTX, 128) keys and
                values (SDPA's flash and cuDNN backends take no GQA, so the 8 KV heads are
                repeated once, outside the timed calls).

cuflash is ``flash_attn_func(q, k, v, causal=True)`` on (b, s, h, d) tensors; SDPA is
``scaled_dot_product_attention(q, k, v, is_causal=True)`` on (b, h, s, d) tensors, its
backend pinned once around the measurement (sdpa_kernel), so neither pays a layout change
or the pinning per call.

One eager call (paths eager_fwd, eager_fwdbwd): wall time of one call plus a synchronize,
after warm-up, median of --eager-reps calls, at batch 8, seqlen 2k, 16 heads, d 128,
causal, bf16: the TFLOPs a single call delivers, host time included (tflops), beside the
kernels' own back-to-back figure (kernel_ms, kernel_tflops).

Feature calls (issue 12; records with a ``case``, FEATURE_CASES): flash_attn_func plain and causal,
with a window (feature_window), softcap 30, ALiBi, dropout 0.1, and flash_attn_varlen_func
(varlen_lens), each beside SDPA's nearest calls (FEATURE_SDPA: the same backends pinned, the
window or ALiBi as an attn_mask made once, varlen as jagged nested tensors); forward, and forward
+ ``out.backward(dout)`` (a contiguous gradient, as training passes):

* feature_fwd, feature_fwdbwd: host µs per call on TINY, interleaved as above (feature_host_records);
* feature_eager_fwd, feature_eager_fwdbwd: one eager call + synchronize on EAGER
  (feature_eager_records).

Writes results/<gpu>/overhead.json; records: impl, path, us_per_call (+ problem fields;
eager: wall_ms, tflops, kernel_ms, kernel_tflops); prints µs per call with the ratio to
SDPA flash, and the feature calls' tables.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import time

from .. import _gpu
from ..problem import Problem
from ..registry import op_flops
from .common import REF, fields, median, results_dir, sdpa_backend, short, torch_dtype, write_json

TINY = Problem("fwd", "bf16", 1, 128, 128, 4, 4, 64, True)
EAGER = Problem("fwd", "bf16", 8, 2048, 2048, 16, 16, 128, True)
IMPLS = ("cuflash", "sdpa_flash", "sdpa_cudnn")
HOST_PATHS = ("torch_fwd", "torch_fwdbwd", "cupy_fwd", "cupy_fwdbwd", "torch_decode")
CUPY_PATHS = ("cupy_fwd", "cupy_fwdbwd")
DECODE_CTX = 256   # keys in the decode step's cache: GPU work far below the host cost
DECODE = Problem("fwd", "bf16", 1, 1, DECODE_CTX, 32, 8, 128, False)
EAGER_PATHS = ("eager_fwd", "eager_fwdbwd")


def call(impl: str, path: str, p: Problem):
    """(fn, sync, context) for one impl and path: fn() is one call, sync() drains the GPU,
    context() gives the context manager entered around each measurement (SDPA's backend pin;
    a fresh one each time: sdpa_kernel's can be entered once)."""
    import torch

    from ..api import flash_attn_backward, flash_attn_func

    if path in CUPY_PATHS:
        if impl != "cuflash":
            raise NotImplementedError(f"{impl} has no CuPy path")
        import cupy

        shape = (p.batch, p.seqlen_q, p.nheads, p.head_dim)
        q, k, v, dout = (cupy.random.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
                         for _ in range(4))  # fp16: CuPy has no bf16 of its own; the host cost is the same
        if path == "cupy_fwd":
            fn = lambda: flash_attn_func(q, k, v, causal=p.causal)  # noqa: E731
        else:
            def fn():
                out, lse, _ = flash_attn_func(q, k, v, causal=p.causal, return_attn_probs=True)
                return flash_attn_backward(dout, q, k, v, out, lse, causal=p.causal)
        return fn, cupy.cuda.Device().synchronize, contextlib.nullcontext
    if path == "torch_decode":
        return decode_call(impl)
    if impl == "cuflash":
        shape = (p.batch, p.seqlen_q, p.nheads, p.head_dim)
        f, context = flash_attn_func, contextlib.nullcontext
    else:
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        shape = (p.batch, p.nheads, p.seqlen_q, p.head_dim)
        f, context = F.scaled_dot_product_attention, lambda: sdpa_kernel(sdpa_backend(impl))
    kw = {"causal": p.causal} if impl == "cuflash" else {"is_causal": p.causal}
    fwdbwd = path.endswith("fwdbwd")
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch_dtype(p.dtype), requires_grad=fwdbwd)
               for _ in range(3))
    if fwdbwd:
        def fn():
            out = f(q, k, v, **kw)
            out.sum().backward()
    else:
        def fn():
            return f(q, k, v, **kw)
    return fn, torch.cuda.synchronize, context


def decode_call(impl: str):
    """(fn, sync, context) of one decode step (path torch_decode)."""
    import torch

    dev, dt = "cuda", torch.bfloat16
    if impl == "cuflash":
        from ..decode import flash_attn_with_kvcache

        q = torch.randn(1, 1, 32, 128, device=dev, dtype=dt)
        kc, vc = (torch.randn(1, DECODE_CTX, 8, 128, device=dev, dtype=dt) for _ in range(2))
        lens = torch.full((1,), DECODE_CTX, device=dev, dtype=torch.int32)
        return (lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens),
                torch.cuda.synchronize, contextlib.nullcontext)
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    q = torch.randn(1, 32, 1, 128, device=dev, dtype=dt)
    k, v = (torch.randn(1, 8, DECODE_CTX, 128, device=dev, dtype=dt).repeat_interleave(4, dim=1)
            for _ in range(2))
    return (lambda: F.scaled_dot_product_attention(q, k, v), torch.cuda.synchronize,
            lambda: sdpa_kernel(sdpa_backend(impl)))


# ---------------------------------------------------------------------------------------
# the feature paths (issue 12): one eager call of flash_attn_func / flash_attn_varlen_func with
# a feature against SDPA's nearest call (causal; the window (feature_window): half the sequence, at
# most 1024, since a window reaching past every key, e.g. (1024, 0) at seqlen 128, is the plain
# causal call)

FEATURE_CASES = ("plain", "causal", "window", "softcap", "alibi", "dropout", "varlen")
FEATURE_SOFTCAP = 30.0
FEATURE_DROPOUT = 0.1


def feature_window(p: Problem) -> tuple:
    """The window case's (left, 0): half the sequence, at most 1024 ((64, 0) on TINY, (1024, 0)
    on EAGER)."""
    return (min(1024, p.seqlen_k // 2), 0)


def varlen_lens(p: Problem) -> tuple:
    """The varlen case's sequence lengths: batch 1, three sequences of 15/32, 7/32 and 10/32 of
    the sequence (60, 28, 40 on TINY); else batch sequences of 1.5 and 0.5 times it in turn."""
    s = p.seqlen_q
    if p.batch == 1:
        return (s * 15 // 32, s * 7 // 32, s * 10 // 32)
    return tuple(s + s // 2 if i % 2 == 0 else s - s // 2 for i in range(p.batch))
# SDPA's nearest call per case: sdpa_* pinned backends; "+mask": the window or ALiBi as an
# attn_mask made once (bool band / float bias), "nested": varlen as jagged nested tensors
FEATURE_SDPA = {
    "plain": ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient"),
    "causal": ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient"),
    "window": ("sdpa_efficient+mask", "sdpa_cudnn+mask"),
    "softcap": (),   # SDPA has no softcap: the causal row is its nearest call
    "alibi": ("sdpa_efficient+mask", "sdpa_cudnn+mask"),
    "dropout": ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient"),
    # (cuDNN on nested tensors: 48 ms per forward, 150 ms per forward + backward on TINY's varlen,
    # H100, session 24 (logs/session24_host7/r3): not a baseline)
    "varlen": ("sdpa_flash+nested", "sdpa_efficient+nested"),
}


def _alibi_slopes(nheads: int):
    return [2.0 ** (-8.0 * (i + 1) / nheads) for i in range(nheads)]


def feature_call(impl: str, case: str, fwdbwd: bool, p: Problem = TINY):
    """(fn, sync, context) of one eager call of ``case`` (FEATURE_CASES) by ``impl`` ("cuflash"
    or one of FEATURE_SDPA[case]); fwdbwd: inputs requiring grad and ``out.backward(dout)`` (a
    contiguous gradient, as training passes) after the forward."""
    import torch

    dev, dt = "cuda", torch_dtype(p.dtype)
    b, s, h, d = p.batch, p.seqlen_q, p.nheads, p.head_dim
    causal = case != "plain"
    window = feature_window(p)
    if case == "varlen":
        lens = varlen_lens(p)
        total = sum(lens)
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=dev)
        shape = (total, h, d)
    else:
        shape = (b, s, h, d)
    q, k, v = (torch.randn(shape, device=dev, dtype=dt, requires_grad=fwdbwd) for _ in range(3))
    dout = torch.randn(shape, device=dev, dtype=dt)
    context = contextlib.nullcontext
    if impl == "cuflash":
        from ..api import flash_attn_func, flash_attn_varlen_func

        kw = {"causal": causal}
        if case == "window":
            kw["window_size"] = window
        elif case == "softcap":
            kw["softcap"] = FEATURE_SOFTCAP
        elif case == "alibi":
            kw["alibi_slopes"] = torch.tensor(_alibi_slopes(h), dtype=torch.float32, device=dev)
        elif case == "dropout":
            kw["dropout_p"] = FEATURE_DROPOUT
        if case == "varlen":
            m = max(lens)
            f = lambda: flash_attn_varlen_func(q, k, v, cu, cu, m, m, **kw)  # noqa: E731
        else:
            f = lambda: flash_attn_func(q, k, v, **kw)  # noqa: E731
    else:
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        base, _, how = impl.partition("+")
        context = lambda: sdpa_kernel(sdpa_backend(base))  # noqa: E731
        qt, kt, vt = (x.transpose(-3, -2) for x in (q, k, v))  # (b, h, s, d) views, made once
        kw = {"dropout_p": FEATURE_DROPOUT} if case == "dropout" else {}
        if how == "mask":  # the band or the bias, made once (SDPA's causal is top-left: s_q = s_k)
            i = torch.arange(s, device=dev)[:, None]
            j = torch.arange(s, device=dev)[None, :]
            if case == "window":
                kw["attn_mask"] = (j <= i) & (j >= i - window[0])
            else:
                slopes = torch.tensor(_alibi_slopes(h), dtype=torch.float32, device=dev)
                bias = -slopes[:, None, None] * (i - j).abs().float()
                kw["attn_mask"] = bias.masked_fill(j > i, -math.inf).to(dt)[None].expand(b, h, s, s)
        else:
            kw["is_causal"] = causal
        if how == "nested":
            offsets = cu.long()

            def f():  # the jagged views are part of the call (they carry autograd's history)
                nq, nk, nv = (torch.nested.nested_tensor_from_jagged(x, offsets).transpose(1, 2)
                              for x in (q, k, v))
                return F.scaled_dot_product_attention(nq, nk, nv, **kw).transpose(1, 2).values()
        else:
            f = lambda: F.scaled_dot_product_attention(qt, kt, vt, **kw).transpose(-3, -2)  # noqa: E731
    if fwdbwd:
        def fn():
            f().backward(dout)
    else:
        fn = f
    return fn, torch.cuda.synchronize, context


def feature_host_records(cases=FEATURE_CASES, p: Problem = TINY, calls: int = 500,
                         rounds: int = 9, passes=("fwd", "fwdbwd"), sdpa: bool = True,
                         round_ms: float = 25.0, log=None) -> list:
    """Host µs per call of every case's cuflash call and SDPA's nearest ones, per pass (fwd:
    inputs without grad; fwdbwd: forward + backward), all of a pass interleaved in ``rounds``
    rounds (as cuflash.timing.host_us_interleaved) of calls // 5 calls each, fewer for a call
    slower than round_ms / that (SDPA on nested tensors: milliseconds): us_per_call the best
    round, us_median the median. log: called with a line per pass timed."""
    from ..timing import host_us_interleaved

    recs = []
    for pass_ in passes:
        fns, by_key, sync = {}, {}, None
        for case in cases:
            for impl in ("cuflash",) + (FEATURE_SDPA[case] if sdpa else ()):
                rec = dict(impl=impl, path=f"feature_{pass_}", case=case, **_problem_fields(p),
                           rounds=rounds)
                recs.append(rec)
                try:
                    fn, sync_i, context = feature_call(impl, case, pass_ == "fwdbwd", p)
                    with context():
                        fn()
                        sync_i()
                        t0 = time.perf_counter()
                        for _ in range(3):
                            fn()
                        one_ms = (time.perf_counter() - t0) / 3 * 1e3
                    n = max(3, min(max(1, calls // 5), int(round_ms / max(one_ms, 1e-3))))
                    fns[(impl, case)], sync = (fn, context, n), sync_i
                    by_key[(impl, case)] = rec
                    rec["calls"] = n * rounds
                except Exception as exc:  # noqa: BLE001
                    rec["error"] = short(exc)
        t_pass = time.perf_counter()
        if fns:
            for key, (best, med) in host_us_interleaved(fns, 1, rounds, sync).items():
                by_key[key].update(us_per_call=best, us_median=med)
        if log is not None:
            log(f"  {pass_}: {len(fns)} calls timed in {time.perf_counter() - t_pass:.1f} s")
    return recs


def feature_table(records: list) -> str:
    """Markdown: a row per (pass, case): cuflash's host µs per call (median round), × its
    plain call of the pass (the causal one for the causal cases), and SDPA's nearest calls."""
    host = [r for r in records if "case" in r and not r["path"].startswith("feature_eager")]
    us = {(r["path"], r["case"], r["impl"]): r.get("us_median") for r in host}
    lines = ["| pass | case | cuflash µs | × cuflash causal | SDPA nearest µs |",
             "| --- | --- | --- | --- | --- |"]
    for path in dict.fromkeys(r["path"] for r in host):
        for case in dict.fromkeys(r["case"] for r in host if r["path"] == path):
            mine = us.get((path, case, "cuflash"))
            plain = us.get((path, "plain" if case == "plain" else "causal", "cuflash"))
            sdpa = ", ".join(f"{impl.replace('sdpa_', '')} {us[(path, case, impl)]:.1f}"
                             for impl in FEATURE_SDPA.get(case, ())
                             if us.get((path, case, impl)) is not None) or "-"
            lines.append(f"| {path.replace('feature_', '')} | {case} | "
                         + (f"{mine:.1f}" if mine else "-") + " | "
                         + (f"{mine / plain:.2f}" if mine and plain else "-") + f" | {sdpa} |")
    return "\n".join(lines)


def host_records(path: str, p: Problem = TINY, calls: int = 2000, rounds: int = 15) -> list:
    """The host cost of every impl on one path, the impls interleaved in ``rounds`` rounds of
    ``calls // 5`` calls (cuflash.timing.host_us_interleaved): us_per_call is the best round,
    us_median the median round."""
    from ..timing import host_us_interleaved

    if path in CUPY_PATHS:
        p = p.replace(dtype="fp16")
    if path == "torch_decode":
        p = DECODE
    impls = [i for i in IMPLS if path not in CUPY_PATHS or i == "cuflash"]
    recs, fns, sync = {}, {}, None
    for impl in impls:
        recs[impl] = dict(impl=impl, path=path, **_problem_fields(p), calls=calls,
                          rounds=rounds)
        try:
            fn, sync_i, context = call(impl, path, p)
            fn()
            fns[impl], sync = (fn, context), sync_i
        except Exception as exc:  # noqa: BLE001
            recs[impl]["error"] = short(exc)
    if fns:
        for impl, (best, med) in host_us_interleaved(fns, max(1, calls // 5), rounds, sync).items():
            recs[impl].update(us_per_call=best, us_median=med)
    return [recs[i] for i in impls]


def eager_record(impl: str, path: str, p: Problem = EAGER, reps: int = 20, case=None) -> dict:
    """Wall time of one call + synchronize (median of reps, after warm-up), and the kernels'
    back-to-back time for contrast. case: one of FEATURE_CASES (feature_call's call; path
    'feature_eager_fwd' or 'feature_eager_fwdbwd'; TFLOPs for the plain and causal cases only)."""
    from ..timing import time_ms

    fwdbwd = path.endswith("fwdbwd")
    if case is not None:
        p = p.replace(causal=case != "plain")
    flops = op_flops(p) + (op_flops(p.replace(op="bwd")) if fwdbwd else 0.0)
    if case not in (None, "plain", "causal"):
        flops = None   # (a window, varlen: other work than the dense call's)
    rec = dict(impl=impl, path=path, **_problem_fields(p), **({} if case is None else {"case": case}))
    try:
        fn, sync, context = (call(impl, path.replace("eager", "torch"), p) if case is None
                             else feature_call(impl, case, fwdbwd, p))
        with context():
            for _ in range(3):
                fn()
            walls = []
            for _ in range(reps):
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                walls.append(time.perf_counter() - t0)
            kernel_ms = time_ms(fn, reps=reps).median_ms
        wall_ms = median(walls) * 1e3
        rec.update(us_per_call=wall_ms * 1e3, wall_ms=wall_ms, kernel_ms=kernel_ms)
        if flops:
            rec.update(tflops=flops / wall_ms / 1e9, kernel_tflops=flops / kernel_ms / 1e9)
    except Exception as exc:  # noqa: BLE001
        rec["error"] = short(exc)
    return rec


def _problem_fields(p: Problem) -> dict:
    return {k: v for k, v in fields(p).items() if k != "op"}


def table(records: list, ref: str = REF) -> str:
    """Markdown: a row per path, µs per call of each impl, cuflash / ref."""
    impls = list(dict.fromkeys(r["impl"] for r in records))
    paths = list(dict.fromkeys(r["path"] for r in records))
    us = {(r["impl"], r["path"]): r.get("us_per_call") for r in records}
    lines = ["| path | " + " | ".join(f"{i} µs" for i in impls) + f" | cuflash / {ref} |",
             "| --- | " + " | ".join("---" for _ in impls) + " | --- |"]
    for path in paths:
        cells = [f"{us[(i, path)]:.1f}" if us.get((i, path)) is not None else "-" for i in impls]
        a, b = us.get(("cuflash", path)), us.get((ref, path))
        lines.append(f"| {path} | " + " | ".join(cells) + f" | {a / b:.2f} |" if a and b
                     else f"| {path} | " + " | ".join(cells) + " | - |")
    return "\n".join(lines)


def feature_eager_records(cases=FEATURE_CASES, p: Problem = EAGER, reps: int = 20,
                          sdpa: bool = True) -> list:
    """eager_record of every case's cuflash call and SDPA's nearest ones, forward and forward +
    backward (paths feature_eager_fwd, feature_eager_fwdbwd)."""
    return [eager_record(impl, f"feature_eager_{pass_}", p, reps, case)
            for pass_ in ("fwd", "fwdbwd") for case in cases
            for impl in ("cuflash",) + (FEATURE_SDPA[case] if sdpa else ())]


def feature_eager_table(records: list) -> str:
    """Markdown: a row per (pass, case): cuflash's single eager call (ms, host time included),
    × its plain call of the pass (the causal one for the causal cases), SDPA's nearest calls."""
    ms = {(r["path"], r["case"], r["impl"]): r.get("wall_ms") for r in records
          if r.get("path", "").startswith("feature_eager")}
    lines = ["| pass | case | cuflash ms | × cuflash causal | SDPA nearest ms |",
             "| --- | --- | --- | --- | --- |"]
    for path, case, impl in ms:
        if impl != "cuflash":
            continue
        mine, plain = ms[(path, case, impl)], ms.get((path, "plain" if case == "plain" else "causal",
                                                      "cuflash"))
        sdpa = ", ".join(f"{i.replace('sdpa_', '')} {ms[(path, case, i)]:.3f}"
                         for i in FEATURE_SDPA[case] if ms.get((path, case, i))) or "-"
        lines.append(f"| {path.replace('feature_eager_', '')} | {case} | "
                     + (f"{mine:.3f}" if mine else "-") + " | "
                     + (f"{mine / plain:.2f}" if mine and plain else "-") + f" | {sdpa} |")
    return "\n".join(lines)


def run(calls: int = 2000, eager_reps: int = 20, out="results", log=print) -> list:
    _gpu.require("bench --mode overhead")
    records = []
    for path in HOST_PATHS:
        records += host_records(path, TINY, calls)
    for path in EAGER_PATHS:
        for impl in IMPLS:
            records.append(eager_record(impl, path, EAGER, eager_reps))
    records += feature_host_records(FEATURE_CASES, TINY, max(5, calls // 4))
    records += feature_eager_records(FEATURE_CASES, EAGER, eager_reps)
    for r in records:
        if "error" in r:
            log(f"  {r['impl']} {r.get('case', '')} {r['path']}: {r['error']}")
    path = results_dir(out) / "overhead.json"
    write_json(path, records, tiny=_problem_fields(TINY), eager=_problem_fields(EAGER))
    log(f"host µs per call (tiny: b={TINY.batch} s={TINY.seqlen_q} h={TINY.nheads} d={TINY.head_dim} "
        f"causal bf16; eager_*: wall µs of one call + synchronize at b={EAGER.batch} "
        f"s={EAGER.seqlen_q} h={EAGER.nheads} d={EAGER.head_dim})")
    log(table([r for r in records if "case" not in r]))
    log("feature calls (issue 12), host µs per call, median round (tiny, causal; the window: "
        f"{feature_window(TINY)}; varlen: sequences {varlen_lens(TINY)}):")
    log(feature_table(records))
    log(f"feature calls, one eager call + synchronize (b={EAGER.batch} s={EAGER.seqlen_q} "
        f"h={EAGER.nheads} d={EAGER.head_dim}; window {feature_window(EAGER)}; varlen: sequences "
        f"{varlen_lens(EAGER)}):")
    log(feature_eager_table(records))
    for r in records:
        if r["path"] in EAGER_PATHS and "tflops" in r:
            log(f"  {r['path']} {r['impl']}: {r['tflops']:.0f} TFLOPs/s per single eager call "
                f"({r['wall_ms']:.3f} ms), kernels back-to-back {r['kernel_tflops']:.0f}")
    log(f"wrote {path}")
    return records
