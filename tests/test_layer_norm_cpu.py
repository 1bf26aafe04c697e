"""cuflash.ops.layer_norm's fused-kernel route without a GPU: the kernel source compiled by nvcc
(sm_80, sm_90a: no spills) with its params struct laid out as cuflash.launch packs it; the route's
plumbing (the torch ops cuflash::layer_norm_fwd / _bwd, whose CPU impls run cuflash.layer_norm's
float64 reference) against the torch composition, eager and under torch.compile(fullgraph);
torch.library.opcheck of the ops; which calls take the route."""

import pytest

torch = pytest.importorskip("torch")

from cuflash import layer_norm as ln_kernels  # noqa: E402
from cuflash.compile import kernel_dir  # noqa: E402
from cuflash.launch import struct_dtype  # noqa: E402
from cuflash.ops import layer_norm as ops  # noqa: E402
from cuflash.ops.layer_norm import layer_norm_fn  # noqa: E402

F64 = dict(dtype=torch.float64)
CASES = {
    "ln": dict(),
    "rms": dict(is_rms_norm=True),
    "ln_res_prenorm": dict(residual=True, prenorm=True),
    "rms_res": dict(residual=True, is_rms_norm=True),
    "rms_prenorm_fp32": dict(prenorm=True, residual_in_fp32=True, is_rms_norm=True),
    "zero_centered": dict(residual=True, prenorm=True, zero_centered_weight=True),
}


@pytest.fixture
def counted(monkeypatch):
    """Counts the kernel module's forward / backward calls; OPS_ROUTE_ON_CPU on."""
    monkeypatch.setattr(ops, "OPS_ROUTE_ON_CPU", True)
    calls = {"fwd": 0, "bwd": 0}
    f, b = ln_kernels.forward, ln_kernels.backward

    def fwd(*a):
        calls["fwd"] += 1
        return f(*a)

    def bwd(*a):
        calls["bwd"] += 1
        return b(*a)

    monkeypatch.setattr(ln_kernels, "forward", fwd)
    monkeypatch.setattr(ln_kernels, "backward", bwd)
    return calls


def run(kw, bias=True, shape=(3, 5, 17)):
    torch.manual_seed(0)
    n = shape[-1]
    x = torch.randn(shape, **F64, requires_grad=True)
    w = torch.randn(n, **F64, requires_grad=True)
    b = torch.randn(n, **F64, requires_grad=True) if bias else None
    r = torch.randn(shape, **F64, requires_grad=True) if kw.get("residual") else None
    args = {k: v for k, v in kw.items() if k != "residual"}
    out = layer_norm_fn(x, w, b, residual=r, **args)
    y, res = out if kw.get("prenorm") else (out, None)
    loss = (y * torch.randn(shape, **F64)).sum()
    if res is not None:
        loss = loss + (res * torch.randn(shape, **F64)).sum()
    loss.backward()
    return [t.detach() for t in (y, res, x.grad, w.grad, None if b is None else b.grad,
                                  None if r is None else r.grad) if t is not None]


@pytest.mark.parametrize("case", sorted(CASES))
def test_ops_route_matches_composition(counted, case):
    kw = CASES[case]
    got = run(kw)
    assert counted == {"fwd": 1, "bwd": 1}
    ops.OPS_ROUTE_ON_CPU = False
    want = run(kw)
    assert counted == {"fwd": 1, "bwd": 1}
    assert len(got) == len(want)
    tol = 1e-12
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        assert torch.allclose(a, b, atol=tol, rtol=1e-10)


def test_ops_route_gradcheck(counted):
    torch.manual_seed(1)
    x = torch.randn(4, 9, **F64, requires_grad=True)
    w = torch.randn(9, **F64, requires_grad=True)
    b = torch.randn(9, **F64, requires_grad=True)
    r = torch.randn(4, 9, **F64, requires_grad=True)
    for rms in (False, True):
        assert torch.autograd.gradcheck(
            lambda x, w, b, r: layer_norm_fn(x, w, b, residual=r, prenorm=True, is_rms_norm=rms), (x, w, b, r))


