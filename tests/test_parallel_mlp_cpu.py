"""cuflash.modules.mlp's tensor-parallel MLPs (ParallelMLP, ParallelGatedMlp, ParallelFusedMLP)
without GPUs: 2 and 3 processes over gloo, CPU tensors, float64, against one single-process
Mlp / GatedMlp / FusedMLP whose weights the ranks' shards come from. Each process checks its
output and the gradients of its input and of every parameter shard, with and without
sequence_parallel (3 ranks: uneven splits of GatedMlp's hidden size). One spawn per world size;
a failure raises in the worker and fails mp.spawn. Plus the argument errors and flash-attn's
signatures."""
from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from cuflash.modules.mlp import (FusedMLP, GatedMlp, Mlp, ParallelFusedMLP, ParallelGatedMlp,  # noqa: E402
                                 ParallelMLP)
from cuflash.utils.distributed import local_range  # noqa: E402
from test_parallel_mha_cpu import F64_TOL, _close, _free_port, _params  # noqa: E402

F64 = dict(dtype=torch.float64)

# name: (single-process class, parallel class, shared kwargs, input "3d" (batch, seqlen, in) / "flat" (rows, in))
CASES_2 = {
    "mlp_gelu_3d": (Mlp, ParallelMLP, dict(in_features=8, hidden_features=12, out_features=6), "3d"),
    "mlp_relu_nobias2_flat": (Mlp, ParallelMLP, dict(in_features=6, hidden_features=10, activation=F.relu,
                                                     bias2=False), "flat"),
    "gated_glu_default_hidden": (GatedMlp, ParallelGatedMlp, dict(in_features=8, multiple_of=4), "3d"),   # 24
    "gated_swiglu_nobias1": (GatedMlp, ParallelGatedMlp, dict(in_features=8, hidden_features=10, multiple_of=5,
                                                              activation=F.silu, bias1=False), "flat"),
    "gated_gelu_out": (GatedMlp, ParallelGatedMlp, dict(in_features=6, hidden_features=6, out_features=4,
                                                        multiple_of=2, activation=F.gelu), "3d"),
    "fused_sqrelu": (FusedMLP, ParallelFusedMLP, dict(in_features=8, hidden_features=12, activation="sqrelu"), "3d"),
    "fused_gelu_approx_nobias": (FusedMLP, ParallelFusedMLP, dict(in_features=6, hidden_features=8, bias1=False,
                                                                  bias2=False), "flat"),
    "fused_relu_lvl2": (FusedMLP, ParallelFusedMLP, dict(in_features=8, hidden_features=12, activation="relu",
                                                         checkpoint_lvl=2), "3d"),
    "fused_gelu_lvl1": (FusedMLP, ParallelFusedMLP, dict(in_features=6, hidden_features=10, checkpoint_lvl=1), "flat"),
}
# 3 ranks: hidden 8 -> 3, 3, 2; 10 (multiple_of 5) -> 4, 3, 3; 12 -> 4 each
CASES_3 = {
    "gated_uneven_glu": (GatedMlp, ParallelGatedMlp, dict(in_features=6, hidden_features=8, multiple_of=4), "3d"),
    "gated_uneven_swiglu": (GatedMlp, ParallelGatedMlp, dict(in_features=6, hidden_features=7, multiple_of=5,
                                                             activation=F.silu), "flat"),
    "mlp_uneven": (Mlp, ParallelMLP, dict(in_features=4, hidden_features=7, activation=F.tanh), "3d"),
    "mlp_even": (Mlp, ParallelMLP, dict(in_features=4, hidden_features=12), "flat"),
    "fused_uneven_sqrelu": (FusedMLP, ParallelFusedMLP, dict(in_features=5, hidden_features=7, activation="sqrelu"),
                            "3d"),
}


def shard_mlp_state_dict(sd: dict, world: int, rank: int, gated: bool) -> dict:
    """This rank's shard of a single-process MLP's state dict (or gradients): fc1's rows of the
    rank's hidden units (gated: its y rows, then the same gate rows), fc2's columns, fc2's bias on
    rank 0 only."""
    hidden = sd["fc2.weight"].shape[1]
    a, b = local_range(hidden, world, rank)
    out = {}
    for key, t in sd.items():
        if key.startswith("fc1."):
            out[key] = torch.cat([t[a:b], t[hidden + a:hidden + b]]) if gated else t[a:b]
        elif key == "fc2.weight":
            out[key] = t[:, a:b]
        elif rank == 0:   # fc2.bias
            out[key] = t
    return out


