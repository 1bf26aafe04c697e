"""cuflash.ops.cross_entropy's kernel route without a GPU: the kernel source compiled by nvcc
(sm_80, sm_90a: no spills) with its params struct laid out as cuflash.launch packs it; the route's
plumbing (the torch ops cuflash::cross_entropy_fwd / _bwd / _bwd_, whose CPU impls run the float64
reference of cuflash.cross_entropy) against the torch composition, eager and under
torch.compile(fullgraph); torch.library.opcheck of the ops; the argument checks."""

import pytest

torch = pytest.importorskip("torch")

from cuflash import cross_entropy as ce_kernels  # noqa: E402
from cuflash.ops import cross_entropy as ops  # noqa: E402
from cuflash.ops.cross_entropy import cross_entropy_loss  # noqa: E402

F64 = dict(dtype=torch.float64)
CASES = {
    "plain": {},
    "smooth_scale_zloss": dict(label_smoothing=0.1, logit_scale=0.7, lse_square_scale=1e-2),
    "ignore_7": dict(ignore_index=7, label_smoothing=0.2),
}


@pytest.fixture
def ops_route(monkeypatch):
    monkeypatch.setattr(ops, "OPS_ROUTE_ON_CPU", True)


def sample(rows=6, vocab=11):
    logits = torch.randn(rows, vocab, **F64)
    labels = torch.randint(0, vocab, (rows,))
    labels[2] = -100
    labels[3] = vocab + 4     # out of range: no label term
    labels[4] = 7 % vocab
    return logits, labels


def run(logits, labels, g, inplace=False, **kw):
    x = logits.clone().requires_grad_(True)
    y = x * 1.0 if inplace else x
    loss, z = cross_entropy_loss(y, labels, inplace_backward=inplace, **kw)
    (gx,) = torch.autograd.grad(loss, x, g)
    return loss, z, gx


@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_ops_route_matches_composition(monkeypatch, case, inplace):
    torch.manual_seed(0)
    logits, labels = sample()
    g = torch.rand(logits.shape[0], **F64)
    want = run(logits, labels, g, inplace, **CASES[case])
    monkeypatch.setattr(ops, "OPS_ROUTE_ON_CPU", True)
    got = run(logits, labels, g, inplace, **CASES[case])
    for a, b, what in zip(got, want, ("loss", "z_loss", "dlogits")):
        assert torch.allclose(a, b, atol=1e-12, rtol=1e-12), what


def test_ops_route_precomputed_lse(ops_route):
    """With precomputed_lse (logit_scale 1, no smoothing) the forward is the composition's, the
    backward the kernel route's p = exp(z - lse) with the given LSE."""
    torch.manual_seed(1)
    logits, labels = sample()
    lse = torch.logsumexp(logits, -1)
    g = torch.rand(logits.shape[0], **F64)
    got = run(logits, labels, g, precomputed_lse=lse)
    ops.OPS_ROUTE_ON_CPU = False
    want = run(logits, labels, g, precomputed_lse=lse)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-12)


def test_ops_route_gradcheck(ops_route):
    torch.manual_seed(2)
    logits, labels = sample(5, 7)
    assert torch.autograd.gradcheck(
        lambda lg: cross_entropy_loss(lg, labels, label_smoothing=0.1, logit_scale=1.3, lse_square_scale=1e-2)[0],
        (logits.clone().requires_grad_(True),))


def test_ops_route_fullgraph(ops_route):
    """torch.compile (aot_eager, fullgraph) traces the kernel route through the ops, forward and
    backward (in place too) equal to eager."""
    torch.manual_seed(3)
    logits, labels = sample()
    g = torch.rand(logits.shape[0], **F64)
    for inplace in (False, True):
        fn = lambda lg: cross_entropy_loss(lg * 1.0 if inplace else lg, labels, label_smoothing=0.1,  # noqa: E731
                                           lse_square_scale=1e-2, inplace_backward=inplace)[0]
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
        outs = []
        for f in (fn, compiled):
            x = logits.clone().requires_grad_(True)
            loss = f(x)
            (gx,) = torch.autograd.grad(loss, x, g)
            outs.append((loss, gx))
        assert torch.allclose(outs[0][0], outs[1][0], atol=1e-12) and torch.allclose(outs[0][1], outs[1][1],
                                                                                     atol=1e-12), inplace


def test_opcheck():
    torch.manual_seed(4)
    logits, labels = sample()
    args = (0.1, 1.3, 1e-2, -100, 0, logits.shape[1])
    torch.library.opcheck(torch.ops.cuflash.cross_entropy_fwd.default, (logits, labels) + args)
    lse = torch.logsumexp(logits * 1.3, -1)
    g = torch.rand(logits.shape[0], **F64)
    torch.library.opcheck(torch.ops.cuflash.cross_entropy_bwd.default, (g, logits, lse, labels) + args)
    torch.library.opcheck(torch.ops.cuflash.cross_entropy_bwd_.default, (g, logits.clone(), lse, labels) + args)


