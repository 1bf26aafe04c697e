"""cuflash.modules.mha.MHA without a GPU: float64 torch CPU tensors (cuflash's attention runs the
float64 reference) against a plain attention computed from the module's weights
(tests/mha_reference.py), forward and gradients; flash-attn's constructor and forward signatures,
state-dict keys, the torch path (use_flash_attn=False), varlen, key_padding_mask, decoding with
InferenceParams, and the arguments cuflash refuses."""
import inspect

import pytest

torch = pytest.importorskip("torch")

import cuflash  # noqa: E402
from cuflash.modules.mha import MHA, get_alibi_slopes  # noqa: E402
from cuflash.utils.generation import InferenceParams  # noqa: E402

from mha_reference import alibi_slopes, reference_mha  # noqa: E402

F64 = dict(dtype=torch.float64)
TOL = dict(atol=2e-6, rtol=1e-5)   # the rotary tables are computed in fp32, as flash-attn's


def grads(out, params):
    return torch.autograd.grad(out, params, torch.ones_like(out))


CASES = {
    "plain": dict(),
    "causal_rotary": dict(causal=True, rotary_emb_dim=16),
    "gqa_partial_rotary_gptj": dict(num_heads_kv=2, causal=True, rotary_emb_dim=8, rotary_emb_interleaved=True),
    "mqa_xpos": dict(num_heads_kv=1, causal=True, rotary_emb_dim=16, rotary_emb_scale_base=64),
    "no_bias_scale": dict(qkv_proj_bias=False, out_proj_bias=False, softmax_scale=0.3),
}


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "torch"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_self_attention_matches_reference(case, flash):
    torch.manual_seed(0)
    m = MHA(64, 4, use_flash_attn=flash, **CASES[case], **F64)
    x = torch.randn(2, 11, 64, requires_grad=True, **F64)
    out = m(x)
    ref = reference_mha(m, x)
    assert torch.allclose(out, ref, **TOL)
    params = [x, m.Wqkv.weight, m.out_proj.weight]
    for g, r in zip(grads(out, params), grads(ref, params)):
        assert torch.allclose(g, r, **TOL)


def test_alibi_and_window():
    m = MHA(48, 6, num_heads_kv=3, causal=True, use_alibi=True, window_size=(4, 0), use_flash_attn=True, **F64)
    assert m.inner_attn.alibi_slopes.tolist() == pytest.approx(alibi_slopes(6))
    x = torch.randn(2, 13, 48, **F64)
    assert torch.allclose(m(x), reference_mha(m, x, window=(4, 0), alibi=True), **TOL)


def test_get_alibi_slopes():
    for n in (1, 2, 6, 8, 12, 24, 32):
        assert get_alibi_slopes(n) == pytest.approx(alibi_slopes(n))


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "torch"])
def test_cross_attention_and_mixer_subset(flash):
    m = MHA(32, 4, num_heads_kv=2, cross_attn=True, use_flash_attn=flash, **F64)
    x, x_kv = torch.randn(2, 5, 32, **F64), torch.randn(2, 9, 32, **F64)
    assert torch.allclose(m(x, x_kv=x_kv), reference_mha(m, x, x_kv=x_kv), **TOL)
    subset = torch.tensor([0, 3])
    want = reference_mha(m, x, x_kv=x_kv, mixer_subset=subset)
    assert torch.allclose(m(x, x_kv=x_kv, mixer_subset=subset), want, **TOL)
    assert list(m.state_dict()) == ["Wq.weight", "Wq.bias", "Wkv.weight", "Wkv.bias", "out_proj.weight",
                                    "out_proj.bias"]


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "torch"])
@pytest.mark.parametrize("kw", [dict(causal=True, rotary_emb_dim=8), dict(num_heads_kv=2)], ids=["mha", "gqa"])
def test_key_padding_mask(flash, kw):
    """Kept keys first in each row: the kept query rows equal attention over the kept keys only
    (flash: unpad / varlen / pad; torch: -10000 added to the masked scores)."""
    m = MHA(32, 4, use_flash_attn=flash, **kw, **F64)
    x = torch.randn(3, 7, 32, requires_grad=True, **F64)
    mask = torch.arange(7)[None] < torch.tensor([7, 4, 1])[:, None]
    out = m(x, key_padding_mask=mask)
    ref = reference_mha(m, x, key_padding_mask=mask)
    assert torch.allclose(out[mask], ref[mask], **TOL)
    (g,) = grads(out[mask], [x])
    (r,) = grads(ref[mask], [x])
    assert torch.allclose(g, r, **TOL)
    if flash:  # padded query rows: zero context, so the output projection's bias alone
        assert torch.allclose(out[~mask], m.out_proj.bias.expand_as(out[~mask]))


