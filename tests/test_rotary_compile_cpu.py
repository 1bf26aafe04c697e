"""cuflash.layers.rotary under torch.compile without a GPU: the ops cuflash::rotary (registered
autograd) and cuflash::rotary_ (in place, the schema's mutation mark) checked by
torch.library.opcheck; torch.compile(fullgraph=True) of every rotary function, RotaryEmbedding
and MHA (backend aot_eager on float64 CPU tensors: the ops' CPU impls run the float64 reference)
equal to eager, forward and gradients."""
import math

import pytest

torch = pytest.importorskip("torch")

from cuflash.layers.rotary import (RotaryEmbedding, apply_rotary_emb, apply_rotary_emb_kv_,  # noqa: E402
                                   apply_rotary_emb_qkv_)
from cuflash.modules.mha import MHA  # noqa: E402
from cuflash.utils.generation import InferenceParams  # noqa: E402

F64 = dict(dtype=torch.float64)


def tables(rows, rotary_dim):
    angles = torch.rand(rows, rotary_dim // 2, **F64) * 2 * math.pi
    return angles.cos(), angles.sin()


def compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


def clones(args):
    return [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]


# (x, cos, sin, seqlen_offsets, seqlen_offset, cu_seqlens, max_seqlen, interleaved, conjugate)
def op_samples():
    cos, sin = tables(12, 8)
    x = torch.randn(2, 5, 3, 10, **F64)
    cu = torch.tensor([0, 2, 2, 7], dtype=torch.int32)
    return {
        "int_offset": (x, cos, sin, None, 3, None, -1, False, False),
        "tensor_offsets_gptj": (x, cos, sin, torch.tensor([0, 6]), 0, None, -1, True, True),
        "varlen": (torch.randn(7, 3, 10, **F64), cos, sin, torch.tensor([1, 0, 4]), 0, cu, 5, False, False),
        "strided_features": (torch.randn(2, 5, 3, 20, **F64)[..., ::2], cos, sin, None, 0, None, -1, False, False),
        "transposed": (torch.randn(2, 3, 5, 10, **F64).transpose(1, 2), cos, sin, None, 1, None, -1, True, False),
    }


@pytest.mark.parametrize("case", sorted(op_samples()))
def test_opcheck_rotary(case):
    args = op_samples()[case]
    torch.library.opcheck(torch.ops.cuflash.rotary.default, (args[0].clone().requires_grad_(),) + args[1:])
    # the in-place op: no autograd (rotary_traced calls it only where autograd does not record)
    torch.library.opcheck(torch.ops.cuflash.rotary_.default, (args[0].clone(),) + args[1:])


def test_fake_output_layout_is_the_real_one():
    for case, args in op_samples().items():
        real = torch.ops.cuflash.rotary(*args)
        with torch._subclasses.FakeTensorMode() as mode:
            fake = torch.ops.cuflash.rotary(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                              for a in args))
        assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype), case


def test_op_gradcheck():
    """The registered autograd: the backward turns by the opposite angles."""
    for case, args in op_samples().items():
        x = args[0].clone().requires_grad_()
        assert torch.autograd.gradcheck(lambda t: torch.ops.cuflash.rotary(t, *args[1:]), (x,)), case


@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
@pytest.mark.parametrize("kw", [{}, {"interleaved": True, "seqlen_offsets": 3}, {"seqlen_offsets": "tensor"},
                                {"varlen": True}], ids=["plain", "gptj_int_offset", "tensor_offsets", "varlen"])
def test_apply_rotary_emb_fullgraph(inplace, kw):
    kw = dict(kw)
    cos, sin = tables(12, 8)
    if kw.pop("varlen", False):
        x = torch.randn(9, 3, 10, **F64)
        kw.update(cu_seqlens=torch.tensor([0, 4, 9], dtype=torch.int32), max_seqlen=5,
                  seqlen_offsets=torch.tensor([2, 0]))
    else:
        x = torch.randn(2, 6, 3, 10, **F64)
        if kw.get("seqlen_offsets") == "tensor":
            kw["seqlen_offsets"] = torch.tensor([4, 1])

    def f(t, cos, sin):
        u = t * 1.0 if inplace else t    # in place on a non-leaf (autograd records the mutation)
        return apply_rotary_emb(u, cos, sin, inplace=inplace, **kw) * 2

    g = compiled(f)
    for grad in (False, True):
        a, b = x.clone().requires_grad_(grad), x.clone().requires_grad_(grad)
        got, want = g(a, cos, sin), f(b, cos, sin)
        assert torch.equal(got, want)
        if grad:
            dout = torch.randn_like(want)
            assert torch.equal(torch.autograd.grad(got, a, dout)[0], torch.autograd.grad(want, b, dout)[0])


def test_inplace_without_grad_mutates_the_input():
    cos, sin = tables(8, 8)
    x = torch.randn(2, 6, 3, 10, **F64)
    a, b = x.clone(), x.clone()
    with torch.no_grad():
        assert compiled(lambda t: apply_rotary_emb(t, cos, sin, inplace=True))(a) is not None
        apply_rotary_emb(b, cos, sin, inplace=True)
    assert torch.equal(a, b) and not torch.equal(a, x)


