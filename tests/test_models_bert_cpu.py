"""cuflash.models.bert (flash-attn's BERT) without a GPU: torch CPU tensors, cuflash's attention
running the float64 reference (use_flash_attn=True: the unpadded varlen path) or the torch
attention on the padded batch. The models against a plain-torch BERT written here from Hugging
Face-style state dicts (through remap_state_dict, so the remap is checked by the outputs), padded
batches with random lengths (1 and full included), gradients, the pretraining heads and losses,
dense_seq_output / last_layer_subset, the inverse remap, the varlen path actually taken (every
layer sees only the kept tokens), refused configs and flash-attn's signatures."""
import inspect
import math
import types

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import cuflash  # noqa: E402
from cuflash.models import bert  # noqa: E402
from cuflash.models.bert import BertConfig, BertForPreTraining, BertModel  # noqa: E402
from cuflash.modules.embedding import BertEmbeddings  # noqa: E402

F64 = torch.float64
TINY = dict(vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
            max_position_embeddings=40, type_vocab_size=2, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)


def hf_bert_state(cfg, dtype=F64, old_names=False) -> dict:
    """A random Hugging Face BertForPreTraining state dict (norm weights around 1)."""
    d, v, inner = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    ln = ("gamma", "beta") if old_names else ("weight", "bias")
    shapes = {"bert.embeddings.word_embeddings.weight": (v, d),
              "bert.embeddings.position_embeddings.weight": (cfg.max_position_embeddings, d),
              "bert.embeddings.token_type_embeddings.weight": (cfg.type_vocab_size, d),
              f"bert.embeddings.LayerNorm.{ln[0]}": (d,), f"bert.embeddings.LayerNorm.{ln[1]}": (d,),
              "bert.pooler.dense.weight": (d, d), "bert.pooler.dense.bias": (d,),
              "cls.predictions.bias": (v,), "cls.predictions.transform.dense.weight": (d, d),
              "cls.predictions.transform.dense.bias": (d,),
              f"cls.predictions.transform.LayerNorm.{ln[0]}": (d,), f"cls.predictions.transform.LayerNorm.{ln[1]}": (d,),
              "cls.seq_relationship.weight": (2, d), "cls.seq_relationship.bias": (2,)}
    for i in range(cfg.num_hidden_layers):
        p = f"bert.encoder.layer.{i}."
        for n in ("query", "key", "value"):
            shapes[f"{p}attention.self.{n}.weight"] = (d, d)
            shapes[f"{p}attention.self.{n}.bias"] = (d,)
        shapes.update({p + "attention.output.dense.weight": (d, d), p + "attention.output.dense.bias": (d,),
                       f"{p}attention.output.LayerNorm.{ln[0]}": (d,), f"{p}attention.output.LayerNorm.{ln[1]}": (d,),
                       p + "intermediate.dense.weight": (inner, d), p + "intermediate.dense.bias": (inner,),
                       p + "output.dense.weight": (d, inner), p + "output.dense.bias": (d,),
                       f"{p}output.LayerNorm.{ln[0]}": (d,), f"{p}output.LayerNorm.{ln[1]}": (d,)})
    sd = {}
    for k, shape in shapes.items():
        t = torch.randn(shape, dtype=dtype) * 0.3
        if "LayerNorm" in k and k.endswith(ln[0]):
            t = 1.0 + t
        sd[k] = t
    sd["cls.predictions.decoder.weight"] = sd["bert.embeddings.word_embeddings.weight"]
    sd["bert.embeddings.position_ids"] = torch.arange(cfg.max_position_embeddings)[None]   # a buffer HF saves
    return sd


