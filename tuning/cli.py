"""``python -m cuflash tune`` and ``python -m cuflash info [--families]`` (wired in
cuflash/__main__.py): ``tune_main(argv) -> int``, ``info_lines()``, ``info_families_lines()``."""
from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

from cuflash.problem import DTYPES, SEQLEN_BUCKETS, TUNE_DTYPES

from .space import OP_NAMES, families_for, problem_name, space_size, tasks
from .study import CONFIRM_TOP, MIN_GAIN

TUNE_HELP = """Tune kernel configs for this GPU and store the winners in the tuned table.

Every registered kernel family of the requested ops that supports the problem on this GPU
is tuned (or only those named by --family). One optuna study per (op, family, dtype, head
dim, causal, features, seqlen bucket), timed on the FlashAttention benchmark shape (heads =
2048/d, batch x seqlen = 16k), back to back as the bench times (--timing flush: single
calls after an L2 flush). Studies are kept in a journal file: re-running the same command
resumes. Each study's trials go to results/<gpu>/tuning/<study>.json (replayable: python -m
cuflash.tuning.replay), plots next to them. The table keeps the heuristic unless the best
config beats it by --min-gain percent, in a re-time of the heuristic and the study's fastest
few together (interleaved, shuffled: --no-confirm skips it).

--candidates N: instead of the sampler, each problem class (family, dtype, head dim, causal)
gets one fixed list (its buckets' heuristics and N configs near them or drawn from the
space: tuning.space.candidates), compiled up front; every study of the class measures it.
A bounded run: the command prints its estimate per study before it starts.
"""


def _csv(kind):
    return lambda s: [kind(x.strip()) for x in s.split(",") if x.strip()]


def tune_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m cuflash tune", description=TUNE_HELP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", type=_csv(str), default=["all"],
                    help=f"ops to tune: {','.join(OP_NAMES)} or all (default all)")
    ap.add_argument("--family", type=_csv(str), default=None,
                    help="only these kernel families (default: every family of the ops that "
                         "supports the problem here; python -m cuflash info --families lists them)")
    ap.add_argument("--dtype", type=_csv(str), default=["bf16", "fp16"],
                    help=f"e.g. bf16,fp16 (any of {','.join(TUNE_DTYPES)}; e4m3: the FP8 forward "
                         "families, verified with cuflash.fp8's error rule, timed with descales)")
    ap.add_argument("--hdim", type=_csv(int), default=[64, 128], help="e.g. 64,128")
    ap.add_argument("--causal", choices=["both", "true", "false"], default="both")
    ap.add_argument("--seqlen", type=_csv(int), default=list(SEQLEN_BUCKETS),
                    help="sequence lengths (bucketed to powers of two 512..16384)")
    ap.add_argument("--trials", type=int, default=None,
                    help="trials per study (default: 2 x the valid configs; TPE stops early "
                         "once every valid config is measured)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds for the whole command; studies not started in time are skipped")
    ap.add_argument("--brute-force", action="store_true", help="measure every valid config")
    ap.add_argument("--sampler", choices=["tpe", "random"], default="tpe")
    ap.add_argument("--storage", default=None,
                    help="optuna journal file (default results/<gpu>/tuning/studies.journal); memory: "
                         "in memory (no resume, no fsync per trial: a short run of many studies)")
    ap.add_argument("--seed", type=int, default=None, help="sampler and input seed")
    ap.add_argument("--table-dir", default=None,
                    help="where the tuned YAML goes (default $CUFLASH_TUNED_DIR or "
                         "~/.cache/cuflash/tuned; tuning/configs to ship it)")
    ap.add_argument("--out", default="results", help="results root (trials JSON, plots)")
    ap.add_argument("--min-gain", type=float, default=100 * MIN_GAIN, metavar="PERCENT",
                    help="the best config replaces the heuristic in the tuned table only when it "
                         "is at least this many percent faster than the heuristic's measured "
                         f"median (default {100 * MIN_GAIN:g}); below that the heuristic is kept "
                         "(timing noise never swaps it for an equal-speed config)")
    ap.add_argument("--reps", type=int, default=20, help="timed samples per config")
    ap.add_argument("--timing", choices=["bench", "flush"], default="bench",
                    help="bench (default): samples of back-to-back calls, as cuflash bench times; "
                         "flush: single calls after an L2 flush (tuning/measure.py: why bench)")
    ap.add_argument("--no-confirm", action="store_true",
                    help="apply the margin to the study's own times (no interleaved re-time of "
                         "the heuristic and the fastest few)")
    ap.add_argument("--candidates", type=int, default=0, metavar="N",
                    help="a fixed list per problem class: its heuristics + N configs "
                         "(tuning.space.candidates), compiled up front; 0 (default): the sampler")
    ap.add_argument("--trial-timeout", type=float, default=60.0, help="seconds per config")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-precompile", action="store_true",
                    help="skip compiling every valid config in parallel before the studies "
                         "(one process per CPU core; afterwards trials load kernels from cache)")
    return ap


