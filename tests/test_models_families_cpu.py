"""flash-attn's other decoder families on cuflash.models.gpt.GPTLMHeadModel without a GPU:
GPT-NeoX, GPT-J, OPT, Falcon and BigCode. For each, a random Hugging Face-style state dict goes
through the family's remap and its config through ``*_config_to_gpt2_config``; the model's
logits (float64, cuflash's attention running its float64 reference with use_flash_attn=True,
and the torch attention) must equal a plain-torch forward of that family written here from the
Hugging Face weights: partial half-split rotary and parallel / sequential residuals (NeoX),
partial interleaved rotary, tied-norm parallel blocks and the lm_head bias (GPT-J), learned
positions with OPT's offset of 2, pre- and post-norm, project_in / project_out (OPT), multi-query,
the new decoder architecture (GQA, two norms), sequential blocks and Falcon-RW's ALiBi ((q·k +
slope · key position) / sqrt(head_dim), Hugging Face's slopes written out) (Falcon), multi-query and
multi-head c_attn (BigCode). Plus the BigCode inverse remap, refused configs and unexpected keys.
The configs are SimpleNamespaces with the Hugging Face attribute names (transformers is not
installed)."""
import math
import types

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import cuflash  # noqa: E402
from cuflash.models import bigcode, falcon, gpt_neox, gptj, opt  # noqa: E402
from cuflash.models.gpt import GPTLMHeadModel  # noqa: E402

F64 = torch.float64
TOL = dict(atol=1e-9, rtol=1e-8)
D, H, L, V = 64, 4, 2, 97          # hidden, heads, layers, vocabulary
HD = D // H


def rnd(*shape, scale=0.3):
    return torch.randn(*shape, dtype=F64) * scale


def norm_params(sd, prefix, d=D):
    sd[prefix + "weight"] = 1.0 + rnd(d)
    sd[prefix + "bias"] = rnd(d)


def ln(x, sd, prefix, eps=1e-5):
    return F.layer_norm(x, (x.shape[-1],), sd[prefix + "weight"], sd[prefix + "bias"], eps)


def lin(x, sd, prefix, bias=True):
    return F.linear(x, sd[prefix + "weight"], sd.get(prefix + "bias") if bias else None)


