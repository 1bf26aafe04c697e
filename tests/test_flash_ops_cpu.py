"""flash-attn's non-attention building blocks in cuflash without a GPU (torch CPU tensors):
cuflash.ops.layer_norm (layer_norm_fn / rms_norm_fn and the older dropout_add_* API),
cuflash.ops.cross_entropy and cuflash.losses.cross_entropy, cuflash.ops.activations,
cuflash.modules.mlp and cuflash.modules.block. Each against a float64 formula written here (not
the implementation), forward and gradients (gradcheck in float64), dropout masks reproducible and
consistent with the forward, the dtype rules, the vocab split over 2 gloo processes, and the
arguments refused."""
import inspect
import socket

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cuflash  # noqa: E402
from cuflash.ops import layer_norm as ln  # noqa: E402
from cuflash.ops import rms_norm as rn  # noqa: E402
from cuflash.ops.activations import gelu_bwd, gelu_fwd, sqrelu_bwd, sqrelu_fwd, swiglu  # noqa: E402
from cuflash.ops.cross_entropy import cross_entropy_loss  # noqa: E402
from cuflash.losses.cross_entropy import CrossEntropyLoss  # noqa: E402
from cuflash.modules.block import Block, ParallelBlock, StochasticDepth  # noqa: E402
from cuflash.modules.mha import MHA  # noqa: E402
from cuflash.modules.mlp import FusedMLP, GatedMlp, Mlp  # noqa: E402

from flash_ops_reference import (TinyGPT, attention_formula, block_formula, ce_formula,  # noqa: E402
                                 norm_formula, tiny_gpt_formula)

F64 = dict(dtype=torch.float64)
TOL = dict(atol=1e-10, rtol=1e-9)


def randn(*shape, grad=False, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


# ---------------------------------------------------------------------------------------------
# layer_norm_fn / rms_norm_fn
# ---------------------------------------------------------------------------------------------

NORM_CASES = {
    "plain": dict(),
    "residual_prenorm": dict(residual=True, prenorm=True),
    "rowscale_residual": dict(residual=True, rowscale=True),
    "parallel_x1_w1": dict(residual=True, x1=True, weight1=True, prenorm=True),
    "w1_only_nobias": dict(weight1=True, bias=False),
    "zero_centered": dict(residual=True, zero_centered=True, prenorm=True),
}


def norm_inputs(case, shape=(3, 7, 37), grad=False):
    n = shape[-1]
    t = dict(x=randn(*shape, grad=grad), weight=randn(n, grad=grad),
             bias=randn(n, grad=grad) if case.get("bias", True) else None)
    if case.get("residual"):
        t["residual"] = randn(*shape, grad=grad)
    if case.get("x1"):
        t["x1"] = randn(*shape, grad=grad)
    if case.get("weight1"):
        t["weight1"] = randn(n, grad=grad)
        t["bias1"] = randn(n, grad=grad) if case.get("bias", True) else None
    if case.get("rowscale"):
        t["rowscale"] = torch.rand(shape[:-1], **F64) + 0.5
    return t


@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
@pytest.mark.parametrize("case", sorted(NORM_CASES))
def test_norm_forward_matches_formula(case, rms):
    torch.manual_seed(0)
    c = NORM_CASES[case]
    t = norm_inputs(c)
    fn = ln.rms_norm_fn if rms else ln.layer_norm_fn
    out = fn(eps=1e-5, prenorm=c.get("prenorm", False), zero_centered_weight=c.get("zero_centered", False), **t)
    y, y1, h = norm_formula(t["x"], t["weight"], t["bias"], t.get("residual"), t.get("x1"), t.get("weight1"),
                            t.get("bias1"), 1e-5, t.get("rowscale"), rms=rms,
                            zero_centered=c.get("zero_centered", False))
    want = (y,) + ((y1,) if y1 is not None else ()) + ((h,) if c.get("prenorm") else ())
    out = out if isinstance(out, tuple) else (out,)
    assert len(out) == len(want)
    for o, w in zip(out, want):
        assert o.dtype == torch.float64
        assert torch.allclose(o, w, **TOL)


@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
@pytest.mark.parametrize("case", ["residual_prenorm", "rowscale_residual", "parallel_x1_w1", "zero_centered"])
def test_norm_gradcheck(case, rms):
    torch.manual_seed(1)
    c = NORM_CASES[case]
    t = norm_inputs(c, shape=(2, 3, 6), grad=True)
    names = [k for k, v in t.items() if isinstance(v, torch.Tensor) and v.requires_grad]

    def f(*args):
        kw = dict(t, **dict(zip(names, args)))
        return ln.layer_norm_fn(eps=1e-5, prenorm=c.get("prenorm", False), is_rms_norm=rms,
                                zero_centered_weight=c.get("zero_centered", False), **kw)

    assert torch.autograd.gradcheck(f, [t[k] for k in names])


def test_norm_gradients_match_formula():
    """Every gradient (x, weight, bias, residual, x1, weight1, bias1) against the formula's autograd,
    through both outputs and the prenorm residual."""
    torch.manual_seed(2)
    t = norm_inputs(dict(residual=True, x1=True, weight1=True), shape=(4, 5, 19), grad=True)
    y, y1, res = ln.layer_norm_fn(eps=1e-5, prenorm=True, **t)
    fy, fy1, fres = norm_formula(t["x"], t["weight"], t["bias"], t["residual"], t["x1"], t["weight1"], t["bias1"], 1e-5)
    g = [torch.randn_like(y) for _ in range(3)]
    params = [t[k] for k in ("x", "weight", "bias", "residual", "x1", "weight1", "bias1")]
    got = torch.autograd.grad((y, y1, res), params, g)
    want = torch.autograd.grad((fy, fy1, fres), params, g)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, **TOL)


