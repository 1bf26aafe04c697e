"""cuflash.models (flash-attn's GPT model family) without a GPU: torch CPU tensors, cuflash's
attention running the float64 reference (use_flash_attn=True) or the torch attention. The
models against plain-torch GPT-2 and Llama forwards written here from Hugging Face-style state
dicts (through remap_state_dict_hf_gpt2 / remap_state_dict_hf_llama, so the remaps are checked
by the outputs too), logits shapes, num_last_tokens, tie_word_embeddings,
pad_vocab_size_multiple, GQA, the config switches' equivalences (fused paths = unfused ones),
configs that are refused (the attribute named), greedy generation against a hand-stepped
forward, the sampling filters, embeddings, tensor-parallel state-dict splits and flash-attn's
signatures."""
import dataclasses
import inspect
import math
import types

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import cuflash  # noqa: E402
from cuflash.models import gpt, llama  # noqa: E402
from cuflash.models.gpt import GPT2Config, GPTLMHeadModel, GPTModel  # noqa: E402
from cuflash.modules.embedding import (ColumnParallelEmbedding, GPT2Embeddings, ParallelGPT2Embeddings,  # noqa: E402
                                       VocabParallelEmbedding)
from cuflash.utils import generation  # noqa: E402

F64 = torch.float64
ROTARY_TOL = dict(atol=5e-6, rtol=1e-5)   # the rotary tables are computed in fp32, as flash-attn's (logits ~5:
# up to ~3e-6 over rtol in 12 random draws of the Llama case)
TINY = dict(vocab_size=97, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0)


def rand_state(shapes: dict, dtype=F64, scale=0.3) -> dict:
    """Fresh random tensors; norms' weights around 1."""
    out = {}
    for k, shape in shapes.items():
        t = torch.randn(shape, dtype=dtype) * scale
        if ("ln" in k or "norm" in k) and k.endswith("weight"):
            t = 1.0 + t
        out[k] = t
    return out


# ---------------------------------------------------------------------------------------
# plain-torch GPT-2 (Hugging Face's parameter layout: Conv1D weights (in, out))

def hf_gpt2_state(cfg, dtype=F64) -> dict:
    d, v, n = cfg.n_embd, cfg.vocab_size, cfg.n_positions
    inner = cfg.n_inner or 4 * d
    shapes = {"wte.weight": (v, d), "wpe.weight": (n, d), "ln_f.weight": (d,), "ln_f.bias": (d,)}
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        shapes.update({p + "ln_1.weight": (d,), p + "ln_1.bias": (d,), p + "attn.c_attn.weight": (d, 3 * d),
                       p + "attn.c_attn.bias": (3 * d,), p + "attn.c_proj.weight": (d, d),
                       p + "attn.c_proj.bias": (d,), p + "ln_2.weight": (d,), p + "ln_2.bias": (d,),
                       p + "mlp.c_fc.weight": (d, inner), p + "mlp.c_fc.bias": (inner,),
                       p + "mlp.c_proj.weight": (inner, d), p + "mlp.c_proj.bias": (d,)})
    sd = rand_state(shapes, dtype)
    for i in range(cfg.n_layer):      # the causal-mask buffers a Hugging Face checkpoint carries
        sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
        sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    return sd


