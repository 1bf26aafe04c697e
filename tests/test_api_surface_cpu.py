"""cuflash's flash-attn 2.8 surface: every public name of flash_attn (and its bert_padding
helpers) exists with flash-attn's positional parameters, in order, with its defaults (cuflash's
extras are keyword-only, after them); the two padding helpers added last behave as flash-attn
documents them."""
import inspect

import pytest

import cuflash

torch = pytest.importorskip("torch")

# flash-attn 2.8's positional parameters and defaults (flash_attn/flash_attn_interface.py)
COMMON = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
          ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
          ("deterministic", False), ("return_attn_probs", False)]
SIGNATURES = {
    "flash_attn_func": ["q", "k", "v"] + COMMON,
    "flash_attn_qkvpacked_func": ["qkv"] + COMMON,
    "flash_attn_kvpacked_func": ["q", "kv"] + COMMON,
    "flash_attn_varlen_func": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                               "max_seqlen_k"] + COMMON + [("block_table", None)],
    "flash_attn_varlen_qkvpacked_func": ["qkv", "cu_seqlens", "max_seqlen"] + COMMON,
    "flash_attn_varlen_kvpacked_func": ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                        "max_seqlen_k"] + COMMON,
    "flash_attn_with_kvcache": ["q", "k_cache", "v_cache", ("k", None), ("v", None),
                                ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None),
                                ("cache_batch_idx", None), ("cache_leftpad", None),
                                ("block_table", None), ("softmax_scale", None), ("causal", False),
                                ("window_size", (-1, -1)), ("softcap", 0.0),
                                ("rotary_interleaved", True), ("alibi_slopes", None),
                                ("num_splits", 0), ("return_softmax_lse", False)],
}
PADDING = {"index_first_axis": None, "index_put_first_axis": None,
           "index_first_axis_residual": None,
           "unpad_input": ["hidden_states", "attention_mask", ("unused_mask", None)],
           "unpad_input_for_concatenated_sequences": ["hidden_states", "attention_mask_in_length"],
           "pad_input": ["hidden_states", "indices", "batch", "seqlen"]}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_positional_parameters_match_flash_attn(name):
    params = list(inspect.signature(getattr(cuflash, name)).parameters.values())
    positional = [p for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    want = [(w, inspect.Parameter.empty) if isinstance(w, str) else w for w in SIGNATURES[name]]
    assert [(p.name, p.default) for p in positional] == want
    extras = params[len(positional):]
    assert all(p.kind == p.KEYWORD_ONLY for p in extras), "cuflash's extras are keyword-only"


@pytest.mark.parametrize("name", sorted(PADDING))
def test_padding_helpers_are_exported(name):
    fn = getattr(cuflash, name)
    assert name in cuflash.__all__ and callable(fn)
    if PADDING[name] is not None:
        got = [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]
        want = [(w, inspect.Parameter.empty) if isinstance(w, str) else w for w in PADDING[name]]
        assert got == want


def test_unpad_input_for_concatenated_sequences():
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0],
                            [0, 0, 0, 0, 0, 0]])
    x = torch.arange(4 * 6 * 2, dtype=torch.float64).reshape(4, 6, 2).requires_grad_()
    x_unpad, indices, cu, max_len = cuflash.unpad_input_for_concatenated_sequences(x, lengths)
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 5, 8, 10, 16] and max_len == 6
    assert torch.equal(x_unpad, x.reshape(-1, 2)[indices])
    x_unpad.sum().backward()
    grad = torch.zeros(24)
    grad[indices] = 1
    assert torch.equal(x.grad, grad[:, None].expand(24, 2).reshape(4, 6, 2).double())
    # each sample is its own sequence: varlen attention over it equals per-sample attention
    h = torch.randn(4, 6, 2, 8, dtype=torch.float64)
    hu, idx, cu, m = cuflash.unpad_input_for_concatenated_sequences(h, lengths)
    out = cuflash.flash_attn_varlen_func(hu, hu, hu, cu, cu, m, m, causal=True)
    first = cuflash.flash_attn_func(h[:1, :2], h[:1, :2], h[:1, :2], causal=True)[0]
    assert torch.allclose(out[:2], first)
    back = cuflash.pad_input(out, idx, 4, 6)
    assert back.shape == (4, 6, 2, 8) and not back[0, 5].any() and not back[3].any()


def test_index_first_axis_residual():
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([4, 0, 4])
    out, residual = cuflash.index_first_axis_residual(x, idx)
    assert torch.equal(out, x.detach()[idx]) and torch.equal(residual, x.detach())
    (out.sum() + 2 * residual.sum()).backward()
    want = torch.full((5, 3), 2.0, dtype=torch.float64)
    want[4] += 2
    want[0] += 1
    assert torch.equal(x.grad, want)
    torch.autograd.gradcheck(lambda x: cuflash.index_first_axis_residual(x, idx), (x,))