def test_ops_route_fullgraph(counted):
    torch.manual_seed(2)
    x = torch.randn(6, 16, **F64)
    w = torch.randn(16, **F64)
    r = torch.randn(6, 16, **F64)
    fn = lambda x, w, r: layer_norm_fn(x, w, None, residual=r, prenorm=True, is_rms_norm=True)  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    outs = []
    for f in (fn, compiled):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, r)]
        y, res = f(*leaves)
        grads = torch.autograd.grad(y.sum() + res.square().sum(), leaves)
        outs.append((y, res) + grads)
    for a, b in zip(*outs):
        assert torch.allclose(a, b, atol=1e-12)


def test_opcheck():
    torch.manual_seed(3)
    x = torch.randn(5, 12, **F64)
    w = torch.randn(12, **F64)
    b = torch.randn(12, **F64)
    r = torch.randn(5, 12, **F64)
    args = (x, w, b, r, 1e-5, False, False, torch.float64, True)
    torch.library.opcheck(torch.ops.cuflash.layer_norm_fwd.default, args)
    y, res, mean, rstd = torch.ops.cuflash.layer_norm_fwd(*args)
    dy = torch.randn(5, 12, **F64)
    torch.library.opcheck(torch.ops.cuflash.layer_norm_bwd.default,
                          (dy, dy.clone(), x, r, w, True, mean, rstd, False, False, True, torch.float64, False))
    torch.library.opcheck(torch.ops.cuflash.layer_norm_bwd.default,
                          (dy, None, res.float(), None, w, True, mean, rstd, False, False, True, torch.float64, True))
    torch.library.opcheck(torch.ops.cuflash.layer_norm_fwd.default,
                          (x, w, None, None, 1e-5, True, False, torch.float64, False))


def test_route_by_arguments(counted):
    x = torch.randn(4, 8, **F64)
    w = torch.randn(8, **F64)
    layer_norm_fn(x, w, None)
    assert counted["fwd"] == 1
    layer_norm_fn(x, w, None, dropout_p=0.1)
    layer_norm_fn(x, w, None, rowscale=torch.ones(4, **F64))
    layer_norm_fn(x, w, None, x1=x.clone())
    layer_norm_fn(x, w, None, weight1=w.clone())
    layer_norm_fn(x, None, None)
    layer_norm_fn(x, w, None, out_dtype=torch.float32)
    assert counted["fwd"] == 1
    ops.USE_KERNELS = False
    try:
        layer_norm_fn(x, w, None)
    finally:
        ops.USE_KERNELS = True
    assert counted["fwd"] == 1


def test_kernel_takes():
    x = torch.zeros(4, 16, dtype=torch.bfloat16)
    w = torch.zeros(16, dtype=torch.bfloat16)
    assert not ln_kernels.kernel_takes(x, w, None, None, torch.bfloat16)   # CPU
    assert ln_kernels.threads_for(1) == 32 and ln_kernels.threads_for(1024) == 32
    assert ln_kernels.threads_for(1025) == 64 and ln_kernels.threads_for(4104) == 160
    assert ln_kernels.threads_for(12288) == 384 and ln_kernels.threads_for(5120) == 160
    assert ln_kernels.threads_for(8192) == 256 and ln_kernels.threads_for(16384) == 512
    with pytest.raises(ValueError):
        ln_kernels.threads_for(16385)


def test_bad_arguments_before_route():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight"):
        layer_norm_fn(x, torch.ones(7), None)
    with pytest.raises(ValueError, match="residual"):
        layer_norm_fn(x, torch.ones(8), None, residual=torch.ones(4, 7))
    with pytest.raises(ValueError, match="eps"):
        layer_norm_fn(x, torch.ones(8), None, eps=-1.0)


def test_not_a_registered_family():
    from cuflash import registry

    assert all("layer_norm" not in f.name for f in registry.families())


# ---------------------------------------------------------------------------------------
# the CUDA kernels' source, without a GPU

from helper_kernel_checks import assert_params_layout, needs_nvcc, ptxas_reports  # noqa: E402


