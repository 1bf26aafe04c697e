"""Forward kernels on the GPU, the FlashAttention way, for every registered family of op fwd.

Error of cuflash against a float64 reference must be at most twice the error of plain
attention computed in the same low precision (torch, no fusion), on fresh random inputs,
with outputs poisoned (NaN) before each launch. The float64 reference runs on the GPU
(torch) for speed; a subset is also checked against cuflash.reference (NumPy).

Each family is forced with config=: its heuristic on the full grid (conftest's GPU_SEQLENS x
GPU_HDIMS x GPU_HEADS x dtypes x masks), and every valid point of its space on a small
ragged shape (test ids = config names). Run tests/gpu_precompile.py first to fill CuPy's
kernel cache in parallel.
"""
import math

import numpy as np
import pytest

import cuflash
from cuflash import api, launch, reference, registry, torch_ops
from cuflash.problem import Problem

from conftest import SPACE_SHAPE, cuda_randn as rand, device_heuristic, grid_params, grid_problem  # noqa: E402
from conftest import require_fits_device, space_params, torch_attention, torch_dtype  # noqa: E402
from conftest import GPU_HEADS  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]


def check_forward(out, lse, q, k, v, causal, scale, what=""):
    """The FlashAttention rule for out, exact +inf LSE for fully masked rows, LSE to 1e-3."""
    import torch

    ref, ref_lse = torch_attention(q, k, v, causal, scale, torch.float64)
    low, _ = torch_attention(q, k, v, causal, scale, q.dtype)
    assert not torch.isnan(out).any(), f"{what}unwritten (NaN-poisoned) output elements"
    err = (out.double() - ref).abs().max().item()
    base = (low.double() - ref).abs().max().item()
    assert err <= 2 * base + 1e-5, \
        f"{what}cuflash error {err:.3g} > 2 x plain {q.dtype} attention error {base:.3g}"
    assert not torch.isnan(lse).any(), f"{what}unwritten LSE"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"{what}fully masked rows must have LSE = +inf"
    assert (lse[~finite] == math.inf).all()
    lse_err = (lse.double() - ref_lse)[finite].abs().max().item() if finite.any() else 0.0
    assert lse_err < 1e-3, f"{what}LSE error {lse_err:.3g}"


def inputs(problem):
    tdtype = torch_dtype(problem.dtype)
    p = problem
    return (rand((p.batch, p.seqlen_q, p.nheads, p.head_dim), tdtype),
            rand((p.batch, p.seqlen_k, p.nheads_kv, p.head_dim), tdtype),
            rand((p.batch, p.seqlen_k, p.nheads_kv, p.head_dim), tdtype))


# ---------------------------------------------------------------------------------------
# every family: its heuristic on the full grid, every point of its space

@pytest.mark.parametrize("family,dtype,causal,hdim,seqlens,heads", grid_params("fwd"))
def test_heuristic_on_the_grid(family, dtype, causal, hdim, seqlens, heads):
    problem = grid_problem("fwd", dtype, causal, hdim, seqlens, heads)
    cfg = device_heuristic(family, problem)
    q, k, v = inputs(problem)
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, config=cfg)
    check_forward(out, lse, q, k, v, causal, 1 / math.sqrt(hdim))


@pytest.mark.parametrize("family,config", space_params("fwd"))
def test_every_point_of_the_space(family, config):
    require_fits_device(config)
    import torch

    s = SPACE_SHAPE
    q = rand((s["batch"], s["seqlen_q"], s["nheads"], config.head_dim), torch_dtype(config.dtype))
    k, v = (rand((s["batch"], s["seqlen_k"], s["nheads_kv"], config.head_dim), q.dtype) for _ in range(2))
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=config.causal, return_attn_probs=True,
                                          config=config)
    check_forward(out, lse, q, k, v, config.causal, config.head_dim ** -0.5, f"{config.name}: ")
    assert torch.equal(out, cuflash.flash_attn_func(q, k, v, causal=config.causal, config=config)), \
        "the forward is deterministic"


