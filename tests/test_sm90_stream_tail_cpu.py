"""sm90_fwd's stream_tail (kStreamTail, kernels_cu/sm90_tail.cuh) without a GPU: the schedule's host
mirror (every (tile, block) unit run exactly once, a tile cut at most once, the finisher waiting only for
a lower blockIdx, per-CTA work balanced), the field's rules, name, template argument and encoding, the
plan's buffers and grid, for_problem dropping it with features or causal, and its kernels (the GPU
test's and the timing script's) compiled without spills or serialized wgmma (nvcc -cubin, sm_90a)."""
import os
import re
import shutil
import sys

import pytest

from cuflash import registry
from cuflash.families import sm90_fwd
from cuflash.families.sm90_fwd import Sm90FwdConfig, stream_tail_buffers, stream_tail_params, stream_tail_pieces
from cuflash.problem import Problem

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FAM = registry.get("sm90_fwd")
NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
PLAIN = Sm90FwdConfig(BM=128, BN=80, stages=2, consumers=2, pingpong=False, persistent=True, head_dim=256,
                      dtype="bf16", causal=False)
ST = PLAIN.replace(stream_tail=True)


@pytest.mark.parametrize("n_tiles,n,grid", [(1024, 26, 132), (2048, 13, 132), (272, 26, 132), (160, 1, 132),
                                            (144, 2, 132), (133, 7, 132), (132, 5, 132), (4, 26, 4),
                                            (1000, 0, 132), (300, 3, 7), (264, 26, 132), (265, 1, 132)])
