"""cuflash.ops.fused_dense's fused path on CUDA (kernels_cu/dense_act.cu and the cuBLASLt epilogues)
against the float64 composition fc2(act(fc1(x))) on the same data: the output within 2x, every
gradient within 3x the error of the same composition run plainly in the inputs' dtype (F.linear,
F.gelu(approximate='tanh') / F.relu / relu², F.linear with torch's autograd). Every activation x
checkpoint_lvl x return_residual, bf16 and fp16, aligned sizes and odd ones (in / hidden / out not
multiples of 8: dense_act's one-element accesses, and fc1's activation epilogue refused for the
kernel); the inference form (save_pre_act=False: the epilogue where it applies, heuristic -1: never);
dense_act's kernels alone (in place, misaligned, no bias gradient, rows fewer than the splits);
FusedDense with return_residual; FusedMLP under autocast. Outputs NaN-poisoned before launches.

``tests/dense_act_precompile.py`` fills the kernel cache in parallel first."""
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from cuflash import api  # noqa: E402
from cuflash import dense_act  # noqa: E402
from cuflash.modules.mlp import FusedMLP  # noqa: E402
from cuflash.ops import fused_dense  # noqa: E402
from cuflash.ops.fused_dense import FusedDense, fused_mlp_func  # noqa: E402

pytestmark = [pytest.mark.gpu]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# (rows, in, hidden, out): 16-byte rows / odd sizes (one-element accesses, no epilogue)
SHAPES = {"aligned": (515, 128, 520, 136), "odd": (67, 37, 101, 29)}
ACTS = ("gelu_approx", "relu", "sqrelu")


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(api, "POISON_OUTPUTS", True)
    # these shapes are below the size where training calls take the fused path by default
    monkeypatch.setattr(fused_dense, "FUSED_MIN_ELEMENTS", 0)


def test_small_default_calls_take_the_composition(monkeypatch):
    """At the default FUSED_MIN_ELEMENTS a small lvl-0 gelu_approx training call runs the torch
    composition (no FusedMLPFunc, no dense_act launch); sqrelu takes the fused path."""
    monkeypatch.setattr(fused_dense, "FUSED_MIN_ELEMENTS", 1 << 27)
    calls = []
    real = fused_dense.FusedMLPFunc.apply
    monkeypatch.setattr(fused_dense.FusedMLPFunc, "apply", lambda *a: calls.append(a) or real(*a))
    tensors, dout, dres = leaves(torch.bfloat16, *SHAPES["aligned"])
    x, w1, b1, w2, b2 = [t.requires_grad_(True) for t in tensors]
    fused_mlp_func(x, w1, w2, b1, b2).backward(dout)
    assert not calls
    fused_mlp_func(x, w1, w2, b1, b2, activation="sqrelu").backward(dout)
    assert len(calls) == 1


def check(got, ref, base, factor, what, floor=1e-6):
    # plus one unit in the last place at the reference's largest value: each output is rounded once
    floor = floor + torch.finfo(got.dtype).eps * ref.abs().max().item()
    err = (got.double() - ref).abs().max().item()
    base_err = (base.double() - ref).abs().max().item()
    print(f"{what}: error {err:.3e}, plain {base_err:.3e}")
    assert not torch.isnan(got).any(), f"{what}: NaN (an unwritten element?)"
    assert err <= factor * base_err + floor, f"{what}: error {err:.3e} > {factor} x plain {base_err:.3e} + {floor}"


def act_torch(t, activation):
    if activation == "gelu_approx":
        return F.gelu(t, approximate="tanh")
    return F.relu(t) if activation == "relu" else torch.square(F.relu(t))


def leaves(dtype, rows, n_in, hidden, n_out, bias=True, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, n_in, device="cuda", generator=g)
    w1 = torch.randn(hidden, n_in, device="cuda", generator=g) / n_in ** 0.5
    b1 = 0.3 * torch.randn(hidden, device="cuda", generator=g) if bias else None
    w2 = torch.randn(n_out, hidden, device="cuda", generator=g) / hidden ** 0.5
    b2 = 0.3 * torch.randn(n_out, device="cuda", generator=g) if bias else None
    dout = torch.randn(rows, n_out, device="cuda", generator=g)
    dres = torch.randn(rows, n_in, device="cuda", generator=g)
    cast = [None if t is None else t.to(dtype) for t in (x, w1, b1, w2, b2)]
    return cast, dout.to(dtype), dres.to(dtype)