def _check_case(rank, world, group, name, case, sp, seed):
    full_cls, par_cls, kw, mode = case
    torch.manual_seed(seed)
    full = full_cls(**kw, **F64)
    par = par_cls(process_group=group, sequence_parallel=sp, **kw, **F64)
    gated = full_cls is GatedMlp
    par.load_state_dict(shard_mlp_state_dict(full.state_dict(), world, rank, gated))
    g = torch.Generator().manual_seed(seed + 1)
    shape = (2 * world, 3) if mode == "3d" else (3 * world,)
    x = torch.randn(*shape, kw["in_features"], generator=g, **F64)
    xf = x.clone().requires_grad_()
    out = full(xf)
    dout = torch.randn(out.shape, generator=g, **F64)
    params = dict(full.named_parameters())
    grads = torch.autograd.grad(out, [xf, *params.values()], dout)

    def local(t):   # sequence_parallel: this rank's share of dimension 0; else replicated
        return t.chunk(world, dim=0)[rank] if sp else t

    what = f"{name} sp={sp} rank {rank}"
    xin = local(x).clone().requires_grad_()
    pout = par(xin)
    _close(pout, local(out.detach()), F64_TOL, f"{what}: out")
    pparams = dict(par.named_parameters())
    pgrads = torch.autograd.grad(pout, [xin, *pparams.values()], local(dout))
    _close(pgrads[0], local(grads[0]), F64_TOL, f"{what}: dx")
    expected = shard_mlp_state_dict(dict(zip(params, grads[1:])), world, rank, gated)
    assert sorted(expected) == sorted(pparams), (what, sorted(expected), sorted(pparams))
    for key, grad in zip(pparams, pgrads[1:]):
        _close(grad, expected[key], F64_TOL, f"{what}: d{key}")


def _check_fused_mlp_group(rank, world, group):
    """FusedMLP.forward(x, process_group): flash-attn's tensor-parallel use of the single-process
    module (this rank's shard of fc1's rows and fc2's columns, fc2's bias on rank 0, x's rows
    all-gathered, the output reduce-scattered), return_residual, every checkpoint_lvl."""
    for lvl in (0, 1, 2):
        torch.manual_seed(40 + lvl)
        kw = dict(in_features=6, hidden_features=4 * world, out_features=5, activation="gelu_approx",
                  checkpoint_lvl=lvl, return_residual=True)
        full = FusedMLP(**kw, **F64)
        hidden_local = len(range(*local_range(4 * world, world, rank)))
        part = FusedMLP(6, hidden_local, out_features=5, bias2=rank == 0, activation="gelu_approx",
                        checkpoint_lvl=lvl, return_residual=True, **F64)
        part.load_state_dict(shard_mlp_state_dict(full.state_dict(), world, rank, False))
        g = torch.Generator().manual_seed(50 + lvl)
        x = torch.randn(2 * world, 6, generator=g, **F64)
        dout = torch.randn(2 * world, 5, generator=g, **F64)
        xf = x.clone().requires_grad_()
        out, res = full(xf)
        grads = torch.autograd.grad(out, [xf, *full.parameters()], dout)
        rows = slice(2 * rank, 2 * rank + 2)
        xin = x[rows].clone().requires_grad_()
        pout, pres = part(xin, process_group=group)
        assert torch.equal(pres, xin)
        what = f"FusedMLP(process_group) lvl{lvl} rank {rank}"
        _close(pout, out.detach()[rows], F64_TOL, f"{what}: out")
        pgrads = torch.autograd.grad(pout, [xin, *part.parameters()], dout[rows])
        _close(pgrads[0], grads[0][rows], F64_TOL, f"{what}: dx")
        expected = shard_mlp_state_dict(dict(zip(dict(full.named_parameters()), grads[1:])), world, rank, False)
        for (key, _), grad in zip(part.named_parameters(), pgrads[1:]):
            _close(grad, expected[key], F64_TOL, f"{what}: d{key}")


def _check_errors(world, group):
    with pytest.raises(ValueError, match="process_group"):
        ParallelMLP(8, 16)
    with pytest.raises(ValueError, match="process_group"):
        ParallelGatedMlp(8, None, multiple_of=4)
    with pytest.raises(ValueError, match="hidden_features"):
        ParallelMLP(8, world - 1, process_group=group)
    with pytest.raises(ValueError, match="multiple_of"):
        ParallelGatedMlp(8, group, multiple_of=0)
    with pytest.raises(ValueError, match="activation"):
        ParallelFusedMLP(8, 16, activation="gelu", process_group=group)
    with pytest.raises(ValueError, match="checkpoint_lvl"):
        ParallelFusedMLP(8, 16, process_group=group, checkpoint_lvl=3)