@pytest.mark.parametrize("x1", [False, True])
def test_dropout_masks_reproducible_and_consistent(x1):
    shape = (4, 9, 33)
    p = 0.3
    t = norm_inputs(dict(residual=True, x1=x1, weight1=x1), shape=shape, grad=True)

    def run():
        torch.manual_seed(123)
        return ln.layer_norm_fn(dropout_p=p, prenorm=True, return_dropout_mask=True, **t)

    a, b = run(), run()
    m, m1 = a[-2], a[-1]
    assert m.dtype == torch.bool and m.shape == shape
    assert (m1 is not None) == x1
    for u, v in zip(a, b):
        assert (u is None and v is None) or torch.equal(u, v)
    y, y1, h = norm_formula(t["x"], t["weight"], t["bias"], t["residual"], t.get("x1"), t.get("weight1"),
                            t.get("bias1"), keep=m, keep1=m1, p=p)
    assert torch.allclose(a[0], y, **TOL)
    assert torch.allclose(a[-3], h, **TOL)
    if x1:
        assert not torch.equal(m, m1)           # two independent draws
        assert torch.allclose(a[1], y1, **TOL)
    # the gradient uses the forward's masks: gradcheck with the seed fixed inside
    small = norm_inputs(dict(residual=True, x1=x1), shape=(2, 3, 5), grad=True)
    names = [k for k in ("x", "weight", "bias", "residual", "x1") if k in small]

    def f(*args):
        torch.manual_seed(7)
        return ln.layer_norm_fn(dropout_p=p, prenorm=True, **dict(small, **dict(zip(names, args))))

    assert torch.autograd.gradcheck(f, [small[k] for k in names])


def test_dropout_keep_rate_and_scale():
    torch.manual_seed(0)
    x = torch.randn(64, 1024, **F64)
    _, res, m, _ = ln.layer_norm_fn(x, torch.ones(1024, **F64), None, dropout_p=0.25, prenorm=True,
                                    return_dropout_mask=True)
    assert abs(m.double().mean().item() - 0.75) < 0.01
    assert torch.allclose(res, torch.where(m, x / 0.75, 0.0), **TOL)


def test_dtype_rules_low_precision():
    """x bf16, weight fp32: y in bf16 (out_dtype changes it), residual_out fp32 with
    residual_in_fp32 or an fp32 residual, x itself when nothing is added; gradients in each
    input's dtype."""
    torch.manual_seed(3)
    x = torch.randn(5, 40, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(40, requires_grad=True)
    b = torch.randn(40, requires_grad=True)
    y, res = ln.layer_norm_fn(x, w, b, prenorm=True)
    assert y.dtype == torch.bfloat16 and res is x
    y, res = ln.layer_norm_fn(x, w, b, prenorm=True, residual_in_fp32=True)
    assert res.dtype == torch.float32 and torch.equal(res, x.float())
    r = torch.randn(5, 40, requires_grad=True)
    y, res = ln.layer_norm_fn(x, w, b, residual=r, prenorm=True, out_dtype=torch.float16)
    assert y.dtype == torch.float16 and res.dtype == torch.float32
    want, _, h = norm_formula(x, w, b, residual=r)
    assert torch.allclose(res.double(), h, atol=1e-6)
    assert (y.double() - want).abs().max() < 1e-2          # fp16 rounding of an O(1) output
    (y.float().sum() + res.sum()).backward()
    assert x.grad.dtype == torch.bfloat16 and r.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


def test_out_and_residual_out_written():
    t = norm_inputs(dict(residual=True))
    out = torch.full_like(t["x"], float("nan"))
    res_out = torch.full_like(t["x"], float("nan"))
    y, res = ln.layer_norm_fn(prenorm=True, out=out, residual_out=res_out, **t)
    assert y is out and res is res_out
    fy, _, fh = norm_formula(t["x"], t["weight"], t["bias"], t["residual"])
    assert torch.allclose(out, fy, **TOL) and torch.allclose(res_out, fh, **TOL)


def test_refs_match_formula():
    t = norm_inputs(dict(residual=True, x1=True, weight1=True))
    for rms, ref in ((False, ln.layer_norm_ref), (True, ln.rms_norm_ref)):
        got = ref(eps=1e-5, prenorm=True, **t)
        want = norm_formula(t["x"], t["weight"], t["bias"], t["residual"], t["x1"], t["weight1"], t["bias1"], 1e-5,
                            rms=rms)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, **TOL)