def run(fn, tensors, dout, dres, return_residual, to=None):
    ins = [None if t is None else (t.to(to) if to else t).detach().clone().requires_grad_(True) for t in tensors]
    x, w1, b1, w2, b2 = ins
    out = fn(x, w1, b1, w2, b2)
    d = dout.to(to) if to else dout
    if return_residual:
        out, res = out
        torch.autograd.backward([out, res], [d, dres.to(to) if to else dres])
    else:
        out.backward(d)
    return [out.detach()] + [None if t is None else t.grad for t in ins]


def composition(activation, return_residual):
    def fn(x, w1, b1, w2, b2):
        out = F.linear(act_torch(F.linear(x, w1, b1), activation), w2, b2)
        return (out, x) if return_residual else out
    return fn


NAMES = ("out", "dx", "dw1", "db1", "dw2", "db2")


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("return_residual", [False, True], ids=["out", "residual"])
@pytest.mark.parametrize("lvl", [0, 1, 2])
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("dt", sorted(DTYPES))
def test_fused_mlp_matches_float64(dt, activation, lvl, return_residual, shape):
    dtype = DTYPES[dt]
    tensors, dout, dres = leaves(dtype, *SHAPES[shape], seed=lvl)

    def fused(x, w1, b1, w2, b2):
        return fused_mlp_func(x, w1, w2, b1, b2, activation=activation, return_residual=return_residual,
                              checkpoint_lvl=lvl)

    got = run(fused, tensors, dout, dres, return_residual)
    ref = run(composition(activation, return_residual), tensors, dout, dres, return_residual, to=torch.float64)
    base = run(composition(activation, return_residual), tensors, dout, dres, return_residual)
    for name, a, r, b in zip(NAMES, got, ref, base):
        check(a, r, b, 2 if name == "out" else 3, f"{dt} {activation} lvl{lvl} {shape} {name}")


@pytest.mark.parametrize("heuristic", [0, -1])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("activation", ACTS)
def test_inference_forms(activation, shape, heuristic, monkeypatch):
    """save_pre_act=False: fc1's activation in the cuBLASLt epilogue where it applies (aligned,
    gelu_approx / relu, heuristic 0), else F.linear + dense_act; counted."""
    tensors, _, _ = leaves(torch.bfloat16, *SHAPES[shape], seed=3)
    calls = {"epilogue": 0}
    real = torch._addmm_activation

    def counting(*a, **k):
        calls["epilogue"] += 1
        return real(*a, **k)

    monkeypatch.setattr(torch, "_addmm_activation", counting)
    x, w1, b1, w2, b2 = tensors
    with torch.no_grad():
        got = fused_mlp_func(x, w1, w2, b1, b2, activation=activation, save_pre_act=False, heuristic=heuristic)
        ref = composition(activation, False)(*[t.double() for t in tensors])
        base = composition(activation, False)(*tensors)
    check(got, ref, base, 2, f"inference {activation} {shape} h{heuristic}")
    want = int(heuristic == 0 and shape == "aligned" and activation != "sqrelu")
    assert calls["epilogue"] == want


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("dt", sorted(DTYPES))
@pytest.mark.parametrize("rows,n,offset", [(1, 8, 0), (3, 1000, 0), (4099, 1032, 0), (70, 17, 0), (33, 64, 1)])
def test_dense_act_kernels(dt, activation, rows, n, offset):
    """forward, backward with / without dbias, in place or not, against dense_act's float64
    reference; offset 1: every pointer 2 bytes past 16-byte alignment (one-element accesses)."""
    dtype = DTYPES[dt]
    g = torch.Generator(device="cuda").manual_seed(rows + n)

    def mat():
        return (2 * torch.randn(rows * n + offset, device="cuda", generator=g)).to(dtype)[offset:].view(rows, n)

    pre, grad = mat(), mat()
    want = dense_act.reference_forward(pre, activation)
    got = dense_act.forward(pre, activation)
    exact = _act64(pre.double(), activation)
    check(got, exact, want, 1, f"fwd {activation} {rows}x{n}")
    ref_d, ref_db = dense_act.reference_backward(grad, pre, activation, True)
    d64 = grad.double() * _grad64(pre.double(), activation)
    for bias_grad in (True, False):
        for inplace in (False, True):
            gin = grad.clone() if not offset else mat().copy_(grad)
            dpre, db = dense_act.backward(gin, pre, activation, bias_grad, inplace=inplace)
            assert (dpre.data_ptr() == gin.data_ptr()) == (inplace and gin.is_contiguous())
            check(dpre, d64, ref_d, 1, f"bwd {activation} {rows}x{n} dpre")
            if bias_grad:
                check(db, d64.sum(0), ref_db, 2, f"bwd {activation} {rows}x{n} dbias")
            else:
                assert db is None


