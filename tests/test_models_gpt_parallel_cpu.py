"""cuflash.models.gpt.GPTLMHeadModel over a process group (tensor parallelism) without GPUs: 2
processes over gloo, float64 CPU tensors (cuflash's attention runs the float64 reference), each
rank's model loaded with shard_state_dict_tp of one single-process model's state dict. Each rank
checks its logits (its vocabulary columns; with sequence_parallel over all the rows the lm_head
gathers) and the gradient of its Wqkv / fc1 shards against the single-process model's, and
greedy generation (sequence_parallel=False: the logits gathered over the ranks) against the
single-process model's. A failure raises in the worker and fails mp.spawn."""
from __future__ import annotations

import socket

import pytest

torch = pytest.importorskip("torch")

from cuflash.models.gpt import GPT2Config, GPTLMHeadModel, shard_state_dict_tp  # noqa: E402
from cuflash.modules.embedding import ParallelGPT2Embeddings  # noqa: E402

TOL = dict(atol=1e-10, rtol=1e-9)
ROTARY_TOL = dict(atol=2e-6, rtol=1e-5)
TINY = dict(vocab_size=100, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, initializer_range=0.3, use_flash_attn=True)
CASES = {
    "gpt2_sp": dict(sequence_parallel=True),
    "gpt2_nosp_untied": dict(sequence_parallel=False, tie_word_embeddings=False),
    "gqa_rotary_swiglu_sp": dict(sequence_parallel=True, n_head_kv=2, rotary_emb_fraction=1.0, n_positions=0,
                                 activation_function="swiglu", rms_norm=True, n_inner=128),
    "parallel_block_nosp": dict(sequence_parallel=False, parallel_block=True, rotary_emb_fraction=0.5,
                                fused_dropout_add_ln=True),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _models(kw, world, rank, group):
    cfg = GPT2Config(**{**TINY, **kw})
    torch.manual_seed(0)
    full = GPTLMHeadModel(cfg, dtype=torch.float64).eval()
    par = GPTLMHeadModel(cfg, process_group=group, dtype=torch.float64).eval()
    par.load_state_dict(shard_state_dict_tp(full.state_dict(), cfg, world, rank))
    return cfg, full, par


def _check_case(name, kw, world, rank, group):
    cfg, full, par = _models(kw, world, rank, group)
    tol = ROTARY_TOL if kw.get("rotary_emb_fraction") else TOL
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(7))
    want = full(ids).logits
    got = par(ids).logits
    cols = slice(rank * 50, (rank + 1) * 50)
    ref = want.flatten(0, 1)[:, cols] if kw["sequence_parallel"] else want[..., cols]
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    assert torch.allclose(got, ref, **tol), (name, (got - ref).abs().max())
    dout = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    (want * dout).sum().backward()
    dref = dout.flatten(0, 1)[:, cols] if kw["sequence_parallel"] else dout[..., cols]
    (got * dref).sum().backward()
    shard = shard_state_dict_tp({n: p.grad for n, p in full.named_parameters()}, cfg, world, rank)
    for n in ("transformer.layers.1.mixer.Wqkv.weight", "transformer.layers.0.mlp.fc1.weight"):
        g = dict(par.named_parameters())[n].grad
        assert torch.allclose(g, shard[n], **tol), (name, n, (g - shard[n]).abs().max())


def _check_generate(world, rank, group):
    cfg, full, par = _models(dict(sequence_parallel=False, n_head_kv=2, rotary_emb_fraction=1.0), world, rank, group)
    prompt = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(9))
    got = par.generate(prompt, 11, return_dict_in_generate=True, output_scores=True)
    want = full.generate(prompt, 11, return_dict_in_generate=True, output_scores=True)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        assert a.shape == (2, 100) and torch.allclose(a, b, **ROTARY_TOL)


def _worker(rank, world, port):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        group = dist.new_group(list(range(world)))
        for name, kw in CASES.items():
            _check_case(name, kw, world, rank, group)
        _check_generate(world, rank, group)
        emb = ParallelGPT2Embeddings(64, 100, 32, group, sequence_parallel=False, dtype=torch.float64)
        assert emb.word_embeddings.weight.shape == (50, 64) and emb.position_embeddings.weight.shape == (32, 32)
        with pytest.raises(ValueError, match="num_embeddings"):
            ParallelGPT2Embeddings(64, 99, 32, group)
        with pytest.raises(ValueError, match="divisible"):
            GPTLMHeadModel(GPT2Config(**{**TINY, "vocab_size": 99, "n_positions": 0}), process_group=group)
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_gpt_matches_single_process():
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(2, _free_port()), nprocs=2, join=True)
