"""Context parallelism: ring attention over torch.distributed (issue 15).

    import cuflash.distributed as cfd
    q_local = cfd.zigzag_shard(q, rank, world)              # (b, s/P, h, d), likewise k, v
    out_local = cfd.ring_flash_attn_func(q_local, k_local, v_local, causal=True)
    out = cfd.zigzag_unshard([out_0, ..., out_P-1])         # (b, s, h, d)

Each of the P ranks of a process group holds a shard of the sequence: q, k, v of shape
(batch, seqlen_local, nheads / nheads_kv, headdim), the same layout and semantics as
``cuflash.flash_attn_func`` on the whole sequence (GQA / MQA, softmax_scale, causal).

Forward (P steps). Step s: rank r holds the K/V block of rank (r - s) mod P; it runs
cuflash's forward (``torch_ops.forward``: the kernels on CUDA tensors, the float64
reference on CPU tensors) on its local Q and that block, giving a partial (O_s, lse_s),
and merges it into its running (O, lse) by log-sum-exp (``merge_partial``: flash-decoding's
combine, in fp32, two passes over O; step 0's partial covers every row and becomes the running
result itself, ``first_partial``). Meanwhile the block travels to rank r + 1 with
``torch.distributed.batch_isend_irecv``, issued on a side CUDA stream so that it overlaps
the step's computation (gloo on CPU: the same calls, no streams); a received block goes on
behind the previous transfer only, not behind the step's kernels (``EARLY_SEND``).

Backward (the same ring). dQ stays local (fp32 accumulator). The K/V blocks rotate as in the
forward. By default (``BWD_LOW_MEMORY``) each step's dK/dV shares of another rank's block go
straight home to that rank, in k's dtype, right after the step's kernels, and each rank sums the
shares of its own block in one fp32 accumulator; otherwise the dK/dV accumulator (fp32) of the
block in hand travels with it one step behind and, after the last step, one more hop returns it
to the block's owner, rounded to k's dtype first (the rounding the owner does anyway;
``DKV_HOME``: the shares go home during the next step instead). With ``REVERSE_BWD`` the forward keeps its last
block and the backward runs the ring the other way round from it, ending on the rank's own
block: no last hop. ``TRACE`` times every step's phases with CUDA events, every transfer on the
side stream and names each call's config (bench --mode ring --ring-breakdown: per-rank
timelines). Transfers run NCCL kernels, which need SMs of their own on both ends at once while
the attention kernels fill the GPU: ``PRIORITY_GROUP`` (transfers on a high-priority twin of
the default group; ``ring_group`` builds such a group to pass in) and ``FWD_DYNAMIC`` (no
static persistent forward, whose late CTAs would end a step late; from 3 ranks up,
``FWD_DYNAMIC_MIN_WORLD``) remove the 4-GPU straggler (both on; bench --ring-ab flips them);
``FWD_GRID_STEPS`` (off) runs the first forward steps' non-causal calls on a grid of one CTA
per tile, so that the chained transfers find SMs during the first step instead of spinning
through later ones; ``FWD_FULL_GRID_STEPS`` (1, non-causal rings from 3 ranks: in place of
FWD_DYNAMIC there) runs the first step on that grid and the later ones static persistent, with
every transfer done in the first step. Each step calls
cuflash's backward (``torch_ops.backward_impl``) with the GLOBAL merged out and lse: with
P = exp(S - lse_global) and D = rowsum(dO * O_global), every block's dS = P * (dP - D) is
exactly its share of the full gradient (the ring-attention identity), so no rescaling is
needed.

Memory per GPU (issue 15). In units of X = one local bf16 tensor of q's shape (batch ·
seqlen/P · nheads · headdim · 2 bytes; GQA's K/V blocks are smaller), the backward's peak is
reached during a step's kernels. With an fp32 dK/dV accumulator travelling with each block
(BWD_LOW_MEMORY and DKV_HOME off) it holds: out (saved by the forward, 1), the fp32 dQ
accumulator (2), the K/V block in hand (2) and the next one arriving (2, steps 0 .. P-2), the
accumulator leaving with the previous block (4) and the one arriving for the block in hand (4,
steps 1 ..), the kernels' dq, dk, dv (3; 2 for a causal ring's half-block calls) and their
workspace (the fp32 dQ sums, 2): 20 X from P = 3 on, 18 at P = 2 (no step has a K/V block and an
accumulator arriving at once); measured (tests/ring_memory_probe.py, 4 x H200, 32k positions per
rank, non-causal, above the inputs) 22.06 X at P = 4 (a K/V block sent two steps earlier still
held at step 2) and 18.06 at P = 2; single-GPU cuflash 6.05 X. Nothing is independent of the
sequence length (results/NVIDIA_H200x4/ring.json: 2.96, 5.92 GB at 256k, 512k tokens: 22.06 X
each). With BWD_LOW_MEMORY (on) one fp32 accumulator stays home and the shares (k's dtype) go
home between the steps: 16.06 X at P = 4, 15.03 at P = 2 (causal 15.06, 14.04): the home
accumulator (4) in place of the two travelling ones (8), the rest as above. With
DQ_IN_WORKSPACE (on) the kernels sum dQ in their own workspace, one for the whole ring: the ring's
dQ accumulator is the workspace's (2), and no call has a dq or a workspace of its own (3 X less;
a causal ring's half-block calls over some rows keep a workspace of their own, 1). With
HOME_LAZY_FP32 (on) the home accumulator is the first share itself (2, k's dtype) until a
second share comes: with 2 ranks for good (the second one is the last), and the last step's
block is dropped before the last exchange. Model: P >= 3, at a middle step's kernels: out 1,
dQ sums 2, the block in hand 2 and the next 2, home 4, the kernels' dk, dv 2 = 13 X (an exchange
between steps: the same with the shares leaving and arriving, 2 + 2, in place of the next block
and dk, dv); P = 2: out 1, dQ sums 2, the block 2, home 2, dk, dv 2 = 9 X (the last exchange:
the shares leaving and arriving in place of the block and dk, dv). Measured (session 19,
tests/ring_memory_probe.py --whole, 4 x H100, 32k positions per rank; non-causal / causal):
P = 4 16.06 / 15.06 X (BWD_LOW_MEMORY alone) -> 13.06 / 14.09 (DQ_IN_WORKSPACE; HOME_LAZY_FP32
changes nothing there); P = 2 14.06 / 13.06 -> 11.06 / 12.09 -> 9.06 / 10.09; single-GPU
flash_attn_func on the whole sequence of the 2-rank ring 12.09 X, of the 4-rank one 24.19 X.
bench --mode ring at 256k tokens (GiB per GPU, non-causal / causal): P = 1 3.02, P = 2 2.27 /
2.52, P = 4 1.63 / 1.76 (session 18: 3.76 / 3.51 and 2.01 / 1.88). Where the P = 4 peak's 13 X
come from (probe --phases, a middle step's kernels): out 1, the dQ sums 2 (the shared workspace),
the home sums 4 (fp32 from the second share on: 3 or more shares), the block in hand 2, the next
block arriving 2, the kernels' dK, dV shares 2; at P = 2 the next block is not there (the last
step) and the home sums stay bf16 (2): 9. With BWD_HEAD_GROUPS (G = 4, on) the backward's ring
runs once per group of heads: all but out scales with 1/G, and dq, dk, dv (3) are allocated
first: 1 + 3 + 12 / G = 7 X at P >= 3, 1 + 3 + 8 / G = 6 at P = 2. Measured (session 20,
ring_memory_probe.py --simulate, 64k positions per rank, and the 4 x H200 probe, 32k, alike;
non-causal / causal): P = 4 7.16 / 7.30 X, the forward's peak from G = 4 on (the fp32 running out,
the block in hand and the next, a block's out: 7.16), P = 2 6.04 / 6.30, against single-GPU
flash_attn_func's 6.05 on the same local shard: bytes per GPU 0.30x (P = 4) and 0.50x (P = 2) of
one GPU on the whole sequence (bench --mode ring at 256k, 4 x H200: 0.90 / 0.91 GiB per GPU at P =
4, 1.51 / 1.57 at P = 2, 3.02 on one GPU). FWD_HEAD_GROUPS (off) runs the forward's ring per group
of heads too: 1 + 7 / G for the forward. The floor of this design is out, the gradients, the dQ
sums, the blocks in hand and the home sums: every term scales with seqlen / P. dK/dV added into the
home accumulator by the kernels' epilogue would not lower the peak: only the rank's own block is
added at home (step 0, not the peak step); the shares of the others' blocks must be written out
anyway, to be sent. Peaks are torch's max_memory_allocated: a buffer still in flight on the side
stream after Python let go of it (record_stream) is not counted there, though its memory is not
reused before the transfer ends.

Causal: the sequence is cut into 2P chunks of equal length; the zigzag layout (the
default) gives rank i the chunks i and 2P-1-i, so that every rank has the same amount of
unmasked work (``zigzag_shard`` / ``zigzag_unshard``); ``layout="contiguous"`` gives rank i
chunk i alone (rank P-1 then does P times the work of rank 0). Each step classifies every
(q chunk, k chunk) pair as full, diagonal (the usual causal mask: cuflash's causal is
bottom-right aligned, the same for equal lengths) or masked (skipped) and runs one cuflash
call per rectangle of pairs (``step_calls``). Without causal the layout does not matter
(all pairs are full; any sharding of the sequence gives the same result).

Varlen (``ring_flash_attn_varlen_func``): a packed batch of sequences of different lengths,
flash_attn_varlen_func's layout (q (total, nheads, headdim), k, v (total, nheads_kv,
headdim), int32 ``cu_seqlens`` of batch + 1 offsets), self-attention (one cu_seqlens for q
and k), every sequence split over the P ranks:

    q_local, cu_local = cfd.varlen_shard(q, cu_seqlens, rank, world)  # likewise k, v
    out_local = cfd.ring_flash_attn_varlen_func(q_local, k_local, v_local, cu_seqlens,
                                                max_seqlen, causal=True)
    out = cfd.varlen_unshard([out_0, ..., out_P-1], cu_seqlens, world)

* Every sequence is cut into 2P equal chunks (zigzag) or P (contiguous), so every length
  must be a multiple of 2P (zigzag) or P (contiguous); length 0 is allowed.
* Local layout (``varlen_shard``): the rank's first chunk of every sequence, packed in
  sequence order, then (zigzag) its second chunk of every sequence, packed likewise. Each
  local half is itself a packed varlen batch whose offsets are the same for every rank and
  every half: cu_seqlens // (2P) (zigzag; cu_seqlens // P contiguous). ``varlen_shard``
  also returns the local offsets of the chunks in local order (2·batch + 1 of them for
  zigzag, batch + 1 contiguous): a valid cu_seqlens of the local tensor, one "sequence" per
  chunk (for per-chunk work such as rotary positions; the ring itself does not take it).
* ``ring_flash_attn_varlen_func`` takes the GLOBAL cu_seqlens and max_seqlen (the same on
  every rank, those flash_attn_varlen_func would take on the unsharded tensors); the local
  q, k, v have total / P rows.
* Because every sequence's chunks have the same index on a rank, a (q half, k half) pair
  is of one kind (full, diagonal, masked) for all sequences at once: each live pair is one
  varlen call over the halves (``varlen_step_calls``: one call per pair, since a sequence's
  two local chunks are not adjacent rows), merged into the running (out, lse) as above.
  Zigzag, causal: 3 calls on the rank's own block, 2 on every other; without causal 4 per
  step (the same work as the dense ring's one call, in quarter-size calls). lse is
  flash_attn_varlen_func's (nheads, total_local). The ring, the fp32 dK/dV accumulators
  one step behind, the global out/lse in the backward, GQA / MQA: as above. CUDA tensors
  run the varlen kernels (``cuflash.varlen_torch``), CPU tensors the float64 reference.
  cu_seqlens values are read back once per call to check them (a sync, as
  flash_attn_varlen_func's check; none with cuflash.api.CHECK_CU_SEQLENS = False); the
  ring itself never reads them on the host.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from . import api, reference, select, torch_ops

Tensor = torch.Tensor

LAYOUTS = ("zigzag", "contiguous")
FULL, DIAG, MASKED = "full", "diag", "masked"


# ---------------------------------------------------------------------------------------
# sharding helpers

def _check_dim(name: str, x: Tensor, dim: int) -> int:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch tensor, got {type(x).__name__}")
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"dim: {dim} is out of range for {name} of shape {tuple(x.shape)}")
    return dim % x.ndim


def _check_rank(rank, world) -> None:
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"world: expected an int >= 1, got {world!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world:
        raise ValueError(f"rank: expected an int in [0, {world}), got {rank!r}")


def zigzag_shard(x: Tensor, rank: int, world: int, dim: int = 1) -> Tensor:
    """Rank ``rank``'s shard of a full sequence in the zigzag layout: x cut into 2·world
    equal chunks along ``dim``, chunks rank and 2·world-1-rank concatenated (a new tensor)."""
    dim = _check_dim("x", x, dim)
    _check_rank(rank, world)
    n = x.shape[dim]
    if n % (2 * world):
        raise ValueError(f"x: the length along dim {dim} ({n}) must be a multiple of "
                         f"2 * world = {2 * world} (zigzag: 2 chunks per rank)")
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def zigzag_unshard(shards: Sequence[Tensor], dim: int = 1) -> Tensor:
    """The full sequence from every rank's zigzag shard (shards[i]: rank i's)."""
    shards = list(shards)
    if not shards:
        raise ValueError("shards: expected one tensor per rank, got none")
    dim = _check_dim("shards[0]", shards[0], dim)
    world = len(shards)
    n = shards[0].shape[dim]
    for i, s in enumerate(shards):
        _check_dim(f"shards[{i}]", s, dim)
        if s.shape != shards[0].shape:
            raise ValueError(f"shards[{i}]: shape {tuple(s.shape)} differs from shards[0]'s "
                             f"{tuple(shards[0].shape)}")
    if n % 2:
        raise ValueError(f"shards: the length along dim {dim} ({n}) must be even (zigzag: "
                         "2 chunks per rank)")
    chunks = [None] * (2 * world)
    for i, s in enumerate(shards):
        chunks[i], chunks[2 * world - 1 - i] = s.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def contiguous_shard(x: Tensor, rank: int, world: int, dim: int = 1) -> Tensor:
    """Rank ``rank``'s shard in the contiguous layout: chunk ``rank`` of ``world``."""
    dim = _check_dim("x", x, dim)
    _check_rank(rank, world)
    if x.shape[dim] % world:
        raise ValueError(f"x: the length along dim {dim} ({x.shape[dim]}) must be a multiple "
                         f"of world = {world}")
    return x.chunk(world, dim=dim)[rank].clone()


