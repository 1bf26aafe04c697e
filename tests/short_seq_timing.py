"""Issue 12, short-sequence training (ViT 197 / 577 tokens, BERT 128 / 512; d 64, non-causal, bf16): the
attention's forward and backward at those shapes, cuflash next to SDPA's flash, cuDNN and memory-efficient
backends in one process, with each peer's kernels and their GPU time (torch.profiler, CUPTI). Not a test.

    python tests/short_seq_timing.py [--shapes 64x197x12 fp16,causal:64x197x12 ...] [--variants heur w16 ...]
                                     [--fwd-variants bal bn128 qd+tmao ...] [--no-bwd] [--reps 10] [--profile 5]
                                     [--out rows.json]

Per shape (batch x seqlen x heads, head dim --hdim; a prefix 'fp16,causal:' sets the cell's dtype / mask):
* "bwd": the backward alone (torch.autograd.grad of one forward's graph, separate q, k, v tensors): cuflash's
  default route (``cf``: the selection's family and config), main's config at session 31's start (``main``:
  head-dim-64 causal calls without wide_epi; elsewhere cf's kernel, a noise reference), sm90_bwd variants forced
  by bwd_config= (VARIANTS: the default config with one field changed, or other tiles), fa2_bwd's heuristic, and
  SDPA's backends;
* "fwd": the forward alone (no grad): cuflash's default, main's at session 31's start (``main``: the heuristic
  without sm90_fwd.SHORT_KEYS_FIELDS / SHORT_CAUSAL_FIELDS), sm90_fwd variants forced by config= (FWD_VARIANTS:
  other K/V block widths, ``bal`` balanced_bn's; or '+'-joined FWD_TOKENS on the default config, "bn128+qd")
  and SDPA's backends; --fwd-max-seqlen: the longest cell that times them;
* "packed" (--packed): forward + backward on packed qkv (batch, seqlen, 3, heads, d) as the ViT / BERT MHA
  passes it: cuflash's flash_attn_qkvpacked_func (cf_packed: the gradient written into one dqkv buffer), the
  route before it (cf_slices: flash_attn_func on qkv's slices, autograd's per-slice zero-filled gradients
  added) with main's kernels (``main_slices``: the route before session 30), the packed route with main's
  kernels at session 31's start (``main_packed``, where they differ from cf's), the packed route with the candidates
  (``cf_packed_new``: fwd ``bal``, bwd ``w16`` where given) and SDPA on qkv.unbind(2) as models_gpt_timing's
  wrapper calls it.
Times: CUDA events, the peers' samples interleaved (cuflash.timing.time_interleaved, back_to_back 5), median ms;
"x cf": the peer's time over the default's.
Then each peer runs --profile times under torch.profiler inside its own record_function range (synchronized),
and its kernels are listed with their mean GPU us per call: where the time of each route goes.
Checks: every cuflash backward's gradients against SDPA flash's (relative max difference, printed; > 2e-2
prints MISMATCH).
"""
import argparse
import collections
import json
import os
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]  # this folder; cuflash from the checkout

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cuflash  # noqa: E402
from cuflash import registry  # noqa: E402
from cuflash.bench.common import grad_fn  # noqa: E402
from cuflash.compile import precompile  # noqa: E402
from cuflash.families.sm90_bwd import Sm90BwdConfig  # noqa: E402
from cuflash.problem import Problem  # noqa: E402
from cuflash.registry import op_flops  # noqa: E402
from cuflash.select import choose  # noqa: E402
from cuflash.timing import time_interleaved  # noqa: E402

from bwd_timing_common import grad_diffs  # noqa: E402

SHAPES = ("64x197x12", "256x197x12", "128x128x12", "32x512x12", "64x577x16", "8x2048x32", "2x8192x32")


