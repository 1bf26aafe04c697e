"""cuflash.modules.mha.ParallelMHA and cuflash.ops.fused_dense's parallel linears without GPUs:
P = 1, 2 and 3 processes over gloo, CPU tensors (cuflash's attention runs the float64
reference), against one single-process MHA whose state dict the ranks' shards come from
(shard_mha_state_dict). Each process checks its output and the gradients of its input and of
every parameter shard against the MHA's, sharded the same way; a failure raises in the worker
and fails mp.spawn. One spawn per P, every case in it. Plus pure functions (the split, the
state-dict round trip, flash-attn's signatures)."""
from __future__ import annotations

import inspect
import socket

import pytest

torch = pytest.importorskip("torch")

import cuflash  # noqa: E402
from cuflash.modules.mha import (MHA, ParallelMHA, combine_mha_state_dicts, get_alibi_slopes,  # noqa: E402
                                 shard_mha_state_dict)
from cuflash.ops.fused_dense import ColumnParallelLinear, RowParallelLinear, fused_dense_func  # noqa: E402
from cuflash.utils import distributed as cud  # noqa: E402
from cuflash.utils.generation import InferenceParams  # noqa: E402

F64_TOL = dict(atol=1e-10, rtol=1e-9)
F32_TOL = dict(atol=2e-5, rtol=1e-4)

