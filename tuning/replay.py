"""Replay a sampler against a recorded study, without a GPU (Kernel Tuner's simulation mode).

Every tuning study is written to ``results/<gpu>/tuning/<study>.json`` (``write_trials``).
A brute-force study holds a time (or a failure) for every valid config; replaying runs a
fresh optuna study whose measurements are looked up in that table, through the same
objective as a real run (invalid points pruned, repeats memoised, the heuristic first),
and counts how many configs it had to measure to come within ``tol`` of the best.

    python -m cuflash.tuning.replay results/<gpu>/tuning/<study>.json --sampler tpe --seeds 5

Recorded studies of both trial formats are read: format 2 names the registered family
(``family``) and the ``cuflash.problem.Problem`` timed; format 1 (before the registry)
had ``problem: {kernel: fwd|bwd, dtype, head_dim, causal, seqlen, batch, nheads}``, read as
the FA2 family of that op.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Optional

from .objective import SKIPPED, Objective, TrialResult
from cuflash.problem import Problem
from cuflash.registry import get

from .space import point_key

V1_FAMILIES = {"fwd": "fa2_fwd", "bwd": "fa2_bwd", "flash_fwd": "fa2_fwd", "flash_bwd": "fa2_bwd"}


def recorded_problem(doc: dict):
    """(family, Problem) of a recorded study, trial format 1 or 2."""
    p = dict(doc["problem"])
    if "kernel" in p:  # format 1
        family = get(V1_FAMILIES.get(p["kernel"], p["kernel"]))
        s, h = int(p["seqlen"]), int(p["nheads"])
        return family, Problem(family.op, p["dtype"], int(p["batch"]), s, s, h, h,
                               int(p["head_dim"]), bool(p["causal"]))
    family = get(doc.get("family") or p.pop("family"))
    p["features"] = tuple(p.get("features") or ())
    p.pop("family", None)
    return family, Problem(**p)


class Recorded:
    """A recorded study as a ``measure``: config -> the TrialResult it got on the GPU."""

    def __init__(self, doc: dict):
        if not isinstance(doc, dict) or not {"problem", "space", "trials"} <= set(doc):
            raise ValueError("not a recorded study (expected the JSON that tuning.study.write_trials writes)")
        self.doc = doc
        self.family, self.problem = recorded_problem(doc)
        self.keys = tuple(self.family.space)
        if list(doc["space"]) != list(self.keys):
            raise ValueError(f"recorded space {list(doc['space'])} is not the current "
                             f"{self.family.name} space {list(self.keys)}")
        self.results: dict[tuple, TrialResult] = {}
        for t in doc["trials"]:
            params, status = t.get("params") or {}, t.get("status")
            if set(params) != set(self.keys) or status in (None, "invalid") or t.get("memo_of") is not None:
                continue
            key = tuple(params[k] for k in self.keys)
            self.results.setdefault(key, TrialResult(status, t.get("median_ms"), t.get("reason", "")))
        self.calls = 0

    @classmethod
    def load(cls, path) -> "Recorded":
        return cls(json.loads(Path(path).read_text()))

    @property
    def best_ms(self) -> float:
        return min((r.median_ms for r in self.results.values() if r.ok), default=math.inf)

    def __call__(self, config) -> TrialResult:
        self.calls += 1
        res = self.results.get(point_key(self.family, config))
        return res if res is not None else TrialResult(SKIPPED, reason="not in the recorded table")


def replay(table: Recorded, sampler: str = "tpe", seed: int = 0, tol: float = 0.02,
           max_trials: Optional[int] = None, enqueue_default: bool = True,
           neighbours: bool = True) -> dict:
    """One replayed search. Returns measured (distinct configs timed, the GPU's cost),
    trials (optuna trials, invalid and repeated suggestions included) and found_ms at the
    moment the best so far came within ``tol`` of the table's best; None if it never did
    within ``max_trials`` (default 20 x the table's size)."""
    import optuna

    from .study import make_sampler

    fam, p = table.family, table.problem
    max_smem = table.doc.get("max_smem")
    objective = Objective(fam, p, table, max_smem)
    n_valid = sum(1 for cfg, why in fam.enumerate(p, max_smem) if not why)
    target = table.best_ms * (1 + tol)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="minimize", sampler=make_sampler(sampler, seed, n_valid))
    if enqueue_default and table.doc.get("default"):
        default = dict(table.doc["default"])
        study.enqueue_trial(default)
        if neighbours:  # as run_study does: the heuristic's one-step neighbours next
            for point in fam.neighbours(fam.make(default, p)):
                study.enqueue_trial(point)
    hit: dict = {}

    def reached(study, trial):
        best = min((r.median_ms for _, r in objective.memo.values() if r.ok), default=math.inf)
        if best <= target and not hit:
            hit.update(measured=len(objective.memo), trials=trial.number + 1, found_ms=best)
            study.stop()
        elif len(objective.memo) >= len(table.results):
            study.stop()

    study.optimize(objective, n_trials=max_trials or 20 * max(1, len(table.results)),
                   callbacks=[reached])
    return {"seed": seed, "measured": hit.get("measured"), "trials": hit.get("trials"),
            "found_ms": hit.get("found_ms"), "best_ms": table.best_ms, "n_valid": n_valid}


def search_efficiency(table_path, sampler: str = "tpe", seeds: int = 5, tol: float = 0.02,
                      bar: float = 0.20, enqueue_default: bool = True,
                      neighbours: bool = True) -> dict:
    """Average replay cost over ``seeds`` seeds (0 .. seeds-1).

    enqueue_default=False leaves out the heuristic's head start (the sampler alone).
    Returns per-seed results plus mean_measured, mean_trials, mean_fraction (measured
    configs / valid configs) and meets_bar (mean_fraction <= bar, the issue's 20%).
    A seed that never reached the target counts as having measured the whole table.
    """
    table = Recorded.load(table_path)
    if not math.isfinite(table.best_ms):
        raise ValueError(f"{table_path}: no successful measurement to replay against")
    runs = [replay(table, sampler, seed, tol, enqueue_default=enqueue_default, neighbours=neighbours)
            for seed in range(seeds)]
    n_valid = runs[0]["n_valid"]
    measured = [r["measured"] if r["measured"] is not None else len(table.results) for r in runs]
    trials = [r["trials"] for r in runs if r["trials"] is not None]
    frac = statistics.mean(measured) / max(1, n_valid)
    return {"table": str(table_path), "sampler": sampler, "seeds": seeds, "tol": tol,
            "n_valid": n_valid, "recorded": len(table.results), "best_ms": table.best_ms,
            "runs": runs, "mean_measured": statistics.mean(measured),
            "mean_trials": statistics.mean(trials) if trials else None,
            "mean_fraction": frac, "meets_bar": frac <= bar, "heuristic_first": enqueue_default,
            "neighbours": enqueue_default and neighbours}


def format_efficiency(res: dict) -> str:
    per_seed = ", ".join(str(r["measured"]) for r in res["runs"])
    start = "" if res.get("heuristic_first", True) else " (no heuristic first)"
    return (f"{Path(res['table']).name}: {res['sampler']}{start} over {res['seeds']} seeds reaches "
            f"within {res['tol'] * 100:.0f}% of the best ({res['best_ms']:.4f} ms) after "
            f"{res['mean_measured']:.1f} measured configs on average ({per_seed}) = "
            f"{res['mean_fraction'] * 100:.0f}% of {res['n_valid']} valid; "
            f"{'meets' if res['meets_bar'] else 'misses'} the 20% bar")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cuflash.tuning.replay", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tables", nargs="+", help="recorded study JSON (results/<gpu>/tuning/*.json)")
    ap.add_argument("--sampler", default="tpe,random", help="comma list of tpe, random")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--tol", type=float, default=0.02)
    ap.add_argument("--no-heuristic", action="store_true",
                    help="do not start from the heuristic default (measure the sampler alone)")
    ap.add_argument("--no-neighbours", action="store_true",
                    help="do not measure the heuristic's one-step neighbours before sampling")
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args(argv)
    results = []
    for path in a.tables:
        for sampler in a.sampler.split(","):
            try:
                res = search_efficiency(path, sampler.strip(), a.seeds, a.tol,
                                        enqueue_default=not a.no_heuristic,
                                        neighbours=not a.no_neighbours)
            except (OSError, ValueError, KeyError) as exc:
                print(f"{path}: {exc}")
                return 2
            results.append(res)
            print(format_efficiency(res))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
