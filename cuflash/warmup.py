"""python -m cuflash warmup: compile, ahead of the first call, the kernels this GPU will run.

For every (op, dtype, head dim, causal, seqlen bucket) asked for, the config that selection
picks on this GPU (tuned entry or heuristic) is compiled in parallel worker processes into
CuPy's disk cache; later processes then load kernels instead of compiling them.

The options say what the model calls, and the warmup runs the calls' own selection for them
(the choice, then what the plan refines from the call: ``Family.for_bounds``; for decoding
``cuflash.decode.call_config``), so that it compiles the kernels those calls' plans load:

* ``--features window+softcap,alibi+dropout``: the feature calls, each comma item one call's
  features joined by ``+`` (``all``: each feature alone), forward and backward as --op asks,
  with representative run-time values where the config depends on them (``feature_problems``);
* ``--deterministic``: the backward calls are deterministic (``deterministic=True``);
* ``--varlen``: the calls are also ``flash_attn_varlen_func``'s, the plain one and each
  ``--features`` item (``varlen`` may also be one of an item's features);
* ``--decode "batch=1..64,ctx=8k..128k,page=0,16,256"``: ``flash_attn_with_kvcache`` calls
  (``decode_calls`` states the syntax);
* ``--helpers cross_entropy,rotary,layer_norm,dense_act`` (``all``: every one in ``HELPERS``): the
  modules of kernels outside the registry that load on their first use (``cuflash.ops.cross_entropy``,
  ``apply_rotary_emb``, ``cuflash.ops.layer_norm``'s fused norms at the widths of
  ``cuflash.layer_norm.WARM_WIDTHS``, the fused MLP's activation kernels of
  ``cuflash.ops.fused_dense`` for every activation), for the --dtype dtypes (and fp32: cross
  entropy's logits may be).

A first call then loads its kernels (without: 1.4-1.7 s of NVRTC per feature call's first call,
H100, bench --mode startup, session 25).
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import dataclass

from . import _gpu
from .problem import SEQLEN_BUCKETS, Problem
from .registry import OPS

# --helpers: name -> the module whose warm_modules(torch dtypes) lists its HelperModules
HELPERS = {"cross_entropy": "cuflash.cross_entropy", "rotary": "cuflash.rotary", "layer_norm": "cuflash.layer_norm",
           "dense_act": "cuflash.dense_act"}


def parse_helpers(text: str) -> list[str]:
    """--helpers' names (``all``: every one), checked."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if names == ["all"]:
        return list(HELPERS)
    for n in names:
        if n not in HELPERS:
            raise ValueError(f"helpers: unknown helper {n!r}; helpers: {', '.join(HELPERS)} or all")
    return list(dict.fromkeys(names))


def helper_modules(names, dtypes) -> list:
    """The HelperModules of these helpers for these dtype names (bf16, fp16; fp32 added)."""
    import importlib

    import torch

    by_name = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    torch_dtypes = [by_name[d] for d in dict.fromkeys(list(dtypes) + ["fp32"]) if d in by_name]
    out = []
    for n in names:
        out += importlib.import_module(HELPERS[n]).warm_modules(torch_dtypes)
    return list(dict.fromkeys(out))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


FEATURES = ("window", "softcap", "alibi", "dropout", "varlen")
# Representative run-time values of the features whose config depends on them: the window's bounds
# (which tiles keep keys: for_bounds) and the softcap (whether the cap allows the fixed row max).
WINDOW = 1024               # keys on each side that has a bound ((1024, 0) causal); bench --mode features'
SOFTCAPS = (30.0, 50.0)     # this project's benches; Gemma 2's attention cap
DROPOUT_P = 0.1


def parse_features(text: str) -> list[tuple]:
    """``--features``' value: a comma list of calls, each its features joined by '+' (``all``:
    each feature alone), as sorted tuples; ValueError naming an unknown feature."""
    if text.strip() == "all":
        return [(f,) for f in FEATURES]
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        mix = tuple(sorted({f.strip() for f in item.split("+") if f.strip()}))
        for f in mix:
            if f not in FEATURES:
                raise ValueError(f"features: unknown feature {f!r} in {item!r}; features: "
                                 f"{', '.join(FEATURES)} (a call's joined by '+'), or all")
        if mix:
            out.append(mix)
    return list(dict.fromkeys(out))


