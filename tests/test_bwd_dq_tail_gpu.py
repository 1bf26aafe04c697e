"""sm90_bwd's dq_tail (kDqTail, sm90_bwd_dq_tail: the dQ convert launched as a programmatic dependent of
the dynamic main kernel, converting the (head, batch) pairs whose K/V tiles are done while the grid's last
tiles run), forced with bwd_config=, on an H100 / H200.

Gradients within 3x the error of plain low-precision attention with the same features, against float64
(test_features_gpu.feature_attention), fresh random inputs, outputs NaN-poisoned before each launch; odd
lengths, s_q != s_k both ways, MHA / GQA / MQA, window bands (both bounds, one side, narrower than a Q block)
and the plain causal / full call; each plan called twice (the kernel resets its counters for the next launch),
and a call shape with more pairs than SMs' worth of tiles (the convert CTAs wait for pairs still running).

Compiles: 8 backward kernels (d128 bf16, window / plain x causal / not x forms 1 / 2) and their forwards
(tests/dq_tail_precompile.py --tests).

    timeout 200 python -m pytest -q tests/test_bwd_dq_tail_gpu.py
"""
import pytest

import cuflash
from cuflash import registry
from cuflash.problem import Problem

from test_features_gpu import check_close, feature_attention, grads, inputs  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

FAM = registry.get("sm90_bwd")
# (seqlen_q, seqlen_k, heads): odd lengths, s_q != s_k both ways, GQA / MQA
SHAPES = [(113, 1023, "mqa"), (1023, 113, "gqa"), (1023, 1023, "gqa"), (2049, 2049, "mha")]
WINDOWS = [(64, 64), (200, -1), (-1, 37), (17, 5), (300, 0)]


def dq_tail_config(causal, window, form=1):
    """The heuristic's backward of the call class (8k, batch 2 x 16 heads, d128 bf16: the dynamic
    scheduler), with dq_tail `form`; selection applies the call's own flags (for_problem)."""
    import torch

    p = Problem("bwd", "bf16", 2, 8192, 8192, 16, 16, 128, causal)
    if window:
        p = p.replace(features=("window",), window=(1024, 0) if causal else (1024, 1024))
    cc = torch.cuda.get_device_capability()
    why = FAM.supports(cc, p)
    if why:
        pytest.skip(why)
    cfg = FAM.for_problem(FAM.heuristic(p, cc), p).replace(dq_tail=form)
    assert not cfg.problems(), cfg.problems()
    return cfg


def check(cfg, causal, window, shapes, batch=2):
    import torch

    for sq, sk, heads in shapes:
        q, k, v, dout = inputs(batch, sq, sk, heads, 128, "bf16")
        kw = dict(causal=causal, window_size=window)
        scale = 128 ** -0.5
        ref = grads(lambda q, k, v: feature_attention(q, k, v, scale, causal, window, 0.0, None,
                                                      torch.float64)[0], q, k, v, dout.double())
        low = grads(lambda q, k, v: feature_attention(q, k, v, scale, causal, window, 0.0, None,
                                                      q.dtype)[0], q, k, v, dout)
        for call in range(2):   # the second call: the counters the first one set back to 0
            ours = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, bwd_config=cfg, **kw), q, k, v, dout)
            what = f"{cfg.name} window={window} {sq}x{sk} {heads} call {call}"
            for name, a, r, b in zip(("dq", "dk", "dv"), ours, ref, low):
                check_close(a, r, b, 3, f"{what} {name}")


@pytest.mark.parametrize("form", [1, 2])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_window(causal, form):
    cfg = dq_tail_config(causal, True, form)
    for window in WINDOWS:
        if (causal and window[0] < 0) or (not causal and window[1] == 0):
            continue   # (-1, 0) is plain causal; (x, 0) may be too (x past every key): the other mask's kernel
        check(cfg, causal, (window[0], 0) if causal else window, SHAPES[:3])
    check(cfg, causal, (1024, 0) if causal else (1024, 1024), SHAPES[3:], batch=3)


@pytest.mark.parametrize("form", [1, 2])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_plain(causal, form):
    check(dq_tail_config(causal, False, form), causal, (-1, -1), SHAPES)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_window_cuda_graph(causal):
    """The window backward with dq_tail 2 (the window default's form: a programmatic dependent launch)
    captured in a torch CUDA graph and replayed gives the eager call's gradients bit for bit, replay after
    replay."""
    import torch

    cfg = dq_tail_config(causal, True, 2)
    window = (300, 0) if causal else (200, 64)
    q, k, v, dout = inputs(2, 1023, 1023, "gqa", 128, "bf16")
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))

    def step():
        out = cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window, bwd_config=cfg)
        return torch.autograd.grad(out, (q, k, v), dout)

    want = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()   # warm on the side stream: plans built outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step()
    for _ in range(3):
        for g in got:
            g.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            assert torch.equal(a, b), f"window={window} {name}: CUDA-graph replay differs from the eager call"


@pytest.mark.parametrize("hdim", [80, 96, 111])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_window_padded_head_dims(causal, hdim):
    """WINDOW_DQ_TAIL keys on the kernel head dim, so real head dims 72..128 run the d128 kernel with dq_tail:
    the convert at a padded head dim (the caller's columns only), GQA and MQA, within the 3x rule. The
    default route (the heuristic takes dq_tail 2 at these shapes; checked on the CPU in test_bwd_dq_tail_cpu)."""
    import torch

    window = (300, 0) if causal else (200, 64)
    scale = hdim ** -0.5
    for sq, sk, heads in [(1023, 1023, "gqa"), (113, 1023, "mqa")]:
        q, k, v, dout = inputs(2, sq, sk, heads, hdim, "bf16")
        ref = grads(lambda q, k, v: feature_attention(q, k, v, scale, causal, window, 0.0, None,
                                                      torch.float64)[0], q, k, v, dout.double())
        low = grads(lambda q, k, v: feature_attention(q, k, v, scale, causal, window, 0.0, None,
                                                      q.dtype)[0], q, k, v, dout)
        ours = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window),
                     q, k, v, dout)
        for name, a, r, b in zip(("dq", "dk", "dv"), ours, ref, low):
            assert a.shape == r.shape, f"d{hdim} {name}: shape {tuple(a.shape)}"
            check_close(a, r, b, 3, f"d{hdim} window={window} {sq}x{sk} {heads} {name}")
