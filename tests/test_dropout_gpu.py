"""Dropout's mask on the GPU: philox.cuh's Dropout.zero_dropped (forward layout) and apply_transposed
(backward layout), on one warp's tile of ones, against the NumPy mirror cuflash.dropout, bit
for bit: the kernels and S_dmask then agree on which elements were dropped."""
import numpy as np
import pytest

from cuflash import dropout
from cuflash.compile import kernel_dir

pytestmark = pytest.mark.gpu

PROBE = r'''
#include "philox.cuh"
using namespace cuflash;
// One warp: a (kMT·16) x (kNT·8) tile of ones in the mma accumulator layout (rows g, g + 8 of
// each 16-row tile, columns 8·nt + 2t + e), dropout applied, written out row-major.
template <int kMT, int kNT, bool kT, bool kP>
__global__ void probe(float* out, unsigned long long seed, unsigned long long offset, float p,
                      int bh, int row0, int col0) {
    const Dropout d = Dropout::make(seed, offset, p);
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    float acc[kMT][kNT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 1.f;
    if constexpr (kT) d.template apply_transposed<kP>(acc, bh, row0, col0, g, t);   // rows: keys, columns: queries
    else d.zero_dropped(acc, bh, row0, col0, g, t);   // rows: queries, columns: keys (kept: 1)
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                out[(16 * mt + g + 8 * (e / 2)) * (kNT * 8) + 8 * nt + 2 * t + e % 2] = acc[mt][nt][e];
}
'''
# (kMT, kNT, transposed, pairs): pairs = one call for two 16-key tiles (fa2_bwd: key0 % 32 == 0)
SHAPES = [(1, 16, False, False), (2, 8, False, False), (1, 20, False, False), (2, 8, True, False),
          (1, 4, True, False), (3, 6, True, False), (1, 8, True, False), (2, 8, True, True), (4, 4, True, True)]


@pytest.mark.parametrize("mt,nt,transposed,pairs", SHAPES, ids=lambda x: str(x))
def test_dropout_apply_matches_the_mirror(mt, nt, transposed, pairs):
    import cupy

    b = lambda x: 'true' if x else 'false'  # noqa: E731
    names = [f"probe<{m}, {n}, {b(tr)}, {b(pr)}>" for m, n, tr, pr in SHAPES]
    mod = cupy.RawModule(code=PROBE, options=("-std=c++17", f"-I{kernel_dir()}"), name_expressions=names)
    kern = mod.get_function(f"probe<{mt}, {nt}, {b(transposed)}, {b(pairs)}>")
    seed, offset, p, bh, row0, col0 = 0xDEADBEEF12345678, (5 << 32) + 96, 0.17, 7, 48, 32
    if pairs:   # its precondition: the tile's first key a multiple of 32
        row0 = 64
    rows, cols = 16 * mt, 8 * nt
    out = cupy.full((rows, cols), np.nan, np.float32)
    kern((1,), (32,), (out, np.uint64(seed), np.uint64(offset), np.float32(p), np.int32(bh),
                       np.int32(row0), np.int32(col0)))
    got = out.get()
    if transposed:   # rows are keys from row0, columns queries from col0
        keep = dropout.keep_mask(seed, offset, p, 1, bh + 1, col0 + cols, row0 + rows)[0, bh]
        want = keep[col0:, row0:].T
    else:            # rows are queries from row0, columns keys from col0
        keep = dropout.keep_mask(seed, offset, p, 1, bh + 1, row0 + rows, col0 + cols)[0, bh]
        want = keep[row0:, col0:]
    # apply_transposed scales the kept elements; zero_dropped leaves them (the forwards' epilogue
    # takes 1 / (1 - p))
    scale = np.float32(1) / (np.float32(1) - np.float32(p)) if transposed else np.float32(1)
    np.testing.assert_array_equal(got, np.where(want, scale, np.float32(0)))


# ---------------------------------------------------------------------------------------
# dropout through fa2_fwd / fa2_bwd and the API (issue 12 item 6)
#
# The mask a call uses is known exactly: torch's generator is re-seeded and the state the call
# will draw (int64[2], cuflash.torch_ops.draw_rng_state) is drawn once beforehand; the NumPy
# mirror gives its mask. Error rule: out within 2x, gradients within 3x, the error of plain
# low-precision attention with the same mask, against float64 with the same mask.
import math  # noqa: E402

import cuflash  # noqa: E402
from cuflash import api, torch_ops  # noqa: E402

P_DROP = 0.17