def test_rmsnorm_and_layernorm_modules():
    torch.manual_seed(4)
    m = ln.RMSNorm(24, eps=1e-5, **F64)
    assert list(m.state_dict()) == ["weight"] and m.bias is None and torch.equal(m.weight, torch.ones(24, **F64))
    z = ln.RMSNorm(24, zero_centered_weight=True, **F64)
    assert torch.equal(z.weight, torch.zeros(24, **F64))
    x, r = randn(3, 24), randn(3, 24)
    for mod in (m, z):
        y, res = mod(x, residual=r, prenorm=True)
        assert torch.allclose(y, norm_formula(x, torch.ones(24, **F64), None, r, eps=1e-5, rms=True)[0], **TOL)
    lnm = ln.LayerNorm(24, **F64)
    assert isinstance(lnm, nn.LayerNorm) and list(lnm.state_dict()) == ["weight", "bias"]
    assert torch.allclose(lnm(x), F.layer_norm(x, (24,), eps=1e-5), **TOL)
    assert torch.allclose(ln.RMSNorm(24, eps=1e-5, **F64)(x), ln.rms_norm_fn(x, torch.ones(24, **F64), None, eps=1e-5))


def test_layer_norm_linear_fn():
    t = norm_inputs(dict(residual=True))
    lw, lb = randn(11, 37), randn(11)
    out, res = ln.layer_norm_linear_fn(t["x"], t["weight"], t["bias"], lw, lb, residual=t["residual"], eps=1e-5,
                                       prenorm=True)
    y, _, h = norm_formula(t["x"], t["weight"], t["bias"], t["residual"], eps=1e-5)
    assert torch.allclose(out, y @ lw.T + lb, **TOL) and torch.allclose(res, h, **TOL)


# ---------------------------------------------------------------------------------------------
# The older API (flash_attn.ops.layer_norm / rms_norm)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
def test_old_dropout_add_norm(rms):
    torch.manual_seed(5)
    fn = rn.dropout_add_rms_norm if rms else ln.dropout_add_layer_norm
    x0, r = randn(3, 5, 16, grad=True), randn(3, 5, 16, grad=True)
    w, b, cs = randn(16, grad=True), randn(16, grad=True), randn(16, grad=True)
    rs = torch.rand(3, 5, **F64) + 0.5
    z, x, m = fn(x0, r, w, b, 0.2, 1e-5, rowscale=rs, layerscale=cs, prenorm=True, return_dropout_mask=True)
    assert m.dtype == torch.uint8 and m.shape == x0.shape
    fz, _, fx = norm_formula(x0, w, b, r, eps=1e-5, rowscale=rs, colscale=cs, keep=m.bool(), p=0.2, rms=rms)
    assert torch.allclose(z, fz, **TOL) and torch.allclose(x, fx, **TOL)
    # layerscale gets its gradient
    g = torch.autograd.grad(z.sum(), [cs])[0]
    assert torch.allclose(g, torch.autograd.grad(fz.sum(), [cs])[0], **TOL)
    # no dropout: the mask is all ones
    _, m0 = fn(x0, r, w, b, 0.0, 1e-5, return_dropout_mask=True)
    assert m0.dtype == torch.uint8 and bool((m0 == 1).all())


def test_old_parallel_residual_and_modules():
    torch.manual_seed(6)
    x0, x1, r = randn(2, 4, 12), randn(2, 4, 12), randn(2, 4, 12)
    w0, b0, w1, b1 = randn(12), randn(12), randn(12), randn(12)
    z0, z1, x = ln.dropout_add_layer_norm_parallel_residual(x0, x1, r, w0, b0, w1, b1, 0.0, 1e-5, prenorm=True)
    f0, f1, fx = norm_formula(x0, w0, b0, r, x1, w1, b1, 1e-5)
    assert torch.allclose(z0, f0, **TOL) and torch.allclose(z1, f1, **TOL) and torch.allclose(x, fx, **TOL)
    z0, z1 = rn.dropout_add_rms_norm_parallel_residual(x0, None, r, w0, None, None, None, 0.0, 1e-5)
    assert z1 is None and torch.allclose(z0, norm_formula(x0, w0, None, r, eps=1e-5, rms=True)[0], **TOL)
    assert torch.allclose(rn.rms_norm(x0, w0, 1e-5), norm_formula(x0, w0, None, eps=1e-5, rms=True)[0], **TOL)
    assert torch.allclose(ln.layer_norm(x0, w0, b0, 1e-5), F.layer_norm(x0, (12,), w0, b0, 1e-5), **TOL)
    m = ln.DropoutAddLayerNorm(12, prenorm=True, p=0.1, **F64)
    assert list(m.state_dict()) == ["weight", "bias"] and m.epsilon == 1e-5
    m.eval()
    z, x = m(x0, r)
    assert torch.allclose(z, F.layer_norm(x0 + r, (12,), eps=1e-5), **TOL)
    mr = rn.DropoutAddRMSNorm(12, **F64)
    assert list(mr.state_dict()) == ["weight"]
    assert torch.allclose(mr(x0, r), norm_formula(x0, None, None, r, eps=1e-5, rms=True)[0], **TOL)


