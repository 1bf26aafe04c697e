"""cuflash.ops.fused_dense's fused dense / MLP without a GPU: flash-attn 2.8's signatures and
defaults (fused_dense, ops.triton.mlp / linear / k_activations); the torch composition and
FusedMLPFunc (the fused path's autograd.Function, here over dense_act's float64 reference) against
float64 formulas at every activation x checkpoint_lvl x return_residual, gradcheck; argument errors
naming the argument; which calls take which path (the cuBLASLt epilogue rule); dense_act.cu compiled
by nvcc without spills with its params struct laid out as cuflash.launch packs it; the plan and its
launches mocked; warmup --helpers dense_act; torch.compile(fullgraph) through the cuflash::dense_act
ops; torch.library.opcheck. The process-group paths run in tests/test_parallel_mlp_cpu.py (gloo)."""
import inspect
import types

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from cuflash import dense_act  # noqa: E402
from cuflash.compile import kernel_dir  # noqa: E402
from cuflash.modules.mlp import FusedMLP, ParallelFusedMLP  # noqa: E402
from cuflash.ops import fused_dense  # noqa: E402
from cuflash.ops.fused_dense import (FusedDense, FusedDenseFunc, FusedMLPFunc, fused_dense_func,  # noqa: E402
                                     fused_mlp_func)
from cuflash.ops.triton import k_activations, linear, mlp as tmlp  # noqa: E402

F64 = dict(dtype=torch.float64)
ACTS = ("gelu_approx", "relu", "sqrelu")


def params(fn, drop_first=False):
    ps = list(inspect.signature(fn).parameters.values())[1 if drop_first else 0:]
    return [p.name if p.default is inspect.Parameter.empty else (p.name, p.default) for p in ps]


FLASH_ATTN = {   # flash-attn 2.8's signatures: (callable, drop self / ctx, parameters)
    "FusedDenseFunc.forward": (FusedDenseFunc.forward, True, [
        "x", "weight", "bias", ("return_residual", False), ("process_group", None), ("sequence_parallel", True)]),
    "fused_dense_func": (fused_dense_func, False, [
        "x", "weight", ("bias", None), ("return_residual", False), ("process_group", None),
        ("sequence_parallel", True)]),
    "FusedDense.__init__": (FusedDense.__init__, True, [
        "in_features", "out_features", ("bias", True), ("return_residual", False), ("device", None),
        ("dtype", None)]),
    "FusedDense.forward": (FusedDense.forward, True, ["x", ("process_group", None)]),
    "FusedMLPFunc.forward": (FusedMLPFunc.forward, True, [
        "x", "weight1", "bias1", "weight2", "bias2", ("activation", "gelu_approx"), ("save_pre_act", True),
        ("return_residual", False), ("checkpoint_lvl", 0), ("heuristic", 0), ("process_group", None),
        ("sequence_parallel", True)]),
    "fused_mlp_func": (fused_mlp_func, False, [
        "x", "weight1", "weight2", ("bias1", None), ("bias2", None), ("activation", "gelu_approx"),
        ("save_pre_act", True), ("return_residual", False), ("checkpoint_lvl", 0), ("heuristic", 0),
        ("process_group", None), ("sequence_parallel", True)]),
    "FusedMLP.__init__": (FusedMLP.__init__, True, [
        "in_features", "hidden_features", ("out_features", None), ("bias1", True), ("bias2", True),
        ("activation", "gelu_approx"), ("return_residual", False), ("checkpoint_lvl", 0), ("heuristic", "auto"),
        ("device", None), ("dtype", None)]),
    "FusedMLP.forward": (FusedMLP.forward, True, ["x", ("process_group", None)]),
    "FusedDenseSqreluDense.__init__": (tmlp.FusedDenseSqreluDense.__init__, True, [
        "in_features", ("hidden_features", None), ("out_features", None), ("bias1", True), ("bias2", True),
        ("checkpoint_lvl", 0), ("device", None), ("dtype", None)]),
    "FusedDenseSqreluDenseFunc.apply": (tmlp.FusedDenseSqreluDenseFunc.apply, False, [
        "x", "weight1", "bias1", "weight2", "bias2", ("checkpoint_lvl", 0)]),
    "triton_linear_act": (linear.triton_linear_act, False, [
        "x", "weight", ("bias", None), ("activation", "id"), ("save_act_input", False)]),
    "triton_dgrad_act": (linear.triton_dgrad_act, False, [
        "grad_output", "weight", ("activation", "id"), ("act_input", None)]),
}


