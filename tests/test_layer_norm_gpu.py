"""cuflash.ops.layer_norm's fused CUDA kernels (kernels_cu/layer_norm.cu) against the float64
formula on the same data: y (and residual_out) within 2x, dx / dresidual / dweight / dbias within
3x the error of the same computation done plainly in the inputs' dtype (flash-attn's rms_norm_ref
/ layer_norm_ref without upcast). Rows of 1, 17 (one element per access), 1024, 4104, 8192, 16384
features (and thousands of rows: several per CTA of the fused backward, and the two-pass backward);
residual, prenorm, residual_in_fp32, zero_centered_weight; bf16 / fp16 / fp32 x with a
weight in x's dtype or fp32; outputs NaN-poisoned before every launch.

``tests/layer_norm_precompile.py`` fills the kernel cache in parallel first."""
import pytest

torch = pytest.importorskip("torch")

from cuflash import api  # noqa: E402
from cuflash import layer_norm as ln_kernels  # noqa: E402
from cuflash.ops import layer_norm as ops  # noqa: E402
from cuflash.ops.layer_norm import layer_norm_fn, layer_norm_ref, rms_norm_ref  # noqa: E402

pytestmark = [pytest.mark.gpu]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NS = {1: 257, 17: 129, 1024: 65, 4104: 33, 8192: 17, 16384: 9}   # n: rows
CASES = {
    "plain": dict(),
    "residual": dict(residual=True),
    "prenorm": dict(residual=True, prenorm=True),
    "prenorm_fp32": dict(prenorm=True, residual_in_fp32=True),
    "res_fp32_prenorm": dict(residual=True, prenorm=True, residual_in_fp32=True),
    "zero_centered": dict(residual=True, prenorm=True, zero_centered_weight=True),
}


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(api, "POISON_OUTPUTS", True)


def inputs(dtype, w_dtype, n, rows, bias, residual, res_dtype=None):
    x = torch.randn(rows, n, device="cuda").to(dtype) + 0.5
    w = (1 + 0.3 * torch.randn(n, device="cuda")).to(w_dtype)
    b = (0.2 * torch.randn(n, device="cuda")).to(w_dtype) if bias else None
    r = torch.randn(rows, n, device="cuda").to(res_dtype or dtype) if residual else None
    return x, w, b, r


def check(got, ref, base, factor, what, floor=1e-6):
    # plus one unit in the last place of got's dtype at the reference's largest value: each output is
    # rounded once to its dtype, and a plain result that happens to round the right way has error 0
    floor = floor + torch.finfo(got.dtype).eps * ref.abs().max().item()
    err = (got.double() - ref).abs().max().item()
    base_err = (base.double() - ref).abs().max().item()
    print(f"{what}: error {err:.3e}, plain {base_err:.3e}")
    assert not torch.isnan(got).any(), f"{what}: NaN (an unwritten element?)"
    assert err <= factor * base_err + floor, f"{what}: error {err:.3e} > {factor} x plain {base_err:.3e} + {floor}"


def run(fn, leaves, rms, prenorm, zero_centered, residual_in_fp32, g, gres):
    x, w, b, r = [t.detach().clone().requires_grad_(True) if t is not None else None for t in leaves]
    out = fn(x, w, b, r)
    y, res = out if prenorm else (out, None)
    loss = (y.double() * g).sum()
    if res is not None:
        loss = loss + (res.double() * gres).sum()
    loss.backward()
    return y, res, x.grad, w.grad, None if b is None else b.grad, None if r is None else r.grad


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("n", sorted(NS))
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
def test_against_float64(rms, dtype, n, case):
    check_case(rms, dtype, n, NS[n], case)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two_pass"])
@pytest.mark.parametrize("rows,n", [(3001, 4104), (5003, 999), (1500, 8192)])
@pytest.mark.parametrize("case", ["plain", "res_fp32_prenorm", "prenorm"])
@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
def test_many_rows_per_cta(monkeypatch, rms, rows, n, case, fused):
    """More rows than the fused backward's CTAs (each sums several rows' dweight / dbias partials
    in shared memory), and the two-pass backward (FUSED_DW = False)."""
    monkeypatch.setattr(ln_kernels, "FUSED_DW", fused)
    check_case(rms, "bf16", n, rows, case)


