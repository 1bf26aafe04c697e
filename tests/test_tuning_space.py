"""What the tuner searches (tuning/space.py): the registry's families used directly,
enumeration, restrictions, buckets, study keys and tasks. CPU only."""
import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cuflash import registry
from cuflash.families.base import MAX_SMEM_BY_ARCH
from cuflash.families.fa2_bwd import BwdConfig
from cuflash.families.fa2_fwd import FwdConfig
from cuflash.problem import DTYPES, Problem
from cuflash.tuning.space import (SEQLEN_BUCKETS, bench_problem, families_for, point_key,
                                  problem_name, problems, seqlen_bucket, space_size, study_key,
                                  tasks)

REPO = Path(__file__).resolve().parent.parent
H100_SMEM = MAX_SMEM_BY_ARCH[(9, 0)]
SMALL_SMEM = 99 * 1024
FWD = registry.get("fa2_fwd")
BWD = registry.get("fa2_bwd")


def prob(family, head_dim=128, dtype="bf16", causal=True, seqlen=4096):
    return bench_problem(family, dtype, head_dim, causal, seqlen)


def test_the_tuner_iterates_the_registry():
    assert families_for(["fwd"]) == registry.families("fwd")
    assert families_for(["fwd", "bwd"]) == registry.families("fwd") + registry.families("bwd")
    assert families_for(["fwd", "bwd"], ["fa2_bwd"]) == [BWD]
    with pytest.raises(LookupError, match="unknown kernel family 'sideways'"):
        families_for(["fwd"], ["sideways"])
    with pytest.raises(ValueError, match="implements op 'bwd', not fwd"):
        families_for(["fwd"], ["fa2_bwd"])
    assert FWD.config_cls is FwdConfig and BWD.config_cls is BwdConfig


@pytest.mark.parametrize("max_smem", [None, H100_SMEM, SMALL_SMEM])
@pytest.mark.parametrize("head_dim", [64, 72, 128, 256])
@pytest.mark.parametrize("family", [FWD, BWD], ids=lambda f: f.name)
def test_enumeration_matches_the_config_rules(family, head_dim, max_smem):
    p = prob(family, head_dim)
    points = list(family.enumerate(p, max_smem))
    assert len(points) == len(list(itertools.product(*family.space.values()))) == space_size(family)
    # the restriction is the config's own rule, reason for reason
    for cfg, why in points:
        assert why == cfg.problems(max_smem) == problems(cfg, max_smem)
        assert cfg.head_dim == family.head_dim_of(head_dim) == p.head_dim
        assert family.make(family.point(cfg), p) == cfg
    assert family.valid(p, max_smem) == [c for c, why in points if not why]


def test_shared_memory_limit_shrinks_the_space_and_says_why():
    p = prob(FWD, 128, "fp16", False)
    big = FWD.valid(p, H100_SMEM)
    small = FWD.valid(p, SMALL_SMEM)
    assert set(small) < set(big)
    dropped = [(cfg, why) for cfg, why in FWD.enumerate(p, SMALL_SMEM) if cfg in big and why]
    assert dropped and all("shared memory" in " ".join(why) for _, why in dropped)


def test_extra_restrictions_apply_only_to_valid_configs():
    no_8_warps = lambda cfg: "8 warps spill here" if cfg.warps == 8 else None  # noqa: E731
    for cfg, why in FWD.enumerate(prob(FWD, 64, causal=False), H100_SMEM):
        got = problems(cfg, H100_SMEM, (no_8_warps,))
        if why:
            assert got == why
        else:
            assert got == (["8 warps spill here"] if cfg.warps == 8 else [])


def test_make_point_round_trip_and_bad_params():
    p = prob(FWD, 100, "fp16", True)
    cfg = FWD.make({"Br": 128, "Bc": 64, "warps": 4, "stages": 2}, p)
    assert cfg == FwdConfig(128, 64, 4, 2, 112, "fp16", True)
    assert FWD.make(FWD.point(cfg), p) == cfg
    assert FWD.point(cfg) == {"Br": 128, "Bc": 64, "warps": 4, "stages": 2}
    assert point_key(FWD, cfg) == (128, 64, 4, 2)
    with pytest.raises(ValueError, match="unknown.*'Bx'"):
        FWD.make({"Br": 128, "Bc": 64, "warps": 4, "stages": 2, "Bx": 1}, p)
    with pytest.raises(ValueError, match="missing.*'stages'"):
        FWD.make({"Br": 128, "Bc": 64, "warps": 4}, p)


@pytest.mark.parametrize("family", [FWD, BWD], ids=lambda f: f.name)
def test_heuristic_is_a_valid_point_of_the_space(family):
    for d, dtype, causal in itertools.product((64, 128, 256), DTYPES, (False, True)):
        p = prob(family, d, dtype, causal)
        for arch, smem in (((9, 0), H100_SMEM), ((8, 6), SMALL_SMEM)):
            cfg = family.heuristic(p, arch, smem)
            assert not cfg.problems(smem)
            if family is FWD or smem == H100_SMEM:
                assert cfg in family.valid(p, smem)
            else:  # the backward's last resort on ~99 KB parts (Br 16, 2 warps) is off the space
                assert cfg in family.valid(p, smem) or not family.valid(p, smem)


