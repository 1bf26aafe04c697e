"""The backward's preprocess (kernels_cu/fa2_bwd.cu fa2_bwd_preprocess) without a GPU: its
launch geometry and constants as the host has them, the workspace layout it writes, its summation
order (a NumPy model of both paths: the 16-byte path sums D in the warp-per-row path's order, so
D is the same to the bit), and the helper kernels compiled for sm_90a without spills."""
import re
import shutil
import subprocess

import numpy as np
import pytest

from cuflash import registry
from cuflash.compile import kernel_dir, kernel_param_decl, parse_ptxas, render_source
from cuflash.families.fa2_bwd import PREP_ROWS, PREP_THREADS, ROW_PAD
from cuflash.problem import Problem

FAMILIES = ["fa2_bwd", "sm90_bwd"]


def kernel_constant(name):
    m = re.search(rf"constexpr int {name} = ([^;]+);", (kernel_dir() / "fa2_bwd.cu").read_text())
    return m.group(1).strip()


def test_constants_match_the_kernel():
    assert int(kernel_constant("kPrepThreads")) == PREP_THREADS
    assert int(kernel_constant("kPrepRows")) == PREP_ROWS
    assert ROW_PAD % PREP_ROWS == 0          # every CTA's rows lie inside one padded (batch, head)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seqlen_q", [1, 113, 2049])