def rotary(x, dim, interleaved, base=10000.0):
    """x (batch, seqlen, heads, head_dim): the first `dim` features rotated by position; tables
    in fp32 as the model computes them."""
    s = x.shape[1]
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    ang = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    cos, sin = ang.cos().to(F64)[None, :, None], ang.sin().to(F64)[None, :, None]
    r, rest = x[..., :dim], x[..., dim:]
    if interleaved:
        a, b = r[..., 0::2], r[..., 1::2]
        out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    else:
        a, b = r[..., :dim // 2], r[..., dim // 2:]
        out = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return torch.cat([out, rest], dim=-1)


def attention(q, k, v):
    """Causal softmax attention, (batch, seqlen, heads, head_dim); k, v with fewer heads serve
    consecutive groups of query heads."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    s = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).flatten(-2)


def run_model(cfg, sd, ids, flash):
    cfg.use_flash_attn = flash
    m = GPTLMHeadModel(cfg, dtype=F64)
    m.load_state_dict(sd)
    return m.eval()(ids).logits


def check(cfg, remapped, ids, want):
    for flash in (True, False):
        got = run_model(cfg, remapped, ids, flash)
        assert got.shape[-1] == math.ceil(V / cfg.pad_vocab_size_multiple) * cfg.pad_vocab_size_multiple
        assert torch.allclose(got[..., :V], want, **TOL), (flash, (got[..., :V] - want).abs().max())


def ids_(batch=3, seqlen=11):
    return torch.randint(0, V, (batch, seqlen))


# ---------------------------------------------------------------------------------------
# GPT-NeoX

def neox_state(c):
    sd = {"gpt_neox.embed_in.weight": rnd(V, D), "embed_out.weight": rnd(V, D)}
    norm_params(sd, "gpt_neox.final_layer_norm.")
    for i in range(L):
        p = f"gpt_neox.layers.{i}."
        norm_params(sd, p + "input_layernorm.")
        norm_params(sd, p + "post_attention_layernorm.")
        sd.update({p + "attention.query_key_value.weight": rnd(3 * D, D), p + "attention.query_key_value.bias": rnd(3 * D),
                   p + "attention.dense.weight": rnd(D, D), p + "attention.dense.bias": rnd(D),
                   p + "mlp.dense_h_to_4h.weight": rnd(c.intermediate_size, D),
                   p + "mlp.dense_h_to_4h.bias": rnd(c.intermediate_size),
                   p + "mlp.dense_4h_to_h.weight": rnd(D, c.intermediate_size), p + "mlp.dense_4h_to_h.bias": rnd(D),
                   p + "attention.bias": torch.ones(1, 1, 8, 8), p + "attention.masked_bias": torch.tensor(-1e9),
                   p + "attention.rotary_emb.inv_freq": torch.ones(4)})
    return sd


def neox_ref(sd, c, ids):
    x = sd["gpt_neox.embed_in.weight"][ids]
    rot = int(c.rotary_pct * HD)
    for i in range(L):
        p = f"gpt_neox.layers.{i}."
        h = ln(x, sd, p + "input_layernorm.", c.layer_norm_eps)
        qkv = lin(h, sd, p + "attention.query_key_value.").unflatten(-1, (H, 3, HD))
        q, k, v = qkv.unbind(3)
        q, k = rotary(q, rot, False, c.rotary_emb_base), rotary(k, rot, False, c.rotary_emb_base)
        a = lin(attention(q, k, v), sd, p + "attention.dense.")

        def mlp(t):
            return lin(F.gelu(lin(t, sd, p + "mlp.dense_h_to_4h.")), sd, p + "mlp.dense_4h_to_h.")
        if c.use_parallel_residual:
            x = x + a + mlp(ln(x, sd, p + "post_attention_layernorm.", c.layer_norm_eps))
        else:
            x = x + a
            x = x + mlp(ln(x, sd, p + "post_attention_layernorm.", c.layer_norm_eps))
    x = ln(x, sd, "gpt_neox.final_layer_norm.", c.layer_norm_eps)
    return x @ sd["embed_out.weight"].t()


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "sequential"])
def test_gpt_neox(parallel):
    c = types.SimpleNamespace(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H,
                              intermediate_size=80, hidden_act="gelu", rotary_pct=0.5, rotary_emb_base=500.0,
                              layer_norm_eps=1e-5, use_parallel_residual=parallel, tie_word_embeddings=False)
    cfg = gpt_neox.gpt_neox_config_to_gpt2_config(c)
    cfg.pad_vocab_size_multiple = 8
    assert cfg.parallel_block == parallel and cfg.rotary_emb_fraction == 0.5 and not cfg.rotary_emb_interleaved
    sd = neox_state(c)
    ids = ids_()
    check(cfg, gpt_neox.remap_state_dict_hf_gpt_neox(sd, cfg), ids, neox_ref(sd, c, ids))


# ---------------------------------------------------------------------------------------
# GPT-J

def gptj_state(c):
    sd = {"transformer.wte.weight": rnd(V, D), "lm_head.weight": rnd(V, D), "lm_head.bias": rnd(V)}
    norm_params(sd, "transformer.ln_f.")
    for i in range(L):
        p = f"transformer.h.{i}."
        norm_params(sd, p + "ln_1.")
        sd.update({p + f"attn.{n}_proj.weight": rnd(D, D) for n in "qkv"})
        sd.update({p + "attn.out_proj.weight": rnd(D, D), p + "mlp.fc_in.weight": rnd(4 * D, D),
                   p + "mlp.fc_in.bias": rnd(4 * D), p + "mlp.fc_out.weight": rnd(D, 4 * D),
                   p + "mlp.fc_out.bias": rnd(D), p + "attn.bias": torch.ones(1, 1, 8, 8),
                   p + "attn.masked_bias": torch.tensor(-1e9)})
    return sd


def gptj_ref(sd, c, ids):
    x = sd["transformer.wte.weight"][ids]
    for i in range(L):
        p = f"transformer.h.{i}."
        h = ln(x, sd, p + "ln_1.")
        q, k, v = (lin(h, sd, p + f"attn.{n}_proj.", bias=False).unflatten(-1, (H, HD)) for n in "qkv")
        q, k = rotary(q, c.rotary_dim, True), rotary(k, c.rotary_dim, True)
        a = lin(attention(q, k, v), sd, p + "attn.out_proj.", bias=False)
        m = lin(F.gelu(lin(h, sd, p + "mlp.fc_in."), approximate="tanh"), sd, p + "mlp.fc_out.")
        x = x + a + m
    return lin(ln(x, sd, "transformer.ln_f."), sd, "lm_head.")


def test_gptj():
    c = types.SimpleNamespace(vocab_size=V, n_embd=D, n_layer=L, n_head=H, n_inner=None, rotary_dim=8,
                              activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                              layer_norm_epsilon=1e-5, tie_word_embeddings=False)
    cfg = gptj.gptj_config_to_gpt2_config(c)
    cfg.pad_vocab_size_multiple = 8
    assert cfg.parallel_block_tied_norm and cfg.rotary_emb_interleaved and cfg.lm_head_bias
    sd = gptj_state(c)
    ids = ids_()
    remapped = gptj.remap_state_dict_hf_gptj(sd, cfg)
    assert (remapped["lm_head.bias"][V:] == 0).all()
    check(cfg, remapped, ids, gptj_ref(sd, c, ids))


# ---------------------------------------------------------------------------------------
# OPT

def opt_state(c, prefix="model.decoder."):
    w = c.word_embed_proj_dim
    sd = {prefix + "embed_tokens.weight": rnd(V, w), prefix + "embed_positions.weight": rnd(c.max_position_embeddings + 2, D),
          "lm_head.weight": None}
    if w != D:
        sd[prefix + "project_in.weight"] = rnd(D, w)
        sd[prefix + "project_out.weight"] = rnd(w, D)
    if c.do_layer_norm_before:
        norm_params(sd, prefix + "final_layer_norm.")
    for i in range(L):
        p = f"{prefix}layers.{i}."
        norm_params(sd, p + "self_attn_layer_norm.")
        norm_params(sd, p + "final_layer_norm.")
        for n in ("q", "k", "v", "out"):
            sd[p + f"self_attn.{n}_proj.weight"], sd[p + f"self_attn.{n}_proj.bias"] = rnd(D, D), rnd(D)
        sd.update({p + "fc1.weight": rnd(c.ffn_dim, D), p + "fc1.bias": rnd(c.ffn_dim), p + "fc2.weight": rnd(D, c.ffn_dim),
                   p + "fc2.bias": rnd(D)})
    sd["lm_head.weight"] = sd[prefix + "embed_tokens.weight"]
    return sd


def opt_ref(sd, c, ids, prefix="model.decoder."):
    x = sd[prefix + "embed_tokens.weight"][ids]
    if c.word_embed_proj_dim != D:
        x = lin(x, sd, prefix + "project_in.", bias=False)
    x = x + sd[prefix + "embed_positions.weight"][torch.arange(ids.shape[1]) + 2]
    for i in range(L):
        p = f"{prefix}layers.{i}."

        def attn(t):
            q, k, v = (lin(t, sd, p + f"self_attn.{n}_proj.").unflatten(-1, (H, HD)) for n in "qkv")
            return lin(attention(q, k, v), sd, p + "self_attn.out_proj.")

        def mlp(t):
            return lin(F.relu(lin(t, sd, p + "fc1.")), sd, p + "fc2.")
        if c.do_layer_norm_before:
            x = x + attn(ln(x, sd, p + "self_attn_layer_norm."))
            x = x + mlp(ln(x, sd, p + "final_layer_norm."))
        else:
            x = ln(x + attn(x), sd, p + "self_attn_layer_norm.")
            x = ln(x + mlp(x), sd, p + "final_layer_norm.")
    if c.do_layer_norm_before:
        x = ln(x, sd, prefix + "final_layer_norm.")
    if c.word_embed_proj_dim != D:
        x = lin(x, sd, prefix + "project_out.", bias=False)
    return x @ sd[prefix + "embed_tokens.weight"].t()


@pytest.mark.parametrize("prenorm, proj, prefix", [(True, D, "model.decoder."), (False, 48, "decoder.")],
                         ids=["opt-prenorm", "opt-350m-like"])
def test_opt(prenorm, proj, prefix):
    c = types.SimpleNamespace(vocab_size=V, max_position_embeddings=16, hidden_size=D, num_hidden_layers=L,
                              num_attention_heads=H, ffn_dim=96, activation_function="relu", dropout=0.0,
                              attention_dropout=0.0, init_std=0.02, do_layer_norm_before=prenorm,
                              word_embed_proj_dim=proj, layerdrop=0.0, layer_norm_elementwise_affine=True)
    cfg = opt.opt_config_to_gpt2_config(c)
    assert cfg.prenorm == prenorm and cfg.word_embed_proj_dim == (None if proj == D else proj)
    sd = opt_state(c, prefix)
    ids = ids_(seqlen=16)                          # every position of the table
    remapped = opt.remap_state_dict_hf_opt(sd, cfg)
    assert remapped["transformer.embeddings.position_embeddings.weight"].shape == (16, D)
    check(cfg, remapped, ids, opt_ref(sd, c, ids, prefix))


# ---------------------------------------------------------------------------------------
# Falcon

def falcon_state(c, kind, n_kv):
    sd = {"transformer.word_embeddings.weight": rnd(V, D), "lm_head.weight": None}
    norm_params(sd, "transformer.ln_f.")
    for i in range(L):
        p = f"transformer.h.{i}."
        names = {"7b": ["input_layernorm."], "new": ["ln_attn.", "ln_mlp."],
                 "seq": ["input_layernorm.", "post_attention_layernorm."]}[kind]
        for n in names:
            norm_params(sd, p + n)
        sd.update({p + "self_attention.query_key_value.weight": rnd((H + 2 * n_kv) * HD, D),
                   p + "self_attention.dense.weight": rnd(D, D), p + "mlp.dense_h_to_4h.weight": rnd(4 * D, D),
                   p + "mlp.dense_4h_to_h.weight": rnd(D, 4 * D)})
    sd["lm_head.weight"] = sd["transformer.word_embeddings.weight"]
    return sd


def falcon_ref(sd, kind, n_kv, ids):
    x = sd["transformer.word_embeddings.weight"][ids]
    per = H // n_kv
    for i in range(L):
        p = f"transformer.h.{i}."

        def attn(t):
            qkv = lin(t, sd, p + "self_attention.query_key_value.", bias=False).unflatten(-1, (n_kv, per + 2, HD))
            q = qkv[..., :per, :].flatten(2, 3)          # (b, s, n_kv * per, hd): group g's heads together
            k, v = qkv[..., per, :], qkv[..., per + 1, :]
            q, k = rotary(q, HD, False), rotary(k, HD, False)
            return lin(attention(q, k, v), sd, p + "self_attention.dense.", bias=False)

        def mlp(t):
            return lin(F.gelu(lin(t, sd, p + "mlp.dense_h_to_4h.", bias=False)), sd, p + "mlp.dense_4h_to_h.", bias=False)
        if kind == "7b":
            h = ln(x, sd, p + "input_layernorm.")
            x = x + attn(h) + mlp(h)
        elif kind == "new":
            x = x + attn(ln(x, sd, p + "ln_attn.")) + mlp(ln(x, sd, p + "ln_mlp."))
        else:
            x = x + attn(ln(x, sd, p + "input_layernorm."))
            x = x + mlp(ln(x, sd, p + "post_attention_layernorm."))
    return ln(x, sd, "transformer.ln_f.") @ sd["transformer.word_embeddings.weight"].t()


def falcon_rw_state(d):
    """Falcon-RW (alibi=True): sequential blocks, biases, per-head [q, k, v] rows (multi_query off)."""
    sd = {"transformer.word_embeddings.weight": rnd(V, d)}
    norm_params(sd, "transformer.ln_f.", d)
    for i in range(L):
        p = f"transformer.h.{i}."
        norm_params(sd, p + "input_layernorm.", d)
        norm_params(sd, p + "post_attention_layernorm.", d)
        sd.update({p + "self_attention.query_key_value.weight": rnd(3 * d, d),
                   p + "self_attention.query_key_value.bias": rnd(3 * d),
                   p + "self_attention.dense.weight": rnd(d, d), p + "self_attention.dense.bias": rnd(d),
                   p + "mlp.dense_h_to_4h.weight": rnd(4 * d, d), p + "mlp.dense_h_to_4h.bias": rnd(4 * d),
                   p + "mlp.dense_4h_to_h.weight": rnd(d, 4 * d), p + "mlp.dense_4h_to_h.bias": rnd(d)})
    return sd


def bloom_slopes(heads):
    """Hugging Face's build_alibi_tensor slopes (Bloom / Falcon), written out: the closest power of
    two below, then odd powers of the next base for the rest."""
    closest = 2 ** math.floor(math.log2(heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base ** p for p in range(1, closest + 1)]
    if closest != heads:
        extra = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** p for p in range(1, 1 + 2 * (heads - closest), 2)]
    return torch.tensor(slopes, dtype=F64)


def falcon_rw_ref(sd, heads, d, ids):
    """Hugging Face Falcon's eager ALiBi attention: (q·k + slope · key position) / sqrt(head_dim),
    causal; no rotary."""
    hd = d // heads
    x = sd["transformer.word_embeddings.weight"][ids]
    s = ids.shape[1]
    alibi = bloom_slopes(heads)[:, None, None] * torch.arange(s, dtype=F64)[None, None, :]
    for i in range(L):
        p = f"transformer.h.{i}."
        qkv = lin(ln(x, sd, p + "input_layernorm."), sd, p + "self_attention.query_key_value.")
        q, k, v = (t.transpose(1, 2) for t in qkv.unflatten(-1, (heads, 3, hd)).unbind(3))
        scores = (q @ k.transpose(-1, -2) + alibi) / math.sqrt(hd)
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
        x = x + lin((scores.softmax(-1) @ v).transpose(1, 2).flatten(-2), sd, p + "self_attention.dense.")
        t = ln(x, sd, p + "post_attention_layernorm.")
        x = x + lin(F.gelu(lin(t, sd, p + "mlp.dense_h_to_4h.")), sd, p + "mlp.dense_4h_to_h.")
    return ln(x, sd, "transformer.ln_f.") @ sd["transformer.word_embeddings.weight"].t()


@pytest.mark.parametrize("heads, d", [(4, D), (8, D), (6, 48)], ids=["4-heads", "8-heads", "6-heads"])
def test_falcon_rw_alibi(heads, d):
    """Falcon-RW's ALiBi (alibi=True): the converted config has no rotary, use_alibi with the
    slopes times 1 / sqrt(head_dim), use_flash_attn; the logits equal Hugging Face's eager
    formula (its slopes written out too, a non-power-of-two head count included)."""
    c = types.SimpleNamespace(vocab_size=V, hidden_size=d, num_hidden_layers=L, num_attention_heads=heads,
                              multi_query=False, new_decoder_architecture=False, parallel_attn=False, bias=True,
                              alibi=True, layer_norm_epsilon=1e-5, hidden_dropout=0.0, attention_dropout=0.0)
    cfg = falcon.falcon_config_to_gpt2_config(c)
    assert cfg.use_alibi and cfg.use_flash_attn and cfg.rotary_emb_fraction == 0.0 and not cfg.parallel_block
    assert cfg.alibi_slope_scale == (d // heads) ** -0.5 and cfg.n_head_kv == heads
    from cuflash.modules.mha import get_alibi_slopes
    assert torch.allclose(torch.tensor(get_alibi_slopes(heads), dtype=F64), bloom_slopes(heads), rtol=1e-15)
    sd = falcon_rw_state(d)
    ids = ids_(seqlen=13)
    got = run_model(cfg, falcon.remap_state_dict_hf_falcon(sd, cfg), ids, True)
    want = falcon_rw_ref(sd, heads, d, ids)
    # the kernels take fp32 slopes: slope / sqrt(head_dim) rounded to fp32 (relative 6e-8) moves the logits ~1e-8
    assert torch.allclose(got[..., :V], want, atol=1e-6, rtol=1e-6), (got[..., :V] - want).abs().max()
    # the plain ALiBi slopes (no 1 / sqrt(head_dim)) would be another model: the check has teeth
    cfg.alibi_slope_scale = 1.0
    assert not torch.allclose(run_model(cfg, falcon.remap_state_dict_hf_falcon(sd, cfg), ids, True)[..., :V], want,
                              atol=1e-3)


@pytest.mark.parametrize("kind, n_kv", [("7b", 1), ("new", 2), ("seq", 4)], ids=["mqa-7b", "new-arch-gqa", "sequential"])
def test_falcon(kind, n_kv):
    c = types.SimpleNamespace(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H,
                              num_kv_heads=n_kv, multi_query=(n_kv == 1), new_decoder_architecture=(kind == "new"),
                              parallel_attn=(kind != "seq"), bias=False, alibi=False, layer_norm_epsilon=1e-5,
                              hidden_dropout=0.0, attention_dropout=0.0)
    cfg = falcon.falcon_config_to_gpt2_config(c)
    assert cfg.n_head_kv == n_kv and cfg.parallel_block == (kind != "seq")
    assert cfg.parallel_block_tied_norm == (kind == "7b")
    sd = falcon_state(c, kind, n_kv)
    ids = ids_()
    check(cfg, falcon.remap_state_dict_hf_falcon(sd, cfg), ids, falcon_ref(sd, kind, n_kv, ids))


# ---------------------------------------------------------------------------------------
# BigCode

def bigcode_state(mq, npos=16):
    kv = HD if mq else D
    sd = {"transformer.wte.weight": rnd(V, D), "transformer.wpe.weight": rnd(npos, D), "lm_head.weight": None,
          "transformer.bias": torch.ones(npos, npos)}
    norm_params(sd, "transformer.ln_f.")
    for i in range(L):
        p = f"transformer.h.{i}."
        norm_params(sd, p + "ln_1.")
        norm_params(sd, p + "ln_2.")
        sd.update({p + "attn.c_attn.weight": rnd(D + 2 * kv, D), p + "attn.c_attn.bias": rnd(D + 2 * kv),
                   p + "attn.c_proj.weight": rnd(D, D), p + "attn.c_proj.bias": rnd(D),
                   p + "mlp.c_fc.weight": rnd(4 * D, D), p + "mlp.c_fc.bias": rnd(4 * D),
                   p + "mlp.c_proj.weight": rnd(D, 4 * D), p + "mlp.c_proj.bias": rnd(D)})
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    return sd


def bigcode_ref(sd, mq, ids):
    x = sd["transformer.wte.weight"][ids] + sd["transformer.wpe.weight"][torch.arange(ids.shape[1])]
    for i in range(L):
        p = f"transformer.h.{i}."
        c = lin(ln(x, sd, p + "ln_1."), sd, p + "attn.c_attn.")
        if mq:
            q, k, v = c.split([D, HD, HD], dim=-1)
            q, k, v = q.unflatten(-1, (H, HD)), k[..., None, :], v[..., None, :]
        else:
            q, k, v = c.unflatten(-1, (H, 3 * HD)).split(HD, dim=-1)
        x = x + lin(attention(q, k, v), sd, p + "attn.c_proj.")
        m = F.gelu(lin(ln(x, sd, p + "ln_2."), sd, p + "mlp.c_fc."), approximate="tanh")
        x = x + lin(m, sd, p + "mlp.c_proj.")
    return ln(x, sd, "transformer.ln_f.") @ sd["transformer.wte.weight"].t()


@pytest.mark.parametrize("mq", [True, False], ids=["mqa", "mha"])
def test_bigcode_and_inverse(mq):
    c = types.SimpleNamespace(vocab_size=V, n_positions=16, n_embd=D, n_layer=L, n_head=H, n_inner=None,
                              activation_function="gelu_pytorch_tanh", resid_pdrop=0.0, embd_pdrop=0.0,
                              attn_pdrop=0.0, layer_norm_epsilon=1e-5, multi_query=mq)
    cfg = bigcode.bigcode_config_to_gpt2_config(c)
    cfg.pad_vocab_size_multiple = 8
    assert cfg.n_head_kv == (1 if mq else None)
    sd = bigcode_state(mq)
    ids = ids_()
    remapped = bigcode.remap_state_dict_hf_bigcode(sd, cfg)
    check(cfg, remapped, ids, bigcode_ref(sd, mq, ids))
    back = bigcode.inv_remap_state_dict_hf_bigcode(remapped, cfg)
    want = {k: v for k, v in sd.items() if k not in ("transformer.bias", "lm_head.weight")}
    assert set(back) == set(want)
    assert all(torch.equal(back[k], want[k]) for k in want)
    if mq:          # flash-attn's layout: k and v tiled to every head
        tiled = dict(remapped)
        for i in range(L):
            for kind in ("weight", "bias"):
                key = f"transformer.layers.{i}.mixer.Wqkv.{kind}"
                q, k, v = tiled[key].split([D, HD, HD])
                reps = (H,) + (1,) * (k.dim() - 1)
                tiled[key] = torch.cat([q, k.repeat(*reps), v.repeat(*reps)])
        back = bigcode.inv_remap_state_dict_hf_bigcode(tiled, cfg)
        assert all(torch.equal(back[k], want[k]) for k in want)


# ---------------------------------------------------------------------------------------
# refusals

def test_refused_configs_and_keys():
    with pytest.raises(cuflash.UnsupportedFeature, match="rope_scaling"):
        falcon.falcon_config_to_gpt2_config(types.SimpleNamespace(vocab_size=V, hidden_size=D,
                                                                  rope_scaling={"type": "linear", "factor": 2.0}))
    with pytest.raises(ValueError, match="opt_config.layerdrop"):
        opt.opt_config_to_gpt2_config(types.SimpleNamespace(layerdrop=0.1))
    with pytest.raises(ValueError, match="gpt_neox_config.vocab_size"):
        gpt_neox.gpt_neox_config_to_gpt2_config(types.SimpleNamespace(hidden_size=D))
    with pytest.raises(cuflash.UnsupportedFeature, match="rope_scaling"):
        gpt_neox.gpt_neox_config_to_gpt2_config(types.SimpleNamespace(rope_scaling={"type": "linear"}))
    c = types.SimpleNamespace(vocab_size=V, n_embd=D, n_layer=L, n_head=H, rotary_dim=8)
    cfg = gptj.gptj_config_to_gpt2_config(c)
    sd = gptj_state(c)
    sd["transformer.h.0.attn.extra.weight"] = rnd(2)
    with pytest.raises(ValueError, match="transformer.h.0.attn.extra.weight"):
        gptj.remap_state_dict_hf_gptj(sd, cfg)