# name: (embed_dim, num_heads, module kwargs, forward: "3d" (batch, seqlen, E) / "flat" ((batch ·
# seqlen, E) with seqlen=) / "varlen" (cu_seqlens) / "padmask" (key_padding_mask), dtype)
CASES_2 = {
    "mha_sp_flat_causal_rotary": (64, 4, dict(causal=True, rotary_emb_dim=16, use_flash_attn=True,
                                              sequence_parallel=True), "flat", torch.float64),
    "mha_nosp_3d_torchpath": (48, 4, dict(sequence_parallel=False), "3d", torch.float64),
    "gqa_sp_3d_rotary8_interleaved": (64, 8, dict(num_heads_kv=2, causal=True, rotary_emb_dim=8,
                                                  rotary_emb_interleaved=True, use_flash_attn=True,
                                                  sequence_parallel=True), "3d", torch.float64),
    "gqa_nosp_alibi_window_nobias": (64, 4, dict(num_heads_kv=2, causal=True, use_alibi=True, window_size=(3, 0),
                                                 qkv_proj_bias=False, out_proj_bias=False, use_flash_attn=True,
                                                 sequence_parallel=False), "flat", torch.float64),
    "mha_sp_varlen_rotary_checkpointing": (32, 2, dict(causal=True, rotary_emb_dim=8, use_flash_attn=True,
                                                       checkpointing=True, sequence_parallel=True), "varlen",
                                           torch.float64),
    "gqa_nosp_padmask": (32, 4, dict(num_heads_kv=2, use_flash_attn=True, sequence_parallel=False), "padmask",
                         torch.float64),
    "mha_sp_flat_f32": (64, 4, dict(causal=True, rotary_emb_dim=16, use_flash_attn=True, sequence_parallel=True),
                        "flat", torch.float32),
}
# uneven splits over 3 ranks: 5 heads -> 2, 2, 1; GQA 8 q / 4 kv heads -> kv 2, 1, 1 with their q heads
# (4, 2, 2); 10 q / 5 kv -> kv 2, 2, 1 (q 4, 4, 2)
CASES_3 = {
    "mha5_uneven_sp_alibi": (40, 5, dict(causal=True, use_alibi=True, use_flash_attn=True, sequence_parallel=True),
                             "flat", torch.float64),
    "gqa_uneven_nosp_rotary": (64, 8, dict(num_heads_kv=4, causal=True, rotary_emb_dim=8, use_flash_attn=True,
                                           sequence_parallel=False), "3d", torch.float64),
    "gqa_uneven_sp_torchpath": (80, 10, dict(num_heads_kv=5, sequence_parallel=True), "3d", torch.float64),
}
# decoding: a prompt, then single tokens through the KV cache (rotary 16: the fused path)
DECODE_CASES = {
    2: [(64, 4, dict(num_heads_kv=2, rotary_emb_dim=16, use_flash_attn=True, sequence_parallel=False)),
        (64, 4, dict(rotary_emb_dim=16, use_flash_attn=True, sequence_parallel=True)),
        (32, 2, dict(use_flash_attn=False, sequence_parallel=False))],
    3: [(48, 6, dict(num_heads_kv=3, rotary_emb_dim=8, use_flash_attn=True, sequence_parallel=False))],
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pair(embed_dim, num_heads, kw, dtype, world, rank, group, seed):
    """A single-process MHA (every rank the same weights) and this rank's ParallelMHA holding its shard."""
    torch.manual_seed(seed)
    common = {k: v for k, v in kw.items() if k != "sequence_parallel"}
    full = MHA(embed_dim, num_heads, dtype=dtype, **common)
    par = ParallelMHA(embed_dim, num_heads, group, dtype=dtype, **kw)
    hkv = kw.get("num_heads_kv", num_heads)
    par.load_state_dict(shard_mha_state_dict(full.state_dict(), num_heads, hkv, world, rank))
    return full, par


def _close(a, b, tol, what):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert torch.allclose(a, b, **tol), f"{what}: max abs error {err}"


def _check_case(rank, world, group, name, case, seed):
    embed_dim, num_heads, kw, mode, dtype = case
    tol = F64_TOL if dtype == torch.float64 else F32_TOL
    sp = kw["sequence_parallel"]
    full, par = _pair(embed_dim, num_heads, kw, dtype, world, rank, group, seed)
    hkv = kw.get("num_heads_kv", num_heads)
    g = torch.Generator().manual_seed(seed + 1)
    # sequence_parallel splits dimension 0: the batch of a 3-D input, the batch · seqlen rows of a flat one
    batch = world if sp and mode in ("3d", "padmask") else 2
    seqlen = 3 * world if mode == "flat" else 3 * world - 1
    x = torch.randn(batch, seqlen, embed_dim, generator=g, dtype=dtype)
    fwd_full, fwd_par = {}, {}
    if mode == "varlen":   # packed sequences of lengths 1, 4, 2P + 1 (total 2P + 6, a multiple of P = 2, 3)
        lengths = [1, 4, 2 * world + 1]
        x = torch.randn(sum(lengths), embed_dim, generator=g, dtype=dtype)
        cu = torch.tensor([0, 1, 5, sum(lengths)], dtype=torch.int32)
        fwd_full = fwd_par = dict(cu_seqlens=cu, max_seqlen=max(lengths))
    if mode == "padmask":
        mask = torch.ones(batch, seqlen, dtype=torch.bool)
        mask[1, seqlen - 2:] = False
        fwd_full = fwd_par = dict(key_padding_mask=mask)
    dout = torch.randn(x.shape, generator=g, dtype=dtype)
    xf = x.clone().requires_grad_()
    out = full(xf, **fwd_full)
    params = dict(full.named_parameters())
    grads = torch.autograd.grad(out, [xf, *params.values()], dout)
    gx, gparams = grads[0], dict(zip(params, grads[1:]))

    def local(t):   # what this rank holds of a (batch, seqlen, E) / (rows, E) tensor
        if mode == "flat":
            t = t.reshape(-1, t.shape[-1])
        return t.chunk(world, dim=0)[rank] if sp else t

    xin = local(x).clone().requires_grad_()
    pout = par(xin, seqlen=seqlen if mode == "flat" else None, **fwd_par)
    _close(pout, local(out.detach()), tol, f"{name} rank {rank}: out")
    pparams = dict(par.named_parameters())
    pgrads = torch.autograd.grad(pout, [xin, *pparams.values()], local(dout))
    _close(pgrads[0], local(gx), tol, f"{name} rank {rank}: dx")
    expected = shard_mha_state_dict(gparams, num_heads, hkv, world, rank)
    assert sorted(expected) == sorted(pparams), (name, sorted(expected), sorted(pparams))
    for key, grad in zip(pparams, pgrads[1:]):
        _close(grad, expected[key], tol, f"{name} rank {rank}: d{key}")


def _check_decode(rank, world, group, case, seed):
    embed_dim, num_heads, kw = case
    sp = kw["sequence_parallel"]
    kw = dict(kw, causal=True, layer_idx=0)
    full, par = _pair(embed_dim, num_heads, kw, torch.float64, world, rank, group, seed)
    batch, prompt, steps = world, 5, 3
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, prompt + steps, embed_dim, generator=g, dtype=torch.float64)
    pf, pp = InferenceParams(max_seqlen=16, max_batch_size=batch), InferenceParams(max_seqlen=16, max_batch_size=batch)

    def run_par(chunk):
        if not sp:
            return par(chunk, inference_params=pp)
        rows = chunk.reshape(-1, embed_dim).chunk(world, dim=0)[rank]
        return par(rows, seqlen=chunk.shape[1], inference_params=pp)

    def local(t):
        return t.reshape(-1, embed_dim).chunk(world, dim=0)[rank] if sp else t

    with torch.no_grad():
        _close(run_par(x[:, :prompt]), local(full(x[:, :prompt], inference_params=pf)), F64_TOL, "decode prompt")
        for t in range(prompt, prompt + steps):
            pf.seqlen_offset = pp.seqlen_offset = t
            _close(run_par(x[:, t:t + 1]), local(full(x[:, t:t + 1], inference_params=pf)), F64_TOL, f"decode {t}")
    cache = pp.key_value_memory_dict[0]
    assert cache.shape == (batch, 16, 2, par.num_heads_kv_per_rank, par.head_dim)
    assert par.allocate_inference_cache(3, 7).shape == (3, 7, 2, par.num_heads_kv_per_rank, par.head_dim)