def test_norm_bad_arguments():
    x, w = randn(3, 8), randn(8)
    with pytest.raises(ValueError, match="weight"):
        ln.layer_norm_fn(x, randn(7), None)
    with pytest.raises(ValueError, match="residual"):
        ln.layer_norm_fn(x, w, None, residual=randn(3, 9))
    with pytest.raises(ValueError, match="rowscale"):
        ln.layer_norm_fn(x, w, None, x1=randn(3, 8), rowscale=torch.ones(3, **F64))
    with pytest.raises(ValueError, match="dropout_p"):
        ln.layer_norm_fn(x, w, None, dropout_p=1.0)
    with pytest.raises(ValueError, match="bias1"):
        ln.layer_norm_fn(x, w, None, bias1=randn(8))
    with pytest.raises(ValueError, match="out"):
        ln.layer_norm_fn(x, w, None, out=torch.empty(3, 8, dtype=torch.float32))
    with pytest.raises(ValueError, match="x must"):
        ln.layer_norm_fn(x.numpy(), w, None)


def test_signatures_match_flash_attn():
    """Positional parameters, order and defaults as flash-attn 2.8's."""
    sig = lambda f: list(inspect.signature(f).parameters)  # noqa: E731
    assert sig(ln.layer_norm_fn) == ["x", "weight", "bias", "residual", "x1", "weight1", "bias1", "eps", "dropout_p",
                                     "rowscale", "prenorm", "residual_in_fp32", "zero_centered_weight", "is_rms_norm",
                                     "return_dropout_mask", "out_dtype", "out", "residual_out"]
    assert sig(ln.rms_norm_fn) == [p for p in sig(ln.layer_norm_fn) if p != "is_rms_norm"]
    assert sig(ln.dropout_add_layer_norm) == ["x0", "residual", "weight", "bias", "dropout_p", "epsilon", "rowscale",
                                              "layerscale", "prenorm", "residual_in_fp32", "return_dropout_mask"]
    assert sig(cross_entropy_loss) == ["logits", "labels", "precomputed_lse", "label_smoothing", "logit_scale",
                                       "lse_square_scale", "ignore_index", "inplace_backward", "process_group"]
    assert sig(CrossEntropyLoss.__init__)[1:] == ["ignore_index", "reduction", "label_smoothing", "logit_scale",
                                                  "lse_square_scale", "inplace_backward", "process_group",
                                                  "return_z_loss"]
    assert sig(Block.__init__)[1:] == ["dim", "mixer_cls", "mlp_cls", "norm_cls", "dropout_cls", "prenorm",
                                       "resid_dropout1", "resid_dropout2", "drop_path1", "drop_path2",
                                       "fused_dropout_add_ln", "return_residual", "residual_in_fp32",
                                       "sequence_parallel", "mark_shared_params"]
    assert inspect.signature(ln.layer_norm_fn).parameters["eps"].default == 1e-6
    assert inspect.signature(ln.RMSNorm.__init__).parameters["eps"].default == 1e-5
    from cuflash.ops.triton import cross_entropy as tce, layer_norm as tln
    assert tln.layer_norm_fn is ln.layer_norm_fn and tce.cross_entropy_loss is cross_entropy_loss


def test_compiles_fullgraph():
    """torch.compile traces layer_norm_fn and cross_entropy_loss in one graph each (aot_eager: no
    C++ build here)."""
    torch._dynamo.reset()
    t = norm_inputs(dict(residual=True, x1=True, weight1=True), shape=(2, 3, 16))
    f = torch.compile(lambda **kw: ln.layer_norm_fn(eps=1e-5, prenorm=True, residual_in_fp32=True, **kw),
                      backend="aot_eager", fullgraph=True)
    for a, b in zip(f(**t), ln.layer_norm_fn(eps=1e-5, prenorm=True, residual_in_fp32=True, **t)):
        assert torch.allclose(a, b, **TOL)
    logits, labels = randn(6, 9, grad=True), ce_labels(6, 9)
    ce = torch.compile(lambda lg: cross_entropy_loss(lg, labels, label_smoothing=0.1, lse_square_scale=1e-2)[0],
                       backend="aot_eager", fullgraph=True)
    got = ce(logits)
    want = ce_formula(logits, labels, 0.1, zsq=1e-2)[0]
    assert torch.allclose(got, want, **TOL)
    assert torch.allclose(torch.autograd.grad(got.sum(), logits)[0], torch.autograd.grad(want.sum(), logits)[0], **TOL)