def attention_with_mask(q, k, v, causal, scale, dtype, keep, p):
    """Attention with dropout given the keep mask (bool, (b, h, sq, sk)), in torch ops, in
    `dtype` (float64: the reference; 16-bit: matmuls in it, softmax in fp32), (out, lse);
    bottom-right causal; differentiable."""
    import torch

    q, k, v = (x.to(dtype).transpose(1, 2) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    s = (q @ k.transpose(-1, -2)).to(acc) * scale
    sq, sk = q.shape[2], k.shape[2]
    if causal:
        visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        s = s.masked_fill(~visible, -math.inf)
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    lse = torch.where(l[..., 0] > 0, (m + torch.log(l))[..., 0], torch.full_like(l[..., 0], math.inf))
    probs = e / torch.where(l > 0, l, torch.ones_like(l))
    dropped = probs * keep.to(acc) / (1.0 - p)
    return (dropped.to(dtype) @ v).transpose(1, 2), lse


def next_mask(seed, b, h, sq, sk, p=P_DROP):
    """torch.manual_seed(seed), then the keep mask of the state the next cuflash call draws
    (and torch.manual_seed(seed) again, so that the call draws it)."""
    import torch

    torch.manual_seed(seed)
    state = torch_ops.draw_rng_state("cuda")
    s, o = (int(x) & (2 ** 64 - 1) for x in state.tolist())
    torch.manual_seed(seed)
    return torch.from_numpy(dropout.keep_mask(s, o, p, b, h, sq, sk)).cuda(), (s, o)


def rand_qkv(b, sq, sk, h, h_kv, d, dtype, grad=False):
    import torch

    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, h_kv, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, h_kv, d, device="cuda", dtype=dtype)
    return tuple(x.requires_grad_(grad) for x in (q, k, v))


def dropout_case(b, sq, sk, h, h_kv, d, dtype, seed, p=P_DROP):
    """Fresh inputs (q, k, v requiring grad), dO, the softmax scale and the keep mask of an explicit
    dropout seed (bool (b, h, sq, sk), the mirror's) for a dropout call against the reference."""
    import torch

    q, k, v = rand_qkv(b, sq, sk, h, h_kv, d, dtype, grad=True)
    dout = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    keep = torch.from_numpy(dropout.keep_mask(*seed, p, b, h, sq, sk)).cuda()
    return q, k, v, dout, 1 / math.sqrt(d), keep


def max_err(a, ref):
    return (a.double() - ref.double()).abs().max().item()


def check_dropout_grads(grads, ref_out, low_out, q, k, v, dout, out, scale, name=""):
    """The gradients (dq, dk, dv) of a dropout call with output ``out`` within 3x the error of plain
    low-precision attention's (``low_out``, attention_with_mask in q's dtype) against the float64
    reference's (``ref_out``), both with the call's keep mask; no unwritten (NaN) element."""
    import torch

    dtype = q.dtype
    ref_g = torch.autograd.grad(ref_out, (q, k, v), dout.double())
    low_g = torch.autograd.grad(low_out, (q, k, v), dout)
    for what, a, r, lo in zip(("dq", "dk", "dv"), grads, ref_g, low_g):
        assert not a.isnan().any(), f"{name} {what}: unwritten (NaN) elements"
        e, bse = max_err(a, r), max_err(lo, r)
        floor = torch.finfo(dtype).eps * max(1.0, r.abs().max().item())
        if what in ("dq", "dk"):
            # D = rowsum(dO∘O) is taken from O rounded to the input dtype (FlashAttention's
            # preprocess), so dS = P∘(dP∘Z/(1-p) - D) keeps a residual of about eps·|dO||O| per
            # row even where it is 0 exactly (one visible key: the plain baseline's error is 0);
            # dQ = dS K and dK = dSᵀ Q carry it
            d_scale = (dout.double() * out.double()).sum(-1).abs().max().item()
            other = k if what == "dq" else q
            floor = max(floor, torch.finfo(dtype).eps * d_scale * other.abs().max().item() * scale)
        assert e <= 3 * bse + floor, f"{name} {what}: error {e:.3g} > 3 x plain {bse:.3g} + {floor:.3g}"


# (dtype, head dim, causal): 6 forward + 6 backward compiles; head dim 59 runs padded to 64
FLAGS = [("bf16", 64, False), ("bf16", 64, True), ("fp16", 64, True), ("bf16", 128, False),
         ("bf16", 128, True), ("fp16", 128, False)]
