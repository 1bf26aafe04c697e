"""Benchmarks against torch SDPA, one module per mode; numbers and ratio tables, no verdicts.

    python -m cuflash bench --mode MODE [MODE ...] [options]

Modes (results in results/<gpu name>/):
  fwd       forward of every registered fwd family vs SDPA flash and cuDNN (TFLOPs):
            bench_fwd.{json,csv,png}
  fwdbwd    backward alone and forward + backward of every bwd family vs SDPA flash and
            cuDNN: bench_fwdbwd.{json,csv,png}
  memory    peak memory of forward + backward vs SDPA flash, cuDNN and math (batch 1, 16
            heads, d 128, causal, seqlen 1k..64k): memory.{json,csv,png}
  tuned     each family's tuned configs vs its heuristic vs SDPA, interleaved:
            bench_tuned.{json,csv,png}
  overhead  host µs per call on a tiny problem (torch fwd, torch fwd+bwd, CuPy fwd) and one
            eager call's wall time, vs SDPA flash and cuDNN: overhead.json
  startup   first call in fresh processes (CuPy kernel cache warm and cold) vs SDPA's first
            call: the causal call, window, softcap, ALiBi, dropout, varlen, kvcache and the
            causal forward + backward: startup.json
  io        the FlashAttention paper's IO table (GFLOPs, HBM bytes by ncu, runtime) for
            standard attention, SDPA flash and cuflash: io_table.{json,md}
  features  sliding window 1024 at 8k (causal and not), softcap, ALiBi, dropout 0.1 and varlen
            (mixed lengths vs the padded call), fwd and fwd+bwd, vs the same call without the
            feature and vs SDPA where it has the feature: features.{json,csv}; the table gives
            the window's cost over its visible fraction
  dropout   dropout_p 0.1 vs the same call without, cuflash and SDPA flash, fwd and fwd+bwd
            at seqlen 8k (--seqlens to change), d 64 and 128: bench_dropout.{json,csv}
  ring      context parallelism: cuflash.distributed ring attention, one process per GPU
            (NCCL), vs single-GPU cuflash on the same shard and torch's context parallel,
            seqlen 256k .. 1M: results/<gpu name>x<P>/ring.{json,csv}
  all       fwd, fwdbwd, memory, overhead, startup (not tuned, io, features, ring, dropout)

Shapes follow the FlashAttention convention (heads = 2048 / head dim, batch · seqlen = 16k),
FLOPs cuflash.registry.op_flops (4·b·h·s²·d, ÷2 causal, ×2.5 backward); all timing is
cuflash.timing (CUDA events; samples of 10 back-to-back calls unless --flush-l2), the
implementations' samples interleaved in one process on the same inputs. Every mode raises
cuflash.NoGPUError without a GPU. Each mode module documents its records.
"""
from __future__ import annotations

import argparse
import importlib
import time

from .common import HDIMS, SEQLENS, gpu_dir_name  # noqa: F401 - gpu_dir_name: tuning/cli.py

MODES = ("fwd", "fwdbwd", "memory", "tuned", "overhead", "startup", "io", "features", "ring",
         "dropout", "decode")
ALL = ("fwd", "fwdbwd", "memory", "overhead", "startup")


