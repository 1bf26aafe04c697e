"""Baichuan (7B: rotary, 13B: ALiBi, Baichuan 2's normalized head) and BTLM (ALiBi or learned
positions, SwiGLU, muP scale factors) on cuflash.models.gpt.GPTLMHeadModel without a GPU. A random
Hugging Face-style state dict goes through the family's remap and its config through
``*_config_to_gpt2_config``; the model's logits (float64; cuflash's attention runs its float64
reference with use_flash_attn=True, and the torch attention where the family has no ALiBi) must
equal a plain-torch forward of that family written here from the Hugging Face weights and
Hugging Face's own formulas (Baichuan-13B's ALiBi bias ``slope · key position``, BTLM's
``-slope · |query - key|``, BTLM's Conv1D weights, c_fc · silu(c_fc2), muP's multipliers, BTLM's
``alibi_scaling``: the slopes divided by a fixed factor or by keys / train_seq_len, also while
decoding with the KV cache, and MHA's per-sequence form of it on packed / padded batches). Plus
the GPT2Config switches these add (use_alibi, mlp_multiple_of, norm_head, mup_*), refused
configs and unexpected keys. The configs are SimpleNamespaces (transformers is not installed)."""
import math
import types

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import cuflash  # noqa: E402
from cuflash.models import baichuan, btlm  # noqa: E402
from cuflash.models.gpt import GPT2Config, GPTLMHeadModel  # noqa: E402
from cuflash.modules.mha import get_alibi_slopes  # noqa: E402

F64 = torch.float64
TOL = dict(atol=1e-9, rtol=1e-8)
D, L, V = 48, 2, 101           # hidden, layers, vocabulary (heads per test: 4 or 6, a non-power of two)


def rnd(*shape, scale=0.3):
    return torch.randn(*shape, dtype=F64) * scale


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def ln(x, sd, prefix, eps=1e-5):
    return F.layer_norm(x, (x.shape[-1],), sd[prefix + "weight"], sd[prefix + "bias"], eps)