def _mix(feature) -> tuple:
    if isinstance(feature, str):
        return parse_features(feature)[0] if feature.strip() else ()
    return tuple(sorted(set(feature)))


def feature_problems(op: str, dtype: str, head_dim: int, causal: bool, feature, seqlen: int,
                     deterministic: bool = False) -> list:
    """The problems whose configs a first call with ``feature`` (a name, or a mix: names joined by
    '+' or a tuple) compiles, at one seqlen (batch and heads 1: the choice does not read them),
    built as the calls build them (``cuflash.api.feature_problem``, ``cuflash.varlen.
    features_problem``); [] where the call is the plain one (a window over every key, alone).
    ``deterministic``: the backward's flag (and dropout's forward, whose problem carries it)."""
    from .varlen import features_problem, problem_of

    mix = _mix(feature)
    for f in mix:
        if f not in FEATURES:
            raise ValueError(f"features: unknown feature {f!r}; features: {', '.join(FEATURES)}")
    det = bool(deterministic) and op == "bwd"
    varlen = "varlen" in mix
    windows = [(-1, -1)]
    if "window" in mix:
        bounds = (WINDOW, 0 if causal else WINDOW)
        # a fixed-length call drops bounds that reach past every key (cuflash.api.check_features)
        windows = [bounds] if varlen or seqlen - 1 > WINDOW else [(-1, -1)]
    caps = SOFTCAPS if "softcap" in mix else (0.0,)
    alibi = "alibi" in mix
    p = DROPOUT_P if "dropout" in mix else 0.0
    out = []
    for window, cap in itertools.product(windows, caps):
        if varlen:
            if len(mix) == 1:   # the plain varlen call (cuflash.varlen.get_plan)
                out.append(problem_of(op, dtype, 1, seqlen, seqlen, 1, 1, head_dim, causal, det))
                continue
            out.append(features_problem(op, dtype, 1, seqlen, seqlen, 1, 1, head_dim, causal, window, cap,
                                        False if alibi else None, p, det))
            continue
        names = [f for f in mix if f != "window" or window != (-1, -1)]
        if not names:
            continue   # the plain call
        problem = Problem(op, dtype, 1, seqlen, seqlen, 1, 1, head_dim, causal, det).replace(
            features=tuple(names), window=window, softcap=float(cap), alibi_batched=False)
        if p:   # dropout's problem carries p and the deterministic flag, forward too (torch_ops._feat_entry)
            problem = problem.replace(dropout_p=p, deterministic=bool(deterministic))
        out.append(problem)
    return out


# ---------------------------------------------------------------------------------------
# decoding: flash_attn_with_kvcache

DECODE_FEATURES = ("alibi", "append", "cache_batch_idx", "leftpad", "paged_kv", "rotary", "softcap", "window")
DECODE_KEYS = ("batch", "ctx", "page", "heads", "q", "with", "causal")
_CAUSAL = {"yes": (True,), "no": (False,), "both": (False, True)}


@dataclass(frozen=True)
class DecodeCalls:
    """The flash_attn_with_kvcache calls of ``--decode``: batch sizes, cache capacities (keys per
    row: seqlen_cache, or pages x page size), page sizes (0: contiguous), (nheads, nheads_kv),
    query tokens per call, each call's features (sorted tuples of DECODE_FEATURES but
    paged_kv, which the page size says), and its causal flags (None: --causal's)."""
    batch: tuple = (1,)
    ctx: tuple = (8192,)
    page: tuple = (0,)
    heads: tuple = ((32, 8),)
    q: tuple = (1,)
    with_: tuple = ((), ("append",), ("append", "rotary"))
    causal: tuple | None = None


def _size(text: str) -> int:
    t = text.strip().lower()
    scale = {"k": 1024, "m": 1024 * 1024}.get(t[-1:], 1)
    return int(t[:-1] if scale > 1 else t) * scale