@pytest.mark.parametrize("seqlen, bucket", [
    (0, 512), (1, 512), (512, 512), (700, 512), (730, 1024), (1024, 1024), (3000, 4096),
    (5000, 4096), (6000, 8192), (16384, 16384), (10 ** 6, 16384)])
def test_seqlen_bucket(seqlen, bucket):
    assert seqlen_bucket(seqlen) == bucket
    assert bucket in SEQLEN_BUCKETS


def test_problem_follows_the_benchmark_convention():
    p = bench_problem(FWD, "bf16", 128, True, 4000)
    assert (p.seqlen_q, p.seqlen_k, p.batch, p.nheads, p.nheads_kv, p.head_dim) == \
        (4096, 4096, 4, 16, 16, 128)
    assert p == Problem.fa_convention("fwd", "bf16", 128, True, 4096)
    assert study_key(FWD, p) == ("fwd", "fa2_fwd", "bf16", 128, True, (), 4096)
    assert problem_name(FWD, p) == "fwd_fa2_fwd_bf16_d128_causal_s4096"
    assert FWD.flops(p) == 4 * 4 * 16 * 4096 * 4096 * 128 / 2
    assert bench_problem(FWD, "fp16", 72, False, 512).head_dim == 80
    # the backward rounds head dims above 128 to 32 (two whole slices)
    assert bench_problem(BWD, "fp16", 144, False, 512).head_dim == 160
    assert bench_problem(FWD, "fp16", 144, False, 512).head_dim == 144
    pb = bench_problem(BWD, "bf16", 64, True, 2048)
    assert study_key(BWD, pb) == ("bwd", "fa2_bwd", "bf16", 64, True, (), 2048)
    assert BWD.flops(pb) == 2.5 * 4 * 8 * 32 * 2048 * 2048 * 64 / 2


def test_backward_family_space():
    for d in (64, 128):
        p = prob(BWD, d, causal=False)
        points = list(BWD.enumerate(p, H100_SMEM))
        assert all(not cfg.deterministic for cfg, _ in points)
        assert len(BWD.valid(p, H100_SMEM)) > 10


def test_tasks_split_by_support_and_dedupe_rounded_head_dims():
    todo, skipped = tasks([FWD, BWD], ["bf16"], [64, 72, 80, 12], [True], [512, 600, 4096], (9, 0))
    keys = [study_key(f, p) for f, p in todo]
    assert len(keys) == len(set(keys)) == 2 * 2 * 2            # d 64, 80 (72 and 80 one study)
    assert {k[3] for k in keys} == {64, 80} and {k[6] for k in keys} == {512, 4096}
    assert len(skipped) == 2 * 2 and all("headdim must be a multiple of 8" in w for *_, w in skipped)
    old, why = tasks([FWD], ["bf16"], [64], [False], [512], (7, 5))
    assert old == [] and "needs sm_80" in why[0][2]


@pytest.mark.parametrize("family", [FWD, BWD], ids=lambda f: f.name)
def test_neighbours_are_one_step_in_one_parameter(family):
    p = prob(family, 128, causal=False)
    cfg = family.heuristic(p, (9, 0), H100_SMEM)
    got = family.neighbours(cfg)
    base = family.point(cfg)
    assert got
    for point in got:
        changed = [k for k in base if point[k] != base[k]]
        assert len(changed) == 1
        values = family.space[changed[0]]
        assert abs(values.index(point[changed[0]]) - values.index(base[changed[0]])) == 1
    assert len(got) == len({tuple(sorted(p.items())) for p in got})
    if family is FWD:
        c = FWD.make({"Br": 128, "Bc": 64, "warps": 4, "stages": 2}, p)
        near = FWD.neighbours(c)
        assert {"Br": 64, "Bc": 64, "warps": 4, "stages": 2} in near
        assert {"Br": 128, "Bc": 128, "warps": 4, "stages": 2} in near
        assert {"Br": 128, "Bc": 32, "warps": 4, "stages": 2} in near


def test_importing_the_tuner_imports_neither_optuna_nor_cupy():
    code = ("import sys, cuflash.tuning, cuflash.tuning.space, cuflash.tuning.study, "
            "cuflash.tuning.objective, cuflash.tuning.measure, cuflash.tuning.table, "
            "cuflash.tuning.replay, cuflash.tuning.fake, cuflash.tuning.cli\n"
            "from cuflash.tuning.cli import info_families_lines\n"
            "info_families_lines()\n"
            "print(sorted(m for m in ('optuna', 'cupy', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_library_never_imports_the_tuner():
    """cuflash/ names cuflash.tuning only in select.shipped_dir's find_spec (and the CLI
    entry points of __main__, which the tuner exports)."""
    offenders = []
    for path in sorted((REPO / "cuflash").rglob("*.py")):
        if path.name == "__main__.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            code = line.split("#")[0]
            if re.search(r"\bimport\b", code) and "tuning" in code or "cuflash.tuning" in code:
                offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert all("find_spec" in o for o in offenders), offenders
    code = ("import sys, cuflash, cuflash.select as s\n"
            "s.shipped_dir(); s.table_dirs()\n"
            "print([m for m in sys.modules if m.startswith('cuflash.tuning') or m == 'tuning'])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
