"""--mode startup: what the first call costs, in fresh processes.

Each measurement is a fresh child (``sys.executable -c ...``) that imports torch, runs
``torch.cuda.init()``, makes the call's inputs (batch 2, seqlen 2k, 16 heads, d 128, bf16)
and synchronizes, then times

* cuflash: (a) ``import cuflash`` (import_s) and (b) the first call + synchronize
  (first_call_s);
* SDPA's nearest call (``CALLS``: the same feature where SDPA has one), pinned to one backend,
  + synchronize (first_call_s).

The calls (``call`` in each record; ``CALLS`` names SDPA's peers):

* causal: ``flash_attn_func(q, k, v, causal=True)``; SDPA flash and cuDNN, ``is_causal``;
* window: causal with ``window_size=(1024, 0)``; SDPA efficient and cuDNN with the band as a
  float mask (0 inside, -inf outside, made before the timing);
* softcap: causal with ``softcap=30``; SDPA has none;
* alibi: causal with ALiBi slopes (nheads,); SDPA efficient and cuDNN with the bias as a float
  mask (-slope·|i - j|, -inf above the diagonal);
* dropout: causal with ``dropout_p=0.1``; SDPA flash with ``dropout_p``;
* varlen: ``flash_attn_varlen_func``, causal, ``batch`` sequences of mixed lengths (1.5 and 0.5
  times seqlen in turn, the same tokens); SDPA flash on jagged nested tensors (made in the call);
* kvcache: ``flash_attn_with_kvcache`` (decode: 1 query token over a cache of seqlen, a
  per-batch int32 ``cache_seqlens`` tensor); SDPA flash and cuDNN, 1 query over the whole cache;
* kvcache_b1: the same at batch 1 over 4·seqlen keys (8192 at the default shape: the batch-1 rule
  of ≤ 8192 keys, which also loads the separate split combine);
* cross_entropy: ``cuflash.ops.cross_entropy.cross_entropy_loss`` forward and backward (the sum
  of the losses) on bf16 logits (batch·seqlen rows, ``CE_VOCAB`` classes, int64 labels); its peer
  ``torch``: ``F.cross_entropy(reduction="sum")`` and its backward;
* rms_norm: ``cuflash.ops.layer_norm.rms_norm_fn`` forward and backward (the sum of y) on bf16
  rows (batch·seqlen rows of heads·head-dim features, a bf16 weight); its peer ``torch``:
  ``F.rms_norm`` and its backward (not among the default calls: ``--startup-calls rms_norm``);
* causal_fwdbwd: the causal call's forward and ``out.backward(dout)``; SDPA flash and cuDNN;
* mix: causal with ``window_size=(1024, 0)`` and ``softcap=30`` (a feature mix); compared with
  SDPA's window call;
* deterministic: causal_fwdbwd with ``deterministic=True``; compared with SDPA's causal_fwdbwd;
* varlen_mix: the varlen call with ``window_size=(1024, 0)`` and ``softcap=30``; compared with
  SDPA's varlen call.

cuflash's cache: warm = the call's kernels already in CuPy's disk cache (a CUPY_CACHE_DIR that
one throwaway child per call filled first, those in parallel; or, with ``warmup_args``, that
``python -m cuflash warmup WARMUP_ARGS`` filled, its wall time recorded), and the parsed tuned tables
in CUFLASH_CACHE_DIR (the same directory); cold = a fresh empty directory per child, so NVRTC
compiles and the tables are parsed. SDPA compiles nothing at run time (cache "n/a").
Each (call, impl, cache) runs --repeats times (default 3), the children interleaved, ``jobs``
at a time (default 1: one child at a time, as the numbers are meant). Records carry the median
and every run. Writes results/<gpu>/startup.json; records: call, impl, cache, first_call_s,
import_s (cuflash), first_call_runs, import_runs, child_wall_s; ``comparison`` compares
cuflash's warm causal call with SDPA's first call + 0.5 s, ``comparisons`` each call's with
its peers'. CUFLASH_STARTUP_PROFILE=FILE in a child's environment writes a cProfile of its
first call to FILE (``profile_child``); CUFLASH_STARTUP_CPU=1 runs a child on torch CPU tensors
(cuflash's reference, SDPA's math backend: the CPU tests' dry run of every call).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .. import _gpu
from .common import median, results_dir, write_json

SHAPE = (2, 2048, 16, 128)      # batch, seqlen, heads, head dim
BUDGET_S = 0.5                  # cuflash's warm first call against SDPA's first call + this
MARK = "CUFLASH_STARTUP "
WINDOW = 1024                   # the window call's window_size[0] (and the SDPA band's width)
SOFTCAP = 30.0
DROPOUT = 0.1
CE_VOCAB = 32000                # the cross_entropy call's classes

# call -> its peers: "sdpa_<backend>" pinned (torch: the torch op, cross entropy's); "+mask": the window / ALiBi as a float mask
# (made before the timing), "+nested": varlen as jagged nested tensors (made in the call)
CALLS = {
    "causal": ("sdpa_flash", "sdpa_cudnn"),
    "window": ("sdpa_efficient+mask", "sdpa_cudnn+mask"),
    "softcap": (),   # SDPA has no softcap: compared with SDPA's causal call (NEAREST)
    "alibi": ("sdpa_efficient+mask", "sdpa_cudnn+mask"),
    "dropout": ("sdpa_flash",),
    "varlen": ("sdpa_flash+nested",),
    "kvcache": ("sdpa_flash", "sdpa_cudnn"),
    "kvcache_b1": ("sdpa_flash", "sdpa_cudnn"),
    "cross_entropy": ("torch",),
    "rms_norm": ("torch",),
    "causal_fwdbwd": ("sdpa_flash", "sdpa_cudnn"),
    "mix": (),
    "deterministic": (),
    "varlen_mix": (),
}
# bench --mode startup's calls unless --startup-calls names others (the feature mix, deterministic
# and varlen-mix calls are the warmup's measurements)
DEFAULT_CALLS = ("causal", "window", "softcap", "alibi", "dropout", "varlen", "kvcache", "kvcache_b1",
                 "causal_fwdbwd", "cross_entropy")
# a call without a peer of its own is compared with this call's peers
NEAREST = {"softcap": "causal", "mix": "window", "deterministic": "causal_fwdbwd", "varlen_mix": "varlen"}

CHILD = r'''
import json, math, os, sys, time
impl, call, b, s, h, d = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
WINDOW, SOFTCAP, DROPOUT, CE_VOCAB = ''' + f"{WINDOW}, {SOFTCAP!r}, {DROPOUT!r}, {CE_VOCAB}" + r'''
import torch
cpu = os.environ.get("CUFLASH_STARTUP_CPU") == "1"   # the CPU tests' dry run: torch CPU, SDPA math
if not cpu:
    torch.cuda.init()
sync = (lambda: None) if cpu else torch.cuda.synchronize
dev, dt = "cpu" if cpu else "cuda", torch.bfloat16
grad = call in ("causal_fwdbwd", "deterministic", "cross_entropy", "rms_norm")
if call == "kvcache_b1":   # one sequence over 4·s keys
    b, s = 1, 4 * s
if call in ("varlen", "varlen_mix"):   # batch sequences of 1.5 and 0.5 times s in turn
    lens = [s + s // 2 if i % 2 == 0 else s - s // 2 for i in range(b)]
    shape = (sum(lens), h, d)
    cu = torch.tensor([sum(lens[:i]) for i in range(b + 1)], dtype=torch.int32, device=dev)
elif call in ("kvcache", "kvcache_b1"):
    shape = (b, 1, h, d)
    kc, vc = (torch.randn(b, s, h, d, device=dev, dtype=dt) for _ in range(2))
    lens_k = torch.tensor([s - s * i // (2 * b) for i in range(b)], dtype=torch.int32, device=dev)
else:
    shape = (b, s, h, d)
q, k, v = (torch.randn(shape, device=dev, dtype=dt, requires_grad=grad) for _ in range(3))
if call in ("kvcache", "kvcache_b1") and impl != "cuflash":
    k, v = kc, vc
if call == "cross_entropy":
    logits = torch.randn(b * s, CE_VOCAB, device=dev, dtype=dt, requires_grad=True)
    labels = torch.randint(0, CE_VOCAB, (b * s,), device=dev)
if call == "rms_norm":
    xn = torch.randn(b * s, h * d, device=dev, dtype=dt, requires_grad=True)
    wn = torch.ones(h * d, device=dev, dtype=dt, requires_grad=True)
dout = torch.randn(shape, device=dev, dtype=dt)
slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], dtype=torch.float32,
                      device=dev)
sync()
rec = {"impl": impl, "call": call}
if impl == "cuflash":
    t0 = time.perf_counter()
    import cuflash
    rec["import_s"] = time.perf_counter() - t0
    kw = {"causal": True}
    if call == "window":
        kw["window_size"] = (WINDOW, 0)
    elif call == "softcap":
        kw["softcap"] = SOFTCAP
    elif call == "alibi":
        kw["alibi_slopes"] = slopes
    elif call == "dropout":
        kw["dropout_p"] = DROPOUT
    elif call in ("mix", "varlen_mix"):
        kw.update(window_size=(WINDOW, 0), softcap=SOFTCAP)
    elif call == "deterministic":
        kw["deterministic"] = True
    if call in ("varlen", "varlen_mix"):
        m = max(lens)
        f = lambda: cuflash.flash_attn_varlen_func(q, k, v, cu, cu, m, m, **kw)
    elif call in ("kvcache", "kvcache_b1"):
        f = lambda: cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens_k)
    elif call == "cross_entropy":
        from cuflash.ops.cross_entropy import cross_entropy_loss
        f = lambda: cross_entropy_loss(logits, labels)[0].sum()
        dout = None
    elif call == "rms_norm":
        from cuflash.ops.layer_norm import rms_norm_fn
        f = lambda: rms_norm_fn(xn, wn, None).sum()
        dout = None
    else:
        f = lambda: cuflash.flash_attn_func(q, k, v, **kw)
    context = None
elif impl == "torch":   # cross entropy's and the norm's peer
    import torch.nn.functional as F
    if call == "rms_norm":
        f = lambda: F.rms_norm(xn, (h * d,), wn).sum()
    else:
        f = lambda: F.cross_entropy(logits, labels, reduction="sum")
    dout, context = None, None
else:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    base, _, how = impl.partition("+")
    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
               "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}[base]
    backend = SDPBackend.MATH if cpu else backend
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kw = {"dropout_p": DROPOUT} if call == "dropout" else {}
    if how == "mask":   # the band or the bias as a float mask, causal inside it (s_q = s_k)
        i = torch.arange(s, device=dev)[:, None]
        j = torch.arange(s, device=dev)[None, :]
        if call == "window":
            bias = torch.zeros(s, s, device=dev)[None]
            bias = bias.masked_fill(j < i - WINDOW, -math.inf)
        else:
            bias = -slopes[:, None, None] * (i - j).abs().float()
        kw["attn_mask"] = bias.masked_fill(j > i, -math.inf).to(dt)[None].expand(b, h, s, s)
    elif call not in ("kvcache", "kvcache_b1"):
        kw["is_causal"] = True
    if how == "nested":
        offsets = cu.long()
        def f():
            nq, nk, nv = (torch.nested.nested_tensor_from_jagged(x, offsets).transpose(1, 2)
                          for x in (q, k, v))
            return F.scaled_dot_product_attention(nq, nk, nv, **kw).transpose(1, 2).values()
    else:
        f = lambda: F.scaled_dot_product_attention(qt, kt, vt, **kw).transpose(1, 2)
    context = lambda: sdpa_kernel(backend)
if grad:
    g = f
    f = lambda: g().backward(dout)
profile = os.environ.get("CUFLASH_STARTUP_PROFILE")
if profile:
    import cProfile
    prof = cProfile.Profile()
t0 = time.perf_counter()
if profile:
    prof.enable()
if context is None:
    f()
else:
    with context():
        f()
sync()
rec["first_call_s"] = time.perf_counter() - t0
if profile:
    prof.disable()
    prof.dump_stats(profile)
print("''' + MARK + r'''" + json.dumps(rec), flush=True)
'''


def child_env(cache_dir: str, **extra) -> dict:
    """The environment of a child: CUPY_CACHE_DIR and CUFLASH_CACHE_DIR (the parsed tuned
    tables) set to cache_dir, this cuflash first on the path; then ``extra`` (which may name
    another PYTHONPATH: another cuflash tree)."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(x for x in (root, os.environ.get("PYTHONPATH", "")) if x)
    env = dict(os.environ, CUPY_CACHE_DIR=cache_dir, CUFLASH_CACHE_DIR=cache_dir, PYTHONPATH=path)
    env.update(extra)
    return env


