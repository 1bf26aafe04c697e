"""cuflash.layers.rotary and MHA under torch.compile on the GPU: the ops cuflash::rotary /
cuflash::rotary_ compiled with the inductor backend equal to eager bit for bit (forward,
gradient, the inputs the in-place forms mutate), captured in CUDA graphs (by hand and by
mode="reduce-overhead"), and MHA compiled with fullgraph=True (training forward and backward,
ALiBi + window, varlen, decoding with InferenceParams).

Compile count: the rotary kernel (bf16, two layouts), MHA's attention kernels at head dim 64 (as
tests/test_mha_gpu.py), and inductor's own (a few graphs).
"""
import math

import pytest

torch = pytest.importorskip("torch")

from cuflash.layers.rotary import (RotaryEmbedding, apply_rotary_emb, apply_rotary_emb_kv_,  # noqa: E402
                                   apply_rotary_emb_qkv_)
from cuflash.modules.mha import MHA  # noqa: E402
from cuflash.utils.generation import InferenceParams  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

BF16 = dict(device="cuda", dtype=torch.bfloat16)


def tables(rows, rotary_dim):
    angles = torch.rand(rows, rotary_dim // 2, device="cuda", dtype=torch.float64) * 2 * math.pi
    return angles.cos().bfloat16(), angles.sin().bfloat16()


def compiled(fn, backend="inductor", **kw):
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True, **kw)


def test_opcheck_on_cuda():
    cos, sin = tables(40, 32)
    x = torch.randn(2, 33, 3, 64, **BF16)
    offsets = torch.tensor([0, 7], device="cuda")
    torch.library.opcheck(torch.ops.cuflash.rotary.default,
                          (x.clone().requires_grad_(), cos, sin, offsets, 0, None, -1, True, False))
    torch.library.opcheck(torch.ops.cuflash.rotary_.default, (x.clone(), cos, sin, None, 4, None, -1, False, True))