def instantiations():
    bf, fp, f32 = torch.bfloat16, torch.float16, torch.float32
    out = []
    for combo in ((bf, bf, bf), (bf, f32, f32), (fp, fp, fp), (fp, fp, f32), (f32, f32, f32)):
        for t in (32, 256, 512):
            for v in (True, False):
                out += ln_kernels.kernel_names(*combo, t, v)
    for combo in ((bf, bf, bf), (bf, f32, f32), (f32, f32, f32)):   # the fused backward at BWD_CHUNKS
        for t in (64, 512):
            out += ln_kernels.kernel_names(*combo, t, True, ln_kernels.BWD_CHUNKS)
    return list(dict.fromkeys(out))


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_kernel_compiles_without_spills(tmp_path, arch):
    reports = ptxas_reports(tmp_path, "layer_norm", "LayerNormParams", instantiations(), arch)
    assert all(r.spill_stores == 0 and r.stack_bytes == 0 for r in reports), reports


@needs_nvcc
def test_params_layout_matches_nvcc(tmp_path):
    dt = assert_params_layout(tmp_path, "LayerNormParams", "params_layer_norm.cuh")
    assert ln_kernels._PTRS.size == dt.fields["rows"][1]   # the per-call pointers come first


def test_static_record_packs():
    """The plan's record packs without a GPU: every field given, the per-call pointers first, in
    _PTRS' order (session 27's first GPU run failed here: pack was given no pointer fields)."""
    from cuflash.launch import pack

    rec = pack("LayerNormParams", **ln_kernels.static_fields(7, 4104, True, False, 3, 3, 1e-5, True))
    dt = struct_dtype("LayerNormParams")
    assert dt.names[:len(ln_kernels._POINTER_FIELDS)] == ln_kernels._POINTER_FIELDS
    assert rec["n"] == 4104 and rec["rows_per_split"] == 3 and rec["w_offset"] == 1.0
    assert ln_kernels._PTRS.size == dt.fields["rows"][1]


