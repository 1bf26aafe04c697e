"""Backward kernels and the torch bridge on the GPU, the FlashAttention way, for every
registered family of op bwd.

dQ, dK, dV of cuflash against a float64 reference (torch autograd on the GPU) must each be
within 3x the error of plain attention's gradients computed in the same low precision (plus
one unit in the last place of the largest gradient: the storage's resolution), on fresh
random inputs, with gradients poisoned (NaN) before each launch. The gradients flow
through torch autograd (FlashAttnFn around the cuflash::fwd / cuflash::bwd kernels), so the
bridge is tested with them; each backward family is forced with bwd_config=: its heuristic on
the full grid and every valid point of its space (test ids = config names). CuPy's
flash_attn_backward, deterministic mode, torch.compile, CUDA graphs and the plan cache have
their own tests.
"""
import math

import numpy as np
import pytest

import cuflash
from cuflash import api, launch, reference, registry, torch_ops

from conftest import SPACE_SHAPE, cuda_randn as rand, device_heuristic, grid_params, grid_problem  # noqa: E402
from conftest import require_fits_device, space_params, torch_attention, torch_dtype  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]


def plain_attention(q, k, v, causal, scale, dtype):
    """Plain attention's output in `dtype` (conftest.torch_attention without the LSE)."""
    return torch_attention(q, k, v, causal, scale, dtype)[0]


def grads(fn, q, k, v, dout):
    import torch

    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), (dq, dk, dv)


def ulp(value, dtype):
    """The spacing of `dtype` (a 16-bit float) at magnitude `value`."""
    import torch

    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(value, 2.0 ** -14)))


def check_grads(ours, ref, low, what=""):
    failures = []
    for name, a, r, b in zip(("dq", "dk", "dv"), ours, ref, low):
        assert not a.isnan().any(), f"{what}{name}: unwritten (NaN-poisoned) elements"
        # The bound's floor is one unit in the last place of the largest gradient in the
        # output's dtype: a gradient stored in 16 bits cannot be judged more finely (plain
        # attention's worst element may happen to round well while ours rounds the other
        # way: ~1 in 2000 grid tests failed on exactly 4 x plain = 1 ulp at the top). It
        # also covers gradients that are exactly 0 in the reference (one key: dS = 0) and
        # come out as fp32 rounding noise. With one key, dS = dP - D cancels only to the fp32
        # rounding of two dot products of head_dim terms (dO·V and dO·O, O = V), ~1e-6 per
        # query row, and dK sums seqlen_q of them: an all-zero reference gets 4e-5 (seen:
        # 1.3e-5 at 257 rows, d128, depending on the kernel's summation order).
        top = r.abs().max().item()
        floor = max(ulp(top, a.dtype), 1e-5 * max(1.0, top), 4e-5 if top == 0 else 0.0)
        err = (a.double() - r).abs().max().item()
        base = (b.double() - r).abs().max().item()
        if not err <= 3 * base + floor:
            failures.append(f"{what}{name}: error {err:.3g} > 3 x plain error {base:.3g} "
                            f"+ 1 ulp {floor:.3g} (max |ref| {top:.3g})")
    assert not failures, "\n".join(failures)


def inputs(problem):
    p = problem
    tdtype = torch_dtype(p.dtype)
    q = rand((p.batch, p.seqlen_q, p.nheads, p.head_dim), tdtype)
    k = rand((p.batch, p.seqlen_k, p.nheads_kv, p.head_dim), tdtype)
    v = rand((p.batch, p.seqlen_k, p.nheads_kv, p.head_dim), tdtype)
    dout = rand((p.batch, p.seqlen_q, p.nheads, p.head_dim), tdtype)
    return q, k, v, dout


def reference_grads(q, k, v, dout, causal, scale):
    import torch

    _, ref = grads(lambda q, k, v: plain_attention(q, k, v, causal, scale, torch.float64), q, k, v, dout.double())
    _, low = grads(lambda q, k, v: plain_attention(q, k, v, causal, scale, q.dtype), q, k, v, dout)
    return ref, low


