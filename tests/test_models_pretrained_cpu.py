"""cuflash.models' local checkpoints without a GPU: the safetensors reader / writer
(cuflash.models._checkpoint: dtypes, empty and scalar tensors, metadata, malformed files) and
``GPTLMHeadModel.from_pretrained`` on a Hugging Face model directory of every family it remaps
(config.json with model_type + model.safetensors, a sharded model.safetensors.index.json, or
pytorch_model.bin; Falcon-RW's ALiBi and BTLM's alibi_scaling too): the loaded model's logits (float64) equal the plain-torch forward of that
family written in tests/test_models_families_cpu.py and tests/test_models_baichuan_btlm_cpu.py.
Plus the family detection from keys alone, explicit configs, and the refusals (a hub name offline
and not cached, a missing path, no config, unknown model_type). Hub downloads:
tests/test_models_hub_cpu.py."""
import json
import os
import sys
import types

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_models_baichuan_btlm_cpu as bb  # noqa: E402
import test_models_families_cpu as fam  # noqa: E402
import test_models_gpt_cpu as g  # noqa: E402

import cuflash  # noqa: E402
from cuflash.models import baichuan, gpt_neox  # noqa: E402
from cuflash.models._checkpoint import load_safetensors, load_state_dict_from, save_safetensors  # noqa: E402
from cuflash.models._pretrained import family_from_keys  # noqa: E402
from cuflash.models.gpt import GPT2Config, GPTLMHeadModel  # noqa: E402

F64 = torch.float64
NS = types.SimpleNamespace


# ---------------------------------------------------------------------------------------
# safetensors

def test_safetensors_round_trip(tmp_path):
    tensors = {"f32": torch.randn(3, 5), "f64": torch.randn(2, dtype=F64), "bf16": torch.randn(4, 3).bfloat16(),
               "f16": torch.randn(7).half(), "i64": torch.arange(6).reshape(2, 3), "i32": torch.arange(3).int(),
               "bool": torch.tensor([True, False, True]), "u8": torch.arange(5, dtype=torch.uint8),
               "empty": torch.empty(0, 4), "scalar": torch.tensor(2.5), "noncontig": torch.randn(4, 6).t()}
    path = tmp_path / "t.safetensors"
    save_safetensors(tensors, path, metadata={"format": "pt"})
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    assert n % 8 == 0 and header["__metadata__"] == {"format": "pt"} and header["bf16"]["dtype"] == "BF16"
    back = load_safetensors(path)
    assert list(back) == list(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v), k
    assert torch.equal(load_state_dict_from(path)["f32"], tensors["f32"])