def gpu_dir_name(device: int = 0) -> str:
    """results/<this>/: the GPU's name with spaces as underscores (as the benchmarks name it)."""
    from cuflash import _gpu

    return _gpu.name(device).replace(" ", "_")


def _select_families(a):
    """(families, '') or (None, why) from --op and --family."""
    ops = list(OP_NAMES) if "all" in a.op else list(dict.fromkeys(a.op))
    bad = [op for op in ops if op not in OP_NAMES]
    if bad:
        return None, f"--op must be {', '.join(OP_NAMES)} or all, got {bad[0]!r}"
    try:
        fams = families_for(ops, a.family)
    except LookupError as exc:
        return None, f"--family: {exc.args[0]}"
    except ValueError as exc:
        return None, f"--family: {exc} (asked for --op {','.join(ops)})"
    if not fams:
        return None, f"no kernel family is registered for op {', '.join(ops)}"
    return fams, ""


def tune_main(argv=None, log=print) -> int:
    """Returns the exit code: 0 done, 2 cannot tune here (the reason on one line)."""
    a = tune_parser().parse_args(argv)

    def refuse(why: str) -> int:
        log(f"cuflash tune: {why}")
        return 2

    try:
        import optuna
    except ImportError:
        return refuse("optuna is not installed (pip install 'cuflash[tune]')")
    fams, why = _select_families(a)
    if fams is None:
        return refuse(why)
    bad = [d for d in a.dtype if d not in TUNE_DTYPES]
    if bad:
        return refuse(f"--dtype must be among {', '.join(TUNE_DTYPES)}, got {bad}")
    if not 0 <= a.min_gain < 100:
        return refuse(f"--min-gain must be a percentage in [0, 100), got {a.min_gain:g}")
    if a.candidates < 0:
        return refuse(f"--candidates must be >= 0, got {a.candidates}")
    if a.candidates and a.brute_force:
        return refuse("--candidates and --brute-force: choose one")
    from cuflash import _gpu

    reason = _gpu.why_unavailable()
    if reason:
        return refuse(f"no GPU here ({reason})")

    from cuflash.select import file_name

    from . import measure as m
    from .study import run_study, study_name_for, write_plots, write_trials
    from .table import save_entries

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    device = 0
    gpu_name, arch, max_smem = _gpu.name(device), tuple(_gpu.arch(device)), _gpu.max_smem(device)
    causals = {"both": (False, True), "true": (True,), "false": (False,)}[a.causal]
    todo, skipped = tasks(fams, a.dtype, a.hdim, causals, a.seqlen, arch)
    for (fam, why), n in Counter((f, w) for f, _, w in skipped).items():
        log(f"skipped {n} {fam.name} studies: {why}")
    if not todo:
        return refuse("nothing to tune: no requested family supports the requested problems "
                      f"on {gpu_name} (sm_{arch[0]}{arch[1]})")
    out_dir = Path(a.out) / gpu_dir_name(device) / "tuning"
    storage = None if a.storage == "memory" else a.storage or str(out_dir / "studies.journal")
    sampler = "brute" if a.brute_force else "candidates" if a.candidates else a.sampler
    used = list(dict.fromkeys(f for f, _ in todo))
    log(f"cuflash tune on {gpu_name} (sm_{arch[0]}{arch[1]}): {len(todo)} studies of "
        f"{', '.join(f.name for f in used)}; {sampler}; timing {a.timing}; journal {storage or 'in memory'}")
    deadline = time.perf_counter() + a.timeout if a.timeout else None
    t_start = time.perf_counter()
    envs = {f.name: dict(m.env_record(f, device), timing=a.timing) for f in used}
    gpu = {"name": gpu_name, "cc": "%d.%d" % arch}
    points = class_candidates(todo, a.candidates, max_smem, arch, a.seed or 0) if a.candidates else None
    if points is not None:
        log(estimate_lines(todo, points, a.reps, not a.no_confirm))
    if not a.no_precompile:
        _precompile(todo, max_smem, device, log, progress=not a.no_progress,
                    configs=None if points is None else list(dict.fromkeys(
                        c for cands in points.values() for c in cands)))
    rows, written = [], set()
    for i, (fam, p) in enumerate(todo):
        left = None if deadline is None else deadline - time.perf_counter()
        if left is not None and left <= 0:
            log(f"time is up: {len(todo) - i} studies not run")
            break
        env = envs[fam.name]
        measure = m.GpuMeasure(fam, p, device, reps=a.reps, timeout_s=a.trial_timeout, seed=a.seed,
                               timing=a.timing)
        name = study_name_for(fam, p, gpu_name, env["code_hash"])
        log(f"[{i + 1}/{len(todo)}] {name}")
        t_study = time.perf_counter()
        outcome = run_study(fam, p, measure, max_smem=max_smem, arch=arch,
                            sampler="tpe" if sampler == "candidates" else sampler,
                            n_trials=a.trials, timeout=left, seed=a.seed, storage=storage,
                            study_name=name, progress=not a.no_progress,
                            min_gain=a.min_gain / 100, log=log,
                            points=None if points is None else points[class_of(fam, p)],
                            confirm=not a.no_confirm)
        log(f"  ({time.perf_counter() - t_study:.1f} s)")
        log(outcome.summary())
        write_trials(out_dir / f"{name}.json", outcome, sampler=sampler, max_smem=max_smem,
                     gpu=gpu, env=env)
        if not a.no_plots:
            write_plots(outcome.study, out_dir / "plots", name, log=log)
        entry = outcome.entry(env)
        if entry is not None:
            written.add(save_entries([entry], gpu_name, arch, a.table_dir))
        elif outcome.ok and outcome.heuristic_outside_space:
            log(f"  no table entry: the heuristic {outcome.default_config.name} has fields outside the "
                "tuning space (its point would lose them); the heuristic serves this class")
        rows.append(outcome)
        if measure.fatal:
            log(format_table(rows))
            return refuse(f"stopped: {measure.fatal}")
    table = ", ".join(map(str, sorted(written))) or f"(nothing written; would be {file_name(gpu_name, arch)})"
    log(f"\n{len(rows)} studies in {time.perf_counter() - t_start:.0f} s; "
        f"trials in {out_dir}; tuned table {table}")
    log(format_table(rows))
    return 0