SHAPES_GRID = [(2, 113, 113, 4, 4), (1, 17, 1023, 4, 1), (1, 2049, 1023, 2, 2), (3, 1, 1, 4, 2),
               (1, 1023, 2049, 4, 2)]


def dtype_of(name):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: f"{f[0]}_d{f[1]}_{'causal' if f[2] else 'full'}")
@pytest.mark.parametrize("shape", SHAPES_GRID, ids=lambda s: "b{}_s{}x{}_h{}x{}".format(*s))
def test_dropout_forward_backward_against_reference(flags, shape):
    import torch

    name, d, causal = flags
    dtype = dtype_of(name)
    b, sq, sk, h, h_kv = shape
    q, k, v = rand_qkv(b, sq, sk, h, h_kv, d, dtype, grad=True)
    dout = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    scale = 1 / math.sqrt(d)
    keep, _ = next_mask(1234, b, h, sq, sk)
    out, lse, s_dmask = cuflash.flash_attn_func(q, k, v, P_DROP, causal=causal, return_attn_probs=True)
    assert not out.isnan().any() and not lse.isnan().any()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)

    ref_out, ref_lse = attention_with_mask(q, k, v, causal, scale, torch.float64, keep, P_DROP)
    low_out, _ = attention_with_mask(q, k, v, causal, scale, dtype, keep, P_DROP)
    err, base = max_err(out, ref_out), max_err(low_out, ref_out)
    assert err <= 2 * base + 1e-5, f"out: error {err:.3g} > 2 x plain {base:.3g}"
    # LSE is plain attention's (l sums the undropped P)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert max_err(lse[finite], ref_lse[finite]) < 1e-3 if finite.any() else True

    check_dropout_grads((dq, dk, dv), ref_out, low_out, q, k, v, dout, out, scale)

    # S_dmask: the probabilities, dropped ones negated: its sign is the mask where P > 0
    assert s_dmask.shape == (b, h, sq, sk) and s_dmask.dtype == torch.float32
    visible = s_dmask != 0
    assert torch.equal((s_dmask > 0)[visible], keep[visible])


@pytest.mark.parametrize("head_dim", [59, 64])
def test_dropout_padded_head_dim_and_gqa(head_dim):
    import torch

    b, sq, sk, h, h_kv = 2, 77, 130, 6, 2
    q, k, v = rand_qkv(b, sq, sk, h, h_kv, head_dim, torch.bfloat16, grad=True)
    keep, _ = next_mask(7, b, h, sq, sk)
    out = cuflash.flash_attn_func(q, k, v, P_DROP, causal=True)
    scale = 1 / math.sqrt(head_dim)
    ref, _ = attention_with_mask(q, k, v, True, scale, torch.float64, keep, P_DROP)
    low, _ = attention_with_mask(q, k, v, True, scale, torch.bfloat16, keep, P_DROP)
    assert max_err(out, ref) <= 2 * max_err(low, ref) + 1e-5
    out.sum().backward()  # stride-0 dout
    assert all(x.grad is not None and not x.grad.isnan().any() for x in (q, k, v))


def test_dropout_reproducible_and_fresh_per_call():
    import torch

    q, k, v = rand_qkv(2, 256, 256, 4, 4, 64, torch.bfloat16, grad=True)
    dout = torch.randn_like(q)

    def run(det=False):
        out = cuflash.flash_attn_func(q, k, v, 0.1, causal=True, deterministic=det)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    torch.manual_seed(0)
    a = run(True)
    b = run(True)              # the generator moved on: another mask
    torch.manual_seed(0)
    c = run(True)              # the same mask again, deterministic backward: bitwise equal
    assert not torch.equal(a[0], b[0])
    for x, y in zip(a, c):
        assert torch.equal(x, y)
    # an explicit seed gives the mirror's mask, whatever the generator
    keep = torch.from_numpy(dropout.keep_mask(5, 9, 0.1, 2, 4, 256, 256)).cuda()
    out = cuflash.flash_attn_func(q, k, v, 0.1, causal=True, dropout_seed=(5, 9))
    ref, _ = attention_with_mask(q, k, v, True, 1 / 8, torch.float64, keep, 0.1)
    low, _ = attention_with_mask(q, k, v, True, 1 / 8, torch.bfloat16, keep, 0.1)
    assert max_err(out, ref) <= 2 * max_err(low, ref) + 1e-5