def rotate_half_rotary(x, base=10000.0):
    """Hugging Face's rotary (rotate_half: pairs i, i + d/2), tables in fp32 as the model's."""
    s, d = x.shape[1], x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    cos, sin = ang.cos().to(F64)[None, :, None], ang.sin().to(F64)[None, :, None]
    a, b = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def attention(q, k, v, scale, bias=None):
    """Causal attention (batch, seqlen, heads, head_dim); bias (heads, seqlen, seqlen) added to the
    scores before the mask."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    s = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).flatten(-2)


def model_logits(cfg, sd, ids, flash):
    cfg.use_flash_attn = flash
    m = GPTLMHeadModel(cfg, dtype=F64)
    m.load_state_dict(sd)
    return m.eval()(ids).logits


def padded(cfg):
    return math.ceil(V / cfg.pad_vocab_size_multiple) * cfg.pad_vocab_size_multiple


# ---------------------------------------------------------------------------------------
# Baichuan

def baichuan_cfg(hidden=D, heads=4, vocab=V, **kw):
    return types.SimpleNamespace(vocab_size=vocab, hidden_size=hidden, intermediate_size=72, num_hidden_layers=L,
                                 num_attention_heads=heads, hidden_act="silu", rms_norm_eps=1e-6,
                                 initializer_range=0.02, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                 tie_word_embeddings=False, **kw)


def baichuan_state(c):
    d, i = c.hidden_size, c.intermediate_size
    sd = {"model.embed_tokens.weight": rnd(c.vocab_size, d), "lm_head.weight": rnd(c.vocab_size, d),
          "model.norm.weight": 1 + rnd(d)}
    for l in range(L):
        p = f"model.layers.{l}."
        sd.update({p + "input_layernorm.weight": 1 + rnd(d), p + "post_attention_layernorm.weight": 1 + rnd(d),
                   p + "self_attn.W_pack.weight": rnd(3 * d, d), p + "self_attn.o_proj.weight": rnd(d, d),
                   p + "mlp.gate_proj.weight": rnd(i, d), p + "mlp.up_proj.weight": rnd(i, d),
                   p + "mlp.down_proj.weight": rnd(d, i), p + "self_attn.rotary_emb.inv_freq": torch.ones(4)})
    return sd


def baichuan_ref(sd, c, ids, alibi, norm_head):
    h_, d = c.num_attention_heads, c.hidden_size
    hd = d // h_
    x = sd["model.embed_tokens.weight"][ids]
    s = ids.shape[1]
    # Baichuan-13B's mask: slope · key position, added to every query row
    bias = torch.tensor(get_alibi_slopes(h_), dtype=F64)[:, None, None] * torch.arange(s, dtype=F64)[None, None, :]
    for l in range(L):
        p = f"model.layers.{l}."
        t = rms(x, sd[p + "input_layernorm.weight"], c.rms_norm_eps)
        q, k, v = (t @ sd[p + "self_attn.W_pack.weight"].t()).unflatten(-1, (3, h_, hd)).unbind(2)
        if not alibi:
            q, k = rotate_half_rotary(q), rotate_half_rotary(k)
        x = x + attention(q, k, v, hd ** -0.5, bias if alibi else None) @ sd[p + "self_attn.o_proj.weight"].t()
        t = rms(x, sd[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gate, up = t @ sd[p + "mlp.gate_proj.weight"].t(), t @ sd[p + "mlp.up_proj.weight"].t()
        x = x + (F.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].t()
    x = rms(x, sd["model.norm.weight"], c.rms_norm_eps)
    head = sd["lm_head.weight"]
    return x @ (F.normalize(head) if norm_head else head).t()


@pytest.mark.parametrize("kind", ["7b_rotary", "13b_alibi", "2_13b_normhead", "alibi_6_heads"])
def test_baichuan(kind):
    if kind == "7b_rotary":
        c = baichuan_cfg()
    elif kind == "13b_alibi":
        c = baichuan_cfg(use_alibi=True)       # the hidden-size rule overridden
    elif kind == "2_13b_normhead":
        c = baichuan_cfg(use_alibi=True, norm_head=True)
    else:
        c = baichuan_cfg(heads=6, use_alibi=True)
    cfg = baichuan.baichuan_config_to_gpt2_config(c)
    alibi = kind != "7b_rotary"
    assert cfg.use_alibi == alibi and cfg.use_flash_attn == alibi and cfg.rms_norm and not cfg.tie_word_embeddings
    assert cfg.rotary_emb_fraction == (0.0 if alibi else 1.0) and cfg.mlp_multiple_of == 1
    assert cfg.norm_head == (kind == "2_13b_normhead")
    cfg.pad_vocab_size_multiple = 8
    sd = baichuan_state(c)
    ids = torch.randint(0, V, (3, 13))
    want = baichuan_ref(sd, c, ids, alibi, cfg.norm_head)
    remapped = baichuan.remap_state_dict_hf_baichuan(sd, cfg)
    for flash in ((True,) if alibi else (True, False)):
        got = model_logits(cfg, remapped, ids, flash)
        assert got.shape == (3, 13, padded(cfg))
        assert torch.allclose(got[..., :V], want, **TOL), (flash, (got[..., :V] - want).abs().max())


def test_baichuan_inference_rules():
    """flash-attn's rules: rotary below hidden 5000, ALiBi from 5000; norm_head above 70000 tokens."""
    small = baichuan.baichuan_config_to_gpt2_config(baichuan_cfg(hidden=4096, heads=32))
    big = baichuan.baichuan_config_to_gpt2_config(baichuan_cfg(hidden=5120, heads=40, vocab=125696))
    assert not small.use_alibi and small.rotary_emb_fraction == 1.0 and not small.norm_head
    assert big.use_alibi and big.rotary_emb_fraction == 0.0 and big.norm_head and big.use_flash_attn


# ---------------------------------------------------------------------------------------
# BTLM

