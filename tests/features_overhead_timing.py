"""What window, softcap, ALiBi and dropout cost over the plain call on an H100 (issue 12's targets:
window 1024 at 8k <= 1.15x its visible fraction of the plain call; softcap, ALiBi and dropout 0.1
<= 1.10x the plain call, forward and forward + backward). Not a test; about a minute with the
compiles:

    timeout 300 python tests/features_overhead_timing.py --out /tmp/features_overhead.json
    python tests/features_overhead_timing.py --precompile     # only fill the kernel cache
    python tests/features_overhead_timing.py --precompile --tests-only   # tests/test_features_opt_gpu.py's
    timeout 60 python tests/features_overhead_timing.py --quick   # causal, QUICK's candidates (~30 s)
    python tests/features_overhead_timing.py --precompile --quick --mask both   # its kernels and
    timeout 120 python tests/features_overhead_timing.py --quick --mask both    # the default tests
    timeout 60 python tests/features_overhead_timing.py --heuristic-only --quick --mask both  # defaults only

Shape: bf16, d128, batch 2 x 16 heads x seqlen 8k (bench --mode features'), causal and not.
Rows per mask, every one timed in the same process, samples interleaved
(cuflash.timing.time_interleaved: CUDA events, warm-up, median):
  * plain: the plain call as selection runs it (tuned entry or heuristic), and SDPA cuDNN's
    plain call (SDPA takes none of the features);
  * window (1024, 0) causal / (1024, 1024) not, softcap 30, ALiBi ((nheads,) slopes), dropout 0.1:
    for every
    candidate forward config of fwd_candidates (the heuristic's first, then the variants the
    heuristic's module constants choose between: sm90_fwd FEATURE_TILES, FEATURE_LAZY_RESCALE,
    SOFTCAP_FOLD), the forward alone and forward + backward (torch autograd, the
    backward by selection: sm90_bwd's heuristic); for the window also forward + backward with
    the backward variants of bwd_candidates (the heuristic forward);
  * --bwd-pass: the backward alone (torch.autograd.grad of one forward's output, retained), per
    forward + backward row, so a feature's forward + backward splits into its two halves.
Columns: ms, x plain (the feature call over the plain call of the same pass), x cuDNN (over SDPA
cuDNN's plain call of the same pass) and, for the window, x visible: x plain over the window's
visible fraction of the plain call's score elements (cuflash.band.visible_fraction). The
heuristic's own row is marked '*'.
"""
import argparse
import json
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]  # the checkout (and the tests' helpers)

from cuflash import registry  # noqa: E402
from cuflash.band import visible_fraction  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

BATCH, SEQLEN, HEADS, HEAD_DIM, DTYPE = 2, 8192, 16, 128, "bf16"
CAP = 30.0
WINDOW = {True: (1024, 0), False: (1024, 1024)}
DROPOUT_P = 0.1
FEATURES = ("window", "softcap", "alibi", "dropout")
MAX_SMEM = 227 * 1024


def problem(feature, causal, seqlen=SEQLEN):
    """The forward Problem of one (feature, mask); feature None is the plain call."""
    p = Problem("fwd", DTYPE, BATCH, seqlen, seqlen, HEADS, HEADS, HEAD_DIM, causal)
    if feature == "window":
        return p.replace(features=("window",), window=WINDOW[causal])
    if feature == "softcap":
        return p.replace(features=("softcap",), softcap=CAP)
    if feature == "alibi":
        return p.replace(features=("alibi",))
    if feature == "dropout":
        return p.replace(features=("dropout",))
    return p


# --quick: the heuristic and these candidates (by feature), and QUICK_BWD's backward variants of
# the window (causal only unless --mask says otherwise)
# (session 16 round A measured emu1 / 2 (then with fold_cap 4), alin_lazy, dpk* slower than or equal to the
# heuristic)
QUICK = {"window": ("prev", "static_tmao", "tov"),
         "softcap": (),
         "alibi": ("alin_bn160_tmao",),
         "dropout": ()}