def _act64(x, a):
    return dense_act._act64(x, a)


def _grad64(x, a):
    return dense_act._grad64(x, a)


def test_zero_rows():
    pre = torch.empty(0, 24, device="cuda", dtype=torch.bfloat16)
    assert dense_act.forward(pre, "relu").shape == (0, 24)
    dpre, db = dense_act.backward(pre.clone(), pre, "relu", True)
    assert dpre.shape == (0, 24) and torch.equal(db, torch.zeros_like(db))


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fused_dense_residual(shape):
    rows, n_in, _, n_out = SHAPES[shape]
    layer = FusedDense(n_in, n_out, return_residual=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, rows, n_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out, res = layer(x)
    assert res is x or torch.equal(res, x)
    gout, gres = torch.randn_like(out), torch.randn_like(x)
    torch.autograd.backward([out, res], [gout, gres])
    x64 = x.detach().double().requires_grad_(True)
    w64 = layer.weight.detach().double().requires_grad_(True)
    b64 = layer.bias.detach().double().requires_grad_(True)
    o64 = F.linear(x64, w64, b64)
    torch.autograd.backward([o64, x64], [gout.double(), gres.double()])
    xb = x.detach().clone().requires_grad_(True)
    wb = layer.weight.detach().clone().requires_grad_(True)
    bb = layer.bias.detach().clone().requires_grad_(True)
    ob = F.linear(xb, wb, bb)
    torch.autograd.backward([ob, xb], [gout, gres])
    for name, a, r, b in (("out", out, o64, ob), ("dx", x.grad, x64.grad, xb.grad),
                          ("dw", layer.weight.grad, w64.grad, wb.grad), ("db", layer.bias.grad, b64.grad, bb.grad)):
        check(a, r, b, 2 if name == "out" else 3, f"FusedDense {shape} {name}")


def test_fused_mlp_module_autocast():
    """fp32 parameters under autocast (bf16): the Function casts, returns bf16, fp32 gradients."""
    torch.manual_seed(1)
    m = FusedMLP(128, 512, activation="gelu_approx").cuda()
    ref = FusedMLP(128, 512, activation="gelu_approx").cuda().double()
    ref.load_state_dict(m.state_dict())
    x = torch.randn(4, 33, 128, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert m.fc1.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    x64 = x.detach().double().requires_grad_(True)
    y64 = ref(x64)
    y64.sum().backward()
    assert torch.allclose(y.double(), y64, atol=0.05, rtol=0.05)
    assert torch.allclose(m.fc1.bias.grad.double(), ref.fc1.bias.grad, atol=0.5, rtol=0.05)


def test_one_rank_group_takes_the_collectives(monkeypatch):
    """A one-rank NCCL group with ONE_RANK_SHORTCUT off: FusedMLP's all-gather / reduce-scatter
    path on one GPU, equal to the call without a group."""
    import os

    import torch.distributed as dist

    if not dist.is_nccl_available():
        pytest.skip("no NCCL")
    started = not dist.is_initialized()
    if started:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        monkeypatch.setattr(fused_dense, "ONE_RANK_SHORTCUT", False)
        torch.manual_seed(2)
        m = FusedMLP(64, 256, activation="sqrelu", device="cuda", dtype=torch.bfloat16)
        x = torch.randn(40, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        x2 = x.detach().clone().requires_grad_(True)
        y = m(x, process_group=dist.group.WORLD)
        y.float().square().sum().backward()
        g1 = [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        y2 = m(x2)
        y2.float().square().sum().backward()
        assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad)
        assert all(torch.equal(a, p.grad) for a, p in zip(g1, m.parameters()))
    finally:
        if started:
            dist.destroy_process_group()