def class_of(fam, problem) -> tuple:
    """A study's problem class: its key without the seqlen bucket (candidates are per class)."""
    from .space import study_key

    return study_key(fam, problem)[:-1]


def class_candidates(todo, n: int, max_smem, arch, seed: int = 0) -> dict:
    """{problem class: candidate configs} (tuning.space.candidates) for the studies ``todo``."""
    from .space import candidates

    by_class: dict = {}
    for fam, p in todo:
        by_class.setdefault(class_of(fam, p), (fam, []))[1].append(p)
    return {key: candidates(fam, sorted(ps, key=lambda q: q.bucket), n, max_smem, arch, seed)
            for key, (fam, ps) in by_class.items()}


# Rough rates for the estimate (H100, TFLOP/s in the FlashAttention convention), and the host /
# verification seconds per config and per study; compile seconds per kernel (sm_90a, NVRTC).
EST_TFLOPS = {"fwd": 550.0, "bwd": 420.0, "decode": 50.0}
EST_CONFIG_S, EST_VERIFY_S, EST_COMPILE_S = 0.1, 0.3, 10.0


def estimate_s(fam, problem, n_configs: int, reps: int, confirm: bool, verify: bool = True) -> float:
    """Seconds one study takes on the GPU, roughly: per config a warm-up (>= 50 ms), one probe call
    and ``reps`` samples of back-to-back calls (measure.bench_calls), its first verification in
    the process, and the confirming re-time (where it runs: half the studies, say)."""
    from cuflash.registry import op_flops

    from .measure import bench_calls

    call_ms = op_flops(problem) / (EST_TFLOPS.get(problem.op, 300.0) * 1e9)
    inner = bench_calls(call_ms)
    per = max(0.05, 3 * call_ms / 1e3) + (1 + reps * inner) * call_ms / 1e3 + EST_CONFIG_S
    total = n_configs * (per + (EST_VERIFY_S if verify else 0.0))
    if confirm:   # only where the study would replace the heuristic: counted for half of them
        total += 0.5 * min(n_configs, CONFIRM_TOP + 1) * per
    return total