def variant(name, heur):
    """An sm90_bwd config: the default one (heur) with a change, or another tile (d 64)."""
    d, dt = heur.head_dim, heur.dtype
    tiles = {
        "heur": heur,
        "nodqf": heur.replace(dq_first=False),
        "static": heur.replace(dynamic=False),
        "w16": heur.replace(wide_epi=True),
        "rot": heur.replace(q_rotate=True),
        "s3": heur.replace(dynamic=False, stages=3),
        "bm64": Sm90BwdConfig(64, 128, 2, 2, d, dt, False, dq_writer=True, dynamic=True, dq_early=True,
                              dk_late=True, dq_first=heur.dq_first),
        "bm64s": Sm90BwdConfig(64, 128, 2, 2, d, dt, False, dq_writer=True),
        "c1": Sm90BwdConfig(64, 64, 2, 1, d, dt, False, dq_writer=True, dynamic=True),
        "c1s": Sm90BwdConfig(64, 64, 2, 1, d, dt, False, dq_writer=True),
        "red": Sm90BwdConfig(128, 128, 2, 2, d, dt, False),
        "ovl": Sm90BwdConfig(128, 128, 2, 2, d, dt, False, dq_writer=True, overlap_sdp=True),
    }
    return tiles[name]


VARIANTS = ("heur", "nodqf", "static", "w16", "rot", "s3", "bm64", "bm64s", "c1", "c1s", "red", "ovl")
ROUND1 = ("heur", "nodqf", "static", "w16", "rot", "bm64", "c1", "red", "ovl")


def parse_shape(text, dtype):
    """'64x197x12' or 'fp16,causal:64x197x12' -> (dtype, causal, batch, seqlen, heads)."""
    flags, _, shape = text.lower().rpartition(":")
    flags = set(filter(None, flags.split(",")))
    b, s, h = (int(x) for x in shape.split("x"))
    return ("fp16" if "fp16" in flags else "bf16" if "bf16" in flags else dtype), "causal" in flags, b, s, h


