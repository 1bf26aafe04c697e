"""flash-attn's non-attention building blocks on the GPU in bf16 / fp16 (cuflash.ops.layer_norm,
cuflash.ops.cross_entropy, a tiny GPT of cuflash's Block + MHA (cuflash's attention kernels) +
Mlp / GatedMlp + RMSNorm + CrossEntropyLoss), the FlashAttention way: the error against the
float64 formula (tests/flash_ops_reference.py) must be within 2x (3x for gradients) the error of
the same computation done plainly in the low-precision dtype, against the same formula.

Compile count: the tiny GPT's attention (head dim 64, causal, bf16: one forward and one backward
kernel); ``test_compiled`` runs torch.compile (inductor) on layer_norm_fn and cross_entropy_loss.
"""
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from cuflash.ops import layer_norm as ln  # noqa: E402
from cuflash.ops.cross_entropy import cross_entropy_loss  # noqa: E402
from cuflash.losses.cross_entropy import CrossEntropyLoss  # noqa: E402

from flash_ops_reference import TinyGPT, ce_formula, norm_formula  # noqa: E402

pytestmark = [pytest.mark.gpu]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def rule(got, ref, base, factor, what, floor=1e-6):
    ref = ref.detach().double().cpu()
    err = (got.detach().double().cpu() - ref).abs().max().item()
    base_err = (base.detach().double().cpu() - ref).abs().max().item()
    print(f"{what}: error {err:.3e}, plain {base_err:.3e}")
    assert err <= factor * base_err + floor, f"{what}: error {err:.3e} > {factor} x plain {base_err:.3e}"
    return err, base_err


NORM_CASES = {
    "residual_prenorm": dict(residual=True, prenorm=True),
    "residual_fp32_weights": dict(residual=True, prenorm=True, fp32_weight=True),
    "x1_w1_rowscale_free": dict(residual=True, x1=True, weight1=True, prenorm=True),
    "rowscale": dict(residual=True, rowscale=True),
}


@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
@pytest.mark.parametrize("case", sorted(NORM_CASES))
@pytest.mark.parametrize("dt", sorted(DTYPES))
def test_norm_low_precision(dt, case, rms):
    """y (and y1, residual_out) and every gradient against the float64 formula, within 2x / 3x the
    error of flash-attn's plain reference (layer_norm_ref / rms_norm_ref without upcast: the sums
    and the norm in the inputs' dtype)."""
    torch.manual_seed(0)
    c = NORM_CASES[case]
    dtype = DTYPES[dt]
    shape, n = (4, 333, 1000), 1000
    wdt = torch.float32 if c.get("fp32_weight") else dtype
    dev = dict(device="cuda")
    t = dict(x=torch.randn(shape, dtype=dtype, **dev), weight=(1 + 0.1 * torch.randn(n, **dev)).to(wdt),
             bias=(0.1 * torch.randn(n, **dev)).to(wdt))
    if c.get("residual"):
        t["residual"] = torch.randn(shape, dtype=dtype, **dev)
    if c.get("x1"):
        t["x1"] = torch.randn(shape, dtype=dtype, **dev)
        t["weight1"] = (1 + 0.1 * torch.randn(n, **dev)).to(wdt)
        t["bias1"] = (0.1 * torch.randn(n, **dev)).to(wdt)
    if c.get("rowscale"):
        t["rowscale"] = (torch.rand(shape[:-1], **dev) + 0.5).to(dtype)
    for v in t.values():
        v.requires_grad_(v.is_floating_point() and v is not t.get("rowscale"))
    prenorm = c.get("prenorm", False)
    got = ln.layer_norm_fn(eps=1e-5, prenorm=prenorm, is_rms_norm=rms, **t)
    got = got if isinstance(got, tuple) else (got,)
    ref_fn = ln.rms_norm_ref if rms else ln.layer_norm_ref
    base = ref_fn(eps=1e-5, prenorm=prenorm, **t)
    base = base if isinstance(base, tuple) else (base,)
    d64 = {k: v.detach().double().requires_grad_(v.requires_grad) for k, v in t.items()}
    y, y1, h = norm_formula(d64["x"], d64["weight"], d64["bias"], d64.get("residual"), d64.get("x1"),
                            d64.get("weight1"), d64.get("bias1"), 1e-5, d64.get("rowscale"), rms=rms)
    ref = (y,) + ((y1,) if y1 is not None else ()) + ((h,) if prenorm else ())
    assert len(got) == len(ref) == len(base)
    for i, (g, r, b) in enumerate(zip(got, ref, base)):
        assert torch.isfinite(g).all()
        rule(g, r, b, 2, f"output {i}")
    grads = [torch.randn_like(g) for g in got]
    names = [k for k, v in t.items() if v.requires_grad]
    gg = torch.autograd.grad(got, [t[k] for k in names], grads)
    gb = torch.autograd.grad(base, [t[k] for k in names], grads)
    gr = torch.autograd.grad(ref, [d64[k] for k in names], [g.double() for g in grads])
    for k, a, b, r in zip(names, gg, gb, gr):
        assert a.dtype == t[k].dtype
        rule(a, r, b, 3, f"d{k}", floor=1e-4 * r.abs().max().item())