# ---------------------------------------------------------------------------------------------
# Cross entropy
# ---------------------------------------------------------------------------------------------

CE_CASES = {
    "plain": dict(),
    "smoothing": dict(label_smoothing=0.1),
    "zloss_scale": dict(lse_square_scale=1e-2, logit_scale=0.7),
    "all": dict(label_smoothing=0.2, lse_square_scale=3e-2, logit_scale=1.3),
}


def ce_labels(n, c, ignore=True):
    t = torch.randint(0, c, (n,))
    if ignore:
        t[1] = -100
        t[-2] = -100
    return t


@pytest.mark.parametrize("case", sorted(CE_CASES))
def test_cross_entropy_matches_formula(case):
    torch.manual_seed(10)
    kw = CE_CASES[case]
    logits, labels = randn(13, 37, grad=True), ce_labels(13, 37)
    loss, z = cross_entropy_loss(logits, labels, **kw)
    fl, fz = ce_formula(logits, labels, kw.get("label_smoothing", 0.0), kw.get("logit_scale", 1.0),
                        kw.get("lse_square_scale", 0.0))
    assert loss.dtype == torch.float64 and torch.allclose(loss, fl, **TOL) and torch.allclose(z, fz, **TOL)
    assert not z.requires_grad
    g = torch.randn(13, **F64)
    assert torch.allclose(torch.autograd.grad(loss, logits, g)[0], torch.autograd.grad(fl, logits, g)[0], **TOL)
    small = ce_labels(5, 7)
    assert torch.autograd.gradcheck(lambda lg: cross_entropy_loss(lg, small, **kw)[0], (randn(5, 7, grad=True),))


@pytest.mark.parametrize("case", sorted(CE_CASES))
def test_cross_entropy_row_chunks(case, monkeypatch):
    """Rows processed 3 at a time (13 rows: a short last chunk), forward and backward, in place too."""
    from cuflash.ops import cross_entropy as ce
    monkeypatch.setattr(ce, "CHUNK_BYTES", 4 * 37 * 3)
    assert len(ce._row_chunks(13, 37)) == 5
    torch.manual_seed(14)
    kw = CE_CASES[case]
    base, labels = torch.randn(13, 37, **F64), ce_labels(13, 37)
    logits = base.clone().requires_grad_(True)
    loss, z = cross_entropy_loss(logits, labels, **kw)
    fl, fz = ce_formula(logits, labels, kw.get("label_smoothing", 0.0), kw.get("logit_scale", 1.0),
                        kw.get("lse_square_scale", 0.0))
    assert torch.allclose(loss, fl, **TOL) and torch.allclose(z, fz, **TOL)
    g = torch.randn(13, **F64)
    want = torch.autograd.grad(fl, logits, g)[0]
    assert torch.allclose(torch.autograd.grad(loss, logits, g)[0], want, **TOL)
    y = base.clone().requires_grad_(True) * 1.0
    cross_entropy_loss(y, labels, inplace_backward=True, **kw)[0].backward(g)
    assert torch.allclose(y.detach(), want, **TOL)


def test_cross_entropy_module_reductions_and_torch_agreement():
    torch.manual_seed(11)
    logits, labels = randn(17, 29, grad=True), ce_labels(17, 29)
    for red in ("mean", "sum", "none"):
        got = CrossEntropyLoss(reduction=red, label_smoothing=0.1)(logits, labels)
        want = F.cross_entropy(logits, labels, reduction=red, label_smoothing=0.1)
        assert torch.allclose(got, want, **TOL)
    loss, z = CrossEntropyLoss(lse_square_scale=1e-3, return_z_loss=True)(logits, labels)
    fl, fz = ce_formula(logits, labels, zsq=1e-3)
    valid = (labels != -100).sum()
    assert torch.allclose(loss, fl.sum() / valid, **TOL) and torch.allclose(z, fz.sum() / valid, **TOL)
    # every row ignored: mean is 0 / 0, as flash-attn
    assert torch.isnan(CrossEntropyLoss()(logits, torch.full((17,), -100)))
    with pytest.raises(NotImplementedError, match="reduction"):
        CrossEntropyLoss(reduction="batchmean")


