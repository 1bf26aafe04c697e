"""One optuna study per problem class: sampler, resumable storage, bookkeeping, summary.

    family = cuflash.registry.get("fa2_fwd")
    problem = tuning.space.bench_problem(family, "bf16", 128, True, 4096)
    outcome = run_study(family, problem, measure, max_smem=..., storage="tune.journal")
    print(outcome.summary())
    save_entries([outcome.entry(env)], gpu_name, cc)

* Sampler: TPE (seedable) by default; "random"; "brute" enqueues every valid point.
  The heuristic default is always the first trial, so the tuned result is never worse
  than what cuflash runs without tuning (on the tuning shape).
* Margin: the table entry keeps the heuristic unless the best config beats the
  heuristic's measured median by at least ``min_gain`` (default 1%), so timing noise never
  swaps the heuristic for an equal-speed config. The runners-up and the summary still show
  the real best; the entry's ``note`` says that the heuristic was kept and why.
* Confirmation: when the study's own times would replace the heuristic and the measure can
  ``compare`` configs (``GpuMeasure.compare``: the heuristic and the study's fastest few
  re-timed together, interleaved, in a new order each round), the margin rule reads
  those times instead: trials timed minutes apart meet different
  clocks (an H100 under sustained load drifts by a few percent), so a config that only ran
  in a cooler phase does not replace the heuristic. ``StudyOutcome.confirmed`` keeps them.
* Candidates: ``points`` gives the study a fixed list of configs (after the heuristic)
  instead of the sampler's choice: a bounded budget whose kernels can be compiled up front
  (``tuning.space.candidates``; ``cuflash tune --candidates N``).
* Storage: optuna's JournalStorage on a JournalFileBackend file. The study name carries
  the study key (op, family, dtype, head dim, causal, features, bucket), the GPU, the
  family's version and its kernel code hash, so re-running the same command
  resumes: finished trials are kept (and not re-measured), a trial that was RUNNING when
  the process died is marked FAIL and its point queued again, queued points stay queued.
  One tuner process per study at a time.
* The study stops when the trial budget is spent, the time is up, every valid point has
  been measured, or the measurement reports the GPU unusable (``measure.fatal``).
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

from .objective import Objective, TrialResult
from .space import point_key, problem_name, study_key

SAMPLERS = ("tpe", "random", "brute")
RUNNERS_UP = 3
# The best config replaces the heuristic in the tuned table only when it is at least this
# much faster (fraction of the heuristic's time: heuristic_ms / best_ms - 1 >= MIN_GAIN).
MIN_GAIN = 0.01
# Configs re-timed together by the confirmation: the heuristic and the study's fastest few.
CONFIRM_TOP = 2


def open_storage(path):
    """Journal-file storage at ``path`` (created with its folder), or in-memory for None."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    if path is None:
        return optuna.storages.InMemoryStorage()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(path)))


def make_sampler(kind: str = "tpe", seed: Optional[int] = None, n_valid: Optional[int] = None):
    """TPE with a short random start (the spaces are small), random, or brute force.

    Brute force is done by enqueueing every valid point (see ``run_study``); its sampler
    only matters past that, so it is a random one.
    """
    import optuna

    if kind == "tpe":
        startup = 10 if n_valid is None else max(2, min(10, n_valid // 4))
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup)
    if kind in ("random", "brute"):
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"sampler must be one of {SAMPLERS}, got {kind!r}")


def study_name_for(family, problem, gpu_name: str = "", code_hash: str = "") -> str:
    """E.g. fwd_fa2_fwd_bf16_d128_causal_s4096_NVIDIA_H100_80GB_HBM3_v1_78d8ed59: a study of
    other code (family version or kernel code hash) is another study."""
    gpu = "".join(c if c.isalnum() else "_" for c in gpu_name).strip("_")
    version = f"v{family.version}" if code_hash else ""
    return "_".join(p for p in (problem_name(family, problem), gpu, version, code_hash[:8]) if p)