def test_safetensors_malformed(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="bad.safetensors"):
        load_safetensors(bad)
    bad.write_bytes((10).to_bytes(8, "little") + b"{not json}")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_safetensors(bad)
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    bad.write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    with pytest.raises(ValueError, match="'w'"):
        load_safetensors(bad)
    header = json.dumps({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    bad.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(ValueError, match="known dtype"):
        load_safetensors(bad)


# ---------------------------------------------------------------------------------------
# from_pretrained on model directories

def neox():
    c = NS(vocab_size=fam.V, hidden_size=fam.D, num_hidden_layers=fam.L, num_attention_heads=fam.H,
           intermediate_size=80, hidden_act="gelu", rotary_pct=0.5, rotary_emb_base=500.0, layer_norm_eps=1e-5,
           use_parallel_residual=True, tie_word_embeddings=False)
    return "gpt_neox", c, fam.neox_state(c), lambda sd, ids: fam.neox_ref(sd, c, ids), fam.V


def gptj():
    c = NS(vocab_size=fam.V, n_embd=fam.D, n_layer=fam.L, n_head=fam.H, n_inner=None, rotary_dim=8,
           activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
           tie_word_embeddings=False)
    return "gptj", c, fam.gptj_state(c), lambda sd, ids: fam.gptj_ref(sd, c, ids), fam.V


def opt():
    c = NS(vocab_size=fam.V, max_position_embeddings=16, hidden_size=fam.D, num_hidden_layers=fam.L,
           num_attention_heads=fam.H, ffn_dim=96, activation_function="relu", dropout=0.0, attention_dropout=0.0,
           init_std=0.02, do_layer_norm_before=True, word_embed_proj_dim=fam.D, layerdrop=0.0,
           layer_norm_elementwise_affine=True)
    return "opt", c, fam.opt_state(c), lambda sd, ids: fam.opt_ref(sd, c, ids), fam.V


def falcon():
    c = NS(vocab_size=fam.V, hidden_size=fam.D, num_hidden_layers=fam.L, num_attention_heads=fam.H, num_kv_heads=1,
           multi_query=True, new_decoder_architecture=False, parallel_attn=True, bias=False, alibi=False,
           layer_norm_epsilon=1e-5, hidden_dropout=0.0, attention_dropout=0.0)
    return "falcon", c, fam.falcon_state(c, "7b", 1), lambda sd, ids: fam.falcon_ref(sd, "7b", 1, ids), fam.V


def falcon_rw():
    c = NS(vocab_size=fam.V, hidden_size=48, num_hidden_layers=fam.L, num_attention_heads=6, multi_query=False,
           new_decoder_architecture=False, parallel_attn=False, bias=True, alibi=True, layer_norm_epsilon=1e-5,
           hidden_dropout=0.0, attention_dropout=0.0)
    return "falcon", c, fam.falcon_rw_state(48), lambda sd, ids: fam.falcon_rw_ref(sd, 6, 48, ids), fam.V


def bigcode():
    c = NS(vocab_size=fam.V, n_positions=16, n_embd=fam.D, n_layer=fam.L, n_head=fam.H, n_inner=None,
           activation_function="gelu_pytorch_tanh", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
           layer_norm_epsilon=1e-5, multi_query=True)
    return "gpt_bigcode", c, fam.bigcode_state(True), lambda sd, ids: fam.bigcode_ref(sd, True, ids), fam.V


def baichuan13():
    c = bb.baichuan_cfg(use_alibi=True)
    return "baichuan", c, bb.baichuan_state(c), lambda sd, ids: bb.baichuan_ref(sd, c, ids, True, False), bb.V


def btlm_():
    c = bb.btlm_cfg()
    return "btlm", c, bb.btlm_state(c), lambda sd, ids: bb.btlm_ref(sd, c, ids), bb.V


def btlm_scaled():
    c = bb.btlm_cfg(heads=6, alibi_scaling={"type": "linear", "train_seq_len": 4})
    return "btlm", c, bb.btlm_state(c), lambda sd, ids: bb.btlm_ref(sd, c, ids), bb.V


def gpt2():
    c = NS(**g.TINY, layer_norm_epsilon=1e-5, activation_function="gelu_new")
    sd = {"transformer." + k: v for k, v in g.hf_gpt2_state(GPT2Config(**g.TINY)).items()}
    ref = lambda sd, ids: g.plain_gpt2({k[len("transformer."):]: v for k, v in sd.items()},  # noqa: E731
                                       GPT2Config(**g.TINY), ids)
    return "gpt2", c, sd, ref, g.TINY["vocab_size"]


def llama():
    c = g.llama_cfg()
    return "llama", c, g.hf_llama_state(c), lambda sd, ids: g.plain_llama(sd, c, ids), c.vocab_size


FAMILIES = {"gpt2": gpt2, "llama": llama, "gpt_neox": neox, "gptj": gptj, "opt": opt, "falcon": falcon,
            "gpt_bigcode": bigcode, "baichuan": baichuan13, "btlm": btlm_, "falcon_rw_alibi": falcon_rw,
            "btlm_alibi_scaling": btlm_scaled}
# the kernels take fp32 slopes: Falcon-RW's slope / sqrt(head_dim), BTLM's slope / scale rounded to fp32
FP32_SLOPES = ("falcon_rw_alibi", "btlm_alibi_scaling")
STORAGE = ("safetensors", "sharded", "bin")


def write_dir(path, model_type, c, sd, storage):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**vars(c), "model_type": model_type}))
    if storage == "safetensors":
        save_safetensors(sd, path / "model.safetensors", metadata={"format": "pt"})
    elif storage == "bin":
        torch.save(sd, path / "pytorch_model.bin")
    else:                          # two shards and their index
        keys = list(sd)
        half = len(keys) // 2
        weight_map = {}
        for i, part in enumerate((keys[:half], keys[half:])):
            name = f"model-{i + 1:05d}-of-00002.safetensors"
            save_safetensors({k: sd[k] for k in part}, path / name)
            weight_map.update({k: name for k in part})
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_from_pretrained_directory(family, tmp_path):
    model_type, c, sd, ref, vocab = FAMILIES[family]()
    storage = STORAGE[list(FAMILIES).index(family) % 3]
    write_dir(tmp_path / "ckpt", model_type, c, sd, storage)
    m = GPTLMHeadModel.from_pretrained(str(tmp_path / "ckpt"), dtype=F64).eval()
    ids = torch.randint(0, vocab, (2, 9))
    got = m(ids).logits[..., :vocab]
    want = ref(sd, ids)
    tol = (g.ROTARY_TOL if family == "llama" else          # fp32 rotary tables
           dict(atol=1e-6, rtol=1e-6) if family in FP32_SLOPES else dict(atol=1e-9, rtol=1e-8))
    assert torch.allclose(got, want, **tol), (family, storage, (got - want).abs().max())
    assert family_from_keys(sd) == model_type