# ---------------------------------------------------------------------------------------
# every family: its heuristic on the full grid, every point of its space

@pytest.mark.parametrize("family,dtype,causal,hdim,seqlens,heads", grid_params("bwd"))
def test_heuristic_on_the_grid(family, dtype, causal, hdim, seqlens, heads):
    problem = grid_problem("bwd", dtype, causal, hdim, seqlens, heads)
    cfg = device_heuristic(family, problem)
    q, k, v, dout = inputs(problem)
    _, ours = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=causal, bwd_config=cfg),
                    q, k, v, dout)
    ref, low = reference_grads(q, k, v, dout, causal, 1 / math.sqrt(hdim))
    check_grads(ours, ref, low)


@pytest.mark.parametrize("family,config", space_params("bwd"))
def test_every_point_of_the_space(family, config):
    require_fits_device(config)
    s = SPACE_SHAPE
    problem = grid_problem("bwd", config.dtype, config.causal, config.head_dim,
                           (s["seqlen_q"], s["seqlen_k"]), "mha", batch=s["batch"])
    q, k, v, dout = inputs(problem.replace(nheads=s["nheads"], nheads_kv=s["nheads_kv"]))
    _, ours = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=config.causal,
                                                            bwd_config=config), q, k, v, dout)
    ref, low = reference_grads(q, k, v, dout, config.causal, config.head_dim ** -0.5)
    check_grads(ours, ref, low, what=f"{config.name} ")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_default_selection(dtype, causal):
    """No bwd_config: the tuned entry for this GPU or the heuristic of the chosen family."""
    problem = grid_problem("bwd", dtype, causal, 128, (1000, 1100), "gqa")
    q, k, v, dout = inputs(problem)
    _, ours = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=causal), q, k, v, dout)
    ref, low = reference_grads(q, k, v, dout, causal, 128 ** -0.5)
    check_grads(ours, ref, low)


# ---------------------------------------------------------------------------------------
# CuPy, deterministic mode, layouts

@pytest.mark.parametrize("causal", [False, True])
def test_cupy_backward_against_numpy_reference(causal):
    """flash_attn_backward on CuPy arrays, checked against cuflash.reference (float64 NumPy),
    and equal to the torch path's gradients bit for bit (deterministic mode)."""
    import cupy
    import torch

    rng = np.random.default_rng()
    shapes = [(2, 203, 4, 72), (2, 113, 2, 72), (2, 113, 2, 72), (2, 203, 4, 72)]
    q, k, v, dout = (rng.standard_normal(s).astype(np.float16) for s in shapes)
    dq_ref, dk_ref, dv_ref = reference.attention_backward_naive(dout, q, k, v, causal=causal)
    gq, gk, gv, gdo = (cupy.asarray(x) for x in (q, k, v, dout))
    out, lse, _ = cuflash.flash_attn_func(gq, gk, gv, causal=causal, return_attn_probs=True)
    dq, dk, dv = cuflash.flash_attn_backward(gdo, gq, gk, gv, out, lse, causal=causal,
                                             deterministic=True)
    assert all(isinstance(x, cupy.ndarray) and x.dtype == np.float16 for x in (dq, dk, dv))
    for name, ours, ref in (("dq", dq, dq_ref), ("dk", dk, dk_ref), ("dv", dv, dv_ref)):
        err = np.abs(cupy.asnumpy(ours).astype(np.float64) - ref).max()
        assert err <= 2e-2 * max(1.0, np.abs(ref).max()), f"{name}: error {err:.3g}"
    tq, tk, tv, tdo = (torch.from_numpy(x).cuda() for x in (q, k, v, dout))
    _, tgrads = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=causal, deterministic=True),
                      tq, tk, tv, tdo)
    for ours, theirs in zip((dq, dk, dv), tgrads):
        np.testing.assert_array_equal(cupy.asnumpy(ours), theirs.cpu().numpy())