@pytest.mark.parametrize("name", sorted(FLASH_ATTN))
def test_flash_attn_signatures(name):
    fn, drop, want = FLASH_ATTN[name]
    assert params(fn, drop) == want


def test_names():
    from cuflash.ops.triton import mlp as m
    assert m.fused_dense_sqrelu_dense_function is m.FusedDenseSqreluDenseFunc.apply
    assert fused_dense.FusedMLP is FusedMLP and fused_dense.ParallelFusedMLP is ParallelFusedMLP
    assert {"FusedDenseFunc", "fused_dense_func", "FusedDense", "FusedMLPFunc", "fused_mlp_func"} <= set(
        fused_dense.__all__)
    names = ("gelu", "gelu_grad", "gelu_approx", "gelu_approx_grad", "squared_relu", "squared_relu_grad", "relu",
             "relu_grad", "leaky_relu", "leaky_relu_grad", "tanh", "cosh", "Activation",
             "get_triton_activation_kernel", "get_triton_activation_bwd_kernel")
    assert all(hasattr(k_activations, n) for n in names)
    assert isinstance(FusedDense(3, 4), torch.nn.Linear)
    from cuflash import rotary
    from cuflash.ops.triton import rotary as trot
    assert trot.apply_rotary is rotary.apply_rotary
    assert params(trot.apply_rotary) == ["x", "cos", "sin", ("seqlen_offsets", 0), ("cu_seqlens", None),
                                         ("max_seqlen", None), ("interleaved", False), ("inplace", False),
                                         ("conjugate", False)]


def leaves(rows=(2, 5), n_in=7, hidden=11, n_out=6, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, **F64).requires_grad_(True)  # noqa: E731
    return mk(*rows, n_in), mk(hidden, n_in), mk(hidden) if bias else None, mk(n_out, hidden), \
        mk(n_out) if bias else None


def formula(x, w1, b1, w2, b2, act):
    h = x @ w1.T + (0 if b1 is None else b1)
    a = {"gelu_approx": lambda t: 0.5 * t * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (t + 0.044715 * t ** 3))),
         "relu": lambda t: t.clamp_min(0), "sqrelu": lambda t: t.clamp_min(0) ** 2}[act](h)
    return a @ w2.T + (0 if b2 is None else b2)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rr", [False, True], ids=["out", "residual"])