def test_from_pretrained_every_storage_and_explicit_config(tmp_path):
    model_type, c, sd, ref, vocab = neox()
    ids = torch.randint(0, vocab, (2, 9))
    want = ref(sd, ids)
    for storage in STORAGE:
        write_dir(tmp_path / storage, model_type, c, sd, storage)
        m = GPTLMHeadModel.from_pretrained(tmp_path / storage, dtype=F64).eval()
        assert torch.allclose(m(ids).logits[..., :vocab], want, atol=1e-9, rtol=1e-8), storage
    # an explicit config (here padded vocabulary) wins over config.json; a lone file needs one
    cfg = gpt_neox.gpt_neox_config_to_gpt2_config(c)
    cfg.pad_vocab_size_multiple = 8
    m = GPTLMHeadModel.from_pretrained(tmp_path / "safetensors", cfg, dtype=F64).eval()
    assert m.lm_head.weight.shape[0] == 104
    lone = tmp_path / "safetensors" / "model.safetensors"
    m = GPTLMHeadModel.from_pretrained(str(lone), cfg, dtype=F64).eval()
    assert torch.allclose(m(ids).logits[..., :vocab], want, atol=1e-9, rtol=1e-8)
    with pytest.raises(ValueError, match="config is needed"):
        GPTLMHeadModel.from_pretrained(str(lone))
    # already this model's keys: loaded as they are
    again = GPTLMHeadModel.from_pretrained("any", cfg, state_dict=m.state_dict(), dtype=F64).eval()
    assert torch.equal(again(ids).logits, m(ids).logits)
    # explicit state dict of a family, detected by its keys
    cfg_b = baichuan.baichuan_config_to_gpt2_config(bb.baichuan_cfg())
    sd_b = bb.baichuan_state(bb.baichuan_cfg())
    m = GPTLMHeadModel.from_pretrained("baichuan-inc/Baichuan-7B", cfg_b, state_dict=sd_b, dtype=F64).eval()
    ids = torch.randint(0, bb.V, (2, 9))
    assert torch.allclose(m(ids).logits[..., :bb.V], bb.baichuan_ref(sd_b, bb.baichuan_cfg(), ids, False, False),
                          atol=1e-9, rtol=1e-8)


def test_family_from_keys_gpt2_vs_bigcode():
    gpt2 = {"h.0.attn.c_attn.weight": torch.zeros(8, 24), "wte.weight": torch.zeros(5, 8)}
    big = {"transformer.h.0.attn.c_attn.weight": torch.zeros(12, 8), "transformer.wte.weight": torch.zeros(5, 8)}
    assert family_from_keys(gpt2) == "gpt2" and family_from_keys(big) == "gpt_bigcode"
    assert family_from_keys({"transformer.layers.0.mixer.Wqkv.weight": torch.zeros(1)}) is None
    assert family_from_keys({"model.layers.0.self_attn.q_proj.weight": torch.zeros(1)}) == "llama"


def test_from_pretrained_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")             # a hub name: the (empty) cache only, no network
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub_cache"))
    with pytest.raises(OSError, match="EleutherAI/pythia-70m.*HF_HUB_OFFLINE"):
        GPTLMHeadModel.from_pretrained("EleutherAI/pythia-70m")
    with pytest.raises(FileNotFoundError, match="no such local file"):
        GPTLMHeadModel.from_pretrained(str(tmp_path / "no" / "such" / "dir"))
    d = tmp_path / "mamba"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    save_safetensors({"backbone.embedding.weight": torch.zeros(2, 2)}, d / "model.safetensors")
    with pytest.raises(cuflash.UnsupportedFeature, match="mamba"):
        GPTLMHeadModel.from_pretrained(d)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no weights found"):
        GPTLMHeadModel.from_pretrained(empty)
    (empty / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(ValueError, match="gone.safetensors"):
        GPTLMHeadModel.from_pretrained(empty)
