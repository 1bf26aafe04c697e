"""--mode features: what each attention feature costs, against the same call without it and
against SDPA (issue 12's speed targets).

For each head dim (default 128) and seqlen (default 8k) of the FlashAttention convention
(heads = 2048 / head dim, batch · seqlen = 16k), bf16 unless told otherwise, and each case
(CASES; DEFAULT_CASES run unless --feature-cases names others):
  window1024_causal  window_size=(1024, 0), causal (Mistral-style local attention)
  window1024         window_size=(1024, 1024), not causal
  softcap30_causal   softcap=30 (Gemma 2), causal         (softcap30: not causal)
  alibi_causal       ALiBi slopes (nheads,) (BLOOM / MPT), causal   (alibi: not causal)
  dropout0.1_causal  dropout_p=0.1, causal                 (dropout0.1: not causal)
  varlen_causal      a batch of mixed lengths (bench/varlen.py's "mixed" draw, 16k tokens)
                     packed, causal                        (varlen: not causal)
the forward ("fwd") and forward + backward ("fwdbwd", torch.autograd.grad) of:
  cuflash         flash_attn_func with the feature (flash_attn_varlen_func for varlen)
  cuflash_plain   the same call without the feature, same causal flag (for varlen: the dense
                  call on the batch padded to its longest sequence, the work padding costs)
  sdpa_flash, sdpa_cudnn, sdpa_efficient, sdpa_math   SDPA pinned to one backend, given the
                  feature where SDPA has a form of it: a window as a boolean attn_mask, ALiBi
                  as a float bias with the causal -inf folded in (both: no form on the flash
                  backend, which takes no attn_mask), dropout as dropout_p; softcap has none.
                  A refusal is recorded as the record's error, never silently skipped.
  sdpa_nested     (varlen) SDPA on nested (jagged) tensors of the same sequences, where this
                  torch runs it, else the error (torch 2.11 refuses is_causal with nested query /
                  key: varlen_causal records that; the non-causal varlen case runs it)
Samples interleaved in one process on the same tensors (cuflash.timing through
common.measure). Before timing, every cuflash kernel the run needs is compiled in parallel
worker processes (cuflash.compile.precompile), so a cold cache costs one parallel compile.

Records (results/<gpu>/features.{json,csv}): feature (the case), pass ("fwd" or "fwdbwd"),
impl, ms, spread, tflops, ratio_vs_plain (ms / cuflash_plain's ms), visible_fraction (window
cases: visible score elements over those of the plain call), cost_over_visible
(ratio_vs_plain / visible_fraction: 1.0 when the window costs exactly its share; the issue's
target is <= 1.15), dtype, hdim, seqlen, batch, nheads, causal, config (cuflash's kernel
config), error (instead of ms). TFLOPs count the visible score elements only:
4·b·h·d·visible (x3.5 for forward + backward), so a window's TFLOPs compare with the plain
call's as useful work per second; for varlen the real tokens only.
"""
from __future__ import annotations

from .. import _gpu
from ..band import visible_fraction
from ..problem import Problem
from .common import inputs, measure, release, results_dir, short, write

STEM = "features"
SEQLENS = (8192,)
HDIMS = (128,)
PASSES = ("fwd", "fwdbwd")
CASES = {
    "window1024_causal": dict(causal=True, window_size=(1024, 0)),
    "window1024": dict(causal=False, window_size=(1024, 1024)),
    "softcap30_causal": dict(causal=True, softcap=30.0),
    "softcap30": dict(causal=False, softcap=30.0),
    "alibi_causal": dict(causal=True, alibi=True),
    "alibi": dict(causal=False, alibi=True),
    "dropout0.1_causal": dict(causal=True, dropout_p=0.1),
    "dropout0.1": dict(causal=False, dropout_p=0.1),
    "varlen_causal": dict(causal=True, varlen="mixed"),
    "varlen": dict(causal=False, varlen="mixed"),
}
DEFAULT_CASES = ("window1024_causal", "window1024", "softcap30_causal", "alibi_causal",
                 "dropout0.1_causal", "varlen_causal")
SDPA_IMPLS = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math")
FWDBWD_FACTOR = 3.5            # forward + backward FLOPs: 1 + 2.5 (registry.OPS["bwd"])