@pytest.mark.parametrize("lvl", [0, 1, 2])
@pytest.mark.parametrize("act", ACTS)
def test_function_and_composition_match_formula(act, lvl, rr, bias):
    """FusedMLPFunc (the fused path's Function; dense_act's float64 reference here) and fused_mlp_func's
    composition: the same outputs and gradients as the formula, in float64."""
    ins = leaves(bias=bias, seed=lvl)
    x, w1, b1, w2, b2 = ins
    want = formula(*ins, act)
    g = torch.randn(want.shape, **F64)
    gres = torch.randn(x.shape, **F64)
    live = [t for t in ins if t is not None]
    wg = torch.autograd.grad(want.mul(g).sum() + x.mul(gres).sum() * rr, live)
    for out in (FusedMLPFunc.apply(x, w1, b1, w2, b2, act, True, rr, lvl, 0, None, True),
                fused_mlp_func(x, w1, w2, b1, b2, act, True, rr, lvl)):
        y, res = out if rr else (out, None)
        assert torch.allclose(y, want, atol=1e-12, rtol=1e-10)
        loss = y.mul(g).sum() + (res.mul(gres).sum() if rr else 0)
        if rr:
            assert torch.equal(res, x)
        for a, b in zip(torch.autograd.grad(loss, live), wg):
            assert torch.allclose(a, b, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("act", ACTS)
def test_gradcheck(act):
    x, w1, b1, w2, b2 = leaves(rows=(4,), n_in=3, hidden=5, n_out=2)
    x = (x + 0.05).detach().requires_grad_(True)   # relu: no input at exactly 0

    def f(x, w1, b1, w2, b2):
        return FusedMLPFunc.apply(x, w1, b1, w2, b2, act, True, True, 1, 0, None, True)[0]

    assert torch.autograd.gradcheck(f, (x, w1, b1, w2, b2))
    assert torch.autograd.gradcheck(lambda x, w, b: FusedDenseFunc.apply(x, w, b, True, None, True)[0], (x, w1, b1))


def test_save_pre_act_false_is_lvl2():
    x, w1, b1, w2, b2 = leaves()
    hidden = w1.shape[0]
    for save, lvl, want in ((True, 0, 5), (True, 1, 4), (False, 0, 4), (True, 2, 4)):
        y = FusedMLPFunc.apply(x, w1, b1, w2, b2, "relu", save, False, lvl, 0, None, True)
        saved = y.grad_fn.saved_tensors
        assert len(saved) == want
        # lvl 2 (and save_pre_act=False) keep no (rows, hidden) tensor: x, weight1, weight2, bias1
        assert any(t is not None and t.shape[-1] == hidden and t.dim() == 2 and t.shape[0] == 10
                   for t in saved) == (save and lvl != 2)
        assert torch.allclose(y, formula(x, w1, b1, w2, b2, "relu"))


def test_dense_act_reference_matches_k_activations():
    x = torch.randn(5, 9, **F64) * 3
    g = torch.randn(5, 9, **F64)
    for name, fwd, bwd in (("gelu_approx", k_activations.gelu_approx, k_activations.gelu_approx_grad),
                           ("sqrelu", k_activations.squared_relu, k_activations.squared_relu_grad),
                           ("relu", k_activations.relu, k_activations.relu_grad)):
        assert torch.allclose(dense_act.reference_forward(x, name), fwd(x))
        d, db = dense_act.reference_backward(g, x, name, True)
        assert torch.allclose(d, g * bwd(x)) and torch.allclose(db, (g * bwd(x)).sum(0))
    xt = x.clone().requires_grad_(True)
    torch.autograd.grad(F.gelu(xt, approximate="tanh").sum(), xt)[0].allclose(k_activations.gelu_approx_grad(x))
    assert torch.allclose(torch.autograd.grad(F.gelu(xt).sum(), xt)[0], k_activations.gelu_grad(x))
    assert torch.allclose(k_activations.gelu(x), F.gelu(x))


def test_triton_linear_names():
    x, w, b = torch.randn(2, 3, 5, **F64), torch.randn(4, 5, **F64), torch.randn(4, **F64)
    for act, f in (("id", lambda t: t), ("gelu", F.gelu), ("gelu_approx", lambda t: F.gelu(t, approximate="tanh")),
                   ("squared_relu", lambda t: F.relu(t) ** 2)):
        out, pre = linear.triton_linear_act(x, w, b, act, save_act_input=True)
        assert torch.allclose(pre, F.linear(x, w, b)) and torch.allclose(out, f(pre))
        assert torch.allclose(linear.triton_linear_act(x, w, b, act), out)
        gout, w2 = torch.randn(2, 3, 3, **F64), torch.randn(3, 4, **F64)   # fc2's output gradient, weight
        pre_l = pre.clone().requires_grad_(True)
        want = torch.autograd.grad(f(pre_l), pre_l, gout @ w2)[0]
        got = linear.triton_dgrad_act(gout, w2, act, act_input=pre)
        assert torch.allclose(got, want)
    with pytest.raises(ValueError, match="activation"):
        linear.triton_linear_act(x, w, b, "relu")
    with pytest.raises(ValueError, match="act_input"):
        linear.triton_dgrad_act(torch.randn(2, 4, **F64), w, "gelu")
    with pytest.raises(ValueError, match="act_input"):
        linear.triton_dgrad_act(torch.randn(2, 4, **F64), w, "gelu", act_input=torch.randn(2, 4, **F64))


def test_sqrelu_dense_module():
    m = tmlp.FusedDenseSqreluDense(6, checkpoint_lvl=2, **F64)
    assert m.fc1.weight.shape == (24, 6) and list(m.state_dict()) == ["fc1.weight", "fc1.bias", "fc2.weight",
                                                                       "fc2.bias"]
    x = torch.randn(3, 6, **F64)
    assert torch.allclose(m(x), formula(x, m.fc1.weight, m.fc1.bias, m.fc2.weight, m.fc2.bias, "sqrelu"))
    with pytest.raises(ValueError, match="checkpoint_lvl"):
        tmlp.FusedDenseSqreluDense(6, checkpoint_lvl=3)


def test_fused_dense_module_and_func():
    torch.manual_seed(1)
    m = FusedDense(5, 3, return_residual=True, **F64)
    x = torch.randn(2, 4, 5, **F64)
    out, res = m(x)
    assert res is x and torch.allclose(out, F.linear(x, m.weight, m.bias))
    assert torch.equal(fused_dense_func(x, m.weight), F.linear(x, m.weight))


def test_bad_arguments_name_themselves():
    x, w1, b1, w2, b2 = leaves()
    cases = [
        (dict(activation="gelu"), "activation"), (dict(checkpoint_lvl=3), "checkpoint_lvl"),
        (dict(heuristic=5), "heuristic"), (dict(heuristic="auto"), "heuristic"),
        (dict(weight1=w1[:, :3]), "weight1"), (dict(weight2=w2[:, :4]), "weight2"),
        (dict(bias1=b1[:3]), "bias1"), (dict(bias2=b2[:2]), "bias2"),
        (dict(weight2=w2.float()), "weight2"), (dict(x=x[..., :3]), "x's last dimension"),
    ]
    for kw, match in cases:
        args = dict(x=x, weight1=w1, weight2=w2, bias1=b1, bias2=b2)
        args.update(kw)
        with pytest.raises(ValueError, match=match):
            fused_mlp_func(**args)
    with pytest.raises(ValueError, match="weight"):
        fused_dense_func(x, w1[:, :2])
    with pytest.raises(ValueError, match="bias"):
        fused_dense_func(x, w1, b1[:2])
    with pytest.raises(ValueError, match="activation"):
        FusedMLP(4, 8, activation="swiglu")
    with pytest.raises(ValueError, match="heuristic"):
        FusedMLP(4, 8, heuristic=7)


def test_routes(monkeypatch):
    """CPU calls without a group: the composition; the Function otherwise. fc1's activation epilogue
    only for CUDA 16-bit, bias, aligned sizes, heuristic != -1, gelu_approx / relu."""
    x, w1, b1, w2, b2 = leaves()
    calls = []
    real = FusedMLPFunc.apply
    monkeypatch.setattr(FusedMLPFunc, "apply", lambda *a: calls.append(a) or real(*a))
    fused_mlp_func(x, w1, w2, b1, b2)
    assert not calls
    fake = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, shape=(64, 128), data_ptr=lambda: 256)
    w = types.SimpleNamespace(shape=(512, 128), data_ptr=lambda: 512)
    b = types.SimpleNamespace(data_ptr=lambda: 1024)
    assert fused_dense.epilogue_takes(fake, w, b, "gelu_approx", 0)
    assert fused_dense.epilogue_takes(fake, w, b, "relu", 4)
    assert not fused_dense.epilogue_takes(fake, w, b, "sqrelu", 0)
    assert not fused_dense.epilogue_takes(fake, w, b, "gelu_approx", -1)
    assert not fused_dense.epilogue_takes(fake, w, None, "gelu_approx", 0)
    assert not fused_dense.epilogue_takes(fake, types.SimpleNamespace(shape=(510, 128), data_ptr=lambda: 0), b,
                                          "relu", 0)
    odd = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, shape=(64, 127), data_ptr=lambda: 0)
    assert not fused_dense.epilogue_takes(odd, w, b, "relu", 0)
    misaligned = types.SimpleNamespace(is_cuda=True, dtype=torch.float16, shape=(64, 128), data_ptr=lambda: 2)
    assert not fused_dense.epilogue_takes(misaligned, w, b, "relu", 0)