def test_cross_attention_key_padding_mask_flash():
    m = MHA(32, 4, cross_attn=True, use_flash_attn=True, **F64)
    x, x_kv = torch.randn(2, 5, 32, **F64), torch.randn(2, 6, 32, **F64)
    mask = torch.arange(6)[None] < torch.tensor([6, 2])[:, None]
    assert torch.allclose(m(x, x_kv=x_kv, key_padding_mask=mask),
                          reference_mha(m, x, x_kv=x_kv, key_padding_mask=mask), **TOL)


@pytest.mark.parametrize("kw", [dict(causal=True, rotary_emb_dim=16), dict(num_heads_kv=2, causal=True,
                                                                             rotary_emb_dim=8)], ids=["mha", "gqa"])
def test_varlen_equals_per_sequence(kw):
    """x packed (total, embed_dim) with cu_seqlens: each sequence as its own batch of one, rotary
    restarting at position 0 per sequence."""
    m = MHA(64, 4, use_flash_attn=True, **kw, **F64)
    lens = [3, 1, 8]
    x = torch.randn(sum(lens), 64, requires_grad=True, **F64)
    cu = torch.tensor([0, 3, 4, 12], dtype=torch.int32)
    out = m(x, cu_seqlens=cu, max_seqlen=8)
    assert out.shape == (12, 64)
    for b in range(3):
        s, e = int(cu[b]), int(cu[b + 1])
        assert torch.allclose(out[s:e], reference_mha(m, x[s:e][None])[0], **TOL)
    (g,) = grads(out, [x])
    (r,) = grads(torch.cat([reference_mha(m, x[int(cu[b]):int(cu[b + 1])][None])[0] for b in range(3)]), [x])
    assert torch.allclose(g, r, **TOL)


def test_return_residual_checkpointing_and_dropout_eval():
    m = MHA(32, 2, causal=True, return_residual=True, checkpointing=True, dropout=0.3, use_flash_attn=True, **F64)
    m.eval()                      # no attention dropout outside training
    x = torch.randn(2, 6, 32, requires_grad=True, **F64)
    out, residual = m(x)
    assert residual is x and torch.allclose(out, reference_mha(m, x), **TOL)
    (g,) = grads(out, [x])
    (r,) = grads(reference_mha(m, x), [x])
    assert torch.allclose(g, r, **TOL)


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "torch"])
@pytest.mark.parametrize("kw", [dict(rotary_emb_dim=16), dict(rotary_emb_dim=8, num_heads_kv=2), dict(num_heads_kv=1)],
                         ids=["rotary16_fused", "rotary8_gqa", "mqa_no_rotary"])
def test_decoding_with_inference_params(flash, kw):
    """A prompt of 5 tokens, then 3 tokens one at a time through the KV cache (rotary 16: the
    fused flash_attn_with_kvcache path), each output equal to the causal forward over the whole
    sequence at that row."""
    m = MHA(64, 4, causal=True, layer_idx=0, use_flash_attn=flash, **kw, **F64)
    x = torch.randn(2, 8, 64, **F64)
    full = reference_mha(m, x)
    params = InferenceParams(max_seqlen=16, max_batch_size=2)
    with torch.no_grad():
        out = m(x[:, :5], inference_params=params)
        assert torch.allclose(out, full[:, :5], **TOL)
        params.seqlen_offset = 5
        for t in range(5, 8):
            out = m(x[:, t:t + 1], inference_params=params)
            assert torch.allclose(out, full[:, t:t + 1], **TOL), t
            params.seqlen_offset += 1
    assert params.key_value_memory_dict[0].shape == (2, 16, 2, m.num_heads_kv, 16)
    assert m.allocate_inference_cache(3, 10).shape == (3, 10, 2, m.num_heads_kv, 16)