CE_CASES = {
    "plain": dict(),
    "smoothing_ignore": dict(label_smoothing=0.1),
    "zloss_scale": dict(lse_square_scale=1e-4, logit_scale=0.8),
}


def ce_plain(logits, labels, smoothing=0.0, scale=1.0, zsq=0.0, ignore_index=-100):
    """The same formula in the logits' dtype (the plain low-precision baseline)."""
    z = logits * scale
    lse = torch.logsumexp(z, dim=-1)
    valid = labels != ignore_index
    zy = z.gather(1, torch.where(valid, labels, 0)[:, None])[:, 0]
    loss = lse - (1 - smoothing) * zy - smoothing * z.mean(-1) + zsq * lse * lse
    return torch.where(valid, loss, torch.zeros_like(loss))


@pytest.mark.parametrize("case", sorted(CE_CASES))
@pytest.mark.parametrize("dt", sorted(DTYPES))
def test_cross_entropy_low_precision(dt, case):
    torch.manual_seed(1)
    kw = CE_CASES[case]
    dtype = DTYPES[dt]
    n, vocab = 777, 32003
    logits = (3 * torch.randn(n, vocab, device="cuda")).to(dtype).requires_grad_(True)
    labels = torch.randint(0, vocab, (n,), device="cuda")
    labels[::7] = -100
    loss, z = cross_entropy_loss(logits, labels, **kw)
    assert loss.dtype == torch.float32 and z.dtype == torch.float32
    s, sc, zsq = kw.get("label_smoothing", 0.0), kw.get("logit_scale", 1.0), kw.get("lse_square_scale", 0.0)
    l64 = logits.detach().double().requires_grad_(True)
    ref, ref_z = ce_formula(l64, labels, s, sc, zsq)
    base = ce_plain(logits, labels, s, sc, zsq)
    rule(loss, ref, base, 2, "loss")
    z_err = (z.double() - ref_z).abs().max().item()
    assert z_err <= 1e-5 * max(ref_z.abs().max().item(), 1.0), f"z_loss error {z_err:.3e}"
    g = torch.rand(n, device="cuda")
    (ga,) = torch.autograd.grad(loss, logits, g)
    (gb,) = torch.autograd.grad(base, logits, g.to(dtype))
    (gr,) = torch.autograd.grad(ref, l64, g.double())
    assert ga.dtype == dtype
    rule(ga, gr, gb, 3, "dlogits", floor=1e-6)
    # the module's mean agrees with its per-row losses
    m = CrossEntropyLoss(**kw)(logits, labels)
    assert torch.allclose(m, loss.sum() / (labels != -100).sum())