def estimate_lines(todo, points: dict, reps: int, confirm: bool) -> str:
    """The run's estimate, per study and in total (compile time not counted: printed apart)."""
    import os

    lines, total, verified = [], 0.0, set()
    for fam, p in todo:
        key = class_of(fam, p)
        n = len(points[key])
        t = estimate_s(fam, p, n, reps, confirm, verify=key not in verified)
        verified.add(key)
        total += t
        lines.append(f"  estimate {problem_name(fam, p)}: {n} configs, ~{t:.1f} s")
    kernels = len({c for cands in points.values() for c in cands})
    procs = os.cpu_count() or 1
    lines.append(f"estimate: {len(todo)} studies ~{total:.0f} s of timing; {kernels} kernels to compile "
                 f"(~{kernels * EST_COMPILE_S / procs:.0f} s on {procs} processes, less if cached)")
    return "\n".join(lines)


def _precompile(todo, max_smem, device, log, progress: bool = True, configs=None) -> None:
    """Compile every valid config of every study (or ``configs``) in parallel (fills CuPy's
    disk cache)."""
    from cuflash.compile import precompile

    t0 = time.perf_counter()
    if configs is None:
        configs = list(dict.fromkeys(cfg for fam, p in todo for cfg in fam.valid(p, max_smem)))
    step = max(1, len(configs) // 10)

    def report(done, total, res):
        if progress and (done % step == 0 or done == total):
            log(f"  precompiled {done}/{total} ({time.perf_counter() - t0:.0f} s)")

    results = precompile(configs, device, progress=report)
    failed = sum(1 for _, _, err in results if err)
    log(f"precompiled {len(results)} configs in {time.perf_counter() - t0:.0f} s"
        + (f" ({failed} failed: their trials record the error)" if failed else ""))


def format_table(outcomes) -> str:
    """One line per study: the best config found, its time and its gain over the heuristic,
    and what the tuned table got ("best", or "heuristic" when the margin rule kept it)."""
    lines = [f"{'study':<36} {'best config':<34} {'ms':>8} {'TFLOPs/s':>8} {'vs heuristic':>12}"
             f"  table entry"]
    for o in outcomes:
        name = problem_name(o.family, o.problem)
        if o.best is None:
            lines.append(f"{name:<36} (no config ran: {o.counts})")
            continue
        g = o.gain(o.best_ms)
        gain = f"{g * 100:+.1f}%" if g is not None else "n/a"
        chosen, _, note = o.choice()
        if chosen == o.best:
            what = note or ("best (is the heuristic)" if chosen == o.default_config else "best")
        else:
            what = f"heuristic {o.short(chosen)} (gain < min {o.min_gain * 100:.1f}%)"
        lines.append(f"{name:<36} {o.short(o.best):<34} {o.best_ms:>8.4f} "
                     f"{o.tflops(o.best_ms):>8.1f} {gain:>12}  {what}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# python -m cuflash info

INFO_HEAD_DIMS = (64, 128, 256)


def _stamps() -> dict:
    """{family name: current stamp} of every registered family (no GPU needed)."""
    from cuflash.registry import families
    from cuflash.select import current_stamp

    return {f.name: current_stamp(f) for f in families()}


def _table_line(tf, stamps: dict, this_gpu: str = "", this_cc: str = "") -> str:
    from cuflash.select import stale_reasons

    if tf.error:
        return f"    {tf.path.name}: unusable, it {tf.error}"
    fams = sorted({e.family for e in tf.entries})
    stale = sum(1 for e in tf.entries
                if e.family not in stamps or stale_reasons(e, stamps[e.family]))
    mine = " <- this GPU" if (tf.gpu_name, tf.cc) == (this_gpu, this_cc) else ""
    return (f"    {tf.path.name}: {tf.gpu_name} sm_{tf.cc.replace('.', '')}, "
            f"{len(tf.entries)} entries ({', '.join(fams) or 'none'})"
            + (f", {stale} stale (other code: ignored until re-tuned)" if stale else "")
            + (f", {len(tf.bad_entries)} malformed" if tf.bad_entries else "") + mine)


def info_lines() -> list[str]:
    """The GPU, the tuned tables found (this GPU's marked), and the config in force with its
    source per (op, family, dtype, head dim, causal[, seqlen bucket])."""
    import cuflash
    from cuflash import _gpu
    from cuflash.select import cc_str, read_file, table_dirs

    stamps = _stamps()
    lines = [f"cuflash {cuflash.__version__}; kernel families "
             + ", ".join(f"{n} v{s['version']} code {s['code_hash']}" for n, s in stamps.items())]
    reason = _gpu.why_unavailable()
    name = arch = smem = None
    if not reason:
        name, arch, smem = _gpu.name(), tuple(_gpu.arch()), _gpu.max_smem()
    lines.append("tuned tables (searched in this order; only this GPU's file is read):")
    for d in table_dirs():
        lines.append(f"  {d}{'' if d.is_dir() else ' (absent)'}")
        if d.is_dir():
            for path in sorted(d.glob("*.yaml")):
                lines.append(_table_line(read_file(path), stamps, name or "",
                                         cc_str(arch) if arch else ""))
    if reason:
        lines.append(f"GPU: none ({reason}); the config in force depends on the GPU")
        return lines
    lines.append(f"GPU: {name}, sm_{arch[0]}{arch[1]}, {smem} B shared memory per block")
    lines.append("config in force (op family dtype d causal [seqlen]: config  <- source):")
    lines += config_in_force_lines(name, arch, smem, dtypes=TUNE_DTYPES)
    return lines


def config_in_force_lines(gpu_name: str, arch, max_smem, dirs=None, dtypes=DTYPES,
                          head_dims=INFO_HEAD_DIMS) -> list[str]:
    """What ``cuflash.select.choose`` runs per (op, dtype, head dim, causal): one line when
    every seqlen bucket gets the heuristic, else one line per bucket."""
    from cuflash.problem import Problem
    from cuflash.registry import families
    from cuflash.select import UnsupportedProblem, choose

    lines = []
    for op in OP_NAMES:
        for dtype in dtypes:
            if dtype not in DTYPES and not families(op, dtype):
                continue   # e.g. bwd in e4m3: no family of the op takes it, nothing to say
            for d in head_dims:
                for causal in (False, True):
                    head = f"  {op} {{fam}} {dtype} d={d:<3} causal={causal!s:<5}"
                    per_bucket = []
                    try:
                        for s in SEQLEN_BUCKETS:
                            p = Problem(op, dtype, 1, s, s, 1, 1, d, causal)
                            per_bucket.append((s, *choose(p, arch, gpu_name, max_smem, dirs=dirs)))
                    except UnsupportedProblem as exc:
                        lines.append(head.format(fam="-") + f": unsupported here ({exc})")
                        continue
                    if all(src.startswith("heuristic") for *_, src in per_bucket):
                        _, fam, cfg, src = per_bucket[-1]
                        lines.append(head.format(fam=fam.name) + f": {cfg.name}  <- "
                                     + (src if "skipped" in src else "heuristic"))
                        continue
                    for s, fam, cfg, src in per_bucket:
                        lines.append(head.format(fam=fam.name) + f" s={s:<5}: {cfg.name}  <- {src}")
    return lines


def info_families_lines() -> list[str]:
    """Every registered kernel family: op, archs, version, code hash, space size and what it
    is. Needs no GPU and makes no CUDA call."""
    from cuflash.compile import code_hash
    from cuflash.families.base import Family
    from cuflash.registry import OPS, families

    lines = ["registered kernel families (per op, highest priority first; selection takes the "
             "highest-ranked that runs the call, Family.rank):"]
    for op in OPS:
        fams = families(op)
        lines.append(f"  op {op}: {OPS[op].doc}" + ("" if fams else " (no family)"))
        for fam in fams:
            try:
                h = code_hash(fam.name)
            except OSError as exc:
                h = f"unavailable ({exc.__class__.__name__})"
            major, minor = fam.min_arch
            # arch-specific code (e.g. sm_90a) runs on that one architecture only
            archs = (f"sm_{major}{minor}{fam.arch_suffix} only" if fam.arch_suffix
                     else f"sm_{major}{minor}+")
            dims = " x ".join(f"{k} {len(v)}" for k, v in fam.space.items())
            # a family that ranks itself per problem (Family.rank, e.g. by head dim) is not
            # chosen by its priority alone: say so
            ranked = ", ranked per problem" if type(fam).rank is not Family.rank else ""
            lines.append(f"    {fam.name}: op {fam.op}, {archs}, version {fam.version}, "
                         f"code {h}, priority {fam.priority}{ranked}, space {space_size(fam)} "
                         f"points ({dims})")
            if fam.description:
                lines.append(f"      {fam.description}")
            lines.append(f"      features: {', '.join(supported_features(fam)) or 'none'} (a call "
                         "with another one falls back to a family that has it)")
    return lines


def supported_features(fam) -> list:
    """The Problem.features names (cuflash.api.FEATURES) that ``fam`` runs, each alone (with the
    features the family requires of every call), on its minimum arch (e.g. varlen: fa2_fwd,
    fa2_bwd and sm90_fwd; sm90_bwd only with VARLEN_BWD on, so varlen backwards fall back to
    fa2_bwd on the H100)."""
    from cuflash.api import FEATURES
    from cuflash.problem import Problem

    required = set(getattr(fam, "requires", ()))  # e.g. fa2_fwd_paged: paged, varlen on every call
    return [f for f in sorted(set(FEATURES) | required)
            if not fam.supports(fam.min_arch, Problem(fam.op, "bf16", 1, 128, 128, 1, 1, 64,
                                                      features=tuple(sorted(required | {f}))))]


__all__ = ["tune_main", "tune_parser", "estimate_s", "estimate_lines", "class_candidates", "info_lines", "info_families_lines", "format_table",
           "config_in_force_lines", "gpu_dir_name"]