def parser() -> argparse.ArgumentParser:
    from ..registry import OPS

    ap = argparse.ArgumentParser(prog="python -m cuflash bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", nargs="+", default=["fwd"], choices=list(MODES) + ["all"])
    ap.add_argument("--hdims", type=int, nargs="+", default=list(HDIMS),
                    help="fwd, fwdbwd, tuned (default 64 128 256)")
    ap.add_argument("--seqlens", type=int, nargs="+", default=list(SEQLENS),
                    help="fwd, fwdbwd, tuned (default 512 .. 16384)")
    ap.add_argument("--dtypes", nargs="+", default=["bf16"], choices=["bf16", "fp16"],
                    help="fwd, fwdbwd, tuned (default bf16)")
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both",
                    help="fwd, fwdbwd, tuned (default both)")
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS),
                    help="tuned: the ops to compare (default all)")
    ap.add_argument("--deterministic", action="store_true",
                    help="fwdbwd: also time each family's deterministic backward")
    ap.add_argument("--reps", type=int, default=None,
                    help="samples per timing (fwd, tuned 20; fwdbwd, io 10; overhead's eager calls 20)")
    ap.add_argument("--flush-l2", action="store_true",
                    help="fwd, fwdbwd, tuned: single-call samples after an L2 flush instead of "
                         "10 back-to-back calls")
    ap.add_argument("--mem-seqlens", type=int, nargs="+", default=None,
                    help="memory (default 1024 .. 65536)")
    ap.add_argument("--calls", type=int, default=2000, help="overhead: calls per host timing")
    ap.add_argument("--repeats", type=int, default=3, help="startup: children per case")
    ap.add_argument("--startup-calls", nargs="+", default=None,
                    help="startup: calls (default causal window softcap alibi dropout varlen "
                         "kvcache causal_fwdbwd; also mix deterministic varlen_mix)")
    ap.add_argument("--startup-warmup", default=None, metavar="ARGS",
                    help="startup: fill the warm cache by python -m cuflash warmup ARGS (one string) "
                         "instead of one throwaway child per call; its wall time is recorded")
    ap.add_argument("--jobs", type=int, default=1,
                    help="startup: children at a time (default 1; more shortens the run and "
                         "shares the host between the timed children)")
    ap.add_argument("--io-seqlens", type=int, nargs="+", default=None,
                    help="io: seqlens of the growth table (default 1024 .. 16384)")
    ap.add_argument("--io-causal", action="store_true", help="io: causal mask (default none)")
    ap.add_argument("--no-ncu", action="store_true", help="io: skip the HBM bytes (ncu)")
    ap.add_argument("--fp8", action="store_true",
                    help="fwd: also the FP8 (e4m3) families on the same problems (next to cuDNN bf16)")
    ap.add_argument("--decode-batches", type=int, nargs="+", default=None,
                    help="decode (default 1 8 32 64)")
    ap.add_argument("--decode-ctxs", type=int, nargs="+", default=None,
                    help="decode (default 8192 32768 65536 131072)")
    ap.add_argument("--feature-hdims", type=int, nargs="+", default=[128],
                    help="features: head dims (default 128)")
    ap.add_argument("--feature-seqlens", type=int, nargs="+", default=[8192],
                    help="features: seqlens (default 8192)")
    ap.add_argument("--feature-cases", nargs="+", default=None,
                    help="features: cases (default window1024_causal window1024 softcap30_causal "
                         "alibi_causal dropout0.1_causal varlen_causal; also softcap30 alibi "
                         "dropout0.1 varlen, not causal)")
    ap.add_argument("--out", default="results", help="results root (default results)")
    ap.add_argument("--ring-seqlens", type=int, nargs="+", default=None,
                    help="ring: total seqlens (default 262144 524288 1048576)")
    ap.add_argument("--ring-procs", type=int, default=None,
                    help="ring: processes = GPUs (default every visible GPU)")
    ap.add_argument("--ring-heads", type=int, default=8, help="ring: heads (default 8, d 128)")
    ap.add_argument("--ring-budget-s", type=float, default=270.0,
                    help="ring: skip problems that would end the run past this (default 270 s)")
    ap.add_argument("--ring-cp-backends", nargs="+", choices=("flash", "cudnn"),
                    default=["flash", "cudnn"],
                    help="ring: SDPA backends run under torch's context_parallel (default both)")
    ap.add_argument("--ring-full-max", type=int, default=262144,
                    help="ring: largest seqlen also run whole on one GPU (default 262144)")
    ap.add_argument("--no-torch-cp", action="store_true",
                    help="ring: skip torch's context_parallel")
    ap.add_argument("--ring-breakdown", action="store_true",
                    help="ring: per-step breakdown (compute, merge / accumulate, exposed waits) "
                         "from one traced forward + backward per problem")
    ap.add_argument("--ring-ab", nargs="+", default=[], type=_ring_variant,
                    help="ring: also time the ring with something changed, per variant: one of "
                         "early_send (cuflash.distributed.EARLY_SEND flipped), nccl_priority "
                         "(a second NCCL group with high-priority streams), nccl_ctasN (one whose "
                         "NCCL kernels take at most N CTAs), split_q, reverse_bwd, fwd_dyn, "
                         "lib_priority, dkv_home, bwd_lowmem, dq_ws, home_lazy "
                         "(cuflash.distributed.SPLIT_Q, REVERSE_BWD, FWD_DYNAMIC, PRIORITY_GROUP, "
                         "DKV_HOME, BWD_LOW_MEMORY, DQ_IN_WORKSPACE, HOME_LAZY_FP32 flipped), "
                         "lib_ctasN (RING_MAX_CTAS = N), fwd_gridN "
                         "(FWD_GRID_STEPS = N), fwd_fullgridN (FWD_FULL_GRID_STEPS = N), "
                         "bwd_groupsN, fwd_groupsN (BWD_HEAD_GROUPS, FWD_HEAD_GROUPS = N), "
                         "rotate (the ring order rotated by "
                         "one rank), "
                         "or several joined by '+' (bench/ring.py AB_VARIANTS)")
    ap.add_argument("--ring-set", type=_ring_variant, default=None,
                    help="ring: run everything with this variant (a --ring-ab name; 'none' or "
                         "'' for as is); the records say ring_set")
    ap.add_argument("--ring-ab-max", type=int, default=None,
                    help="ring: run --ring-ab only at seqlens up to this (default every seqlen)")
    ap.add_argument("--ring-ab-seqlens", type=int, nargs="+", default=None,
                    help="ring: run --ring-ab only at these seqlens (default every seqlen)")
    ap.add_argument("--ring-ab-causal", choices=("yes", "no", "both"), default="both",
                    help="ring: run --ring-ab only with this mask (default both)")
    ap.add_argument("--ring-rotate", type=int, default=0,
                    help="ring: process (= ring rank) r runs on GPU (r + this) %% P (default 0), "
                         "to tell a slow GPU from a slow ring position")
    ap.add_argument("--ring-light-from", type=int, default=524288,
                    help="ring: seqlens above run light (1 repetition, no transfer-free runs, "
                         "torch CP on cuDNN only; default 524288)")
    return ap


