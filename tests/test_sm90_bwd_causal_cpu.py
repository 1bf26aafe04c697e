"""CPU checks of sm90_bwd's launch order lpt (issue 14, the causal backward): K/V block 0 of a
group of (head, batch) pairs first, then block 1, ... (kLpt, fa2_bwd's grouped order).

The config field, name, template argument (appended last: a plain config keeps its name
expression), the space and the encoded form, the rules (not with varlen; for_problem drops it
there), the heuristic's switch, the params' head_group, the order itself (the host mirror of the
kernel's mapping: a bijection, K/V block n - 1 of a pair before block n, longest first), and the
nvcc/ptxas build (zero spills, no "wgmma serialized") of the new instantiations. No GPU needed.
"""
import itertools
import os
import shutil

import pytest

from cuflash import registry
from cuflash.compile import kernel_dir
from cuflash.families import fa2_bwd, sm90_bwd
from cuflash.families.sm90_bwd import Sm90BwdConfig, lpt_tile
from cuflash.problem import Problem

from test_sm90_bwd_sched_cpu import compile_clean  # noqa: E402

NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
FAM = registry.get("sm90_bwd")


def problem(head_dim=128, causal=True, deterministic=False, batch=2, seqlen=2048, nheads=16, features=()):
    return Problem("bwd", "bf16", batch, seqlen, seqlen, nheads, nheads, head_dim, causal, deterministic,
                   features=features)


def heur(d=128, causal=True):
    return Sm90BwdConfig(64, 128, 2, 2, d, "bf16", causal, dq_writer=True) if d == 128 else \
        Sm90BwdConfig(128, 128, 2, 2, d, "bf16", causal, dq_writer=True)


def test_field_name_template_encoding():
    plain = heur()
    lpt = plain.replace(lpt=True)
    assert lpt.name == plain.name + "_lpt" and lpt.problems() == []
    # appended last, after kVarlen: the plain config keeps its name expression (and its code)
    assert plain.kernel_name() == ("cuflash::sm90_bwd<64, 128, 2, 2, 128, cuflash::bf16, true, false, "
                                   "false, false, false, false, false, false, true>")
    assert lpt.kernel_name() == plain.kernel_name()[:-1] + ", false, true>"
    assert lpt.template_args()[-2:] == (False, True) and len(lpt.template_args()) == 17
    assert FAM.encode(plain) == FAM.encode(plain.replace(lpt=False)) and "lpt" not in FAM.encode(plain)
    assert FAM.decode(FAM.encode(lpt), "bf16", True) == lpt
    assert FAM.space["lpt"] == (False, True)
    point = {k: v for k, v in FAM.point(plain).items() if k != "lpt"}   # a table entry from before
    assert FAM.make(point, problem()).lpt is False
    src = (kernel_dir() / "sm90_bwd.cu").read_text()
    assert "bool kVarlen = false, bool kLpt = false>" in src


def test_rules_varlen_and_heuristic(monkeypatch):
    assert "lpt with varlen" in " ".join(heur().replace(lpt=True, varlen=True).problems())
    assert "lpt without causal" in " ".join(heur(causal=False).replace(lpt=True).problems())
    vp = problem(features=("varlen",))
    assert not FAM.for_problem(heur().replace(lpt=True), vp).lpt
    assert not FAM.for_problem(heur(causal=False).replace(lpt=True), problem(causal=False)).lpt
    for on in (False, True):
        monkeypatch.setattr(sm90_bwd, "HEURISTIC_LPT", on)
        for d, causal, det in itertools.product((64, 128), (False, True), (False, True)):
            p = problem(d, causal, det)
            cfg = FAM.for_problem(FAM.heuristic(p), p)
            assert cfg.lpt == (on and causal) and cfg.problems() == []


def test_params_head_group():
    p = problem(seqlen=2048, batch=8, nheads=16)
    n_kv = 2048 // 128
    for lpt in (False, True):
        cfg = heur().replace(lpt=lpt)
        ws = FAM.workspace(cfg, p)
        st = fa2_bwd.contiguous_strides(p)
        strides = {n: st for n in ("q", "k", "v", "o", "dout", "dq", "dk", "dv")}
        params = FAM.static_params(cfg, p, strides, ws, 0.1, 132)
        assert params["head_group"] == (fa2_bwd.head_group(8 * 16, n_kv, 132) if lpt else 1)
    assert fa2_bwd.head_group(128, 16, 132) == 17     # two waves of 132 CTAs


@pytest.mark.parametrize("n_kv,n_pairs,group", [(16, 128, 17), (5, 8, 3), (1, 3, 2), (7, 1, 4), (128, 16, 3)])
def test_order_is_a_bijection_longest_first(n_kv, n_pairs, group):
    tiles = [lpt_tile(t, n_kv, n_pairs, group) for t in range(n_kv * n_pairs)]
    assert sorted(tiles) == sorted(itertools.product(range(n_kv), range(n_pairs)))
    pos = {tile: i for i, tile in enumerate(tiles)}
    for n, pair in itertools.product(range(1, n_kv), range(n_pairs)):
        assert pos[(n - 1, pair)] < pos[(n, pair)]        # the deterministic turns' order
    # inside a group, every pair's block n before any pair's block n + 1
    for t in range(1, len(tiles)):
        (n0, p0), (n1, p1) = tiles[t - 1], tiles[t]
        assert n1 >= n0 or p1 // group > p0 // group or n1 == 0


@needs_nvcc
def test_lpt_kernels_compile_clean():
    configs = [heur(d).replace(lpt=True) for d in (64, 128)]
    configs.append(heur(128).replace(lpt=True, dtype="fp16", window=True, softcap=True, alibi=True))
    configs.append(Sm90BwdConfig(64, 128, 2, 2, 128, "bf16", True, True, lpt=True))   # deterministic
    assert all(c.problems() == [] for c in configs)
    assert compile_clean(configs) == []