def test_plan_launch_path_mocked(monkeypatch):
    """_Plan and its run() without a GPU: compile, the device calls and the driver launch mocked;
    the packed record's pointers and the three backward launches' grids as the host builds them."""
    import types

    from cupy_backends.cuda.api import driver

    from cuflash import launch as launch_mod

    monkeypatch.setattr(ln_kernels.compile_mod, "get_helper_functions",
                        lambda src, names, dev: tuple(range(1, len(names) + 1)))
    monkeypatch.setattr(launch_mod, "_device_fns", lambda: (lambda: 0, lambda d: None))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(multi_processor_count=132))
    calls = []
    monkeypatch.setattr(driver, "launchKernel", lambda *a: calls.append(a))
    dev = types.SimpleNamespace(index=0)
    plan = ln_kernels._Plan(1000, 4104, torch.bfloat16, torch.float32, torch.bfloat16, dev, True, False, 1e-5,
                            False, True)
    assert plan.threads == 160 and plan.splits * -(-1000 // plan.splits) >= 1000
    ptrs = tuple(range(16, 16 * 16, 16))
    plan.run(ptrs, ((plan.bwd_dx, 1000, 1, plan.threads, 0), (plan.bwd_dw, plan.dw_grid, plan.splits, 128, 0)), 7)
    assert [c[:8] for c in calls] == [(2, 1000, 1, 1, 160, 1, 1, 0), (3, plan.dw_grid, plan.splits, 1, 128, 1, 1, 0)]
    rec = plan.rec.record
    assert tuple(int(rec[f][0]) for f in ln_kernels._POINTER_FIELDS) == ptrs
    assert int(rec["splits"][0]) == plan.splits and int(rec["h_from_res"][0]) == 1


def test_fused_plan_mocked(monkeypatch):
    """The fused backward's plan: as many CTAs as fit at once (the occupancy query, mocked, given
    the shared memory), at most one per row, each a row of partials; the shared memory opted into
    above 48 KB."""
    import types

    from cupy_backends.cuda.api import driver

    from cuflash import launch as launch_mod

    monkeypatch.setattr(ln_kernels.compile_mod, "get_helper_functions",
                        lambda src, names, dev: tuple(range(1, len(names) + 1)))
    monkeypatch.setattr(launch_mod, "_device_fns", lambda: (lambda: 0, lambda d: None))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(multi_processor_count=132))
    occ, attrs = [], []
    monkeypatch.setattr(driver, "occupancyMaxActiveBlocksPerMultiprocessor",
                        lambda fn, threads, smem: occ.append((fn, threads, smem)) or 3)
    monkeypatch.setattr(driver, "funcSetAttribute", lambda fn, attr, value: attrs.append((fn, attr, value)))
    dev = types.SimpleNamespace(index=0)
    args = (torch.bfloat16, torch.bfloat16, torch.bfloat16, dev, True, True, 1e-5, False, False)
    plan = ln_kernels._Plan(16384, 4096, *args, True)
    assert plan.fused and plan.bwd == 5 and plan.splits == 3 * 132
    # the fused backward at BWD_CHUNKS (2) chunks a thread: 256 threads for 4096, the same shared memory
    assert ln_kernels.BWD_CHUNKS == 2 and plan.threads == 256
    assert int(plan.rec.record["splits"][0]) == 396 and occ[-1] == (5, 256, 32768) and not attrs
    assert ln_kernels._Plan(100, 4096, *args, True).splits == 100
    big = ln_kernels._Plan(16384, 16384, *args, True)
    assert big.threads == 512 and big.smem == 131072 and attrs == [(5, 8, 131072)]
    two = ln_kernels._Plan(16384, 4096, *args, False)
    assert not two.fused and two.smem == 0 and two.splits * -(-16384 // two.splits) >= 16384


def test_warm_modules_are_the_calls(monkeypatch):
    """python -m cuflash warmup --helpers layer_norm: the modules warmed are those the plans of
    calls at WARM_WIDTHS load (the same source and name expressions: CuPy's disk-cache key)."""
    import types

    from cuflash import compile as compile_mod
    from cuflash import launch as launch_mod
    from cuflash import warmup

    assert "layer_norm" in warmup.parse_helpers("all")
    mods = warmup.helper_modules(["layer_norm"], ["bf16"])
    assert all(isinstance(m, compile_mod.HelperModule) and m.source == "layer_norm" for m in mods)
    threads = sorted({ln_kernels.threads_for(n) for n in ln_kernels.WARM_WIDTHS})
    assert threads == [32, 64, 96, 128, 160, 256, 384, 512]
    shapes = {s for n in ln_kernels.WARM_WIDTHS for s in ln_kernels.module_shapes(n)}
    assert (192, 2) in shapes and (512, 4) in shapes and (512, 2) in shapes   # 3072: the backward at 2 chunks
    assert len(mods) == len(shapes) * (3 + 1) and len(set(mods)) == len(mods)   # bf16: 3 combos; fp32: 1
    asked = []
    monkeypatch.setattr(compile_mod, "get_helper_functions",
                        lambda src, names, dev: asked.append(compile_mod.HelperModule(src, tuple(names)))
                        or tuple(range(1, len(names) + 1)))
    monkeypatch.setattr(launch_mod, "_device_fns", lambda: (lambda: 0, lambda d: None))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(multi_processor_count=132))
    from cupy_backends.cuda.api import driver

    monkeypatch.setattr(driver, "occupancyMaxActiveBlocksPerMultiprocessor", lambda fn, threads, smem: 2)
    monkeypatch.setattr(driver, "funcSetAttribute", lambda fn, attr, value: None)
    dev = types.SimpleNamespace(index=0)
    bf, f32 = torch.bfloat16, torch.float32
    for n in ln_kernels.WARM_WIDTHS:
        for combo in ((bf, bf, bf), (bf, bf, f32), (bf, f32, bf), (f32, f32, f32)):
            for fused in (False, ln_kernels.FUSED_DW):   # the forward's plan, the backward's
                ln_kernels._Plan(64, n, *combo, dev, True, True, 1e-5, False, False, fused)
    assert asked and set(asked) == set(mods)