def test_cross_entropy_low_precision_dtypes_and_inplace():
    torch.manual_seed(12)
    base = torch.randn(9, 50)
    labels = ce_labels(9, 50)
    logits = base.to(torch.bfloat16).requires_grad_(True)
    loss, z = cross_entropy_loss(logits, labels)
    assert loss.dtype == torch.float32 and z.dtype == torch.float32
    assert torch.allclose(loss.double(), ce_formula(logits.detach(), labels)[0], atol=1e-5)
    (g,) = torch.autograd.grad(loss.sum(), logits)
    assert g.dtype == torch.bfloat16
    # inplace_backward: the gradient lands in the logits' storage
    x = base.clone().requires_grad_(True)
    y = x * 1.0
    y.retain_grad()
    cross_entropy_loss(y, labels, inplace_backward=True)[0].sum().backward()
    ref_x = base.clone().requires_grad_(True)
    cross_entropy_loss(ref_x, labels)[0].sum().backward()
    assert torch.allclose(y.detach(), ref_x.grad) and torch.allclose(x.grad, ref_x.grad)


def test_cross_entropy_precomputed_lse_and_bad_args():
    torch.manual_seed(13)
    logits, labels = randn(6, 10, grad=True), ce_labels(6, 10, ignore=False)
    lse = torch.logsumexp(logits.detach(), -1)
    loss, _ = cross_entropy_loss(logits, labels, precomputed_lse=lse + 1.0)     # used: shifts every loss by 1
    assert torch.allclose(loss, ce_formula(logits, labels)[0] + 1.0, **TOL)
    loss, _ = cross_entropy_loss(logits, labels, precomputed_lse=lse + 1.0, label_smoothing=0.1)   # ignored
    assert torch.allclose(loss, ce_formula(logits, labels, 0.1)[0], **TOL)
    with pytest.raises(ValueError, match="labels"):
        cross_entropy_loss(logits, labels.double())
    with pytest.raises(ValueError, match="labels"):
        cross_entropy_loss(logits, labels[:5])
    with pytest.raises(ValueError, match="logit_scale"):
        cross_entropy_loss(logits, labels, logit_scale=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        cross_entropy_loss(logits, labels, label_smoothing=1.5)
    with pytest.raises(ValueError, match="logits"):
        cross_entropy_loss(logits[0], labels)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ce_split_worker(rank, world, port, kw, ops_route=False):
    import torch.distributed as dist

    from cuflash.ops import cross_entropy as ce_ops
    ce_ops.OPS_ROUTE_ON_CPU = ops_route   # the kernel route's plumbing (its ops' CPU impls)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(20)
        full = torch.randn(11, 8 * world, **F64)
        labels = ce_labels(11, 8 * world)
        labels[3] = 8 * rank + 2            # some labels in each rank's slice
        labels = labels.clone()
        dist.broadcast(labels, 0)
        part = full[:, 8 * rank:8 * (rank + 1)].clone().requires_grad_(True)
        loss, z = cross_entropy_loss(part, labels, process_group=dist.group.WORLD, **kw)
        fl, fz = ce_formula(full, labels, kw.get("label_smoothing", 0.0), kw.get("logit_scale", 1.0),
                            kw.get("lse_square_scale", 0.0))
        assert torch.allclose(loss, fl, **TOL), (rank, kw, (loss - fl).abs().max())
        assert torch.allclose(z, fz, **TOL)
        g = torch.linspace(-1, 1, 11, **F64)
        (gp,) = torch.autograd.grad(loss, part, g)
        fullg = full.clone().requires_grad_(True)
        (gf,) = torch.autograd.grad(ce_formula(fullg, labels, kw.get("label_smoothing", 0.0),
                                               kw.get("logit_scale", 1.0), kw.get("lse_square_scale", 0.0))[0],
                                    fullg, g)
        assert torch.allclose(gp, gf[:, 8 * rank:8 * (rank + 1)], **TOL)
        # the module, mean reduction
        m = CrossEntropyLoss(process_group=dist.group.WORLD, **kw)
        assert torch.allclose(m(part, labels), fl.sum() / (labels != -100).sum(), **TOL)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("route", ["composition", "kernel_route"])
@pytest.mark.parametrize("case", ["plain", "all"])
def test_cross_entropy_vocab_split_two_gloo_processes(case, route):
    mp = pytest.importorskip("torch.multiprocessing")
    mp.spawn(_ce_split_worker, args=(2, _free_port(), CE_CASES[case], route == "kernel_route"), nprocs=2, join=True)


# ---------------------------------------------------------------------------------------------
# Activations, MLPs
# ---------------------------------------------------------------------------------------------

def test_activations():
    torch.manual_seed(30)
    x, y, g = randn(50), randn(50), randn(50)
    tanh_gelu = 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x ** 3)))
    assert torch.allclose(gelu_fwd(x), tanh_gelu, **TOL)
    xg = x.clone().requires_grad_(True)
    (d,) = torch.autograd.grad(gelu_fwd(xg), xg, g)
    assert torch.allclose(gelu_bwd(g, x), d, **TOL)
    assert torch.allclose(sqrelu_fwd(x), torch.clamp(x, min=0) ** 2, **TOL)
    assert torch.allclose(sqrelu_bwd(g, x), 2 * g * torch.clamp(x, min=0), **TOL)
    assert torch.allclose(swiglu(x, y), x / (1 + torch.exp(-x)) * y, **TOL)
    xb, yb = x.to(torch.bfloat16), y.to(torch.bfloat16)
    assert swiglu(xb, yb).dtype == torch.bfloat16
    assert (swiglu(xb, yb).double() - swiglu(xb.double(), yb.double())).abs().max() < 2e-2