def _check_autocast(rank, world, group):
    """Mixed precision: fp32 parameters under CPU autocast (bf16). The column-parallel Function casts
    as autocast would, so the backward's products see one dtype; out and the fp32 gradients match a
    single-process Mlp under the same autocast to bf16 accuracy."""
    torch.manual_seed(7)
    full = Mlp(8, hidden_features=12, out_features=6)
    par = ParallelMLP(8, 12, out_features=6, process_group=group, sequence_parallel=True)
    lo, hi = local_range(12, world, rank)
    with torch.no_grad():
        par.fc1.weight.copy_(full.fc1.weight[lo:hi])
        par.fc1.bias.copy_(full.fc1.bias[lo:hi])
        par.fc2.weight.copy_(full.fc2.weight[:, lo:hi])
        if par.fc2.bias is not None:
            par.fc2.bias.copy_(full.fc2.bias)
    x = torch.randn(2 * world, 8, generator=torch.Generator().manual_seed(8))   # the same on every rank
    rows = slice(2 * rank, 2 * rank + 2)
    xs = x[rows].clone().requires_grad_()
    xf = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref = par(xs), full(xf)
    assert out.dtype == torch.bfloat16
    (out.float() * torch.arange(out.numel()).view_as(out).add(2 * rank * 6)).sum().backward()
    (ref.float() * torch.arange(ref.numel()).view_as(ref)).sum().backward()
    tol = dict(atol=0.1, rtol=0.05)
    assert torch.allclose(out.float(), ref[rows].float(), **tol)
    assert xs.grad.dtype == torch.float32 and par.fc1.weight.grad.dtype == torch.float32
    assert torch.allclose(xs.grad, xf.grad[rows], **tol)
    assert torch.allclose(par.fc1.weight.grad, full.fc1.weight.grad[lo:hi], **tol)
    assert torch.allclose(par.fc2.weight.grad, full.fc2.weight.grad[:, lo:hi], **tol)


def _worker(rank, world, port):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        group = dist.new_group(list(range(world)))
        for i, (name, case) in enumerate(sorted((CASES_3 if world == 3 else CASES_2).items())):
            for sp in (True, False):
                _check_case(rank, world, group, name, case, sp, seed=100 + i)
        _check_errors(world, group)
        _check_autocast(rank, world, group)
        _check_fused_mlp_group(rank, world, group)
        m = ParallelGatedMlp(64, group)   # hidden int(8 * 64 / 3) = 170 -> 256 (multiple_of 128)
        h = len(range(*local_range(256, world, rank)))
        assert m.fc1.weight.shape == (2 * h, 64) and m.fc2.weight.shape == (64, h)
        assert (m.fc2.bias is not None) == (rank == 0)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_parallel_mlps_match_single_process(world):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world, _free_port()), nprocs=world, join=True)


FLASH_ATTN = {
    ParallelMLP: ["in_features", ("hidden_features", None), ("out_features", None), ("activation", F.gelu),
                  ("process_group", None), ("sequence_parallel", True), ("bias1", True), ("bias2", True),
                  ("device", None), ("dtype", None)],
    ParallelGatedMlp: ["in_features", "process_group", ("hidden_features", None), ("out_features", None),
                       ("activation", F.sigmoid), ("bias1", True), ("bias2", True), ("multiple_of", 128),
                       ("sequence_parallel", True), ("device", None), ("dtype", None)],
    GatedMlp: ["in_features", ("hidden_features", None), ("out_features", None), ("activation", F.sigmoid),
               ("bias1", True), ("bias2", True), ("multiple_of", 128), ("return_residual", False), ("device", None),
               ("dtype", None)],
    ParallelFusedMLP: ["in_features", ("hidden_features", None), ("out_features", None),
                       ("activation", "gelu_approx"), ("process_group", None), ("bias1", True), ("bias2", True),
                       ("sequence_parallel", True), ("checkpoint_lvl", 0), ("heuristic", "auto"), ("device", None),
                       ("dtype", None)],
}


@pytest.mark.parametrize("cls", list(FLASH_ATTN), ids=lambda c: c.__name__)
def test_flash_attn_signatures(cls):
    assert _params(cls.__init__) == FLASH_ATTN[cls]


def test_exported_names():
    import cuflash.modules.mlp as mlp
    from cuflash.ops import fused_dense

    assert {"ParallelMLP", "ParallelGatedMlp", "ParallelFusedMLP"} <= set(mlp.__all__)
    assert fused_dense.ParallelFusedMLP is ParallelFusedMLP and fused_dense.FusedMLP is FusedMLP