def parse_child(stdout: str, mark: str = MARK):
    """The child's JSON record (the last line starting with mark), or None."""
    lines = [x for x in stdout.splitlines() if x.startswith(mark)]
    return json.loads(lines[-1][len(mark):]) if lines else None


def child(impl: str, cache_dir: str, shape=SHAPE, timeout: float = 300.0, call: str = "causal",
          env: dict | None = None) -> dict:
    """One fresh process's record of ``call`` by ``impl``, with child_wall_s (its whole life) or
    an error; env: extra environment variables (CUFLASH_STARTUP_PROFILE)."""
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-c", CHILD, impl, call, *map(str, shape)],
                           env=child_env(cache_dir, **(env or {})), capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"impl": impl, "call": call, "error": f"timed out after {timeout:.0f} s"}
    rec = parse_child(r.stdout)
    if rec is None:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        return {"impl": impl, "call": call, "error": f"exit {r.returncode}: " + " | ".join(tail)}
    rec["child_wall_s"] = time.perf_counter() - t0
    return rec


def summarize(impl: str, cache: str, runs: list, call: str = "causal") -> dict:
    """One record from the runs of (call, impl, cache): medians, and every run."""
    ok = [r for r in runs if "first_call_s" in r]
    rec = dict(call=call, impl=impl, cache=cache, first_call_s=median(r["first_call_s"] for r in ok),
               first_call_runs=[r["first_call_s"] for r in ok],
               child_wall_s=median(r["child_wall_s"] for r in ok))
    if impl == "cuflash":
        rec.update(import_s=median(r["import_s"] for r in ok), import_runs=[r["import_s"] for r in ok])
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        rec["errors"] = errors
    return rec