def btlm_cfg(heads=4, kind="alibi", **kw):
    base = dict(vocab_size=V, n_positions=64, n_embd=D, n_layer=L, n_head=heads, n_inner=70,
                activation_function="swiglu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                layer_norm_epsilon=1e-5, initializer_range=0.02, scale_attn_weights=True,
                scale_attn_by_inverse_layer_idx=False, position_embedding_type=kind, mup_width_scale=0.25,
                mup_embeddings_scale=3.5, mup_output_alpha=1.7, mup_scale_qk_dot_by_d=True, alibi_scaling=None,
                bos_token_id=0, eos_token_id=0)
    base.update(kw)
    return types.SimpleNamespace(**base)


def btlm_state(c):
    d, i = c.n_embd, c.n_inner
    sd = {"transformer.wte.weight": rnd(V, d), "transformer.ln_f.weight": 1 + rnd(d), "transformer.ln_f.bias": rnd(d),
          "transformer.relative_pe.slopes": torch.tensor(get_alibi_slopes(c.n_head)), "lm_head.weight": None}
    if c.position_embedding_type == "learned":
        sd["transformer.wpe.weight"] = rnd(c.n_positions, d)
        del sd["transformer.relative_pe.slopes"]
    for l in range(L):
        p = f"transformer.h.{l}."
        sd.update({p + "ln_1.weight": 1 + rnd(d), p + "ln_1.bias": rnd(d), p + "ln_2.weight": 1 + rnd(d),
                   p + "ln_2.bias": rnd(d), p + "attn.c_attn.weight": rnd(d, 3 * d), p + "attn.c_attn.bias": rnd(3 * d),
                   p + "attn.c_proj.weight": rnd(d, d), p + "attn.c_proj.bias": rnd(d),
                   p + "mlp.c_fc.weight": rnd(d, i), p + "mlp.c_fc.bias": rnd(i), p + "mlp.c_fc2.weight": rnd(d, i),
                   p + "mlp.c_fc2.bias": rnd(i), p + "mlp.c_proj.weight": rnd(i, d), p + "mlp.c_proj.bias": rnd(d),
                   p + "attn.bias": torch.ones(1, 1, 4, 4), p + "attn.masked_bias": torch.tensor(-1e4)})
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    return sd


def conv1d(x, sd, prefix):
    return x @ sd[prefix + "weight"] + sd[prefix + "bias"]


def btlm_alibi_scale(c, keys):
    """Hugging Face BTLM's alibi_scaling, written out: the slopes divided by 'factor', or by
    keys / 'train_seq_len' when there are more keys than that (keys: cache + new tokens)."""
    scaling = getattr(c, "alibi_scaling", None)
    if scaling is None:
        return 1.0
    if scaling.get("factor") is not None:
        return scaling["factor"]
    return keys / scaling["train_seq_len"] if keys > scaling["train_seq_len"] else 1.0


def btlm_ref(sd, c, ids, prompt=None):
    """prompt: decoding with the KV cache after a prompt of that many tokens (default: all of
    ids at once): Hugging Face computes token i >= prompt alone, its scale from i + 1 keys, and
    the prompt's tokens together, from prompt keys; per-row scales reproduce that."""
    h_, d = c.n_head, c.n_embd
    hd = d // h_
    s = ids.shape[1]
    prompt = s if prompt is None else prompt
    x = sd["transformer.wte.weight"][ids]
    if c.position_embedding_type == "learned":
        x = x + sd["transformer.wpe.weight"][:s]
    x = x * c.mup_embeddings_scale
    pos = torch.arange(s, dtype=F64)
    row_scale = torch.tensor([btlm_alibi_scale(c, max(prompt, i + 1)) for i in range(s)], dtype=F64)
    slopes = torch.tensor(get_alibi_slopes(h_), dtype=F64)[:, None, None] / row_scale[None, :, None]
    bias = -slopes * (pos[None, :] - pos[:, None]).abs()
    for l in range(L):
        p = f"transformer.h.{l}."
        t = ln(x, sd, p + "ln_1.", c.layer_norm_epsilon)
        q, k, v = conv1d(t, sd, p + "attn.c_attn.").unflatten(-1, (3, h_, hd)).unbind(2)
        scale = 1.0 / hd ** (1.0 if c.mup_scale_qk_dot_by_d else 0.5)
        if c.scale_attn_by_inverse_layer_idx:
            scale /= l + 1
        a = attention(q, k, v, scale, bias if c.position_embedding_type == "alibi" else None)
        x = x + conv1d(a, sd, p + "attn.c_proj.")
        t = ln(x, sd, p + "ln_2.", c.layer_norm_epsilon)
        x = x + conv1d(conv1d(t, sd, p + "mlp.c_fc.") * F.silu(conv1d(t, sd, p + "mlp.c_fc2.")), sd, p + "mlp.c_proj.")
    x = ln(x, sd, "transformer.ln_f.", c.layer_norm_epsilon)
    return (x @ sd["transformer.wte.weight"].t()) * (c.mup_output_alpha * c.mup_width_scale)