def test_host_constants_match_the_kernel():
    """The grid sizes the host computes use layer_norm.cu's CTA shapes."""
    import re
    from pathlib import Path

    src = (Path(kernel_dir()) / "layer_norm.cu").read_text()
    const = {m[0]: int(m[1]) for m in re.findall(r"constexpr int (kLn\w+) = (\d+);", src)}
    assert const["kLnDwThreads"] == ln_kernels._DW_THREADS and const["kLnFinishCols"] == ln_kernels._FINISH_COLS
    assert const["kLnFinishCols"] * const["kLnFinishGroups"] == ln_kernels._FINISH_THREADS


def test_no_grad_call_skips_autograd(monkeypatch):
    """A call with nothing to differentiate runs the kernel route without _FusedNormFn (host time);
    its outputs are the autograd route's."""
    monkeypatch.setattr(ops, "OPS_ROUTE_ON_CPU", True)
    torch.manual_seed(3)
    x, r = torch.randn(5, 40, dtype=torch.float64), torch.randn(5, 40, dtype=torch.float64)
    w = torch.randn(40, dtype=torch.float64)
    want = [t.detach() for t in layer_norm_fn(x.clone().requires_grad_(True), w, None, residual=r, prenorm=True,
                                               is_rms_norm=True)]
    applied = []
    real = ops._FusedNormFn.apply
    monkeypatch.setattr(ops._FusedNormFn, "apply", lambda *a: applied.append(1) or real(*a))
    with torch.no_grad():
        got = layer_norm_fn(x, w, None, residual=r, prenorm=True, is_rms_norm=True)
        y = layer_norm_fn(x.reshape(1, 5, 40), w, None)
    assert not applied and all(torch.equal(a, b) for a, b in zip(got, want))
    assert y.shape == (1, 5, 40) and torch.equal(y[0], layer_norm_fn(x, w, None))
    layer_norm_fn(x, w.clone().requires_grad_(True), None)
    assert applied == [1]


# ---------------------------------------------------------------------------------------
# the eager fast path (issue 12's host time): CPU tensors passed off as the kernels' and the plans
# faked (tests/layer_norm_host_profile.py's stub)

@pytest.fixture
def fake_gpu(monkeypatch):
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import layer_norm_host_profile

    monkeypatch.setattr(layer_norm_host_profile.FakePlan, "keep", True)
    made = layer_norm_host_profile.stub_gpu(monkeypatch.setattr)
    yield made
    ln_kernels._drop_plans()


def _bf(*shape, grad=False):
    return torch.randn(*shape).to(torch.bfloat16).requires_grad_(grad)


def test_fast_path_repeat_call_checks_nothing(fake_gpu, monkeypatch):
    x, r, w = _bf(2, 3, 64), _bf(2, 3, 64), _bf(64)
    y, res = layer_norm_fn(x, w, None, residual=r, prenorm=True, residual_in_fp32=True, is_rms_norm=True)
    assert len(ln_kernels.entries) == 1 and len(fake_gpu) == 1
    (entry,) = ln_kernels.entries.values()
    # a residual's dtype is residual_out's (residual_in_fp32 applies without one): h = x + r again
    assert (entry.rows, entry.n, entry.write_res, entry.h_from_res) == (6, 64, True, False)
    assert y.shape == x.shape and y.dtype == x.dtype and res.dtype == torch.bfloat16 and res.shape == x.shape
    for name in ("_check_args", "_check_tensor", "_kernel_route", "_dropout_add_norm"):
        monkeypatch.setattr(ops, name, lambda *a, **k: pytest.fail(f"{name} on a repeat call"))
    monkeypatch.setattr(ln_kernels, "kernel_takes", lambda *a: pytest.fail("kernel_takes on a repeat call"))
    x2 = _bf(2, 3, 64)
    y2, res2 = layer_norm_fn(x2, w, None, residual=r, prenorm=True, residual_in_fp32=True, is_rms_norm=True)
    (plan,) = fake_gpu
    ptrs, steps = plan.launches[-1]
    assert len(plan.launches) == 2 and len(steps) == 1 and steps[0][1] == 6
    assert ptrs[:6] == (x2.data_ptr(), r.data_ptr(), w.data_ptr(), 0, y2.data_ptr(), res2.data_ptr())
    assert ptrs[7] == ptrs[6] + 4 * 6 and ptrs[8:] == (0,) * 7
    assert plan.launches[0][0][6] == ptrs[6] == entry.scratch.data_ptr()   # no backward: the entry's scratch stats