def feature_of(case: str) -> str:
    """The feature a case measures: window, softcap, alibi, dropout or varlen."""
    kw = CASES[case]
    for name, key in (("window", "window_size"), ("softcap", "softcap"), ("alibi", "alibi"),
                      ("dropout", "dropout_p"), ("varlen", "varlen")):
        if key in kw:
            return name
    raise ValueError(f"case {case!r} has no feature")


def sdpa_support(case: str) -> dict:
    """{sdpa impl: '' (runs the feature) or why not (recorded as the error)}."""
    feature = feature_of(case)
    if feature == "varlen":
        return {"sdpa_nested": ""}
    if feature == "softcap":
        return {i: "SDPA has no softcap (a tanh of the scores, not a bias)" for i in SDPA_IMPLS}
    if feature in ("window", "alibi"):
        return {i: ("SDPA's flash backend takes no attn_mask" if i == "sdpa_flash" else "")
                for i in SDPA_IMPLS}
    return {i: "" for i in SDPA_IMPLS}          # dropout: dropout_p on every backend


def plan(cases=DEFAULT_CASES, hdims=HDIMS, seqlens=SEQLENS, dtypes=("bf16",), passes=PASSES) -> list:
    """Every (dtype, hdim, seqlen, case, pass, impl) the run times, in order; impls whose SDPA
    backend has no form of the feature are in it too (their record carries the reason)."""
    out = []
    for dtype in dtypes:
        for d in hdims:
            for s in seqlens:
                for case in cases:
                    impls = ("cuflash", "cuflash_plain") + tuple(sdpa_support(case))
                    for ps in passes:
                        out += [(dtype, d, s, case, ps, impl) for impl in impls]
    return out


def case_problem(case: str, dtype: str, d: int, s: int, op: str = "fwd") -> Problem:
    """The Problem cuflash's API builds for a (non-varlen) case: features and their values."""
    kw = CASES[case]
    p = Problem.fa_convention(op, dtype, d, kw["causal"], s)
    feature = feature_of(case)
    if feature == "window":
        left, right = kw["window_size"]
        return p.replace(features=("window",), window=(left, 0 if kw["causal"] else right))
    if feature == "softcap":
        return p.replace(features=("softcap",), softcap=kw["softcap"])
    if feature == "alibi":
        return p.replace(features=("alibi",))
    if feature == "dropout":
        return p.replace(features=("dropout",), dropout_p=kw["dropout_p"])
    return p


def window_fraction(case: str, s: int) -> float:
    """Visible elements of a window case over those of the same call without the window."""
    kw = CASES[case]
    return visible_fraction(s, s, kw["causal"], kw["window_size"])


def visible_pairs(s: int, causal: bool, window=(-1, -1)) -> int:
    """Visible (query, key) pairs of one (batch, head) at seqlen s."""
    from ..band import Band

    return Band(s, s, causal, tuple(window)).visible()


def useful_flops(batch: int, nheads: int, d: int, pairs: int, pass_: str) -> float:
    return 4.0 * batch * nheads * d * pairs * (FWDBWD_FACTOR if pass_ == "fwdbwd" else 1.0)


def make_records(case: str, pass_: str, timings: dict, base: dict, flops: float,
                 fraction=None, configs=None) -> list:
    """Records of one (case, pass) from {impl: Timing or error string}."""
    plain = timings.get("cuflash_plain")
    plain_ms = plain.median_ms if plain is not None and not isinstance(plain, str) else None
    out = []
    for impl, t in timings.items():
        rec = dict(feature=case, **{"pass": pass_}, impl=impl, **base)
        if configs and impl in configs:
            rec["config"] = configs[impl]
        if fraction is not None:
            rec["visible_fraction"] = round(fraction, 4)
        if isinstance(t, str):
            rec["error"] = t
        else:
            rec.update(ms=t.median_ms, spread=round(t.spread, 4), tflops=round(flops / t.median_ms / 1e9, 1))
            if plain_ms:
                rec["ratio_vs_plain"] = round(t.median_ms / plain_ms, 3)
                if fraction:
                    rec["cost_over_visible"] = round(t.median_ms / plain_ms / fraction, 3)
        out.append(rec)
    return out


# ---------------------------------------------------------------------------------------
# the callables (GPU)

def alibi_slopes(nheads: int, device="cpu"):
    """The ALiBi paper's slopes for nheads heads (a power of two): 2^(-8 i / nheads), i = 1.."""
    import torch

    return torch.tensor([2.0 ** (-8.0 * (i + 1) / nheads) for i in range(nheads)],
                        dtype=torch.float32, device=device)