def plain_bert(sd, cfg, ids, types_, mask):
    """BERT in torch ops from a Hugging Face state dict: (sequence output, pooled, MLM logits, NSP
    logits). mask: bool (batch, seqlen), the padded keys get -inf."""
    d, h, eps = cfg.hidden_size, cfg.num_attention_heads, cfg.layer_norm_eps
    gelu = partial_gelu(cfg)
    e = "bert.embeddings."
    x = sd[e + "word_embeddings.weight"][ids] + sd[e + "position_embeddings.weight"][torch.arange(ids.shape[1])]
    x = F.layer_norm(x + sd[e + "token_type_embeddings.weight"][types_], (d,), sd[e + "LayerNorm.weight"],
                     sd[e + "LayerNorm.bias"], eps)
    bias = torch.zeros(mask.shape, dtype=x.dtype).masked_fill(~mask, float("-inf"))[:, None, None, :]
    for i in range(cfg.num_hidden_layers):
        p = f"bert.encoder.layer.{i}."
        q, k, v = (F.linear(x, sd[f"{p}attention.self.{n}.weight"], sd[f"{p}attention.self.{n}.bias"])
                   .unflatten(-1, (h, d // h)).transpose(1, 2) for n in ("query", "key", "value"))
        att = ((q @ k.transpose(-1, -2)) / math.sqrt(d // h) + bias).softmax(-1) @ v
        a = F.linear(att.transpose(1, 2).flatten(-2), sd[p + "attention.output.dense.weight"],
                     sd[p + "attention.output.dense.bias"])
        x = F.layer_norm(a + x, (d,), sd[p + "attention.output.LayerNorm.weight"],
                         sd[p + "attention.output.LayerNorm.bias"], eps)
        m = gelu(F.linear(x, sd[p + "intermediate.dense.weight"], sd[p + "intermediate.dense.bias"]))
        m = F.linear(m, sd[p + "output.dense.weight"], sd[p + "output.dense.bias"])
        x = F.layer_norm(m + x, (d,), sd[p + "output.LayerNorm.weight"], sd[p + "output.LayerNorm.bias"], eps)
    pooled = torch.tanh(F.linear(x[:, 0], sd["bert.pooler.dense.weight"], sd["bert.pooler.dense.bias"]))
    t = "cls.predictions.transform."
    y = F.layer_norm(gelu(F.linear(x, sd[t + "dense.weight"], sd[t + "dense.bias"])), (d,),
                     sd[t + "LayerNorm.weight"], sd[t + "LayerNorm.bias"], eps)
    mlm = F.linear(y, sd["bert.embeddings.word_embeddings.weight"], sd["cls.predictions.bias"])
    nsp = F.linear(pooled, sd["cls.seq_relationship.weight"], sd["cls.seq_relationship.bias"])
    return x, pooled, mlm, nsp


def partial_gelu(cfg):
    approximate = "tanh" if cfg.hidden_act in ("gelu_new", "gelu_fast", "gelu_pytorch_tanh") else "none"
    return lambda t: F.gelu(t, approximate=approximate)


def batch(cfg, lengths, seqlen):
    b = len(lengths)
    ids = torch.randint(1, cfg.vocab_size, (b, seqlen))
    types_ = torch.randint(0, cfg.type_vocab_size, (b, seqlen))
    mask = torch.arange(seqlen)[None] < torch.tensor(lengths)[:, None]
    return ids, types_, mask


def pretraining_model(cfg, sd, dtype=F64):
    m = BertForPreTraining(cfg).to(dtype)
    m.load_state_dict(bert.remap_state_dict(sd, cfg))
    return m.eval()


LENGTHS = [13, 1, 7, 13, 4]


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("flash", [True, False], ids=["flash", "torch"])
@pytest.mark.parametrize("act", ["gelu", "gelu_new"])
def test_pretraining_matches_plain_torch(flash, dtype, act):
    cfg = BertConfig(**TINY, hidden_act=act, use_flash_attn=flash)
    sd = hf_bert_state(cfg, dtype)
    m = pretraining_model(cfg, sd, dtype)
    ids, types_, mask = batch(cfg, LENGTHS, 13)
    out = m(ids, token_type_ids=types_, attention_mask=mask)
    assert isinstance(out, bert.BertForPreTrainingOutput) and out.loss is None
    assert out.prediction_logits.shape == (5, 13, 101) and out.seq_relationship_logits.shape == (5, 2)
    x, pooled, mlm, nsp = plain_bert(sd, cfg, ids, types_, mask)
    tol = dict(atol=1e-10, rtol=1e-9) if dtype == F64 else dict(atol=2e-4, rtol=1e-4)
    assert torch.allclose(out.prediction_logits[mask], mlm[mask], **tol)
    assert torch.allclose(out.seq_relationship_logits, nsp, **tol)
    h = m.bert(ids, token_type_ids=types_, attention_mask=mask)
    assert torch.allclose(h.last_hidden_state[mask], x[mask], **tol)
    assert torch.allclose(h.pooler_output, pooled, **tol)
    if flash:      # the unpadded path: zeros at the padding
        assert (h.last_hidden_state[~mask] == 0).all()


def test_no_mask_and_full_rows():
    cfg = BertConfig(**TINY, use_flash_attn=True)
    sd = hf_bert_state(cfg)
    m = pretraining_model(cfg, sd)
    ids, types_, mask = batch(cfg, [9, 9], 9)
    x, pooled, mlm, nsp = plain_bert(sd, cfg, ids, types_, mask)
    for kw in ({}, {"attention_mask": mask}):
        out = m(ids, token_type_ids=types_, **kw)
        assert torch.allclose(out.prediction_logits, mlm, atol=1e-10, rtol=1e-9)
    out = m(ids)        # token types default to 0
    assert torch.allclose(out.prediction_logits, plain_bert(sd, cfg, ids, torch.zeros_like(ids), mask)[2],
                          atol=1e-10, rtol=1e-9)


def test_gradients_match_plain_torch():
    cfg = BertConfig(**TINY, use_flash_attn=True)
    sd = hf_bert_state(cfg)
    m = pretraining_model(cfg, sd)
    ids, types_, mask = batch(cfg, [8, 1, 5], 8)
    sd = {k: v.requires_grad_() if v.is_floating_point() else v for k, v in sd.items()}
    sd["cls.predictions.decoder.weight"] = sd["bert.embeddings.word_embeddings.weight"]
    dmlm = torch.randn(3, 8, 101, dtype=F64) * mask[..., None]
    dnsp = torch.randn(3, 2, dtype=F64)
    out = m(ids, token_type_ids=types_, attention_mask=mask)
    ((out.prediction_logits * dmlm).sum() + (out.seq_relationship_logits * dnsp).sum()).backward()
    _, _, mlm, nsp = plain_bert(sd, cfg, ids, types_, mask)
    ((mlm * dmlm).sum() + (nsp * dnsp).sum()).backward()
    params = dict(m.named_parameters())
    d = cfg.hidden_size
    pairs = [("bert.embeddings.word_embeddings.weight", sd["bert.embeddings.word_embeddings.weight"].grad),
             ("bert.encoder.layers.0.mixer.Wqkv.weight",
              torch.cat([sd[f"bert.encoder.layer.0.attention.self.{n}.weight"].grad for n in ("query", "key", "value")])),
             ("bert.encoder.layers.1.mlp.fc2.weight", sd["bert.encoder.layer.1.output.dense.weight"].grad),
             ("bert.encoder.layers.0.norm1.weight", sd["bert.encoder.layer.0.attention.output.LayerNorm.weight"].grad),
             ("bert.emb_ln.bias", sd["bert.embeddings.LayerNorm.bias"].grad),
             ("bert.pooler.dense.weight", sd["bert.pooler.dense.weight"].grad)]
    for name, want in pairs:
        got = params[name].grad
        assert got.shape[-1] == want.shape[-1] and torch.allclose(got, want, atol=1e-9, rtol=1e-8), name
    assert d == 64


def test_losses_and_dense_seq_output_and_last_layer_subset():
    ids_cfg = BertConfig(**TINY, use_flash_attn=True)
    sd = hf_bert_state(ids_cfg)
    ids, types_, mask = batch(ids_cfg, [11, 1, 6, 11], 11)
    labels = torch.where((torch.rand(ids.shape) < 0.3) & mask, torch.randint(1, 101, ids.shape), 0)
    labels[0, 3] = 5                 # at least one masked token
    labels[:, 0] = 0
    nsl = torch.tensor([0, 1, -1, 1])
    x, pooled, mlm, nsp = plain_bert(sd, ids_cfg, ids, types_, mask)
    keep = labels > 0
    want = (F.cross_entropy(mlm[keep], labels[keep]) + F.cross_entropy(nsp, nsl, ignore_index=-1))
    results = {}
    for flash in (True, False):
        for extra in ({}, {"dense_seq_output": True}, {"dense_seq_output": True, "last_layer_subset": True},
                      {"use_xentropy": True}):
            cfg = BertConfig(**TINY, use_flash_attn=flash, **extra)
            m = pretraining_model(cfg, sd)
            out = m(ids, token_type_ids=types_, attention_mask=mask, labels=labels, next_sentence_label=nsl)
            assert out.loss.dtype == torch.float32
            assert torch.allclose(out.loss.double(), want, atol=1e-6, rtol=1e-6), (flash, extra)
            assert torch.allclose(out.seq_relationship_logits, nsp, atol=1e-10, rtol=1e-9), (flash, extra)
            if extra.get("dense_seq_output"):
                assert out.prediction_logits.shape == (int(keep.sum()), 101)
                assert torch.allclose(out.prediction_logits, mlm[keep], atol=1e-10, rtol=1e-9), (flash, extra)
            results[(flash, tuple(extra))] = out.loss
    cfg = BertConfig(**TINY, use_flash_attn=True, dense_seq_output=True, last_layer_subset=True)
    m = pretraining_model(cfg, sd)
    assert {"bert.encoder.layers.1.mixer.Wq.weight", "bert.encoder.layers.1.mixer.Wkv.weight"} <= set(m.state_dict())


def test_last_layer_subset_runs_last_layer_on_subset_only():
    cfg = BertConfig(**TINY, use_flash_attn=True, dense_seq_output=True, last_layer_subset=True)
    sd = hf_bert_state(cfg)
    m = pretraining_model(cfg, sd)
    ids, types_, mask = batch(cfg, [10, 3, 10], 10)
    labels = torch.zeros_like(ids)
    labels[0, 4], labels[2, 9], labels[2, 1] = 7, 8, 9
    rows = {}
    for i, name in ((0, "first"), (1, "last")):
        m.bert.encoder.layers[i].mlp.fc1.register_forward_hook(
            lambda mod, a, o, _name=name: rows.__setitem__(_name, a[0].shape))
    m(ids, token_type_ids=types_, attention_mask=mask, labels=labels)
    assert rows["first"] == (23, 64)           # the kept tokens
    assert rows["last"] == (3 + 3, 64)         # the masked tokens and each row's first


def test_varlen_path_taken():
    """With use_flash_attn and a mask, every layer runs on the packed kept tokens through the
    varlen attention (cu_seqlens), never on the padding."""
    cfg = BertConfig(**TINY, use_flash_attn=True)
    m = BertModel(cfg).to(F64).eval()
    ids, types_, mask = batch(cfg, [13, 1, 7], 13)
    seen, calls = [], []
    for layer in m.encoder.layers:
        layer.mlp.fc1.register_forward_hook(lambda mod, a, o: seen.append(tuple(a[0].shape)))
        inner = layer.mixer.inner_attn
        orig = inner.forward

        def spy(qkv, *a, _orig=orig, **kw):
            calls.append((tuple(qkv.shape), kw.get("cu_seqlens")))
            return _orig(qkv, *a, **kw)
        inner.forward = spy
    m(ids, token_type_ids=types_, attention_mask=mask)
    assert seen == [(21, 64)] * 2
    assert [c[0] for c in calls] == [(21, 3, 4, 16)] * 2
    assert all(c[1].tolist() == [0, 13, 14, 21] for c in calls)


def test_encoder_trusts_its_own_cu_seqlens():
    """The encoder's varlen calls run inside cuflash.api.trusted_cu_seqlens (no read-back of
    unpad_input's offsets); the context is left afterwards, and it makes GPU offsets unread."""
    from cuflash import api
    cfg = BertConfig(**TINY, use_flash_attn=True)
    m = BertModel(cfg).to(F64).eval()
    seen = []
    inner = m.encoder.layers[0].mixer.inner_attn
    orig = inner.forward

    def spy(*a, **kw):
        seen.append(api._TRUSTED_CU_SEQLENS.get())
        return orig(*a, **kw)
    inner.forward = spy
    ids, types_, mask = batch(cfg, [5, 2], 5)
    m(ids, attention_mask=mask)
    assert seen == [True] and not api._TRUSTED_CU_SEQLENS.get()
    m(ids)                                  # no mask: no unpadding, no varlen call
    assert seen == [True, False]
    gpu_like = types.SimpleNamespace()
    assert not api._values_unreadable(gpu_like, "cupy")
    with api.trusted_cu_seqlens():
        assert api._values_unreadable(gpu_like, "cupy")
        assert not api._values_unreadable(gpu_like, "numpy")      # host offsets are always read
    assert not api._values_unreadable(gpu_like, "cupy")


def test_rotary_flash_matches_torch_path():
    cfg_kw = dict(TINY, position_embedding_type="rotary", rotary_emb_dim=8, max_position_embeddings=0)
    sd = BertModel(BertConfig(**cfg_kw)).to(F64).state_dict()
    outs = []
    ids, types_, mask = batch(BertConfig(**TINY), LENGTHS, 13)
    for flash in (True, False):
        m = BertModel(BertConfig(**cfg_kw, use_flash_attn=flash)).to(F64).eval()
        m.load_state_dict(sd)
        outs.append(m(ids, token_type_ids=types_, attention_mask=mask).last_hidden_state[mask])
    assert torch.allclose(outs[0], outs[1], atol=1e-10, rtol=1e-9)
    assert m.encoder.layers[0].mixer.rotary_emb_dim == 8


def test_inv_remap_round_trip_and_padded_vocab():
    cfg = BertConfig(**TINY, pad_vocab_size_multiple=8)
    sd = hf_bert_state(cfg)
    ours = bert.remap_state_dict(sd, cfg)
    assert ours["bert.embeddings.word_embeddings.weight"].shape == (104, 64)
    assert (ours["cls.predictions.decoder.bias"][101:] == -100).all()
    m = BertForPreTraining(cfg).to(F64)
    m.load_state_dict(ours)
    assert cfg.vocab_size == 101                   # the config is not modified
    back = bert.inv_remap_state_dict(m.state_dict(), cfg)
    want = {k: v for k, v in sd.items() if k != "bert.embeddings.position_ids"}
    assert set(back) == set(want)
    for k, v in want.items():
        assert torch.equal(back[k], v), k
    for subset in (True,):
        cfg2 = BertConfig(**TINY, last_layer_subset=subset, dense_seq_output=True)
        back2 = bert.inv_remap_state_dict(bert.remap_state_dict(sd, cfg2), cfg2)
        assert all(torch.equal(back2[k], want[k]) for k in want)


def test_old_gamma_beta_names_and_bert_model_from_pretrained(tmp_path, monkeypatch):
    cfg = BertConfig(**TINY, use_flash_attn=True)
    sd = hf_bert_state(cfg, old_names=True)
    ours = bert.remap_state_dict(sd, cfg)
    assert "bert.emb_ln.weight" in ours and "cls.predictions.transform.layer_norm.bias" in ours
    path = tmp_path / "bert.pt"
    torch.save(sd, path)
    m = BertModel.from_pretrained(str(path), cfg).to(F64).eval()
    assert torch.equal(m.emb_ln.weight, sd["bert.embeddings.LayerNorm.gamma"].float().double())
    p = BertForPreTraining.from_pretrained(None, cfg, state_dict=sd).to(F64).eval()
    ids, types_, mask = batch(cfg, [6, 2], 6)
    assert torch.allclose(m(ids, attention_mask=mask).last_hidden_state,
                          p.bert(ids, attention_mask=mask).last_hidden_state)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")             # a hub name: the (empty) cache only, no network
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub_cache"))
    with pytest.raises(OSError, match="bert-base-uncased.*HF_HUB_OFFLINE"):
        BertModel.from_pretrained("bert-base-uncased", cfg)


def test_config_from_any_object_and_init():
    ns = types.SimpleNamespace(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=48, pad_token_id=3)
    m = BertModel(ns, add_pooling_layer=False)
    assert m.pooler is None and m.embeddings.word_embeddings.weight.shape == (50, 32)
    assert (m.embeddings.word_embeddings.weight[3] == 0).all()
    assert m.emb_ln.eps == 1e-12 and m.encoder.layers[0].mlp.fc1.out_features == 48
    assert not hasattr(ns, "pad_vocab_size_multiple")


@pytest.mark.parametrize("bad, match", [
    (dict(hidden_act="relu"), "config.hidden_act"),
    (dict(num_attention_heads=5), "config.hidden_size"),
    (dict(fused_mlp=True), "config.fused_mlp"),
    (dict(last_layer_subset=True), "config.last_layer_subset"),
    (dict(pad_vocab_size_multiple=0), "config.pad_vocab_size_multiple"),
    (dict(hidden_dropout_prob=1.0), "config.hidden_dropout_prob"),
    (dict(position_embedding_type="rotary", rotary_emb_dim=17), "config.rotary_emb_dim"),
    (dict(layer_norm_eps=0.0), "config.layer_norm_eps"),
])
def test_refused_configs(bad, match):
    with pytest.raises(ValueError, match=match):
        BertForPreTraining(BertConfig(**{**TINY, **bad}))


def test_refused_unsupported_and_missing():
    with pytest.raises(cuflash.UnsupportedFeature, match="position_embedding_type"):
        BertModel(BertConfig(**TINY, position_embedding_type="relative_key"))
    with pytest.raises(ValueError, match="config.num_attention_heads"):
        BertModel(types.SimpleNamespace(vocab_size=5, hidden_size=8, num_hidden_layers=1))
    m = BertModel(BertConfig(**TINY))
    with pytest.raises(ValueError, match="attention_mask"):
        m(torch.zeros(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="input_ids"):
        m(torch.zeros(5, dtype=torch.long))
    p = BertForPreTraining(BertConfig(**TINY, dense_seq_output=True))
    labels = torch.zeros(2, 5, dtype=torch.long)
    labels[1, 4] = 3
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    with pytest.raises(ValueError, match="labels"):
        p(torch.ones(2, 5, dtype=torch.long), attention_mask=mask, labels=labels)
    mask[:, 0] = False
    with pytest.raises(ValueError, match="first token"):
        p.bert(torch.ones(2, 5, dtype=torch.long), attention_mask=mask, masked_tokens_mask=labels > 0)


def test_fused_switches_equal_unfused():
    sd = hf_bert_state(BertConfig(**TINY, hidden_act="gelu_new"))
    ids, types_, mask = batch(BertConfig(**TINY), LENGTHS, 13)
    ref = pretraining_model(BertConfig(**TINY, hidden_act="gelu_new", use_flash_attn=True), sd)
    want = ref(ids, token_type_ids=types_, attention_mask=mask).prediction_logits
    cfg = BertConfig(**TINY, hidden_act="gelu_new", use_flash_attn=True, fused_mlp=True, fused_bias_fc=True,
                     fused_dropout_add_ln=True)
    got = pretraining_model(cfg, sd)(ids, token_type_ids=types_, attention_mask=mask).prediction_logits
    assert torch.allclose(got[mask], want[mask], atol=1e-10, rtol=1e-9)


def test_embeddings_and_signatures():
    e = BertEmbeddings(16, 30, 8, 3, padding_idx=0)
    ids = torch.randint(0, 30, (2, 5))
    tt = torch.randint(0, 3, (2, 5))
    want = e.word_embeddings(ids) + e.position_embeddings(torch.arange(5)) + e.token_type_embeddings(tt)
    assert torch.equal(e(ids, token_type_ids=tt), want)
    assert not hasattr(BertEmbeddings(16, 30, 0, 0), "position_embeddings")
    for fn, names in [(BertModel.forward, ["self", "input_ids", "position_ids", "token_type_ids", "attention_mask",
                                           "masked_tokens_mask"]),
                      (BertForPreTraining.forward, ["self", "input_ids", "position_ids", "token_type_ids",
                                                    "attention_mask", "labels", "next_sentence_label"]),
                      (BertModel.__init__, ["self", "config", "add_pooling_layer"]),
                      (bert.remap_state_dict, ["state_dict", "config"]),
                      (bert.inv_remap_state_dict, ["state_dict", "config"])]:
        assert list(inspect.signature(fn).parameters)[:len(names)] == names