@pytest.mark.parametrize("family", registry.families("bwd"), ids=lambda f: f.name)
def test_deterministic_is_bitwise_reproducible(family):
    """deterministic=True: 20 runs give identical dQ, dK, dV bits (GQA, many K/V blocks)."""
    import torch

    problem = grid_problem("bwd", "bf16", True, 128, (1000, 1100), "gqa", deterministic=True)
    problem = problem.replace(nheads=8)
    cfg = device_heuristic(family, problem)
    assert getattr(cfg, "deterministic", True)
    q, k, v, dout = inputs(problem)
    first = None
    for _ in range(20):
        _, g = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=True, deterministic=True,
                                                             bwd_config=cfg), q, k, v, dout)
        if first is None:
            first = g
            ref, low = reference_grads(q, k, v, dout, True, 128 ** -0.5)
            check_grads(g, ref, low)
        else:
            for a, b in zip(first, g):
                assert torch.equal(a, b), "deterministic backward differs between runs"


def test_noncontiguous_and_broadcast_grads():
    """Gradients with stride 0 (from .sum()) and strided q/k/v views into one packed tensor."""
    import torch

    qkv = rand((2, 300, 3, 4, 64), torch.bfloat16).requires_grad_()
    q, k, v = qkv.unbind(2)
    cuflash.flash_attn_func(q, k, v, causal=True).sum().backward()
    ours = qkv.grad.unbind(2)
    ones = torch.ones(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16)
    ref, low = reference_grads(q.detach(), k.detach(), v.detach(), ones, True, 1 / 8)
    check_grads(ours, ref, low)


@pytest.mark.parametrize("layout", ["head_dim_strided", "odd_strides", "broadcast_row"])
@pytest.mark.parametrize("det", [False, True], ids=["atomic", "deterministic"])
def test_dout_layouts_read_in_place(layout, det):
    """dout that the main kernel cannot read in place (head dim not contiguous, strides not
    whole 16-byte chunks, a broadcast row): the preprocess reads it through its strides and
    copies it (fa2_bwd.cu); gradients within the rule, GQA included."""
    import torch

    b, s, h, hk, d = 2, 113, 4, 2, 64
    q = rand((b, s, h, d), torch.bfloat16).requires_grad_()
    k, v = (rand((b, 97, hk, d), torch.bfloat16).requires_grad_() for _ in range(2))
    if layout == "head_dim_strided":
        dout = rand((b, s, h, 2 * d), torch.bfloat16)[..., ::2]
    elif layout == "odd_strides":
        dout = rand((b, s, h, d + 3), torch.bfloat16)[..., :d]
    else:
        dout = rand((b, 1, h, d), torch.bfloat16).expand(b, s, h, d)
    out = cuflash.flash_attn_func(q, k, v, causal=True, deterministic=det)
    out.backward(dout)
    ours = (q.grad, k.grad, v.grad)
    ref, low = reference_grads(q.detach(), k.detach(), v.detach(), dout.contiguous(), True, d ** -0.5)
    check_grads(ours, ref, low)


@pytest.mark.parametrize("family", registry.families("bwd"), ids=lambda f: f.name)
def test_flash_attn_backward_torch_with_config(family):
    """flash_attn_backward on torch tensors (no autograd) with an explicit config equals the
    autograd path with that bwd_config, for each backward family (registry order is priority,
    not selection: families("bwd")[0] became sm90_bwd, which skips off sm_90)."""
    import torch

    problem = grid_problem("bwd", "fp16", False, 64, (257, 300), "gqa")
    q, k, v, dout = inputs(problem)
    cfg = device_heuristic(family, problem.replace(deterministic=True))
    out, lse, _ = cuflash.flash_attn_func(q, k, v, return_attn_probs=True)
    direct = cuflash.flash_attn_backward(dout, q, k, v, out, lse, deterministic=True, config=cfg)
    _, auto = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, deterministic=True, bwd_config=cfg),
                    q, k, v, dout)
    for a, b in zip(direct, auto):
        assert torch.equal(a, b)