def _check_helpers(rank, world, group):
    """The collectives' autograd and the parameter helpers, directly."""
    x = torch.arange(6, dtype=torch.float64).reshape(3, 2) + 10 * rank
    x.requires_grad_()
    y = cud.all_gather(x, group)
    assert y.shape == (3 * world, 2) and torch.equal(y[3 * rank:3 * rank + 3], x.detach())
    (gx,) = torch.autograd.grad(y, x, torch.ones_like(y) * (rank + 1))
    assert torch.equal(gx, torch.full_like(x, world * (world + 1) / 2))   # reduce-scatter of the ranks' grads
    z = cud.all_reduce(x, group)
    assert torch.equal(x.detach(), torch.arange(6, dtype=torch.float64).reshape(3, 2) + 10 * rank)   # untouched
    (gz,) = torch.autograd.grad(z, x, torch.ones_like(z))
    assert torch.equal(gz, torch.ones_like(x))
    if world > 1:
        with pytest.raises(ValueError, match="multiple of the process group's size"):
            cud.reduce_scatter(torch.zeros(world + 1, 2), group)
    lin = torch.nn.Linear(2, 2, dtype=torch.float64)
    with torch.no_grad():
        lin.weight.fill_(rank)
        lin.bias.fill_(rank)
    lin.weight._shared_params = True
    cud.sync_shared_params(lin, group)
    assert torch.equal(lin.weight, torch.zeros_like(lin.weight)) and torch.equal(lin.bias, torch.full((2,), rank * 1.0))
    lin.bias._sequence_parallel = True
    lin.bias.grad = torch.full((2,), 1.0 + rank, dtype=torch.float64)
    cud.allreduce_sequence_parallel_grad(lin, group)
    assert torch.equal(lin.bias.grad, torch.full((2,), world * (world + 1) / 2, dtype=torch.float64))
    # a marked parameter without a gradient on some ranks (rank 0 here): a zero gradient there, no hang
    lin.bias.grad = None if rank == 0 else torch.full((2,), 1.0, dtype=torch.float64)
    cud.allreduce_sequence_parallel_grad(lin, group)
    assert torch.equal(lin.bias.grad, torch.full((2,), world - 1.0, dtype=torch.float64))
    col = ColumnParallelLinear(8, 12, group, multiple_of=2, sequence_parallel=False)
    if world > 1:
        with pytest.raises(ValueError, match="x must have at least 2 dimensions"):
            fused_dense_func(torch.zeros(8, dtype=torch.float64), col.weight, None, process_group=group)
    row = RowParallelLinear(12, 8, group, multiple_of=2)
    assert col.weight.shape == (cud.get_dim_for_local_rank(12, world, rank, 2), 8)
    assert row.weight.shape == (8, cud.get_dim_for_local_rank(12, world, rank, 2))
    assert (row.bias is not None) == (rank == 0)