def contiguous_unshard(shards: Sequence[Tensor], dim: int = 1) -> Tensor:
    return torch.cat(list(shards), dim=dim)


def chunk_ids(rank: int, world: int, layout: str) -> tuple:
    """The global chunk indices a rank holds, in its local order (zigzag: 2·world chunks in
    all, contiguous: world)."""
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


# ---------------------------------------------------------------------------------------
# which pairs of chunks each step computes

def pair_kind(q_chunk: int, k_chunk: int, causal: bool) -> str:
    """A (q chunk, k chunk) pair of equal-length chunks of one sequence: FULL (every key
    visible), DIAG (the usual causal triangle) or MASKED (no key visible: skipped)."""
    if not causal or k_chunk < q_chunk:
        return FULL
    return DIAG if k_chunk == q_chunk else MASKED


@dataclass(frozen=True)
class Call:
    """One cuflash call of a step: local q chunks [q0, q1) against the block's k chunks
    [k0, k1) (chunk units of the local order), causal or not."""
    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


def step_calls(q_chunks: tuple, k_chunks: tuple, causal: bool) -> list:
    """The cuflash calls that cover a step's unmasked (q chunk, k chunk) pairs, as few as
    the pair pattern allows: one causal call when the block is the rank's own (the local
    causal mask is then the global one, chunks being in ascending order), one full call
    when the unmasked pairs form one rectangle of FULL pairs, else one call per pair."""
    kinds = [[pair_kind(qc, kc, causal) for kc in k_chunks] for qc in q_chunks]
    nq, nk = len(q_chunks), len(k_chunks)
    if all(kind == MASKED for row in kinds for kind in row):
        return []
    if causal and tuple(q_chunks) == tuple(k_chunks) and list(q_chunks) == sorted(q_chunks):
        return [Call(0, nq, 0, nk, True)]
    live = [(i, j) for i in range(nq) for j in range(nk) if kinds[i][j] != MASKED]
    rows = sorted({i for i, _ in live})
    cols = sorted({j for _, j in live})
    rect = (len(live) == len(rows) * len(cols) and rows == list(range(rows[0], rows[-1] + 1))
            and cols == list(range(cols[0], cols[-1] + 1)))
    if rect and all(kinds[i][j] == FULL for i, j in live):
        return [Call(rows[0], rows[-1] + 1, cols[0], cols[-1] + 1, False)]
    return [Call(i, i + 1, j, j + 1, kinds[i][j] == DIAG) for i, j in live]


# ---------------------------------------------------------------------------------------
# the merge: flash-decoding's combine of partial results

