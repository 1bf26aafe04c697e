"""The tuner's search space (tuning/space.py): enumeration, restrictions, buckets. CPU only."""
import itertools

import pytest

import cuflash.config as cc
from tuning.space import SEQLEN_BUCKETS, Problem, families, get_family, problems, seqlen_bucket

HAS_BWD = hasattr(cc, "BwdConfig")
H100_SMEM = cc.MAX_SMEM_BY_ARCH[(9, 0)]
SMALL_SMEM = 99 * 1024


def test_forward_family_is_the_config_space():
    fam = get_family("fwd")
    assert fam.space == cc.FWD_SPACE and fam.config_cls is cc.FwdConfig
    assert fam.source == "flash_fwd" and get_family("flash_fwd") is not None


@pytest.mark.parametrize("max_smem", [None, H100_SMEM, SMALL_SMEM])
@pytest.mark.parametrize("head_dim", [64, 72, 128, 256])
def test_enumeration_matches_the_config_rules(head_dim, max_smem):
    fam = get_family("fwd")
    points = fam.enumerate(head_dim, "bf16", True, max_smem)
    assert len(points) == len(list(itertools.product(*cc.FWD_SPACE.values())))
    # the restriction is the config's own rule, reason for reason
    for cfg, why in points:
        assert why == cfg.problems(max_smem)
        assert cfg.head_dim == cc.kernel_head_dim(head_dim)
    assert fam.valid(head_dim, "bf16", True, max_smem) == \
        cc.valid_fwd_configs(head_dim, "bf16", True, max_smem)


def test_shared_memory_limit_shrinks_the_space_and_says_why():
    fam = get_family("fwd")
    big = fam.valid(128, "fp16", False, H100_SMEM)
    small = fam.valid(128, "fp16", False, SMALL_SMEM)
    assert set(small) < set(big)
    dropped = [cfg for cfg, why in fam.enumerate(128, "fp16", False, SMALL_SMEM)
               if cfg in big and why]
    assert dropped and all("shared memory" in " ".join(why) for cfg, why in
                           fam.enumerate(128, "fp16", False, SMALL_SMEM) if cfg in dropped)


def test_extra_restrictions_apply_only_to_valid_configs():
    fam = get_family("fwd")
    no_8_warps = lambda cfg: "8 warps spill here" if cfg.warps == 8 else None  # noqa: E731
    for cfg, why in fam.enumerate(64, "bf16", False, H100_SMEM):
        got = problems(cfg, H100_SMEM, (no_8_warps,))
        if why:
            assert got == why
        else:
            assert got == (["8 warps spill here"] if cfg.warps == 8 else [])


def test_make_params_point_round_trip_and_bad_params():
    fam = get_family("fwd")
    cfg = fam.make({"Br": 128, "Bc": 64, "warps": 4, "stages": 2}, 100, "fp16", True)
    assert cfg == cc.FwdConfig(128, 64, 4, 2, 112, "fp16", True)
    assert fam.make(fam.params(cfg), 112, "fp16", True) == cfg
    assert fam.point(cfg) == (128, 64, 4, 2)
    with pytest.raises(ValueError, match="unknown.*'Bx'"):
        fam.make({"Br": 128, "Bc": 64, "warps": 4, "stages": 2, "Bx": 1}, 64, "fp16", True)
    with pytest.raises(ValueError, match="missing.*'stages'"):
        fam.make({"Br": 128, "Bc": 64, "warps": 4}, 64, "fp16", True)


def test_heuristic_is_a_valid_point_of_the_space():
    fam = get_family("fwd")
    for d, dtype, causal in itertools.product((64, 128, 256), cc.DTYPES, (False, True)):
        for arch, smem in (((9, 0), H100_SMEM), ((8, 6), SMALL_SMEM)):
            cfg = fam.heuristic(d, dtype, causal, arch, smem)
            assert cfg in fam.valid(d, dtype, causal, smem)


@pytest.mark.parametrize("seqlen, bucket", [
    (0, 512), (1, 512), (512, 512), (700, 512), (730, 1024), (1024, 1024), (3000, 4096),
    (5000, 4096), (6000, 8192), (16384, 16384), (10 ** 6, 16384)])
def test_seqlen_bucket(seqlen, bucket):
    assert seqlen_bucket(seqlen) == bucket
    assert bucket in SEQLEN_BUCKETS


def test_problem_follows_the_benchmark_convention():
    p = Problem.fa_convention("fwd", "bf16", 128, True, 4000)
    assert (p.seqlen, p.batch, p.nheads, p.head_dim) == (4096, 4, 16, 128)
    assert p.key == ("fwd", "bf16", 128, True, 4096)
    assert p.name == "fwd_bf16_d128_causal_s4096"
    assert p.flops() == 4 * 4 * 16 * 4096 * 4096 * 128 / 2
    assert Problem.fa_convention("fwd", "fp16", 72, False, 512).head_dim == 80


def test_unknown_kernel_is_refused_clearly():
    with pytest.raises(LookupError, match="unknown kernel 'sideways'"):
        get_family("sideways")


@pytest.mark.skipif(HAS_BWD, reason="cuflash.config has BwdConfig")
def test_backward_family_absent_until_the_config_exists():
    assert "bwd" not in families()
    with pytest.raises(LookupError, match="backward kernel is not in this cuflash"):
        get_family("bwd")


@pytest.mark.skipif(not HAS_BWD, reason="cuflash.config has no BwdConfig yet")
def test_backward_family_plugs_in():
    fam = get_family("bwd")
    assert fam.space == cc.BWD_SPACE and fam.source == fam.config_cls.family
    for d in (64, 128):
        points = fam.enumerate(d, "bf16", False, H100_SMEM)
        assert len(points) == len(list(itertools.product(*cc.BWD_SPACE.values())))
        expected = {cfg for cfg, why in cc.bwd_space(d, "bf16", False, H100_SMEM) if not why}
        assert set(fam.valid(d, "bf16", False, H100_SMEM)) == expected
        assert all(not cfg.deterministic for cfg, _ in points)
        assert fam.heuristic(d, "bf16", False, (9, 0), H100_SMEM) in expected
    p = Problem.fa_convention("bwd", "bf16", 64, True, 2048)
    assert p.flops() == 2.5 * 4 * 8 * 32 * 2048 * 2048 * 64 / 2


def test_neighbours_are_one_step_in_one_parameter():
    from tuning.space import get_family

    fam = get_family("fwd")
    cfg = fam.make({"Br": 128, "Bc": 64, "warps": 4, "stages": 2}, 128, "bf16", False)
    got = fam.neighbours(cfg)
    base = fam.params(cfg)
    assert {"Br": 64, "Bc": 64, "warps": 4, "stages": 2} in got
    assert {"Br": 128, "Bc": 128, "warps": 4, "stages": 2} in got
    assert {"Br": 128, "Bc": 32, "warps": 4, "stages": 2} in got
    for point in got:
        changed = [k for k in base if point[k] != base[k]]
        assert len(changed) == 1
        values = fam.space[changed[0]]
        assert abs(values.index(point[changed[0]]) - values.index(base[changed[0]])) == 1
    assert len(got) == len({tuple(sorted(p.items())) for p in got})
