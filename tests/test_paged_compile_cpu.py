"""flash_attn_varlen_func with block_table under torch.compile, without a GPU: the ops
cuflash::varlen_fwd_paged (CPU impl: the float64 reference on the keys gathered from their
pages) and cuflash::varlen_paged_no_bwd (the backward's run-time refusal, as flash-attn's varlen
backward rejects a paged cache) trace with fullgraph=True; the plain torch CPU varlen call
runs eagerly under torch.compile (its reference reads cu_seqlens on the host)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cuflash  # noqa: E402
from cuflash import varlen_torch  # noqa: E402  (registers the ops)

from test_varlen_paged_cpu import LENS_K, LENS_Q, paged_inputs  # noqa: E402


def _call(q, kc, vc, table, cu_q, cu_k, **kw):
    return cuflash.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, max(LENS_Q), max(LENS_K),
                                          block_table=table, **kw)


def test_opcheck_paged_op():
    q, kc, vc, table, cu_q, cu_k = paged_inputs(dtype=torch.float32)
    args = (q, kc, vc, cu_q, cu_k, table, max(LENS_Q), max(LENS_K), 0.25, True, None, 3, 0, 4.0, "")
    torch.library.opcheck(torch.ops.cuflash.varlen_fwd_paged.default, args)
    slopes = torch.rand(4, q.shape[1])
    torch.library.opcheck(torch.ops.cuflash.varlen_fwd_paged.default,
                          args[:10] + (slopes, -1, -1, 0.0, ""))


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(3, 1), softcap=5.0),
                                dict(alibi_slopes=torch.rand(4, 4), causal=True)])
def test_compile_fullgraph_matches_eager(backend, kw):
    torch._dynamo.reset()
    q, kc, vc, table, cu_q, cu_k = paged_inputs(dtype=torch.float64)
    f = lambda q, kc, vc: _call(q, kc, vc, table, cu_q, cu_k, return_attn_probs=True, **kw)  # noqa: E731
    out, lse, probs = f(q, kc, vc)
    out_c, lse_c, probs_c = torch.compile(f, fullgraph=True, backend=backend)(q, kc, vc)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)
    assert probs.shape == probs_c.shape == (0,) and probs.dtype == probs_c.dtype == q.dtype   # as flash-attn


def test_compile_with_grad_traces_and_the_backward_refuses():
    """A graph whose inputs require grad compiles (as flash-attn's does); running its backward
    raises the same NotImplementedError as the eager call."""
    torch._dynamo.reset()
    q, kc, vc, table, cu_q, cu_k = paged_inputs(dtype=torch.float64)
    want = _call(q, kc, vc, table, cu_q, cu_k, causal=True)
    q.requires_grad_()
    f = torch.compile(lambda q: _call(q, kc, vc, table, cu_q, cu_k, causal=True), fullgraph=True,
                      backend="aot_eager")
    out = f(q)
    assert torch.equal(out.detach(), want) and out.requires_grad
    with pytest.raises(NotImplementedError, match="^block_table: the backward"):
        out.sum().backward()


def test_compile_keeps_the_validation_errors():
    torch._dynamo.reset()
    q, kc, vc, table, cu_q, cu_k = paged_inputs(dtype=torch.float64)
    for kw, err, msg in ((dict(block_table=table.long()), TypeError, "^block_table: dtype must be int32"),
                         (dict(block_table=table[:3]), ValueError, "^block_table: expected shape"),
                         (dict(dropout_p=0.1), NotImplementedError, r"^dropout_p=0.1, block_table")):
        torch._dynamo.reset()
        args = dict(dict(q=q, kc=kc, vc=vc, table=table, cu_q=cu_q, cu_k=cu_k), **kw)
        table_ = args.pop("block_table", table)
        args["table"] = table_
        with pytest.raises(err, match=msg):
            torch.compile(lambda: _call(**args), backend="eager")()


def test_plain_cpu_varlen_runs_under_compile():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 2, 16, generator=g, dtype=torch.float64) for n in (10, 12, 12))
    cq = torch.tensor([0, 4, 10], dtype=torch.int32)
    ck = torch.tensor([0, 5, 12], dtype=torch.int32)
    f = lambda q, k, v: cuflash.flash_attn_varlen_func(q, k, v, cq, ck, 6, 7, causal=True)  # noqa: E731
    assert torch.equal(torch.compile(f, backend="aot_eager")(q, k, v), f(q, k, v))


def test_eager_cuda_path_untouched_by_the_op(monkeypatch):
    """Eager calls launch directly (no dispatcher); only tracing takes the op."""
    seen = []
    monkeypatch.setattr(varlen_torch, "attention_paged_traced", lambda *a, **k: seen.append(a))
    monkeypatch.setattr(varlen_torch, "forward_paged", lambda *a: ("direct", None))
    from cuflash import api

    q, kc, vc, table, cu_q, cu_k = paged_inputs()
    feats = api.check_features(api.describe("q", q[None]), 0.0, (-1, -1), 0.0, None, False, 4, 4)
    out, _ = varlen_torch.attention_paged(q, kc, vc, cu_q, cu_k, table, 5, 19, 0.25, feats)
    assert out == "direct" and not seen


def test_the_gpu_branch_traces_fullgraph(monkeypatch):
    """The branch CUDA tensors take (selection, then attention_paged's op) traces with
    fullgraph=True: CPU tensors sent down it (api._is_torch_cpu patched) reach the op's CPU
    impl and give the reference's answer."""
    from cuflash import api

    q, kc, vc, table, cu_q, cu_k = paged_inputs(dtype=torch.float64)
    kw = dict(causal=True, window_size=(3, -1), alibi_slopes=torch.rand(4))
    want = _call(q, kc, vc, table, cu_q, cu_k, **kw)
    monkeypatch.setattr(api, "_is_torch_cpu", lambda t: False)
    torch._dynamo.reset()
    got = torch.compile(lambda q: _call(q, kc, vc, table, cu_q, cu_k, **kw), fullgraph=True,
                        backend="aot_eager")(q)
    assert torch.equal(got, want)