def test_decoding_with_lengths_per_sample():
    """Rows at different lengths (lengths_per_sample): each row's new token at its own position."""
    m = MHA(64, 4, causal=True, layer_idx=3, rotary_emb_dim=16, use_flash_attn=True, **F64)
    x = torch.randn(2, 6, 64, **F64)
    params = InferenceParams(max_seqlen=8, max_batch_size=2)
    with torch.no_grad():
        m(x[:, :5], inference_params=params)           # both rows' first 5 tokens in the cache
        params.seqlen_offset = 5
        params.lengths_per_sample = torch.tensor([5, 3], dtype=torch.int32)
        out = m(x[:, 5:6], inference_params=params)
    row0 = reference_mha(m, x[:1])[0, 5]
    row1 = reference_mha(m, torch.cat([x[1:, :3], x[1:, 5:6]], dim=1))[0, 3]
    assert torch.allclose(out[0, 0], row0, **TOL) and torch.allclose(out[1, 0], row1, **TOL)


def test_fused_bias_fc_is_fused_dense():
    """fused_bias_fc: the projections are cuflash.ops.fused_dense.FusedDense (nn.Linear's keys), the
    same output and gradients as without."""
    from cuflash.ops.fused_dense import FusedDense

    torch.manual_seed(0)
    for rr in (False, True):
        a = MHA(32, 2, return_residual=rr, dtype=torch.float64)
        b = MHA(32, 2, return_residual=rr, fused_bias_fc=True, dtype=torch.float64)
        b.load_state_dict(a.state_dict())
        assert isinstance(b.Wqkv, FusedDense) and isinstance(b.out_proj, FusedDense)
        assert b.Wqkv.return_residual == rr
        x = torch.randn(2, 5, 32, dtype=torch.float64, requires_grad=True)
        x2 = x.detach().clone().requires_grad_(True)
        ya, yb = a(x), b(x2)
        if rr:
            assert yb[1] is x2
            ya, yb = ya[0] + ya[1], yb[0] + yb[1]
        assert torch.allclose(ya, yb, atol=1e-12)
        ya.sum().backward()
        yb.sum().backward()
        assert torch.allclose(x.grad, x2.grad, atol=1e-12)
    c = MHA(32, 2, cross_attn=True, fused_bias_fc=True)
    assert isinstance(c.Wq, FusedDense) and isinstance(c.Wkv, FusedDense)


def test_refused_arguments_name_themselves():
    with pytest.raises(cuflash.UnsupportedFeature, match="dwconv"):
        MHA(32, 2, dwconv=True)
    with pytest.raises(cuflash.UnsupportedFeature, match="cross_attn"):
        MHA(32, 2, cross_attn=True, rotary_emb_dim=8)
    with pytest.raises(ValueError, match="use_alibi"):
        MHA(32, 2, use_alibi=True)
    with pytest.raises(ValueError, match="window_size"):
        MHA(32, 2, window_size=(8, 0))
    with pytest.raises(ValueError, match="num_heads_kv"):
        MHA(32, 4, num_heads_kv=3)
    with pytest.raises(ValueError, match="embed_dim"):
        MHA(30, 4)
    m = MHA(32, 2, use_flash_attn=False)
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(torch.randn(4, 32), cu_seqlens=torch.tensor([0, 4], dtype=torch.int32), max_seqlen=4)
    with pytest.raises(ValueError, match="max_seqlen"):
        MHA(32, 2, use_flash_attn=True)(torch.randn(4, 32), cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="layer_idx"):
        MHA(32, 2, use_flash_attn=True)(torch.randn(1, 2, 32), inference_params=InferenceParams(4, 1))


def test_flash_attn_checkpoint_keys_load():
    """A state dict with flash-attn's keys (Wqkv, out_proj) loads strictly into either path."""
    src = MHA(64, 4, num_heads_kv=2, rotary_emb_dim=16, use_flash_attn=True)
    state = {k: v.clone() for k, v in src.state_dict().items()}
    assert sorted(state) == ["Wqkv.bias", "Wqkv.weight", "out_proj.bias", "out_proj.weight"]
    assert state["Wqkv.weight"].shape == (16 * (4 + 2 * 2), 64)
    MHA(64, 4, num_heads_kv=2, rotary_emb_dim=16, use_flash_attn=False).load_state_dict(state, strict=True)