def comparison(records: list, budget_s: float = BUDGET_S, call: str = "causal") -> dict:
    """cuflash's warm first call of ``call`` against each peer's (SDPA's impls, torch's) first
    call of it + budget_s (records without a call field are the causal call's); a call that has
    no peer (NEAREST) against the peers of its nearest call, named in "sdpa_call"."""
    def of(c):
        return {(r["impl"], r["cache"]): r for r in records if r.get("call", "causal") == c}

    by = of(call)
    mine = by.get(("cuflash", "warm"), {}).get("first_call_s")
    out = {"cuflash_warm_first_call_s": mine, "budget_s": budget_s}
    peers = {k: r for k, r in by.items() if k[0] != "cuflash"}
    if not peers and call in NEAREST:
        peers = {k: r for k, r in of(NEAREST[call]).items() if k[0] != "cuflash"}
        if peers:
            out["sdpa_call"] = NEAREST[call]
    for (impl, _), r in peers.items():
        theirs = r.get("first_call_s")
        if theirs is not None:
            out[impl] = {"first_call_s": theirs, "plus_budget_s": theirs + budget_s,
                         "cuflash_minus_that_s": None if mine is None else mine - theirs - budget_s}
    return out


def comparisons(records: list, budget_s: float = BUDGET_S) -> dict:
    """{call: comparison(records, budget_s, call)} for every call the records hold, in CALLS'
    order."""
    calls = dict.fromkeys(r.get("call", "causal") for r in records)
    order = [c for c in CALLS if c in calls] + [c for c in calls if c not in CALLS]
    return {c: comparison(records, budget_s, c) for c in order}