def _range(text: str, what: str, sizes: bool) -> list:
    """One value, or lo..hi: every int for batch and q; for ctx lo, hi and the powers of two and
    1.5 times them between (cache capacities are mostly those: list exact ones one by one)."""
    parse = _size if sizes else int
    if ".." not in text:
        return [parse(text)]
    lo, hi = (parse(x) for x in text.split("..", 1))
    if lo < 0 or hi < lo:
        raise ValueError(f"decode: {what}={text}: a range lo..hi needs 0 <= lo <= hi")
    if not sizes:
        if hi - lo > 4096:
            raise ValueError(f"decode: {what}={text}: at most 4096 values in a range")
        return list(range(lo, hi + 1))
    points = {lo, hi}
    p = 1
    while p <= hi:
        points.update(x for x in (p, p + p // 2) if lo <= x <= hi)
        p *= 2
    return sorted(points)


def decode_calls(text: str) -> DecodeCalls:
    """``--decode``'s value: comma-separated key=value items, a bare value continuing the key
    before it (``page=0,16,256``): batch=N or lo..hi (every batch), ctx=N or lo..hi (cache
    capacity in keys, k = 1024: the ends and the powers of two and 1.5 times them between),
    page=0 (contiguous) and page sizes, heads=H:HKV (default 32:8), q=query tokens per call
    (default 1), with=features of a call joined by '+' among append, rotary, alibi, softcap,
    window, leftpad, cache_batch_idx ('none': no feature; default none, append, append+rotary),
    causal=yes, no or both (default: --causal's). ValueError naming the key for anything else."""
    items: dict = {}
    key = None
    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        if "=" in token:
            key, token = (x.strip() for x in token.split("=", 1))
            if key not in DECODE_KEYS:
                raise ValueError(f"decode: unknown key {key!r}; keys: {', '.join(DECODE_KEYS)}")
            if key in items:
                raise ValueError(f"decode: {key} given twice")
            items[key] = []
        elif key is None:
            raise ValueError(f"decode: {token!r} needs a key (key=value); keys: {', '.join(DECODE_KEYS)}")
        items[key].append(token)
    kw = {}
    try:
        for name in ("batch", "q"):
            if name in items:
                kw[name] = tuple(sorted({v for t in items[name] for v in _range(t, name, False)}))
        if "ctx" in items:
            kw["ctx"] = tuple(sorted({v for t in items["ctx"] for v in _range(t, "ctx", True)}))
        if "page" in items:
            kw["page"] = tuple(sorted({_size(t) for t in items["page"]}))
        if "heads" in items:
            pairs = []
            for t in items["heads"]:
                h, _, hk = t.partition(":")
                pairs.append((int(h), int(hk or h)))
            kw["heads"] = tuple(dict.fromkeys(pairs))
    except ValueError as exc:
        if str(exc).startswith("decode:"):
            raise
        raise ValueError(f"decode: {text!r}: {exc}") from None
    if "with" in items:
        mixes = []
        for t in items["with"]:
            mix = () if t == "none" else tuple(sorted({f for f in t.split("+") if f}))
            for f in mix:
                if f not in DECODE_FEATURES or f == "paged_kv":
                    raise ValueError(f"decode: with={t}: unknown feature {f!r}; features: "
                                     f"{', '.join(x for x in DECODE_FEATURES if x != 'paged_kv')}, none")
            mixes.append(mix)
        kw["with_"] = tuple(dict.fromkeys(mixes))
    if "causal" in items:
        if len(items["causal"]) != 1 or items["causal"][0] not in _CAUSAL:
            raise ValueError(f"decode: causal must be one of {', '.join(_CAUSAL)}, got {','.join(items['causal'])}")
        kw["causal"] = _CAUSAL[items["causal"][0]]
    calls = DecodeCalls(**kw)
    for name, values in (("batch", calls.batch), ("ctx", calls.ctx), ("q", calls.q)):
        if any(v < 1 for v in values):
            raise ValueError(f"decode: {name} must be >= 1, got {min(values)}")
    if any(p < 0 for p in calls.page):
        raise ValueError(f"decode: page must be 0 (contiguous) or a page size, got {min(calls.page)}")
    if any(h < 1 or hk < 1 or h % hk for h, hk in calls.heads):
        raise ValueError(f"decode: heads=H:HKV needs HKV >= 1 dividing H, got {calls.heads}")
    return calls


def decode_problems(calls: DecodeCalls, dtype: str, head_dim: int, causal: bool) -> list:
    """[(problem, page size)] of the calls (the problems as ``KVCacheCall.problem`` makes them:
    seqlen_k the capacity, for a paged cache whole pages)."""
    out = []
    for batch, ctx, page, (h, hk), sq, mix in itertools.product(calls.batch, calls.ctx, calls.page, calls.heads,
                                                                calls.q, calls.with_):
        capacity = -(-ctx // page) * page if page else ctx
        feats = tuple(sorted(set(mix) | ({"paged_kv"} if page else set())))
        out.append((Problem("decode", dtype, batch, sq, capacity, h, hk, head_dim, bool(causal), False, feats),
                    page))
    return out


def decode_configs(calls: DecodeCalls, dtypes, head_dims, causals, device: int = 0) -> list:
    """The configs the calls' plans compile: cuflash.decode.call_config, then Plan's for_bounds
    (a call shape first seen inside a CUDA-graph capture may run another: captured_config)."""
    from .decode import call_config
    from .select import UnsupportedProblem, table_dirs

    dirs = table_dirs()   # once: choose would look them up per problem
    out = []
    for dtype, d, causal in itertools.product(dtypes, head_dims, calls.causal or causals):
        for problem, page in decode_problems(calls, dtype, d, causal):
            try:
                family, cfg = call_config(problem, device, page, 0, dirs=dirs)
            except UnsupportedProblem:
                continue
            out.append(family.for_bounds(cfg, problem))
    return out


# ---------------------------------------------------------------------------------------

def short_seqlens() -> tuple:
    """Lengths below the buckets whose calls select their own kernels (select.SHORT_EXACT): sm90_fwd's short-key
    K/V block widths, one length per width of SHORT_KEYS_BNS (a length equal to a width takes it)."""
    from .families.sm90_fwd import SHORT_KEYS_BNS

    return tuple(bn for bn in SHORT_KEYS_BNS if bn < SEQLEN_BUCKETS[0])


def configs_to_warm(ops, dtypes, head_dims, causals, device: int = 0, features=(), deterministic: bool = False,
                    varlen: bool = False, decode: DecodeCalls | None = None) -> list:
    """The distinct configs selection picks for these classes, over all seqlen buckets (and short_seqlens); with
    ``features`` (names or mixes), also those of each feature call (as their plans compile them:
    the choice, then the call's bounds, ``Family.for_bounds``); ``deterministic``: the backward
    calls' flag; ``varlen``: the varlen calls too (plain and each feature call); ``decode``: the
    flash_attn_with_kvcache calls (``decode_configs``; not limited by ``ops``). A call that no
    family runs for a class is skipped."""
    from .select import UnsupportedProblem, choose_on_device

    mixes = [_mix(f) for f in features]
    if varlen:
        mixes = mixes + [tuple(sorted(set(m) | {"varlen"})) for m in [("varlen",)] + mixes]
    mixes = list(dict.fromkeys(m for m in mixes if m))
    out = []
    for op in ops:
        for dtype in dtypes:
            for d in head_dims:
                for causal in causals:
                    for s in SEQLEN_BUCKETS + short_seqlens():
                        problem = Problem(op, dtype, 1, s, s, 1, 1, d, causal, bool(deterministic) and op == "bwd")
                        try:
                            family, cfg, _ = choose_on_device(problem, device)
                        except UnsupportedProblem:
                            continue
                        out.append(family.for_bounds(cfg, problem))
                        for mix in mixes:
                            for fp in feature_problems(op, dtype, d, causal, mix, s, deterministic):
                                try:
                                    family, cfg, _ = choose_on_device(fp, device)
                                except UnsupportedProblem:
                                    continue
                                out.append(family.for_bounds(cfg, fp))
    if decode is not None:
        out += decode_configs(decode, dtypes, head_dims, causals, device)
    return list(dict.fromkeys(out))


def modules(configs) -> dict:
    """{(family, kernel name expressions): first config}: the compiled modules (CuPy's disk cache
    keys a module by its source, options and name expressions: configs that differ in run-time
    fields only share one)."""
    from .registry import family_of

    out = {}
    for cfg in configs:
        family = family_of(cfg)
        out.setdefault((family.name, tuple(sorted(family.kernel_names(cfg).values()))), cfg)
    return out


def tuned_head_dims(device: int = 0) -> list[int]:
    """Head dims that this GPU's tuned tables hold entries for."""
    from .select import files_for_gpu

    dims = {e.head_dim for tf in files_for_gpu(_gpu.name(device), _gpu.arch(device)) for e in tf.entries}
    return sorted(dims)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuflash warmup", description=__doc__.split("\n")[0])
    parser.add_argument("--op", default="fwd,bwd", help="ops to warm (default fwd,bwd)")
    parser.add_argument("--dtype", default="bf16,fp16")
    parser.add_argument("--hdim", default="", help="head dims (default: this GPU's tuned ones, and 64,128)")
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--features", default="",
                        help="also the feature calls' kernels: a comma list of calls, each its features joined "
                             f"by + among {','.join(FEATURES)} (e.g. window+softcap,alibi+dropout), or all "
                             "(each alone); default none")
    parser.add_argument("--deterministic", action="store_true",
                        help="the backward calls are deterministic (deterministic=True)")
    parser.add_argument("--varlen", action="store_true",
                        help="also flash_attn_varlen_func's calls: the plain one and each --features call")
    parser.add_argument("--decode", default="",
                        help="also flash_attn_with_kvcache's calls, e.g. 'batch=1..64,ctx=8k..128k,page=0,16,256,"
                             "heads=32:8,with=append+rotary' (keys batch, ctx, page, heads, q, with; README)")
    parser.add_argument("--helpers", default="",
                        help=f"also the modules of kernels outside the registry: a comma list of "
                             f"{','.join(HELPERS)}, or all")
    parser.add_argument("--list", action="store_true", help="print the kernels it would compile, compile none")
    parser.add_argument("--processes", type=int, default=None)
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        features = parse_features(args.features)
    except ValueError as exc:
        parser.error(f"--{exc}")
    try:
        decode = decode_calls(args.decode) if args.decode.strip() else None
    except ValueError as exc:
        parser.error(f"--{exc}")
    try:
        helpers = parse_helpers(args.helpers)
    except ValueError as exc:
        parser.error(f"--{exc}")
    ops = [o for o in args.op.split(",") if o]
    for op in ops:
        if op not in OPS:
            parser.error(f"--op: unknown op {op!r}; ops: {', '.join(OPS)}")
    _gpu.require("python -m cuflash warmup")
    from .compile import precompile

    dims = _ints(args.hdim) or sorted(set(tuned_head_dims(args.device)) | {64, 128})
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    start = time.perf_counter()
    configs = configs_to_warm(ops, args.dtype.split(","), dims, causals, args.device, features,
                              args.deterministic, args.varlen, decode)
    configs = list(modules(configs).values()) + helper_modules(helpers, args.dtype.split(","))
    chosen_s = time.perf_counter() - start
    if args.list:
        for cfg in configs:
            print(cfg.name)
        print(f"{len(configs)} kernels (selection {chosen_s:.1f} s)")
        return 0
    failed = []

    def progress(done, total, result):
        cfg, seconds, error = result
        if error:
            failed.append((cfg, error))
        width = 30
        bar = "#" * (width * done // total) + "." * (width - width * done // total)
        sys.stderr.write(f"\r[{bar}] {done}/{total} {cfg.name[:48]:<48} {seconds:5.1f} s")
        sys.stderr.flush()

    what = [f"ops {','.join(ops)}", f"head dims {','.join(map(str, dims))}"]
    if features:
        what.append(f"features {','.join('+'.join(m) for m in features)}")
    if args.deterministic:
        what.append("deterministic")
    if args.varlen:
        what.append("varlen")
    if decode is not None:
        what.append("decode")
    if helpers:
        what.append(f"helpers {','.join(helpers)}")
    print(f"warming {len(configs)} kernels on {_gpu.name(args.device)} ({', '.join(what)}; "
          f"selection {chosen_s:.1f} s)")
    precompile(configs, args.device, args.processes, progress=progress)
    sys.stderr.write("\n")
    for cfg, error in failed:
        print(f"  FAILED {cfg.name}: {error}")
    print(f"{len(configs) - len(failed)}/{len(configs)} kernels in the cache, {time.perf_counter() - start:.1f} s")
    return 1 if failed else 0