@pytest.mark.parametrize("act", ["sigmoid", "silu", "gelu"])
def test_gated_mlp(act):
    torch.manual_seed(31)
    fn = getattr(F, act)
    m = GatedMlp(20, activation=fn, multiple_of=16, return_residual=True, **F64)
    hidden = (int(8 * 20 / 3) + 15) // 16 * 16
    assert m.fc1.weight.shape == (2 * hidden, 20) and m.fc2.weight.shape == (20, hidden)
    x = randn(3, 4, 20)
    out, res = m(x)
    h = x @ m.fc1.weight.T + m.fc1.bias
    a, gate = h[..., :hidden], h[..., hidden:]
    act_gate = {"sigmoid": 1 / (1 + torch.exp(-gate)), "silu": gate / (1 + torch.exp(-gate)),
                "gelu": F.gelu(gate)}[act]
    assert res is x and torch.allclose(out, (a * act_gate) @ m.fc2.weight.T + m.fc2.bias, **TOL)


def test_mlp_and_fused_mlp():
    torch.manual_seed(32)
    m = Mlp(12, **F64)
    assert m.fc1.weight.shape == (48, 12) and list(m.state_dict()) == ["fc1.weight", "fc1.bias", "fc2.weight",
                                                                        "fc2.bias"]
    x = randn(2, 5, 12)
    assert torch.allclose(m(x), F.gelu(x @ m.fc1.weight.T + m.fc1.bias) @ m.fc2.weight.T + m.fc2.bias, **TOL)
    for act, f in (("gelu_approx", lambda t: F.gelu(t, approximate="tanh")), ("relu", F.relu),
                   ("sqrelu", lambda t: F.relu(t) ** 2)):
        fm = FusedMLP(12, 30, out_features=7, bias2=False, activation=act, **F64)
        assert fm.fc2.bias is None
        assert torch.allclose(fm(x), f(x @ fm.fc1.weight.T + fm.fc1.bias) @ fm.fc2.weight.T, **TOL)
    with pytest.raises(ValueError, match="activation"):
        FusedMLP(12, 30, activation="gelu")


# ---------------------------------------------------------------------------------------------
# Block, ParallelBlock, and a tiny GPT in float64
# ---------------------------------------------------------------------------------------------

def make_block(dim, heads, fused, norm="rms", gated=False, flash=True, residual_in_fp32=False, **kw):
    from functools import partial
    mixer = partial(MHA, num_heads=heads, causal=True, use_flash_attn=flash, **F64)
    mlp = (partial(GatedMlp, activation=F.silu, multiple_of=8, **F64) if gated
           else partial(Mlp, hidden_features=2 * dim, **F64))
    norm_cls = partial(ln.RMSNorm, eps=1e-5, **F64) if norm == "rms" else partial(nn.LayerNorm, eps=1e-5, **F64)
    return Block(dim, mixer, mlp, norm_cls=norm_cls, fused_dropout_add_ln=fused, residual_in_fp32=residual_in_fp32,
                 **kw)


@pytest.mark.parametrize("norm", ["rms", "ln"])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_block_prenorm_matches_formula(fused, norm):
    torch.manual_seed(40)
    blk = make_block(32, 4, fused, norm=norm, gated=(norm == "rms"))
    x, r = randn(2, 9, 32, grad=True), randn(2, 9, 32, grad=True)
    out, res = blk(x, r)
    fo, fr = block_formula(blk, x, r)
    assert torch.allclose(out, fo, atol=1e-9) and torch.allclose(res, fr, atol=1e-9)
    params = [x, r, blk.norm1.weight, blk.mixer.Wqkv.weight, blk.mlp.fc1.weight]
    g = [torch.randn_like(out), torch.randn_like(res)]
    for a, b in zip(torch.autograd.grad((out, res), params, g), torch.autograd.grad((fo, fr), params, g)):
        assert torch.allclose(a, b, atol=1e-9)
    # the first block: residual None
    out, res = blk(x)
    assert torch.allclose(out, block_formula(blk, x, None)[0], atol=1e-9)