def test_kernel_takes():
    lb = torch.zeros(4, dtype=torch.int64)
    assert not ce_kernels.kernel_takes(torch.zeros(4, 9), lb)   # CPU
    if torch.cuda.is_available():  # pragma: no cover - a GPU machine
        return
    # (on CUDA: bf16 / fp16 / fp32 with contiguous columns and int32 / int64 labels; see the GPU tests)


# ---------------------------------------------------------------------------------------
# argument checks (before any launch)

def test_bad_arguments():
    logits, labels = sample()
    with pytest.raises(ValueError, match="ignore_index"):
        cross_entropy_loss(logits, labels, ignore_index=True)
    with pytest.raises(ValueError, match="ignore_index"):
        cross_entropy_loss(logits, labels, ignore_index=2 ** 63)
    with pytest.raises(ValueError, match="precomputed_lse"):
        cross_entropy_loss(logits, labels, precomputed_lse=torch.zeros(6, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="precomputed_lse"):
        cross_entropy_loss(logits, labels, precomputed_lse=torch.zeros(6, dtype=torch.int64))
    with pytest.raises(ValueError, match="precomputed_lse"):
        cross_entropy_loss(logits, labels, precomputed_lse=torch.zeros(6, device="meta"))
    # numpy / other integral ignore_index values are accepted as ints
    import numpy as np
    loss, _ = cross_entropy_loss(logits, labels, ignore_index=np.int64(-100))
    assert loss[2] == 0


# ---------------------------------------------------------------------------------------
# the CUDA kernels' source, without a GPU

from helper_kernel_checks import assert_params_layout, needs_nvcc, ptxas_reports  # noqa: E402


def instantiations():
    """Every dtype's default module, and bf16 at the timing script's other CTA sizes / unrolls."""
    out = [n for dt in ce_kernels._KERNEL_TYPES for n in ce_kernels.kernel_names(dt)]
    out += [n for v in ((128, 4), (256, 4), (512, 2), (1024, 2)) for n in ce_kernels.kernel_names(torch.bfloat16, v, v)]
    return list(dict.fromkeys(out))


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_kernel_compiles_without_spills(tmp_path, arch):
    reports = ptxas_reports(tmp_path, "cross_entropy", "CrossEntropyParams", instantiations(), arch)
    assert all(r.spill_stores == 0 and r.stack_bytes == 0 and r.registers <= 64 for r in reports), reports


@needs_nvcc
def test_params_layout_matches_nvcc(tmp_path):
    dt = assert_params_layout(tmp_path, "CrossEntropyParams", "params_cross_entropy.cuh")
    # the per-call writes of cuflash.cross_entropy: nine pointers, then three strides
    assert dt.names[:9] == ("logits", "labels", "loss", "z_loss", "lse", "part", "partials", "grad_loss", "dlogits")
    assert dt.names[9:12] == ("grad_loss_stride", "logits_row_stride", "dlogits_row_stride")
    assert ce_kernels._PTRS.size == dt.fields["ignore_index"][1]


def test_not_a_registered_family():
    from cuflash import registry

    assert all("cross_entropy" not in f.name for f in registry.families())


def test_splits():
    # many rows: one CTA per row; few rows: split, each split >= MIN_SPLIT_COLS columns, 16-aligned
    assert ce_kernels._splits(8192, 32000, 132) == (1, 32000)
    splits, cols = ce_kernels._splits(5, 256000, 132)
    assert splits > 1 and cols % 16 == 0 and (splits - 1) * cols < 256000 <= splits * cols
    assert cols >= ce_kernels.MIN_SPLIT_COLS
    assert ce_kernels._splits(3, 17, 132) == (1, 32)


def test_no_grad_call_skips_autograd(ops_route, monkeypatch):
    """Logits that need no gradient run the kernel route without CrossEntropyLossFunction (host µs
    per call), with the autograd route's losses; a precomputed LSE still takes the Function (its
    forward is the composition's)."""
    torch.manual_seed(4)
    logits, labels = sample()
    kw = dict(label_smoothing=0.1, logit_scale=1.3, lse_square_scale=1e-2)
    want = [t.detach() for t in cross_entropy_loss(logits.clone().requires_grad_(True), labels, **kw)]
    real = ops.CrossEntropyLossFunction.apply
    applied = []
    monkeypatch.setattr(ops.CrossEntropyLossFunction, "apply", lambda *a: applied.append(1) or real(*a))
    got = cross_entropy_loss(logits, labels, **kw)
    with torch.no_grad():
        got2 = cross_entropy_loss(logits.clone().requires_grad_(True), labels, **kw)
    assert not applied
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(got, got2, want))
    cross_entropy_loss(logits, labels, precomputed_lse=torch.logsumexp(logits, -1))
    assert applied == [1]
