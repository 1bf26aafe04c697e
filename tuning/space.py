"""What the tuner searches: the registry's kernel families, and the problems they are tuned on.

There is no tuner-side family wrapper: a study drives a ``cuflash.families.base.Family``
straight from ``cuflash.registry`` (its ``space``, ``make``, ``valid``, ``neighbours``,
``heuristic``, ``point``, ``flops``, ``version``). The restrictions are the config's own
rules (``config.problems(max_smem)``), so the tuner and the kernel's ``static_assert``s
can never disagree about what is legal.

A *study* is keyed by (op, family, dtype, head dim, causal, features, seqlen bucket) —
the tuned-table key — and timed on the FlashAttention benchmark shape of that key
(``bench_problem``: heads = 2048 / d, batch x seqlen = 16k, seqlen_q = seqlen_k = bucket).

Importing this module imports neither optuna nor CuPy.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Optional

from cuflash.problem import SEQLEN_BUCKETS, Problem, seqlen_bucket
from cuflash.registry import OPS, families, get

OP_NAMES = tuple(OPS)


def bench_problem(family, dtype: str, head_dim: int, causal: bool, seqlen: int,
                  features: tuple = ()) -> Problem:
    """The problem one study of ``family`` is timed on: the FlashAttention convention for
    the family's compiled head dim (``head_dim_of``) and the seqlen's bucket; a family with
    its own benchmark shape (``family.bench_problem``, e.g. decode: one query row over a cache)
    gives it."""
    own = getattr(family, "bench_problem", None)
    if own is not None:
        return own(dtype, family.head_dim_of(head_dim), bool(causal), seqlen_bucket(seqlen),
                   tuple(sorted(features)))
    return Problem.fa_convention(family.op, dtype, family.head_dim_of(head_dim), bool(causal),
                                 seqlen_bucket(seqlen), features=tuple(sorted(features)))


def study_key(family, problem: Problem) -> tuple:
    """(op, family, dtype, head_dim, causal, features, seqlen bucket): one study, one table entry."""
    return (problem.op, family.name, problem.dtype, family.head_dim_of(problem.head_dim),
            bool(problem.causal), tuple(problem.features), problem.bucket)


def problem_name(family, problem: Problem) -> str:
    """A study's readable name, e.g. fwd_fa2_fwd_bf16_d128_causal_s4096."""
    op, fam, dtype, d, causal, features, bucket = study_key(family, problem)
    feats = "".join(f"_{f}" for f in features)
    return f"{op}_{fam}_{dtype}_d{d}_{'causal' if causal else 'full'}{feats}_s{bucket}"


def point_key(family, config) -> tuple:
    """The tunable part of a config as a tuple in space order (a memo key)."""
    return tuple(getattr(config, k) for k in family.space)


def space_size(family) -> int:
    n = 1
    for values in family.space.values():
        n *= len(values)
    return n


def problems(config, max_smem: Optional[int] = None,
             restrictions: tuple[Callable[[Any], Optional[str]], ...] = ()) -> list[str]:
    """The rules ``config`` breaks: its own ``problems()``, then any extra predicates.

    A restriction is ``config -> reason or None`` (e.g. a register budget read off a
    compile report); it is only asked about configs the kernel itself accepts.
    """
    why = list(config.problems(max_smem))
    if not why:
        why += [r for r in (pred(config) for pred in restrictions) if r]
    return why


def families_for(ops, names: Optional[list] = None) -> list:
    """The registered families of ``ops`` (all of them, or those named in ``names``), in
    registry order. Raises LookupError for an unknown name, ValueError for a name whose
    op was not asked for."""
    ops = list(ops)
    if names:
        out = []
        for name in names:
            fam = get(name)
            if fam.op not in ops:
                raise ValueError(f"family {name} implements op {fam.op!r}, not {'/'.join(ops)}")
            out.append(fam)
        return list(dict.fromkeys(out))
    return [f for op in ops for f in families(op)]


def tasks(fams, dtypes, head_dims, causals, seqlens, arch, features: tuple = ()) -> tuple[list, list]:
    """The studies to run: ``([(family, problem)], [(family, problem, why not)])`` for every
    family x dtype x head dim x causal x seqlen bucket, split by the family's dtypes and
    ``family.supports(arch, ...)``.
    Head dims that round to the same compiled one make one study."""
    from cuflash.select import dtype_refusal

    todo, skipped, seen = [], [], set()
    buckets = sorted({seqlen_bucket(s) for s in seqlens})
    for fam, dtype, d, causal, s in itertools.product(fams, dtypes, head_dims, causals, buckets):
        real = Problem.fa_convention(fam.op, dtype, d, bool(causal), s, features=tuple(features))
        # the input dtypes it takes (Family.dtypes: e4m3 for the FP8 families only), then the rest
        why = dtype_refusal(fam, real) or fam.supports(tuple(arch), real)
        p = bench_problem(fam, dtype, d, causal, s, features)
        key = study_key(fam, p)
        if key in seen:
            continue
        seen.add(key)
        (skipped.append((fam, p, why)) if why else todo.append((fam, p)))
    return todo, skipped


def candidates(family, problems_of_class: list, n: int, max_smem: Optional[int] = None, arch=(9, 0),
               seed: int = 0) -> list:
    """A fixed, bounded list of configs for the studies of one problem class (same family,
    dtype, head dim, causal, features; every seqlen bucket): the heuristic of each of
    ``problems_of_class`` first, then ``n`` more valid configs: about two thirds one step away
    from a heuristic (``family.neighbours``: a good default is usually one parameter away from
    the best) and the rest drawn from the whole valid space, both shuffled by ``seed``. Every
    study of the class measures the same list, so its kernels can be compiled up front and once.
    Reads the family's space and rules only (no parameter names): any family's space works."""
    import random

    if not problems_of_class:
        return []
    rep = problems_of_class[-1]
    valid = family.valid(rep, max_smem)
    valid_keys = {point_key(family, c) for c in valid}
    out, seen = [], set()

    def add(cfg) -> bool:
        k = point_key(family, cfg)
        if k in seen:
            return False
        seen.add(k)
        out.append(cfg)
        return True

    for p in problems_of_class:
        add(family.heuristic(p, tuple(arch), max_smem))
    heurs = list(out)
    rng = random.Random(seed)
    near = []
    for h in heurs:
        for point in family.neighbours(h):
            cfg = family.make(point, rep)
            if point_key(family, cfg) in valid_keys:
                near.append(cfg)
    near = list(dict.fromkeys(near))
    rng.shuffle(near)
    far = list(valid)
    rng.shuffle(far)
    n_near = min(len(near), -(-2 * n // 3))
    picked = 0
    for cfg in near[:n_near]:
        picked += add(cfg)
    for cfg in far + near[n_near:]:
        if picked >= n:
            break
        picked += add(cfg)
    return out


__all__ = ["SEQLEN_BUCKETS", "candidates", "OP_NAMES", "Problem", "bench_problem", "families_for", "point_key",
           "problem_name", "problems", "seqlen_bucket", "space_size", "study_key", "tasks"]