def test_dropout_cuda_graph_replays_draw_fresh_masks():
    """torch's generator is graph-safe: the state draw (random_) recorded in the graph gets a
    new philox offset at each replay, so each replay drops other elements (what torch's own
    dropout does under CUDA graphs)."""
    import torch

    q, k, v = rand_qkv(1, 128, 128, 2, 2, 64, torch.bfloat16)
    for _ in range(2):  # warm up: plans and compiles outside the capture
        cuflash.flash_attn_func(q, k, v, 0.2)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuflash.flash_attn_func(q, k, v, 0.2)
    graph.replay()
    first = out.clone()
    graph.replay()
    second = out.clone()
    torch.cuda.synchronize()
    assert not first.isnan().any()
    assert not torch.equal(first, second), "replays reused one mask: the RNG offset did not advance"


def test_dropout_cupy_and_numpy_with_explicit_seed():
    import cupy
    import torch

    b, sq, sk, h, d = 1, 100, 200, 2, 64
    qt, kt, vt = rand_qkv(b, sq, sk, h, h, d, torch.float16)
    q, k, v = (cupy.asarray(x.cpu().numpy()) for x in (qt, kt, vt))
    seed = (2 ** 63 + 11, 3)
    out, lse, probs = cuflash.flash_attn_func(q, k, v, P_DROP, causal=True, return_attn_probs=True,
                                              dropout_seed=seed)
    keep_np = dropout.keep_mask(seed[0], seed[1], P_DROP, b, h, sq, sk)
    keep = torch.from_numpy(keep_np).cuda()
    ref, _ = attention_with_mask(qt, kt, vt, True, 1 / 8, torch.float64, keep, P_DROP)
    low, _ = attention_with_mask(qt, kt, vt, True, 1 / 8, torch.float16, keep, P_DROP)
    got = torch.from_numpy(cupy.asnumpy(out)).cuda()
    assert max_err(got, ref) <= 2 * max_err(low, ref) + 1e-5
    visible = cupy.asnumpy(probs) != 0
    assert ((cupy.asnumpy(probs) > 0) == keep_np)[visible].all()
    # NumPy goes through the GPU with the same mask
    out_np = cuflash.flash_attn_func(qt.cpu().numpy(), kt.cpu().numpy(), vt.cpu().numpy(), P_DROP,
                                     causal=True, dropout_seed=seed)
    assert np.array_equal(out_np, cupy.asnumpy(out))
    # the backward with the same seed: gradients of the masked reference (3x rule)
    dout_t = torch.randn(b, sq, h, d, device="cuda", dtype=torch.float16)
    dq, dk, dv = cuflash.flash_attn_backward(cupy.asarray(dout_t.cpu().numpy()), q, k, v, out, lse,
                                             causal=True, dropout_p=P_DROP, dropout_seed=seed)
    x = [t.detach().clone().requires_grad_() for t in (qt, kt, vt)]
    ref_g = torch.autograd.grad(attention_with_mask(*x, True, 1 / 8, torch.float64, keep, P_DROP)[0],
                                x, dout_t.double())
    low_g = torch.autograd.grad(attention_with_mask(*x, True, 1 / 8, torch.float16, keep, P_DROP)[0],
                                x, dout_t)
    for a, r, lo in zip((dq, dk, dv), ref_g, low_g):
        a = torch.from_numpy(cupy.asnumpy(a)).cuda()
        assert max_err(a, r) <= 3 * max_err(lo, r) + 1e-3 * max(1.0, r.abs().max().item())


def test_dropout_selection_and_its_configs_carry_the_flag():
    from cuflash import _gpu
    from cuflash.problem import Problem
    from cuflash.select import choose_on_device

    p = Problem("fwd", "bf16", 1, 4096, 4096, 16, 16, 128, True, features=("dropout",), dropout_p=0.1)
    fam, cfg, _ = choose_on_device(p, 0)
    # the forward: sm90_fwd on sm_90 (tests/test_sm90_dropout_gpu.py), fa2_fwd elsewhere
    assert fam.name == ("sm90_fwd" if tuple(_gpu.arch(0)) == (9, 0) else "fa2_fwd") and cfg.dropout
    fam, cfg, _ = choose_on_device(p.replace(op="bwd"), 0)
    # the backward at d 128: sm90_bwd on sm_90 (its rank: head dims 97..128), fa2_bwd elsewhere
    assert fam.name == ("sm90_bwd" if tuple(_gpu.arch(0)) == (9, 0) else "fa2_bwd") and cfg.dropout


# ---------------------------------------------------------------------------------------
# dropout under torch.compile: the ops cuflash::fwd_dropout / bwd_dropout (torch_ops.py)