def sdpa_mask(seqlen_q: int, seqlen_k: int, causal: bool, window=(-1, -1), slopes=None,
              dtype=None, device="cpu"):
    """SDPA's attn_mask for a case, bottom-right aligned as cuflash: None (no feature), a
    boolean (s_q, s_k) keep mask (causal / window), or with ALiBi a float (1, h, s_q, s_k)
    bias with -inf at the hidden elements."""
    import torch

    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    diag = i + seqlen_k - seqlen_q
    left, right = window
    if causal:
        right = 0
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        keep &= j <= diag + right
    if left >= 0:
        keep &= j >= diag - left
    if slopes is None:
        return keep if (causal or window != (-1, -1)) else None
    bias = -slopes[:, None, None].to(torch.float32) * (diag - j).abs()[None].to(torch.float32)
    bias = bias.masked_fill(~keep[None], float("-inf"))
    return bias[None].to(dtype or torch.float32)


def _sdpa(impl: str, mask=None, causal: bool = False, dropout_p: float = 0.0):
    """f(q, k, v) in cuflash's (b, s, h, d) layout by SDPA pinned to impl's backend; the mask
    (when given) carries the causal part."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from .common import sdpa_backend

    backend = sdpa_backend(impl)

    def f(q, k, v):
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                dropout_p=dropout_p, is_causal=causal and mask is None)
        return out.transpose(1, 2)
    return f


def _cuflash(**kw):
    from ..api import flash_attn_func

    return lambda q, k, v: flash_attn_func(q, k, v, **kw)


def _passes(fns: dict, passes, dout: dict) -> dict:
    """{pass: {impl: callable}}: the forward alone (no autograd), or forward + backward
    (torch.autograd.grad of the output with respect to the impl's own leaves)."""
    import torch

    out = {}
    if "fwd" in passes:
        out["fwd"] = {impl: (lambda f=f, ins=ins: f(*ins)) for impl, (f, ins) in fns.items()}
    if "fwdbwd" in passes:
        both = {}
        for impl, (f, ins) in fns.items():
            leaves = [x.detach().requires_grad_() if not x.requires_grad else x for x in ins]
            both[impl] = (lambda f=f, leaves=leaves, g=dout[impl]:
                          torch.autograd.grad(f(*leaves), leaves, g))
        out["fwdbwd"] = both
    return out


def dense_case(case, dtype, d, s, passes, sdpa, log):
    """{pass: {impl: callable}}, base fields, useful FLOPs per pass, the visible fraction and
    cuflash's configs of a non-varlen case."""
    kw = dict(CASES[case])
    causal = kw["causal"]
    p = Problem.fa_convention("fwd", dtype, d, causal, s)
    q, k, v, dout = inputs(p, 4)
    feature = feature_of(case)
    slopes = alibi_slopes(p.nheads, q.device) if kw.pop("alibi", False) else None
    feature_kw = dict(kw, alibi_slopes=slopes) if slopes is not None else kw
    window = kw.get("window_size", (-1, -1))
    fns = {"cuflash": (_cuflash(**feature_kw), (q, k, v)),
           "cuflash_plain": (_cuflash(causal=causal), (q, k, v))}
    errors = {}
    mask = None
    if feature in ("window", "alibi"):
        try:
            mask = sdpa_mask(s, s, causal, window, slopes, q.dtype, q.device)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory
            errors.update({i: short(exc) for i in SDPA_IMPLS})
    for impl, why in sdpa.items():
        if why or impl in errors:
            errors.setdefault(impl, why)
        else:
            fns[impl] = (_sdpa(impl, mask, causal, kw.get("dropout_p", 0.0)), (q, k, v))
    by_pass = _passes(fns, passes, {impl: dout for impl in fns})
    pairs = visible_pairs(s, causal, window)
    base = dict(dtype=dtype, hdim=d, seqlen=s, batch=p.batch, nheads=p.nheads, causal=causal)
    flops = {ps: useful_flops(p.batch, p.nheads, d, pairs, ps) for ps in passes}
    fraction = window_fraction(case, s) if feature == "window" else None
    return by_pass, errors, base, flops, fraction


def varlen_case(case, dtype, d, s, passes, log):
    """As dense_case for a varlen case: 16k tokens of mixed lengths, packed (cuflash), padded
    to the longest (cuflash_plain) and nested (sdpa_nested)."""
    import numpy as np
    import torch

    import cuflash

    from .common import torch_dtype
    from .varlen import lengths

    causal = CASES[case]["causal"]
    h = 2048 // d
    lens = lengths(CASES[case]["varlen"], 16384)
    b, smax, tokens = len(lens), max(lens), sum(lens)
    cu = torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int32, device="cuda")
    tdt = torch_dtype(dtype)
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(tokens, h, d, device="cuda", dtype=tdt) for _ in range(4))

    def pad(x):
        return torch.stack([torch.nn.functional.pad(x[cu[i]:cu[i + 1]], (0, 0, 0, 0, 0, smax - lens[i]))
                            for i in range(b)])

    qp, kp, vp, dop = (pad(x) for x in (q, k, v, do))
    fns = {"cuflash": (lambda q_, k_, v_: cuflash.flash_attn_varlen_func(q_, k_, v_, cu, cu, smax, smax,
                                                                         causal=causal), (q, k, v)),
           "cuflash_plain": (lambda q_, k_, v_: cuflash.flash_attn_func(q_, k_, v_, causal=causal),
                             (qp, kp, vp))}
    douts = {"cuflash": do, "cuflash_plain": dop}
    errors = {}
    try:  # jagged nested tensors (B, j, h, d), seen by SDPA as (B, h, j, d)
        offsets = cu.to(torch.int64)

        def nest(x, grad):
            # one offsets tensor for all: the same ragged size, so the output and its gradient
            # match (nested tensors built apart get different ragged sizes, j1 != j2).
            return torch.nested.nested_tensor_from_jagged(x.detach().clone(), offsets).requires_grad_(grad)

        qn, kn, vn = nest(q, True), nest(k, True), nest(v, True)
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def nested(q_, k_, v_):
            return sdpa(q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2),
                        is_causal=causal).transpose(1, 2)

        nested(qn, kn, vn)  # raises where unsupported
        fns["sdpa_nested"] = (nested, (qn, kn, vn))
        douts["sdpa_nested"] = nest(do, False)
    except Exception as exc:  # noqa: BLE001 - recorded
        errors["sdpa_nested"] = short(exc)
    by_pass = _passes(fns, passes, douts)
    pairs = sum(visible_pairs(n, causal) for n in lens)
    base = dict(dtype=dtype, hdim=d, seqlen=smax, batch=b, nheads=h, causal=causal, tokens=tokens,
                padded_tokens=b * smax)
    flops = {ps: useful_flops(1, h, d, pairs, ps) for ps in passes}
    return by_pass, errors, base, flops, None