@pytest.mark.parametrize("shape", [(3, 1023, 1023, 16, 16), (2, 2049, 700, 8, 2), (4, 300, 517, 12, 1)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", [64, 128])
def test_persistent_tiles(hdim, causal, shape):
    """The layout parameters that change how tiles map to CTAs (sm90_fwd's persistent: a CTA
    per SM, several tiles each, Q and ring phases carried from tile to tile), on shapes with
    more tiles than SMs, tiles without keys (causal, seqlen_q > seqlen_k) and GQA / MQA."""
    from cuflash import _gpu, registry

    ran = []
    for family in registry.families("fwd"):
        if "persistent" not in family.space:
            continue
        b, sq, sk, h, hk = shape
        problem = Problem("fwd", "bf16", b, sq, sk, h, hk, hdim, causal)
        if family.supports(_gpu.arch(), problem):
            continue   # e.g. the FP8 family on bf16: the other families still run
        cfg = device_heuristic(family, problem)
        ran.append(family.name)
        q, k, v = inputs(problem)
        # static tiles, static persistent, and (sm90_fwd) the dynamic scheduler
        sched = [dict(persistent=False), dict(persistent=True)]
        if "dynamic" in family.space:
            sched = [dict(s, dynamic=False) for s in sched] + [dict(persistent=True, dynamic=True)]
        for kw in sched:
            c = cfg.replace(**kw)
            if getattr(c, "stream_tail", False) and not (c.persistent and not c.dynamic):
                c = c.replace(stream_tail=False)   # (stream_tail: the static persistent schedule only)
            out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, config=c)
            check_forward(out, lse, q, k, v, causal, hdim ** -0.5, f"{c.name}: ")
    if not ran:
        pytest.skip("no forward family with a persistent layout supports bf16 on this GPU")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_default_selection(dtype, causal):
    """No config: the tuned entry for this GPU or the heuristic of the chosen family."""
    problem = grid_problem("fwd", dtype, causal, 128, (1000, 1100), "gqa")
    q, k, v = inputs(problem)
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    check_forward(out, lse, q, k, v, causal, 128 ** -0.5)
    cfg, source = cuflash.config_for(128, dtype, causal, seqlen=1100, with_source=True)
    assert source


# ---------------------------------------------------------------------------------------
# the three kinds of input

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_numpy_cupy_and_torch_give_the_same_results(dtype, causal):
    """One problem through the NumPy, CuPy and torch entry points: bit-identical outputs and
    LSE (one config, one deterministic kernel), and within the rule of cuflash.reference."""
    import cupy
    import ml_dtypes
    import torch

    npdtype = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}[dtype]
    rng = np.random.default_rng()
    q = rng.standard_normal((2, 203, 4, 72)).astype(npdtype)
    k = rng.standard_normal((2, 113, 2, 72)).astype(npdtype)
    v = rng.standard_normal((2, 113, 2, 72)).astype(npdtype)
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert isinstance(out, np.ndarray) and out.dtype == q.dtype and lse.dtype == np.float32

    ref, ref_lse = reference.attention_naive(q, k, v, causal=causal, return_lse=True)
    low = reference.lowp_attention(q, k, v, causal=causal, dtype=npdtype)
    base = np.abs(low - ref).max()
    assert np.abs(out.astype(np.float64) - ref).max() <= 2 * base + 1e-5
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    assert np.abs(lse[finite] - ref_lse[finite]).max() < 1e-3

    tdtype = torch_dtype(dtype)
    tq, tk, tv = (torch.from_numpy(x.view(np.int16)).view(tdtype).cuda() for x in (q, k, v))
    tout, tlse, _ = cuflash.flash_attn_func(tq, tk, tv, causal=causal, return_attn_probs=True)
    assert tout.dtype == tdtype and tout.is_cuda
    np.testing.assert_array_equal(tout.cpu().view(torch.int16).numpy(), out.view(np.int16))
    np.testing.assert_array_equal(tlse.cpu().numpy(), lse)

    if dtype == "fp16":  # CuPy has fp16 natively; bf16 CuPy arrays need ml_dtypes support
        cq, ck, cv = (cupy.asarray(x) for x in (q, k, v))
        cout, clse, _ = cuflash.flash_attn_func(cq, ck, cv, causal=causal, return_attn_probs=True)
        assert isinstance(cout, cupy.ndarray) and cout.dtype == np.float16
        np.testing.assert_array_equal(cupy.asnumpy(cout), out)
        np.testing.assert_array_equal(cupy.asnumpy(clse), lse)


def test_strided_views_and_explicit_config():
    """q, k, v as views into one packed (b, s, 3, h, d) tensor; a config given explicitly."""
    import torch

    qkv = rand((2, 300, 3, 4, 64), torch.bfloat16)
    q, k, v = qkv.unbind(2)
    cfg = cuflash.FwdConfig(64, 32, 4, 3, 64, "bf16", True)
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=True, config=cfg, return_attn_probs=True)
    check_forward(out, lse, q, k, v, True, 1 / 8)


