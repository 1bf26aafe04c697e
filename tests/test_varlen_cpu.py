"""Variable-length plumbing without a GPU: the varlen Problem, the families' launch plans and
params for it, and the backward's token-indexed workspace layout (kernels_cu/varlen.cuh)."""
import numpy as np
import pytest

from cuflash import launch, registry, varlen
from cuflash.families.fa2_bwd import ROW_PAD, VARLEN_ROW_PAD, varlen_ws_rows
from cuflash.compile import render_source


def strides(nheads, nheads_kv, d):
    q, k = (nheads * d, d, 1), (nheads_kv * d, d, 1)
    out = {n: varlen.strides4(s) for n, s in
           {"dout": q, "q": q, "k": k, "v": k, "o": q, "dq": q, "dk": k, "dv": k}.items()}
    return out


@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_varlen_params_pack_and_launch(op):
    fam = registry.get("fa2_fwd" if op == "fwd" else "fa2_bwd")
    p = varlen.problem_of(op, "bf16", 3, 300, 500, 8, 2, 64, True, op == "bwd")
    cfg = fam.for_problem(fam.heuristic(p, (9, 0)), p)
    assert cfg.varlen and cfg.name.endswith("_varlen")
    assert all("true>" in name or ", true" in name for name in fam.kernel_names(cfg).values())
    st = dict(strides(8, 2, 64), totals=(600, 900))
    ws = fam.workspace(cfg, p, st)
    fields = fam.static_params(cfg, p, st, ws, 0.125, 132)
    rec = launch.pack(fam.params_struct, **dict.fromkeys(fam.pointer_fields, 0), **fields)
    assert rec["total_q"][0] == 600 and rec["cu_seqlens_q"][0] == 0
    assert all(v == 0 for k, v in fields.items() if k.endswith("_batch_stride"))
    grids = {s.role: s.grid for s in fam.launches(cfg, p, 132)}
    if op == "fwd":
        assert grids["main"] == (-(-300 // cfg.Br), 8, 3)
    else:
        assert rec["total_k"][0] == 900 and rec["ws_rows"][0] == varlen_ws_rows(600, 3)
        assert ws["dk_accum"] + 8 * 900 * cfg.head_dim * 4 <= ws["dv_accum"]
        assert grids["preprocess"][2] == 3 and grids["main"][0] == 3 * 8 * (-(-500 // cfg.Bc))


def test_fixed_length_params_are_unchanged():
    fam = registry.get("fa2_fwd")
    p = varlen.problem_of("fwd", "bf16", 2, 64, 64, 2, 2, 64, False).replace(features=())
    cfg = fam.for_problem(fam.heuristic(p), p)
    assert not cfg.varlen
    st = {n: (64 * 128, 128, 64) for n in ("q", "k", "v", "o")}
    fields = fam.static_params(cfg, p, st, {"total": 0}, 0.125, 132)
    assert fields["q_batch_stride"] == 64 * 128 and fields["total_q"] == 0


def test_kernel_constants_match():
    src = render_source("fa2_bwd")
    assert f"constexpr int kVarlenRowPad = {VARLEN_ROW_PAD};" in src
    assert VARLEN_ROW_PAD >= ROW_PAD + 8


@pytest.mark.parametrize("seed", range(20))
def test_workspace_rows_of_sequences_are_disjoint(seed):
    """varlen.cuh ws_row_offset: sequence b's rows [floor8(cu[b] + pad·b), + round_up(len, 128))
    (the preprocess writes them; every Q block read or dQ atomic of b stays inside) are 16-byte
    aligned, disjoint, and inside ws_rows."""
    rng = np.random.default_rng(seed)
    lens = rng.choice([0, 1, 7, 8, 17, 113, 127, 128, 129, 1023], size=rng.integers(1, 40))
    cu = np.concatenate([[0], np.cumsum(lens)])
    rows = varlen_ws_rows(cu[-1], len(lens))
    assert rows % 8 == 0
    end = 0
    for b, n in enumerate(lens):
        start = (int(cu[b]) + VARLEN_ROW_PAD * b) & ~7
        assert start % 4 == 0 and start >= end
        end = start + -(-int(n) // ROW_PAD) * ROW_PAD
        assert end <= rows


def test_other_features_with_varlen_are_refused():
    p = varlen.problem_of("fwd", "bf16", 2, 64, 64, 2, 2, 64, False)
    assert "window" in registry.get("fa2_fwd").supports((9, 0), p.replace(features=("varlen", "window")))
    assert "window" in registry.get("fa2_bwd").supports((9, 0), p.replace(op="bwd", features=("varlen", "window")))
    assert registry.get("fa2_fwd").supports((9, 0), p) == ""
    assert "varlen" in registry.get("sm90_fwd").supports((9, 0), p)
