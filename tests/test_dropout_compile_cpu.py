"""Dropout through the torch ops cuflash::fwd_dropout / cuflash::bwd_dropout without a GPU:
their CPU impls run the float64 reference with the kernels' keep mask (cuflash.dropout's
mirror of philox.cuh) of the RNG state tensor, so opcheck and torch.compile(fullgraph=True)
exercise the plumbing that CUDA tensors take under torch.compile."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cuflash import api, dropout, flash_attn_func, reference  # noqa: E402
from cuflash import torch_ops  # noqa: E402  (registers the ops)


def qkv(b=2, sq=17, sk=23, h=4, h_kv=2, d=16, dtype=torch.float64, grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, n, d, generator=g, dtype=dtype).requires_grad_(grad)
                 for s, n in ((sq, h), (sk, h_kv), (sk, h_kv)))


def state(seed, offset=0):
    return torch.tensor([seed, offset], dtype=torch.int64)


def test_opcheck_dropout_ops():
    q, k, v = qkv(1, 5, 6, 2, 2, 8, dtype=torch.float32, grad=False)
    rng = state(11, 4)
    args = (q, k, v, rng, 0.3, True, 0.25, "")
    torch.library.opcheck(torch.ops.cuflash.fwd_dropout.default, args)
    out, lse = torch.ops.cuflash.fwd_dropout(*args)
    torch.library.opcheck(torch.ops.cuflash.bwd_dropout.default,
                          (torch.randn_like(out), q, k, v, out, lse, rng, 0.3, True, 0.25, False, ""))


def test_cpu_ops_are_the_reference_with_the_kernels_mask():
    q, k, v = qkv(grad=False)
    seed, offset, p = 0x9234_5678_9ABC_DEF0, 17, 0.3
    rng = torch.tensor([seed - 2 ** 64, offset], dtype=torch.int64)  # int64 bits of the u64 seed
    out, lse = torch.ops.cuflash.fwd_dropout(q, k, v, rng, 0.25, True, p, "")
    keep = dropout.keep_mask(seed, offset, p, 2, 4, 17, 23)
    as_np = lambda x: x.detach().numpy()  # noqa: E731
    want, want_lse = reference.attention_naive(as_np(q), as_np(k), as_np(v), softmax_scale=0.25,
                                               causal=True, return_lse=True, dropout_p=p,
                                               dropout_mask=keep)
    np.testing.assert_allclose(out.numpy(), want, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-6)
    dout = torch.randn_like(out)
    grads = torch.ops.cuflash.bwd_dropout(dout, q, k, v, out, lse, rng, 0.25, True, p, False, "")
    want = reference.attention_backward_naive(as_np(dout), as_np(q), as_np(k), as_np(v),
                                              softmax_scale=0.25, causal=True, dropout_p=p,
                                              dropout_mask=keep)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g.numpy(), w, atol=1e-12)


def test_eager_cpu_with_a_seed_uses_the_kernels_mask():
    """torch CPU with an explicit dropout_seed: S_dmask is the kernels' keep mask of that seed
    (the one a GPU call with the same seed draws), and the output follows it."""
    q, k, v = qkv(grad=False)
    out, lse, mask = flash_attn_func(q, k, v, 0.2, causal=True, return_attn_probs=True,
                                     dropout_seed=(5, 9))
    keep = dropout.keep_mask(5, 9, 0.2, 2, 4, 17, 23)
    assert mask.dtype == torch.bool and np.array_equal(mask.numpy(), keep)
    want = reference.attention_naive(*(x.numpy() for x in (q, k, v)), causal=True, dropout_p=0.2,
                                     dropout_mask=keep)
    np.testing.assert_allclose(out.numpy(), want, atol=1e-12)
    again = flash_attn_func(q, k, v, 0.2, causal=True, dropout_seed=(5, 9))
    assert torch.equal(out, again)
    assert not torch.equal(out, flash_attn_func(q, k, v, 0.2, causal=True, dropout_seed=(5, 10)))


def test_gradcheck_through_the_dropout_ops():
    q, k, v = qkv(1, 5, 7, 2, 1, 8)

    def f(q, k, v):
        return flash_attn_func(q, k, v, 0.3, causal=True, dropout_seed=3)

    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("backend,d", [("eager", 16), ("eager", 12), ("aot_eager", 16),
                                       ("aot_eager", 12), ("inductor", 16)])
def test_compile_fullgraph_matches_eager_for_a_seed(backend, d):
    torch._dynamo.reset()
    q, k, v = qkv(d=d)

    def f(q, k, v):
        return flash_attn_func(q, k, v, dropout_p=0.3, causal=True, dropout_seed=(7, 3))

    out = f(q, k, v)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    cf = torch.compile(f, fullgraph=True, backend=backend)
    out_c = cf(q, k, v)
    grads_c = torch.autograd.grad(out_c, (q, k, v), dout)
    assert torch.equal(out, out_c)
    for a, b in zip(grads, grads_c):
        assert torch.equal(a, b)


def test_compile_draws_a_state_per_call_reproducibly():
    """No dropout_seed under torch.compile: the state is drawn inside the graph from torch's
    generator: a new mask per call, the same ones again after torch.manual_seed."""
    torch._dynamo.reset()
    q, k, v = qkv()

    cf = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, dropout_p=0.3), fullgraph=True,
                       backend="aot_eager")

    def step():
        out = cf(q, k, v)
        return out, torch.autograd.grad(out.sum(), (q, k, v))

    torch.manual_seed(1)
    a, ga = step()
    b, _ = step()
    torch.manual_seed(1)
    c, gc = step()
    assert not torch.equal(a, b)
    assert torch.equal(a, c) and all(torch.equal(x, y) for x, y in zip(ga, gc))


def test_compile_keeps_the_validation_errors():
    torch._dynamo.reset()
    q, k, v = qkv(grad=False)
    for kw, err, msg in ((dict(dropout_p=1.5), ValueError, r"dropout_p must be in \[0, 1\)"),
                         (dict(dropout_p=0.1, dropout_seed=1.5), TypeError, r"dropout_seed must be"),
                         (dict(dropout_p=0.1, dropout_seed=-1), ValueError, r"dropout_seed: seed"),
                         (dict(dropout_p=0.1, dropout_seed=state(1)), TypeError,
                          r"dropout_seed: a tensor state is for torch CUDA")):
        with pytest.raises(err, match=msg):
            flash_attn_func(q, k, v, **kw)
        torch._dynamo.reset()
        # (fullgraph=True reports it as dynamo's Unsupported, the message in its context)
        with pytest.raises(err, match=msg):
            torch.compile(lambda q, k, v: flash_attn_func(q, k, v, **kw), backend="eager")(q, k, v)


def test_the_direct_gpu_route_stays_off_the_ops_in_eager(monkeypatch):
    """Eager CUDA calls keep dropout_attention's direct route (no dispatcher): the ops are
    taken only under torch.compile or for CPU tensors."""
    seen = []
    monkeypatch.setattr(torch_ops, "dropout_attention_ops", lambda *a, **k: seen.append(a))
    monkeypatch.setattr(torch_ops, "dropout_forward", lambda *a: ("direct", None))
    from cuflash.problem import Problem

    problem = Problem("fwd", "bf16", 1, 3, 3, 2, 2, 8, False, False, ("dropout",), dropout_p=0.1)
    q = torch.zeros(1, 3, 2, 8, device="meta")   # not a CPU tensor: the GPU route
    out, lse, rng = torch_ops.dropout_attention(q, q, q, problem, 0.3, state(1))
    assert out == "direct" and not seen


def test_compile_first_in_a_fresh_process():
    """A compiled call before any eager one: the kernel families are registered at import
    (dynamo refuses the registry's importlib.import_module when it loads them lazily)."""
    import subprocess
    import sys

    code = ("import torch, cuflash\n"
            "q, k, v = (torch.randn(1, 9, 2, 8).requires_grad_() for _ in range(3))\n"
            "f = torch.compile(lambda q, k, v: cuflash.flash_attn_func(q, k, v, 0.2, dropout_seed=4),"
            " fullgraph=True, backend='aot_eager')\n"
            "f(q, k, v).sum().backward()\n"
            "print('ok', q.grad.isfinite().all().item())\n")
    root = str(__import__("pathlib").Path(__file__).resolve().parents[1])   # this checkout's cuflash
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=root)
    assert res.stdout.split() == ["ok", "True"], res.stderr[-3000:]


def test_cpu_seed_with_nothing_to_drop_gives_an_empty_bool_mask():
    q, k, v = qkv(1, 0, 5, 2, 2, 8, grad=False)
    out, lse, mask = flash_attn_func(q, k, v, 0.2, dropout_seed=1, return_attn_probs=True)
    assert out.shape == q.shape and mask.shape == (1, 2, 0, 5) and mask.dtype == torch.bool