def cuflash_configs(case: str, dtype: str, d: int, s: int, device: int = 0, chooser=None) -> tuple:
    """({"cuflash": fwd + bwd config names, "cuflash_plain": ...}, [configs]) as selection
    picks them on this GPU (varlen: the packed call's), for the records and the parallel
    precompile. ``chooser(problem, device)`` -> (family, config, source) stands in for
    select.choose_on_device (the CPU tests pass select.choose for a given arch)."""
    if chooser is None:
        from ..select import choose_on_device as chooser

    out, configs = {}, []
    causal = CASES[case]["causal"]
    if feature_of(case) == "varlen":
        from ..varlen import problem_of
        from .varlen import lengths

        h, lens = 2048 // d, lengths(CASES[case]["varlen"], 16384)
        b, smax = len(lens), max(lens)
        feature_problems = [problem_of(op, dtype, b, smax, smax, h, h, d, causal) for op in ("fwd", "bwd")]
        plain_problems = [Problem(op, dtype, b, smax, smax, h, h, d, causal) for op in ("fwd", "bwd")]
    else:
        feature_problems = [case_problem(case, dtype, d, s, op) for op in ("fwd", "bwd")]
        plain_problems = [Problem.fa_convention(op, dtype, d, causal, s) for op in ("fwd", "bwd")]
    for impl, probs in (("cuflash", feature_problems), ("cuflash_plain", plain_problems)):
        names = []
        for p in probs:
            try:
                _, cfg, _ = chooser(p, device)
                configs.append(cfg)
                names.append(cfg.name)
            except Exception as exc:  # noqa: BLE001 - the call itself will report it
                names.append(short(exc, 80))
        out[impl] = " + ".join(names)
    return out, configs


