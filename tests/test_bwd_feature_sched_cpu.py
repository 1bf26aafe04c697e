"""sm90_bwd's feature backward with the plain call's schedule fields (FEATURE_SCHED_BUILT, FEATURE_SCHED,
feature_sched_spills): the configs that keep them, the heuristic's choice, and ptxas's report of their
kernels (no GPU; the GPU side is tests/test_bwd_feature_sched_gpu.py)."""
import itertools

import pytest

from cuflash import registry
from cuflash.families import sm90_bwd
from cuflash.problem import Problem

FAM = registry.get("sm90_bwd")
SINGLE = (("softcap",), ("alibi",), ("window",))
FLAGS = dict(dynamic=True, ds_double=True, dq_early=True, dk_late=True, frag_pin=True)


def problem(feats, dtype="bf16", causal=False, d=128, **kw):
    return Problem("bwd", dtype, 2, 1023, 1023, 4, 2, d, causal, features=feats, window=(100, 3), softcap=20.0, **kw)


def plain_config(p):
    """The plain call's heuristic config of problem p's class."""
    return FAM.heuristic(p.replace(features=()))


@pytest.mark.parametrize("feats", SINGLE, ids="_".join)
def test_given_plain_config_keeps_the_schedule_fields(feats):
    for dtype, causal in itertools.product(("bf16", "fp16"), (False, True)):
        p = problem(feats, dtype, causal)
        got = FAM.for_problem(plain_config(p), p)
        assert got.dq_early and got.dk_late and got.frag_pin and got.ds_double, got.name
        # fp16 and bf16 ALiBi causal: the plain grid (the dynamic kernel spills there)
        assert got.dynamic == (dtype == "bf16" and not (feats == ("alibi",) and causal)), got.name
        assert got.problems(227 * 1024) == [] and (got.window, got.softcap, got.alibi) == tuple(
            f in feats for f in ("window", "softcap", "alibi"))
        # (dq_convert stays a plain call's, or a window's: session 21)
        assert not got.dq_convert or feats == ("window",)


@pytest.mark.parametrize("feats", [("alibi", "softcap"), ("softcap", "window"), ("alibi", "softcap", "window"),
                                   ("dropout",), ("dropout", "softcap")], ids="_".join)
def test_other_feature_sets_drop_them(feats, monkeypatch):
    # dropout alone at bf16 d 128 takes them through its own rule (DROPOUT_FAST, session 27: the test below);
    # without that rule it drops them like the other sets
    monkeypatch.setattr(sm90_bwd, "DROPOUT_FAST", {})
    p = problem(feats, dropout_p=0.1 if "dropout" in feats else 0.0)
    got = FAM.for_problem(plain_config(p), p)
    assert not (got.dq_early or got.dk_late or got.frag_pin), got.name
    assert not (got.ds_double and (got.softcap or got.alibi)), got.name


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_alone_takes_dropout_fast(causal):
    """DROPOUT_FAST (session 27, drp8): a bf16 d 128 dropout backward keeps the plain call's speed fields; fp16
    and dropout with another feature do not."""
    p = problem(("dropout",), causal=causal, dropout_p=0.1)
    got = FAM.for_problem(plain_config(p), p)
    assert got.dq_early and got.dk_late and got.frag_pin and got.dynamic, got.name
    assert got.problems(227 * 1024) == [], got.name
    for q in (p.replace(dtype="fp16"), problem(("dropout", "softcap"), causal=causal, dropout_p=0.1)):
        other = FAM.for_problem(plain_config(q), q)
        assert not (other.dq_early or other.dk_late or other.frag_pin), other.name


@pytest.mark.parametrize("feats", SINGLE, ids="_".join)
def test_varlen_deterministic_and_d64_drop_them(feats):
    for p in (problem(feats).replace(features=tuple(sorted(feats + ("varlen",)))),
              problem(feats).replace(deterministic=True), problem(feats, d=64)):
        got = FAM.for_problem(plain_config(p), p)
        assert not (got.dq_early or got.dk_late or got.frag_pin or got.dynamic), got.name


def test_config_rules():
    base = sm90_bwd.Sm90BwdConfig(64, 128, 2, 2, 128, "bf16", False, dq_writer=True, **FLAGS)
    for f in ("softcap", "alibi", "window"):
        c = base.replace(**{f: True})
        assert c.feature_sched_built() and c.problems(227 * 1024) == [], c.name
        assert any("fp16" in w for w in c.replace(dtype="fp16").problems())
        assert c.replace(dtype="fp16", dynamic=False).problems(227 * 1024) == []
        assert not c.replace(dropout=True).feature_sched_built()
    assert base.replace(softcap=True, alibi=True).problems()     # (a pair: unchecked)
    assert not base.feature_sched_built()


def test_heuristic_per_feature_set(monkeypatch):
    for feats, causal in itertools.product(SINGLE, (False, True)):
        p = problem(feats, causal=causal)
        off = FAM.for_problem(FAM.heuristic(p), p)
        assert feats in sm90_bwd.FEATURE_SCHED.get((128, "bf16"), ()) or not off.dk_late, off.name
        monkeypatch.setattr(sm90_bwd, "FEATURE_SCHED", {(128, dt): frozenset({feats}) for dt in ("bf16", "fp16")})
        for dtype in ("bf16", "fp16"):
            q = p.replace(dtype=dtype)
            on = FAM.for_problem(FAM.heuristic(q), q)
            # (a plain config's dq_first stays with a window where every Q block gets a dQ part, session 21;
            # the window heuristic's own is sm90_bwd.WINDOW_DQ_FIRST's)
            given = FAM.for_problem(plain_config(q), q).replace(dq_convert=False)
            if feats == ("window",):
                given = given.replace(dq_first=(128, dtype) in sm90_bwd.WINDOW_DQ_FIRST,
                                      dq_tail=sm90_bwd.WINDOW_DQ_TAIL.get((128, dtype, q.causal), 0))   # (session 31)
            if feats == ("softcap",):   # (the heuristic's folded softcap step, on the dynamic kernel: session 23)
                given = sm90_bwd.with_cap_fold(given, q)
            assert on == given, (on.name, dtype)
            assert on.dk_late and on.dynamic == (dtype == "bf16" and not (feats == ("alibi",) and causal))
        monkeypatch.undo()


def test_ptxas_feature_sched_kernels_no_spills_no_serialized_wgmma():
    """Every built feature kernel with the plain fields (dynamic where feature_sched_spills allows it, and the
    plain grid) compiles with zero spills and no serialized wgmma (nvcc 13.0, sm_90a): one nvcc run."""
    from cuflash.compile import nvcc_compile

    cfgs = []
    for (feat,), causal, dtype in itertools.product(SINGLE, (False, True), ("bf16", "fp16")):
        c = sm90_bwd.Sm90BwdConfig(64, 128, 2, 2, 128, dtype, causal, dq_writer=True, **FLAGS, **{feat: True})
        cfgs += [c] * (dtype == "bf16") + [c.replace(dynamic=False)]
    cfgs = [c.replace(dynamic=c.dynamic and not c.feature_sched_spills()) for c in cfgs]
    cfgs = list(dict.fromkeys(cfgs))
    for c, r in zip(cfgs, nvcc_compile(cfgs, "sm_90a")):
        assert c.problems(227 * 1024) == [], c.name
        assert (r.spill_stores, r.spill_loads, r.warnings) == (0, 0, ()), (c.name, r)