def test_small_training_calls_take_the_composition(monkeypatch):
    """FUSED_MIN_ELEMENTS: lvl-0 gelu_approx / relu training calls below it take the torch composition;
    sqrelu, lvl 1 / 2 and save_pre_act=False never; calls with nothing to differentiate run the fused
    forward without the autograd.Function, below the threshold too. (The CUDA rule forced onto CPU float64: dense_act's reference.)"""
    x, w1, b1, w2, b2 = leaves()   # 10 rows x 11 hidden
    take = fused_dense._composition_takes
    monkeypatch.setattr(fused_dense, "FUSED_MIN_ELEMENTS", 111)
    assert take(x, w1, "gelu_approx", True, 0) and take(x, w1, "relu", True, 0)
    assert not take(x, w1, "sqrelu", True, 0) and not take(x, w1, "relu", True, 1)
    assert not take(x, w1, "relu", False, 0) and not take(x, w1, "gelu_approx", True, 2)
    monkeypatch.setattr(fused_dense, "FUSED_MIN_ELEMENTS", 110)
    assert not take(x, w1, "gelu_approx", True, 0) and take(x, w1, "relu", True, 0)
    monkeypatch.setattr(fused_dense, "_takes_fused", lambda *a: True)
    calls = []
    real = FusedMLPFunc.apply
    monkeypatch.setattr(FusedMLPFunc, "apply", lambda *a: calls.append(a) or real(*a))
    want = formula(x, w1, b1, w2, b2, "gelu_approx")
    assert torch.allclose(fused_mlp_func(x, w1, w2, b1, b2), want) and len(calls) == 1
    with torch.no_grad():
        out, res = fused_mlp_func(x, w1, w2, b1, b2, return_residual=True)
    assert torch.allclose(out, want) and torch.equal(res, x) and len(calls) == 1 and out.grad_fn is None
    monkeypatch.setattr(fused_dense, "FUSED_MIN_ELEMENTS", 111)
    assert torch.allclose(fused_mlp_func(x, w1, w2, b1, b2), want) and len(calls) == 1   # the composition
    fused_mlp_func(x, w1, w2, b1, b2, activation="sqrelu")
    assert len(calls) == 2
    # inference takes the fused forward whatever the training rule says (the epilogue where it applies)
    forwards = []
    real_fwd = fused_dense._mlp_forward
    monkeypatch.setattr(fused_dense, "_mlp_forward", lambda *a: forwards.append(a) or real_fwd(*a))
    with torch.no_grad():
        out = fused_mlp_func(x, w1, w2, b1, b2)
    assert torch.allclose(out, want) and len(forwards) == 1 and len(calls) == 2 and out.grad_fn is None