def precompile_all(keys, log=print) -> dict:
    """Compile every cuflash kernel of the run in parallel worker processes; {key: configs}."""
    from ..compile import precompile

    names, configs = {}, []
    for key in keys:
        names[key], cfgs = cuflash_configs(*key)
        configs += cfgs
    configs = list(dict.fromkeys(configs))
    if configs:
        import time

        t0 = time.perf_counter()
        try:
            results = precompile(configs)
        except Exception as exc:  # noqa: BLE001 - the calls then compile on first use
            log(f"precompile failed ({short(exc)}): kernels compile on their first call")
            return names
        bad = [(c.name, e) for c, _, e in results if e]
        log(f"compiled {len(configs) - len(bad)}/{len(configs)} kernels in {time.perf_counter() - t0:.0f} s"
            + "".join(f"\n  FAILED {n}: {e[:200]}" for n, e in bad))
    return names


def run(hdims=HDIMS, seqlens=SEQLENS, dtypes=("bf16",), cases=DEFAULT_CASES, passes=PASSES,
        out="results", reps=10, flush_l2=False, log=print) -> list:
    _gpu.require("bench --mode features")
    import torch

    from .. import api

    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise ValueError(f"cases: unknown {unknown}; known: {', '.join(CASES)}")
    keys = [(case, dtype, d, s) for dtype in dtypes for d in hdims for s in seqlens for case in cases]
    names = precompile_all(keys, log)
    records = []
    check, api.CHECK_CU_SEQLENS = api.CHECK_CU_SEQLENS, False  # varlen: no D2H sync per call
    try:
        for case, dtype, d, s in keys:
            if feature_of(case) == "varlen":
                by_pass, errors, base, flops, fraction = varlen_case(case, dtype, d, s, passes, log)
            else:
                by_pass, errors, base, flops, fraction = dense_case(case, dtype, d, s, passes,
                                                                    sdpa_support(case), log)
            order = ["cuflash", "cuflash_plain"] + [i for i in sdpa_support(case)]
            for ps, fns in by_pass.items():
                if ps == "fwd":
                    with torch.no_grad():
                        timings = measure(fns, reps, flush_l2, log)
                else:
                    timings = measure(fns, reps, flush_l2, log)
                timings = {i: timings.get(i, errors.get(i, "not run")) for i in order}
                new = make_records(case, ps, timings, base, flops[ps], fraction, names.get((case, dtype, d, s)))
                records += new
                log(line(new))
            del by_pass
            release()
            torch.cuda.empty_cache()
    finally:
        api.CHECK_CU_SEQLENS = check
    write(records, results_dir(out), STEM, None, log)
    log("\n" + table(records))
    return records


# ---------------------------------------------------------------------------------------
# text

def line(recs: list) -> str:
    r0 = recs[0]
    cells = [f"{r['impl']} {r['ms']:.3f} ms" if "ms" in r else f"{r['impl']} -" for r in recs]
    return f"{r0['feature']} {r0['pass']} d{r0['hdim']} s{r0['seqlen']}: " + ", ".join(cells)


def table(records: list) -> str:
    """A markdown table: one row per (feature, pass, dtype, hdim, seqlen), ms per impl,
    cuflash / plain, and for a window the visible fraction and cuflash's cost over it."""
    impls = list(dict.fromkeys(r["impl"] for r in records))
    rows = {}
    for r in records:
        key = (r["feature"], r["pass"], r["dtype"], r["hdim"], r["seqlen"])
        rows.setdefault(key, {})[r["impl"]] = r
    out = ["| feature | pass | dtype | d | seqlen | " + " | ".join(f"{i} ms" for i in impls)
           + " | cuflash / plain | visible | cost / visible |", "|" + " --- |" * (8 + len(impls))]
    for key, by in rows.items():
        cells = [f"{by[i]['ms']:.3f}" if i in by and "ms" in by[i] else "-" for i in impls]
        cf = by.get("cuflash", {})
        ratio, frac, cost = cf.get("ratio_vs_plain"), cf.get("visible_fraction"), cf.get("cost_over_visible")
        tail = [f"{x}" if x is not None else "-" for x in (ratio, frac, cost)]
        out.append("| " + " | ".join(map(str, key)) + " | " + " | ".join(cells + tail) + " |")
    return "\n".join(out)