QUICK_BWD = ("bwd_dqt", "bwd_dqt2", "bwd_dqt0")


def fwd_candidates(feature, causal, seqlen=SEQLEN, quick=False, only_heuristic=False):
    """[(key, label, config)] of one feature and mask: the heuristic's config first, then the
    variants (skipped when they break a rule, e.g. a spill-prone pair); quick: QUICK's only."""
    fam = registry.get("sm90_fwd")
    p = problem(feature, causal, seqlen)
    heur = fam.for_problem(fam.heuristic(p), p)
    base = heur.replace(dynamic=False, tma_store=False, lazy_rescale=False, fold_cap=0)
    dyn = dict(persistent=True, dynamic=True, tma_store=True)
    if feature == "window":
        base = base.replace(BN=128, persistent=True, tile_overlap=False)   # window_tiles' shape, static schedule
        tov = heur.replace(persistent=True, dynamic=True, tma_store=True, tile_overlap=True)
        variants = [("static", base),
                    ("dyn_tmao", base.replace(**dyn)),
                    ("dyn_tmao_lazy", base.replace(**dyn, lazy_rescale=True)),
                    ("dyn_lazy", base.replace(persistent=True, dynamic=True, lazy_rescale=True)),
                    # BN 64 (the band's edges still on block boundaries; 17 blocks per Q block, the
                    # masked two of them narrower)
                    ("dyn_tmao_bn64", base.replace(BN=64, **dyn)),
                    # 3 consumer warpgroups, BM 192 (BN 64: the 3-consumer register budget): the
                    # tile's fixed costs (Q load, the first S without a P V beside it, the epilogue)
                    # over 1.5x the rows, for 19 key blocks of 64 where BM 128 visits 9 of 128
                    ("c3_bn64_dyn_tmao", base.replace(BM=192, consumers=3, BN=64, **dyn)),
                    # one consumer warpgroup, BM 64: half the band's edge triangles (the computed
                    # share of a Q block's 9 blocks: 1.06x the visible keys, 1.12x at BM 128), no
                    # second warpgroup to overlap with
                    ("c1_bm64_dyn_tmao", base.replace(BM=64, consumers=1, pingpong=False, **dyn)),
                    # a window's tiles are short (9 K/V blocks at BN 128): two Q buffers, so a tile's
                    # first S does not wait for its Q after the last tile's (q_double); the softmax
                    # step with shorter chains, so a block's first ex2 issues sooner (tree_max)
                    ("q2", heur.replace(q_double=True, tile_overlap=False)),
                    ("tree", heur.replace(tree_max=True, tile_overlap=False)),
                    # the next tile's S_0 issued behind the last P V (tile_overlap, session 21), on the
                    # dynamic + TMA-store schedule (the heuristic's before it), without the TMA store, and
                    # static; "prev" / "static_tmao": those schedules without it
                    ("prev", tov.replace(tile_overlap=False)),
                    ("static_tmao", tov.replace(tile_overlap=False, dynamic=False)),
                    ("tov", tov),
                    ("tov_notmao", tov.replace(tma_store=False)),
                    ("tov_static", tov.replace(dynamic=False)),
                    ("tov_static_notmao", tov.replace(dynamic=False, tma_store=False)),
                    # and with two Q buffers (the next tile's Q loads under the current tile, so its S_0
                    # behind the last P V does not wait for it)
                    ("tov_q2", tov.replace(q_double=True)),
                    ("tov_q2_notmao", tov.replace(q_double=True, tma_store=False)),
                    # three K/V stages (fits without the TMA store's staging tiles)
                    ("tov_s3_notmao", tov.replace(stages=3, tma_store=False))]
    elif feature == "softcap":
        base = base.replace(BN=176, persistent=False, emu_exp2=0)   # the shipped softcap tile
        lazy3 = dict(fold_cap=3, lazy_rescale=True)
        variants = [("bn176", base),
                    ("fold1", base.replace(fold_cap=1)),
                    ("fold1_lazy", base.replace(fold_cap=1, lazy_rescale=True)),
                    ("fold2_lazy", base.replace(fold_cap=2, lazy_rescale=True)),
                    ("fold3_lazy", base.replace(**lazy3)),
                    ("fold3_lazy_dyn", base.replace(persistent=True, dynamic=True, **lazy3)),
                    ("fold3_lazy_dyn_tmao_bn144", base.replace(BN=144, **dyn, **lazy3)),
                    ("fold3_lazy_dyn_tmao_bn128", base.replace(BN=128, **dyn, **lazy3))]
        # (fold_cap 4, Q prescaled by softcap_in, is refused since session 19: its LSE is not the
        # backward's; tests/softcap_fixed_timing.py times it under sm90_fwd.FOLD4_TIMING)
        # the folded step's exp2s of 1 / 2 quarters of S's tiles on the FMA pipes (emu_exp2 with
        # fold_cap: softmax_fold.cuh), the SFU's share of a score from two ops to 1.75 / 1.5
        variants += [("emu1", heur.replace(emu_exp2=1)), ("emu2", heur.replace(emu_exp2=2))]
    # (BN 160 with fold_cap 3 + dynamic + TMA store spills 88 bytes: nvcc 13.0)
    elif feature == "dropout":
        # drop_packed (the keep mask on P's packed fragments: dropout_packed.cuh; the heuristic's at
        # d128 since session 16 round A, where "dpk" was measured against the fp32 form), at BN 192
        # (DROPOUT_PACKED_BN) and with the TMA-store epilogue (BN 160: no spill with it)
        variants = [("dpk", heur.replace(drop_packed=True)),
                    ("dpk_bn192", heur.replace(drop_packed=True, BN=192, drop_early=0)),
                    ("dpk_tmao", heur.replace(drop_packed=True, BN=160, tma_store=True))]
    elif feature == "alibi":
        base = base.replace(BN=176, persistent=False)
        variants = [("bn176", base),
                    ("dyn", base.replace(persistent=True, dynamic=True)),
                    ("dyn_lazy", base.replace(persistent=True, dynamic=True, lazy_rescale=True)),
                    ("dyn_tmao_lazy_bn144", base.replace(BN=144, lazy_rescale=True, **dyn)),
                    # ALiBi's bias as one FFMA per score (alibi_lin, softmax_fold.cuh AlibiLinear)
                    ("alin", heur.replace(alibi_lin=True)),   # the heuristic's tile (causal: dynamic)
                    ("dyn_alin", base.replace(persistent=True, dynamic=True, alibi_lin=True)),
                    # alibi_lin with lazy_rescale, and at the plain call's BN 160 with the TMA store
                    # (non-causal: the causal kernel spills 8 bytes, nvcc 13.0)
                    ("alin_lazy", heur.replace(alibi_lin=True, lazy_rescale=True))]
        if not causal:
            variants.append(("alin_bn160_tmao", heur.replace(alibi_lin=True, BN=160, tma_store=True)))
    # (BN 160, the plain call's tile, with ALiBi + dynamic + TMA store spills 8 bytes: nvcc 13.0)
    else:
        variants = []
    out, seen = [("heuristic", "heuristic", heur)], {heur}
    if only_heuristic:
        return out
    if quick:
        variants = [(k, c) for k, c in variants if k in QUICK.get(feature, ())]
    for key, cfg in variants:
        cfg = fam.for_problem(cfg, p)
        if cfg in seen or cfg.problems(MAX_SMEM):
            continue
        seen.add(cfg)
        out.append((key, key, cfg))
    return out


