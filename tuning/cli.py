"""``python -m cuflash tune`` and ``python -m cuflash info`` (wired in cuflash/__main__.py)."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from .space import KERNELS, SEQLEN_BUCKETS, Problem, families
from .study import MIN_GAIN

TUNE_HELP = """Tune kernel configs for this GPU and store the winners in the tuned table.

One optuna study per (kernel, dtype, head dim, causal, seqlen bucket), timed on the
FlashAttention benchmark shape (heads = 2048/d, batch x seqlen = 16k). Studies are kept
in a journal file: re-running the same command resumes. Each study's trials go to
results/<gpu>/tuning/<study>.json (replayable: python -m tuning.replay), plots next to them.
The table keeps the heuristic unless the best config beats it by --min-gain percent.
"""


def _csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x.strip()]


def tune_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m cuflash tune", description=TUNE_HELP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", choices=["fwd", "bwd", "all"], default="all")
    ap.add_argument("--dtype", type=_csv(str), default=["bf16", "fp16"], help="e.g. bf16,fp16")
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
                    help="optuna journal file (default results/<gpu>/tuning/studies.journal)")
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
    ap.add_argument("--trial-timeout", type=float, default=60.0, help="seconds per config")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-precompile", action="store_true",
                    help="skip compiling every valid config in parallel before the studies "
                         "(one process per CPU core; afterwards trials load kernels from cache)")
    return ap


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
    from cuflash import _gpu
    from cuflash.bench import gpu_dir_name

    reason = _gpu.why_unavailable()
    if reason:
        return refuse(f"no GPU here ({reason})")
    fams = families()
    kernels = list(KERNELS) if a.kernel == "all" else [a.kernel]
    missing = [k for k in kernels if k not in fams]
    if a.kernel != "all" and missing:
        return refuse(f"the {missing[0]} kernel is not in this cuflash yet")
    kernels = [k for k in kernels if k in fams]
    bad = [d for d in a.dtype if d not in ("bf16", "fp16")]
    if bad:
        return refuse(f"--dtype must be bf16 and/or fp16, got {bad}")
    if not 0 <= a.min_gain < 100:
        return refuse(f"--min-gain must be a percentage in [0, 100), got {a.min_gain:g}")

    from . import measure as m
    from .study import run_study, study_name_for, write_plots, write_trials
    from .table import save_entries

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    device = 0
    gpu_name, arch, max_smem = _gpu.name(device), _gpu.arch(device), _gpu.max_smem(device)
    out_dir = Path(a.out) / gpu_dir_name(device) / "tuning"
    storage = a.storage or str(out_dir / "studies.journal")
    causals = {"both": (False, True), "true": (True,), "false": (False,)}[a.causal]
    seqlens = sorted({Problem.fa_convention("fwd", "bf16", 64, False, s).seqlen for s in a.seqlen})
    sampler = "brute" if a.brute_force else a.sampler
    log(f"cuflash tune on {gpu_name} (sm_{arch[0]}{arch[1]}), {sampler}, journal {storage}")
    deadline = time.perf_counter() + a.timeout if a.timeout else None
    t_start = time.perf_counter()
    rows, written = [], set()
    envs = {k: m.env_record(fams[k], device) for k in kernels}
    todo = [Problem.fa_convention(k, dt, d, c, s) for k in kernels for dt in a.dtype
            for d in a.hdim for c in causals for s in seqlens]
    gpu = {"name": gpu_name, "cc": "%d.%d" % arch}
    if not a.no_precompile:
        from cuflash.kernels import precompile

        t0 = time.perf_counter()
        configs = [cfg for p in todo
                   for cfg in fams[p.kernel].valid(p.head_dim, p.dtype, p.causal, max_smem)]
        results = precompile(configs, device)
        failed = sum(1 for _, _, err in results if err)
        log(f"precompiled {len(results)} configs in {time.perf_counter() - t0:.0f} s"
            + (f" ({failed} failed: their trials record the error)" if failed else ""))
    for i, p in enumerate(todo):
        left = None if deadline is None else deadline - time.perf_counter()
        if left is not None and left <= 0:
            log(f"time is up: {len(todo) - i} studies not run")
            break
        fam, env = fams[p.kernel], envs[p.kernel]
        measure = m.GpuMeasure(fam, p, device, reps=a.reps, timeout_s=a.trial_timeout, seed=a.seed)
        name = study_name_for(p, gpu_name, env["source_hash"])
        log(f"[{i + 1}/{len(todo)}] {name}")
        outcome = run_study(fam, p, measure, max_smem=max_smem, arch=arch, sampler=sampler,
                            n_trials=a.trials, timeout=left, seed=a.seed, storage=storage,
                            study_name=name, progress=not a.no_progress,
                            min_gain=a.min_gain / 100, log=log)
        log(outcome.summary())
        write_trials(out_dir / f"{name}.json", outcome, sampler=sampler, max_smem=max_smem,
                     gpu=gpu, env=env)
        if not a.no_plots:
            write_plots(outcome.study, out_dir / "plots", name, log=log)
        entry = outcome.entry(env)
        if entry is not None:
            written.add(save_entries([entry], gpu_name, arch, a.table_dir))
        rows.append(outcome)
        if measure.fatal:
            log(format_table(rows))
            return refuse(f"stopped: {measure.fatal}")
    log(f"\n{len(rows)} studies in {time.perf_counter() - t_start:.0f} s; "
        f"trials in {out_dir}; tuned table {', '.join(map(str, sorted(written))) or '(nothing)'}")
    log(format_table(rows))
    return 0


def format_table(outcomes) -> str:
    """One line per study: the best config found, its time and its gain over the heuristic,
    and what the tuned table got ("best", or "heuristic" when the margin rule kept it)."""
    lines = [f"{'problem':<28} {'best config':<34} {'ms':>8} {'TFLOPs/s':>8} {'vs heuristic':>12}"
             f"  table entry"]
    for o in outcomes:
        if o.best is None:
            lines.append(f"{o.problem.name:<28} (no config ran: {o.counts})")
            continue
        g = o.gain(o.best_ms)
        gain = f"{g * 100:+.1f}%" if g is not None else "n/a"
        chosen, _, note = o.choice()
        if chosen == o.best:
            what = note or ("best (is the heuristic)" if chosen == o.default_config else "best")
        else:
            what = f"heuristic {o.short(chosen)} (gain < min {o.min_gain * 100:.1f}%)"
        lines.append(f"{o.problem.name:<28} {o.short(o.best):<34} {o.best_ms:>8.4f} "
                     f"{o.tflops(o.best_ms):>8.1f} {gain:>12}  {what}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------

def info_lines() -> list[str]:
    """The GPU, the tuned tables found, and the config in force per problem class."""
    import cuflash
    from cuflash import _gpu
    from cuflash.kernels import source_hash

    from .table import choose, table_dirs, table_files

    fams = families()
    hashes = []
    for k, fam in fams.items():
        try:
            hashes.append(f"{fam.source} {source_hash(fam.source)}")
        except OSError:
            hashes.append(f"{fam.source} (source missing)")
    lines = [f"cuflash {cuflash.__version__}, kernel source {', '.join(hashes)}"]
    lines.append("tuned tables (searched in this order):")
    for d in table_dirs():
        files = table_files([d])
        lines.append(f"  {d}{'' if d.is_dir() else ' (absent)'}")
        for tf in files:
            if tf.error:
                lines.append(f"    {tf.path.name}: unusable, it {tf.error}")
            else:
                kinds = sorted({e.kernel for e in tf.entries})
                lines.append(f"    {tf.path.name}: {tf.gpu_name} sm_{tf.cc.replace('.', '')}, "
                             f"{len(tf.entries)} entries ({', '.join(kinds) or 'none'})"
                             + (f", {len(tf.bad_entries)} malformed" if tf.bad_entries else ""))
    reason = _gpu.why_unavailable()
    if reason:
        lines.append(f"GPU: none ({reason}); the config in force depends on the GPU")
        return lines
    name, arch, smem = _gpu.name(), _gpu.arch(), _gpu.max_smem()
    lines.append(f"GPU: {name}, sm_{arch[0]}{arch[1]}, {smem} B shared memory per block")
    lines.append("config in force (kernel dtype d causal [seqlen]: config  <- source):")
    for kernel in fams:
        for dtype in ("bf16", "fp16"):
            for d in (64, 128, 256):
                for causal in (False, True):
                    head = f"  {kernel} {dtype} d={d:<3} causal={causal!s:<5}"
                    per_bucket = [(s, *choose(kernel, d, dtype, causal, s, gpu_name=name, cc=arch,
                                              max_smem=smem)) for s in SEQLEN_BUCKETS]
                    if all(src.startswith("heuristic") for _, _, src in per_bucket):
                        cfg, src = per_bucket[-1][1], per_bucket[-1][2]
                        lines.append(f"{head}: {cfg.name}  <- "
                                     + (src if "skipped" in src else "heuristic"))
                        continue
                    for s, cfg, src in per_bucket:
                        lines.append(f"{head} s={s:<5}: {cfg.name}  <- {src}")
    return lines