def balanced_bn(seqlen_k):
    """The K/V block width that covers seqlen_k in the fewest blocks of <= 192 keys with the least padding
    (a multiple of 16, >= 64): 197 -> 112, 128 -> 128, 512 -> 176, 577 -> 160, 2048 -> 192."""
    n = -(-seqlen_k // 192)
    return max(64, -(-(-(-seqlen_k // n)) // 16) * 16)


FWD_VARIANTS = ("bn112", "bn128", "bn144", "bn160", "bn176", "bal", "bal_np")
# Tokens of a composed forward variant ("qd+tmao", "c1+np", "stat+ovl", "bn128+qd"): each changes the default
# config's fields, applied left to right (session 31, sb2).
FWD_TOKENS = {
    "qd": dict(q_double=True),                                    # the next tile's Q loaded under this one
    "tmao": dict(tma_store=True),                                 # O through shared memory by TMA store
    "stat": dict(dynamic=False),                                  # static persistent
    "ovl": dict(dynamic=False, tile_overlap=True),                # static persistent, next tile's S_0 early
    "pf": dict(dynamic=False, prefetch=True),                     # static persistent, next Q prefetched to L2
    "ew": dict(dynamic=False, even_waves=True),                   # static persistent, even waves
    "np": dict(persistent=False, dynamic=False),                  # one CTA per tile
    "c1": dict(BM=64, consumers=1, pingpong=False),               # one consumer warpgroup
    "c2": dict(BM=128, consumers=2, pingpong=True),
    "c3": dict(BM=192, consumers=3, pingpong=True, BN=128),       # the d64 tile of 2k and up
    "nopp": dict(pingpong=False),
    "tree": dict(tree_max=True),
    "s3": dict(stages=3),
    "s4": dict(stages=4),
    "noqd": dict(q_double=False),
    "notmao": dict(tma_store=False),
    "pp": dict(pingpong=True),
    "dyn": dict(dynamic=True),
}


def fwd_variant(name, cfg, seqlen_k):
    if name == "bal":
        return cfg.replace(BN=balanced_bn(seqlen_k))
    if name == "bal_np":
        return cfg.replace(BN=balanced_bn(seqlen_k), persistent=False, dynamic=False)
    if "+" in name or name in FWD_TOKENS:
        for tok in name.split("+"):
            cfg = cfg.replace(BN=int(tok[2:])) if tok.startswith("bn") else cfg.replace(**FWD_TOKENS[tok])
        return cfg
    return cfg.replace(BN=int(name[2:]))


def fwd_variant_name(text):
    """argparse type of --fwd-variants: a FWD_VARIANTS name or '+'-joined tokens (FWD_TOKENS, bnNNN)."""
    ok = text in FWD_VARIANTS or all(t in FWD_TOKENS or (t.startswith("bn") and t[2:].isdigit())
                                     for t in text.split("+"))
    if not ok:
        raise argparse.ArgumentTypeError(f"--fwd-variants: unknown variant {text!r} (tokens {sorted(FWD_TOKENS)})")
    return text


def sdpa(backend, causal=False):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
          "eff": SDPBackend.EFFICIENT_ATTENTION, "auto": None}[backend]

    def f(q, k, v):   # (b, s, h, d) in and out
        args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        if be is None:
            return F.scaled_dot_product_attention(*args, is_causal=causal).transpose(1, 2)
        with sdpa_kernel(be):
            return F.scaled_dot_product_attention(*args, is_causal=causal).transpose(1, 2)
    return f


def kernel_table(fns, calls):
    """{peer: [(kernel name, mean us per call, launches per call)]} from torch.profiler: each peer
    runs `calls` times inside its own record_function range, synchronized at the range's end."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for name, fn in fns.items():
            torch.cuda.synchronize()
            with record_function(f"peer::{name}"):
                for _ in range(calls):
                    fn()
                torch.cuda.synchronize()
    events = prof.events()
    ranges = {e.name[len("peer::"):]: (e.time_range.start, e.time_range.end)
              for e in events if e.name.startswith("peer::") and e.device_type == DeviceType.CPU}
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith("peer::")]
    if not kernels:
        print("# torch.profiler recorded no CUDA kernels", flush=True)
    out = {}
    for name, (t0, t1) in ranges.items():
        acc = collections.OrderedDict()
        for k in kernels:
            if t0 <= k.time_range.start <= t1:
                tot, n = acc.get(k.name, (0.0, 0))
                acc[k.name] = (tot + k.time_range.elapsed_us(), n + 1)
        out[name] = [(kn, tot / calls, n / calls) for kn, (tot, n) in acc.items()]
    return out


def short(name, n=70):
    return name if len(name) <= n else name[:n - 3] + "..."


def main_bwd(cfg):
    """main's backward config at session 31's start for the call cuflash now runs with cfg: head-dim-64 causal calls
    without wide_epi (session 31 put it on); the rest as cfg."""
    return cfg.replace(wide_epi=False) if cfg.family == "sm90_bwd" and cfg.head_dim == 64 and cfg.causal else cfg


def main_fwd(cfg, problem, arch, smem):
    """main's forward config at session 31's start: the heuristic's without the short-call fields
    (sm90_fwd.SHORT_KEYS_FIELDS, SHORT_CAUSAL_FIELDS), where cfg is the heuristic's head-dim-64 2-consumer tile."""
    from cuflash.families import sm90_fwd

    if not (cfg.family == "sm90_fwd" and cfg.head_dim == 64 and cfg.BM == 128 and cfg.consumers == 2):
        return cfg
    fam = registry.get("sm90_fwd")
    saved = sm90_fwd.SHORT_KEYS_FIELDS, sm90_fwd.SHORT_CAUSAL_FIELDS
    sm90_fwd.SHORT_KEYS_FIELDS, sm90_fwd.SHORT_CAUSAL_FIELDS = {}, {}
    try:
        return fam.for_problem(fam.heuristic(problem, arch, smem), problem)
    finally:
        sm90_fwd.SHORT_KEYS_FIELDS, sm90_fwd.SHORT_CAUSAL_FIELDS = saved


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="[dtype,causal:]batch x seqlen x heads")
    ap.add_argument("--hdim", type=int, default=64)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--variants", nargs="*", default=list(ROUND1), choices=list(VARIANTS))
    ap.add_argument("--long-variants", nargs="*", default=["heur"], choices=list(VARIANTS),
                    help="the variants at seqlen >= 1024")
    ap.add_argument("--fwd-variants", nargs="*", default=[], type=fwd_variant_name)
    ap.add_argument("--fwd-max-seqlen", type=int, default=1023, help="the longest cell with --fwd-variants")
    ap.add_argument("--sdpa", nargs="*", default=["flash", "cudnn", "eff"])
    ap.add_argument("--no-fa2", action="store_true")
    ap.add_argument("--no-fwd", action="store_true")
    ap.add_argument("--no-bwd", action="store_true", help="the forward alone (no backward peers compiled or timed)")
    ap.add_argument("--packed", action="store_true", help="also packed qkv fwd+bwd, cuflash vs SDPA (auto)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--b2b", type=int, default=5)
    ap.add_argument("--profile", type=int, default=5, help="calls per peer under torch.profiler (0: none)")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--no-precompile", action="store_true",
                    help="kernels already in CuPy's disk cache (a --compile-only run before): no worker processes")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    t0 = time.time()
    dev = torch.cuda.get_device_name()
    cc = torch.cuda.get_device_capability()
    from cuflash import _gpu

    smem = _gpu.max_smem(0)
    sm90, fa2 = registry.get("sm90_bwd"), registry.get("fa2_bwd")
    cells = [parse_shape(s, args.dtype) for s in args.shapes]

    def plan(dtype, causal, b, s, h):
        p = Problem("bwd", dtype, b, s, s, h, h, args.hdim, causal)
        fam, cfg, src = choose(p, cc, dev, smem)
        heur = cfg if fam.name == "sm90_bwd" else sm90.for_problem(sm90.heuristic(p, cc, smem), p)
        names = args.variants if s < 1024 else args.long_variants
        vs = {}
        for n in names:
            c = variant(n, heur).replace(causal=causal) if n not in ("heur", "w16", "nodqf", "static", "rot") \
                else variant(n, heur)
            bad = c.problems(smem)
            if bad or sm90.for_problem(c, p) != c:
                print(f"# {n} skipped at {b}x{s}x{h}: {bad or 'for_problem changes it'}", flush=True)
                continue
            vs[n] = c
        fcfg = None if args.no_fa2 else fa2.for_problem(fa2.heuristic(p, cc, smem), p)
        pf = p.replace(op="fwd")
        ffam, fwd_cfg, fsrc = choose(pf, cc, dev, smem)
        fvs = {}
        if ffam.name == "sm90_fwd" and s <= args.fwd_max_seqlen:
            for n in args.fwd_variants:
                c = fwd_variant(n, fwd_cfg, s)
                bad = c.problems(smem)
                if bad or ffam.for_problem(c, pf) != c:
                    print(f"# fwd {n} skipped at {b}x{s}x{h}: {bad or 'for_problem changes it'}", flush=True)
                    continue
                if c not in fvs.values() and c != fwd_cfg:
                    fvs[n] = c
        return p, (fam, cfg, src), vs, fcfg, (ffam, fwd_cfg, fsrc), fvs

    todo = []
    plans = {}
    for cell in cells:
        plans[cell] = plan(*cell)
        p, (fam, cfg, src), vs, fcfg, (_, fwd_cfg, _), fvs = plans[cell]
        todo += ([] if args.no_bwd and not args.packed else [cfg, main_bwd(cfg)]) \
            + ([] if args.no_bwd else list(vs.values()) + ([fcfg] if fcfg else [])) \
            + [fwd_cfg, main_fwd(fwd_cfg, p.replace(op="fwd"), cc, smem)] + list(fvs.values())
    todo = list(dict.fromkeys(todo))
    errors = [] if args.no_precompile else [(c.name, e) for c, _, e in precompile(todo) if e]
    assert not errors, errors
    print(f"{dev}  short-sequence attention, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; "
          f"{len(todo)} kernels compiled in {time.time() - t0:.0f} s", flush=True)
    if args.compile_only:
        return
    rows = []

    def kernels_of(what, fns, cell):
        if not args.profile:
            return
        dtype, causal, b, s, h = cell
        for n, ks in kernel_table(fns, args.profile).items():
            tot = sum(us for _, us, _ in ks)
            print(f"  kernels {what} {n:<14} total {tot:8.1f} us: " + "; ".join(
                f"{short(kn)} {us:.1f} us x{cnt:g}" for kn, us, cnt in ks), flush=True)
            rows.append(dict(what=f"{what}_kernels", dtype=dtype, causal=causal, batch=b, seqlen=s, heads=h, peer=n,
                             total_us=tot, kernels=[dict(name=kn, us=us, launches=cnt) for kn, us, cnt in ks]))

    for cell in cells:
        dtype, causal, b, s, h = cell
        tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        d = args.hdim
        p, (fam, cfg, src), vs, fcfg, (ffam, fwd_cfg, fsrc), fvs = plans[cell]
        mb, mf = main_bwd(cfg), main_fwd(fwd_cfg, p.replace(op="fwd"), cc, smem)
        case = f"{dtype} d{d} {'causal' if causal else 'full'} b{b} s{s} h{h}"
        print(f"\n== {case}: bwd default {fam.name} {cfg.name} ({src.split('(')[0].strip()}), main {mb.name}; "
              f"fwd default {fwd_cfg.name}, main {mf.name}; variants "
              f"{', '.join(f'{n}={c.name}' for n, c in {**vs, **fvs}.items())}", flush=True)
        torch.manual_seed(0)
        q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=tdt) for _ in range(4))
        # backward alone
        if not args.no_bwd:
            bw = {"cf": grad_fn(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=causal), q, k, v, dout),
                  "main": grad_fn(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=causal, bwd_config=mb),
                                  q, k, v, dout)}
            for n, c in vs.items():
                bw[f"sm90:{n}"] = grad_fn(lambda q, k, v, c=c: cuflash.flash_attn_func(q, k, v, causal=causal,
                                                                                       bwd_config=c), q, k, v, dout)
            if fcfg is not None:
                bw["fa2_bwd"] = grad_fn(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=causal,
                                                                                bwd_config=fcfg), q, k, v, dout)
            for be in args.sdpa:
                try:
                    fn = grad_fn(sdpa(be, causal), q, k, v, dout)
                    fn()
                    bw[f"sdpa_{be}"] = fn
                except RuntimeError as e:
                    print(f"sdpa_{be}: skipped ({str(e).splitlines()[0][:100]})", flush=True)
            grads = {n: fn() for n, fn in bw.items()}
            torch.cuda.synchronize()
            ref = grads.get("sdpa_flash") or grads.get("sdpa_cudnn") or grads["main"]
            times = time_interleaved(bw, warmup=3, reps=args.reps, back_to_back=args.b2b)
            flops = op_flops(p)
            tref = {n: times[n].median_ms for n in bw if n.startswith("sdpa_")}
            best_sdpa = min(tref.values()) if tref else float("nan")
            print(f"{'bwd ' + case:<40} {'peer':<14} {'ms':>8} {'TFLOPs':>7} {'x main':>6} {'x best sdpa':>11} "
                  f"{'dq diff':>8} {'dkv diff':>8}", flush=True)
            tm = times["main"].median_ms
            for n in bw:
                t = times[n].median_ms
                ddq, dkv = grad_diffs(grads[n], ref)
                flag = "  MISMATCH" if not n.startswith("sdpa") and max(ddq, dkv) > 2e-2 else ""
                label = vs[n[5:]].name if n.startswith("sm90:") else fcfg.name if n == "fa2_bwd" else \
                    cfg.name if n == "cf" else mb.name if n == "main" else n
                print(f"{'bwd ' + case:<40} {n:<14} {t:8.4f} {flops / t / 1e9:7.1f} {t / tm:6.3f} "
                      f"{t / best_sdpa:11.3f} {ddq:8.1e} {dkv:8.1e}  x cf {t / times['cf'].median_ms:6.3f}{flag}",
                      flush=True)
                rows.append(dict(what="bwd", dtype=dtype, causal=causal, batch=b, seqlen=s, heads=h, hdim=d, peer=n,
                                 kernel=label, ms=t, samples=list(times[n].samples), tflops=flops / t / 1e9,
                                 x_main=t / tm, x_best_sdpa=t / best_sdpa, dq_diff=ddq, dkv_diff=dkv,
                                 x_cf=t / times["cf"].median_ms))
            kernels_of("bwd", bw, cell)
            del bw, grads
        # forward alone
        if not args.no_fwd:
            fw = {"cf": lambda: cuflash.flash_attn_func(q, k, v, causal=causal),
                  "main": lambda: cuflash.flash_attn_func(q, k, v, causal=causal, config=mf)}
            for n, c in fvs.items():
                fw[f"sm90:{n}"] = (lambda c=c: cuflash.flash_attn_func(q, k, v, causal=causal, config=c))
            for be in args.sdpa:
                f = sdpa(be, causal)
                try:
                    f(q, k, v)
                    fw[f"sdpa_{be}"] = (lambda f=f: f(q, k, v))
                except RuntimeError:
                    pass
            with torch.no_grad():
                outs = {n: fn() for n, fn in fw.items()}
                times = time_interleaved(fw, warmup=3, reps=args.reps, back_to_back=args.b2b)
            fflops = op_flops(p.replace(op="fwd"))
            tm = times["main"].median_ms
            tref = {n: times[n].median_ms for n in fw if n.startswith("sdpa_")}
            best_sdpa = min(tref.values()) if tref else float("nan")
            for n in fw:
                t = times[n].median_ms
                diff = ((outs[n].float() - outs["main"].float()).abs().max() / outs["main"].float().abs().max()).item()
                label = fvs[n[5:]].name if n.startswith("sm90:") else fwd_cfg.name if n == "cf" else \
                    mf.name if n == "main" else n
                print(f"{'fwd ' + case:<40} {n:<14} {t:8.4f} {fflops / t / 1e9:7.1f} {t / tm:6.3f} "
                      f"{t / best_sdpa:11.3f} {diff:8.1e}  x cf {t / times['cf'].median_ms:6.3f}  {label}",
                      flush=True)
                rows.append(dict(what="fwd", dtype=dtype, causal=causal, batch=b, seqlen=s, heads=h, hdim=d, peer=n,
                                 kernel=label, ms=t, samples=list(times[n].samples), tflops=fflops / t / 1e9,
                                 x_main=t / tm, x_best_sdpa=t / best_sdpa, out_diff=diff,
                                 x_cf=t / times["cf"].median_ms))
            with torch.no_grad():
                kernels_of("fwd", fw, cell)
            del fw, outs
        # packed qkv, forward + backward, as the models' MHA calls it
        if args.packed and s < 1024:
            from cuflash.api import flash_attn_qkvpacked_func

            qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=tdt, requires_grad=True)

            def sdpa_packed():
                qq, kk, vv = (t.transpose(1, 2) for t in qkv.unbind(dim=2))
                return F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal).transpose(1, 2)

            pk = {"cf_packed": lambda: flash_attn_qkvpacked_func(qkv, causal=causal),
                  # main's route before session 30: flash_attn_func on qkv's slices, main's kernels
                  "main_slices": lambda: cuflash.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2],
                                                                 causal=causal, config=mf, bwd_config=mb),
                  "sdpa_packed": sdpa_packed}
            if (mf, mb) != (fwd_cfg, cfg):   # the packed route with main's kernels (session 31's start)
                pk["main_packed"] = lambda: flash_attn_qkvpacked_func(qkv, causal=causal, config=mf, bwd_config=mb)
            nf, nb = fvs.get("bal", fwd_cfg), vs.get("w16", cfg)
            if (nf, nb) != (fwd_cfg, cfg):   # the packed route with the candidate kernels (bal, w16)
                pk["cf_packed_new"] = lambda: flash_attn_qkvpacked_func(qkv, causal=causal, config=nf, bwd_config=nb)
            fb = {n: (lambda fn=fn: torch.autograd.grad(fn(), qkv, dout)) for n, fn in pk.items()}
            g = {n: fn()[0] for n, fn in fb.items()}
            diff = max(((g[n].float() - g["sdpa_packed"].float()).abs().max()
                        / g["sdpa_packed"].float().abs().max()).item() for n in g if n != "sdpa_packed")
            times = time_interleaved(fb, warmup=3, reps=args.reps, back_to_back=args.b2b)
            tm = times["main_slices"].median_ms
            for n in fb:
                t = times[n].median_ms
                print(f"{'fwd+bwd packed ' + case:<40} {n:<14} {t:8.4f} {t / tm:6.3f} "
                      f"{t / times['sdpa_packed'].median_ms:11.3f}  dqkv diff {diff:.1e}", flush=True)
                rows.append(dict(what="fwdbwd_packed", dtype=dtype, causal=causal, batch=b, seqlen=s, heads=h, hdim=d,
                                 peer=n, ms=t, samples=list(times[n].samples), x_main=t / tm,
                                 x_sdpa=t / times["sdpa_packed"].median_ms, dqkv_diff=diff))
            kernels_of("packed", fb, cell)
            del qkv, fb, g
        del q, k, v, dout
        torch.cuda.empty_cache()
    print(f"total {time.time() - t0:.0f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=dev, torch=torch.__version__, cudnn=torch.backends.cudnn.version(),
                           convention="FA: fwd 4 b h s^2 d (/2 causal), bwd 2.5x", rows=rows), f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