def _worker(rank, world, port):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        group = dist.new_group(list(range(world)))   # a group object, as tensor-parallel code passes
        _check_helpers(rank, world, group)
        cases = CASES_3 if world == 3 else CASES_2   # world 1: no collective at all (the linears skip them)
        for i, (name, case) in enumerate(sorted(cases.items())):
            _check_case(rank, world, group, name, case, seed=100 + i)
        for i, case in enumerate(DECODE_CASES[3 if world == 3 else 2]):
            _check_decode(rank, world, group, case, seed=200 + i)
        if world == 1:   # the collectives over the one-rank group, as on more ranks
            from cuflash.ops import fused_dense

            fused_dense.ONE_RANK_SHORTCUT = False
            try:
                for name in ("mha_sp_flat_causal_rotary", "mha_nosp_3d_torchpath", "gqa_sp_3d_rotary8_interleaved"):
                    _check_case(rank, world, group, name, CASES_2[name], seed=300)
                _check_decode(rank, world, group, DECODE_CASES[2][1], seed=301)
            finally:
                fused_dense.ONE_RANK_SHORTCUT = True
        if world == 3:
            with pytest.raises(cuflash.UnsupportedFeature, match="num_heads_kv"):
                ParallelMHA(32, 4, group, num_heads_kv=2)
        with pytest.raises(ValueError, match="process_group"):
            ParallelMHA(32, 4, None)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_parallel_mha_matches_mha(world):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world, _free_port()), nprocs=world, join=True)