def test_inductor_equals_eager_forward_and_gradient():
    cos, sin = tables(300, 64)
    offsets = torch.tensor([0, 17, 200], device="cuda", dtype=torch.int32)

    def f(x, w):
        y = apply_rotary_emb(x * w, cos, sin, seqlen_offsets=offsets)
        return apply_rotary_emb(y, cos, sin, interleaved=True, seqlen_offsets=5) + 1.0

    g = compiled(f)
    w = torch.tensor(1.0, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        x = torch.randn(3, 77, 4, 96, requires_grad=True, **BF16)
        got, want = g(x, w), f(x, w)
        assert torch.equal(got, want)
        dout = torch.randn_like(want)
        assert torch.equal(torch.autograd.grad(got, x, dout)[0], torch.autograd.grad(want, x, dout)[0])


def test_inductor_inplace_forms_mutate_as_eager():
    cos, sin = tables(128, 64)
    emb = RotaryEmbedding(64, device="cuda")

    def f(qkv, kv, q, x):
        apply_rotary_emb_qkv_(qkv, cos, sin, seqlen_offsets=3)
        apply_rotary_emb_kv_(kv, cos, sin)
        apply_rotary_emb(x, cos, sin, inplace=True, interleaved=True)
        return emb(q, kv.clone(), seqlen_offset=7)

    g = compiled(f)
    args = (torch.randn(2, 64, 3, 4, 128, **BF16), torch.randn(2, 64, 2, 2, 128, **BF16),
            torch.randn(2, 64, 4, 128, **BF16), torch.randn(2, 64, 4, 128, **BF16))
    mine, theirs = [a.clone() for a in args], [a.clone() for a in args]
    with torch.no_grad():
        got, want = g(*mine), f(*theirs)
    for a, b in zip(got + tuple(mine), want + tuple(theirs)):
        assert torch.equal(a, b)
    assert not torch.equal(mine[0], args[0])


def test_cuda_graph_capture_of_the_ops_and_reduce_overhead():
    cos, sin = tables(64, 64)
    x = torch.randn(2, 64, 4, 64, **BF16)
    y = x.clone()
    torch.ops.cuflash.rotary(x, cos, sin, None, 0, None, -1, False, False)   # plans before the capture
    torch.ops.cuflash.rotary_(y, cos, sin, None, 0, None, -1, False, False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.cuflash.rotary(x, cos, sin, None, 0, None, -1, False, False)
        torch.ops.cuflash.rotary_(y, cos, sin, None, 0, None, -1, False, False)
    x.copy_(torch.randn_like(x))
    y.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, apply_rotary_emb(x, cos, sin)) and torch.equal(y, out)

    g = compiled(lambda t: apply_rotary_emb(t, cos, sin, seqlen_offsets=0) * 2, mode="reduce-overhead")
    for _ in range(4):   # cudagraph trees record on the second call and replay after
        t = torch.randn(2, 64, 4, 64, **BF16)
        assert torch.equal(g(t).clone(), apply_rotary_emb(t, cos, sin) * 2)


MHA_CASES = {
    "causal_rotary": dict(causal=True, rotary_emb_dim=64),
    "gqa_rotary_partial_gptj": dict(num_heads_kv=2, causal=True, rotary_emb_dim=32, rotary_emb_interleaved=True),
    "alibi_window": dict(causal=True, use_alibi=True, window_size=(64, 0)),
    "xpos": dict(causal=True, rotary_emb_dim=64, rotary_emb_scale_base=512),
}


@pytest.mark.parametrize("case", sorted(MHA_CASES))
def test_mha_fullgraph_aot_eager_equals_eager(case):
    """The compiled graph runs the same kernels: forward and gradients bit for bit."""
    torch.manual_seed(0)
    m = MHA(512, 8, use_flash_attn=True, **MHA_CASES[case], **BF16)
    g = compiled(m, backend="aot_eager")
    x = torch.randn(2, 200, 512, requires_grad=True, **BF16)
    got, want = g(x), m(x)
    assert torch.equal(got, want)
    dout = torch.randn_like(want)
    params = [x, m.Wqkv.weight]
    for a, b in zip(torch.autograd.grad(got, params, dout), torch.autograd.grad(want, params, dout)):
        assert torch.equal(a, b)


def test_mha_fullgraph_inductor():
    """Inductor fuses the projections' epilogues: within a few bf16 units of eager."""
    torch.manual_seed(1)
    m = MHA(512, 8, num_heads_kv=2, causal=True, rotary_emb_dim=64, use_flash_attn=True, **BF16)
    g = compiled(m)
    x = torch.randn(2, 200, 512, requires_grad=True, **BF16)
    got, want = g(x), m(x)
    scale = want.abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= 4 * 2 ** -8 * scale
    dout = torch.randn_like(want)
    (a,), (b,) = torch.autograd.grad(got, [x], dout), torch.autograd.grad(want, [x], dout)
    assert (a.float() - b.float()).abs().max().item() <= 4 * 2 ** -8 * b.abs().max().item()


def test_mha_varlen_and_decoding_fullgraph():
    torch.manual_seed(2)
    m = MHA(512, 8, num_heads_kv=2, causal=True, rotary_emb_dim=32, layer_idx=0, use_flash_attn=True, **BF16)
    cu = torch.tensor([0, 30, 31, 130], device="cuda", dtype=torch.int32)
    x = torch.randn(130, 512, **BF16)
    g = compiled(m, backend="aot_eager")
    assert torch.equal(g(x, cu_seqlens=cu, max_seqlen=100), m(x, cu_seqlens=cu, max_seqlen=100))
    for rotary in (64, 24):   # 64: the fused path (the decode kernel turns); 24: the rotary kernel first
        m = MHA(512, 8, causal=True, layer_idx=0, use_flash_attn=True, rotary_emb_dim=rotary, **BF16)
        g = compiled(m, backend="aot_eager")
        x = torch.randn(2, 40, 512, **BF16)
        p1, p2 = InferenceParams(max_seqlen=64, max_batch_size=2), InferenceParams(max_seqlen=64, max_batch_size=2)
        with torch.no_grad():
            assert torch.equal(g(x[:, :36], inference_params=p1), m(x[:, :36], inference_params=p2))
            for t in range(36, 40):
                p1.seqlen_offset = p2.seqlen_offset = t
                assert torch.equal(g(x[:, t:t + 1], inference_params=p1), m(x[:, t:t + 1], inference_params=p2))
        assert torch.equal(p1.key_value_memory_dict[0][:, :40], p2.key_value_memory_dict[0][:, :40])