@pytest.mark.parametrize("kind", ["alibi", "alibi_6_heads_inverse_layer", "learned"])
def test_btlm(kind):
    if kind == "alibi":
        c = btlm_cfg()
    elif kind == "alibi_6_heads_inverse_layer":
        c = btlm_cfg(heads=6, scale_attn_by_inverse_layer_idx=True, mup_scale_qk_dot_by_d=False)
    else:
        c = btlm_cfg(kind="learned")
    cfg = btlm.btlm_config_to_gpt2_config(c)
    alibi = c.position_embedding_type == "alibi"
    assert cfg.use_alibi == alibi and cfg.n_positions == (0 if alibi else 64) and cfg.mlp_multiple_of == 1
    assert (cfg.mup_embeddings_multiplier, cfg.mup_output_multiplier, cfg.mup_width_scale) == (3.5, 1.7, 0.25)
    cfg.pad_vocab_size_multiple = 8
    sd = btlm_state(c)
    ids = torch.randint(0, V, (2, 17))
    want = btlm_ref(sd, c, ids)
    remapped = btlm.remap_state_dict_hf_btlm(sd, cfg)
    assert remapped["transformer.layers.0.mlp.fc1.weight"].shape == (2 * 70, D)
    assert remapped["lm_head.weight"] is remapped["transformer.embeddings.word_embeddings.weight"]
    for flash in ((True,) if alibi else (True, False)):
        got = model_logits(cfg, remapped, ids, flash)
        assert got.shape == (2, 17, padded(cfg))
        assert torch.allclose(got[..., :V], want, **TOL), (flash, (got[..., :V] - want).abs().max())


SCALINGS = {"factor_2": {"type": "linear", "factor": 2.0}, "train_8": {"type": "linear", "train_seq_len": 8},
            "train_32": {"type": "linear", "train_seq_len": 32}}


@pytest.mark.parametrize("name", list(SCALINGS))
def test_btlm_alibi_scaling(name):
    """BTLM's alibi_scaling (ALiBi position interpolation): the bias -(slope / scale) · |i - j|
    with scale 'factor' (alibi_slope_scale = 1 / factor) or max(1, keys / train_seq_len)
    (alibi_train_seqlen; 17 tokens > 8 interpolate, < 32 do not); the prompt's logits, then
    decoding with the KV cache one token at a time, where the scale grows with the cache (Hugging
    Face's scale from cache + new tokens; the cached keys and values keep the scales of their
    own steps)."""
    c = btlm_cfg(heads=6, alibi_scaling=SCALINGS[name])
    cfg = btlm.btlm_config_to_gpt2_config(c)
    factor = SCALINGS[name].get("factor")
    assert cfg.alibi_slope_scale == (1.0 / factor if factor else 1.0)
    assert cfg.alibi_train_seqlen == SCALINGS[name].get("train_seq_len")
    sd = btlm_state(c)
    remapped = btlm.remap_state_dict_hf_btlm(sd, cfg)
    ids = torch.randint(0, V, (2, 17))
    cfg.use_flash_attn = True
    m = GPTLMHeadModel(cfg, dtype=F64).eval()
    m.load_state_dict(remapped)
    # the kernels take fp32 slopes (slope / factor or / scale rounded to fp32)
    tol = dict(atol=1e-6, rtol=1e-6)
    want = btlm_ref(sd, c, ids)
    assert torch.allclose(m(ids).logits[..., :V], want, **tol), (m(ids).logits[..., :V] - want).abs().max()
    if name == "train_32":                           # no interpolation below train_seq_len
        plain = btlm_cfg(heads=6)
        assert torch.allclose(want, btlm_ref(sd, plain, ids), atol=1e-12)
    else:
        assert not torch.allclose(want, btlm_ref(sd, btlm_cfg(heads=6), ids), atol=1e-3)
    from cuflash.utils.generation import InferenceParams
    params = InferenceParams(max_seqlen=17, max_batch_size=2)
    got = m(ids[:, :5], inference_params=params).logits
    assert torch.allclose(got[..., :V], btlm_ref(sd, c, ids[:, :5]), **tol)
    for t in range(5, 17):
        params.seqlen_offset = t
        step = m(ids[:, t:t + 1], position_ids=torch.full((2, 1), t), inference_params=params).logits
        ref = btlm_ref(sd, c, ids[:, :t + 1], prompt=5)[:, -1:]
        assert torch.allclose(step[..., :V], ref, **tol), (t, (step[..., :V] - ref).abs().max())