def check_case(rms, dtype, n, rows, case):
    torch.manual_seed(n + len(case) + rows)
    kw = CASES[case]
    dt = DTYPES[dtype]
    prenorm, res_fp32, zc = kw.get("prenorm", False), kw.get("residual_in_fp32", False), kw.get(
        "zero_centered_weight", False)
    res_dtype = torch.float32 if res_fp32 and kw.get("residual") else None
    w_dtype = torch.float32 if dtype == "bf16" and case == "residual" else dt
    leaves = inputs(dt, w_dtype, n, rows, not rms, kw.get("residual", False), res_dtype)
    assert ln_kernels.kernel_takes(leaves[0], leaves[1], leaves[2], leaves[3],
                                   leaves[3].dtype if leaves[3] is not None else torch.float32 if res_fp32 else dt)
    # the output gradients in the outputs' dtypes (what autograd hands the kernels), as float64 so
    # that the float64 reference sees the same values (with unrounded ones, a sum over rows such as
    # dweight would count the gradient's rounding, which no implementation can avoid, as error)
    res_out_dtype = leaves[3].dtype if leaves[3] is not None else torch.float32 if res_fp32 else dt
    g = torch.randn(rows, n, device="cuda").to(dt).double()
    gres = torch.randn(rows, n, device="cuda").to(res_out_dtype).double()
    eps = 1e-5

    def fused(x, w, b, r):
        return layer_norm_fn(x, w, b, residual=r, eps=eps, prenorm=prenorm, residual_in_fp32=res_fp32,
                             zero_centered_weight=zc, is_rms_norm=rms)

    ref_fn = rms_norm_ref if rms else layer_norm_ref

    def plain(x, w, b, r):    # the low-precision composition (flash-attn's reference, no upcast)
        return ref_fn(x, w, b, residual=r, eps=eps, prenorm=prenorm, zero_centered_weight=zc)

    got = run(fused, leaves, rms, prenorm, zc, res_fp32, g, gres)
    base = run(plain, leaves, rms, prenorm, zc, res_fp32, g, gres)
    # the float64 formula on float64 copies of the same values (its gradients in float64 too)
    ref = run(plain, [None if t is None else t.double() for t in leaves], rms, prenorm, zc, res_fp32, g, gres)
    assert got[0].dtype == dt
    names = ("y", "residual_out", "dx", "dweight", "dbias", "dresidual")
    for i, what in enumerate(names):
        if got[i] is None:
            assert ref[i] is None or what == "residual_out", what
            continue
        if what == "residual_out":
            want_dtype = leaves[3].dtype if leaves[3] is not None else torch.float32 if res_fp32 else dt
            assert got[i].dtype == want_dtype
            # h rounded once to its dtype: within its half ulp
            check(got[i], ref[i], ref[i].to(want_dtype), 1.0, what)
            continue
        # dweight / dbias are sums over rows: the plain error counts them in w's dtype
        check(got[i], ref[i], base[i], 2.0 if i == 0 else 3.0, f"{what}", floor=1e-5 if i == 0 else 1e-4)