def test_module_heuristic_auto(monkeypatch):
    m = FusedMLP(4, 8)
    assert m.heuristic == "auto"
    seen = []
    real = fused_dense.fused_mlp_func
    monkeypatch.setattr("cuflash.modules.mlp.fused_mlp_func", lambda *a, **k: seen.append(k) or real(*a, **k))
    m.eval()
    m(torch.randn(3, 4))
    assert seen[-1]["heuristic"] == fused_dense.AUTO_HEURISTIC and seen[-1]["save_pre_act"] is False
    assert FusedMLP(4, 8, activation="sqrelu").heuristic == -1


def test_compiles_fullgraph():
    """torch.compile traces FusedMLPFunc (its activations through cuflash::dense_act_fwd / _bwd)
    in one graph (aot_eager: no C++ build here)."""
    torch._dynamo.reset()
    ins = leaves()

    def f(x, w1, b1, w2, b2):
        return FusedMLPFunc.apply(x, w1, b1, w2, b2, "gelu_approx", True, False, 1, 0, None, True)

    y = torch.compile(f, backend="aot_eager", fullgraph=True)(*ins)
    g = torch.autograd.grad(y.sum(), ins)
    y2 = f(*ins)
    assert torch.allclose(y, y2)
    assert all(torch.allclose(a, b) for a, b in zip(g, torch.autograd.grad(y2.sum(), ins)))


def test_opcheck():
    pre = torch.randn(4, 6, **F64)
    torch.library.opcheck(torch.ops.cuflash.dense_act_fwd.default, (pre, "gelu_approx"))
    torch.library.opcheck(torch.ops.cuflash.dense_act_bwd.default, (torch.randn(4, 6, **F64), pre, "relu", True))


def test_kernel_takes():
    assert not dense_act.kernel_takes(torch.randn(3, 4, dtype=torch.bfloat16))   # CPU
    with pytest.raises(ValueError, match="activation"):
        dense_act.forward(torch.randn(3, 4), "gelu")


from helper_kernel_checks import assert_params_layout, needs_nvcc, ptxas_reports  # noqa: E402