@dataclasses.dataclass
class StudyOutcome:
    """What a study found. ranked: (config, TrialResult) of every measured config, best first."""

    problem: Any            # cuflash.problem.Problem: the benchmark shape
    family: Any             # the registered cuflash family
    study_name: str
    ranked: list
    default_config: Any
    default_result: Optional[TrialResult]
    n_valid: int
    counts: dict            # trial status -> number of trials
    n_trials: int
    wall_s: float
    flops: float
    stopped_because: str = ""
    study: Any = dataclasses.field(default=None, repr=False)   # the optuna study
    min_gain: float = MIN_GAIN   # see choice()
    confirmed: dict = dataclasses.field(default_factory=dict)   # {config: ms} re-timed together

    @property
    def ok(self) -> list:
        return [(c, r) for c, r in self.ranked if r.ok]

    @property
    def best(self):
        """The fastest measured config (what the search found; see ``chosen``)."""
        return self.ok[0][0] if self.ok else None

    @property
    def best_ms(self) -> Optional[float]:
        return self.ok[0][1].median_ms if self.ok else None

    @property
    def heuristic_ms(self) -> Optional[float]:
        """The heuristic's measured median, None when it was not measured or failed."""
        r = self.default_result
        return r.median_ms if r is not None and r.ok else None

    @property
    def heuristic_outside_space(self) -> bool:
        """Whether the heuristic's config has fields outside the tuning space (e.g. a heuristic-only
        switch): its point, made back into a config, is another config. The study measures the
        heuristic itself for that point (Objective.overrides), and a table entry that keeps it is not
        written (``entry``: None): the lookup would build the made config, not the heuristic."""
        d = self.default_config
        return d is not None and self.family.make(self.family.point(d), self.problem) != d

    def gain(self, ms: Optional[float]) -> Optional[float]:
        """How much faster ``ms`` is than the heuristic (0.05: 5%); None without both."""
        base = self.heuristic_ms
        return base / ms - 1 if base and ms else None

    def tflops(self, ms: Optional[float]) -> Optional[float]:
        return self.flops / ms / 1e9 if ms else None

    def choice(self, min_gain: Optional[float] = None):
        """What the tuned table gets: ``(config, median_ms, note)``, or None if nothing ran.

        The best config, unless the heuristic was measured and the best beats it by less
        than ``min_gain`` (a fraction; default the outcome's ``min_gain``): then the
        heuristic, with a note saying why. The note is also set when the best is kept
        although the heuristic has no time (it failed or was not measured)."""
        if not self.ok:
            return None
        min_gain = self.min_gain if min_gain is None else min_gain
        confirmed = self.confirmed_choice(min_gain)
        if confirmed is not None:
            return confirmed
        best, best_ms = self.best, self.best_ms
        if best == self.default_config:
            return best, best_ms, ""
        base = self.heuristic_ms
        if base is None:
            r = self.default_result
            why = (f"heuristic {r.status}" + (f": {r.reason[:80]}" if r.reason else "")
                   if r is not None else "heuristic not measured")
            return best, best_ms, f"best kept ({why})"
        gain = base / best_ms - 1
        if gain >= min_gain:
            return best, best_ms, ""
        return (self.default_config, base,
                f"heuristic kept: best {self.short(best)} is {gain * 100:+.1f}% vs heuristic "
                f"(< min gain {min_gain * 100:.1f}%)")

    def confirmed_choice(self, min_gain: float):
        """``choice()`` from the confirming re-time (``confirmed``), or None without one (or when
        it agrees with the study's own times: then ``choice`` says what it always said)."""
        times = self.confirmed
        base = times.get(self.default_config)
        if base is None or len(times) < 2:
            return None
        top, top_ms = min(times.items(), key=lambda kv: kv[1])
        gain = base / top_ms - 1
        pick = top if top != self.default_config and gain >= min_gain else self.default_config
        study_pick = self._study_choice(min_gain)
        if study_pick == pick:
            return None
        if pick == self.default_config:
            return (pick, base, f"heuristic kept: best {self.short(top)} is {gain * 100:+.1f}% vs "
                                f"heuristic re-timed together (< min gain {min_gain * 100:.1f}%)"
                    if top != pick else f"heuristic kept: the fastest re-timed together with "
                                        f"{', '.join(self.short(c) for c in times if c != pick)}")
        return pick, top_ms, f"{gain * 100:+.1f}% vs heuristic re-timed together"

    def _study_choice(self, min_gain: float):
        """The config ``choice`` picks from the study's own times."""
        best, base = self.best, self.heuristic_ms
        if best == self.default_config or base is None:
            return best
        return best if base / self.best_ms - 1 >= min_gain else self.default_config

    @property
    def chosen(self):
        """The config the tuned table gets (``choice()``'s), None if nothing ran."""
        c = self.choice()
        return c[0] if c else None

    @property
    def key(self) -> tuple:
        """(op, family, dtype, head_dim, causal, features, seqlen bucket): the table key."""
        return study_key(self.family, self.problem)

    @staticmethod
    def short(config) -> str:
        """A config's name without the problem part, e.g. Br128_Bc64_w4_s2."""
        return config.name.split("_", 4)[-1]

    def entry(self, env: dict, min_gain: Optional[float] = None, stamp: Optional[dict] = None):
        """The tuned-table record (a ``cuflash.select.Entry``: chosen config, runners-up,
        stamp, env); None if nothing ran.

        The chosen config is the best one unless the margin rule keeps the heuristic
        (``choice``); the runners-up are the fastest other configs, so with the heuristic
        kept the real best comes first among them, and ``note`` says why. The stamp is the
        code the study measured: ``stamp``, else the env record's family_version and
        code_hash, else ``cuflash.select.current_stamp(family)``."""
        from cuflash.select import Entry, current_stamp

        c = self.choice(min_gain)
        if c is None:
            return None
        chosen, chosen_ms, note = c
        fam = self.family
        if self.heuristic_outside_space and fam.point(chosen) == fam.point(self.default_config):
            return None   # the entry's point would lose the heuristic's other fields: it serves itself
        if stamp is None:
            stamp = ({"version": env.get("family_version", fam.version), "code_hash": env["code_hash"]}
                     if env.get("code_hash") else current_stamp(fam))
        runners = [{"config": fam.point(cfg), "median_ms": r.median_ms,
                    "tflops": self.tflops(r.median_ms)}
                   for cfg, r in self.ok if cfg != chosen][:RUNNERS_UP]
        op, family, dtype, head_dim, causal, features, seqlen = self.key
        return Entry(op=op, family=family, dtype=dtype, head_dim=head_dim, causal=causal,
                     seqlen=seqlen, features=features, config=fam.point(chosen),
                     stamp=dict(stamp), median_ms=chosen_ms, tflops=self.tflops(chosen_ms),
                     runners_up=runners, env=dict(env), note=note)

    def summary(self, top: int = 8) -> str:
        counts = ", ".join(f"{n} {s}" for s, n in sorted(self.counts.items()))
        lines = [f"{self.study_name}: {self.n_trials} trials ({counts}); "
                 f"{len(self.ranked)} of {self.n_valid} valid configs measured in {self.wall_s:.0f} s"
                 + (f"; stopped: {self.stopped_because}" if self.stopped_because else "")]
        lines.append(f"  {'#':>3}  {'config':<44} {'median ms':>10} {'TFLOPs/s':>9} {'vs heuristic':>12}")
        chosen = self.chosen
        for i, (cfg, res) in enumerate(self.ranked[:top], start=1):
            if res.ok:
                g = self.gain(res.median_ms)
                gain = f"{g * 100:+.1f}%" if g is not None else ""
                mark = " (heuristic)" if cfg == self.default_config else ""
                mark += " <- table" if cfg == chosen else ""
                lines.append(f"  {i:>3}  {cfg.name:<44} {res.median_ms:>10.4f} "
                             f"{self.tflops(res.median_ms):>9.1f} {gain:>12}{mark}")
            else:
                lines.append(f"  {i:>3}  {cfg.name:<44} {res.status:>10}  {res.reason[:60]}")
        if len(self.ranked) > top:
            lines.append(f"  ... {len(self.ranked) - top} more")
        if self.confirmed:
            lines.append("  re-timed together: " + ", ".join(
                f"{self.short(c)}{' (heuristic)' if c == self.default_config else ''} {ms:.4f}"
                for c, ms in sorted(self.confirmed.items(), key=lambda kv: kv[1])))
        c = self.choice()
        if c is not None:
            config, ms, note = c
            g = self.gain(ms) if config != self.default_config else None
            lines.append(f"  table entry: {config.name}"
                         + (f" ({g * 100:+.1f}% vs heuristic)" if g is not None else "")
                         + (f"; {note}" if note else ""))
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------

