"""sm90_fwd's levers for the d256 non-causal cells (issue 11) on the GPU: lazy rescale (kLazyRescale,
kernels_cu/softmax_fold.cuh: FlashAttention-4's, O rescaled only when a row's max moves by more than 2^8 in
P) on plain calls, even_waves (the static persistent grid sized to equal tile counts per CTA), rag_keys
(kRagKeys) and prefetch (kPrefetch: the next tile's Q into L2), the FlashAttention way: fresh random inputs, outputs
poisoned (NaN) before each launch, error against the float64 reference within 2x the error of plain
attention in the same low precision.

* the d256 tiles HEURISTIC_LAZY gives lazy_rescale (tests/sm90_fwd_cells_timing.py's rows: non-causal 2k
  static persistent, causal 2k dynamic with pingpong; bf16 / fp16), over seqlens 1, 17, 113, 1023, 2049
  with s_q != s_k both ways, MHA / GQA / MQA;
* the same with keys whose scale grows toward the first key (the K/V blocks are visited from the last):
  the running max moves past the 2^8 threshold on many blocks, so the rescale branch runs;
* even_waves: bit for bit the config without it (the same kernel; only the grid differs), many tiles
  per CTA;
* rag_keys (kRagKeys: the ragged last K/V block at its own width) at d256, bf16 / fp16: seqlen_k % 80 of
  48, 16, 64, 32 and one 48-key block against the reference, and bit for bit the full-width block;
* prefetch: bit for bit the config without it (L2 hints only), alone, with tile_overlap and with
  lazy_rescale + rag_keys.

    CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q tests/test_sm90_fwd_levers_gpu.py
"""
import pytest

import cuflash

from test_features_gpu import inputs  # noqa: E402
from test_sm90_fwdnc_gpu import check  # noqa: E402
from test_sm90_pv_overlap_gpu import HEADS, SEQLENS, cid, equal_bit_for_bit  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

# (dtype, head dim, causal, seqlen of the benchmark cell whose tile is tested)
CELLS = [("bf16", 256, False, 2048), ("fp16", 256, False, 2048), ("bf16", 128, False, 16384)]
# lazy_rescale's: the d256 cells (HEURISTIC_LAZY), non-causal (static persistent) and causal (dynamic, pingpong)
LAZY_CELLS = CELLS[:2] + [("bf16", 256, True, 2048), ("fp16", 256, True, 2048)]


def cell_config(c, **change):
    """The heuristic's config of the benchmark cell c without stream_tail and lazy_rescale (HEURISTIC_LAZY's
    class switch), with ``change``."""
    from cuflash import registry

    fam = registry.get("sm90_fwd")
    p = cuflash.Problem.fa_convention("fwd", c[0], c[1], c[2], c[3])
    cfg = fam.for_problem(fam.heuristic(p), p).replace(stream_tail=False, lazy_rescale=False, section=0)
    return cfg.replace(**change).validate(227 * 1024)


_WARM = set()


def warm(cfgs, seqlens_k=()):
    """The test's kernels compiled up front in parallel worker processes (CuPy's disk cache); with
    seqlens_k, each config as for_problem resolves it for those key lengths (rag_keys=-1)."""
    from cuflash import registry
    from cuflash.compile import precompile

    fam = registry.get("sm90_fwd")
    out = {}
    for cfg in cfgs:
        for sk in seqlens_k or (None,):
            c = cfg if sk is None else fam.for_problem(cfg, cuflash.Problem(
                "fwd", cfg.dtype, 2, 1024, sk, 16, 4, cfg.head_dim, cfg.causal))
            if c.kernel_name() not in _WARM:
                out[c.kernel_name()] = c
    failed = [(cfg.name, e[-1500:]) for cfg, _, e in precompile(list(out.values())) if e]
    assert not failed, failed
    _WARM.update(out)


@pytest.mark.parametrize("c", LAZY_CELLS, ids=cid)
def test_lazy_forward(c):
    k = (c[0], c[1], c[2], {})
    cfg = cell_config(c, lazy_rescale=True)
    warm([cfg])
    for i, (sq, sk) in enumerate(SEQLENS):
        q, kk, v, _ = inputs(2, sq, sk, HEADS[i % 3], c[1], c[0])
        check(k, q, kk, v, f"{sq}x{sk} {HEADS[i % 3]}", cfg=cfg)


