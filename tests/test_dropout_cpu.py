"""Dropout's random numbers: kernels_cu/philox.cuh and its NumPy mirror cuflash/dropout.py.

The mirror computes the keep mask the kernels draw, bit for bit (the GPU tests compare a
kernel's S_dmask with it); here the two are held to Random123's known-answer vectors and to
each other (philox.cuh compiled for the host by nvcc)."""
import os
import shutil
import subprocess

import numpy as np
import pytest

from cuflash import dropout
from cuflash.compile import kernel_dir

NVCC = os.environ.get("NVCC", "nvcc")

# Random123's known answers (its kat_vectors file) for Philox4x32-R: (rounds, counter + key) ->
# output; 7 rounds are the mask's (dropout.PHILOX_ROUNDS), 10 check the round loop once more
KAT = [(7, (0, 0, 0, 0, 0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
       (7, (0xFFFFFFFF,) * 6, (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
       (7, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344, 0xA4093822, 0x299F31D0),
        (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
       (10, (0, 0, 0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
       (10, (0xFFFFFFFF,) * 6, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
       (10, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344, 0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


def test_mask_rounds_are_seven():
    assert dropout.PHILOX_ROUNDS == 7


@pytest.mark.parametrize("rounds,args,want", KAT)
def test_numpy_philox_known_answers(rounds, args, want):
    assert tuple(int(x) for x in dropout.philox4x32(*args, rounds=rounds)) == want


def _philox_bytes(seed, offset, bh, c0, c1):
    """The 16 keep bytes of one call (counter words c0, c1 of head bh), as philox.cuh draws them."""
    seed, offset = seed & (2 ** 64 - 1), offset & (2 ** 64 - 1)
    words = dropout.philox4x32(c0, c1, bh, offset & 0xFFFFFFFF, seed & 0xFFFFFFFF,
                                  (seed >> 32) ^ (offset >> 32))
    return np.array([int(w) for w in words], "<u4").view(np.uint8)


def _forward_tile(seed, offset, thr, bh, query0, key0, mt_tiles, n_tiles):
    """Dropout::zero_dropped's walk, lane by lane (no shared state between lanes): the keep mask of a
    warp's (16·mt_tiles) x (8·n_tiles) tile at (query0, key0), rows = queries."""
    out = np.zeros((16 * mt_tiles, 8 * n_tiles), bool)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for mt in range(mt_tiles):
            for blk in range(n_tiles // 4):
                row, col = query0 + 16 * mt + g, key0 + 32 * blk + 2 * t
                b16 = _philox_bytes(seed, offset, bh, 4 * (col // 32) + (col % 8) // 2,
                                    8 * (row // 16) + row % 8)
                for ct in range(4):
                    for b in range(4):   # acc[mt][4 blk + ct][b]: row g + 8 (b // 2), column 8 nt + 2t + b % 2
                        out[16 * mt + g + 8 * (b // 2), 8 * (4 * blk + ct) + 2 * t + b % 2] = b16[4 * ct + b] >= thr
    return out


def _transposed_tile(seed, offset, thr, bh, key0, query0, mt_tiles, n_tiles):
    """Dropout::visit_transposed's walk, lane by lane, with its shuffle (lane ^ 4) spelled
    out: the keep mask of a warp's (16·mt_tiles) keys x (8·n_tiles) queries tile (rows = keys),
    returned transposed (queries x keys)."""
    out = np.zeros((8 * n_tiles, 16 * mt_tiles), bool)
    for mt in range(mt_tiles):
        for qb in range(n_tiles // 2):
            own, send = {}, {}
            for lane in range(32):
                g, t = lane // 4, lane % 4
                gp, key = g & 1, key0 + 16 * mt + g
                row = query0 + 16 * qb + 2 * t + gp
                b16 = _philox_bytes(seed, offset, bh, 4 * (key // 32) + (key % 8) // 2,
                                    8 * (row // 16) + row % 8)
                w0, w1 = (b16[4 * (2 * ((key & 16) >> 4) + hk):][:4] for hk in (0, 1))
                own[lane] = [w0[gp], w0[2 + gp], w1[gp], w1[2 + gp]]
                send[lane] = [w0[1 - gp], w0[3 - gp], w1[1 - gp], w1[3 - gp]]
            for lane in range(32):
                g, t = lane // 4, lane % 4
                gp = g & 1
                by_e = {gp: own[lane], 1 - gp: send[lane ^ 4]}
                for e in (0, 1):
                    for hk in (0, 1):
                        for hr in (0, 1):
                            q = 16 * qb + 8 * hr + 2 * t + e
                            out[q, 16 * mt + g + 8 * hk] = by_e[e][2 * hk + hr] >= thr
    return out


@pytest.mark.parametrize("row_tile,col_tile", [(16, 32), (32, 64), (64, 96), (48, 128)])
def test_keep_mask_is_the_same_under_every_tiling(row_tile, col_tile):
    """The kernels' walks (Dropout::zero_dropped: rows = queries, blocks of 32 keys; visit_transposed:
    rows = keys, 16-key tiles at either half of a 32-key block, the pair shuffle) tile the
    matrix differently, yet all give keep_mask: the mask is a function of the coordinates."""
    seed, offset, p, bh, sq, sk = 0x0123_4567_89AB_CDEF, (7 << 32) + 5, 0.3, 3, 192, 384
    thr = dropout.drop_threshold(p)
    want = dropout.keep_mask(seed, offset, p, 1, bh + 1, sq, sk)[0, bh]
    fwd = np.zeros_like(want)
    for q0 in range(0, sq, row_tile):
        for k0 in range(0, sk, col_tile):
            fwd[q0:q0 + row_tile, k0:k0 + col_tile] = _forward_tile(
                seed, offset, thr, bh, q0, k0, row_tile // 16, col_tile // 8)
    np.testing.assert_array_equal(fwd, want)
    bwd = np.zeros_like(want)
    for k0 in range(0, sk, row_tile):          # the backward's rows are keys: 16-key tiles may
        for q0 in range(0, sq, 32):           # start at 16 mod 32
            bwd[q0:q0 + 32, k0:k0 + row_tile] = _transposed_tile(
                seed, offset, thr, bh, k0, q0, row_tile // 16, 4)
    np.testing.assert_array_equal(bwd, want)


def test_keep_mask_kept_share_is_one_minus_p():
    """Over 2^22 elements the kept share is 1 - round(p·256)/256 within 5 standard errors, for
    every byte position of a call (row and column parity classes) alike."""
    for p in (0.1, 0.17, 0.5):
        m = dropout.keep_mask(99, 3, p, 2, 4, 512, 1024)
        q = 1 - dropout.drop_threshold(p) / 256
        for part in (m, m[..., 0::2, 0::2], m[..., 1::2, 1::2], m[..., 8:16, 24:32]):
            se = np.sqrt(q * (1 - q) / part.size)
            assert abs(part.mean() - q) < 5 * se, (p, part.shape, part.mean(), q)
        # neighbours are independent: the share of pairs both kept is q²
        both = (m[..., :, :-1] & m[..., :, 1:]).mean()
        assert abs(both - q * q) < 5 * np.sqrt(q * q * (1 - q * q) / m[..., :, 1:].size) * 2


def test_keep_mask_shape_rate_and_determinism():
    m = dropout.keep_mask(1234, 77, 0.17, 2, 3, 65, 200)
    assert m.shape == (2, 3, 65, 200) and m.dtype == bool
    assert abs(m.mean() - (1 - dropout.drop_threshold(0.17) / 256)) < 0.01
    assert np.array_equal(m, dropout.keep_mask(1234, 77, 0.17, 2, 3, 65, 200))
    assert not np.array_equal(m, dropout.keep_mask(1234, 78, 0.17, 2, 3, 65, 200))   # offset
    assert not np.array_equal(m, dropout.keep_mask(1235, 77, 0.17, 2, 3, 65, 200))   # seed
    # a column's bits do not depend on seqlen_k, nor a row's on seqlen_q (the counter is
    # the element's coordinates)
    assert np.array_equal(m[..., :100], dropout.keep_mask(1234, 77, 0.17, 2, 3, 65, 100))
    assert np.array_equal(m[..., :40, :], dropout.keep_mask(1234, 77, 0.17, 2, 3, 40, 200))
    assert dropout.keep_mask(1, 2, 0.0, 1, 1, 4, 40).all()


@pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
def test_philox_cuh_matches_the_numpy_mirror(tmp_path):
    """philox.cuh, compiled for the host, gives the mirror's known answers and keep mask (the
    canonical byte -> column order included) for a seed and offset with high bits set."""
    seed, offset, p, bh, sq, sk = 0x1234_5678_9ABC_DEF0, 0x0000_0003_0000_0010, 0.17, 6, 33, 70
    src = tmp_path / "t.cu"
    src.write_text(f'''#include "philox.cuh"
#include <cstdio>
using namespace cuflash;
int main() {{
    auto r = philox4x32<kPhiloxRounds>(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u);
    printf("%08x %08x %08x %08x\\n", r.w[0], r.w[1], r.w[2], r.w[3]);
    r = philox4x32<10>(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u);
    printf("%08x %08x %08x %08x\\n", r.w[0], r.w[1], r.w[2], r.w[3]);
    const Dropout d = Dropout::make({seed}ull, {offset}ull, {p}f);
    for (int h = 0; h < {bh}; ++h)
        for (int i = 0; i < {sq}; ++i) {{
            for (int j = 0; j < {sk}; ++j) {{
                const PhiloxWords w = d.draw(h, i, j);   // the canonical layout, spelled out
                const bool kept = d.factor(w.w[(j % 32) / 8], 2 * ((i % 16) / 8) + j % 2) != 0.f;
                if (kept != d.keep(h, i, j)) return 1;
                putchar(kept ? '1' : '0');
            }}
            putchar('\\n');
        }}
}}
''')
    exe = tmp_path / "t"
    subprocess.run([NVCC, "-I", str(kernel_dir()), "-o", str(exe), str(src)], check=True,
                   capture_output=True)
    lines = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    assert lines[:8] == ["4dfccaba", "190a87f0", "c47362ba", "b6b5242a",
                         "d16cfe09", "94fdcceb", "5001e420", "24126ea1"]
    got = np.array([[c == "1" for c in line] for line in lines[8:]]).reshape(1, bh, sq, sk)
    assert np.array_equal(got, dropout.keep_mask(seed, offset, p, 1, bh, sq, sk))


@pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_dropout_apply_compiles_to_registers(tmp_path, arch):
    """Dropout.zero_dropped / apply_transposed on accumulator tiles of the shapes the kernels use
    (sm90_fwd's 1 x 22: an odd number of 16-column blocks) keep everything in registers: no
    stack frame, no spills (a run-time index into a register array would put it in memory)."""
    src = tmp_path / "k.cu"
    src.write_text('''#include "philox.cuh"
using namespace cuflash;
template <int kMT, int kNT, bool kT, bool kP = false>
__global__ void k(float* out, Dropout d) {
    float acc[kMT][kNT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)\n#pragma unroll\n for (int nt = 0; nt < kNT; ++nt)\n#pragma unroll\n for (int e = 0; e < 4; ++e)\n   
        acc[mt][nt][e] = out[threadIdx.x + 32 * (e + 4 * (nt + kNT * mt))];
    if constexpr (kT)
        d.template apply_transposed<kP>(acc, blockIdx.y, 64 * blockIdx.x, 16 * blockIdx.z, threadIdx.x % 32 / 4, threadIdx.x % 4);
    else
        d.zero_dropped(acc, blockIdx.y, 64 * blockIdx.x, 16 * blockIdx.z, threadIdx.x % 32 / 4, threadIdx.x % 4);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)\n#pragma unroll\n for (int nt = 0; nt < kNT; ++nt)\n#pragma unroll\n for (int e = 0; e < 4; ++e)\n   
        out[threadIdx.x + 32 * (e + 4 * (nt + kNT * mt))] = acc[mt][nt][e];
}
template __global__ void k<1, 16, false>(float*, Dropout);   // fa2_fwd Br 128, 8 warps, Bc 128
template __global__ void k<2, 8, false>(float*, Dropout);    // fa2_fwd Br 128, 4 warps, Bc 64
template __global__ void k<1, 20, false>(float*, Dropout);   // sm90_fwd BN 160
template __global__ void k<2, 8, true>(float*, Dropout);     // fa2_bwd: 32 keys x 64 queries a warp
template __global__ void k<1, 4, true>(float*, Dropout);     // fa2_bwd: 16 keys x 32 queries
template __global__ void k<2, 8, true, true>(float*, Dropout);   // fa2_bwd, tiles paired (kPairs)
''')
    res = subprocess.run([NVCC, "-cubin", f"-arch={arch}", "-Xptxas", "-v", "-I", str(kernel_dir()),
                          "-o", str(tmp_path / "k.cubin"), str(src)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    frames = [line for line in res.stderr.splitlines() if "stack frame" in line]
    assert len(frames) == 6 and all("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"
                                    in line for line in frames), res.stderr


# ---------------------------------------------------------------------------------------
# dropout wired into fa2_fwd / fa2_bwd and the API (no GPU needed)

from cuflash import NoGPUError, api, flash_attn_func, registry  # noqa: E402
from cuflash.problem import Problem  # noqa: E402


def drop_problem(op="fwd", d=64, causal=False, p=0.1, **kw):
    return Problem(op, "bf16", 2, 300, 300, 4, 4, d, causal, features=("dropout",), dropout_p=p, **kw)


def test_families_support_dropout_and_configs_carry_the_flag():
    fwd, bwd, sm90 = (registry.get(n) for n in ("fa2_fwd", "fa2_bwd", "sm90_fwd"))
    assert fwd.supports((9, 0), drop_problem()) == ""
    assert bwd.supports((8, 0), drop_problem("bwd")) == ""
    assert sm90.supports((9, 0), drop_problem()) == ""   # sm_90 runs it (test_sm90_dropout_cpu.py)
    assert fwd.supports((9, 0), drop_problem().replace(features=("dropout", "window"))) == ""
    cfg = fwd.for_problem(fwd.heuristic(drop_problem()), drop_problem())
    assert cfg.dropout and cfg.name.endswith("_drop") and cfg.kernel_name().endswith("bf16, false, false, true, false, false, false>")
    assert cfg.template_args()[-4] is True   # kDropout, then kWindow, kSoftcap, kAlibi
    plain = fwd.heuristic(drop_problem().replace(features=()))
    assert not plain.dropout and plain.kernel_name().endswith("bf16, false, false, false, false, false, false>")
    assert fwd.decode(fwd.encode(cfg), "bf16", False) == cfg
    bcfg = bwd.for_problem(bwd.heuristic(drop_problem("bwd")), drop_problem("bwd", deterministic=True))
    assert bcfg.dropout and bcfg.deterministic and bcfg.kernel_name().endswith("bf16, false, true, false, true, false, false, false>")
    assert not bwd.for_problem(bcfg, drop_problem("bwd").replace(features=())).dropout


def test_params_carry_threshold_scale_and_an_rng_pointer():
    from cuflash.launch import struct_dtype

    for fam_name in ("fa2_fwd", "fa2_bwd"):
        fam = registry.get(fam_name)
        names = struct_dtype(fam.params_struct).names
        assert names[-9:-6] == ("rng_state", "dropout_threshold", "dropout_scale")   # then features
        problem = drop_problem(fam.op, p=0.17)
        cfg = fam.for_problem(fam.heuristic(problem), problem)
        strides = {n: (300 * 4 * 64, 4 * 64, 64, 1) for n in ("q", "k", "v", "o", "dout", "dq", "dk", "dv")}
        static = fam.static_params(cfg, problem, strides, fam.workspace(cfg, problem, strides), 0.125, 132)
        assert static["dropout_threshold"] == 44 == dropout.drop_threshold(0.17)   # round(0.17 * 256)
        assert static["dropout_scale"] == float(np.float32(1) / (np.float32(1) - np.float32(0.17)))
        assert static["rng_state"] == 0   # a per-call pointer (Plan.run_with)


def test_numpy_dropout_needs_a_seed_before_any_gpu(monkeypatch):
    from cuflash import _gpu

    q = np.zeros((1, 8, 2, 64), np.float16)
    with pytest.raises(ValueError, match=r"^dropout_seed: numpy inputs with dropout_p > 0 need"):
        flash_attn_func(q, q, q, 0.1)
    for bad, err in ((1.5, TypeError), ((1, 2, 3), TypeError), (True, TypeError), (-1, ValueError),
                     ((0, 2 ** 64), ValueError)):
        with pytest.raises(err, match=r"^dropout_seed"):
            flash_attn_func(q, q, q, 0.1, dropout_seed=bad)
    assert api.check_dropout_seed(7) == (7, 0) and api.check_dropout_seed((7, 9)) == (7, 9)
    monkeypatch.setattr(_gpu, "why_unavailable", lambda: "no GPU in this test")
    with pytest.raises(NoGPUError):
        flash_attn_func(q, q, q, 0.1, dropout_seed=3)
    with pytest.raises(ValueError, match=r"^dropout_seed: flash_attn_backward with dropout_p > 0"):
        api.flash_attn_backward(q, q, q, q, q, np.zeros((1, 2, 8), np.float32), dropout_p=0.1)


def test_dropout_probs_host_matches_the_reference_and_the_mask():
    from cuflash import reference

    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((1, 21, 4, 16)).astype(np.float16) for _ in range(2))
    k = k[:, :, :2]   # GQA: 4 query heads, 2 K/V heads
    v = np.zeros_like(k)
    _, lse = reference.attention_naive(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                       causal=True, return_lse=True)
    probs = dropout.dropout_probs_host(q.view(np.uint16), k.view(np.uint16), lse, "fp16", 0.25,
                                       True, 0.3, 11, 5)
    keep = dropout.keep_mask(11, 5, 0.3, 1, 4, 21, 21)
    visible = np.tril(np.ones((21, 21), bool))
    assert (probs[..., ~visible] == 0).all()
    assert ((probs > 0) == keep)[..., visible].all()
    np.testing.assert_allclose(np.abs(probs).sum(-1), 1.0, rtol=1e-5)


@pytest.mark.skipif(shutil.which(NVCC) is None, reason="needs nvcc (no GPU)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_dropout_instantiations_compile(arch):
    """The dropout heuristics of fa2_fwd (zero spills, as the plain ones) and fa2_bwd (compiles;
    its heuristic may spill a few bytes, as tests/test_compile.py allows for fa2_bwd), head dims
    64 / 128 / 256, both masks, both dtypes across them."""
    from cuflash.compile import nvcc_compile

    archcc = (9, 0) if arch == "sm_90a" else (8, 0)
    for op in ("fwd", "bwd"):
        fam = registry.get(f"fa2_{op}")
        cfgs = []
        for i, (d, causal) in enumerate([(64, False), (64, True), (128, False), (128, True),
                                         (256, True)]):
            problem = drop_problem(op, d, causal).replace(dtype=("bf16", "fp16")[i % 2])
            cfgs.append(fam.for_problem(fam.heuristic(problem, archcc), problem))
        reports = nvcc_compile(cfgs, arch)
        for cfg, rep in zip(cfgs, reports):
            assert cfg.dropout
            if op == "fwd":
                assert rep.spill_stores == 0 and rep.spill_loads == 0, (cfg.name, rep)


def test_plan_run_with_writes_the_rng_pointer_for_the_launch_only():
    """Plan.run_with packs the per-call rng_state pointer where params.cuh puts it, for the
    launches only (a plain run afterwards sees 0); the struct bytes are what the driver gets."""
    import struct
    import threading

    from cuflash.launch import Plan, pack, struct_dtype

    dtype = struct_dtype("FwdParams")
    plan = object.__new__(Plan)
    fields = {n: 0 for n in dtype.names}
    plan._record = pack("FwdParams", **fields)
    plan._bytes = plan._record.view(np.uint8)
    plan._argv_ptr = 0
    plan._ws_offsets = ()
    plan._pack = struct.Struct("<5Q").pack_into
    plan._field_offsets = {n: dtype.fields[n][1] for n in dtype.names[5:] if dtype.fields[n][0] == np.uint64}
    plan._write_call = None
    plan._counter_fields = ()      # no cross-CTA counters (launch.StreamCounters)
    plan._lock = threading.Lock()
    plan._calls = ((111, 1, 1, 1, 128, 0),)
    plan.device = 0
    plan._get_device, plan._set_device = (lambda: 0), (lambda d: None)
    seen = []
    plan._launch = lambda *a: seen.append(bytes(plan._bytes))
    plan.family = registry.get("fa2_fwd")
    plan.run_with((1, 2, 3, 4, 5), 0, 0, (("rng_state", 0xABCDEF0),))
    rec = np.frombuffer(seen[0], dtype=dtype)[0]
    assert rec["rng_state"] == 0xABCDEF0 and rec["q"] == 1 and rec["lse"] == 5
    assert plan._record["rng_state"][0] == 0
    with pytest.raises(KeyError, match="rng"):
        plan.run_with((1, 2, 3, 4, 5), 0, 0, (("rng", 1),))


def test_torch_dropout_autograd_plumbing_with_reference_kernels(monkeypatch):
    """torch_ops.dropout_attention's autograd path (state drawn once, kept for the backward,
    head dim padding) on CPU, the launches replaced by the float64 reference with the mirror's
    mask of the same state: the gradients must be the masked reference's."""
    torch = pytest.importorskip("torch")
    from cuflash import reference, torch_ops

    def mask_of(rng, p, b, h, sq, sk):
        seed, offset = (int(x) & (2 ** 64 - 1) for x in rng.tolist())
        return dropout.keep_mask(seed, offset, p, b, h, sq, sk)

    def fake_forward(q, k, v, problem, scale, rng, config=None):
        b, sq, h, _ = q.shape
        keep = mask_of(rng, problem.dropout_p, b, h, sq, k.shape[1])
        out, lse = reference.attention_naive(*(x.detach().double().numpy() for x in (q, k, v)),
                                             softmax_scale=scale, causal=problem.causal, return_lse=True,
                                             dropout_p=problem.dropout_p, dropout_mask=keep)
        return torch.from_numpy(out).to(q.dtype), torch.from_numpy(lse).float()

    def fake_backward(dout, q, k, v, out, lse, problem, scale, rng, config=None):
        b, sq, h, _ = q.shape
        keep = mask_of(rng, problem.dropout_p, b, h, sq, k.shape[1])
        grads = reference.attention_backward_naive(
            *(x.detach().double().numpy() for x in (dout, q, k, v)), softmax_scale=scale,
            causal=problem.causal, dropout_p=problem.dropout_p, dropout_mask=keep)
        return tuple(torch.from_numpy(g).to(x.dtype) for g, x in zip(grads, (q, k, v)))

    monkeypatch.setattr(torch_ops, "dropout_forward", fake_forward)
    monkeypatch.setattr(torch_ops, "dropout_backward", fake_backward)
    torch.manual_seed(0)
    b, sq, sk, h, h_kv, d = 1, 9, 13, 4, 2, 12          # d 12: padded to 16
    q = torch.randn(b, sq, h, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, sk, h_kv, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, sk, h_kv, d, dtype=torch.float64, requires_grad=True)
    problem = Problem("fwd", "bf16", b, sq, sk, h, h_kv, d, True, features=("dropout",), dropout_p=0.3)
    out, lse, rng = torch_ops.dropout_attention(q, k, v, problem, 0.3)
    assert out.shape == q.shape and rng.dtype == torch.int64 and rng.shape == (2,)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    keep = mask_of(rng, 0.3, b, h, sq, sk)
    want_out = reference.attention_naive(*(x.detach().numpy() for x in (q, k, v)), softmax_scale=0.3,
                                         causal=True, dropout_p=0.3, dropout_mask=keep)
    want = reference.attention_backward_naive(*(x.detach().numpy() for x in (dout, q, k, v)),
                                              softmax_scale=0.3, causal=True, dropout_p=0.3,
                                              dropout_mask=keep)
    np.testing.assert_allclose(out.detach().numpy(), want_out, atol=1e-12)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g.numpy(), w, atol=1e-12)


def test_numpy_dropout_with_a_padded_head_dim_reaches_the_gpu_check(monkeypatch):
    """head dim 60 is run zero-padded to 64: the padded call must describe the padded copies
    (it recursed forever on the caller's unpadded description)."""
    from cuflash import _gpu

    monkeypatch.setattr(_gpu, "why_unavailable", lambda: "no GPU in this test")
    q = np.zeros((1, 8, 2, 60), np.float16)
    with pytest.raises(NoGPUError):
        flash_attn_func(q, q, q, 0.1, dropout_seed=3)


def test_backward_with_dropout_and_a_window_keeps_dropout_p():
    """flash_attn_backward with dropout and a window / softcap takes the dropout path (never
    drops dropout_p): torch CPU tensors are refused there by name, as dropout alone."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 2, 16, generator=g, dtype=torch.float64)
    lse = torch.zeros(1, 2, 8, dtype=torch.float32)
    for kw in ({"window_size": (2, 2)}, {"softcap": 5.0}):
        with pytest.raises(api.UnsupportedFeature, match=r"^dropout_p: flash_attn_backward with "
                                                         r"dropout on torch CPU"):
            api.flash_attn_backward(q, q, q, q, q, lse, dropout_p=0.1, dropout_seed=1, **kw)
        with pytest.raises(ValueError, match=r"^dropout_seed: flash_attn_backward with dropout_p"):
            api.flash_attn_backward(q, q, q, q, q, lse, dropout_p=0.1, **kw)


def test_a_callers_rng_state_tensor_is_copied_for_the_backward(monkeypatch):
    """dropout_seed given as a state tensor: autograd's backward must regenerate the forward's
    mask even when the caller updates that tensor in place before backward (e.g. the next
    micro-batch's offset)."""
    torch = pytest.importorskip("torch")
    from cuflash import torch_ops

    seen = []
    monkeypatch.setattr(torch_ops, "dropout_attention",
                        lambda q, k, v, problem, scale, rng, config, bwd_config, slopes=None:
                        seen.append(rng) or (q, None, rng))
    q = torch.zeros(1, 8, 2, 16, dtype=torch.float16)
    state = torch.tensor([5, 7], dtype=torch.int64)
    tq, tk = api.describe("q", q), api.describe("k", q)
    problem = Problem("fwd", "fp16", 1, 8, 8, 2, 2, 16, False, False, ("dropout",), dropout_p=0.1)
    api._dropout_func(q, q, q, tq, tk, problem, 0.25, state, False, None, None)
    state[1] += 1
    assert seen[0] is not state and seen[0].tolist() == [5, 7]
    with pytest.raises(TypeError, match=r"^dropout_seed"):   # validated on the plain path too
        flash_attn_func(q.float(), q.float(), q.float(), window_size=(-1, 0), dropout_seed=1.5)


def test_backward_with_dropout_on_torch_cpu_raises_before_any_plan(monkeypatch):
    """torch CPU tensors: no GPU plan may be built for them (a GPU machine would launch on
    CPU addresses); the error names dropout_p."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(api, "make_plan", lambda *a, **k: pytest.fail("a GPU plan for CPU tensors"))
    q = torch.zeros(1, 8, 2, 16, dtype=torch.float16)
    lse = torch.zeros(1, 2, 8, dtype=torch.float32)
    with pytest.raises(api.UnsupportedFeature, match=r"^dropout_p: flash_attn_backward"):
        api.flash_attn_backward(q, q, q, q, q, lse, dropout_p=0.1, dropout_seed=1)


def test_torch_gpu_route_without_a_seed_draws_from_torch(monkeypatch):
    """A torch GPU call with dropout and no dropout_seed passes rng=None down (the torch route
    then draws a state from torch's generator); it must not treat None as the caller's tensor."""
    torch = pytest.importorskip("torch")
    from cuflash import torch_ops

    seen = []

    def fake_dropout_attention(q, k, v, problem, scale, rng, config, bwd_config, slopes=None):
        seen.append(rng)
        return q, torch.zeros(1), None

    monkeypatch.setattr(torch_ops, "dropout_attention", fake_dropout_attention)
    q = torch.zeros(1, 3, 2, 8)
    tq = api._Tensor("torch", "bf16", (1, 3, 2, 8), (48, 16, 8, 1), 0, 0)
    out = api._dropout_func(q, q, q, tq, tq, drop_problem(d=8), 0.35, None, False, None, None)
    assert out is q and seen == [None]
    state = torch.tensor([5, 0], dtype=torch.int64)
    monkeypatch.setattr(torch_ops, "rng_state_of", lambda seed, device: seed)
    api._dropout_func(q, q, q, tq, tq, drop_problem(d=8), 0.35, state, False, None, None)
    assert seen[1] is not state and torch.equal(seen[1], state)  # the caller's tensor is copied