def test_mha_alibi_train_seqlen_per_sequence():
    """MHA's alibi_train_seqlen on packed (cu_seqlens) and padded (key_padding_mask) batches:
    each sequence's slopes scale by its own key count, so each row equals that sequence alone."""
    from cuflash.modules.mha import MHA
    torch.manual_seed(0)
    mha = MHA(32, 4, causal=True, use_alibi=True, use_flash_attn=True, dtype=F64, alibi_train_seqlen=6,
              alibi_slope_scale=0.5, layer_idx=0).eval()
    lens = [11, 4, 8]
    xs = [rnd(1, n, 32, scale=1.0) for n in lens]
    alone = [mha(x)[0] for x in xs]
    cu = torch.tensor([0, 11, 15, 23], dtype=torch.int32)
    packed = mha(torch.cat([x[0] for x in xs]), cu_seqlens=cu, max_seqlen=11)
    assert torch.allclose(packed, torch.cat(alone), atol=1e-12)
    padded_x = torch.zeros(3, 11, 32, dtype=F64)
    mask = torch.zeros(3, 11, dtype=torch.bool)
    for i, x in enumerate(xs):
        padded_x[i, :lens[i]], mask[i, :lens[i]] = x[0], True
    out = mha(padded_x, key_padding_mask=mask)
    for i, n in enumerate(lens):
        assert torch.allclose(out[i, :n], alone[i], atol=1e-12)
    # scale 1 below alibi_train_seqlen: the 4-token sequence sees the plain slopes times 0.5
    ref = MHA(32, 4, causal=True, use_alibi=True, use_flash_attn=True, dtype=F64, alibi_slope_scale=0.5).eval()
    ref.load_state_dict(mha.state_dict())
    assert torch.allclose(ref(xs[1])[0], alone[1], atol=1e-12)
    assert not torch.allclose(ref(xs[0])[0], alone[0], atol=1e-6)


def test_mup_init_scale():
    """mup_width_scale: the linear weights' init std times sqrt(scale) and their lr hint."""
    torch.manual_seed(0)
    base = dict(vocab_size=64, n_embd=256, n_layer=1, n_head=4, initializer_range=0.02)
    plain = GPTLMHeadModel(GPT2Config(**base))
    mup = GPTLMHeadModel(GPT2Config(**base, mup_width_scale=0.25, tie_word_embeddings=False))
    w0, w1 = plain.transformer.layers[0].mixer.Wqkv.weight, mup.transformer.layers[0].mixer.Wqkv.weight
    assert abs(w1.std().item() / w0.std().item() - 0.5) < 0.05
    assert w1._optim == {"lr_multiplier": 0.25} and not hasattr(w0, "_optim")


# ---------------------------------------------------------------------------------------
# refused

