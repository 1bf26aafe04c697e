"""The cuflash autotuner (``cuflash.tuning``): optuna search over the configs of every
registered kernel family, tuned tables per GPU. It consumes the library (the family
registry, selection's table format, compilation, timing); the library never imports it.

    space.py      the studies: registry families x problem classes, benchmark shapes
    objective.py  the optuna objective: prune invalid points, memoise, record failures
    measure.py    compile, verify against cuflash.reference, time (one runner per op; GPU)
    study.py      one study per (op, family, dtype, d, causal, features, bucket): TPE / brute
                  force, journal storage, summary, trial records, plots
    table.py      writing tuned YAML tables (reading and lookup: cuflash.select); upgrade_v1
    replay.py     replay samplers against a recorded brute-force study (no GPU)
    fake.py       a deterministic stand-in measurement (CPU tests)
    cli.py        python -m cuflash tune / info

Importing this package imports neither optuna nor CuPy.
"""
from .space import SEQLEN_BUCKETS, bench_problem, problem_name, seqlen_bucket, study_key
from .table import save_entries, upgrade_v1

__all__ = ["save_entries", "upgrade_v1", "bench_problem", "problem_name", "study_key",
           "seqlen_bucket", "SEQLEN_BUCKETS"]