def test_preprocess_launch(family, seqlen_q):
    fam = registry.get(family)
    p = Problem("bwd", "bf16", 3, seqlen_q, 77, 6, 2, 128, True)
    cfg = fam.for_problem(fam.heuristic(p, (9, 0), 227 * 1024), p)
    pre = next(s for s in fam.launches(cfg, p, 132) if s.role == "preprocess")
    rows = -(-seqlen_q // ROW_PAD) * ROW_PAD
    assert tuple(pre.grid) == (rows // PREP_ROWS, 6, 3) and pre.threads == PREP_THREADS


@pytest.mark.parametrize("family", FAMILIES)
def test_workspace_layout_unchanged(family):
    """lse_log2, D: (batch, nheads, seqlen_q_rounded) fp32; dq_accum (batch, nheads,
    seqlen_q_rounded, head_dim); pieces 256-byte aligned, in this order. (sm90_bwd's dq_first, on in
    its heuristic here, adds its tickets after them: int32 (batch, nheads, seqlen_q_rounded / 16).)"""
    fam = registry.get(family)
    p = Problem("bwd", "bf16", 2, 300, 200, 4, 4, 128, False)
    cfg = fam.for_problem(fam.heuristic(p, (9, 0), 227 * 1024), p)
    tickets = getattr(cfg, "dq_first", False)
    if tickets:
        cfg = cfg.replace(dq_first=False)
    ws = fam.workspace(cfg, p)
    bh, rows = 8, 384
    assert ws["lse_log2"] == 0 and ws["D"] == bh * rows * 4
    assert ws["dq_accum"] == 2 * bh * rows * 4 and ws["total"] == 2 * bh * rows * 4 + bh * rows * 128 * 4
    assert tickets == (family == "sm90_bwd")
    if tickets:
        with_tickets = fam.workspace(cfg.replace(dq_first=True), p)
        assert with_tickets == dict(ws, dq_semaphore=ws["total"], total=ws["total"] + bh * rows // 16 * 4)


# ---------------------------------------------------------------------------------------
# the summation order of D, both paths, in float32 as the GPU rounds it (fma of a product of two
# 16-bit values = the float32 sum with the exact product: such a product fits in float32)

def d_warp_per_row(o, d_o):
    """fa2_bwd.cu's any-strides path: lane L sums columns L, L+32, ...; xor butterfly 16 .. 1."""
    lanes = np.zeros(32, np.float32)
    for c in range(o.shape[0]):
        lanes[c % 32] = np.float32(lanes[c % 32] + np.float32(o[c] * d_o[c]))
    for off in (16, 8, 4, 2, 1):
        lanes = np.float32(lanes + lanes[np.arange(32) ^ off])
    assert (lanes == lanes[0]).all() or np.isnan(lanes).all()
    return lanes[0]


def d_16_byte(o, d_o):
    """The 16-byte path: thread g (0..3) of the row owns chunks g, g+4, ... (columns 32k + 8g ..
    + 7); element e of them is lane 8g + e's column sequence; shuffles xor 2, 1 (lanes' bits 4,
    3), then registers e ^ 4, e ^ 2, e ^ 1."""
    d = o.shape[0]
    lane_d = np.zeros((4, 8), np.float32)
    for g in range(4):
        for k in range(8):
            col = 8 * (4 * k + g)
            if col < d:
                for e in range(8):
                    lane_d[g, e] = np.float32(lane_d[g, e] + np.float32(o[col + e] * d_o[col + e]))
    lane_d = np.float32(lane_d + lane_d[[2, 3, 0, 1]])
    lane_d = np.float32(lane_d + lane_d[[1, 0, 3, 2]])
    lane_d = np.float32(lane_d[:, :4] + lane_d[:, 4:])
    lane_d = np.float32(lane_d[:, :2] + lane_d[:, 2:])
    out = np.float32(lane_d[:, 0] + lane_d[:, 1])
    assert (out == out[0]).all()
    return out[0]


@pytest.mark.parametrize("head_dim", [8, 40, 64, 96, 128, 200, 256])
def test_both_paths_sum_d_in_one_order(head_dim):
    rng = np.random.default_rng(head_dim)
    for _ in range(20):
        # bf16 values (8 significant bits) at spread magnitudes, so the order shows in the bits
        o, d_o = (np.float32(np.round(rng.standard_normal(head_dim) * 2.0 ** rng.integers(-8, 8, head_dim) * 128) / 128)
                  for _ in range(2))
        a, b = d_warp_per_row(o, d_o), d_16_byte(o, d_o)
        assert a.tobytes() == b.tobytes(), (head_dim, a, b)


def test_another_order_would_differ():
    """The check above can fail: a plain sequential sum gives other bits for some rows."""
    rng = np.random.default_rng(0)
    differs = 0
    for _ in range(50):
        o, d_o = (np.float32(rng.standard_normal(128) * 2.0 ** rng.integers(-8, 8, 128)) for _ in range(2))
        seq = np.float32(0)
        for c in range(128):
            seq = np.float32(seq + np.float32(o[c] * d_o[c]))
        differs += seq.tobytes() != d_warp_per_row(o, d_o).tobytes()
    assert differs > 0


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_helper_kernels_compile_for_sm90a_without_spills(tmp_path):
    """fa2_bwd's preprocess / convert / reduce kernels as sm90_bwd instantiates them, sm_90a."""
    fam = registry.get("sm90_bwd")
    exprs = {}
    for dtype in ("bf16", "fp16"):
        p = Problem("bwd", dtype, 1, 512, 512, 4, 4, 128, False)
        cfg = fam.heuristic(p, (9, 0), 227 * 1024)
        exprs.update({e: r for r, e in fam.kernel_names(cfg).items() if r != "main"})
    src = [render_source(fam.name)]
    src += [f"template __global__ void {e}({kernel_param_decl(fam, r)});" for e, r in exprs.items()]
    path = tmp_path / "helpers.cu"
    path.write_text("\n".join(src) + "\n")
    proc = subprocess.run(["nvcc", "-cubin", "-arch=sm_90a", "-std=c++17", "-Xptxas", "-v",
                           "-o", str(tmp_path / "helpers.cubin"), str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    reports = parse_ptxas(proc.stderr)
    assert len(reports) == len(exprs), proc.stderr
    assert all(r.spill_stores == 0 and r.spill_loads == 0 for r in reports), proc.stderr