def test_get_dim_for_local_rank_and_ranges():
    for dim, world, multiple in [(12, 2, 1), (10, 3, 2), (5, 3, 1), (5, 4, 1), (48, 5, 8), (7, 7, 1)]:
        sizes = [cud.get_dim_for_local_rank(dim, world, r, multiple) for r in range(world)]
        units, extra = divmod(dim // multiple, world)
        assert sizes == [(units + (r < extra)) * multiple for r in range(world)]
        ranges = [cud.local_range(dim, world, r, multiple) for r in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == sum(sizes)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("heads,heads_kv,world", [(4, 4, 2), (5, 5, 3), (8, 2, 2), (8, 4, 3), (6, 3, 2)])
def test_state_dict_shard_combine_round_trip(heads, heads_kv, world):
    torch.manual_seed(0)
    m = MHA(8 * heads, heads, num_heads_kv=heads_kv, dtype=torch.float64)
    sd = m.state_dict()
    shards = [shard_mha_state_dict(sd, heads, heads_kv, world, r) for r in range(world)]
    assert ("out_proj.bias" in shards[1]) is False
    back = combine_mha_state_dicts(shards, heads, heads_kv)
    assert sorted(back) == sorted(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    # rank r's Wqkv rows: its query heads, then its key heads, then its value heads
    g = heads // heads_kv
    a, b = cud.local_range(heads_kv, world, world - 1)
    w = sd["Wqkv.weight"].unflatten(0, (heads + 2 * heads_kv, 8))
    expect = torch.cat([w[g * a:g * b], w[heads + a:heads + b], w[heads + heads_kv + a:heads + heads_kv + b]])
    assert torch.equal(shards[-1]["Wqkv.weight"], expect.flatten(0, 1))


def test_alibi_slopes_per_rank_cover_all_heads():
    """Each rank's slopes are its own heads' (flash-attn's ceil slicing would give rank 3 of 4 no
    slope for 5 heads)."""
    full = get_alibi_slopes(5)
    parts = [full[slice(*cud.local_range(5, 4, r))] for r in range(4)]
    assert sum(parts, []) == full and all(len(p) == 1 + (r == 0) for r, p in enumerate(parts))


FLASH_ATTN_PARALLEL_MHA = ["embed_dim", "num_heads", "process_group", ("num_heads_kv", None), ("qkv_proj_bias", True),
                           ("out_proj_bias", True), ("dropout", 0.0), ("softmax_scale", None), ("causal", False),
                           ("layer_idx", None), ("rotary_emb_dim", 0), ("rotary_emb_base", 10000.0),
                           ("rotary_emb_scale_base", None), ("rotary_emb_interleaved", False), ("use_alibi", False),
                           ("window_size", (-1, -1)), ("use_flash_attn", False), ("checkpointing", False),
                           ("sequence_parallel", True), ("device", None), ("dtype", None)]
FLASH_ATTN_PARALLEL_LINEAR = ["in_features", "out_features", "process_group", ("bias", True),
                              ("sequence_parallel", True), ("multiple_of", 1), ("device", None), ("dtype", None)]


def _params(fn, kind=inspect.Parameter.POSITIONAL_OR_KEYWORD):
    """fn's parameters of that kind after self: flash-attn's (positional-or-keyword), or cuflash's
    keyword-only additions."""
    out = []
    for p in list(inspect.signature(fn).parameters.values())[1:]:
        if p.kind == kind:
            out.append(p.name if p.default is inspect.Parameter.empty else (p.name, p.default))
    return out


def test_flash_attn_signatures():
    assert _params(ParallelMHA.__init__) == FLASH_ATTN_PARALLEL_MHA
    assert _params(ParallelMHA.__init__, inspect.Parameter.KEYWORD_ONLY) == [("alibi_slope_scale", 1.0),
                                                                            ("alibi_train_seqlen", None)]
    assert _params(ColumnParallelLinear.__init__) == FLASH_ATTN_PARALLEL_LINEAR
    assert _params(RowParallelLinear.__init__) == FLASH_ATTN_PARALLEL_LINEAR
    fwd = inspect.signature(ParallelMHA.forward).parameters
    assert list(fwd)[:3] == ["self", "x", "seqlen"] and "inference_params" in fwd
    for name in ("all_gather_raw", "reduce_scatter_raw", "all_reduce_raw", "all_gather", "reduce_scatter",
                 "all_reduce", "sync_shared_params", "allreduce_sequence_parallel_grad", "get_dim_for_local_rank"):
        assert callable(getattr(cud, name)), name


def test_fused_dense_func_without_group():
    """No process group: F.linear (return_residual also returns x), flash-attn's signature."""
    from cuflash.ops.fused_dense import fused_dense_func

    x, w, b = torch.randn(3, 4, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64), torch.randn(5)
    b = b.double()
    assert torch.equal(fused_dense_func(x, w, b), torch.nn.functional.linear(x, w, b))
    out, res = fused_dense_func(x, w, return_residual=True)
    assert res is x and torch.equal(out, x @ w.t())
    assert _params(fused_dense_func) == ["weight", ("bias", None), ("return_residual", False), ("process_group", None),
                                         ("sequence_parallel", True)]


def test_column_parallel_saves_x_only_for_the_weight_gradient():
    """The column-parallel Function keeps this rank's x for dW alone: a frozen weight (adapters,
    a frozen backbone) holds nothing of x (the forward with sequence_parallel=False runs no collective)."""
    from cuflash.ops.fused_dense import _ColumnParallelLinearFunc

    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    for w_grad in (True, False):
        w = torch.randn(5, 8, dtype=torch.float64, requires_grad=w_grad)
        out = _ColumnParallelLinearFunc.apply(x, w, None, None, False)
        saved_x, saved_w = out.grad_fn.saved_tensors
        assert (saved_x is x) if w_grad else (saved_x is None)
        assert saved_w is w
        assert torch.equal(out, x.detach() @ w.detach().t())