def plain_gpt2(sd, cfg, ids):
    """GPT-2's forward in torch ops from a Hugging Face state dict: pre-norm blocks, causal
    softmax attention, tanh-GELU MLP, final norm, logits against the tied word embedding."""
    d, h, eps = cfg.n_embd, cfg.n_head, cfg.layer_norm_epsilon
    x = sd["wte.weight"][ids] + sd["wpe.weight"][torch.arange(ids.shape[1])]
    s = ids.shape[1]
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        a = F.layer_norm(x, (d,), sd[p + "ln_1.weight"], sd[p + "ln_1.bias"], eps)
        q, k, v = (a @ sd[p + "attn.c_attn.weight"] + sd[p + "attn.c_attn.bias"]).split(d, dim=-1)
        q, k, v = (t.unflatten(-1, (h, d // h)).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // h)
        att = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        x = x + att.transpose(1, 2).flatten(-2) @ sd[p + "attn.c_proj.weight"] + sd[p + "attn.c_proj.bias"]
        m = F.layer_norm(x, (d,), sd[p + "ln_2.weight"], sd[p + "ln_2.bias"], eps)
        m = F.gelu(m @ sd[p + "mlp.c_fc.weight"] + sd[p + "mlp.c_fc.bias"], approximate="tanh")
        x = x + m @ sd[p + "mlp.c_proj.weight"] + sd[p + "mlp.c_proj.bias"]
    x = F.layer_norm(x, (d,), sd["ln_f.weight"], sd["ln_f.bias"], eps)
    return x @ sd["wte.weight"].t()


def gpt2_model(cfg, sd, dtype=F64):
    m = GPTLMHeadModel(cfg, dtype=dtype)
    m.load_state_dict(gpt.remap_state_dict_hf_gpt2(sd, cfg))
    return m.eval()


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("flash", [True, False], ids=["flash", "torch"])
def test_gpt2_matches_plain_torch(flash, dtype):
    cfg = GPT2Config(**TINY, use_flash_attn=flash)
    sd = hf_gpt2_state(cfg, dtype)
    m = gpt2_model(cfg, sd, dtype)
    ids = torch.randint(0, cfg.vocab_size, (3, 13))
    out = m(ids)
    assert type(out).__name__ == "CausalLMOutput" and out._fields == ("logits",)
    assert out.logits.shape == (3, 13, 97) and out.logits.dtype == dtype
    want = plain_gpt2(sd, cfg, ids)
    tol = dict(atol=1e-10, rtol=1e-9) if dtype == F64 else dict(atol=2e-4, rtol=1e-4)
    assert torch.allclose(out.logits, want, **tol), (out.logits - want).abs().max()


def test_gpt2_gradients_match_plain_torch():
    cfg = GPT2Config(**TINY, use_flash_attn=True)
    sd = hf_gpt2_state(cfg)
    m = gpt2_model(cfg, sd)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    sd = {k: v.requires_grad_() if v.is_floating_point() else v for k, v in sd.items()}
    dout = torch.randn(2, 9, 97, dtype=F64)
    (m(ids).logits * dout).sum().backward()
    (plain_gpt2(sd, cfg, ids) * dout).sum().backward()
    pairs = [("transformer.embeddings.word_embeddings.weight", "wte.weight", False),
             ("transformer.layers.1.mixer.Wqkv.weight", "h.1.attn.c_attn.weight", True),
             ("transformer.layers.0.mlp.fc2.weight", "h.0.mlp.c_proj.weight", True),
             ("transformer.layers.0.norm1.weight", "h.0.ln_1.weight", False)]
    params = dict(m.named_parameters())
    for ours, theirs, transposed in pairs:
        want = sd[theirs].grad.t() if transposed else sd[theirs].grad
        assert torch.allclose(params[ours].grad, want, atol=1e-10, rtol=1e-8), ours


def test_num_last_tokens_padding_and_ties():
    cfg = GPT2Config(**TINY, pad_vocab_size_multiple=8)
    sd = hf_gpt2_state(cfg)
    remapped = gpt.remap_state_dict_hf_gpt2(sd, cfg)
    emb = remapped["transformer.embeddings.word_embeddings.weight"]
    assert emb.shape == (104, 64) and torch.equal(emb[97:], torch.zeros(7, 64))
    assert remapped["lm_head.weight"] is emb
    assert not any(".attn.bias" in k or "masked_bias" in k for k in remapped)
    m = gpt2_model(cfg, sd)
    assert m.lm_head.weight is m.transformer.embeddings.word_embeddings.weight
    assert "lm_head.weight" in m.state_dict()
    ids = torch.randint(0, 97, (2, 11))
    full = m(ids).logits
    assert full.shape == (2, 11, 104)
    assert torch.allclose(full[..., :97], plain_gpt2(sd, cfg, ids), atol=1e-10, rtol=1e-9)
    assert torch.equal(m(ids, num_last_tokens=3).logits, full[:, -3:])
    assert torch.allclose(m(ids, num_last_tokens=1).logits[:, 0], full[:, -1], atol=1e-12, rtol=0)
    untied = GPTLMHeadModel(GPT2Config(**TINY, tie_word_embeddings=False), dtype=F64)
    assert untied.lm_head.weight is not untied.transformer.embeddings.word_embeddings.weight
    assert untied.lm_head.weight.shape == (97, 64) and untied.lm_head.bias is None
    assert GPTLMHeadModel(GPT2Config(**TINY, lm_head_bias=True)).lm_head.bias.shape == (97,)


def test_simple_namespace_config_and_position_ids():
    ns = types.SimpleNamespace(vocab_size=50, n_embd=32, n_head=2, n_layer=1, n_positions=16, resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0)
    m = GPTLMHeadModel(ns, dtype=F64).eval()
    assert m.config is ns and m.lm_head.weight.shape == (50, 32)
    ids = torch.randint(0, 50, (2, 5))
    base = m(ids).logits
    assert torch.equal(m(ids, position_ids=torch.arange(5)[None].expand(2, 5)).logits, base)
    assert not torch.allclose(m(ids, position_ids=torch.arange(5)[None].expand(2, 5) + 3).logits, base)
    hf_like = GPT2Config(vocab_size=50, hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
                         max_position_embeddings=16)
    assert (hf_like.n_embd, hf_like.n_head, hf_like.n_layer, hf_like.n_positions) == (32, 2, 1, 16)
    assert hf_like.hidden_size == 32 and hf_like.activation_function == "gelu_new"
    assert GPTModel(hf_like).layers[0].mixer.num_heads == 2
    assert dataclasses.is_dataclass(GPT2Config) and hf_like == GPT2Config(vocab_size=50, n_embd=32, n_head=2, n_layer=1,
                                                                           n_positions=16)
    names = {f.name for f in dataclasses.fields(GPT2Config)}
    assert {"n_head_kv", "rotary_emb_fraction", "use_flash_attn", "pad_vocab_size_multiple"} <= names
    assert GPT2Config(my_switch=3).my_switch == 3 and GPT2Config().to_dict()["n_embd"] == 768


# ---------------------------------------------------------------------------------------
# the config switches

def _same_weights(a, b):
    b.load_state_dict(a.state_dict())
    return a.eval(), b.eval()


@pytest.mark.parametrize("switch", [
    dict(fused_dropout_add_ln=True), dict(fused_dropout_add_ln=True, rms_norm=True),
    dict(fused_dropout_add_ln=True, parallel_block=True), dict(fused_mlp=True),
    dict(fused_bias_fc=True), dict(residual_in_fp32=True), dict(fused_mlp=True, mlp_checkpoint_lvl=[1, 2]),
], ids=["fused_ln", "fused_rms", "fused_ln_parallel", "fused_mlp", "fused_bias_fc", "resid_fp32",
        "fused_mlp_lvl_list"])
def test_fused_switches_compute_the_unfused_model(switch):
    base = {k: v for k, v in switch.items() if k in ("rms_norm", "parallel_block")}
    a = GPTLMHeadModel(GPT2Config(**TINY, **base, initializer_range=0.3), dtype=F64)
    b = GPTLMHeadModel(GPT2Config(**TINY, **switch, initializer_range=0.3), dtype=F64)
    a, b = _same_weights(a, b)
    ids = torch.randint(0, 97, (2, 7))
    # residual_in_fp32 rounds this float64 model's residual stream to fp32
    tol = dict(atol=1e-5, rtol=1e-5) if "residual_in_fp32" in switch else dict(atol=1e-10, rtol=1e-9)
    assert torch.allclose(a(ids).logits, b(ids).logits, **tol)
    if "residual_in_fp32" in switch:
        assert b.transformer.layers[0](b.transformer.embeddings(ids))[1].dtype == torch.float32


def test_variants_build_and_run():
    """Each structural switch makes the module it names and runs (flash and torch agree)."""
    variants = {
        "prenorm_false": dict(prenorm=False),
        "parallel_block_tied": dict(parallel_block=True, parallel_block_tied_norm=True),
        "rms_sqrelu": dict(rms_norm=True, activation_function="sqrelu"),
        "relu": dict(activation_function="relu"),
        "gelu_exact": dict(activation_function="gelu"),
        "glu": dict(activation_function="glu", n_inner=96), "geglu": dict(activation_function="geglu"),
        "sqrelu_dense": dict(activation_function="sqrelu", fused_dense_sqrelu_dense=True),
        "no_biases": dict(qkv_proj_bias=False, out_proj_bias=False, mlp_fc1_bias=False, mlp_fc2_bias=False),
        "inverse_layer_idx": dict(scale_attn_by_inverse_layer_idx=True, scale_attn_weights=False),
        "word_proj": dict(word_embed_proj_dim=48), "xpos": dict(rotary_emb_fraction=1.0, rotary_emb_scale_base=64),
    }
    ids = torch.randint(0, 97, (2, 6))
    for name, kw in variants.items():
        flash = GPTLMHeadModel(GPT2Config(**{**TINY, **kw}, use_flash_attn=True, initializer_range=0.3), dtype=F64)
        plain = GPTLMHeadModel(GPT2Config(**{**TINY, **kw}, initializer_range=0.3), dtype=F64)
        flash, plain = _same_weights(flash, plain)
        out = flash(ids).logits
        assert out.shape == (2, 6, 97), name
        assert torch.allclose(out, plain(ids).logits, atol=1e-9, rtol=1e-8), name
    m = GPTLMHeadModel(GPT2Config(**TINY, prenorm=False))
    assert not hasattr(m.transformer, "ln_f") and m.transformer.layers[0].prenorm is False
    m = GPTLMHeadModel(GPT2Config(**TINY, parallel_block=True, parallel_block_tied_norm=True))
    assert type(m.transformer.layers[0]).__name__ == "ParallelBlock" and not hasattr(m.transformer.layers[0], "norm2")
    m = GPTLMHeadModel(GPT2Config(**TINY, activation_function="glu", n_inner=96))
    assert m.transformer.layers[0].mlp.fc1.weight.shape == (2 * 128, 64)      # GatedMlp's multiple_of=128
    m = GPTLMHeadModel(GPT2Config(**TINY, word_embed_proj_dim=48))
    assert m.transformer.embeddings.project_in.weight.shape == (64, 48) and m.project_out.weight.shape == (48, 64)
    m = GPTLMHeadModel(GPT2Config(**TINY, scale_attn_by_inverse_layer_idx=True))
    assert m.transformer.layers[1].mixer.inner_attn.softmax_scale == pytest.approx(16 ** -0.5 / 2)
    m = GPTLMHeadModel(GPT2Config(**{**TINY, "embd_pdrop": 0.2, "resid_pdrop": 0.05, "attn_pdrop": 0.1}))
    layers = m.transformer.layers
    assert (layers[0].dropout1.p, layers[1].dropout1.p, layers[0].dropout2.p, m.transformer.drop_f.p) == \
        (0.2, 0.05, 0.05, 0.05)
    assert layers[0].mixer.inner_attn.drop.p == 0.1


def test_init_scales_residual_projections():
    torch.manual_seed(0)
    m = GPTLMHeadModel(GPT2Config(vocab_size=500, n_positions=64, n_embd=256, n_layer=8, n_head=4))
    layer = m.transformer.layers[3]
    assert layer.mixer.Wqkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert layer.mixer.out_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert layer.mlp.fc2.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.equal(layer.mlp.fc1.bias, torch.zeros_like(layer.mlp.fc1.bias))


def test_old_checkpoint_norm_layout_loads():
    """flash-attn's older checkpoints (ln_0; each block's norms after its mixer / MLP) load."""
    m = GPTLMHeadModel(GPT2Config(**{**TINY, "n_layer": 3}, tie_word_embeddings=False), dtype=F64)
    new = {k: torch.randn_like(v) for k, v in m.state_dict().items()}
    old = {k: v for k, v in new.items() if ".norm" not in k and "ln_f" not in k}
    for s in ("weight", "bias"):
        old[f"transformer.ln_0.{s}"] = new[f"transformer.layers.0.norm1.{s}"]
        for l in range(3):
            old[f"transformer.layers.{l}.norm1.{s}"] = new[f"transformer.layers.{l}.norm2.{s}"]
            old[f"transformer.layers.{l}.norm2.{s}"] = (new[f"transformer.layers.{l + 1}.norm1.{s}"] if l < 2
                                                        else new[f"transformer.ln_f.{s}"])
    m.load_state_dict(old)
    for k, v in m.state_dict().items():
        assert torch.equal(v, new[k]), k


# ---------------------------------------------------------------------------------------
# refused configs

@pytest.mark.parametrize("kw, exc, word", [
    (dict(n_head=5), ValueError, "config.n_embd"),
    (dict(n_head_kv=3), ValueError, "config.n_head_kv"),
    (dict(activation_function="silu"), ValueError, "config.activation_function"),
    (dict(parallel_block=True, prenorm=False), ValueError, "config.parallel_block"),
    (dict(residual_in_fp32=True, prenorm=False), ValueError, "config.residual_in_fp32"),
    (dict(fused_mlp=True, activation_function="gelu"), ValueError, "config.fused_mlp"),
    (dict(fused_dense_sqrelu_dense=True), ValueError, "config.fused_dense_sqrelu_dense"),
    (dict(rotary_emb_fraction=0.2), ValueError, "config.rotary_emb_fraction"),
    (dict(rotary_emb_fraction=1.5), ValueError, "config.rotary_emb_fraction"),
    (dict(pad_vocab_size_multiple=0), ValueError, "config.pad_vocab_size_multiple"),
    (dict(vocab_size=0), ValueError, "config.vocab_size"),
    (dict(n_layer=2.0), ValueError, "config.n_layer"),
    (dict(resid_pdrop=1.0), ValueError, "config.resid_pdrop"),
    (dict(n_positions=-1), ValueError, "config.n_positions"),
    (dict(layer_norm_epsilon=0.0), ValueError, "config.layer_norm_epsilon"),
    (dict(head_dim=32), cuflash.UnsupportedFeature, "config.head_dim"),
    (dict(attn_dwconv=True), cuflash.UnsupportedFeature, "config.attn_dwconv"),
])
def test_bad_config_names_the_attribute(kw, exc, word):
    with pytest.raises(exc, match=word.replace(".", r"\.")):
        GPTLMHeadModel(GPT2Config(**{**TINY, **kw}))


def test_missing_attribute_and_bad_inputs(monkeypatch, tmp_path):
    ns = types.SimpleNamespace(vocab_size=10, n_embd=32, n_layer=1)
    with pytest.raises(ValueError, match=r"config\.n_head is missing"):
        GPTLMHeadModel(ns)
    m = GPTLMHeadModel(GPT2Config(**TINY))
    with pytest.raises(ValueError, match="input_ids"):
        m(torch.randint(0, 97, (5,)))
    with pytest.raises(ValueError, match="num_last_tokens"):
        m(torch.randint(0, 97, (1, 5)), num_last_tokens=-1)
    with pytest.raises(ValueError, match="max_length"):
        m.generate(torch.randint(0, 97, (1, 5)), 5)
    with pytest.raises(ValueError, match="top_p"):
        m.generate(torch.randint(0, 97, (1, 5)), 8, top_k=0, top_p=1.5)
    with pytest.raises(ValueError, match="temperature"):
        m.generate(torch.randint(0, 97, (1, 5)), 8, top_k=5, temperature=0.0)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")             # a hub name: the (empty) cache only, no network
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub_cache"))
    with pytest.raises(OSError, match="gpt2.*HF_HUB_OFFLINE"):
        GPTLMHeadModel.from_pretrained("gpt2", GPT2Config(**TINY))


# ---------------------------------------------------------------------------------------
# Llama: config conversion and the Hugging Face remap against a plain Llama forward

def llama_cfg(**kw):
    d = dict(vocab_size=89, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, rms_norm_eps=1e-6, rope_theta=500.0, initializer_range=0.02, bos_token_id=1,
             eos_token_id=2, pad_token_id=None, tie_word_embeddings=False)
    d.update(kw)
    return types.SimpleNamespace(**d)


def hf_llama_state(lc, dtype=F64) -> dict:
    d, v, f = lc.hidden_size, lc.vocab_size, lc.intermediate_size
    hd = d // lc.num_attention_heads
    kv = lc.num_key_value_heads * hd
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not lc.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, d)
    for i in range(lc.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                       p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (kv, d),
                       p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, d),
                       p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                       p + "mlp.down_proj.weight": (d, f)})
    sd = rand_state(shapes, dtype)
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(hd // 2)
    return sd


def plain_llama(sd, lc, ids):
    """Llama's forward (Hugging Face's layout): RMSNorm, q / k turned by the half-split rotary
    (rotate_half), GQA by repeating kv heads, SwiGLU MLP."""
    d, h, hk = lc.hidden_size, lc.num_attention_heads, lc.num_key_value_heads
    hd, s, eps = d // h, ids.shape[1], lc.rms_norm_eps

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    inv = 1.0 / lc.rope_theta ** (torch.arange(0, hd, 2, dtype=F64) / hd)
    ang = torch.arange(s, dtype=F64)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rope(t):
        half = torch.cat([-t[..., hd // 2:], t[..., :hd // 2]], dim=-1)
        return t * cos.to(t.dtype) + half * sin.to(t.dtype)

    x = sd["model.embed_tokens.weight"][ids]
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    for i in range(lc.num_hidden_layers):
        p = f"model.layers.{i}."
        a = rms(x, sd[p + "input_layernorm.weight"])
        q = (a @ sd[p + "self_attn.q_proj.weight"].t()).unflatten(-1, (h, hd)).transpose(1, 2)
        k = (a @ sd[p + "self_attn.k_proj.weight"].t()).unflatten(-1, (hk, hd)).transpose(1, 2)
        v = (a @ sd[p + "self_attn.v_proj.weight"].t()).unflatten(-1, (hk, hd)).transpose(1, 2)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(h // hk, dim=1), v.repeat_interleave(h // hk, dim=1)
        att = ((q @ k.transpose(-1, -2)) / math.sqrt(hd)).masked_fill(~mask, float("-inf")).softmax(-1) @ v
        x = x + att.transpose(1, 2).flatten(-2) @ sd[p + "self_attn.o_proj.weight"].t()
        m = rms(x, sd[p + "post_attention_layernorm.weight"])
        m = F.silu(m @ sd[p + "mlp.gate_proj.weight"].t()) * (m @ sd[p + "mlp.up_proj.weight"].t())
        x = x + m @ sd[p + "mlp.down_proj.weight"].t()
    x = rms(x, sd["model.norm.weight"])
    head = sd["model.embed_tokens.weight"] if lc.tie_word_embeddings else sd["lm_head.weight"]
    return x @ head.t()


def test_llama_config_conversion():
    cfg = llama.llama_config_to_gpt2_config(llama_cfg())
    assert isinstance(cfg, GPT2Config)
    assert (cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.n_layer, cfg.n_inner, cfg.n_positions) == (64, 4, 2, 2, 128, 0)
    assert (cfg.activation_function, cfg.rms_norm, cfg.rotary_emb_fraction, cfg.rotary_emb_interleaved,
            cfg.rotary_emb_base, cfg.layer_norm_epsilon) == ("swiglu", True, 1.0, True, 500.0, 1e-6)
    assert not any((cfg.qkv_proj_bias, cfg.out_proj_bias, cfg.mlp_fc1_bias, cfg.mlp_fc2_bias, cfg.tie_word_embeddings))
    assert (cfg.resid_pdrop, cfg.embd_pdrop, cfg.attn_pdrop) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match=r"llama_config\.rms_norm_eps"):
        llama.llama_config_to_gpt2_config(types.SimpleNamespace(vocab_size=8, hidden_size=8, num_hidden_layers=1,
                                                                num_attention_heads=2, intermediate_size=8))
    with pytest.raises(cuflash.UnsupportedFeature, match="rope_scaling"):
        llama.llama_config_to_gpt2_config(llama_cfg(rope_scaling={"type": "linear", "factor": 2.0}))


def test_llama_remap_names_and_shapes():
    lc = llama_cfg()
    cfg = llama.llama_config_to_gpt2_config(lc)
    cfg.pad_vocab_size_multiple = 8
    sd = hf_llama_state(lc)
    out = llama.remap_state_dict_hf_llama(sd, cfg)
    model_keys = set(GPTLMHeadModel(cfg).state_dict())
    assert set(out) == model_keys
    assert out["transformer.layers.0.mixer.Wqkv.weight"].shape == (64 + 2 * 32, 64)
    assert out["transformer.layers.1.mlp.fc1.weight"].shape == (2 * 128, 64)
    assert out["transformer.embeddings.word_embeddings.weight"].shape == (96, 64)
    assert out["lm_head.weight"].shape == (96, 64)
    # fc1 = [up; gate]; q rows of head 0: HF's (i, i + 8) pairs become (2i, 2i + 1)
    assert torch.equal(out["transformer.layers.1.mlp.fc1.weight"][:128], sd["model.layers.1.mlp.up_proj.weight"])
    wq = sd["model.layers.0.self_attn.q_proj.weight"]
    wqkv = out["transformer.layers.0.mixer.Wqkv.weight"]
    assert torch.equal(wqkv[0], wq[0]) and torch.equal(wqkv[1], wq[8]) and torch.equal(wqkv[2], wq[1])
    wk = sd["model.layers.0.self_attn.k_proj.weight"]
    assert torch.equal(wqkv[64 + 16 + 1], wk[16 + 8])           # the second kv head's pair 0, second half
    back = llama.inv_remap_state_dict_hf_llama(out, cfg)
    for k, v in back.items():
        want = sd[k]
        assert torch.equal(v[:want.shape[0]], want), k
    assert set(back) == set(sd) - {"model.layers.0.self_attn.rotary_emb.inv_freq"}
    with pytest.raises(ValueError, match="keys not mapped"):
        llama.remap_state_dict_hf_llama({**sd, "model.extra.weight": torch.zeros(1)}, cfg)


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "torch"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_remap_matches_plain_llama(flash, tied):
    """GQA + rotary: the permutation undone and interleaved rotary give Hugging Face's model."""
    torch.manual_seed(4)
    lc = llama_cfg(tie_word_embeddings=tied)
    cfg = llama.llama_config_to_gpt2_config(lc)
    cfg.use_flash_attn = flash
    sd = hf_llama_state(lc)
    m = GPTLMHeadModel(cfg, dtype=F64)
    m.load_state_dict(llama.remap_state_dict_hf_llama(sd, cfg))
    ids = torch.randint(0, 89, (2, 10))
    assert torch.allclose(m.eval()(ids).logits, plain_llama(sd, lc, ids), **ROTARY_TOL)
    via = GPTLMHeadModel.from_pretrained("meta-llama/Llama-tiny", cfg, state_dict=sd, dtype=F64).eval()
    assert torch.allclose(via(ids).logits, m(ids).logits, atol=0, rtol=0)


def test_from_pretrained_gpt2_file(tmp_path):
    cfg = GPT2Config(**TINY)
    sd = hf_gpt2_state(cfg)
    path = tmp_path / "gpt2_tiny.bin"
    torch.save({f"transformer.{k}": v for k, v in sd.items()}, path)    # GPT2LMHeadModel's prefix
    m = GPTLMHeadModel.from_pretrained(str(path), cfg, dtype=F64).eval()
    ids = torch.randint(0, 97, (2, 6))
    assert torch.allclose(m(ids).logits, plain_gpt2(sd, cfg, ids), atol=1e-10, rtol=1e-9)
    again = GPTLMHeadModel.from_pretrained("any-name", cfg, state_dict=m.state_dict(), dtype=F64).eval()
    assert torch.equal(again(ids).logits, m(ids).logits)      # cuflash's own keys load as they are


# ---------------------------------------------------------------------------------------
# generation

def greedy_by_hand(m, prompt, max_length):
    ids = prompt
    with torch.no_grad():
        while ids.shape[1] < max_length:
            ids = torch.cat([ids, m(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


GEN_CASES = {
    "gpt2": dict(),
    "gqa_rotary16_fused": dict(n_positions=0, n_head_kv=2, rotary_emb_fraction=1.0),     # rotary dim 16
    "rotary8_interleaved": dict(rotary_emb_fraction=0.5, rotary_emb_interleaved=True),
    "parallel_block": dict(parallel_block=True, rotary_emb_fraction=1.0),
    # head dim 32, rotary 16 of it, interleaved, GQA: the GPU test's llama-like layout (fused decode path)
    "gqa_partial_rotary16_interleaved_swiglu": dict(n_embd=128, n_head_kv=2, rotary_emb_fraction=0.5,
                                                    rotary_emb_interleaved=True, n_positions=0, rms_norm=True,
                                                    activation_function="swiglu"),
}


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "torch"])
@pytest.mark.parametrize("case", sorted(GEN_CASES))
def test_greedy_generate_equals_stepping_by_hand(case, flash):
    torch.manual_seed(1)
    cfg = GPT2Config(**{**TINY, **GEN_CASES[case]}, use_flash_attn=flash, initializer_range=0.3)
    m = GPTLMHeadModel(cfg, dtype=F64).eval()
    prompt = torch.randint(0, 97, (2, 5))
    seq = m.generate(prompt, 12)
    assert seq.shape == (2, 12) and torch.equal(seq[:, :5], prompt)
    assert torch.equal(seq, greedy_by_hand(m, prompt, 12))
    out = m.generate(prompt, 9, return_dict_in_generate=True, output_scores=True)
    assert isinstance(out, generation.GreedySearchDecoderOnlyOutput) and len(out.scores) == 4
    with torch.no_grad():      # generate's sequences are inference-mode tensors
        full = m(out.sequences).logits
    for i, s in enumerate(out.scores):
        assert torch.allclose(s, full[:, 4 + i], atol=1e-10, rtol=1e-9), i


def test_generate_options():
    torch.manual_seed(2)
    m = GPTLMHeadModel(GPT2Config(**TINY, pad_vocab_size_multiple=8, initializer_range=0.3), dtype=F64).eval()
    prompt = torch.randint(0, 97, (2, 4))
    out = m.generate(prompt, 10, return_dict_in_generate=True)
    assert out.scores is None and out.sequences.shape == (2, 10)
    # vocab_size: the padded rows' logits dropped
    out = m.generate(prompt, 6, vocab_size=97, return_dict_in_generate=True, output_scores=True)
    assert all(s.shape == (2, 97) for s in out.scores)
    # teacher forcing: the teacher's tokens where it has them
    teacher = torch.randint(0, 97, (2, 8))
    seq = m.generate(prompt, 10, teacher_outputs=teacher)
    assert torch.equal(seq[:, 4:8], teacher[:, 4:8])
    assert torch.equal(seq, greedy_by_hand(m, seq[:, :8], 10))
    # eos: stops once every row's last token is eos
    first = m.generate(prompt, 5)[:, -1]
    if first[0] == first[1]:
        assert m.generate(prompt, 10, eos_token_id=int(first[0])).shape == (2, 5)
    # sampling: tokens within each step's top-k
    torch.manual_seed(3)
    out = m.generate(prompt, 10, top_k=3, temperature=0.7, return_dict_in_generate=True, output_scores=True)
    assert isinstance(out, generation.SampleDecoderOnlyOutput)
    for i, s in enumerate(out.scores):
        top = s.topk(3, dim=-1).indices
        assert (top == out.sequences[:, 4 + i, None]).any(-1).all()
    # repetition penalty and streamer run
    put = []
    streamer = types.SimpleNamespace(put=put.append, end=lambda: put.append("end"))
    seq = m.generate(prompt, 8, repetition_penalty=1.3, streamer=streamer)
    assert seq.shape == (2, 8) and put[-1] == "end" and len(put) == 1 + 4 + 1


def test_sampling_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]], dtype=F64))
    x = logits.clone()
    generation.modify_logits_for_top_p_filtering(x, 0.7)
    assert torch.isinf(x).tolist() == [[False, False, True, True], [True, True, False, False]]
    x = logits.clone()
    generation.modify_logits_for_top_p_filtering(x, 0.85)
    assert torch.isinf(x).sum().item() == 2
    x = logits.clone()
    generation.modify_logits_for_min_p_filtering(x, 0.5)
    assert torch.isinf(x).tolist() == [[False, False, True, True], [True, True, False, False]]
    assert generation.sample(logits, top_k=1).tolist() == [0, 3]
    torch.manual_seed(0)
    draws = torch.stack([generation.sample(logits, top_k=0, top_p=0.7) for _ in range(200)])
    assert set(draws[:, 0].tolist()) == {0, 1} and set(draws[:, 1].tolist()) == {2, 3}
    draws = torch.stack([generation.sample(logits, top_k=2) for _ in range(200)])
    assert set(draws[:, 0].tolist()) == {0, 1}
    draws = torch.stack([generation.sample(logits.bfloat16(), top_k=0, top_p=0.7, min_p=0.1) for _ in range(50)])
    assert set(draws[:, 0].tolist()) <= {0, 1} and set(draws[:, 1].tolist()) <= {2, 3}   # 16-bit logits: fp32 probs
    pen = generation.modify_logit_for_repetition_penalty(torch.tensor([[2.0, -2.0, 1.0]]), torch.tensor([[0, 1]]),
                                                         2.0)
    assert pen.tolist() == [[1.0, -4.0, 1.0]]


# ---------------------------------------------------------------------------------------
# embeddings and tensor-parallel state dicts

def test_embeddings():
    e = GPT2Embeddings(32, 50, 16, dtype=F64)
    ids = torch.randint(0, 50, (2, 7))
    want = e.word_embeddings.weight[ids] + e.position_embeddings.weight[:7]
    assert torch.equal(e(ids), want)
    assert torch.equal(e(ids, position_ids=torch.arange(2, 9)[None]),
                       e.word_embeddings.weight[ids] + e.position_embeddings.weight[2:9])
    none = GPT2Embeddings(32, 50, 0)
    assert not hasattr(none, "position_embeddings") and torch.equal(none(ids), none.word_embeddings(ids))
    proj = GPT2Embeddings(32, 50, 0, word_embed_proj_dim=8, padding_idx=0)
    assert proj(ids).shape == (2, 7, 32) and proj.word_embeddings.padding_idx == 0
    assert list(GPT2Embeddings(32, 50, 16).state_dict()) == ["word_embeddings.weight", "position_embeddings.weight"]
    v = VocabParallelEmbedding(50, 8)
    assert isinstance(v, torch.nn.Embedding) and v.weight.shape == (50, 8) and v(ids).shape == (2, 7, 8)
    assert ColumnParallelEmbedding(50, 8).weight.shape == (50, 8)
    with pytest.raises(ValueError, match="process_group"):
        ParallelGPT2Embeddings(32, 50, 16, None)
    with pytest.raises(ValueError, match="input_ids"):
        e(torch.randn(2, 7))


@pytest.mark.parametrize("act", ["gelu_new", "swiglu"])
def test_shard_and_combine_state_dict_tp(act):
    cfg = GPT2Config(**{**TINY, "vocab_size": 100}, n_head_kv=2, activation_function=act, n_inner=64)
    sd = {k: torch.randn_like(v) for k, v in GPTLMHeadModel(cfg).state_dict().items()}
    shards = [gpt.shard_state_dict_tp(sd, cfg, 2, r) for r in range(2)]
    assert shards[0]["transformer.embeddings.word_embeddings.weight"].shape == (50, 64)
    assert shards[1]["transformer.embeddings.position_embeddings.weight"].shape == (32, 32)
    assert shards[0]["transformer.layers.0.mixer.Wqkv.weight"].shape == (16 * (2 + 2 * 1), 64)
    assert shards[1]["transformer.layers.0.mixer.out_proj.weight"].shape == (64, 32)
    assert "transformer.layers.0.mixer.out_proj.bias" not in shards[1]
    assert "transformer.layers.0.mlp.fc2.bias" not in shards[1]
    fc1 = "transformer.layers.1.mlp.fc1.weight"
    if act == "swiglu":       # GatedMlp's hidden 64 rounded to multiple_of 128: y rows, then gate rows
        assert torch.equal(shards[1][fc1], torch.cat([sd[fc1][64:128], sd[fc1][192:256]]))
    else:
        assert torch.equal(shards[1][fc1], sd[fc1][32:64])
    back = gpt.combine_state_dicts_tp(shards, cfg)
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


# ---------------------------------------------------------------------------------------
# flash-attn 2.8's signatures (flash_attn/models/gpt.py, llama.py, modules/embedding.py,
# utils/generation.py)

SIGNATURES = {
    gpt.create_mixer_cls: ["config", ("layer_idx", None), ("process_group", None), ("device", None), ("dtype", None)],
    gpt.create_mlp_cls: ["config", ("layer_idx", None), ("process_group", None), ("device", None), ("dtype", None)],
    gpt.create_block: ["config", ("layer_idx", None), ("process_group", None), ("device", None), ("dtype", None)],
    GPTModel.__init__: ["self", "config", ("process_group", None), ("device", None), ("dtype", None)],
    GPTModel.forward: ["self", "input_ids", ("position_ids", None), ("inference_params", None)],
    GPTLMHeadModel.__init__: ["self", "config", ("process_group", None), ("device", None), ("dtype", None)],
    GPTLMHeadModel.forward: ["self", "input_ids", ("position_ids", None), ("inference_params", None),
                             ("num_last_tokens", 0)],
    gpt.remap_state_dict_hf_gpt2: ["state_dict", "config"],
    gpt.shard_state_dict_tp: ["state_dict", "config", "world_size", "rank"],
    llama.remap_state_dict_hf_llama: ["state_dict", "config"],
    llama.llama_config_to_gpt2_config: ["llama_config"],
    GPT2Embeddings.__init__: ["self", "embed_dim", "vocab_size", "max_position_embeddings", ("padding_idx", None),
                              ("word_embed_proj_dim", None), ("device", None), ("dtype", None)],
    GPT2Embeddings.forward: ["self", "input_ids", ("position_ids", None)],
    ParallelGPT2Embeddings.__init__: ["self", "embed_dim", "vocab_size", "max_position_embeddings", "process_group",
                                      ("padding_idx", None), ("sequence_parallel", True), ("device", None),
                                      ("dtype", None)],
    ParallelGPT2Embeddings.forward: ["self", "input_ids", ("position_ids", None), ("combine_batch_seqlen_dim", False)],
    generation.GenerationMixin.generate: ["self", "input_ids", "max_length", ("top_k", 1), ("top_p", 0.0),
                                          ("min_p", 0.0), ("temperature", 1.0), ("return_dict_in_generate", False),
                                          ("output_scores", False)],
    generation.decode: ["input_ids", "model", "max_length", ("top_k", 1), ("top_p", 0.0), ("min_p", 0.0),
                        ("temperature", 1.0), ("repetition_penalty", 1.0), ("eos_token_id", None),
                        ("teacher_outputs", None), ("vocab_size", None), ("cg", False), ("enable_timing", False),
                        ("output_scores", False), ("streamer", None)],
}


def test_flash_attn_signatures():
    for fn, spec in SIGNATURES.items():
        ps = [(p.name, p.default) for p in inspect.signature(fn).parameters.values()
              if p.kind == p.POSITIONAL_OR_KEYWORD]
        want = [(w, inspect.Parameter.empty) if isinstance(w, str) else w for w in spec]
        assert ps == want, fn.__qualname__
    assert issubclass(GPTLMHeadModel, generation.GenerationMixin)
    assert issubclass(GPTLMHeadModel, gpt.GPTPreTrainedModel) and issubclass(GPTModel, gpt.GPTPreTrainedModel)