def instantiations():
    return list(dict.fromkeys(n for dt in (torch.bfloat16, torch.float16) for a in dense_act.ACTIVATIONS
                              for v in (True, False) for n in dense_act.kernel_names(dt, a, v)))


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_kernel_compiles_without_spills(tmp_path, arch):
    reports = ptxas_reports(tmp_path, "dense_act", "DenseActParams", instantiations(), arch)
    assert all(r.spill_stores == 0 and r.stack_bytes == 0 for r in reports), reports


@needs_nvcc
def test_params_layout_matches_nvcc(tmp_path):
    dt = assert_params_layout(tmp_path, "DenseActParams", "params_dense_act.cuh")
    assert dense_act._PTRS.size == dt.fields["rows"][1]
    assert dt.names[:len(dense_act._POINTER_FIELDS)] == dense_act._POINTER_FIELDS


def test_host_constants_match_the_kernel():
    src = (kernel_dir() / "dense_act.cu").read_text()
    for const, value in (("kDaThreads", dense_act.THREADS), ("kDaRows", dense_act.ROWS_PER_STEP),
                         ("kDaFinishThreads", dense_act.FINISH_THREADS)):
        assert f"constexpr int {const} = {value};" in src
    for name, k in dense_act.ACTIVATIONS.items():
        tag = {"gelu_approx": "kActGeluApprox", "relu": "kActRelu", "sqrelu": "kActSqrelu"}[name]
        assert f"constexpr int {tag} = {k};" in src


def test_split_rows():
    for rows, n in ((16384, 11008), (16384, 3072), (5, 8), (1, 1), (4099, 1032)):
        splits, per = dense_act.split_rows(rows, n, 132)
        assert per >= dense_act.ROWS_PER_STEP and splits * per >= rows and (splits - 1) * per < rows
    assert dense_act.split_rows(16384, 3072, 132) == (-(-16384 // 47), 47)


def _mock_plan(monkeypatch):
    from cupy_backends.cuda.api import driver

    from cuflash import launch as launch_mod

    monkeypatch.setattr(dense_act.compile_mod, "get_helper_functions",
                        lambda src, names, dev: tuple(range(1, len(names) + 1)))
    monkeypatch.setattr(launch_mod, "_device_fns", lambda: (lambda: 0, lambda d: None))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(multi_processor_count=132))
    calls = []
    monkeypatch.setattr(driver, "launchKernel", lambda *a: calls.append(a))
    return calls


def test_plan_launch_path_mocked(monkeypatch):
    calls = _mock_plan(monkeypatch)
    plan = dense_act._Plan(16384, 11008, torch.bfloat16, "sqrelu", types.SimpleNamespace(index=0), True)
    assert plan.col_blocks == 11 and plan.splits == 96
    plan.run((16, 32, 48, 64, 80, 96), ((plan.bwd_bias, plan.col_blocks, plan.splits, 128, 0),
                                        (plan.finish, 43, 1, 256, 0)), 7)
    assert [c[:9] for c in calls] == [(2, 11, 96, 1, 128, 1, 1, 0, 7), (4, 43, 1, 1, 256, 1, 1, 0, 7)]
    rec = plan.rec.record
    assert tuple(int(rec[f][0]) for f in dense_act._POINTER_FIELDS) == (16, 32, 48, 64, 80, 96)
    assert int(rec["rows_per_split"][0]) == 171 and int(rec["n"][0]) == 11008


def test_warm_modules_are_the_calls(monkeypatch):
    """python -m cuflash warmup --helpers dense_act: the modules warmed are those aligned calls' plans
    load (the same source and name expressions: CuPy's disk-cache key)."""
    from cuflash import warmup

    loaded = []
    monkeypatch.setattr(dense_act.compile_mod, "get_helper_functions",
                        lambda src, names, dev: loaded.append((src, names)) or tuple(range(len(names))))
    from cuflash import launch as launch_mod
    monkeypatch.setattr(launch_mod, "_device_fns", lambda: (lambda: 0, lambda d: None))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(multi_processor_count=132))
    for act in dense_act.ACTIVATIONS:
        dense_act._Plan(64, 3072, torch.bfloat16, act, types.SimpleNamespace(index=0), True)
    mods = warmup.helper_modules(["dense_act"], ["bf16"])
    assert [(m.source, m.names) for m in mods] == loaded
    assert "dense_act" in warmup.parse_helpers("all")
