"""The optuna objective: a suggested point becomes a config, is checked, measured once, scored.

The objective owns no GPU code. Measuring is injected: any ``measure(config) ->
TrialResult`` will do (``tuning.measure.GpuMeasure`` on a GPU, a recorded table in
``tuning.replay``, a deterministic fake in the tests). What the objective adds:

* invalid points never reach ``measure``: they raise ``optuna.TrialPruned`` and the
  reason is kept in the trial's user attrs (optuna's TPE learns from PRUNED trials, not
  from FAIL ones);
* each config is measured once: a repeated suggestion reuses the recorded result
  (``memo_of`` names the trial that measured it);
* a failed measurement (compile error, wrong result, launch failure, timeout) is pruned
  with its status and reason; an exception from ``measure`` itself is caught and recorded
  the same way, so a study never crashes on one bad config.
"""
from __future__ import annotations

import dataclasses
import math
import traceback
from typing import Any, Callable, Optional

from .space import point_key, problems

# Statuses a measurement can end in. "ok" is the only one with a time.
OK = "ok"
INVALID = "invalid"            # breaks a rule of the config (never measured)
COMPILE_ERROR = "compile_error"
WRONG = "wrong"                # verified against cuflash.reference and failed
LAUNCH_ERROR = "launch_error"
TIMEOUT = "timeout"
SKIPPED = "skipped"            # not measured: the GPU context was unusable
ERROR = "error"                # anything else the measurement raised
# Results worth keeping across a resumed run (the rest may succeed in a fresh process).
DURABLE = (OK, COMPILE_ERROR, WRONG, LAUNCH_ERROR, TIMEOUT)


@dataclasses.dataclass
class TrialResult:
    """What measuring one config gave.

    status:    one of the statuses above
    median_ms: median time of one call (status "ok" only)
    reason:    why it is not "ok" (compiler message, error sizes, ...)
    compile_s: seconds spent compiling (None when it was already compiled)
    extra:     small JSON-able facts (registers, spill bytes, max error, samples)
    """

    status: str
    median_ms: Optional[float] = None
    reason: str = ""
    compile_s: Optional[float] = None
    extra: dict = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == OK and self.median_ms is not None and math.isfinite(self.median_ms)

    def attrs(self) -> dict:
        """As optuna user attrs (JSON-able)."""
        return {"status": self.status, "median_ms": self.median_ms, "reason": self.reason[:2000],
                "compile_s": self.compile_s, "extra": dict(self.extra)}

    @classmethod
    def from_attrs(cls, attrs: dict) -> "TrialResult":
        return cls(status=attrs.get("status", ERROR), median_ms=attrs.get("median_ms"),
                   reason=attrs.get("reason", ""), compile_s=attrs.get("compile_s"),
                   extra=dict(attrs.get("extra") or {}))


Measure = Callable[[Any], TrialResult]


class Objective:
    """``objective(trial) -> median ms`` for one registered family and its benchmark problem.

    memo maps a point (tuple in space order) to (trial number, TrialResult) of the trial
    that measured it; ``seed(trials)`` refills it from a stored study when resuming.
    restrictions: extra ``config -> reason or None`` predicates beyond ``config.problems``.
    """

    def __init__(self, family, problem, measure: Measure,
                 max_smem: Optional[int] = None, restrictions: tuple = ()):
        self.family, self.problem, self.measure = family, problem, measure
        self.max_smem, self.restrictions = max_smem, tuple(restrictions)
        self.memo: dict[tuple, tuple[int, TrialResult]] = {}
        self.flops = family.flops(problem)
        # point (space order) -> the config measured for it instead of family.make's: the heuristic,
        # whose fields outside the space a point cannot carry (run_study)
        self.overrides: dict[tuple, Any] = {}

    # -- the point -> config step, shared with the study's bookkeeping --------------------
    def config(self, params: dict):
        if self.overrides:
            key = tuple(params.get(k) for k in self.family.space)
            if key in self.overrides:
                return self.overrides[key]
        return self.family.make(params, self.problem)

    def check(self, params: dict):
        """(config, reasons): reasons is empty when the point may be measured."""
        try:
            cfg = self.config(params)
            return cfg, problems(cfg, self.max_smem, self.restrictions)
        except Exception as exc:  # noqa: BLE001 - a constructor may refuse a point outright
            return None, [f"{exc.__class__.__name__}: {exc}"]

    def tflops(self, median_ms: Optional[float]) -> Optional[float]:
        return self.flops / median_ms / 1e9 if median_ms else None

    def seed(self, trials) -> int:
        """Fill the memo from finished trials of an earlier run; returns how many."""
        n = 0
        for t in trials:
            attrs = t.user_attrs
            if t.state.name not in ("COMPLETE", "PRUNED") or "memo_of" in attrs:
                continue
            if attrs.get("status") not in DURABLE or set(t.params) != set(self.family.space):
                continue
            key = tuple(t.params[k] for k in self.family.space)
            if key not in self.memo:
                self.memo[key] = (t.number, TrialResult.from_attrs(attrs))
                n += 1
        return n

    def measured(self) -> list[tuple[Any, TrialResult]]:
        """(config, result) of every distinct config measured so far, fastest first."""
        out = [(self.config(dict(zip(self.family.space, key))), res)
               for key, (_, res) in self.memo.items()]
        return sorted(out, key=lambda cr: (not cr[1].ok, cr[1].median_ms or math.inf))

    # -- the objective -------------------------------------------------------------------
    def __call__(self, trial) -> float:
        import optuna

        params = {k: trial.suggest_categorical(k, list(v)) for k, v in self.family.space.items()}
        cfg, why = self.check(params)
        if why:
            trial.set_user_attr("status", INVALID)
            trial.set_user_attr("reason", "; ".join(why))
            raise optuna.TrialPruned(f"invalid: {'; '.join(why)}")
        trial.set_user_attr("config", cfg.name)
        key = point_key(self.family, cfg)
        if key in self.memo:
            number, result = self.memo[key]
            trial.set_user_attr("memo_of", number)
        else:
            result = self._measure(cfg)
            self.memo[key] = (trial.number, result)
        for name, value in result.attrs().items():
            trial.set_user_attr(name, value)
        trial.set_user_attr("tflops", self.tflops(result.median_ms) if result.ok else None)
        if not result.ok:
            raise optuna.TrialPruned(f"{result.status}: {result.reason[:300]}")
        return result.median_ms

    def _measure(self, cfg) -> TrialResult:
        try:
            result = self.measure(cfg)
        except Exception as exc:  # noqa: BLE001 - one bad config must not end the study
            tb = traceback.format_exc(limit=3)
            return TrialResult(ERROR, reason=f"{exc.__class__.__name__}: {exc}\n{tb}")
        if not isinstance(result, TrialResult):
            return TrialResult(ERROR, reason=f"measure returned {type(result).__name__}, "
                                             "not a TrialResult")
        return result