def test_double_backward_is_not_implemented():
    import torch

    q, k, v, _ = inputs(grid_problem("bwd", "bf16", True, 64, (64, 64), "mha", batch=1))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = cuflash.flash_attn_func(q, k, v, causal=True)
    dq, dk, dv = torch.autograd.grad(out.float().square().sum(), (q, k, v), create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(dq.float().sum(), (q, k, v))


# ---------------------------------------------------------------------------------------
# torch.compile, CUDA graphs, the hot path

def test_torch_compile_fullgraph_and_cuda_graphs_match_eager():
    """torch.compile(fullgraph=True) traces the custom ops (forward and backward) with no graph
    break, and a CUDA graph captures a whole training step; both give eager's gradients bit
    for bit (deterministic=True, so dQ's order of additions is fixed)."""
    import torch

    q, k, v, dout = inputs(grid_problem("bwd", "bf16", True, 64, (512, 512), "gqa"))

    def loss(q, k, v):
        out = cuflash.flash_attn_func(q, k, v, causal=True, deterministic=True)
        return (out.float() * dout.float()).sum()

    def grads_of(fn):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        fn(*leaves).backward()
        return [x.grad for x in leaves]

    eager = grads_of(loss)
    compiled = grads_of(torch.compile(loss, fullgraph=True))
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b), "torch.compile gradients differ from eager"

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture: compiles and loads the kernels
        loss(*leaves).backward()
    torch.cuda.current_stream().wait_stream(side)
    for x in leaves:
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss(*leaves).backward()
    graph.replay()
    torch.cuda.synchronize()
    for x, e in zip(leaves, eager):
        assert torch.equal(x.grad, e), "CUDA graph replay gradients differ from eager"


def test_second_backward_reuses_the_plan(monkeypatch):
    """A training step repeated on one shape validates and builds its forward and backward
    plans once; the cached plans compute later steps correctly."""
    validated, built = [], []
    real_check, real_plan = api.check_qkv, launch.Plan

    def check(*a, **kw):
        validated.append(a[5] if len(a) > 5 else kw.get("op", "fwd"))
        return real_check(*a, **kw)

    class CountingPlan(real_plan):
        def __init__(self, *a, **kw):
            built.append(a[0].op)
            super().__init__(*a, **kw)

    monkeypatch.setattr(api, "check_qkv", check)
    monkeypatch.setattr(launch, "Plan", CountingPlan)
    monkeypatch.setattr(torch_ops, "_fwd_plans", {})
    monkeypatch.setattr(torch_ops, "_bwd_plans", {})
    problem = grid_problem("bwd", "bf16", False, 96, (300, 333), "gqa")
    for _ in range(3):
        q, k, v, dout = inputs(problem)
        _, ours = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v), q, k, v, dout)
    assert sorted(validated) == ["bwd", "fwd"] and sorted(built) == ["bwd", "fwd"]
    ref, low = reference_grads(q, k, v, dout, False, 96 ** -0.5)
    check_grads(ours, ref, low)


def test_empty_and_keyless_backward():
    q, k, v, dout = inputs(grid_problem("bwd", "fp16", False, 64, (4, 0), "mha"))
    _, (dq, dk, dv) = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v), q, k, v, dout)
    assert (dq == 0).all() and dk.shape == k.shape
    q, k, v, dout = inputs(grid_problem("bwd", "fp16", False, 64, (0, 5), "mha"))
    _, (dq, dk, dv) = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v), q, k, v, dout)
    assert (dk == 0).all() and (dv == 0).all() and dq.shape == q.shape