def bwd_candidates(feature, causal, seqlen=SEQLEN, quick=False, only_heuristic=False):
    """[(key, config)] of backward variants timed in the forward + backward pass next to the
    backward's heuristic (window only: its backward dominates its forward + backward)."""
    if feature != "window" or only_heuristic:
        return []
    fam = registry.get("sm90_bwd")
    p = problem(feature, causal, seqlen).replace(op="bwd")
    heur = fam.for_problem(fam.heuristic(p), p)
    out = []
    for key, kw in (("bwd_prev", dict(dq_first=False, wide_epi=False)),   # (the heuristic's before session 21)
                    ("bwd_dqb", dict(dq_writer=False, dq_bulk=True, dynamic=False)),
                    ("bwd_s2", dict(stages=2, dynamic=False)),
                    ("bwd_s3", dict(stages=3, dynamic=False)), ("bwd_s3_ovl", dict(stages=3, overlap_sdp=True, dynamic=False)),
                    ("bwd_s3_ds2", dict(stages=3, ds_double=True, dynamic=False)),
                    ("bwd_dyn", dict(stages=2, dynamic=True)),      # (sm90_bwd WINDOW_BWD's)
                    ("bwd_dyn_ovl", dict(stages=2, dynamic=True, overlap_sdp=True)),
                    ("bwd_dyn_ds2", dict(stages=2, dynamic=True, ds_double=True)),
                    # dq_first (the accumulator zeroed in the main kernel, not by the preprocess: session 21)
                    ("bwd_dqf", dict(dq_first=True, wide_epi=False)),
                    # the 16-byte dK / dV epilogue stores (wide_epi, MHA: this shape), alone and with dq_first
                    ("bwd_w16", dict(wide_epi=True, dq_first=False)),
                    ("bwd_dqf_w16", dict(dq_first=True, wide_epi=True)),
                    # and the dQ convert inside the main kernel (dq_convert: no third launch)
                    ("bwd_dqf_w16_dqc", dict(dq_first=True, wide_epi=True, dq_convert=True)),
                    # the dQ convert a programmatic dependent of the main kernel, converting the pairs done on the
                    # SMs the grid's end leaves idle (dq_tail: session 31)
                    ("bwd_dqt", dict(dq_tail=1)), ("bwd_dqt2", dict(dq_tail=2)),
                    ("bwd_dqt0", dict(dq_tail=0))):   # (without it, where the heuristic has it)
        if quick and key not in QUICK_BWD:
            continue
        cfg = fam.for_problem(heur.replace(**kw), p)
        if cfg != heur and not cfg.problems(MAX_SMEM):
            out.append((key, cfg))
    return out