def test_schedule_covers_every_unit_once(n_tiles, n, grid):
    pieces = stream_tail_pieces(n_tiles, n, grid)
    seen = {}
    for b, ps in enumerate(pieces):
        for t, jb, je in ps:
            assert 0 <= t < n_tiles and 0 <= jb < je <= n or (n == 0 and (jb, je) == (0, 0))
            for j in range(jb, je):
                assert (t, j) not in seen
                seen[(t, j)] = b
            if n == 0:
                seen[(t, -1)] = b
    assert len(seen) == n_tiles * max(n, 1)
    by_tile = {}
    for b, ps in enumerate(pieces):
        for t, jb, je in ps:
            by_tile.setdefault(t, []).append((b, jb, je))
    for t, parts in by_tile.items():
        assert len(parts) <= 2, (t, parts)          # a tile is cut at most once
        if len(parts) == 2:
            (bh, jbh, jeh), (bw, jbw, jew) = sorted(parts, key=lambda x: x[1])
            assert jbh == 0 and jeh == jbw and jew == n
            # the head piece (finisher) is its CTA's last, the writer its CTA's first of the stretch,
            # in the CTA just below (range + 1), whose slot is range + 1
            assert pieces[bh][-1] == (t, 0, jeh) and bw == bh - 1
            dp = [p for p in pieces[bw] if p[1] == 0 and p[2] == n and p[0] < n_tiles - (n_tiles - grid * (n_tiles // grid - 1))]
            assert pieces[bw][len(dp)] == (t, jbw, n)
    if n:
        work = [sum(je - jb for _, jb, je in ps) for ps in pieces]
        assert max(work) - min(work) <= 1, work    # balanced to one block
        assert max(len(ps) for ps in pieces) <= -(-n_tiles // grid) + 1


def test_ideal_gain_at_d256_2k():
    """1024 tiles on 132 CTAs: 8 tiles for the slowest CTA without it, 7.76 with it."""
    pieces = stream_tail_pieces(1024, 26, 132)
    assert max(sum(je - jb for _, jb, je in ps) for ps in pieces) / 26 < 7.8


def test_field_name_template_and_encoding():
    assert not PLAIN.stream_tail and ST.validate(227 * 1024) is ST
    assert ST.name == PLAIN.name + "_st"
    assert PLAIN.kernel_name() == ("cuflash::sm90_fwd<128, 80, 2, 2, false, true, 256, cuflash::bf16, false, "
                                   "false, false, false>")
    assert ST.kernel_name().endswith(", false, 0, true>") and ST.kernel_name().count(",") == 27
    assert ST.template_args()[-7] is True and PLAIN.template_args()[-7] is False   # (kPvOverlap, kMaskedCopy, kRagKeys, kPrefetch, kSAhead, kDeferMax after)
    assert "stream_tail" not in FAM.encode(PLAIN) and FAM.encode(ST).endswith(",stream_tail=1")
    assert FAM.decode(FAM.encode(ST), "bf16", False) == ST
    assert "stream_tail" not in FAM.space


@pytest.mark.parametrize("change,pattern", [
    (dict(persistent=False), r"needs the static persistent schedule"),
    (dict(dynamic=True), r"needs the static persistent schedule"),
    (dict(causal=True), r"non-causal fixed-length"),
    (dict(varlen=True), r"non-causal fixed-length"),
    (dict(tile_overlap=True), r"non-causal fixed-length"),
    (dict(pingpong=True), r"pingpong at head_dim=256 spills"),
    (dict(softcap=True), r"plain calls only"),
    (dict(dropout=True, BN=64), r"plain calls only"),
])
def test_rules(change, pattern):
    why = ST.replace(**change).problems(227 * 1024)
    assert any(re.search(pattern, w) for w in why), why


def test_for_problem_drops_it_with_features_or_causal():
    p = Problem("fwd", "bf16", 1, 2048, 2048, 8, 8, 256, False, features=("softcap",), softcap=30.0)
    assert FAM.for_problem(ST, p).stream_tail is False
    plain = Problem("fwd", "bf16", 1, 2048, 2048, 8, 8, 256, False)
    assert FAM.for_problem(ST, plain) == ST
    causal = Problem("fwd", "bf16", 1, 2048, 2048, 8, 8, 256, True)
    assert FAM.for_problem(ST.replace(causal=True), causal).stream_tail is False


def test_buffers_grid_and_params():
    bufs = stream_tail_buffers(ST)
    assert FAM.zeroed_counters(ST, Problem("fwd", "bf16", 8, 2048, 2048, 8, 8, 256, False)) == bufs
    assert bufs == {"tail_flags": sm90_fwd.STREAM_TAIL_MAX_CTAS * 256,
                    "tail_partial": sm90_fwd.STREAM_TAIL_MAX_CTAS * 33 * 256 * 4}
    assert FAM.zeroed_counters(PLAIN, Problem("fwd", "bf16", 8, 2048, 2048, 8, 8, 256, False)) == {}
    # a slot per CTA: fewer tiles than STREAM_TAIL_MAX_CTAS, fewer slots
    assert FAM.zeroed_counters(ST, Problem("fwd", "bf16", 1, 113, 2048, 4, 4, 256, False)) == {
        "tail_flags": 4 * 256, "tail_partial": 4 * 33 * 256 * 4}
    p = Problem("fwd", "bf16", 8, 2048, 2048, 8, 8, 256, False)
    assert FAM.launches(ST, p, 132)[0].grid == (132, 1, 1)
    assert FAM.launches(ST, p, 200)[0].grid == (sm90_fwd.STREAM_TAIL_MAX_CTAS, 1, 1)
    assert FAM.launches(PLAIN, p, 200)[0].grid == (200, 1, 1)


def test_heuristic_takes_it_only_where_listed(monkeypatch):
    p = Problem.fa_convention("fwd", "bf16", 256, False, 2048)
    assert FAM.heuristic(p).stream_tail is (( 256, p.bucket) in sm90_fwd.HEURISTIC_STREAM_TAIL)
    monkeypatch.setattr(sm90_fwd, "HEURISTIC_STREAM_TAIL", frozenset({(256, p.bucket)}))
    monkeypatch.setattr(sm90_fwd, "HEURISTIC_LAZY", frozenset())   # (lazy_rescale replaces it where listed)
    cfg = FAM.heuristic(p)
    assert cfg.stream_tail and not cfg.problems(227 * 1024)
    assert not FAM.heuristic(Problem.fa_convention("fwd", "bf16", 256, True, 2048)).stream_tail


@needs_nvcc
def test_kernels_compile_without_spills_or_serialization():
    from cuflash.compile import nvcc_compile

    import sm90_fwd_cells_timing as timing

    cfgs = timing.stream_tail_test_configs()
    have = {c.kernel_name() for c in cfgs}
    cfgs += [c for c in timing.all_configs(("bf16", "fp16")) if c.stream_tail and c.kernel_name() not in have]
    assert 5 <= len(cfgs) <= 12
    for c, r in zip(cfgs, nvcc_compile(cfgs, "sm_90a")):
        assert r.spill_stores == 0 and r.spill_loads == 0 and not r.warnings, (c.name, r)


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not on PATH")
def test_device_schedule_matches_the_mirror(tmp_path):
    """kernels_cu/sm90_tail.cuh's Sm90TailSchedule, compiled for the host (g++, gridDim / blockIdx as
    globals), gives every CTA the pieces of stream_tail_pieces (a mismatch would hang a finisher)."""
    import subprocess

    from cuflash.compile import kernel_dir

    text = (kernel_dir() / "sm90_tail.cuh").read_text()
    struct = re.search(r"struct Sm90TailSchedule \{.*?\n\};\n", text, re.S).group(0)
    cases = [(1024, 26, 132), (2048, 13, 132), (272, 26, 132), (160, 1, 132), (144, 2, 132), (133, 7, 132),
             (4, 26, 4), (1000, 0, 132), (300, 3, 7), (265, 1, 132), (816, 26, 132), (1024, 205, 132),
             (2048, 94, 132), (1056, 1000, 132), (300, 12345, 144)]
    src = tmp_path / "sched.cpp"
    src.write_text("""#include <cstdio>
#include <algorithm>
#define __device__
#define __forceinline__ inline
using std::min;
typedef long long i64;
typedef unsigned int u32;
typedef unsigned long long u64;
struct Dim { int x; } gridDim, blockIdx;
""" + struct + """
int main() {
    int n_tiles, n, grid, dp_end, q, rem, magic, shift;
    while (std::scanf("%d %d %d %d %d %d %d %d", &n_tiles, &n, &grid, &dp_end, &q, &rem, &magic, &shift) == 8) {
        gridDim.x = grid;
        for (int b = 0; b < grid; ++b) {
            blockIdx.x = b;
            Sm90TailSchedule s(n_tiles, n, dp_end, q, rem, magic, shift);
            std::printf("%d:", b);
            for (int t = s.first(); t < n_tiles; t = s.next(t)) std::printf(" %d,%d,%d", t, s.jb, s.je);
            std::printf("\\n");
        }
    }
}
""")
    exe = tmp_path / "sched"
    subprocess.run(["g++", "-std=c++17", "-O1", "-o", str(exe), str(src)], check=True)
    def line(a, b, c):
        tp = stream_tail_params(a, b, c)
        return " ".join(str(x) for x in (a, b, c, tp["tail_dp_end"], tp["tail_q"], tp["tail_rem"], tp["tail_magic"],
                                         tp["tail_shift"])) + "\n"

    out = subprocess.run([str(exe)], input="".join(line(a, b, c) for a, b, c in cases), capture_output=True,
                         text=True, check=True).stdout.splitlines()
    want = []
    for n_tiles, n, grid in cases:
        for b, pieces in enumerate(stream_tail_pieces(n_tiles, n, grid)):
            want.append(f"{b}:" + "".join(f" {t},{jb},{je}" for t, jb, je in pieces))
    assert out == want


@pytest.mark.parametrize("n", [1, 2, 3, 7, 13, 26, 80, 205, 1000, 12345, 65535, 1 << 20, (1 << 24) + 1])
def test_magic_division_is_exact(n):
    import random

    tp = stream_tail_params(132 * 2, n, 132) if n * 132 < 2 ** 31 else None
    shift = 31 + (n - 1).bit_length()
    magic = -(-(1 << shift) // n)
    if tp is not None:
        assert tp["tail_shift"] == shift and tp["tail_magic"] % 2 ** 32 == magic
    rng = random.Random(n)
    xs = [0, 1, n - 1, n, n + 1, 2 ** 31 - 1, 2 ** 31 - n] + [rng.randrange(2 ** 31) for _ in range(2000)]
    for x in xs:
        if 0 <= x < 2 ** 31:
            assert (x * magic) >> shift == x // n, (x, n)


def test_params_refuse_a_stretch_past_32_bits():
    with pytest.raises(ValueError, match="2\\^31"):
        stream_tail_params(264, 2 ** 24, 132)