def merge_partial(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold one partial attention result into the running one, in place.

    out (batch, seqlen, nheads, headdim) and lse (batch, nheads, seqlen): the running
    result, fp32 (or float64), lse = -inf where no key has been seen yet. block_out, block_lse:
    the same rows' attention over another set of keys (block_lse = +inf: the block had no
    key for the row, cuflash's fully-masked convention). With L = log(exp(lse) + exp(lse_b)):
    out = exp(lse - L)·out + exp(lse_b - L)·out_b, lse = L. Computed around m = max(lse,
    lse_b), so no exp overflows, and with m = 0 where both are -inf (never -inf - -inf)."""
    block_lse = block_lse.to(lse.dtype).masked_fill(torch.isposinf(block_lse), -math.inf)
    m = torch.maximum(lse, block_lse)
    m = m.masked_fill(torch.isneginf(m), 0.0)
    w_old, w_new = torch.exp(lse - m), torch.exp(block_lse - m)
    total = w_old + w_new
    seen = total > 0
    inv = torch.where(seen, 1.0 / torch.where(seen, total, 1.0), 0.0)
    lse.copy_(torch.where(seen, m + torch.log(torch.where(seen, total, 1.0)), -math.inf))
    # (b, h, s) weights -> (b, s, h, 1) to scale the rows of out
    a = (w_old * inv).transpose(1, 2).unsqueeze(-1)
    c = (w_new * inv).transpose(1, 2).unsqueeze(-1)
    out.mul_(a).addcmul_(block_out, c)  # one pass: out·a, then + block_out·c (block_out's
    # dtype read as is, the product in out's)


def first_partial(block_out: Tensor, block_lse: Tensor, acc) -> tuple:
    """The running (out, lse) after the first partial result of every row: the block's own,
    in the accumulator dtype (what merge_partial gives on a running result that has seen no key,
    without allocating that empty result and merging into it)."""
    lse = block_lse.to(acc)
    return block_out.to(acc), lse.masked_fill_(torch.isposinf(lse), -math.inf)


# ---------------------------------------------------------------------------------------
# one block: cuflash's forward and backward (CUDA: kernels; CPU: the float64 reference)

def block_forward(q, k, v, scale: float, causal: bool, step: int = 0, world: int = 0,
                  ring_causal: Optional[bool] = None):
    """(out, lse) of q against one K/V block: cuflash's torch forward (no autograd); with
    FWD_DYNAMIC on the dynamic scheduler where selection picks the static persistent one (in a
    non-causal ring, ring_causal False (None: the call's causal), or with FWD_DYNAMIC_CAUSAL in any,
    of at least FWD_DYNAMIC_MIN_WORLD ranks; world 0: any), and for a non-causal call of the
    ring's first FWD_GRID_STEPS steps on a grid of one CTA per tile where selection picks a
    persistent one. In a non-causal ring (ring_causal False) of at least FWD_DYNAMIC_MIN_WORLD
    ranks with FWD_FULL_GRID_STEPS: the first FWD_FULL_GRID_STEPS steps on that grid, the later
    ones as selected (no FWD_DYNAMIC). step: the ring step (FWD_GRID_STEPS; TRACE's config
    record)."""
    if ring_causal is None:
        ring_causal = causal
    big = world == 0 or world >= FWD_DYNAMIC_MIN_WORLD
    full_grid = FWD_FULL_GRID_STEPS > 0 and big and not ring_causal
    grid = not causal and (step < FWD_GRID_STEPS or (full_grid and step < FWD_FULL_GRID_STEPS))
    dynamic = FWD_DYNAMIC and big and not full_grid and (FWD_DYNAMIC_CAUSAL or not ring_causal)
    config = _forward_config(q, k, v, scale, causal, grid) if (dynamic or grid) and \
        q.is_cuda else None
    out, lse, entry = torch_ops._forward(q, k, v, scale, causal, config, None)
    if TRACE is not None and q.is_cuda:
        _trace_config("fwd_config", step, entry.plan.config if entry is not None and
                      entry.plan is not None else config)
    return out, lse


_dynamic_configs: dict = {}


def _forward_config(q, k, v, scale: float, causal: bool, grid: bool = False):
    """The config selection picks for this forward call, changed: grid=False, on the dynamic
    scheduler when it is a static persistent one that the dynamic scheduler can run; grid=True,
    on a grid of one CTA per tile (no persistent schedule, static or dynamic) when it is
    persistent (FWD_GRID_STEPS). None: selection's own (nothing to change, or the changed config
    does not fit). Cached per call shape."""
    key = (q.shape, k.shape, q.dtype, q.device, causal, grid)
    if key not in _dynamic_configs:
        problem = api.check_qkv(q, k, v, scale, causal)[4]
        fam, cfg, _ = select.choose_on_device(problem, q.device.index)
        alt = None
        # stream_tail (a static persistent schedule's balanced last stretch) goes with the static
        # schedule: off in both changed configs (with it on, neither is a valid config)
        tail = {"stream_tail": False} if getattr(cfg, "stream_tail", False) else {}
        if grid and getattr(cfg, "persistent", False):
            alt = cfg.replace(persistent=False, dynamic=False, tile_overlap=False, section=0, **tail)
        elif not grid and getattr(cfg, "persistent", False) and getattr(cfg, "dynamic", None) is False:
            alt = cfg.replace(dynamic=True, **tail)
        if alt is not None:
            from . import _gpu

            if alt.problems(_gpu.max_smem(q.device.index)) or fam.fits(alt, problem):
                alt = None
        _dynamic_configs[key] = alt
    return _dynamic_configs[key]


def block_backward(dout, q, k, v, out, lse, scale: float, causal: bool, deterministic: bool,
                   step: int = 0):
    """(dq, dk, dv) of one block given the GLOBAL out and lse. CUDA: cuflash's backward
    kernels (they read out and lse as given). CPU: ``reference_block_backward`` (the torch
    CPU path of cuflash's backward recomputes the block's own softmax, which is the wrong
    normalization for a block of a ring). step: the ring step, for TRACE's config record."""
    if q.is_cuda:
        q, k, v, out, lse = (x.contiguous() for x in (q, k, v, out, lse))
        grads = torch_ops.backward_impl(dout, q, k, v, out, lse, scale, causal, deterministic)
        if TRACE is not None:
            plan = torch_ops._bwd_plans.get(torch_ops._bwd_key(dout, q, k, v, out, lse, scale,
                                                               causal, deterministic, None))
            _trace_config("bwd_config", step, getattr(plan, "config", plan))
        return grads
    return reference_block_backward(dout, q, k, v, out, lse, scale, causal)


def reference_block_backward(dout, q, k, v, out, lse, scale: float, causal: bool):
    """Float64 (dq, dk, dv) of attention of q on one K/V block given the GLOBAL out and lse
    (q's rows normalized over all keys): P = exp(scale·QKᵀ - lse), D = rowsum(dO∘O),
    dV = PᵀdO, dS = P∘(dO Vᵀ - D), dQ = scale·dS K, dK = scale·dSᵀQ (GQA: summed over the
    query heads of a K/V head). causal: bottom-right aligned, as cuflash's. Rows with
    lse = +inf (no key anywhere) contribute nothing."""
    f64 = torch.float64
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    qh = q.to(f64).permute(0, 2, 1, 3)                                   # (b, h, sq, d)
    kh = k.to(f64).permute(0, 2, 1, 3).repeat_interleave(g, dim=1)       # (b, h, sk, d)
    vh = v.to(f64).permute(0, 2, 1, 3).repeat_interleave(g, dim=1)
    do = dout.to(f64).permute(0, 2, 1, 3)
    o = out.to(f64).permute(0, 2, 1, 3)
    s = scale * qh @ kh.transpose(-1, -2)                                # (b, h, sq, sk)
    lse64 = lse.to(f64).unsqueeze(-1)
    p = torch.exp(s - lse64)  # lse = +inf rows: exp(-inf) = 0 (nan from inf - inf: below)
    if causal:
        i = torch.arange(sq).unsqueeze(1)
        j = torch.arange(sk).unsqueeze(0)
        p = p.masked_fill(j > i + (sk - sq), 0.0)
    p = torch.nan_to_num(p, nan=0.0)
    dv = p.transpose(-1, -2) @ do
    dp = do @ vh.transpose(-1, -2)
    delta = (do * o).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = scale * ds @ kh
    dk = scale * ds.transpose(-1, -2) @ qh
    dk = dk.reshape(b, hk, g, sk, d).sum(2)
    dv = dv.reshape(b, hk, g, sk, d).sum(2)
    back = lambda x, like: x.permute(0, 2, 1, 3).to(like.dtype).contiguous()  # noqa: E731
    return back(dq, q), back(dk, k), back(dv, v)


# ---------------------------------------------------------------------------------------
# dQ summed over a ring's block calls (DQ_IN_WORKSPACE)

# Whether the dense ring's backward sums dQ in the backward kernels' own fp32 accumulator: the
# workspace of the first call that covers every local q row (step 0's, the rank's own block) stays
# for the whole ring; its preprocess zeroes the accumulator and writes LSE·log2e and D =
# rowsum(dO∘O) (the same rows, out and dout for every block); every later call over all the rows
# runs the main kernel alone on it (adding its dQ share, as the kernel adds its K/V blocks'), and
# after the last step one launch of the dQ convert (dQ = scale · accumulator) writes dq. A call
# over some rows only (a causal ring's half-block steps) runs with a workspace of its own, and its
# accumulator rows are added in (fp32, exact). The calls run with dq_first and dq_convert off
# (dq_first zeroes a Q block's rows in the main kernel; dq_convert converts after every call). Off:
# every call allocates its workspace (fp32 dQ sums, 2 X) and dq (1 X), and dq (rounded to q's
# dtype) is added into a separate fp32 accumulator (2 X): 3 X more at the peak (module docstring).
# The same sums in another rounding (dQ's shares are no longer rounded to q's dtype before they are
# added: closer to single-GPU attention, which sums every K/V block in that accumulator);
# deterministic calls stay bitwise reproducible (the turn counters are zeroed before each call).
# Measured (session 19 round 1, 1 x H100, tests/ring_dqsum_timing.py: one rank's 4 non-causal 64k x
# 64k block calls, 8 heads, d128, alternated, median of 5): 315.4 -> 300.9 ms, peak above the inputs
# 13.03 -> 11.03 X (the calls' dK/dV, kept, included); dQ error against the float64 block gradients
# (tests/test_distributed_dqsum_gpu.py) 1.84e-3 / 2.31e-3 / 1.12e-3 / 3.74e-3 against the old path's
# 1.86e-3 / 3.48e-3 / 1.28e-3 / 3.23e-3. 4 x H100, 1M tokens non-causal at P = 4, same processes
# (bench --ring-ab dq_ws): backward 5174.5 ms without it, 5144.6 with it; peak per GPU 16.06 -> 13.06
# X (module docstring). On.
DQ_IN_WORKSPACE = True

_FIRST_ROLES = ("preprocess", "main", "reduce_dkv")  # (reduce_dkv: GQA / MQA only)
_LATER_ROLES = ("main", "reduce_dkv")
_acc_plans: dict = {}


# The backward fields an accumulating ring plan turns off: each would convert or zero dQ inside one launch
# (dq_first, dq_convert) or behind it (dq_tail), where the ring adds several launches into one dQ.
_ACC_OFF = ("dq_first", "dq_convert", "dq_tail")


def _acc_plan(dout, q, k, v, out, lse, scale: float, causal: bool, deterministic: bool):
    """The backward plan of one ring block call that adds into a dQ accumulator (DQ_IN_WORKSPACE):
    the config selection picks, with dq_first and dq_convert off; None where the call runs no
    single plan on these tensors (reference, padding, copies, dout copied by the preprocess,
    misaligned pointers): the caller takes the plain path."""
    key = torch_ops._bwd_key(dout, q, k, v, out, lse, scale, causal, deterministic, "ring_acc")
    if key not in _acc_plans:
        plan = None
        try:
            problem = api.check_qkv(q, k, v, scale, causal, "bwd", deterministic)[4]
            cfg = select.choose_on_device(problem, q.device.index)[1]
            # (dq_tail: its convert, a programmatic dependent, waits for counts that the ring's repeated main
            # launches would have passed already)
            flags = {f: False for f in _ACC_OFF if getattr(cfg, f, False)}
            plan = torch_ops._bwd_verdict(dout, q, k, v, out, lse, scale, causal, deterministic,
                                          cfg.replace(**flags) if flags else None)
        except (ValueError, TypeError, select.UnsupportedProblem):
            plan = None
        if plan.__class__ is str or plan is None or "dout_copy" in plan.workspace_offsets or \
                any(getattr(plan.config, f, False) for f in _ACC_OFF):
            plan = None
        _acc_plans[key] = plan
    plan = _acc_plans[key]
    if plan is not None and (dout.data_ptr() | q.data_ptr() | k.data_ptr() | v.data_ptr()
                             | out.data_ptr()) & 15:
        return None
    return plan


def _same_rows(a, b) -> bool:
    """Whether two backward plans lay out the workspace's per-row pieces (LSE·log2e, D, the dQ
    accumulator) alike: the same rows, head dim and offsets (one workspace serves both)."""
    pa, pb = a.problem, b.problem
    wa, wb = a.workspace_offsets, b.workspace_offsets
    return ((pa.batch, pa.nheads, pa.seqlen_q, a.config.head_dim)
            == (pb.batch, pb.nheads, pb.seqlen_q, b.config.head_dim)
            and all(wa.get(n) == wb.get(n) for n in ("lse_log2", "D", "dq_accum")))


def _ws_dq(ws: Tensor, plan) -> Tensor:
    """The fp32 dQ accumulator in a backward workspace, (batch, nheads, rows, kernel head dim)
    (rows: seqlen_q rounded up to the workspace's row padding), unscaled."""
    from .families.fa2_bwd import ROW_PAD

    p = plan.problem
    rows, hd = -(-p.seqlen_q // ROW_PAD) * ROW_PAD, plan.config.head_dim
    off = plan.workspace_offsets["dq_accum"]
    return ws[off:off + p.batch * p.nheads * rows * hd * 4].view(torch.float32).view(
        p.batch, p.nheads, rows, hd)


class _DqSum:
    """dQ of the local q summed over a ring backward's block calls: ``block`` runs one call (its
    dK, dV returned) and adds its dQ share, ``result`` gives dq in q's dtype. The sums are kept
    unscaled (dQ = softmax_scale · acc), (batch, nheads, rows, head dim) as the kernels keep them:
    with ``in_workspace`` (DQ_IN_WORKSPACE, CUDA) in the first all-rows call's workspace, otherwise
    in an accumulator of their own (q's accumulation dtype) into which each call's dq is added."""

    def __init__(self, q: Tensor, scale: float, in_workspace: bool):
        self.q, self.scale = q, scale
        self.in_workspace = bool(in_workspace) and q.is_cuda
        self.acc = None   # the unscaled sums, once a call has run
        self.ws = None    # in_workspace: the workspace (uint8) that holds acc
        self.plan = None  # in_workspace: the plan whose preprocess filled ws (its convert writes dq)
        self.ptrs = None  # that call's input pointers (the convert's writer encodes them)

    def block(self, dout, q, k, v, out, lse, causal: bool, deterministic: bool, rows: slice,
              all_rows: bool, step: int = 0, strided: bool = False) -> tuple:
        """(dk, dv) of q's ``rows`` (a slice of the local rows; all_rows: every one) on one K/V
        block given the GLOBAL out and lse; the call's dQ goes into the sums. strided: q, k, v,
        out are head-group views (BWD_HEAD_GROUPS), read by the kernels through their strides
        (no copy; the same row stride as the whole tensors); a call that runs no single plan on
        them takes the plain path (copies)."""
        if self.in_workspace:
            if strided:
                lse = lse.contiguous()
            else:
                q, k, v, out, lse = (x.contiguous() for x in (q, k, v, out, lse))
            plan = _acc_plan(dout, q, k, v, out, lse, self.scale, causal, deterministic)
            if plan is not None:
                if TRACE is not None:
                    _trace_config("bwd_config", step, plan.config)
                if all_rows and (self.ws is not None or self.acc is None) and \
                        (self.plan is None or _same_rows(plan, self.plan)):
                    return self._shared(plan, dout, q, k, v, out, lse, deterministic)
                if self.acc is not None:
                    return self._own(plan, dout, q, k, v, out, lse, rows)
        dq, dk, dv = block_backward(dout, q, k, v, out, lse, self.scale, causal, deterministic,
                                    step)
        self._sums()[:, :, rows, :dq.shape[-1]] += dq.transpose(1, 2).to(self._dtype()) / self.scale
        return dk, dv

    def _dtype(self):
        return _acc_dtype(self.q.dtype)

    def _sums(self) -> Tensor:
        if self.acc is None:
            b, n, h, d = self.q.shape
            self.acc = torch.zeros((b, h, n, d), dtype=self._dtype(), device=self.q.device)
        return self.acc

    def _launch(self, plan, roles, ws: Tensor, dout, q, k, v, out, lse) -> tuple:
        dk, dv = k.new_empty(k.shape), v.new_empty(v.shape)
        if api.POISON_OUTPUTS:
            dk.fill_(math.nan)
            dv.fill_(math.nan)
        ptrs = (dout.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                lse.data_ptr())
        # dq 0: no launch among roles writes dq (dq_convert off; the convert runs in result)
        plan.run_roles(roles, ptrs + (0, dk.data_ptr(), dv.data_ptr()), ws.data_ptr(),
                       torch_ops._raw_stream(plan.device))
        return ptrs, dk, dv

    def _shared(self, plan, dout, q, k, v, out, lse, deterministic: bool) -> tuple:
        """An all-rows call on the shared workspace: the first runs the preprocess (zeroed sums,
        LSE·log2e, D), the later ones the main kernel alone."""
        if self.ws is None:
            self.ws = q.new_empty(plan.workspace_bytes, dtype=torch.uint8)
            ptrs, dk, dv = self._launch(plan, _FIRST_ROLES, self.ws, dout, q, k, v, out, lse)
            self.plan, self.ptrs, self.acc = plan, ptrs, _ws_dq(self.ws, plan)
            return dk, dv
        if plan.workspace_bytes > self.ws.numel():  # (GQA: a longer block's dK/dV sums)
            grown = self.ws.new_empty(plan.workspace_bytes)
            grown[:self.ws.numel()].copy_(self.ws)
            self.ws, self.acc = grown, _ws_dq(grown, self.plan)
        if deterministic and "dq_semaphore" in plan.workspace_offsets:
            # the dQ turn counters start at 0 (the preprocess, not run here, zeroes them)
            off = plan.workspace_offsets["dq_semaphore"]
            nxt = min([o for n, o in plan.workspace_offsets.items() if o > off] + [self.ws.numel()])
            self.ws[off:nxt].zero_()
        return self._launch(plan, _LATER_ROLES, self.ws, dout, q, k, v, out, lse)[1:]

    def _own(self, plan, dout, q, k, v, out, lse, rows: slice) -> tuple:
        """A call over some rows: its own workspace (zeroed sums), its rows added in (fp32)."""
        ws = q.new_empty(plan.workspace_bytes, dtype=torch.uint8)
        dk, dv = self._launch(plan, _FIRST_ROLES, ws, dout, q, k, v, out, lse)[1:]
        d, n = q.shape[-1], rows.stop - rows.start  # (the kernel's head dim may be larger)
        self.acc[:, :, rows, :d] += _ws_dq(ws, plan)[:, :, :n, :d]
        return dk, dv

    def result(self) -> Tensor:
        """dq in q's dtype (q's shape): the convert launch on the shared workspace, else the sums
        scaled and rounded."""
        q = self.q
        if self.acc is None:
            return torch.zeros_like(q)
        if self.ws is not None:
            dq = q.new_empty(q.shape)
            plan = self.plan
            plan.run_roles(("convert_dq",), self.ptrs + (dq.data_ptr(), 0, 0), self.ws.data_ptr(),
                           torch_ops._raw_stream(plan.device))
            return dq
        d = q.shape[-1]
        return (self.acc[..., :d] * self.scale).transpose(1, 2).to(q.dtype).contiguous()


# ---------------------------------------------------------------------------------------
# the ring: send the block in hand to rank + 1, receive the next from rank - 1

class _Ring:
    """Point-to-point exchange with the ring neighbours of a group, on a side CUDA stream
    (CUDA tensors) so that the transfer overlaps the current stream's computation."""

    def __init__(self, group, device: torch.device):
        group = self.group = _transfer_group(group, device)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        to_global = (lambda r: r) if group is None or group is dist.group.WORLD else \
            (lambda r: dist.get_global_rank(group, r))
        self.to_global = to_global
        self.next = to_global((self.rank + 1) % self.world)
        self.prev = to_global((self.rank - 1) % self.world)
        self.stream = None
        if device.type == "cuda":
            self.stream = _side_streams.get(device)
            if self.stream is None:
                self.stream = _side_streams[device] = torch.cuda.Stream(device)

    def start(self, tensors: Sequence[Tensor], after_current: bool = True,
              reverse: bool = False, trace: Optional[tuple] = None, peers=None,
              recv_like: Optional[Sequence[Tensor]] = None) -> tuple:
        """Send each tensor to the next rank and receive one like it from the previous
        (reverse: to the previous, from the next); returns (received tensors, pending
        requests). The received tensors may be read only after ``finish``.

        after_current=True: the transfer starts after everything the current stream has queued
        (the tensors sent were written there). False (EARLY_SEND, for tensors that an earlier
        transfer received: NCCL's own stream order makes them ready): it starts as soon as the
        earlier transfers are done, while the current stream still computes, so that its
        kernels are on the GPU before the next step's kernels fill the SMs. Then the received
        buffers are allocated on the side stream (the current stream's queued work may still
        use memory its own pool would hand out) and marked as used by the current stream too
        (record_stream), which reads them after ``finish``.

        trace: (phase, step) to time the transfer under TRACE: CUDA events on the side stream
        when it reaches the transfer (the transfer may start: its inputs are ready and the
        earlier transfers queued) and when the transfer is done (the side stream waits for it
        first; it would wait for the next one anyway, NCCL's stream being in order).

        peers: (to, from) group ranks instead of the ring neighbours (DKV_HOME's shares);
        recv_like: the tensors to receive are shaped like these instead of like ``tensors``
        (either list may then be empty: nothing sent, or nothing received)."""
        new = torch.empty_like if recv_like is None else \
            (lambda t: torch.empty(t.shape, dtype=t.dtype, device=t.device))
        like = tensors if recv_like is None else recv_like
        if peers is None:
            to, frm = (self.prev, self.next) if reverse else (self.next, self.prev)
        else:
            to, frm = (self.to_global(r) for r in peers)
        if not tensors and not like:
            return [], []
        if self.stream is None:
            recv = [new(t) for t in like]
            return recv, dist.batch_isend_irecv(self._ops(tensors, recv, to, frm))
        current = torch.cuda.current_stream(self.stream.device)
        if after_current:
            recv = [new(t) for t in like]
            # the side stream starts after what the current stream has queued (the tensors
            # sent are ready); NCCL then runs on its own streams after the side stream
            self.stream.wait_stream(current)
        else:
            with torch.cuda.stream(self.stream):
                recv = [new(t) for t in like]
            for r in recv:
                r.record_stream(current)
        timed = trace is not None and TRACE is not None
        with torch.cuda.stream(self.stream):
            if timed:
                ready = torch.cuda.Event(enable_timing=True)
                ready.record()
            reqs = dist.batch_isend_irecv(self._ops(tensors, recv, to, frm))
            if timed:
                for req in reqs:
                    req.wait()
                done = torch.cuda.Event(enable_timing=True)
                done.record()
                TRACE.append((*trace, ready, done))
        for t in list(tensors) + recv:  # used by the side stream: not reused before it is done
            t.record_stream(self.stream)
        return recv, reqs

    def _ops(self, tensors, recv, to: int, frm: int) -> list:
        """Send each of ``tensors`` to global rank ``to``, receive each of ``recv`` from ``frm``
        (in list order: the peer's sends and receives pair up by their order; a send and a
        receive of the same index side by side, then the longer list's rest)."""
        ops = []
        for i in range(max(len(tensors), len(recv))):
            if i < len(tensors):
                ops.append(dist.P2POp(dist.isend, tensors[i], to, self.group))
            if i < len(recv):
                ops.append(dist.P2POp(dist.irecv, recv[i], frm, self.group))
        return ops

    def finish(self, reqs) -> None:
        """Wait for the transfers: on CUDA the current stream waits (not the host)."""
        for req in reqs:
            req.wait()
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


# Whether the rings send a received K/V block on without waiting for the current stream
# (_Ring.start's after_current=False): the block's transfer is queued behind the earlier
# transfers only (in the backward these include the previous accumulator's, which waits for
# the additions into it), not behind the step's kernels, so that it need not race the next
# step's kernels for the SMs (a persistent kernel holding every SM would keep it out to the
# end). False: every transfer waits for all the current stream has queued (and the
# backward's K/V block and accumulator travel in one batch).
EARLY_SEND = True

# Whether the dense ring's backward runs the other way round (ring_backward's kv_last): the
# forward keeps the K/V block it ends with (rank + 1's), the backward starts on it without a
# transfer and passes blocks and accumulators to rank - 1, so that its last step is the rank's
# own block: its accumulator is home when the step ends, with no last hop (the cost: that
# block, as large as the local K/V, kept from the forward to the backward).
REVERSE_BWD = False

# Whether the backward sends each step's dK/dV shares of a block straight home, to the block's
# owner, in the kernels' dtype (k's), where one fp32 accumulator per rank sums them
# (_rotate_backward_home), instead of passing the block's fp32 accumulator on with the block.
# The same sum of the same rounded shares (in another order), so the same error. Per step the
# wire carries the K/V block and the shares (4 bytes a K/V value, not 6 with an fp32
# accumulator); a rank adds a share one step after it was made instead of waiting at every step
# end for its neighbour's additions (no chain of additions around the ring); with 2 ranks no
# accumulator is in flight during a step at all (4 bytes a K/V value less at the peak). The
# shares do not go to a neighbour: step s's go s hops back (one node's NVSwitch: every pair at
# the same bandwidth). Unmeasured: off.
DKV_HOME = False

# With the shares sent home (the backward takes DKV_HOME's path whatever DKV_HOME says): each
# step's shares leave right after the step's kernels and the next step's kernels wait for the
# exchange, instead of travelling during the next step. No share is then in flight while a step
# runs: the peak per GPU loses the two share buffers (4 bytes per local K/V value: 16 instead of
# 20 local bf16 q-sized tensors, the same at every P), for a transfer between the steps that is
# exposed (the shares, k's dtype, once each way; the whole GPU free for it) and a wait at every
# step for the rank it exchanges with. Faster too where the step kernels hold every SM (selection's
# dynamic persistent backward): an accumulator transfer queued during a step got SMs on one rank and
# spun there through the whole step waiting for its peer (4 x H200, 1M tokens non-causal, session 18
# round 1: rank 0's steps 1 and 2 1494 and 1484 ms against 1310-1347 on the others). Measured there,
# same processes, one repetition each: 1M non-causal backward 5640 -> 5278 ms (DKV_HOME alone 5645),
# 512 -> 537 TFLOPs/GPU fwd + bwd; 1M causal 2691 (DKV_HOME) / 2769 (as is, warm) -> 2590 ms; peak
# per GPU (32k positions per rank, tests/ring_memory_probe.py) 22.06 -> 16.06 X at P = 4, 18.06 ->
# 15.03 X at P = 2 (non-causal). On.
BWD_LOW_MEMORY = True

_side_streams: dict = {}

# Whether the rings move blocks over a process group of their own whose NCCL streams have high
# priority (ring_group), made once from the default group on the first ring call that passes
# group=None (every rank makes that call; a group passed in is used as given: build it with
# ring_group). A transfer's NCCL kernel spins on its SMs until the peer's kernel runs; at
# normal priority the peer's kernel can queue behind a whole step of attention blocks, so
# that this end loses those SMs for that step (the 4-GPU straggler of session 15: one rank's
# middle steps 1.2-2x longer). At high priority the peer's kernel takes the first SMs that
# free up. Measured (4 x H200, 512k tokens non-causal, bench --ring-ab, same run): 518 ->
# 543 TFLOPs/GPU alone, 561 with FWD_DYNAMIC (torch CP on cuDNN 543); on.
PRIORITY_GROUP = True

# NCCL's CTAs (SMs) per transfer kernel on PRIORITY_GROUP's group (ring_group's max_ctas; None:
# NCCL's choice): a spinning transfer kernel holds that many SMs (bench --ring-ab lib_ctasN).
RING_MAX_CTAS: Optional[int] = None

# Whether the dense ring's forward runs a call whose selected config is the static persistent
# schedule on the dynamic scheduler instead (the same tiles; the CTAs claim them): a CTA that
# starts late, its SM held by a transfer's kernel, then computes one tile instead of a fixed
# 1/132 of the step, so the step does not end a transfer's wait later. Measured as above:
# forward 524 -> 460 ms alone (the single-GPU shard's four steps: 441), 518 -> 533 TFLOPs/GPU;
# on (non-causal rings; causal ones with FWD_DYNAMIC_CAUSAL). Selection's static configs with
# stream_tail run it without their balanced tail (_forward_config; until session 18 such a
# config kept it from applying at all). Session 18, 4 x H200, 1M tokens non-causal: forward 2079
# ms with it (steps 465-588 ms), 2061 without (static stream_tail: one rank's step 1 739 ms, the
# rest 419-461); 512k: 462 ms with it (the shard's 4 x 105, torch CP 490).
FWD_DYNAMIC = True
# The smallest ring FWD_DYNAMIC applies to. With 2 ranks the forward has one transfer, queued
# before the first step's kernels, so no CTA starts more than that transfer late (3-6 ms), and
# the static persistent schedule is the faster one there: 2 x H100, 512k tokens non-causal (the
# 4-GPU 1M cell's call shape, 256k x 256k; session 17, results/NVIDIA_H100_80GB_HBM3x2/logs/
# session17_ring4/ring2.log): forward 939 ms on the dynamic scheduler, 896 static (the shard's
# 2 x 447), 559 -> 565 TFLOPs/GPU fwd + bwd (grid of one CTA per tile, FWD_GRID_STEPS: 914 ms).
FWD_DYNAMIC_MIN_WORLD = 3
# Whether FWD_DYNAMIC applies to causal rings too (their half-block steps are non-causal calls). Off:
# 4 x H200, 1M tokens causal (session 18 round 1), the half-block steps on selection's static
# persistent schedule (with stream_tail) ran the forward in 892 ms, no rank straggling (each step
# 210-231 ms; the single-GPU shard 217); on the dynamic scheduler it took 941 ms in session 16. The
# non-causal ring of the same run straggled without it (one rank's step 1 739 ms, the others' 454-461:
# selection's stream_tail configs had kept FWD_DYNAMIC from applying at all, fixed in
# _forward_config).
FWD_DYNAMIC_CAUSAL = False

# How many of the dense ring's first forward steps run their non-causal calls on a grid of one CTA
# per tile where selection picks a persistent schedule (0: none; bench --ring-ab fwd_gridN). A
# persistent forward holds every SM for its whole step, so a transfer queued during it (EARLY_SEND
# chains them: the block received is sent on at once) gets SMs only when the step ends, and each
# rank's transfer kernel, at high priority (PRIORITY_GROUP), then takes its SMs first and spins
# there until the slowest neighbour's kernel runs. The 1M-token non-causal timeline (4 x H200,
# session 16, results/NVIDIA_H200x4/logs/session16_ring3/ring3.log): every rank's step-2 transfer
# ran from 517.6 to 1023.3 ms, the whole of step 1, waiting for the rank whose step-1 kernel had
# filled its SMs first; step 1 took 27-76 ms more than step 0 on every rank (fwd 2100 ms against
# the shard's 4 x 459). On a grid, tiles retire all the time (one tile is 3.7 ms there), so each
# transfer's kernel gets SMs within a tile of being queued on every rank and the chained transfers
# all end in the first step; the later steps run persistent with no transfer left to wait for.
# Causal calls keep their schedule (the causal 1M forward ran at the shard's speed, 941 against
# 4 x 234 ms). Unmeasured: off.
FWD_GRID_STEPS = 0

# Non-causal rings of at least FWD_DYNAMIC_MIN_WORLD ranks: how many first steps run on a grid of
# one CTA per tile (as FWD_GRID_STEPS), the later steps then on the config selection picks (the
# static persistent one: FWD_DYNAMIC is left to causal rings there; 0: off, FWD_DYNAMIC and
# FWD_GRID_STEPS as they are). On the grid every transfer of the forward gets its SMs within a
# tile and the chained transfers end in the first step (FWD_GRID_STEPS' note), so that the later
# steps have none left to make room for and the static persistent schedule, the faster one for a
# non-causal call (2 x H100, 256k x 256k: 896 ms static, 939 dynamic), has nothing to straggle
# behind. Causal rings keep FWD_DYNAMIC: their step 0 is the causal call, on which the dynamic
# scheduler is the faster one (4 x H200, 1M tokens: 213 ms, the static shard's 234). The cell it
# is for: 1M tokens non-causal at P = 4, the one torch CP still won (session 18 final, 4 x H200:
# forward 2079 ms on the dynamic scheduler, 2061 static with one rank's step 1 at 739; torch CP's
# forward 1962). Measured (session 19, 4 x H100 (the call asked for H200s), same processes, bench
# --ring-ab fwd_fullgrid1 fwd_fullgrid4 --ring-ab-seqlens 1048576 --ring-ab-causal no; results/
# NVIDIA_H100_80GB_HBM3x4/logs/session19_ring6/): forward 1976 ms as it was (dynamic), 1777 with
# 1 grid step, 1835 with all 4 on the grid; 553 -> 571 TFLOPs/GPU fwd + bwd. The final bench ran with
# it (--ring-set fwd_fullgrid1): 1M non-causal forward 1782 ms (steps: grid 469-498, then static
# 418-438), 569 TFLOPs/GPU against torch CP on cuDNN's 540 (its forward 1963), efficiency 1.00;
# 512k 570 / 537, 256k 548 / 520. 1: on (FWD_DYNAMIC then runs the causal rings' calls only).
FWD_FULL_GRID_STEPS = 1

_priority_groups: dict = {}


def ring_group(ranks=None, high_priority: bool = True, max_ctas: Optional[int] = None):
    """A new NCCL process group for the rings' transfers (``dist.new_group``: every rank of the
    default group calls it, members or not), its streams at high priority (see
    PRIORITY_GROUP) and, with max_ctas, NCCL's kernels limited to that many CTAs (SMs).
    ranks: the members (default every rank). Pass it as the ring's ``group``."""
    if max_ctas is not None and (not isinstance(max_ctas, int) or isinstance(max_ctas, bool)
                                 or max_ctas < 1):
        raise ValueError(f"max_ctas: expected an int >= 1 or None, got {max_ctas!r}")
    if not hasattr(dist, "ProcessGroupNCCL"):
        raise RuntimeError("ring_group: this torch has no NCCL (ProcessGroupNCCL)")
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = bool(high_priority)
    if max_ctas is not None:
        opts.config.max_ctas = max_ctas
    return dist.new_group(ranks=ranks, backend="nccl", pg_options=opts)


def _transfer_group(group, device: torch.device):
    """The group the ring moves blocks over: ``group``, or with PRIORITY_GROUP (CUDA tensors,
    group None) the default group's high-priority twin (ring_group with RING_MAX_CTAS, made
    once per RING_MAX_CTAS and default group: a default group made anew after
    destroy_process_group gets a twin of its own)."""
    if not PRIORITY_GROUP or device.type != "cuda" or group not in (None, dist.group.WORLD):
        return group
    key = ("world", RING_MAX_CTAS, dist.group.WORLD)
    twin = _priority_groups.get(key)
    if twin is None:
        twin = _priority_groups[key] = ring_group(max_ctas=RING_MAX_CTAS)
    return twin


# ---------------------------------------------------------------------------------------
# per-step timing (bench --mode ring --ring-breakdown)

# None: off. A list: the rings append (phase, step, start event, end event), CUDA events
# recorded on the current stream around each phase of each step (CUDA tensors only):
# fwd_compute / bwd_compute (cuflash's kernels), fwd_merge (LSE merges), bwd_accum (dQ, dK,
# dV additions), fwd_wait / bwd_wait (the current stream waiting for the step's transfer:
# exposed communication), fwd_final / bwd_final (the last conversions; the backward's last
# dK/dV hop home included); on the side stream, from reaching a transfer to its end:
# fwd_xfer / bwd_xfer (K/V blocks), bwd_acc_xfer (dK/dV accumulators), bwd_home_xfer (the last
# hop); ("origin", -1, event, event) at the start of each ring call (the timeline's time 0);
# (fwd_config / bwd_config, step, config name, None) for each kernel call. ``trace_summary``
# sums the timed phases per step, ``trace_timeline`` gives every span's start and end.
TRACE: Optional[list] = None


class _Span:
    """``with _Span(phase, step, x):`` records CUDA events around the block when TRACE is on
    and x is a CUDA tensor; nothing otherwise."""
    __slots__ = ("key", "start")

    def __init__(self, phase: str, step: int, like: Tensor):
        self.key = (phase, step) if TRACE is not None and like.is_cuda else None

    def __enter__(self):
        if self.key is not None:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        return self

    def __exit__(self, *exc):
        if self.key is not None and TRACE is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            TRACE.append((*self.key, self.start, end))
        return False


def _trace_origin(like: Tensor) -> None:
    """Under TRACE, an event on the current stream before a ring's first transfer and kernel:
    trace_timeline's time 0."""
    if TRACE is not None and like.is_cuda:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        TRACE.append(("origin", -1, ev, ev))


def _trace_config(phase: str, step: int, config) -> None:
    """Under TRACE, the config name of a call of a step (phase fwd_config or bwd_config)."""
    if TRACE is not None and config is not None:
        TRACE.append((phase, step, getattr(config, "name", str(config)), None))


def _timed(entry) -> bool:
    return entry[3] is not None and entry[0] != "origin"


def _sync_events(trace: list) -> None:
    """Wait for the device when the trace holds events (config names alone need no GPU)."""
    if any(entry[3] is not None for entry in trace):
        torch.cuda.synchronize()


def trace_summary(trace: list) -> dict:
    """{phase: [ms of step 0, step 1, ...]} from TRACE's events (synchronizes first): the
    compute stream's phases and, for the transfers (fwd_xfer, bwd_xfer, bwd_acc_xfer,
    bwd_home_xfer), the time from the side stream reaching a transfer to its end (a transfer
    longer than its bytes need was waiting: for its peer's kernel, or for SMs)."""
    _sync_events(trace)
    out: dict = {}
    for phase, step, start, end in filter(_timed, trace):
        steps = out.setdefault(phase, [])
        steps.extend([0.0] * (step + 1 - len(steps)))
        steps[step] += start.elapsed_time(end)
    return out


def trace_timeline(trace: list) -> tuple:
    """(spans, configs) of one traced ring call: spans [(phase, step, start ms, end ms)], the
    times from the call's origin event (the same clock for the compute and the side stream),
    in recording order; configs [(phase, step, config name)] (synchronizes first)."""
    _sync_events(trace)
    origin = next((e[2] for e in trace if e[0] == "origin"), None)
    spans, configs = [], []
    for phase, step, start, end in trace:
        if end is None:
            configs.append((phase, step, start))
        elif phase != "origin" and origin is not None:
            spans.append((phase, step, origin.elapsed_time(start), origin.elapsed_time(end)))
    return spans, configs


# ---------------------------------------------------------------------------------------
# forward and backward

def _slices(call: Call, q_len: int, k_len: int) -> tuple:
    return slice(call.q0 * q_len, call.q1 * q_len), slice(call.k0 * k_len, call.k1 * k_len)


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _sendable(k: Tensor, v: Tensor) -> tuple:
    """k and v as the ring sends them: contiguous (a strided view, say k, v = kv.unbind(2), is
    copied once; NCCL would send its numel elements from its first address, gaps and all)."""
    return k.contiguous(), v.contiguous()


def _rotate_forward(ring: _Ring, kv: tuple, comm: bool, step_fn) -> tuple:
    """The forward ring: for each of the P steps, ``step_fn(step, src, k_block, v_block)`` on
    the K/V block in hand (src: its owner) while that block travels on to the next rank.
    comm=False: no transfers (every step sees the local block: wrong results, the same work;
    for timing the computation alone)."""
    world, rank = ring.world, ring.rank
    for step in range(world):
        pending = None
        if comm and step + 1 < world:  # step 0's block is the local one, written by this stream
            nxt, pending = ring.start(kv, after_current=step == 0 or not EARLY_SEND,
                                      trace=("fwd_xfer", step))
        step_fn(step, (rank - step) % world, *kv)
        if pending is not None:
            with _Span("fwd_wait", step, kv[0]):
                ring.finish(pending)
            kv = tuple(nxt)
    return kv  # the block of the last step: rank + 1's (comm=False: the local one)


def _step_and_receive(ring: _Ring, step_fn, step: int, src: int, kv: tuple, recv_kv, pending,
                      comm: bool) -> tuple:
    """A backward step: step_fn on the block in hand, then the compute stream waits for the
    step's transfers (bwd_wait). Returns (the step's dK/dV shares, the next step's block)."""
    shares = step_fn(step, src, *kv)
    if pending:
        with _Span("bwd_wait", step, kv[0]):
            ring.finish(pending)
    if comm and step + 1 < ring.world:
        kv = tuple(recv_kv)
    return shares, kv


def _rotate_backward(ring: _Ring, kv: tuple, comm: bool, acc, step_fn, first=None,
                     like: Optional[tuple] = None) -> tuple:
    """The backward ring: K/V blocks travel as in the forward, each with its fp32 dK/dV
    accumulator one step behind. ``step_fn(step, src, k_block, v_block)`` adds dQ's share
    itself and returns this rank's share of the block's dK, dV as [(index, dk_b, dv_b)]
    (index: where in the block, as a tensor index; None: the whole block). The shares stay in
    the kernels' dtype until the block's accumulator has arrived and are then added into it
    (a share covering the whole block of a block's first rank becomes the accumulator itself),
    so that only two fp32 pairs live at a time: the one leaving and the one arriving. Returns
    the local block's (dK, dV) in k's dtype: the accumulators are rounded to it before the last
    hop brings them home (the same rounding the owner would do; half the bytes on the wire).

    first: (REVERSE_BWD) the block of rank + 1, which the forward ended with: the ring runs
    the other way round from it (blocks rank + 1, rank + 2, ..., rank; transfers to rank - 1),
    and the last step's block is the local one, so no last hop. like: the local (k, v) whose
    shape, dtype and device the results take (default kv; not kept alive as blocks: kv may be a
    copy made to be sent, let go after its transfer)."""
    world = ring.world
    k, v = kv if like is None else like
    reverse = first is not None
    if reverse:
        kv = tuple(first)
    dkv = None  # the dK/dV accumulator of the block in hand, after this rank's share
    for step in range(world):
        recv_kv, recv_acc, pending = [], [], []
        send_kv, send_acc = comm and step + 1 < world, comm and step > 0
        early = EARLY_SEND and step > 0  # (step 0's block is the local one)
        if send_kv and (early or not send_acc):
            recv_kv, reqs = ring.start(kv, after_current=not early, reverse=reverse,
                                       trace=("bwd_xfer", step))
            pending += reqs
        if send_acc:  # the previous block's accumulator goes on with that block
            if early or not send_kv:  # its own transfer, behind this stream's additions
                recv_acc, reqs = ring.start(dkv, reverse=reverse, trace=("bwd_acc_xfer", step))
            else:  # one batch with the K/V block, both behind this stream's work
                both, reqs = ring.start(list(kv) + list(dkv), reverse=reverse,
                                        trace=("bwd_xfer", step))
                recv_kv, recv_acc = both[:2], both[2:]
            pending += reqs
        src = (ring.rank + 1 + step) % world if reverse else (ring.rank - step) % world
        parts, kv = _step_and_receive(ring, step_fn, step, src, kv, recv_kv, pending, comm)
        with _Span("bwd_accum", step, k):
            if comm and step > 0:  # the block's accumulator as it left the previous rank
                dk_acc, dv_acc = recv_acc
            elif len(parts) == 1 and parts[0][0] is None:  # the block's first share: all of it
                dk_acc, dv_acc = parts[0][1].to(acc), parts[0][2].to(acc)
                parts = []
            else:
                dk_acc = torch.zeros(k.shape, dtype=acc, device=k.device)
                dv_acc = torch.zeros(v.shape, dtype=acc, device=v.device)
            for index, dk_b, dv_b in parts:
                if index is None:
                    dk_acc += dk_b
                    dv_acc += dv_b
                else:
                    dk_acc[index] += dk_b
                    dv_acc[index] += dv_b
        del parts, recv_kv, recv_acc
        dkv = (dk_acc, dv_acc)
    with _Span("bwd_final", world - 1, k):
        dkv = (dkv[0].to(k.dtype), dkv[1].to(v.dtype))
        if comm and world > 1 and not reverse:  # one more hop: the block is rank + 1's
            dkv, pending = ring.start(dkv, trace=("bwd_home_xfer", world - 1))
            ring.finish(pending)
    return tuple(dkv)


# Whether the home accumulator of _rotate_backward_home stays the first share itself (k's dtype, as
# the kernels wrote it or it arrived) until a second share comes, and with 2 shares in all (2
# ranks) for good: the second is then added in k's dtype (torch adds two bf16 tensors in fp32 and
# rounds once: the bits of the fp32 sum rounded at the end). The fp32 accumulator (4 bytes per K/V
# value) exists only from the second of 3 or more shares on. Same results, bitwise (tests/
# test_distributed_cpu.py, bf16). Measured (session 19, tests/ring_memory_probe.py, 4 x H100, 32k
# positions per rank): P = 2 11.06 -> 9.06 X non-causal, 12.09 -> 10.09 causal; P = 4 unchanged
# (13.06: its peak step holds the fp32 sums anyway). On.
HOME_LAZY_FP32 = True


def _add_shares(home, shares, k: Tensor, v: Tensor, acc, left: Optional[list] = None):
    """home (dK, dV of a block: fp32, or with HOME_LAZY_FP32 its first share in k's dtype; None:
    none yet) plus shares [(index, dk, dv)] (index as _rotate_backward's); a first share
    covering the whole block becomes home itself. left: [how many shares are still to come,
    these included] (counted down; None: unknown): the last share is added into a home still in
    k's dtype there, any other turns it into fp32 first."""
    for index, dk_b, dv_b in shares:
        if left is not None:
            left[0] -= 1
        if home is None and index is None:
            home = (dk_b, dv_b) if HOME_LAZY_FP32 else (dk_b.to(acc), dv_b.to(acc))
            continue
        if home is None:
            home = (torch.zeros(k.shape, dtype=acc, device=k.device),
                    torch.zeros(v.shape, dtype=acc, device=v.device))
        elif home[0].dtype != acc and (left is None or left[0] > 0):
            dk_h, dv_h = home
            home = None
            dk_h = dk_h.to(acc)  # one tensor at a time (the k-dtype one freed before the next)
            dv_h = dv_h.to(acc)
            home = (dk_h, dv_h)
        if index is None:
            home[0].add_(dk_b)
            home[1].add_(dv_b)
        else:
            home[0][index] += dk_b
            home[1][index] += dv_b
    return home


def _rotate_backward_home(ring: _Ring, kv: tuple, comm: bool, acc, step_fn, share_index,
                          first=None, like: Optional[tuple] = None) -> tuple:
    """The backward ring with DKV_HOME: K/V blocks travel as in _rotate_backward; the dK/dV
    shares ``step_fn`` returns for another rank's block go to that rank at the start of the next
    step (while it computes), and the shares other ranks made of the local block come back the
    same way; the local block's fp32 accumulator stays home. share_index(rank): the indices, in
    order, of the shares ``rank`` makes of the local block (what its step_fn returns for it), so
    that they can be received. The last step's shares go home after the loop (the forward
    direction: the last block is rank + 1's; first given (REVERSE_BWD): the last block is the
    local one, nothing left to send). BWD_LOW_MEMORY: every step's shares go home right after
    its kernels, and the next step's kernels wait for them. Returns the local (dK, dV) in k's
    dtype. like: as _rotate_backward's."""
    world, rank = ring.world, ring.rank
    k, v = kv if like is None else like
    reverse = first is not None
    if reverse:
        kv = tuple(first)
    # the block of step s, and the rank that holds the local block at its step s
    owner = (lambda s: (rank + 1 + s) % world) if reverse else (lambda s: (rank - s) % world)
    holder = (lambda s: (rank - 1 - s) % world) if reverse else (lambda s: (rank + s) % world)

    def exchange(step: int, shares: list, trace: tuple):
        """Send the shares step ``step`` made (of owner(step)'s block); receive those
        holder(step) made of the local block: (received [(index, dk, dv)], requests)."""
        out = [t for _, dk_b, dv_b in shares for t in (dk_b, dv_b)]
        index = share_index(holder(step)) if holder(step) != rank else []
        like = [x[i] if i is not None else x for i in index for x in (k, v)]
        got, reqs = ring.start(out, trace=trace, peers=(owner(step), holder(step)),
                               recv_like=like)
        return [(i, got[2 * j], got[2 * j + 1]) for j, i in enumerate(index)], reqs

    home = None  # the local block's (dK, dV): fp32 (HOME_LAZY_FP32: the first share until a second)
    made = None  # (step, shares) of another rank's block, made by the last step
    # how many shares the local block gets in all (each rank's calls on it; comm=False: unknown)
    left = [sum(len(share_index(r)) for r in range(world))] if comm else None
    for step in range(world):
        pending, recv_kv, incoming = [], [], []
        if comm and step + 1 < world:
            recv_kv, reqs = ring.start(kv, after_current=not (EARLY_SEND and step > 0),
                                       reverse=reverse, trace=("bwd_xfer", step))
            pending += reqs
        if comm and made is not None:
            incoming, reqs = exchange(*made, trace=("bwd_acc_xfer", step))
            pending += reqs
        made = None
        src = owner(step)
        shares, kv = _step_and_receive(ring, step_fn, step, src, kv, recv_kv, pending, comm)
        with _Span("bwd_accum", step, k):
            if src == rank or not comm:  # (comm=False: every step sees the local block)
                home = _add_shares(home, shares, k, v, acc, left)
            else:
                made = (step, shares)
            home = _add_shares(home, incoming, k, v, acc, left)
        del shares, recv_kv, incoming
        if BWD_LOW_MEMORY and made is not None and step + 1 < world:  # home now, waited for
            with _Span("bwd_wait", step, k):
                incoming, reqs = exchange(*made, trace=("bwd_acc_xfer", step))
                ring.finish(reqs)
            made = None  # (the shares sent: the side stream holds them until they are gone)
            with _Span("bwd_accum", step, k):
                home = _add_shares(home, incoming, k, v, acc, left)
            incoming = None
    kv = None  # the last step's block: not needed for the last exchange
    with _Span("bwd_final", world - 1, k):
        if made is not None:  # the last step's shares (rank + 1's block) go home
            incoming, reqs = exchange(*made, trace=("bwd_home_xfer", world - 1))
            ring.finish(reqs)
            made = None
            home = _add_shares(home, incoming, k, v, acc, left)
            incoming = None
        if home is None:  # (no share at all: not with a ring's own block, kept for safety)
            return torch.zeros_like(k), torch.zeros_like(v)
        return home[0].to(k.dtype), home[1].to(v.dtype)


# How many groups of heads the dense ring's backward runs in turn (ring_backward's _by_head_groups;
# the largest divisor of nheads_kv not above it is used; 1: all heads at once): the whole ring
# (every step, every transfer) on the first group's heads of q, dout, out (views, read in place
# through their strides) and of k, v (copies of the group's heads, to be sent), then on the next
# group's, each group's gradients written into dq, dk, dv, allocated first. Everything the ring
# holds besides out scales with the heads of a group: in units of X (module docstring) the
# backward's peak is out 1 + dq, dk, dv 3 + the one-group ring's peak without out (12 X from P = 3
# on, 8 at P = 2) / G: 4 + 12 / G from P = 3 on, 4 + 8 / G at P = 2, where G = 1 holds 13 and 9.
# The same block calls on fewer heads each (a call's grid 1/G as large), G times the transfers at
# 1/G the bytes (the same bytes in all): exact, each head's sums the same additions as with G = 1
# (the kernels keep heads apart; selection may pick another config for the smaller calls).
# Measured (session 20 round 2, 1 x H100, tests/ring_memory_probe.py --simulate: rank 0 of a ring
# in one process, transfers made on-GPU copies, 64k positions per rank = the 256k bench cell at
# P = 4, 8 heads; peak above the inputs in X, non-causal / causal; the backward's ms, variants
# alternated, median of 3): P = 4 G = 1 13.06 / 14.09 X (323.4 / 160.1 ms), G = 2 10.05 / 10.56
# (317.5 / 159.9), G = 4 7.16 / 7.30 (318.8 / 162.5), G = 8 7.16 / 6.59 (317.0 / 163.3); P = 2
# G = 1 9.06 / 10.09, G = 2 8.05 / 8.56, G = 4 6.04 / 6.30, G = 8 5.16 / 5.16 (159.6, 160.3,
# 159.6 ms non-causal for G = 1, 4, 8). From G = 4 on a P = 4 rank's peak is the forward's (7.16 X:
# the fp32 running out 2, the block in hand 2 and the next 2, a block's out 1), not the
# backward's; single-GPU flash_attn_func on the same local shard: 6.05 X. 4 x H200 (session 20,
# results/NVIDIA_H200x4/logs/session20_ring7/): the real probe (32k per rank) gives the same peaks
# to the digit; bench --mode ring at 256k: 0.90 / 0.91 GiB per GPU at P = 4, 1.51 / 1.57 at P = 2,
# 3.02 on one GPU; backward, same processes (--ring-ab bwd_groups1 bwd_groups2), 1M non-causal P =
# 4: 5225.6 ms (G = 4), 5362.4 (G = 1), 5264.9 (G = 2); 256k: 334.5, 331.7, 339.1. With the
# forward's ring per 4 groups too (FWD_HEAD_GROUPS), 8 groups here take a P = 4 rank to 5.54 / 5.66 X
# (4 groups: 7.04 X, the backward's own peak): 4 x H200, the lead's second call of session 20
# (results/NVIDIA_H200x4/logs/session20_lead/), see FWD_HEAD_GROUPS. 8: on.
BWD_HEAD_GROUPS = 8


# How many groups of heads the dense ring's forward runs in turn (ring_forward's
# _forward_by_head_groups; as BWD_HEAD_GROUPS: the whole ring on each group's heads, q as views, k,
# v copied to be sent, out and lse allocated first). The forward's peak (in X) is out 1 + the one-
# group ring's (the fp32 running out 2, the block in hand 2 and the next arriving 2, a block's out
# 1) / G: 1 + 7 / G from P = 3 on, where G = 1 holds 7.16, the P = 4 peak once BWD_HEAD_GROUPS is 4
# (session 20, 4 x H200 probe: 7.16 X at P = 4 for BWD_HEAD_GROUPS 4 and 8 alike). Exact (the
# kernels keep heads apart). G times the forward's transfers, each group's first step on
# FWD_FULL_GRID_STEPS' grid. Measured with BWD_HEAD_GROUPS = 8 ("g8f4") against 4 and 1 ("g4", the
# default before), 4 x H200, session 20 (results/NVIDIA_H200x4/logs/session20_lead/): the real
# probe (32k per rank, peak above the inputs in X, non-causal / causal) P = 4 5.54 / 5.66 against
# 7.16 / 7.30, P = 2 5.04 / 5.16 against 6.04 / 6.30 (single GPU on the same shard 6.05); bench
# --mode ring at 256k, peak GiB per GPU 0.69 / 0.71 at P = 4 and 1.26 / 1.29 at P = 2 (one GPU on
# the whole 256k: 3.02; 0.92-0.94x and 0.83-0.85x of 1/P); TFLOPs per GPU, the same processes
# (--ring-set bwd_groups8+fwd_groups4 --ring-ab bwd_groups4+fwd_groups1), non-causal / causal:
# P = 4 557.1 / 543.2 against 556.2 / 545.8, P = 2 570.5 / 574.7 against 576.1 / 576.7 (-1.0% to
# +0.2%). 4: on.
FWD_HEAD_GROUPS = 4


def _head_groups(nheads_kv: int, wanted: int) -> int:
    """The largest divisor of nheads_kv that is at most ``wanted`` (at least 1)."""
    return max(g for g in range(1, max(1, min(int(wanted), nheads_kv)) + 1) if nheads_kv % g == 0)


# Whether the dense rings run a step's non-causal call over several q chunks as one call per q
# chunk (the same work in smaller calls; bench --ring-ab split_q times it against one call).
SPLIT_Q = False


def _dense_calls(q_chunks: tuple, k_chunks: tuple, causal: bool) -> list:
    """step_calls, with SPLIT_Q's split of multi-chunk non-causal calls."""
    calls = step_calls(q_chunks, k_chunks, causal)
    if not SPLIT_Q:
        return calls
    return [Call(i, i + 1, c.k0, c.k1, False) if not c.causal else c
            for c in calls for i in (range(c.q0, c.q1) if not c.causal else (c.q0,))]


def _share_index(call: Call, n_k: int, k_len: int):
    """Where a dense call's dK/dV share goes in the block (n_k chunks of k_len positions): None
    for the whole block, else (slice(None), the call's k positions)."""
    if _covers(call, n_k, True):
        return None
    return slice(None), slice(call.k0 * k_len, call.k1 * k_len)


def _covers(call: Call, n_chunks: int, of_k: bool = False) -> bool:
    """Whether a call spans every local chunk of q (or, of_k, of the block's k)."""
    return (call.k0, call.k1) == (0, n_chunks) if of_k else (call.q0, call.q1) == (0, n_chunks)


def _forward_by_head_groups(groups: int, q, k, v, keep_last: bool, forward) -> tuple:
    """ring_forward's results run once per group of heads (FWD_HEAD_GROUPS): ``forward(q, k, v)``
    on group g's heads (views), its out, lse (and with keep_last its last K/V block) written into
    the whole ones."""
    b, n, h, _ = q.shape
    whole = [torch.empty(q.shape, dtype=q.dtype, device=q.device),
             torch.empty((b, h, n), dtype=torch.float32, device=q.device)]
    if keep_last:
        whole += [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (k, v)]
    hq, hk = h // groups, k.shape[2] // groups
    for g in range(groups):
        hs, hks = slice(g * hq, (g + 1) * hq), slice(g * hk, (g + 1) * hk)
        res = forward(q[:, :, hs], k[:, :, hks], v[:, :, hks])
        whole[0][:, :, hs] = res[0]
        whole[1][:, hs] = res[1]
        for i in range(2, len(whole)):
            whole[i][:, :, hks] = res[i]
        del res
    return tuple(whole)


def ring_forward(q, k, v, scale: float, causal: bool, group, layout: str, comm: bool = True,
                 keep_last: bool = False, head_views: bool = False):
    """(out, lse) of the local q over the whole sequence's K/V (no autograd). out: q's
    dtype; lse: fp32 (batch, nheads, seqlen_local), +inf for rows with no key.
    keep_last: (out, lse, k_last, v_last), the K/V block of the last step (rank + 1's), for
    ring_backward's kv_last (REVERSE_BWD).
    comm=False: no transfers (every step computes the real step's chunk pairs on the local
    block: wrong results, the same work; for timing the computation alone).
    The running result starts as the first partial that covers every row (the rank's own
    block, step 0: one call over all its rows, causal or not) instead of an empty result
    merged into. With FWD_HEAD_GROUPS the ring runs once per group of heads
    (_forward_by_head_groups; head_views: q is such a group's view, read in place)."""
    groups = 1 if head_views else _head_groups(k.shape[2], FWD_HEAD_GROUPS)
    if groups > 1:
        return _forward_by_head_groups(
            groups, q, k, v, keep_last,
            lambda q, k, v: ring_forward(q, k, v, scale, causal, group, layout, comm, keep_last,
                                         head_views=True))
    ring = _Ring(group, q.device)
    world, rank = ring.world, ring.rank
    q_chunks = chunk_ids(rank, world, layout)
    nq = len(q_chunks)
    q_len = q.shape[1] // nq
    acc = _acc_dtype(q.dtype)
    run = {}  # "out", "lse": the running result, once it exists

    def step(i, src, k_cur, v_cur):
        for call in _dense_calls(q_chunks, chunk_ids(src, world, layout), causal):
            qs, ks = _slices(call, q_len, q_len)
            with _Span("fwd_compute", i, q):
                o_b, lse_b = block_forward(q[:, qs], k_cur[:, ks], v_cur[:, ks], scale, call.causal,
                                           i, world, causal)
            with _Span("fwd_merge", i, q):
                if not run and _covers(call, nq):
                    run["out"], run["lse"] = first_partial(o_b, lse_b, acc)
                    continue
                if not run:
                    run["out"] = torch.zeros(q.shape, dtype=acc, device=q.device)
                    run["lse"] = torch.full((q.shape[0], q.shape[2], q.shape[1]), -math.inf,
                                            dtype=acc, device=q.device)
                merge_partial(run["out"][:, qs], run["lse"][:, :, qs], o_b, lse_b)

    _trace_origin(q)
    last = _rotate_forward(ring, _sendable(k, v), comm, step)
    with _Span("fwd_final", world - 1, q):
        if not run:  # (no call at all: not for a ring's own block, kept for safety)
            res = (torch.zeros_like(q), torch.full((q.shape[0], q.shape[2], q.shape[1]),
                                                   math.inf, dtype=torch.float32, device=q.device))
        else:
            lse = run["lse"].float().masked_fill_(torch.isneginf(run["lse"]), math.inf)
            res = (run["out"].to(q.dtype), lse)
    return (*res, *last) if keep_last else res


def _by_head_groups(groups: int, dout, q, k, v, out, lse, kv_last, backward) -> tuple:
    """(dq, dk, dv) of a ring backward run once per group of heads (BWD_HEAD_GROUPS): group g's
    heads of q, dout, out, lse and of k, v (kv_last) as views, ``backward(dout, q, k, v, out, lse,
    kv_last)`` on them, its gradients written into the whole ones."""
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    hq, hk = q.shape[2] // groups, k.shape[2] // groups
    for g in range(groups):
        hs, hks = slice(g * hq, (g + 1) * hq), slice(g * hk, (g + 1) * hk)
        last = None if kv_last is None else tuple(x[:, :, hks] for x in kv_last)
        grads = backward(dout[:, :, hs], q[:, :, hs], k[:, :, hks], v[:, :, hks], out[:, :, hs],
                         lse[:, hs], last)
        for whole, part, heads in zip((dq, dk, dv), grads, (hs, hks, hks)):
            whole[:, :, heads] = part
        del grads, part  # (the loop's name would keep the group's dv alive)
    return dq, dk, dv


def ring_backward(dout, q, k, v, out, lse, scale: float, causal: bool, group, layout: str,
                  deterministic: bool = False, comm: bool = True, kv_last=None,
                  head_views: bool = False):
    """(dq, dk, dv) of the local shards, out and lse: ring_forward's (global) results. dQ's
    fp32 accumulator starts as the first share covering every row (step 0's). kv_last:
    ring_forward's (k_last, v_last) (keep_last): the ring runs the other way round from that
    block, with no last hop (REVERSE_BWD); None: the forward's direction. With BWD_HEAD_GROUPS
    the ring runs once per group of heads (_by_head_groups), on head views (head_views: the
    kernels read q, dout, out through their strides, no copy)."""
    groups = 1 if head_views else _head_groups(k.shape[2], BWD_HEAD_GROUPS)
    if groups > 1:
        return _by_head_groups(
            groups, dout if dout.is_contiguous() else dout.contiguous(), q, k, v,
            out.contiguous(), lse, kv_last,
            lambda dout, q, k, v, out, lse, last: ring_backward(
                dout, q, k, v, out, lse, scale, causal, group, layout, deterministic, comm, last,
                head_views=True))
    ring = _Ring(group, q.device)
    world, rank = ring.world, ring.rank
    q_chunks = chunk_ids(rank, world, layout)
    nq = len(q_chunks)
    q_len = q.shape[1] // nq
    acc = _acc_dtype(q.dtype)
    if not head_views:
        dout, out = dout.contiguous(), out.contiguous()
    lse = lse.contiguous()
    grad = {}  # "dq": the fp32 accumulator, once it exists (DQ_IN_WORKSPACE off)
    lse_rows = {}  # (q0, q1) -> those rows of lse, contiguous once (the kernels read it dense)
    # DQ_IN_WORKSPACE: the sums in the kernels' workspace of the first call, which must then cover
    # every row (step 0's block: the rank's own, or rank + 1's with kv_last)
    first_src = rank if kv_last is None else (rank + 1) % world
    first_calls = _dense_calls(q_chunks, chunk_ids(first_src, world, layout), causal)
    sums = _DqSum(q, scale, DQ_IN_WORKSPACE and bool(first_calls)
                  and _covers(first_calls[0], nq)) if DQ_IN_WORKSPACE else None

    def step(i, src, k_cur, v_cur):
        parts = []
        k_chunks = chunk_ids(src, world, layout)
        for call in _dense_calls(q_chunks, k_chunks, causal):
            qs, ks = _slices(call, q_len, q_len)
            lse_q = lse_rows.get((call.q0, call.q1))
            if lse_q is None:
                lse_q = lse_rows[call.q0, call.q1] = lse[:, :, qs].contiguous()
            if sums is not None:
                with _Span("bwd_compute", i, q):
                    dk_b, dv_b = sums.block(dout[:, qs], q[:, qs], k_cur[:, ks], v_cur[:, ks],
                                            out[:, qs], lse_q, call.causal, deterministic, qs,
                                            _covers(call, nq), i, strided=head_views)
                parts.append((_share_index(call, len(k_chunks), q_len), dk_b, dv_b))
                continue
            with _Span("bwd_compute", i, q):
                dq_b, dk_b, dv_b = block_backward(dout[:, qs], q[:, qs], k_cur[:, ks],
                                                  v_cur[:, ks], out[:, qs], lse_q, scale,
                                                  call.causal, deterministic, i)
            with _Span("bwd_accum", i, q):
                if not grad and _covers(call, nq):
                    grad["dq"] = dq_b.to(acc)
                else:
                    if not grad:
                        grad["dq"] = torch.zeros(q.shape, dtype=acc, device=q.device)
                    grad["dq"][:, qs] += dq_b
            parts.append((_share_index(call, len(k_chunks), q_len), dk_b, dv_b))
        return parts

    def share_index(holder: int) -> list:  # DKV_HOME: where the shares of holder's steps go
        k_chunks = chunk_ids(rank, world, layout)
        return [_share_index(call, len(k_chunks), q_len)
                for call in _dense_calls(chunk_ids(holder, world, layout), k_chunks, causal)]

    _trace_origin(q)
    first = None if kv_last is None else _sendable(*kv_last)
    if DKV_HOME or BWD_LOW_MEMORY:
        dk, dv = _rotate_backward_home(ring, _sendable(k, v), comm, acc, step, share_index, first,
                                       like=(k, v))
    else:
        dk, dv = _rotate_backward(ring, _sendable(k, v), comm, acc, step, first, like=(k, v))
    if sums is not None:
        with _Span("bwd_final", world - 1, q):
            return sums.result(), dk, dv
    dq = grad["dq"].to(q.dtype) if grad else torch.zeros_like(q)
    return dq, dk, dv


class RingAttnFn(torch.autograd.Function):
    """out, lse = a ring's forward of the local shards; the backward is that ring's backward.
    ring = (forward(q, k, v) -> (out, lse), backward(dout, q, k, v, out, lse) -> (dq, dk, dv)):
    the dense ring or the varlen one, their static arguments bound."""

    @staticmethod
    def forward(ctx, q, k, v, ring):
        out, lse, *extra = ring[0](q, k, v)  # extra: tensors the backward takes after lse
        ctx.save_for_backward(q, k, v, out, lse, *extra)
        ctx.ring = ring
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *extra = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        return (*ctx.ring[1](dout, q, k, v, out, lse, *extra), None)


def _attend(q, k, v, forward, backward):
    """(out, lse) of a ring: through RingAttnFn when a gradient is wanted, else the forward
    (what it returns after out and lse is for the backward only)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return RingAttnFn.apply(q, k, v, (forward, backward))
    return tuple(forward(q, k, v)[:2])


def _check_group(group, device: torch.device) -> None:
    """group: an initialized process group (None: the default one) of which this process is a
    member, whose backend moves tensors of ``device``'s type (NCCL for CUDA, gloo or MPI for
    the CPU): a mismatch would fail inside the first transfer with an error naming no
    argument."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("group: torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected a torch.distributed ProcessGroup or None, got "
                        f"{type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise ValueError("group: this process is not a member of the group")
    backend = str(dist.get_backend(group)).lower()
    wanted = ("nccl",) if device.type == "cuda" else ("gloo", "mpi")
    if not any(b in backend for b in wanted):
        raise ValueError(f"group: its backend {backend!r} does not move {device.type} tensors "
                         f"(q is on {device}); use {' or '.join(wanted)}")


def check_ring_args(q, k, v, softmax_scale, causal, group, layout) -> tuple:
    """Validate a ring call before any launch or transfer; every error names the argument.
    Returns (softmax_scale, world)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: expected a torch tensor, got {type(x).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    _check_group(group, q.device)
    _, _, _, scale, problem = api.check_qkv(q, k, v, softmax_scale, causal)
    if problem.seqlen_q != problem.seqlen_k:
        raise ValueError(f"k: seqlen_local must equal q's ({problem.seqlen_q}): each rank holds "
                         f"the same positions of q, k and v, got {problem.seqlen_k}")
    world = dist.get_world_size(group)
    if layout == "zigzag" and problem.seqlen_q % 2:  # causal or not: two equal chunks per rank
        raise ValueError(f"q: zigzag needs an even seqlen_local (two chunks per rank), "
                         f"got {problem.seqlen_q}")
    return scale, world


def ring_flash_attn_func(q, k, v, causal: bool = False, softmax_scale: Optional[float] = None,
                         group=None, layout: str = "zigzag", deterministic: bool = False,
                         return_attn_probs: bool = False):
    """Exact attention of a sequence sharded over the ranks of ``group`` (default: the world).

    q: (batch, seqlen_local, nheads, headdim), k, v: (batch, seqlen_local, nheads_kv,
    headdim): this rank's shard of the sequence in ``layout`` ("zigzag": chunks rank and
    2P-1-rank of 2P, see zigzag_shard; "contiguous": chunk rank of P), the same shapes on
    every rank. Semantics are flash_attn_func's on the unsharded tensors (causal: position i
    sees positions <= i; GQA / MQA; softmax_scale default 1/sqrt(headdim)); returns this
    rank's shard of the output, and with return_attn_probs (out, lse, None), lse fp32
    (batch, nheads, seqlen_local). Autograd: the backward is the ring backward (every rank
    must call backward). CUDA tensors (NCCL group) run cuflash's kernels, CPU tensors (gloo)
    the float64 reference."""
    scale, world = check_ring_args(q, k, v, softmax_scale, causal, group, layout)
    causal, deterministic = bool(causal), bool(deterministic)
    keep = REVERSE_BWD and torch.is_grad_enabled()  # (the backward's first block)
    out, lse = _attend(
        q, k, v, lambda q, k, v: ring_forward(q, k, v, scale, causal, group, layout,
                                              keep_last=keep),
        lambda dout, q, k, v, out, lse, *last: ring_backward(
            dout, q, k, v, out, lse, scale, causal, group, layout, deterministic,
            kv_last=tuple(last) or None))
    return (out, lse, None) if return_attn_probs else out


# flash-attn's ring-attention packages name it so
zigzag_ring_flash_attn_func = ring_flash_attn_func


# ---------------------------------------------------------------------------------------
# varlen: a packed batch of sequences, every one split over the ranks

def chunk_count(world: int, layout: str) -> int:
    """How many equal chunks every sequence is cut into: 2·world (zigzag) or world."""
    return 2 * world if layout == "zigzag" else world


def _check_layout(layout) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")


def _cu_values(cu_seqlens) -> np.ndarray:
    """The host values of a global cu_seqlens given to varlen_shard / varlen_unshard (int32
    1-D torch tensor, 0 first, never decreasing); a device-to-host read for GPU tensors."""
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens: expected a torch tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens: dtype must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens: expected a 1-D tensor of batch + 1 offsets, got shape "
                         f"{tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.detach().cpu().numpy().astype(np.int64)
    if cu[0] != 0 or (np.diff(cu) < 0).any():
        raise ValueError(f"cu_seqlens: must start at 0 and never decrease, got {cu.tolist()}")
    return cu


def _check_chunkable(cu: np.ndarray, world: int, layout: str) -> None:
    """Every sequence length a multiple of the chunk count, else ValueError naming cu_seqlens."""
    n = chunk_count(world, layout)
    lens = np.diff(cu)
    bad = np.flatnonzero(lens % n)
    if bad.size:
        why = "2 * world: 2 chunks per rank" if layout == "zigzag" else "world: 1 chunk per rank"
        raise ValueError(f"cu_seqlens: every sequence length must be a multiple of {n} ({why}, "
                         f"layout {layout!r}); sequence {int(bad[0])} has {int(lens[bad[0]])} "
                         f"tokens (lengths {lens.tolist()})")


def _local_rows(cu: np.ndarray, rank: int, world: int, layout: str) -> np.ndarray:
    """The global rows a rank holds, in local order: for each of its chunks, that chunk of
    every sequence in sequence order."""
    n = chunk_count(world, layout)
    starts, lens = cu[:-1], np.diff(cu) // n
    rows = [np.arange(s + c * m, s + (c + 1) * m) for c in chunk_ids(rank, world, layout)
            for s, m in zip(starts, lens)]
    return np.concatenate(rows) if rows else np.zeros(0, np.int64)


def varlen_shard(x: Tensor, cu_seqlens: Tensor, rank: int, world: int, layout: str = "zigzag",
                 dim: int = 0) -> tuple:
    """Rank ``rank``'s shard of a packed varlen tensor: (local tensor, local cu_seqlens).

    x: packed along ``dim`` (q, k, v, out: (total, nheads, headdim), dim 0; lse (nheads,
    total), dim 1) by the GLOBAL ``cu_seqlens`` (int32, batch + 1). Every sequence is cut into
    2·world (zigzag) or world (contiguous) equal chunks; the local tensor holds chunk ``rank``
    of every sequence, packed, then (zigzag) chunk 2·world-1-rank of every sequence (a new
    tensor, total / world long along dim). Local cu_seqlens (int32, on cu_seqlens' device):
    the offsets of those chunks in local order, one per chunk (2·batch + 1 values for zigzag,
    batch + 1 contiguous); each half's own offsets are cu_seqlens // (2·world)."""
    dim = _check_dim("x", x, dim)
    _check_rank(rank, world)
    _check_layout(layout)
    cu = _cu_values(cu_seqlens)
    if x.shape[dim] != cu[-1]:
        raise ValueError(f"x: its length along dim {dim} ({x.shape[dim]}) must be the total "
                         f"number of tokens of cu_seqlens ({int(cu[-1])})")
    _check_chunkable(cu, world, layout)
    rows = torch.from_numpy(_local_rows(cu, rank, world, layout)).to(x.device)
    lens = np.diff(cu) // chunk_count(world, layout)
    pieces = np.tile(lens, len(chunk_ids(rank, world, layout)))
    local_cu = np.concatenate([[0], np.cumsum(pieces)]).astype(np.int32)
    return x.index_select(dim, rows), torch.from_numpy(local_cu).to(cu_seqlens.device)


def varlen_unshard(shards: Sequence[Tensor], cu_seqlens: Tensor, world: int,
                   layout: str = "zigzag", dim: int = 0) -> Tensor:
    """The packed tensor (total along ``dim``) from every rank's ``varlen_shard`` (shards[i]:
    rank i's); the exact inverse."""
    shards = list(shards)
    _check_rank(0, world)
    _check_layout(layout)
    if len(shards) != world:
        raise ValueError(f"shards: expected one tensor per rank (world = {world}), got {len(shards)}")
    dim = _check_dim("shards[0]", shards[0], dim)
    cu = _cu_values(cu_seqlens)
    _check_chunkable(cu, world, layout)
    for i, s in enumerate(shards):
        _check_dim(f"shards[{i}]", s, dim)
        if s.shape != shards[0].shape or s.dtype != shards[0].dtype or s.device != shards[0].device:
            raise ValueError(f"shards[{i}]: shape, dtype and device must be shards[0]'s "
                             f"({tuple(shards[0].shape)}, {shards[0].dtype}, {shards[0].device}), "
                             f"got {tuple(s.shape)}, {s.dtype}, {s.device}")
    total = int(cu[-1])
    if shards[0].shape[dim] * world != total:
        raise ValueError(f"shards: each must be total / world = {total // world} long along dim "
                         f"{dim} (cu_seqlens' total {total}), got {shards[0].shape[dim]}")
    shape = list(shards[0].shape)
    shape[dim] = total
    full = shards[0].new_empty(shape)
    for r, s in enumerate(shards):
        rows = torch.from_numpy(_local_rows(cu, r, world, layout)).to(s.device)
        full.index_copy_(dim, rows, s)
    return full


@dataclass(frozen=True)
class VarlenChunks:
    """One local chunk of every sequence, as a packed varlen batch: the offsets every call of
    the ring passes as cu_seqlens_q and cu_seqlens_k (the same for every rank and chunk)."""
    cu: Tensor                      # int32 (batch + 1) on q's device: cu_seqlens // chunk_count
    cu_host: Optional[np.ndarray]   # the same on the host (None: not read back; CUDA only)
    max_len: int                    # max_seqlen // chunk_count: >= every chunk's length
    rows: int                       # tokens of one local chunk of all sequences


def varlen_step_calls(q_chunks: tuple, k_chunks: tuple, causal: bool) -> list:
    """A varlen step's calls: one per unmasked (q chunk, k chunk) pair (a sequence's two local
    chunks are not adjacent rows, so pairs cannot be joined into larger rectangles)."""
    return [Call(i, i + 1, j, j + 1, pair_kind(qc, kc, causal) == DIAG)
            for i, qc in enumerate(q_chunks) for j, kc in enumerate(k_chunks)
            if pair_kind(qc, kc, causal) != MASKED]


def varlen_block_forward(q, k, v, chunks: VarlenChunks, scale: float, causal: bool):
    """(out, lse) of one chunk of every sequence's queries against one chunk of the same
    sequences' keys; lse (nheads, rows) fp32. CUDA: the varlen kernels; CPU: the reference."""
    if q.is_cuda:
        from . import varlen_torch

        return varlen_torch.forward(q, k, v, chunks.cu, chunks.cu, chunks.max_len, chunks.max_len,
                                    scale, causal)
    as64 = lambda x: x.detach().to(torch.float64).numpy()  # noqa: E731
    out, lse = reference.attention_varlen_naive(as64(q), as64(k), as64(v), chunks.cu_host,
                                                chunks.cu_host, softmax_scale=scale,
                                                causal=causal, return_lse=True)
    return torch.from_numpy(out).to(q.dtype), torch.from_numpy(lse).to(torch.float32)


def varlen_block_backward(dout, q, k, v, out, lse, chunks: VarlenChunks, scale: float,
                          causal: bool, deterministic: bool):
    """(dq, dk, dv) of one (q chunk, k chunk) pair given the GLOBAL out and lse (nheads, rows).
    CUDA: the varlen backward kernels (they read out and lse as given); CPU:
    ``reference_block_backward`` per sequence."""
    if q.is_cuda:
        from . import varlen_torch

        return varlen_torch.backward(dout, q, k, v, out, lse, chunks.cu, chunks.cu, chunks.max_len,
                                     chunks.max_len, scale, causal, deterministic)
    dq, dk, dv = (torch.zeros_like(x) for x in (q, k, v))
    cu = chunks.cu_host
    for b in range(len(cu) - 1):
        s = slice(int(cu[b]), int(cu[b + 1]))
        if s.start == s.stop:
            continue
        g = reference_block_backward(dout[None, s], q[None, s], k[None, s], v[None, s],
                                     out[None, s], lse[None, :, s], scale, causal)
        dq[s], dk[s], dv[s] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


def _rows(call: Call, rows: int) -> tuple:
    return slice(call.q0 * rows, call.q1 * rows), slice(call.k0 * rows, call.k1 * rows)


def ring_varlen_forward(q, k, v, chunks: VarlenChunks, scale: float, causal: bool, group,
                        layout: str, comm: bool = True):
    """(out, lse) of the local packed q over every sequence's whole K/V (no autograd). out:
    q's dtype (total_local, nheads, headdim); lse fp32 (nheads, total_local), +inf for rows
    with no key. comm=False: no transfers (as ring_forward's)."""
    ring = _Ring(group, q.device)
    world, rank = ring.world, ring.rank
    q_chunks = chunk_ids(rank, world, layout)
    acc = _acc_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=acc, device=q.device)
    if q.shape[0] == 0:  # every sequence empty (on every rank alike: total / P rows each)
        return out.to(q.dtype), lse.float()

    def step(_i, src, k_cur, v_cur):
        for call in varlen_step_calls(q_chunks, chunk_ids(src, world, layout), causal):
            qs, ks = _rows(call, chunks.rows)
            o_b, lse_b = varlen_block_forward(q[qs], k_cur[ks], v_cur[ks], chunks, scale,
                                              call.causal)
            # (rows, h, d) and (h, rows) as merge_partial's (1, rows, h, d) and (1, h, rows)
            merge_partial(out[qs][None], lse[:, qs][None], o_b[None], lse_b[None])

    _rotate_forward(ring, _sendable(k, v), comm, step)
    lse = lse.float().masked_fill(torch.isneginf(lse), math.inf)
    return out.to(q.dtype), lse