def test_misaligned_views_are_copied():
    """Views starting 8 bytes into their storage (contiguous, but not 16-byte aligned) are
    read through aligned copies, on the first call of a shape and on a cached plan alike,
    forward and backward (q and dout misaligned)."""
    import torch

    from test_flash_bwd_gpu import check_grads, reference_grads

    n = 200 * 4 * 64
    for _ in range(2):
        base = rand((4 + n,), torch.float16).requires_grad_()
        q = base[4:].view(1, 200, 4, 64)          # 8 bytes past a 16-byte boundary
        assert q.data_ptr() % 16 == 8 and q.is_contiguous()
        k, v = (rand((1, 150, 4, 64), torch.float16).requires_grad_() for _ in range(2))
        out, lse, _ = cuflash.flash_attn_func(q, k, v, return_attn_probs=True)
        check_forward(out.detach(), lse, q.detach(), k.detach(), v.detach(), False, 1 / 8)
        dbase = rand((4 + n,), torch.float16)
        dout = dbase[4:].view(1, 200, 4, 64)
        out.backward(dout)
        ref, low = reference_grads(q.detach(), k.detach(), v.detach(), dout, False, 1 / 8)
        check_grads((base.grad[4:].view(1, 200, 4, 64), k.grad, v.grad), ref, low)


def test_empty_and_keyless_inputs():
    import torch

    q = rand((0, 5, 2, 64), torch.float16)
    assert cuflash.flash_attn_func(q, q, q).shape == (0, 5, 2, 64)
    q, k = rand((1, 4, 2, 64), torch.float16), rand((1, 0, 2, 64), torch.float16)
    out, lse, _ = cuflash.flash_attn_func(q, k, k, return_attn_probs=True)
    assert (out == 0).all() and (lse == math.inf).all()


# ---------------------------------------------------------------------------------------
# torch.compile, CUDA graphs, the hot path