@pytest.mark.parametrize("form", ["qkv", "qkv_gqa", "qkv_xpos", "kv"])
def test_packed_inplace_fullgraph(form):
    cos, sin = tables(10, 8)
    cos_k, sin_k = tables(10, 8)
    offsets = torch.tensor([0, 3])
    x = {"qkv": torch.randn(2, 6, 3, 2, 12, **F64), "qkv_gqa": torch.randn(2, 6, 4 + 2 * 1, 12, **F64),
         "qkv_xpos": torch.randn(2, 6, 3, 2, 12, **F64), "kv": torch.randn(2, 6, 2, 2, 12, **F64)}[form]
    call = {"qkv": lambda t: apply_rotary_emb_qkv_(t, cos, sin, seqlen_offsets=2),
            "qkv_gqa": lambda t: apply_rotary_emb_qkv_(t, cos, sin, num_heads_q=4, seqlen_offsets=offsets),
            "qkv_xpos": lambda t: apply_rotary_emb_qkv_(t, cos, sin, cos_k, sin_k, interleaved=True),
            "kv": lambda t: apply_rotary_emb_kv_(t, cos, sin, seqlen_offsets=offsets)}[form]

    def f(t):
        u = t * 1.0
        return call(u) + 0.0

    g = compiled(f)
    with torch.no_grad():
        assert torch.equal(g(x), f(x))
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = g(a), f(b)
    assert torch.equal(got, want)
    dout = torch.randn_like(want)
    assert torch.equal(torch.autograd.grad(got, a, dout)[0], torch.autograd.grad(want, b, dout)[0])


@pytest.mark.parametrize("kw", [{}, {"interleaved": True}, {"scale_base": 64}], ids=["neox", "gptj", "xpos"])
def test_rotary_embedding_fullgraph(kw):
    emb = RotaryEmbedding(16, **kw)
    qkv = torch.randn(2, 7, 3, 4, 24, **F64)
    q, kv = torch.randn(2, 7, 4, 24, **F64), torch.randn(2, 7, 2, 4, 24, **F64)
    g = compiled(lambda *t, **k: emb(*(u * 1.0 for u in t), **k))
    for offset in (0, 3):
        assert torch.equal(g(qkv, seqlen_offset=offset), emb(qkv.clone(), seqlen_offset=offset))
        for got, want in zip(g(q, kv, seqlen_offset=offset), emb(q.clone(), kv.clone(), seqlen_offset=offset)):
            assert torch.equal(got, want)
    offsets = torch.tensor([2, 5])
    assert torch.equal(g(qkv, seqlen_offset=offsets, max_seqlen=12),
                       emb(qkv.clone(), seqlen_offset=offsets, max_seqlen=12))


MHA_CASES = {
    "plain": dict(),
    "causal_rotary": dict(causal=True, rotary_emb_dim=16),
    "gqa_partial_rotary_gptj": dict(num_heads_kv=2, causal=True, rotary_emb_dim=8, rotary_emb_interleaved=True),
    "mqa_xpos": dict(num_heads_kv=1, causal=True, rotary_emb_dim=16, rotary_emb_scale_base=64),
}


@pytest.mark.parametrize("case", sorted(MHA_CASES))
def test_mha_fullgraph(case):
    """MHA's training forward and backward, compiled whole (flash-attn's MHA compiles there too)."""
    torch.manual_seed(0)
    m = MHA(64, 4, use_flash_attn=True, **MHA_CASES[case], **F64)
    g = compiled(m)
    for _ in range(2):   # the second call: the rotary cache made (its staleness test traced)
        x = torch.randn(2, 11, 64, requires_grad=True, **F64)
        got, want = g(x), m(x)
        assert torch.equal(got, want)
        params = [x, m.Wqkv.weight]
        for a, b in zip(torch.autograd.grad(got.sum(), params), torch.autograd.grad(want.sum(), params)):
            assert torch.allclose(a, b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("rotary", [16, 0], ids=["rotary16_fused", "no_rotary"])
def test_mha_decoding_fullgraph(rotary):
    """Prefill then one-token steps with InferenceParams (flash_attn_with_kvcache's op)."""
    m = MHA(64, 4, causal=True, layer_idx=0, use_flash_attn=True, rotary_emb_dim=rotary, **F64)
    g = compiled(m)
    x = torch.randn(2, 8, 64, **F64)
    p1, p2 = InferenceParams(max_seqlen=16, max_batch_size=2), InferenceParams(max_seqlen=16, max_batch_size=2)
    with torch.no_grad():
        assert torch.equal(g(x[:, :5], inference_params=p1), m(x[:, :5], inference_params=p2))
        for t in range(5, 8):
            p1.seqlen_offset = p2.seqlen_offset = t
            assert torch.equal(g(x[:, t:t + 1], inference_params=p1), m(x[:, t:t + 1], inference_params=p2)), t
    assert torch.equal(p1.key_value_memory_dict[0][:, :8], p2.key_value_memory_dict[0][:, :8])  # the rows written


def test_traced_call_validates_naming_the_argument():
    cos, sin = tables(8, 8)
    x = torch.randn(2, 8, 3, 10, **F64)
    with pytest.raises(Exception, match="seqlen_offsets"):
        compiled(lambda t: apply_rotary_emb(t, cos, sin, seqlen_offsets=1))(x)   # 1 + 8 rows > 8
    with pytest.raises(Exception, match="rotary_dim"):
        compiled(lambda t: apply_rotary_emb(t, *tables(8, 22)))(x)