def ring_varlen_backward(dout, q, k, v, out, lse, chunks: VarlenChunks, scale: float,
                         causal: bool, group, layout: str, deterministic: bool = False,
                         comm: bool = True):
    """(dq, dk, dv) of the local packed shards; out and lse: ring_varlen_forward's (global)."""
    ring = _Ring(group, q.device)
    world, rank = ring.world, ring.rank
    if q.shape[0] == 0:
        return tuple(torch.zeros_like(x) for x in (q, k, v))
    q_chunks = chunk_ids(rank, world, layout)
    n = chunks.rows
    acc = _acc_dtype(q.dtype)
    dout, out = dout.contiguous(), out.contiguous()
    # each local chunk's lse rows, contiguous once (the kernels read (nheads, rows) dense)
    lse_chunk = [lse[:, i * n:(i + 1) * n].contiguous() for i in range(len(q_chunks))]
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)

    def step(_i, src, k_cur, v_cur):
        parts = []
        for call in varlen_step_calls(q_chunks, chunk_ids(src, world, layout), causal):
            qs, ks = _rows(call, n)
            dq_b, dk_b, dv_b = varlen_block_backward(dout[qs], q[qs], k_cur[ks], v_cur[ks],
                                                     out[qs], lse_chunk[call.q0], chunks, scale,
                                                     call.causal, deterministic)
            dq[qs] += dq_b
            parts.append((ks, dk_b, dv_b))
        return parts

    def share_index(holder: int) -> list:  # DKV_HOME: where the shares of holder's steps go
        return [_rows(call, n)[1] for call in varlen_step_calls(
            chunk_ids(holder, world, layout), chunk_ids(rank, world, layout), causal)]

    if DKV_HOME or BWD_LOW_MEMORY:
        dk, dv = _rotate_backward_home(ring, _sendable(k, v), comm, acc, step, share_index)
    else:
        dk, dv = _rotate_backward(ring, _sendable(k, v), comm, acc, step)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def check_ring_varlen_args(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, group,
                           layout) -> tuple:
    """Validate a varlen ring call before any launch or transfer; every error names the
    argument. Returns (softmax_scale, VarlenChunks). Reads cu_seqlens back (a sync) unless
    flash_attn_varlen_func would not (CUDA graph capture, CHECK_CU_SEQLENS off)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: expected a torch tensor, got {type(x).__name__}")
        if x.ndim != 3:
            raise ValueError(f"{name}: expected 3 dims (total_local, nheads, headdim): the "
                             f"varlen layout, got shape {tuple(x.shape)}")
    _check_layout(layout)
    _check_group(group, q.device)
    tq, _, _, scale, _ = api.check_qkv(q[None], k[None], v[None], softmax_scale, causal)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k: total_local must equal q's ({q.shape[0]}): self-attention, each rank "
                         f"holds the same positions of q, k and v, got {k.shape[0]}")
    world = dist.get_world_size(group)
    n = chunk_count(world, layout)
    nlocal = len(chunk_ids(0, world, layout))
    total_local = q.shape[0]
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens: expected a torch tensor like q, got "
                        f"{type(cu_seqlens).__name__}")
    cu = api.check_cu_seqlens("cu_seqlens", cu_seqlens, tq, None)  # None: values not read
    if cu is not None:
        if cu[-1] != world * total_local:
            raise ValueError(f"cu_seqlens: expected the GLOBAL offsets (the same on every rank), "
                             f"ending at world * q's total_local = {world} * {total_local} = "
                             f"{world * total_local}, got {int(cu[-1])} (varlen_shard's local "
                             f"offsets are not the argument)")
        _check_chunkable(cu, world, layout)
    elif total_local % nlocal:
        raise ValueError(f"q: total_local ({total_local}) must be a multiple of {nlocal} (one "
                         f"chunk of every sequence per local half)")
    nseq = int(cu_seqlens.shape[0]) - 1
    if nseq > api.GRID_LIMIT:
        raise ValueError(f"cu_seqlens: batch ({nseq}) must be <= {api.GRID_LIMIT} (CUDA grid limit)")
    max_seqlen = api.check_max_seqlen("max_seqlen", max_seqlen, cu)
    chunk_cu = (cu_seqlens // n).to(torch.int32).contiguous()  # on the device, no host read
    chunk_host = None if cu is None else cu // n
    return scale, VarlenChunks(chunk_cu, chunk_host, max_seqlen // n, total_local // nlocal)


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, causal: bool = False,
                                softmax_scale: Optional[float] = None, group=None,
                                layout: str = "zigzag", deterministic: bool = False,
                                return_attn_probs: bool = False):
    """Exact attention of a packed batch of variable-length sequences, every sequence sharded
    over the ranks of ``group`` (default: the world). Self-attention: one cu_seqlens for q, k.

    q: (total_local, nheads, headdim), k, v: (total_local, nheads_kv, headdim): this rank's
    shard (``varlen_shard``: its chunk(s) of every sequence, in ``layout``), total_local =
    total / P. cu_seqlens: the GLOBAL int32 offsets (batch + 1) on q's device and max_seqlen
    (an int >= the longest sequence), the same on every rank: what flash_attn_varlen_func
    takes on the unsharded tensors (as cu_seqlens_q and cu_seqlens_k); every sequence length
    must be a multiple of 2P (zigzag) or P (contiguous), 0 allowed. Semantics are
    flash_attn_varlen_func's (causal per sequence; GQA / MQA; softmax_scale default
    1/sqrt(headdim)); returns this rank's shard of the output, and with return_attn_probs
    (out, lse, None), lse fp32 (nheads, total_local). Autograd: the backward is the ring
    backward (every rank must call backward). CUDA tensors (NCCL) run cuflash's varlen
    kernels, CPU tensors (gloo) the float64 reference."""
    scale, chunks = check_ring_varlen_args(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal,
                                           group, layout)
    causal, deterministic = bool(causal), bool(deterministic)
    out, lse = _attend(
        q, k, v, lambda q, k, v: ring_varlen_forward(q, k, v, chunks, scale, causal, group, layout),
        lambda *t: ring_varlen_backward(*t, chunks, scale, causal, group, layout, deterministic))
    return (out, lse, None) if return_attn_probs else out


zigzag_ring_flash_attn_varlen_func = ring_flash_attn_varlen_func