def test_block_fused_and_unfused_agree_with_drop_path_and_residual_fp32():
    """Same weights, same RNG state: the fused path (rowscale from drop path, dropout masks of
    layer_norm_fn) and the unfused one differ in their draws, so compare in eval mode, and the
    training-mode drop path by its per-sample structure."""
    torch.manual_seed(41)
    a = make_block(32, 4, False, residual_in_fp32=True, resid_dropout1=0.1, drop_path1=0.5, drop_path2=0.5)
    b = make_block(32, 4, True, residual_in_fp32=True, resid_dropout1=0.1, drop_path1=0.5, drop_path2=0.5)
    b.load_state_dict(a.state_dict())
    a.eval(), b.eval()
    x, r = randn(3, 6, 32), randn(3, 6, 32).float()    # the residual stream in fp32 (its dtype wins)
    for u, v in zip(a(x, r), b(x, r)):
        assert torch.allclose(u.double(), v.double(), atol=1e-6)     # the residual is fp32 here
    assert a(x, r)[1].dtype == torch.float32 and b(x, r)[1].dtype == torch.float32
    # a zero-centered RMSNorm: the fused path applies weight + 1 as the module does
    from functools import partial
    zc = partial(ln.RMSNorm, eps=1e-5, zero_centered_weight=True, **F64)
    c = make_block(32, 4, False)
    c.norm1, c.norm2 = zc(32), zc(32)
    d = make_block(32, 4, True)
    d.norm1, d.norm2 = zc(32), zc(32)
    with torch.no_grad():
        c.norm1.weight.normal_(), c.norm2.weight.normal_()
    d.load_state_dict(c.state_dict())
    r32 = randn(3, 6, 32)
    for u, v in zip(c(x, r32), d(x, r32)):
        assert torch.allclose(u, v, atol=1e-10)
    sd = StochasticDepth(0.5, "row").train()
    torch.manual_seed(0)
    y = sd(torch.ones(64, 3, 4, **F64))
    per_row = y[:, 0, 0]
    assert set(per_row.tolist()) <= {0.0, 2.0} and bool((y == per_row[:, None, None]).all())


def test_block_postnorm_and_parallel_block():
    torch.manual_seed(42)
    from functools import partial
    blk = Block(24, partial(MHA, num_heads=3, use_flash_attn=True, **F64), partial(Mlp, **F64), prenorm=False,
                norm_cls=partial(nn.LayerNorm, **F64))
    x = randn(2, 5, 24)
    h = F.layer_norm(attention_formula(x, blk.mixer, False) + x, (24,), blk.norm1.weight, blk.norm1.bias, 1e-5)
    m = blk.mlp
    want = F.layer_norm(F.gelu(h @ m.fc1.weight.T + m.fc1.bias) @ m.fc2.weight.T + m.fc2.bias + h, (24,),
                        blk.norm2.weight, blk.norm2.bias, 1e-5)
    assert torch.allclose(blk(x), want, atol=1e-10)
    with pytest.raises(ValueError, match="residual_in_fp32"):
        Block(24, prenorm=False, residual_in_fp32=True)
    with pytest.raises(ValueError, match="norm_cls"):
        Block(64, norm_cls=lambda d: nn.Identity(), fused_dropout_add_ln=True)
    # ParallelBlock: fused (layer_norm_fn with x1 / weight1) and unfused agree
    for tied in (False, True):
        pa = ParallelBlock(24, partial(MHA, num_heads=3, use_flash_attn=True, **F64), partial(Mlp, **F64),
                           norm_cls=partial(nn.LayerNorm, **F64), tied_norm=tied)
        pb = ParallelBlock(24, partial(MHA, num_heads=3, use_flash_attn=True, **F64), partial(Mlp, **F64),
                           norm_cls=partial(nn.LayerNorm, **F64), tied_norm=tied, fused_dropout_add_ln=True)
        pb.load_state_dict(pa.state_dict())
        h1, h2, r = randn(2, 5, 24), randn(2, 5, 24), randn(2, 5, 24)
        for u, v in zip(pa(h1, h2, r), pb(h1, h2, r)):
            assert torch.allclose(u, v, atol=1e-10)


def test_tiny_gpt_loss_and_gradients_float64():
    torch.manual_seed(43)
    model = TinyGPT(61, 32, 4, 2)
    ids = torch.randint(0, 61, (2, 10))
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    loss = CrossEntropyLoss(label_smoothing=0.05, lse_square_scale=1e-4)(model(ids).flatten(0, 1), labels.flatten())
    logits = tiny_gpt_formula(model, ids).flatten(0, 1)
    fl = ce_formula(logits, labels.flatten(), smoothing=0.05, zsq=1e-4)[0].sum() / (labels != -100).sum()
    assert torch.allclose(loss, fl, atol=1e-10)
    params = list(model.parameters())
    for a, b in zip(torch.autograd.grad(loss, params), torch.autograd.grad(fl, params)):
        assert torch.allclose(a, b, atol=1e-9)
