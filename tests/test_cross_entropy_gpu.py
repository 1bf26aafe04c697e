"""cuflash.ops.cross_entropy's CUDA kernels (kernels_cu/cross_entropy.cu) against the float64
formula on the same data, the FlashAttention way: the loss within 2x, the gradient within 3x the
error of the same formula done plainly in the logits' dtype (fp32 for fp32 logits). Vocab sizes
1, 17, 50257 (odd: edge columns), 128256, 256000 (few rows: a row split over CTAs and merged);
label smoothing, logit_scale != 1, z-loss, ignored rows, labels out of range, int32 labels,
inplace_backward both ways, a row-strided view; outputs NaN-poisoned before every launch.

Compile count: one module per logits dtype (3). ``tests/cross_entropy_precompile.py`` fills the
cache in parallel."""
import pytest

torch = pytest.importorskip("torch")

from cuflash import cross_entropy as ce_kernels  # noqa: E402
from cuflash.ops.cross_entropy import cross_entropy_loss  # noqa: E402

pytestmark = [pytest.mark.gpu]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
VOCABS = {1: 64, 17: 301, 50257: 67, 128256: 9, 256000: 5}   # vocab: rows
CASES = {
    "plain": {},
    "smooth": dict(label_smoothing=0.1),
    "scale_zloss": dict(logit_scale=0.63, lse_square_scale=1e-3),
    "all": dict(label_smoothing=0.1, logit_scale=1.7, lse_square_scale=1e-4),
}


def formula(z_in, labels, s, scale, zsq, ignore_index=-100):
    """(loss, z_loss) by the module docstring's formula, in z_in's dtype (autograd through it)."""
    z = z_in * scale
    lse = torch.logsumexp(z, dim=-1)
    vocab = z.shape[1]
    ok = (labels >= 0) & (labels < vocab)
    zy = z.gather(1, torch.where(ok, labels, 0).long()[:, None])[:, 0]
    loss = lse - (1 - s) * torch.where(ok, zy, torch.zeros_like(zy)) - s * z.sum(-1) / vocab + zsq * lse * lse
    ignored = labels == ignore_index
    return (torch.where(ignored, torch.zeros_like(loss), loss),
            torch.where(ignored, torch.zeros_like(lse), zsq * lse * lse))


def check(got, ref, base, factor, what, floor):
    err = (got.double() - ref).abs().max().item()
    base_err = (base.double() - ref).abs().max().item()
    print(f"{what}: error {err:.3e}, plain {base_err:.3e}")
    assert not torch.isnan(got).any(), f"{what}: NaN (an unwritten element?)"
    assert err <= factor * base_err + floor, f"{what}: error {err:.3e} > {factor} x plain {base_err:.3e} + {floor}"


def run_case(dtype, vocab, rows, kw, inplace=False, label_dtype=torch.int64, strided=False):
    s, sc, zsq = kw.get("label_smoothing", 0.0), kw.get("logit_scale", 1.0), kw.get("lse_square_scale", 0.0)
    full = (4 * torch.randn(rows, vocab + (3 if strided else 0), device="cuda")).to(dtype)
    logits = full[:, 1:vocab + 1] if strided else full
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    labels[::5] = -100
    if rows > 3:
        labels[3] = vocab + 7        # out of range: no label term
    labels = labels.to(label_dtype)
    assert ce_kernels.kernel_takes(logits, labels)
    g = torch.rand(rows, device="cuda")
    leaf = full.detach().clone().requires_grad_(True)
    src = leaf.clone() if inplace else leaf
    x = src[:, 1:vocab + 1] if strided else src
    loss, z = cross_entropy_loss(x, labels, inplace_backward=inplace, **kw)
    assert loss.dtype == torch.float32 and z.dtype == torch.float32 and loss.shape == (rows,)
    (ga,) = torch.autograd.grad(loss, leaf, g)
    ga = ga[:, 1:vocab + 1] if strided else ga
    assert ga.dtype == dtype
    l64 = logits.detach().double().requires_grad_(True)
    ref, ref_z = formula(l64, labels.long(), s, sc, zsq)
    (gr,) = torch.autograd.grad(ref, l64, g.double())
    lb = logits.detach().clone().requires_grad_(True)
    base, _ = formula(lb, labels.long(), s, sc, zsq)
    (gb,) = torch.autograd.grad(base, lb, g.to(dtype))
    top = ref.abs().max().item()
    check(loss, ref, base, 2, "loss", floor=1e-6 * max(1.0, top))
    check(z, ref_z, ref_z.to(torch.float32), 2, "z_loss", floor=2e-6 * max(1.0, ref_z.abs().max().item()))
    check(ga, gr, gb, 3, "dlogits", floor=1e-6)
    if inplace:   # the gradient was written into the logits' own storage
        assert torch.equal(x.detach(), ga)
    return loss


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("vocab", sorted(VOCABS))
@pytest.mark.parametrize("dt", sorted(DTYPES))
def test_loss_and_grad(poison_outputs, dt, vocab, case):
    torch.manual_seed(vocab + len(case))
    run_case(DTYPES[dt], vocab, VOCABS[vocab], CASES[case])