def test_route_by_arguments(monkeypatch):
    """dropout / rowscale / x1 / weight1 / another out_dtype keep the composition; the fused call
    runs the kernel (a call counter on the eager fast path's cuflash.layer_norm.Entry.forward and
    on the checked route's cuflash.layer_norm.forward)."""
    calls = []
    real, real_entry = ln_kernels.forward, ln_kernels.Entry.forward
    monkeypatch.setattr(ln_kernels, "forward", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(ln_kernels.Entry, "forward", lambda *a: calls.append(1) or real_entry(*a))
    x, w, b, r = inputs(torch.bfloat16, torch.bfloat16, 256, 8, True, True)
    layer_norm_fn(x, w, b, residual=r)
    assert len(calls) == 1
    layer_norm_fn(x, w, b, residual=r, out_dtype=torch.bfloat16)   # the checked route, the same kernel
    assert len(calls) == 2
    calls.clear()
    layer_norm_fn(x, w, b, residual=r)
    assert len(calls) == 1
    layer_norm_fn(x, w, b, residual=r, dropout_p=0.1)
    layer_norm_fn(x, w, b, rowscale=torch.ones(8, device="cuda"))
    layer_norm_fn(x, w, b, x1=x.clone())
    layer_norm_fn(x, w, b, weight1=w.clone())
    layer_norm_fn(x, w, b, out_dtype=torch.float32)
    assert len(calls) == 1
    monkeypatch.setattr(ops, "USE_KERNELS", False)
    layer_norm_fn(x, w, b)
    assert len(calls) == 1


def test_nd_input_and_modules():
    """(batch, seq, n) input, flash-attn's RMSNorm module with residual / prenorm, against the composition."""
    torch.manual_seed(5)
    m = ops.RMSNorm(1024, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 37, 1024, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(2, 37, 1024, device="cuda", dtype=torch.bfloat16)
    y, res = m(x, residual=r, prenorm=True, residual_in_fp32=True)
    with torch.no_grad():   # the route without autograd.Function: the same kernel, the same outputs
        y0, res0 = m(x, residual=r, prenorm=True, residual_in_fp32=True)
    assert torch.equal(y0, y) and torch.equal(res0, res)
    ops.USE_KERNELS = False
    try:
        y2, res2 = m(x, residual=r, prenorm=True, residual_in_fp32=True)
    finally:
        ops.USE_KERNELS = True
    assert res.dtype == res2.dtype
    assert (y.float() - y2.float()).abs().max() < 0.05
    assert (res - res2).abs().max() == 0


def test_compiled():
    torch.manual_seed(6)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fn = lambda x, w: layer_norm_fn(x, w, None, is_rms_norm=True)  # noqa: E731
    y = fn(x, w)
    gx, gw = torch.autograd.grad(y.float().square().sum(), (x, w))
    c = torch.compile(fn, backend="aot_eager", fullgraph=True)   # the ops traced; no inductor compile time
    y2 = c(x, w)
    gx2, gw2 = torch.autograd.grad(y2.float().square().sum(), (x, w))
    assert torch.equal(y, y2) and torch.equal(gx, gx2) and torch.equal(gw, gw2)


@pytest.mark.parametrize("rows", [37, 6])
@pytest.mark.parametrize("case", ["plain", "prenorm", "prenorm_fp32", "res_fp32_prenorm"])
@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
def test_fast_path_is_the_checked_route(monkeypatch, rms, case, rows):
    """The eager fast path (a cached cuflash.layer_norm.Entry, no checks; the first call makes it,
    the second reuses it) gives what the checked route (EAGER_CACHE = False: _FusedNormFn /
    cuflash.layer_norm.forward / backward) gives, bit for bit, forward and gradients, with and
    without autograd; a misaligned x (a view one element in) takes one-element accesses. 6 rows:
    the backward's partials in the forward's statistics buffer (PARTIALS_WITH_STATS); 37: apart."""
    torch.manual_seed(11)
    kw = CASES[case]
    n = 2048
    assert (2 * rows * n <= ln_kernels.PARTIALS_WITH_STATS) == (rows == 6)
    dt = torch.bfloat16
    leaves = inputs(dt, dt, n, rows, not rms, kw.get("residual", False))
    opts = dict(prenorm=kw.get("prenorm", False), residual_in_fp32=kw.get("residual_in_fp32", False),
                is_rms_norm=rms, eps=1e-5)
    g = torch.randn(rows, n, device="cuda", dtype=torch.float64)

    def go(x, w, b, r):
        out = layer_norm_fn(x, w, b, residual=r, **opts)
        outs = list(out) if opts["prenorm"] else [out]
        with torch.no_grad():
            again = layer_norm_fn(x, w, b, residual=r, **opts)
        loss = sum((o.double() * g).sum() for o in outs)
        grads = torch.autograd.grad(loss, [t for t in (x, w, b, r) if t is not None])
        return [o.detach() for o in outs] + list(again if opts["prenorm"] else [again]) + list(grads)

    def leaves_grad():
        return [t.detach().clone().requires_grad_(True) if t is not None else None for t in leaves]

    ln_kernels.entries.clear()
    first, second = go(*leaves_grad()), go(*leaves_grad())
    assert len(ln_kernels.entries) == 1
    monkeypatch.setattr(ops, "EAGER_CACHE", False)
    checked = go(*leaves_grad())
    for a, b, c in zip(first, second, checked):
        assert torch.equal(a, c) and torch.equal(b, c)
    monkeypatch.setattr(ops, "EAGER_CACHE", True)
    big = torch.empty(rows * n + 1, device="cuda", dtype=dt)
    xm = big[1:].view(rows, n)   # 2 bytes past a 16-byte boundary
    xm.copy_(leaves[0])
    got = layer_norm_fn(xm, *leaves[1:3], residual=leaves[3], **opts)
    want = layer_norm_fn(leaves[0], *leaves[1:3], residual=leaves[3], **opts)
    for a, b in zip(got if opts["prenorm"] else [got], want if opts["prenorm"] else [want]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
def test_fast_path_raw_apply_is_the_public_apply(monkeypatch, rms):
    """The fast path's node applied through the raw C apply (ops._entry_apply, the default) gives the
    bits of autograd.Function.apply's (ops._entry_apply None): outputs and gradients, prenorm with a
    residual, and through torch.autograd.grad and .backward()."""
    torch.manual_seed(13)
    n, rows, dt = 2048, 6, torch.bfloat16
    leaves = inputs(dt, dt, n, rows, not rms, True)
    dy, dres = torch.randn(rows, n, device="cuda").to(dt), torch.randn(rows, n, device="cuda").to(dt)

    def go():
        x, w, b, r = [t.detach().clone().requires_grad_(True) if t is not None else None for t in leaves]
        y, res = layer_norm_fn(x, w, b, residual=r, prenorm=True, is_rms_norm=rms)
        ts = [t for t in (x, w, b, r) if t is not None]
        grads = torch.autograd.grad((y, res), ts, (dy, dres), retain_graph=True)
        y.backward(dy)
        return [y.detach(), res.detach(), *grads, *(t.grad for t in ts)]

    ln_kernels.entries.clear()
    go()
    raw = go()
    monkeypatch.setattr(ops, "_entry_apply", None)
    public = go()
    assert len(raw) == len(public)
    for a, b in zip(raw, public):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_cuda_graph_replay():
    """The eager fast path inside a CUDA graph (entries made by the warm-up on a side stream, as torch
    asks): replays with new input values give the eager outputs, forward without autograd and
    forward + backward."""
    torch.manual_seed(12)
    n, rows, dt = 1024, 16, torch.bfloat16
    x, w, _, r = inputs(dt, dt, n, rows, False, True)
    xg = x.clone().requires_grad_(True)
    dy = torch.randn(rows, n, device="cuda", dtype=dt)

    def step():
        with torch.no_grad():
            y, res = layer_norm_fn(x, w, None, residual=r, prenorm=True, is_rms_norm=True)
        y2 = layer_norm_fn(xg, w, None, is_rms_norm=True)
        (dx,) = torch.autograd.grad(y2, (xg,), dy)
        return y, res, y2.detach(), dx

    ln_kernels.entries.clear()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    assert len(ln_kernels.entries) == 2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(2):
        with torch.no_grad():
            x.copy_(torch.randn_like(x))
            r.copy_(torch.randn_like(r))
            xg.copy_(torch.randn_like(x))
            dy.copy_(torch.randn_like(dy))
        graph.replay()
        want = step()
        torch.cuda.synchronize()
        for a, b in zip(outs, want):
            assert torch.equal(a, b)