@pytest.mark.parametrize("change", ["eps", "dtype", "shape", "bias", "residual", "rms", "fp32", "zero_centered"])
def test_fast_path_changed_argument_new_entry(fake_gpu, change):
    x, w, b = _bf(4, 64), _bf(64), _bf(64)
    kw = dict(eps=1e-5)
    layer_norm_fn(x, w, None, **kw)
    layer_norm_fn(x, w, None, **kw)
    assert len(ln_kernels.entries) == 1
    bias = None
    if change == "eps":
        kw["eps"] = 1e-6
    elif change == "dtype":
        x, w = x.half(), w.half()
    elif change == "shape":
        x = _bf(5, 64)
    elif change == "bias":
        bias = b
    elif change == "residual":
        kw["residual"] = _bf(4, 64)
    elif change == "rms":
        kw["is_rms_norm"] = True
    elif change == "fp32":
        kw["residual_in_fp32"] = True
    else:
        kw["zero_centered_weight"] = True
    layer_norm_fn(x, w, bias, **kw)
    assert len(ln_kernels.entries) == 2


def test_fast_path_entries_bounded(fake_gpu, monkeypatch):
    """Call keys that keep changing (varlen batches: a new row count each step) do not grow the entries
    past ENTRY_LIMIT: a full cache starts over, and the calls still run."""
    monkeypatch.setattr(ln_kernels, "ENTRY_LIMIT", 3)
    w = _bf(64)
    for rows in range(1, 8):
        y = layer_norm_fn(_bf(rows, 64), w, None)
        assert y.shape == (rows, 64) and len(ln_kernels.entries) <= 3
    assert len(ln_kernels.entries) == 1   # 7 keys, emptied at the 4th and the 7th


def test_fast_path_bad_input_still_raises(fake_gpu):
    x, w = _bf(4, 64), _bf(64)
    layer_norm_fn(x, w, None)
    for bad, match in ((dict(weight=_bf(63)), "weight"), (dict(eps=-1.0), "eps"), (dict(eps=[1e-5]), "eps"),
                       (dict(residual=_bf(4, 63)), "residual"), (dict(x="x"), "x"),
                       (dict(weight=None, zero_centered_weight=True), "weight")):
        kw = dict(x=x, weight=w, bias=None)
        kw.update(bad)
        with pytest.raises(ValueError, match=match):
            layer_norm_fn(**kw)
    assert sum(len(p.launches) for p in fake_gpu) == 1


def test_fast_path_autograd(fake_gpu):
    """The backward finds its entry: the fused plan's two launches with the saved tensors' pointers;
    gradients in the leaves' shapes and dtypes (values are the GPU tests')."""
    x, w, b, r = _bf(3, 64, grad=True), _bf(64, grad=True), _bf(64, grad=True), _bf(3, 64, grad=True)
    y, res = layer_norm_fn(x, w, b, residual=r, prenorm=True)
    (fwd_plan,) = fake_gpu
    fptrs, _ = fwd_plan.launches[-1]
    (entry,) = ln_kernels.entries.values()
    assert entry.scratch is None   # the backward's statistics: a tensor of the call's own
    dy, dres = _bf(3, 64), _bf(3, 64)
    gx, gw, gb, gr = torch.autograd.grad((y, res), (x, w, b, r), (dy, dres))
    assert [t.shape for t in (gx, gw, gb, gr)] == [x.shape, w.shape, b.shape, r.shape]
    assert all(t.dtype == torch.bfloat16 for t in (gx, gw, gb, gr))
    bwd_plan = fake_gpu[-1]
    assert bwd_plan is not fwd_plan and bwd_plan.fused
    ptrs, steps = bwd_plan.launches[-1]
    assert [s[0] for s in steps] == [bwd_plan.bwd, bwd_plan.finish]
    # h = x + r again (a bf16 residual_out is h rounded): x, r, w; the forward's stats; dy, dres
    assert ptrs[:6] == (x.data_ptr(), r.data_ptr(), w.data_ptr(), 0, 0, 0)
    assert ptrs[6:8] == fptrs[6:8] and ptrs[8] == dy.data_ptr() and ptrs[9] == dres.data_ptr()
    assert ptrs[10] == gx.data_ptr() and ptrs[11] == gr.data_ptr() and ptrs[13:] == (gw.data_ptr(), gb.data_ptr())