def test_torch_compile_fullgraph_and_cuda_graph_forward():
    """The forward under torch.compile(fullgraph=True) (the cuflash::fwd op) and replayed from
    a CUDA graph gives eager's output bit for bit."""
    import torch

    q, k, v = inputs(grid_problem("fwd", "bf16", True, 64, (512, 640), "gqa"))
    eager = cuflash.flash_attn_func(q, k, v, causal=True)
    compiled = torch.compile(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=True),
                             fullgraph=True)(q, k, v)
    assert torch.equal(eager, compiled)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture: compiles and loads the kernels
        cuflash.flash_attn_func(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cuflash.flash_attn_func(q, k, v, causal=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


def test_second_call_reuses_the_plan(monkeypatch):
    """The second call of a shape neither validates nor builds a plan; new data of the same
    shape is computed correctly by the cached plan."""
    import cupy

    validated, built = [], []
    real_check, real_plan = api.check_qkv, launch.Plan

    def check(*a, **kw):
        validated.append(a[5] if len(a) > 5 else "fwd")
        return real_check(*a, **kw)

    class CountingPlan(real_plan):
        def __init__(self, *a, **kw):
            built.append(a[1].name)
            super().__init__(*a, **kw)

    monkeypatch.setattr(api, "check_qkv", check)
    monkeypatch.setattr(launch, "Plan", CountingPlan)
    monkeypatch.setattr(torch_ops, "_fwd_plans", {})
    monkeypatch.setattr(api, "_cupy_plans", {})
    problem = grid_problem("fwd", "fp16", True, 64, (300, 257), "mqa")
    q, k, v = inputs(problem)
    cuflash.flash_attn_func(q, k, v, causal=True)
    assert (len(validated), len(built)) == (1, 1)
    for _ in range(3):
        q, k, v = inputs(problem)
        out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert (len(validated), len(built)) == (1, 1)
    check_forward(out, lse, q, k, v, True, 1 / 8)
    # CuPy arrays: their own plan cache, the same rule
    cq, ck, cv = (cupy.asarray(x.cpu().numpy()) for x in (q, k, v))
    first = cuflash.flash_attn_func(cq, ck, cv, causal=True)
    n = (len(validated), len(built))
    again = cuflash.flash_attn_func(cq, ck, cv, causal=True)
    assert (len(validated), len(built)) == n
    assert bool((first == again).all())


# ---------------------------------------------------------------------------------------
# non-finite inputs: NaN in gives NaN out in the rows that read it (cuflash.reference's rule)

@pytest.mark.parametrize("causal", [False, True])
def test_nan_input_rows_give_nan_output_rows(causal):
    import torch

    q, k, v = (rand((1, 64, 2, 64), torch.bfloat16) for _ in range(3))
    q[0, 5, 1] = float("nan")   # one query row
    k[0, 40, 0] = float("nan")  # one key: rows that see it (causal: rows >= 40) read it
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    ref = reference.attention_naive(*(x.float().cpu().numpy() for x in (q, k, v)), causal=causal)
    ref_nan = torch.from_numpy(np.isnan(ref)).to(out.device)
    assert torch.equal(torch.isnan(out), ref_nan), "NaN must reach exactly the rows that read it"
    finite = ~ref_nan
    err = (out.double()[finite] - torch.from_numpy(ref).to(out.device)[finite]).abs().max().item()
    assert err < 0.05


def test_nan_input_rows_give_nan_lse():
    import torch

    q, k, v = (rand((1, 32, 2, 64), torch.bfloat16) for _ in range(3))
    q[0, 3, 0] = float("nan")
    _, lse, _ = cuflash.flash_attn_func(q, k, v, return_attn_probs=True)
    assert torch.isnan(lse[0, 0, 3]) and not torch.isnan(lse[0, 1]).any()


# ---------------------------------------------------------------------------------------
# head dims that are not a multiple of 8 (zero-padded copies, outputs sliced back)

@pytest.mark.parametrize("hdim", [59, 111, 200])
def test_odd_head_dims_forward_and_backward(hdim):
    import torch

    q, k, v = (rand((2, 97, 4, hdim), torch.bfloat16).requires_grad_() for _ in range(3))
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.shape == q.shape and out.is_contiguous()
    check_forward(out.detach(), lse, q.detach(), k.detach(), v.detach(), True, hdim ** -0.5,
                  f"hdim {hdim}: ")
    dout = torch.randn_like(out)
    out.backward(dout)
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, _ = torch_attention(qr, kr, vr, True, hdim ** -0.5, torch.float64)
    ref.backward(dout.double())
    for name, got, want in (("dq", q.grad, qr.grad), ("dk", k.grad, kr.grad), ("dv", v.grad, vr.grad)):
        assert got.shape == want.shape
        err = (got.double() - want).abs().max().item()
        assert err < 0.05 * max(1.0, want.abs().max().item()), f"hdim {hdim} {name}: error {err:.3g}"


# ---------------------------------------------------------------------------------------
# sm90_fwd's exact head dim 96: real head dims 65..96 run on the d96 kernel (6 k16 steps for
# S, one m64n96k16 per k16 step for P V, O of 96 columns; shared memory laid out as d128's).
# `pytest -m gpu -k "sm90 and (d96 or d80)"` runs these with the grid's d96 tests.

D96_SEQLENS = [(1, 1), (17, 17), (113, 203), (1023, 1024), (2049, 700), (300, 1), (1, 300)]
# each id's real head dims: d96 itself, d80 for the zero-filled ones below it
D96_REAL = {96: (96,), 80: (72, 80, 88)}
# a few points of the d96 space (BM, BN, stages, consumers, pingpong, persistent): every
# consumer count, pingpong on and off, 3 stages, persistent, BN from 64 to 192
D96_POINTS = [(64, 128, 2, 1, False, False), (128, 192, 2, 2, True, False), (128, 64, 3, 2, False, True),
              (128, 144, 2, 2, True, True), (192, 96, 2, 3, True, False), (192, 80, 3, 3, False, True)]


def d96_params():
    return [pytest.param(d, dtype, causal, id=f"sm90_fwd-d{d}-{dtype}-{'causal' if causal else 'full'}")
            for d in D96_REAL for dtype in ("bf16", "fp16") for causal in (False, True)]


def column_errors(out, q, k, v, causal, scale):
    """Max error against float64 per column block (0..63, 64..): a wrong P V descriptor for
    the half-used second chunk shows in the second block only, a wrong S in both (and LSE)."""
    import torch

    ref, _ = torch_attention(q, k, v, causal, scale, torch.float64)
    err = (out.double() - ref).abs()
    return {f"cols {lo}..{min(lo + 64, out.shape[-1]) - 1}": err[..., lo:lo + 64].max().item()
            for lo in range(0, out.shape[-1], 64)}


def check_d96(out, lse, q, k, v, causal, scale, what):
    try:
        check_forward(out, lse, q, k, v, causal, scale, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; per column block: {column_errors(out, q, k, v, causal, scale)}") from None


@pytest.mark.parametrize("hdim,dtype,causal", d96_params())
def test_sm90_d96_kernel(hdim, dtype, causal):
    """sm90_fwd forced (its heuristic: the d96 kernel) on odd seqlens, s_q != s_k, MHA / GQA /
    MQA; one kernel per dtype and mask. The same call on the d128 kernel (TMA zero fill) gives
    the same bits: the d96 kernel only skips products with zero columns."""
    import torch

    fam = registry.get("sm90_fwd")
    heads = list(GPU_HEADS)
    for d in D96_REAL[hdim]:
        for i, seqlens in enumerate(D96_SEQLENS):
            problem = grid_problem("fwd", dtype, causal, d, seqlens, heads[i % len(heads)])
            cfg = device_heuristic(fam, problem)
            assert cfg.head_dim == 96, cfg.name
            q, k, v = inputs(problem)
            out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, config=cfg)
            what = f"{cfg.name} d{d} {seqlens} {heads[i % len(heads)]}: "
            check_d96(out, lse, q, k, v, causal, d ** -0.5, what)
            if i in (2, 4):
                d128 = cfg.replace(head_dim=128)
                out128, lse128, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True,
                                                            config=d128)
                check_forward(out128, lse128, q, k, v, causal, d ** -0.5, f"{d128.name}: ")
                assert torch.equal(lse, lse128), f"{what}LSE differs from the d128 kernel's"
                assert torch.equal(out, out128), \
                    f"{what}O differs from the d128 kernel's: {column_errors(out, q, k, v, causal, d ** -0.5)}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("point", D96_POINTS, ids=lambda p: "BM{}_BN{}_s{}_c{}{}{}".format(
    *p[:4], "_pp" if p[4] else "", "_persist" if p[5] else ""))