@pytest.mark.parametrize("c", LAZY_CELLS, ids=cid)
def test_lazy_forward_growing_max(c):
    """Keys scaled by up to 8x toward the first key: the scores' row max grows block after block (in
    the kernel's order, from the last block), by more than the threshold on many of them."""
    import torch

    k = (c[0], c[1], c[2], {})
    cfg = cell_config(c, lazy_rescale=True)
    warm([cfg])
    for sq, sk in ((1023, 2049), (2049, 2049)):
        q, kk, v, _ = inputs(2, sq, sk, "gqa", c[1], c[0])
        ramp = torch.linspace(8.0, 1.0, sk, device="cuda").view(1, sk, 1, 1)
        kk = (kk.float() * ramp).to(kk.dtype)
        check(k, q, kk, v, f"{sq}x{sk} growing max", cfg=cfg)


@pytest.mark.parametrize("c", CELLS, ids=cid)
def test_even_waves_bit_for_bit(c):
    k = (c[0], c[1], c[2], {})
    plain = cell_config(c)
    warm([plain, cell_config(c, lazy_rescale=True)])
    assert plain.replace(even_waves=True).kernel_name() == plain.kernel_name()
    equal_bit_for_bit(k, cell_config(c, even_waves=True), plain)
    equal_bit_for_bit(k, cell_config(c, even_waves=True, lazy_rescale=True), cell_config(c, lazy_rescale=True))


# rag_keys (kRagKeys: the ragged last K/V block's P V at rag_keys / 16 steps):
# seqlen_k % 80 = 48, 16, 64, 32; one block of 48 keys; a length whose remainder is no multiple of 16 (off)
RAG_SEQLENS = [(2049, 2048), (1023, 4096), (300, 1024), (17, 1632), (200, 48), (1023, 2049)]


@pytest.mark.parametrize("c", CELLS[:2], ids=cid)
def test_rag_keys_forward(c):
    from cuflash import registry

    k = (c[0], c[1], c[2], {})
    cfg = cell_config(c, rag_keys=-1)
    warm([cfg], [sk for _, sk in RAG_SEQLENS])
    fam = registry.get("sm90_fwd")
    for i, (sq, sk) in enumerate(RAG_SEQLENS):
        q, kk, v, _ = inputs(2, sq, sk, HEADS[i % 3], c[1], c[0])
        p = cuflash.Problem("fwd", c[0], 2, sq, sk, q.shape[2], kk.shape[2], c[1], c[2])
        want = sk % cfg.BN if sk % cfg.BN % 16 == 0 else 0
        assert fam.for_problem(cfg, p).rag_keys == want
        check(k, q, kk, v, f"{sq}x{sk} {HEADS[i % 3]}", cfg=cfg)


@pytest.mark.parametrize("c", CELLS[:2], ids=cid)
def test_rag_keys_bit_for_bit(c):
    """The skipped P V steps would add P = 0 times zero-filled V rows: the same O and LSE as the
    full-width block."""
    k = (c[0], c[1], c[2], {})
    shapes = ((2049, 2048), (1500, 4096))
    warm([cell_config(c, rag_keys=-1, **ch) for ch in ({}, {"lazy_rescale": True})], [2048, 4096])
    warm([cell_config(c), cell_config(c, lazy_rescale=True)])
    equal_bit_for_bit(k, cell_config(c, rag_keys=-1), cell_config(c), shapes)
    equal_bit_for_bit(k, cell_config(c, rag_keys=-1, lazy_rescale=True), cell_config(c, lazy_rescale=True), shapes)


@pytest.mark.parametrize("c", CELLS, ids=cid)
def test_prefetch_bit_for_bit(c):
    k = (c[0], c[1], c[2], {})
    warm([cell_config(c), cell_config(c, prefetch=True)])
    if c[1] == 256:
        warm([cell_config(c, tile_overlap=True, **ch) for ch in ({}, {"prefetch": True})])
        warm([cell_config(c, lazy_rescale=True, rag_keys=-1, **ch) for ch in ({}, {"prefetch": True})], [2048, 4096])
    equal_bit_for_bit(k, cell_config(c, prefetch=True), cell_config(c))
    if c[1] == 256:
        equal_bit_for_bit(k, cell_config(c, prefetch=True, tile_overlap=True), cell_config(c, tile_overlap=True))
        shapes = ((2049, 2048), (1500, 4096))
        equal_bit_for_bit(k, cell_config(c, prefetch=True, lazy_rescale=True, rag_keys=-1),
                          cell_config(c, lazy_rescale=True, rag_keys=-1), shapes)