def test_refused():
    with pytest.raises(ValueError, match="config.use_alibi"):
        GPTLMHeadModel(GPT2Config(vocab_size=V, n_embd=D, n_layer=1, n_head=4, use_alibi=True))
    with pytest.raises(ValueError, match="config.window_size"):
        GPTLMHeadModel(GPT2Config(vocab_size=V, n_embd=D, n_layer=1, n_head=4, window_size=(3,)))
    with pytest.raises(ValueError, match="config.mlp_multiple_of"):
        GPTLMHeadModel(GPT2Config(vocab_size=V, n_embd=D, n_layer=1, n_head=4, mlp_multiple_of=0))
    with pytest.raises(ValueError, match="config.mup_width_scale"):
        GPTLMHeadModel(GPT2Config(vocab_size=V, n_embd=D, n_layer=1, n_head=4, mup_width_scale=0))
    with pytest.raises(ValueError, match="baichuan_config.hidden_act"):
        baichuan.baichuan_config_to_gpt2_config(types.SimpleNamespace(**{**vars(baichuan_cfg()), "hidden_act": "gelu"}))
    with pytest.raises(ValueError, match="baichuan_config.hidden_size"):
        baichuan.baichuan_config_to_gpt2_config(types.SimpleNamespace(vocab_size=V))
    for bad in ({"type": "linear"}, {"type": "dynamic", "factor": 2.0}, {"type": "linear", "factor": 1.0},
                {"type": "linear", "factor": 2}, {"type": "linear", "train_seq_len": 1},
                {"type": "linear", "train_seq_len": 8.0}, ["linear", 2.0]):
        with pytest.raises(ValueError, match="btlm_config.alibi_scaling"):
            btlm.btlm_config_to_gpt2_config(btlm_cfg(alibi_scaling=bad))
    learned = btlm.btlm_config_to_gpt2_config(btlm_cfg(kind="learned", alibi_scaling={"type": "linear", "factor": 2.0}))
    assert learned.alibi_slope_scale == 1.0 and learned.alibi_train_seqlen is None     # Hugging Face ignores it too
    with pytest.raises(ValueError, match="config.alibi_slope_scale"):
        GPTLMHeadModel(GPT2Config(vocab_size=V, n_embd=D, n_layer=1, n_head=4, alibi_slope_scale=0.5))
    with pytest.raises(ValueError, match="config.alibi_slope_scale"):
        GPTLMHeadModel(GPT2Config(vocab_size=V, n_embd=D, n_layer=1, n_head=4, use_alibi=True, use_flash_attn=True,
                                  alibi_slope_scale=-1.0))
    with pytest.raises(ValueError, match="config.alibi_train_seqlen"):
        GPTLMHeadModel(GPT2Config(vocab_size=V, n_embd=D, n_layer=1, n_head=4, use_alibi=True, use_flash_attn=True,
                                  alibi_train_seqlen=0))
    from cuflash.modules.mha import MHA
    with pytest.raises(ValueError, match="alibi_train_seqlen"):
        MHA(32, 4, alibi_train_seqlen=8, use_flash_attn=True)
    with pytest.raises(ValueError, match="position_embedding_type"):
        btlm.btlm_config_to_gpt2_config(btlm_cfg(kind="rotary"))
    c = btlm_cfg()
    cfg = btlm.btlm_config_to_gpt2_config(c)
    sd = btlm_state(c)
    sd["transformer.relative_pe.slopes"] = sd["transformer.relative_pe.slopes"] * 2
    with pytest.raises(cuflash.UnsupportedFeature, match="slopes"):
        btlm.remap_state_dict_hf_btlm(sd, cfg)
    sd = btlm_state(c)
    sd["transformer.h.0.attn.extra.weight"] = rnd(2)
    with pytest.raises(ValueError, match="transformer.h.0.attn.extra.weight"):
        btlm.remap_state_dict_hf_btlm(sd, cfg)
    c = baichuan_cfg()
    sd = baichuan_state(c)
    del sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="up_proj"):
        baichuan.remap_state_dict_hf_baichuan(sd, baichuan.baichuan_config_to_gpt2_config(c))