def test_sm90_d96_space_points(point, causal):
    """Points of the d96 space on the space test's ragged GQA shape (sm90_fwd-d96 in the id)."""
    from cuflash.families.sm90_fwd import Sm90FwdConfig

    cfg = Sm90FwdConfig(*point, head_dim=96, dtype="bf16", causal=causal)
    require_fits_device(cfg)
    s = SPACE_SHAPE
    problem = Problem("fwd", "bf16", 2, s["seqlen_q"], s["seqlen_k"], s["nheads"], s["nheads_kv"], 96, causal)
    q, k, v = inputs(problem)
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, config=cfg)
    check_d96(out, lse, q, k, v, causal, 96 ** -0.5, f"sm90_fwd-d96 {cfg.name}: ")


@pytest.mark.parametrize("case", ["window", "causal_window", "softcap30", "alibi_bh_causal", "all"])
def test_sm90_d96_features(case):
    """Window, softcap and ALiBi on the d96 kernel (the checks of test_features_gpu.py)."""
    import torch

    from test_features_gpu import CASES, check_close, feature_attention, problem_of, slopes_for
    from test_features_gpu import inputs as feature_inputs

    fam = registry.get("sm90_fwd")
    c = next(c for c in CASES if c[0] == case)
    _, causal, window, softcap, alibi = c
    for (sq, sk), heads in (((113, 1023), "gqa"), ((1023, 113), "mqa"), ((2049, 1023), "mha")):
        q, k, v, _ = feature_inputs(2, sq, sk, heads, 96, "bf16")
        slopes = slopes_for(alibi, 2, q.shape[2])
        cfg = device_heuristic(fam, problem_of("fwd", q, k, c))
        assert cfg.head_dim == 96, cfg.name
        out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                              alibi_slopes=slopes, config=cfg, return_attn_probs=True)
        ref, ref_lse = feature_attention(q, k, v, 96 ** -0.5, causal, window, softcap, slopes, torch.float64)
        low, _ = feature_attention(q, k, v, 96 ** -0.5, causal, window, softcap, slopes, q.dtype)
        what = f"sm90_fwd-d96 {cfg.name} {sq}x{sk} {heads}"
        check_close(out, ref, low, 2, what)
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite), f"{what}: LSE = +inf rows differ"
        if finite.any():
            assert (lse[finite].double() - ref_lse[finite]).abs().max().item() < 1e-2, f"{what}: LSE"