def _ring_variant(name: str) -> str:
    """--ring-ab's type: a variant name bench/ring.py knows (argparse reports a ValueError)."""
    from .ring import parse_variant

    if name in ("", "none"):  # --ring-set none: as is
        return ""
    parse_variant(name)
    return name


def modes_of(selected) -> list:
    """The modes to run, in MODES order ('all' expands to ALL)."""
    want = set(selected)
    if "all" in want:
        want |= set(ALL)
    return [m for m in MODES if m in want]


def run_mode(mode: str, a) -> object:
    mod = importlib.import_module(f"{__name__}.{mode}")
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[a.causal]
    common = dict(hdims=a.hdims, seqlens=a.seqlens, dtypes=a.dtypes, causals=causals, out=a.out,
                  flush_l2=a.flush_l2)
    if mode == "fwd":
        return mod.run(reps=a.reps or 20, fp8=a.fp8, **common)
    if mode == "fwdbwd":
        return mod.run(reps=a.reps or 10, deterministic=a.deterministic, **common)
    if mode == "tuned":
        return mod.run(reps=a.reps or 20, ops=a.ops, **common)
    if mode == "memory":
        return mod.run(seqlens=a.mem_seqlens or mod.SEQLENS, out=a.out)
    if mode == "overhead":
        return mod.run(calls=a.calls, eager_reps=a.reps or 20, out=a.out)
    if mode == "startup":
        import shlex

        return mod.run(repeats=a.repeats, out=a.out, calls=tuple(a.startup_calls or mod.DEFAULT_CALLS),
                       jobs=a.jobs, warmup_args=None if a.startup_warmup is None else shlex.split(a.startup_warmup))
    if mode == "io":
        return mod.run(growth_seqlens=a.io_seqlens or mod.GROWTH_SEQLENS, causal=a.io_causal,
                       use_ncu=not a.no_ncu, reps=a.reps or 10, out=a.out)
    if mode == "features":
        return mod.run(hdims=a.feature_hdims, seqlens=a.feature_seqlens, dtypes=a.dtypes,
                       cases=tuple(a.feature_cases or mod.DEFAULT_CASES), out=a.out, reps=a.reps or 10,
                       flush_l2=a.flush_l2)
    if mode == "ring":
        return mod.run(seqlens=a.ring_seqlens or mod.SEQLENS,
                       causals=tuple(sorted(causals, reverse=True)), procs=a.ring_procs,
                       nheads=a.ring_heads, reps=a.reps or 3, budget_s=a.ring_budget_s,
                       torch_cp=not a.no_torch_cp, full_max=a.ring_full_max, out=a.out,
                       cp_backends=a.ring_cp_backends, breakdown=a.ring_breakdown,
                       light_from=a.ring_light_from, ab=a.ring_ab, ab_max=a.ring_ab_max,
                       rotate=a.ring_rotate, ring_set=a.ring_set, ab_seqlens=a.ring_ab_seqlens,
                       ab_causals={"both": (True, False), "yes": (True,),
                                   "no": (False,)}[a.ring_ab_causal])
    if mode == "decode":
        return mod.run(batches=a.decode_batches or mod.BATCHES, ctxs=a.decode_ctxs or mod.CTXS,
                       reps=a.reps or 10, out=a.out)
    if mode == "dropout":
        seqlens = a.seqlens if a.seqlens != list(SEQLENS) else (8192,)
        hdims = a.hdims if a.hdims != list(HDIMS) else (64, 128)
        return mod.run(hdims=hdims, seqlens=seqlens, dtypes=a.dtypes, causals=causals, out=a.out,
                       reps=a.reps or 10, flush_l2=a.flush_l2)
    raise ValueError(f"unknown mode {mode!r}")


def main(argv=None) -> int:
    """Run the selected modes; 0 when done. cuflash.NoGPUError propagates (no GPU)."""
    a = parser().parse_args(argv)
    for mode in modes_of(a.mode):
        t0 = time.perf_counter()
        run_mode(mode, a)
        print(f"bench {mode}: {time.perf_counter() - t0:.0f} s", flush=True)
    return 0