# ---------------------------------------------------------------------------------------
# flash-attn 2.8's signatures (flash_attn/modules/mha.py, flash_attn/layers/rotary.py)

MHA_INIT = ["embed_dim", "num_heads", ("num_heads_kv", None), ("cross_attn", False), ("qkv_proj_bias", True),
            ("out_proj_bias", True), ("dropout", 0.0), ("softmax_scale", None), ("causal", False),
            ("layer_idx", None), ("dwconv", False), ("rotary_emb_dim", 0), ("rotary_emb_base", 10000.0),
            ("rotary_emb_scale_base", None), ("rotary_emb_interleaved", False), ("use_alibi", False),
            ("window_size", (-1, -1)), ("fused_bias_fc", False), ("use_flash_attn", False),
            ("return_residual", False), ("checkpointing", False), ("device", None), ("dtype", None)]
MHA_FORWARD = ["x", ("x_kv", None), ("key_padding_mask", None), ("cu_seqlens", None), ("max_seqlen", None),
               ("mixer_subset", None), ("inference_params", None)]
ROTARY = {
    "apply_rotary_emb": ["x", "cos", "sin", ("interleaved", False), ("inplace", False), ("seqlen_offsets", 0),
                         ("cu_seqlens", None), ("max_seqlen", None)],
    "apply_rotary_emb_qkv_": ["qkv", "cos", "sin", ("cos_k", None), ("sin_k", None), ("interleaved", False),
                              ("seqlen_offsets", 0), ("num_heads_q", None)],
    "apply_rotary_emb_kv_": ["kv", "cos", "sin", ("interleaved", False), ("seqlen_offsets", 0)],
    "apply_rotary_emb_torch": ["x", "cos", "sin", ("interleaved", False)],
    "rotate_half": ["x", ("interleaved", False)],
}
ROTARY_INIT = ["dim", ("base", 10000.0), ("interleaved", False), ("scale_base", None), ("pos_idx_in_fp32", True),
               ("device", None)]
ROTARY_FORWARD = ["qkv", ("kv", None), ("seqlen_offset", 0), ("max_seqlen", None), ("num_heads_q", None)]


def _params(fn, skip_self=True):
    ps = [p for p in inspect.signature(fn).parameters.values() if p.kind == p.POSITIONAL_OR_KEYWORD]
    return [(p.name, p.default) for p in ps[1 if skip_self else 0:]]


def _want(spec):
    return [(w, inspect.Parameter.empty) if isinstance(w, str) else w for w in spec]


def test_mha_signatures():
    assert _params(MHA.__init__) == _want(MHA_INIT)
    extra = [(p.name, p.default) for p in inspect.signature(MHA.__init__).parameters.values() if p.kind == p.KEYWORD_ONLY]
    assert extra == [("alibi_slope_scale", 1.0), ("alibi_train_seqlen", None)]      # cuflash's, keyword-only
    assert _params(MHA.forward) == _want(MHA_FORWARD)
    assert any(p.kind == p.VAR_KEYWORD for p in inspect.signature(MHA.forward).parameters.values())


def test_rotary_signatures():
    from cuflash.layers import rotary

    for name, spec in ROTARY.items():
        assert _params(getattr(rotary, name), skip_self=False) == _want(spec), name
    assert _params(rotary.RotaryEmbedding.__init__) == _want(ROTARY_INIT)
    assert _params(rotary.RotaryEmbedding.forward) == _want(ROTARY_FORWARD)
    assert rotary.apply_rotary_emb_func is rotary.apply_rotary_emb


def test_inference_params_fields():
    p = InferenceParams(max_seqlen=8, max_batch_size=2)
    assert (p.seqlen_offset, p.batch_size_offset, p.key_value_memory_dict, p.lengths_per_sample) == (0, 0, {}, None)
    p.seqlen_offset, p.lengths_per_sample = 3, torch.tensor([3, 1])
    p.reset(16, 4)
    assert (p.max_seqlen, p.max_batch_size, p.seqlen_offset, p.lengths_per_sample.tolist()) == (16, 4, 0, [0, 0])