def _point(trial, keys) -> Optional[tuple]:
    params = trial.params or trial.system_attrs.get("fixed_params") or {}
    if set(params) != set(keys):
        return None
    return tuple(params[k] for k in keys)


def _recover(study, storage, keys) -> int:
    """After a killed run: RUNNING trials -> FAIL (marked interrupted), their points queued
    again unless measured or queued already. Returns the number of points queued again."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    settled = {_point(t, keys) for t in trials
               if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.WAITING)}
    requeued = 0
    study_id = storage.get_study_id_from_name(study.study_name)
    for t in trials:
        if t.state != TrialState.RUNNING:
            continue
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        storage.set_trial_user_attr(trial_id, "interrupted", True)
        storage.set_trial_state_values(trial_id, TrialState.FAIL)
        p = _point(t, keys)
        if p is not None and p not in settled:
            study.enqueue_trial(dict(zip(keys, p)), user_attrs={"requeued_from": t.number})
            settled.add(p)
            requeued += 1
    # Points of trials that failed outright (e.g. Ctrl-C) are not lost either.
    for t in trials:
        p = _point(t, keys)
        if t.state == TrialState.FAIL and p is not None and p not in settled:
            study.enqueue_trial(dict(zip(keys, p)), user_attrs={"requeued_from": t.number})
            settled.add(p)
            requeued += 1
    return requeued


def run_study(family, problem, measure, *, max_smem: Optional[int] = None,
              arch=(9, 0), sampler: str = "tpe", n_trials: Optional[int] = None,
              timeout: Optional[float] = None, seed: Optional[int] = None, storage=None,
              study_name: Optional[str] = None, progress: bool = False,
              restrictions: tuple = (), neighbours: bool = True, min_gain: float = MIN_GAIN,
              points: Optional[list] = None, confirm: bool = True, log=print) -> StudyOutcome:
    """Tune one registered ``family`` on ``problem`` (its benchmark shape, e.g. from
    ``tuning.space.bench_problem``). ``measure(config) -> TrialResult`` does the timing.

    sampler: "tpe" (default), "random" or "brute" (every valid point, heuristic first).
    n_trials: the study's total trial budget, counting trials of earlier runs of the same
    study (default: twice the number of valid points); ignored for "brute".
    neighbours: after the heuristic, measure its one-step neighbours before sampling.
    min_gain: the margin (fraction) by which the best must beat the heuristic to replace it
    in the tuned table (``StudyOutcome.choice``).
    points: a fixed list of configs to measure after the heuristic (and nothing else: the
    sampler and n_trials are not used; invalid ones are left out).
    confirm: re-time the heuristic and the fastest CONFIRM_TOP configs together when the
    study's times would replace the heuristic and the measure has ``compare`` (module doc).
    timeout: seconds for this call. storage: a journal file path (resumable) or None
    (in memory). study_name: default from the study key (give it the GPU and code hash
    through ``study_name_for`` to keep studies of different code apart).
    """
    import optuna
    from optuna.trial import TrialState

    t0 = time.perf_counter()
    store = open_storage(storage) if storage is None or isinstance(storage, (str, Path)) else storage
    objective = Objective(family, problem, measure, max_smem, restrictions)
    default = family.heuristic(problem, tuple(arch), max_smem)
    if family.make(family.point(default), problem) != default:
        # the heuristic has fields outside the space (a heuristic-only switch): its point measures
        # the heuristic itself (StudyOutcome.heuristic_outside_space: no entry keeps it)
        objective.overrides[point_key(family, default)] = default
    # the valid points: the whole space's, or (points given) the fixed list's only, so a study of a
    # large space (sm90_fwd: 20k points) does not pay for enumerating what it will not measure
    space = ((objective.config(family.point(c)), None) for c in [default] + list(points)) \
        if points is not None else family.enumerate(problem, max_smem)
    valid = list(dict.fromkeys(cfg for cfg, _ in space if not objective.check(family.point(cfg))[1]))
    valid_points = {point_key(family, c) for c in valid}
    name = study_name or study_name_for(family, problem)
    study = optuna.create_study(storage=store, study_name=name, direction="minimize",
                                sampler=make_sampler(sampler, seed, len(valid)),
                                load_if_exists=True)
    keys = tuple(family.space)
    requeued = _recover(study, store, keys)
    resumed = objective.seed(study.get_trials(deepcopy=False))
    if resumed or requeued:
        log(f"{name}: resuming ({resumed} configs already measured, {requeued} queued again)")

    present = {_point(t, keys) for t in study.get_trials(deepcopy=False)
               if t.state != TrialState.FAIL}
    # The heuristic first, then (unless brute force) its one-step neighbours: a good default
    # is usually one parameter away from the best, and the sampler takes over from there.
    if points is not None:
        queue = [default] + list(points)
    elif sampler == "brute":
        queue = [default] + valid
    elif neighbours:
        queue = [default] + [family.make(p, problem) for p in family.neighbours(default)]
    else:
        queue = [default]
    for cfg in queue:
        p = point_key(family, cfg)
        if p not in present and p in valid_points:
            study.enqueue_trial(family.point(cfg), user_attrs={"heuristic": cfg == default})
            present.add(p)

    trials = study.get_trials(deepcopy=False)
    waiting = sum(t.state == TrialState.WAITING for t in trials)
    finished = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
    if sampler == "brute" or points is not None:
        remaining = waiting
    else:
        budget = n_trials if n_trials is not None else 2 * max(1, len(valid))
        remaining = max(0, budget - finished)

    stopped = {"why": ""}

    def stop_when_done(study, trial):
        fatal = getattr(measure, "fatal", "")
        if fatal:
            stopped["why"] = f"GPU unusable: {fatal}"
            study.stop()
        elif valid_points <= set(objective.memo):
            stopped["why"] = "every valid config measured"
            study.stop()

    if remaining and not valid_points <= set(objective.memo):
        study.optimize(objective, n_trials=remaining, timeout=timeout, catch=(Exception,),
                       callbacks=[stop_when_done], show_progress_bar=progress)
    elif valid_points <= set(objective.memo):
        stopped["why"] = "every valid config measured"

    trials = study.get_trials(deepcopy=False)
    counts = Counter("memo" if "memo_of" in t.user_attrs
                     else t.user_attrs.get("status", t.state.name.lower())
                     for t in trials if t.state != TrialState.WAITING)
    default_hit = objective.memo.get(point_key(family, default))
    outcome = StudyOutcome(problem, family, name, objective.measured(), default,
                           default_hit[1] if default_hit else None, len(valid), dict(counts),
                           sum(t.state != TrialState.WAITING for t in trials),
                           time.perf_counter() - t0, objective.flops, stopped["why"], study,
                           min_gain)
    compare = getattr(measure, "compare", None)
    if (confirm and compare is not None and outcome.heuristic_ms is not None
            and outcome._study_choice(min_gain) != default):
        top = [c for c, _ in outcome.ok if c != default][:CONFIRM_TOP]
        if top:
            try:
                outcome.confirmed = dict(compare([default] + top))
            except Exception as exc:  # noqa: BLE001 - the study's own times still stand
                log(f"{name}: confirmation failed ({exc.__class__.__name__}: {exc}); study times used")
        outcome.wall_s = time.perf_counter() - t0
    return outcome


# ---------------------------------------------------------------------------------------
# records on disk: the replayable trial table and the plots

def trial_records(study, family=None) -> list[dict]:
    out = []
    for t in study.get_trials(deepcopy=False):
        a = t.user_attrs
        params = t.params or t.system_attrs.get("fixed_params") or {}
        out.append({"number": t.number, "state": t.state.name, "params": dict(params),
                    "config": a.get("config"), "status": a.get("status"),
                    "median_ms": a.get("median_ms"), "tflops": a.get("tflops"),
                    "reason": a.get("reason", ""), "compile_s": a.get("compile_s"),
                    "memo_of": a.get("memo_of"), "heuristic": bool(a.get("heuristic")),
                    "extra": a.get("extra", {})})
    return out


TRIALS_FORMAT = 2


def write_trials(path, outcome: StudyOutcome, *, sampler: str, max_smem: Optional[int],
                 gpu: Optional[dict] = None, env: Optional[dict] = None) -> Path:
    """The study as JSON, replayable by ``tuning.replay`` without a GPU.

    Format 2: ``family`` and ``family_version`` name the registered family; ``problem`` is
    the ``cuflash.problem.Problem`` it was timed on (format 1, before the registry, had
    ``problem.kernel`` instead; replay reads both)."""
    p, fam = outcome.problem, outcome.family
    problem = dataclasses.asdict(p)
    problem["features"] = list(p.features)
    doc = {"format": TRIALS_FORMAT, "study": outcome.study_name, "sampler": sampler,
           "family": fam.name, "family_version": fam.version, "key": list(outcome.key),
           "problem": problem, "gpu": gpu or {}, "max_smem": max_smem,
           "space": {k: list(v) for k, v in fam.space.items()},
           "default": fam.point(outcome.default_config), "n_valid": outcome.n_valid,
           "flops": outcome.flops, "wall_s": outcome.wall_s, "env": env or {},
           "confirmed": [{"config": fam.point(c), "name": c.name, "median_ms": ms}
                         for c, ms in outcome.confirmed.items()],
           "trials": trial_records(outcome.study, fam)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=_jsonable))
    return path


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return str(x)


def write_plots(study, out_dir, stem: str, log=print) -> list[Path]:
    """Optimization history and parameter importances (optuna's matplotlib plots), when
    matplotlib is installed and the study has enough finished trials; else nothing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from optuna.visualization import matplotlib as ovm
    except ImportError:
        return []
    import warnings

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for what, plot in (("history", ovm.plot_optimization_history),
                       ("importances", ovm.plot_param_importances)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # optuna marks these plots experimental
                ax = plot(study)
            fig = ax.figure if hasattr(ax, "figure") else plt.gcf()
            fig.set_size_inches(7, 4)
            fig.tight_layout()
            path = out_dir / f"{stem}_{what}.png"
            fig.savefig(path, dpi=100)
            plt.close(fig)
            written.append(path)
        except Exception as exc:  # noqa: BLE001 - e.g. importances need >= 2 complete trials
            log(f"  (no {what} plot for {stem}: {exc.__class__.__name__}: {str(exc)[:100]})")
            plt.close("all")
    return written


__all__ = ["run_study", "StudyOutcome", "MIN_GAIN", "open_storage", "make_sampler", "study_name_for",
           "write_trials", "write_plots", "trial_records", "SAMPLERS"]