def masks_of(mask, quick):
    """The causal flags a run times: --mask, else causal only with --quick, else both."""
    return {"causal": (True,), "full": (False,), "both": (True, False)}[mask or ("causal" if quick else "both")]


def all_configs(seqlen=SEQLEN, quick=False, mask=None, only_heuristic=False, features=FEATURES, bwd=True,
                fwd_heuristic=False):
    """Every kernel this script launches (forward candidates, selection's plain forward and the
    backward of each feature), for precompile."""
    from cuflash import _gpu, select

    arch, smem, name = _gpu.arch(), _gpu.max_smem(), _gpu.name()
    cfgs = []
    for causal in masks_of(mask, quick):
        for feature in (None,) + tuple(features):
            p = problem(feature, causal, seqlen)
            cfgs += [c for _, _, c in fwd_candidates(feature, causal, seqlen, quick, only_heuristic or fwd_heuristic)]
            if bwd:
                cfgs += [c for _, c in bwd_candidates(feature, causal, seqlen, quick, only_heuristic)]
            cfgs.append(select.choose(p, arch, name, smem)[1])
            if bwd:
                cfgs.append(select.choose(p.replace(op="bwd"), arch, name, smem)[1])
    return list(dict.fromkeys(cfgs))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seqlen", type=int, default=SEQLEN)
    ap.add_argument("--out", default="", help="write the rows as JSON here")
    ap.add_argument("--precompile", action="store_true", help="compile every kernel and stop")
    ap.add_argument("--no-bwd", action="store_true", help="forward rows only")
    ap.add_argument("--bwd-pass", action="store_true",
                    help="also time the backward alone (one retained forward per forward + backward row)")
    ap.add_argument("--tests-only", action="store_true",
                    help="with --precompile: only tests/test_features_opt_gpu.py's kernels")
    ap.add_argument("--heuristic-only", action="store_true",
                    help="time the heuristic's configs only (no candidates): the shipped defaults")
    ap.add_argument("--fwd-heuristic", action="store_true",
                    help="the forward's heuristic only (the backward's candidates as --quick / not)")
    ap.add_argument("--features", default=",".join(FEATURES),
                    help=f"comma-separated features to time (default: all of {','.join(FEATURES)})")
    ap.add_argument("--mask", choices=("causal", "full", "both"), default=None,
                    help="the masks to time (default: both; causal with --quick)")
    ap.add_argument("--quick", action="store_true",
                    help="causal only, the heuristic and QUICK's candidates (about 30 s with the compiles)")
    args = ap.parse_args()
    features = tuple(f for f in args.features.split(",") if f)
    unknown = [f for f in features if f not in FEATURES]
    if unknown:
        ap.error(f"--features: unknown {unknown}; known: {FEATURES}")

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash
    from cuflash.compile import precompile
    from cuflash.timing import time_interleaved

    import test_alibi_linear_gpu as alin_test
    import test_feature_defaults_gpu as defaults_test
    import test_features_opt_gpu as gpu_test

    # the GPU tests' kernels: the shipped defaults' and alibi_lin's files, and (not with --quick) the
    # variants' file
    tests = defaults_test.all_test_configs() + alin_test.all_test_configs() \
        + ([] if args.quick else gpu_test.all_test_configs())
    if args.precompile and args.tests_only:
        cfgs = tests
    elif args.precompile:
        cfgs = list(dict.fromkeys(all_configs(args.seqlen, args.quick, args.mask, args.heuristic_only, features,
                                              not args.no_bwd, args.fwd_heuristic) + tests))
    else:
        cfgs = all_configs(args.seqlen, args.quick, args.mask, args.heuristic_only, features, not args.no_bwd,
                           args.fwd_heuristic)
    failed = [(c.name, e) for c, _, e in precompile(cfgs) if e]
    print(f"compiled {len(cfgs)} kernels; failed: {failed}")
    assert not failed, failed
    if args.precompile:
        return

    b, s, h, d = BATCH, args.seqlen, HEADS, HEAD_DIM
    rows = []
    print(f"{'mask':<7} {'pass':<7} {'feature':<8} {'candidate':<22} {'ms':>8} {'x plain':>8} "
          f"{'x cuDNN':>8} {'x visible':>9}  config")
    for causal in masks_of(args.mask, args.quick):
        mask = "causal" if causal else "full"
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        dout = torch.randn_like(q)
        slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], device="cuda",
                              dtype=torch.float32)
        kwargs = {None: {}, "window": dict(window_size=WINDOW[causal]), "softcap": dict(softcap=CAP),
                  "alibi": dict(alibi_slopes=slopes), "dropout": dict(dropout_p=DROPOUT_P)}
        vis = visible_fraction(s, s, causal, WINDOW[causal])
        entries = {"plain": (None, "selection", None)}
        bwd_entries = {}     # forward + backward only: the heuristic forward, a backward variant
        for feature in features:
            for key, label, cfg in fwd_candidates(feature, causal, s, args.quick,
                                                  args.heuristic_only or args.fwd_heuristic):
                entries[f"{feature}:{key}"] = (feature, label, cfg)
            for key, bcfg in bwd_candidates(feature, causal, s, args.quick, args.heuristic_only):
                bwd_entries[f"{feature}:{key}"] = (feature, key, bcfg)

        def fwd_fn(feature, cfg):
            kw = kwargs[feature]
            return lambda: cuflash.flash_attn_func(q, k, v, causal=causal, config=cfg, **kw)

        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def sdpa():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        passes = [("fwd", {name: fwd_fn(f, c) for name, (f, _, c) in entries.items()}, sdpa)]
        if not args.no_bwd:
            qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
            qgt, kgt, vgt = (x.transpose(1, 2) for x in (qg, kg, vg))

            def fwdbwd_fn(feature, cfg, bcfg=None):
                kw = kwargs[feature]

                def fn():
                    out = cuflash.flash_attn_func(qg, kg, vg, causal=causal, config=cfg, bwd_config=bcfg, **kw)
                    out.backward(dout)
                return fn

            def sdpa_fwdbwd():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    out = F.scaled_dot_product_attention(qgt, kgt, vgt, is_causal=causal)
                out.backward(dout.transpose(1, 2))

            fns = {name: fwdbwd_fn(f, c) for name, (f, _, c) in entries.items()}
            fns.update({name: fwdbwd_fn(f, None, b) for name, (f, _, b) in bwd_entries.items()})
            passes.append(("fwdbwd", fns, sdpa_fwdbwd))
            if args.bwd_pass:
                # the backward alone: one forward each, its graph retained, then grad() repeatedly
                # (dropout's backward regenerates the forward's mask from the saved RNG state)
                def bwd_fn(feature, cfg, bcfg=None):
                    out = cuflash.flash_attn_func(qg, kg, vg, causal=causal, config=cfg, bwd_config=bcfg,
                                                  **kwargs[feature])
                    return lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True)

                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    sdpa_out = F.scaled_dot_product_attention(qgt, kgt, vgt, is_causal=causal)
                dout_t = dout.transpose(1, 2)
                bfns = {name: bwd_fn(f, c) for name, (f, _, c) in entries.items()}
                bfns.update({name: bwd_fn(f, None, b) for name, (f, _, b) in bwd_entries.items()})
                passes.append(("bwd", bfns, lambda: torch.autograd.grad(sdpa_out, (qgt, kgt, vgt), dout_t,
                                                                         retain_graph=True)))
        for pass_name, fns, sdpa_fn in passes:
            fns = dict(fns, sdpa_cudnn=sdpa_fn)
            for name, fn in fns.items():   # compile / plan outside the timing; fail loudly here
                fn()
            torch.cuda.synchronize()
            times = time_interleaved(fns, reps=args.reps, back_to_back=3)
            plain, cudnn = times["plain"].median_ms, times["sdpa_cudnn"].median_ms
            for name, t in times.items():
                feature, label, cfg = entries.get(name) or bwd_entries.get(name) \
                    or (None, "SDPA cuDNN (plain)", None)
                x_plain = t.median_ms / plain
                x_vis = x_plain / vis if feature == "window" else None
                mark = "*" if label == "heuristic" else " "
                cname = cfg.name if cfg is not None else ""
                print(f"{mask:<7} {pass_name:<7} {feature or '':<8} {label + mark:<22} {t.median_ms:8.3f} "
                      f"{x_plain:8.3f} {t.median_ms / cudnn:8.3f} "
                      f"{'' if x_vis is None else f'{x_vis:9.3f}':>9}  {cname}")
                rows.append(dict(mask=mask, causal=causal, pass_=pass_name, feature=feature or "plain",
                                 candidate=name, label=label, config=cname, median_ms=t.median_ms,
                                 spread=t.spread, x_plain=x_plain, x_cudnn=t.median_ms / cudnn,
                                 visible_fraction=vis if feature == "window" else None,
                                 x_visible=x_vis))
    if args.out:
        env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   cudnn=torch.backends.cudnn.version(), cuflash=cuflash.__version__)
        shape = dict(batch=b, seqlen=s, heads=h, head_dim=d, dtype=DTYPE, softcap=CAP,
                     window={"causal": WINDOW[True], "full": WINDOW[False]})
        with open(args.out, "w") as f:
            json.dump(dict(env=env, shape=shape, rows=rows), f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