@pytest.mark.parametrize("limit", [1 << 16, 0])
def test_fast_path_partials_with_stats(fake_gpu, monkeypatch, limit):
    """A recorded call whose backward partials fit PARTIALS_WITH_STATS floats allocates them with its
    statistics (one buffer, the partials after the 2 · rows means and rstds); PARTIALS_WITH_STATS = 0
    or a bigger call: the backward allocates them apart."""
    monkeypatch.setattr(ln_kernels, "PARTIALS_WITH_STATS", limit)
    rows, n = 6, 64   # FakePlan.splits (4) <= rows
    for r, cols in ((rows, n), (rows, 8192)):
        x, w = _bf(r, cols, grad=True), _bf(cols, grad=True)
        y = layer_norm_fn(x, w, None, is_rms_norm=True)
        fptrs, _ = fake_gpu[-1].launches[-1]
        torch.autograd.grad(y, (x, w), torch.ones_like(y))
        ptrs, _ = fake_gpu[-1].launches[-1]
        assert ptrs[6:8] == fptrs[6:8] == (fptrs[6], fptrs[6] + 4 * r)
        inside = limit > 0 and 2 * r * cols <= limit
        assert (ptrs[12] == fptrs[6] + 8 * r) == inside


def test_fast_path_raw_apply(fake_gpu, monkeypatch):
    """The recorded fast path applies _EntryNormFn through the raw C apply (ops._entry_apply), not
    autograd.Function.apply's Python wrapper; with ops._entry_apply None (another torch) the public
    apply runs; both give the same launches and gradients' shapes."""
    assert ops._entry_apply is not None
    public = []
    real = ops._EntryNormFn.apply
    monkeypatch.setattr(ops._EntryNormFn, "apply", lambda *a: public.append(1) or real(*a))
    x, w, r = _bf(3, 64, grad=True), _bf(64, grad=True), _bf(3, 64)
    got = []
    for raw in (True, False):
        if not raw:
            monkeypatch.setattr(ops, "_entry_apply", None)
        for _ in range(2):   # the first call makes the entry; the second is a repeat call
            y, res = layer_norm_fn(x, w, None, residual=r, prenorm=True, is_rms_norm=True)
        assert len(public) == (0 if raw else 2)
        gx, gw = torch.autograd.grad((y, res), (x, w), (torch.ones_like(y), torch.ones_like(res)))
        got.append((y.grad_fn.__class__.__name__, gx.shape, gw.shape))
    assert got[0] == got[1] and got[0][0] == "_EntryNormFnBackward"


def test_fast_path_off(fake_gpu, monkeypatch):
    """EAGER_CACHE = False: the checked route, no entry; a kernel-directory change drops the entries."""
    x, w = _bf(4, 64), _bf(64)
    layer_norm_fn(x, w, None)
    assert len(ln_kernels.entries) == 1
    from cuflash import compile as compile_mod

    compile_mod.set_kernel_dir(compile_mod.kernel_dir())
    compile_mod.set_kernel_dir(None)
    assert not ln_kernels.entries
    monkeypatch.setattr(ops, "EAGER_CACHE", False)
    layer_norm_fn(x, w, None)
    assert not ln_kernels.entries