def _compiled(fn, backend):
    import torch

    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=backend)


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("head_dim", [64, 59])
def test_dropout_compiled_matches_eager_bitwise_for_a_seed(backend, head_dim):
    """The same dropout_seed: the compiled call runs the same kernels on the same inputs and
    state as eager, so out and the (deterministic) gradients are bitwise equal."""
    import torch

    q, k, v = rand_qkv(2, 113, 130, 4, 2, head_dim, torch.bfloat16, grad=True)
    dout = torch.randn_like(q)

    def f(q, k, v):
        return cuflash.flash_attn_func(q, k, v, P_DROP, causal=True, deterministic=True,
                                       dropout_seed=(5, 9))

    out = f(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    cf = _compiled(f, backend)
    out_c = cf(q, k, v)
    grads_c = torch.autograd.grad(out_c, (q, k, v), dout)
    assert not out.isnan().any()
    assert torch.equal(out, out_c)
    for a, b in zip(grads, grads_c):
        assert not a.isnan().any() and torch.equal(a, b)
    # and the seed's mask is the mirror's: the same answer as the reference with it
    keep = torch.from_numpy(dropout.keep_mask(5, 9, P_DROP, 2, 4, 113, 130)).cuda()
    scale = 1 / math.sqrt(head_dim)
    ref, _ = attention_with_mask(q, k, v, True, scale, torch.float64, keep, P_DROP)
    low, _ = attention_with_mask(q, k, v, True, scale, torch.bfloat16, keep, P_DROP)
    assert max_err(out_c, ref) <= 2 * max_err(low, ref) + 1e-5


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_dropout_compiled_draws_fresh_and_reproducible_states(backend):
    """No dropout_seed: the state is drawn inside the compiled graph from torch's generator:
    another mask per call, the same again after torch.manual_seed (deterministic backward:
    bitwise equal gradients)."""
    import torch

    q, k, v = rand_qkv(2, 256, 256, 4, 4, 64, torch.bfloat16, grad=True)
    dout = torch.randn_like(q)
    cf = _compiled(lambda q, k, v: cuflash.flash_attn_func(q, k, v, 0.1, causal=True,
                                                           deterministic=True), backend)

    def run():
        out = cf(q, k, v)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    torch.manual_seed(0)
    a = run()
    b = run()
    torch.manual_seed(0)
    c = run()
    assert not torch.equal(a[0], b[0])
    for x, y in zip(a, c):
        assert not x.isnan().any() and torch.equal(x, y)


def test_dropout_cuda_graph_of_a_compiled_step():
    """A compiled forward + backward step captured in a CUDA graph (mode="reduce-overhead",
    and torch.cuda.graph of the compiled forward): replays draw fresh masks, nothing NaN."""
    import torch

    q, k, v = rand_qkv(1, 128, 128, 2, 2, 64, torch.bfloat16, grad=True)
    dout = torch.randn_like(q)
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, mode="reduce-overhead")
    def step(q, k, v):
        return cuflash.flash_attn_func(q, k, v, 0.2, causal=True)

    outs = []
    for _ in range(4):
        out = step(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        outs.append(out.detach().clone())
        assert not any(g.isnan().any() for g in grads)
    assert not outs[-1].isnan().any() and not torch.equal(outs[-1], outs[-2])

    fwd = _compiled(lambda q, k, v: cuflash.flash_attn_func(q, k, v, 0.2), "inductor")
    qd, kd, vd = (x.detach() for x in (q, k, v))
    for _ in range(2):  # warm up outside the capture
        fwd(qd, kd, vd)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fwd(qd, kd, vd)
    graph.replay()
    first = out.clone()
    graph.replay()
    second = out.clone()
    torch.cuda.synchronize()
    assert not first.isnan().any()
    assert not torch.equal(first, second), "replays reused one mask"


def test_varlen_dropout_compiled_matches_eager_for_a_seed():
    import torch

    lens = [17, 113, 1]
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32, device="cuda")
    total, h, d = sum(lens), 4, 64
    q, k, v = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)

    def f(q, k, v):
        return cuflash.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), P_DROP,
                                              causal=True, deterministic=True, dropout_seed=(3, 1))

    out = f(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    cf = _compiled(f, "aot_eager")
    out_c = cf(q, k, v)
    grads_c = torch.autograd.grad(out_c, (q, k, v), dout)
    assert torch.equal(out, out_c)
    for a, b in zip(grads, grads_c):
        assert torch.equal(a, b)