def comparison_lines(cmp_: dict, call: str = "") -> list:
    mine = cmp_["cuflash_warm_first_call_s"]
    what = f"cuflash warm first call{' (' + call + ')' if call else ''}"
    if "sdpa_call" in cmp_:
        what += f", SDPA's {cmp_['sdpa_call']} call"
    out = []
    for impl, c in cmp_.items():
        if not isinstance(c, dict):
            continue
        if mine is None:
            out.append(f"{what}: no number; {impl} first call {c['first_call_s']:.3f} s")
            continue
        out.append(f"{what} {mine:.3f} s vs {impl} first call + {cmp_['budget_s']} s "
                   f"= {c['plus_budget_s']:.3f} s: difference {c['cuflash_minus_that_s']:+.3f} s")
    return out


def _s(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def table(records: list, budget_s: float = BUDGET_S) -> str:
    """Markdown: per call, cuflash's first call (warm, cold, its import), SDPA's peers' first
    calls, and the warm call's margin over the nearest budget (the fastest peer + budget_s;
    negative = within)."""
    by = {(r.get("call", "causal"), r["impl"], r["cache"]): r for r in records}
    lines = ["| call | cuflash warm | cuflash cold | import cuflash | SDPA first call | "
             f"warm - (fastest SDPA + {budget_s} s) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for call, cmp_ in comparisons(records, budget_s).items():
        warm = by.get((call, "cuflash", "warm"), {})
        cold = by.get((call, "cuflash", "cold"), {})
        peers = [(impl, c["first_call_s"]) for impl, c in cmp_.items() if isinstance(c, dict)]
        sdpa = ", ".join(f"{impl.removeprefix('sdpa_')} {t:.3f}" for impl, t in peers) or "none"
        if peers and "sdpa_call" in cmp_:
            sdpa = f"none ({cmp_['sdpa_call']}: {sdpa})"
        mine = warm.get("first_call_s")
        margin = None if mine is None or not peers else mine - min(t for _, t in peers) - budget_s
        lines.append(f"| {call} | {_s(mine)} | {_s(cold.get('first_call_s'))} | "
                     f"{_s(warm.get('import_s'))} | {sdpa} | "
                     f"{'-' if margin is None else f'{margin:+.3f}'} |")
    return "\n".join(lines)


def plan_of(calls) -> list:
    """[(call, impl, cache)] in the order each repeat runs them."""
    out = []
    for call in calls:
        if call not in CALLS:
            raise ValueError(f"calls: unknown call {call!r}; calls: {', '.join(CALLS)}")
        out += [(call, "cuflash", "warm"), (call, "cuflash", "cold")]
        out += [(call, impl, "n/a") for impl in CALLS[call]]
    return out


def profile_child(call: str, cache_dir: str, path: str, shape=SHAPE, timeout: float = 300.0) -> dict:
    """One cuflash child of ``call`` with its first call under cProfile (stats written to path)."""
    return child("cuflash", cache_dir, shape, timeout, call, env={"CUFLASH_STARTUP_PROFILE": path})


def warm_by_warmup(cache_dir: str, args, timeout: float = 900.0) -> dict:
    """Fill cache_dir by ``python -m cuflash warmup ARGS`` (this cuflash, child_env): its wall
    time, exit status and last output lines."""
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-m", "cuflash", "warmup", *args], env=child_env(cache_dir),
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"args": list(args), "error": f"timed out after {timeout:.0f} s"}
    tail = (r.stdout + r.stderr.split("\r")[-1]).strip().splitlines()[-4:]
    return {"args": list(args), "wall_s": time.perf_counter() - t0, "returncode": r.returncode, "tail": tail}


def run(repeats: int = 3, shape=SHAPE, out="results", log=print, calls=tuple(CALLS),
        jobs: int = 1, warm_dir=None, warmup_args=None) -> list:
    """warm_dir: the warm cache's directory, kept afterwards (default: a temporary one);
    warmup_args: fill it by ``python -m cuflash warmup`` with these arguments (a list) instead
    of one throwaway child per call."""
    _gpu.require("bench --mode startup")
    plan = plan_of(calls)
    warm = str(warm_dir) if warm_dir else tempfile.mkdtemp(prefix="cuflash_startup_warm_")
    cold_dirs = []
    runs = {key: [] for key in plan}

    def one(key):
        call, impl, cache = key
        if cache == "cold":
            cold_dirs.append(tempfile.mkdtemp(prefix="cuflash_startup_cold_"))
            return child(impl, cold_dirs[-1], shape, call=call)
        return child(impl, warm, shape, call=call)

    warmed = None
    try:
        if warmup_args is not None:
            warmed = warm_by_warmup(warm, warmup_args)
            log(f"  python -m cuflash warmup {' '.join(warmup_args)}: "
                + (warmed["error"] if "error" in warmed else
                   f"{warmed['wall_s']:.1f} s, exit {warmed['returncode']}: {' | '.join(warmed['tail'])}"))
        else:
            with ThreadPoolExecutor(max(1, min(len(calls), os.cpu_count() or 1))) as pool:
                # throwaways: fill the warm cache, every call's kernels at once
                for rec in pool.map(lambda c: child("cuflash", warm, shape, call=c), calls):
                    if "error" in rec:
                        log(f"  throwaway cuflash child ({rec['call']}): {rec['error']}")
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            for i in range(repeats):
                for key, rec in zip(plan, pool.map(one, plan)):
                    runs[key].append(rec)
                    log(f"  run {i + 1}/{repeats} {key[0]} {key[1]} cache={key[2]}: "
                        + (rec["error"] if "error" in rec else f"first call {rec['first_call_s']:.3f} s"
                           + (f", import {rec['import_s']:.3f} s" if "import_s" in rec else "")))
    finally:
        for d in ([] if warm_dir else [warm]) + cold_dirs:
            shutil.rmtree(d, ignore_errors=True)
    records = [summarize(impl, cache, runs[(call, impl, cache)], call) for call, impl, cache in plan]
    cmps = comparisons(records)
    path = results_dir(out) / "startup.json"
    write_json(path, records, shape=dict(zip(("batch", "seqlen", "nheads", "hdim"), shape)),
               causal=True, dtype="bf16", repeats=repeats, jobs=jobs,
               calls={c: list(CALLS[c]) for c in calls}, window=WINDOW, softcap=SOFTCAP,
               dropout_p=DROPOUT, ce_vocab=CE_VOCAB, comparison=cmps.get("causal", comparison(records)),
               comparisons=cmps, warm_by="throwaway children" if warmed is None else "python -m cuflash warmup",
               warmup=warmed)
    for r in records:
        log(f"{r['call']:>13} {r['impl']:>19} cache={r['cache']:4}: first call "
            + (f"{r['first_call_s']:.3f} s" if r["first_call_s"] is not None else "-")
            + (f", import cuflash {r['import_s']:.3f} s" if r.get("import_s") is not None else "")
            + f" (median of {len(r['first_call_runs'])})")
    for call, cmp_ in cmps.items():
        for text in comparison_lines(cmp_, call):
            log(text)
    log(table(records))
    log(f"wrote {path}")
    return records
