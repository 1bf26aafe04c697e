"""The cuflash autotuner: optuna search over kernel configs, tuned tables per GPU.

    space.py      kernel families (search space as data, restrictions = config rules)
    objective.py  the optuna objective: prune invalid points, memoise, record failures
    measure.py    compile, verify against cuflash.reference, time with CUDA events (GPU)
    study.py      one study per problem: TPE / brute force, journal storage, summary
    table.py      tuned YAML tables and the lookup cuflash.config_for uses
    replay.py     replay samplers against a recorded brute-force table (no GPU)
    cli.py        python -m cuflash tune / info

Importing this package imports neither optuna nor CuPy.
"""
from .space import SEQLEN_BUCKETS, Family, Problem, families, get_family, seqlen_bucket
from .table import TunedTableWarning, choose, clear_cache, lookup, save_entries

__all__ = ["lookup", "choose", "seqlen_bucket", "SEQLEN_BUCKETS", "save_entries", "clear_cache",
           "TunedTableWarning", "families", "get_family", "Family", "Problem"]