@pytest.mark.parametrize("vocab", [17, 50257, 256000])
@pytest.mark.parametrize("dt", sorted(DTYPES))
def test_inplace_backward(poison_outputs, dt, vocab):
    torch.manual_seed(3)
    run_case(DTYPES[dt], vocab, VOCABS[vocab], CASES["all"], inplace=True)


@pytest.mark.parametrize("dt", sorted(DTYPES))
def test_int32_labels_and_strided_rows(poison_outputs, dt):
    """int32 labels; a row-strided view whose rows start off the 16-byte grid (edge columns at
    both ends; the new gradient keeps the kernel's 16-byte stores only where its phase matches)."""
    torch.manual_seed(4)
    run_case(DTYPES[dt], 50257, 33, CASES["all"], label_dtype=torch.int32, strided=True)
    run_case(DTYPES[dt], 50257, 33, CASES["all"], label_dtype=torch.int32, strided=True, inplace=True)


def test_matches_composition_and_broadcast_grad(poison_outputs):
    """The kernels and the torch composition (the CPU path, run on the GPU through USE_KERNELS)
    agree; a mean's backward (grad_loss with stride 0) reaches every row."""
    from cuflash.ops import cross_entropy as ops

    torch.manual_seed(5)
    logits = (3 * torch.randn(129, 32000, device="cuda")).to(torch.bfloat16)
    labels = torch.randint(0, 32000, (129,), device="cuda")
    labels[::9] = -100
    out = []
    for use in (True, False):
        ops.USE_KERNELS = use
        try:
            x = logits.detach().clone().requires_grad_(True)
            loss, _ = cross_entropy_loss(x, labels, label_smoothing=0.05, lse_square_scale=1e-4)
            loss.mean().backward()
            out.append((loss.detach(), x.grad))
        finally:
            ops.USE_KERNELS = True
    assert (out[0][0] - out[1][0]).abs().max().item() < 1e-4
    assert (out[0][1].float() - out[1][1].float()).abs().max().item() < 1e-6
    assert torch.equal(out[0][1][labels == -100], torch.zeros_like(out[0][1][labels == -100]))


def test_cuda_graph_replay(poison_outputs):
    """The kernels launch on torch's current stream with torch-allocated outputs: a forward and a
    backward captured in a CUDA graph replay on new logits in place, equal to eager calls."""
    from cuflash import api

    torch.manual_seed(6)
    rows, vocab = 37, 50257
    logits = (3 * torch.randn(rows, vocab, device="cuda")).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    labels[::4] = -100
    g = torch.rand(rows, device="cuda")
    args = (0.1, 1.3, 1e-3, -100, 0, vocab)

    def step():
        loss, z, lse, _ = ce_kernels.forward(logits, labels, *args)
        return loss, z, ce_kernels.backward(g, logits, lse, labels, *args, False)

    api.POISON_OUTPUTS = False   # no fill_ inside the capture
    try:
        step()   # plans made, kernels loaded, before the capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step()
        logits.copy_((3 * torch.randn(rows, vocab, device="cuda")).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        want = step()
    finally:
        api.POISON_OUTPUTS = True
    for a, b in zip(outs, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
def test_precomputed_lse(poison_outputs, inplace):
    """precomputed_lse (logit_scale 1, no smoothing): the loss from the given LSE, the gradient by
    the backward kernel with p = exp(z - lse)."""
    torch.manual_seed(7)
    rows, vocab = 41, 50257
    logits = (3 * torch.randn(rows, vocab, device="cuda")).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    labels[::6] = -100
    lse = torch.logsumexp(logits.double(), -1).float()
    g = torch.rand(rows, device="cuda")
    leaf = logits.clone().requires_grad_(True)
    x = leaf.clone() if inplace else leaf
    loss, _ = cross_entropy_loss(x, labels, precomputed_lse=lse, lse_square_scale=1e-3, inplace_backward=inplace)
    (ga,) = torch.autograd.grad(loss, leaf, g)
    l64 = logits.double().requires_grad_(True)
    ref, _ = formula(l64, labels, 0.0, 1.0, 1e-3)
    (gr,) = torch.autograd.grad(ref, l64, g.double())
    lb = logits.clone().requires_grad_(True)
    base, _ = formula(lb, labels, 0.0, 1.0, 1e-3)
    (gb,) = torch.autograd.grad(base, lb, g.to(torch.bfloat16))
    check(loss, ref, base, 2, "loss", floor=1e-5)
    check(ga, gr, gb, 3, "dlogits", floor=1e-6)