def test_tiny_gpt_bf16_matches_float64(poison_outputs):
    """Embedding → 2 prenorm Blocks (cuflash MHA on its kernels, GatedMlp / Mlp, fused RMSNorm
    with the residual in fp32) → RMSNorm → tied head → CrossEntropyLoss (smoothing, z-loss), bf16
    on the GPU, against the same weights in float64 on the CPU (cuflash's float64 reference
    attention); the plain baseline is the bf16 model with use_flash_attn=False (torch attention)."""
    torch.manual_seed(2)
    vocab, dim, heads, layers, batch, seqlen = 1000, 256, 4, 2, 2, 257
    model = TinyGPT(vocab, dim, heads, layers, flash=True, dtype=torch.bfloat16, device="cuda",
                    residual_in_fp32=True)
    plain = TinyGPT(vocab, dim, heads, layers, flash=False, dtype=torch.bfloat16, device="cuda",
                    residual_in_fp32=True)
    ref = TinyGPT(vocab, dim, heads, layers, flash=True, dtype=torch.float64)
    plain.load_state_dict(model.state_dict())
    ref.load_state_dict({k: v.double().cpu() for k, v in model.state_dict().items()})
    ids = torch.randint(0, vocab, (batch, seqlen))
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    crit = CrossEntropyLoss(label_smoothing=0.05, lse_square_scale=1e-4)

    def run(m, device):
        logits = m(ids.to(device))
        loss = crit(logits.flatten(0, 1), labels.flatten().to(device))
        return logits.detach(), loss, torch.autograd.grad(loss, list(m.parameters()))

    logits, loss, grads = run(model, "cuda")
    logits_b, loss_b, grads_b = run(plain, "cuda")
    logits_r, loss_r, grads_r = run(ref, "cpu")
    assert torch.isfinite(loss)
    rule(logits, logits_r, logits_b, 2, "logits")
    # the loss is one number: its error is noise around bf16's; bound it by the baseline's or 2^-9 relative
    rule(loss, loss_r, loss_b, 2, "loss", floor=loss_r.abs().item() * 2.0 ** -9)
    for (name, _), g, gb, gr in zip(model.named_parameters(), grads, grads_b, grads_r):
        assert torch.isfinite(g).all(), name
        rule(g.cpu(), gr, gb.cpu(), 3, f"d{name}", floor=1e-3 * gr.abs().max().item())


def test_compiled():
    """torch.compile (inductor, fullgraph) of layer_norm_fn and cross_entropy_loss on CUDA tensors
    gives the eager results (forward and gradients)."""
    torch.manual_seed(3)
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(512, device="cuda", requires_grad=True)
    f = lambda x, r, w: ln.rms_norm_fn(x, w, None, residual=r, prenorm=True, residual_in_fp32=True)  # noqa: E731
    cf = torch.compile(f, fullgraph=True)
    for a, b in zip(cf(x, r, w), f(x, r, w)):
        assert torch.allclose(a.float(), b.float(), atol=2e-2)
    ga = torch.autograd.grad(sum(o.float().sum() for o in cf(x, r, w)), [x, r, w])
    gb = torch.autograd.grad(sum(o.float().sum() for o in f(x, r, w)), [x, r, w])
    for a, b in zip(ga, gb):
        assert torch.allclose(a.float(), b.float(), atol=5e-2, rtol=2e-2)
    logits = torch.randn(128, 1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 1000, (128,), device="cuda")
    ce = lambda lg: cross_entropy_loss(lg, labels, label_smoothing=0.1, lse_square_scale=1e-3)[0]  # noqa: E731
    cce = torch.compile(ce)
    assert torch.allclose(cce(logits), ce(logits), atol=1e-4)
    (ga,) = torch.autograd.grad(cce(logits).sum(), logits)
    (gb,) = torch.autograd.grad(ce(logits).sum(), logits)
    assert torch.allclose(ga.float(), gb.float(), atol=1e-3)
