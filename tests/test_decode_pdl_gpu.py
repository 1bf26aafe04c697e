"""decode_splitkv's ``pdl`` (programmatic dependent launch of the regs kernel's calls, sm_90) on the GPU,
against the float64 reference.

PDL_DEFAULT is set (1: the main kernel lets the next kernel be scheduled right after its wait; 2: after
its K/V loop; 3: as 1 with the first blocks prefetched into L2 before the wait) and the plan cache cleared, so the calls go through flash_attn_with_kvcache as users make
them, eagerly (each launch programmatic on the stream) and in CUDA graphs (programmatic edges):
  * the regs kernel's cases (contiguous, pages 16 and 256 with leftpad, append + rotary, cache_batch_idx,
    window + softcap + ALiBi, two row tiles) at num_splits 0 / 1 / 3, and with the separate combine kernel
    (FUSED_COMBINE_DEFAULT off), checked as test_decode_gpu.check_call does (outputs NaN-poisoned, error at
    most twice that of plain attention in the same precision);
  * a chain captured in one graph, each call's query the previous call's output (the kernel that writes it is
    the one a PDL kernel may overlap) and, with append, each call writing its own new key / value into the
    same cache row the previous call read: every step checked against the reference on the inputs it had,
    over replays with changing cache_seqlens (the fused combine's counters back at 0 in between).

    timeout 300 python -m pytest -q -x tests/test_decode_pdl_gpu.py
"""
import numpy as np
import pytest

from cuflash import api, decode
from cuflash.families import decode_splitkv as fam_mod

from test_decode_gpu import _torch, lowp_of, make_case, reference_of
from test_decode_regs_gpu import CASES, _ids, check_case
from test_decode_ringfill_gpu import _poison  # noqa: F401  (autouse: outputs poisoned, skip without a GPU)

pytestmark = [pytest.mark.gpu]


def _pdl(monkeypatch, pdl: int, fused: bool = True):
    torch = _torch()
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("pdl: sm_90 (griddepcontrol) only")
    monkeypatch.setattr(fam_mod, "PDL_DEFAULT", pdl)
    monkeypatch.setattr(fam_mod, "PDL_RULES", ())
    monkeypatch.setattr(fam_mod, "REGS_HEAD_DIM_DEFAULT", (64, 128))
    if not fused:
        monkeypatch.setattr(fam_mod, "FUSED_COMBINE_DEFAULT", False)
    decode._drop_gpu_plans()  # plans made with other settings must not serve these calls
    monkeypatch.setattr(decode, "_gpu_plans", {})


def _ran_pdl(pdl):
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None]
    assert plans and all(p.config.pdl == pdl for p in plans), [p.config.name for p in plans]
    assert all(p._launch.pdl for p in plans)   # launched through cuLaunchKernelEx with the attribute


GRID = [CASES[i] for i in (1, 2, 4, 6, 7, 8, 9, 10, 11, 13)]


@pytest.mark.parametrize("splits", [0, 1, 3], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("case", GRID, ids=_ids)
def test_pdl_grid(monkeypatch, case, splits):
    _case(monkeypatch, case, 1, splits, fused=True)


@pytest.mark.parametrize("pdl", [2, 3], ids=lambda n: f"pdl{n}")
@pytest.mark.parametrize("case", [GRID[i] for i in (0, 1, 4, 7)], ids=_ids)
def test_pdl_trigger_options(monkeypatch, case, pdl):
    """pdl 2 (the trigger after the K/V loop) and 3 (the L2 prefetch before the wait) at 3 splits."""
    _case(monkeypatch, case, pdl, 3, fused=True)


@pytest.mark.parametrize("case", [CASES[2], CASES[7], CASES[10]], ids=_ids)
def test_pdl_separate_combine(monkeypatch, case):
    """num_splits 3 without the fused combine: decode_combine (kPdl) after the main kernel."""
    _case(monkeypatch, case, 1, 3, fused=False)


def _case(monkeypatch, case, pdl, splits, fused):
    _pdl(monkeypatch, pdl, fused)
    check_case(case, splits)
    _ran_pdl(pdl)


def _step_ok(args, out, what):
    """out against the float64 reference of the call `args` (its caches before the call's append)."""
    torch = _torch()
    ref_out, _, ref_k, ref_v = reference_of(args, "bf16")
    low_out, _ = lowp_of(args, ref_k, ref_v, args["q"].double().cpu().numpy(), "bf16")
    got = out.double().cpu()
    assert not torch.isnan(got).any(), f"{what}: unwritten output"
    err = (got - torch.from_numpy(ref_out)).abs().max().item()
    base = (low_out - torch.from_numpy(ref_out)).abs().max().item()
    assert err <= 2 * base + 1e-5, f"{what}: error {err:.3g} > 2 x plain bf16 error {base:.3g}"


CHAINS = ([(1, page, append, batch) for page in (None, 16) for append in (False, True) for batch in (1, 3)]
          + [(pdl, None, True, 3) for pdl in (2, 3)] + [(pdl, 16, False, 1) for pdl in (2, 3)])


@pytest.mark.parametrize("pdl,page,append,batch", CHAINS,
                         ids=lambda v: str(v) if not isinstance(v, bool) else ("append" if v else "read"))
def test_pdl_chain_graph(monkeypatch, pdl, page, append, batch):
    """N calls in one CUDA graph, call i's query = call i-1's output; with append each call writes its own
    k_new / v_new into the row the previous call read. Replayed at two sets of cache_seqlens."""
    _pdl(monkeypatch, pdl)
    # no poisoning fill between the calls in the graph (it would be each launch's predecessor): the outputs
    # are poisoned before each replay instead
    monkeypatch.setattr(api, "POISON_OUTPUTS", False)
    torch = _torch()
    rng = np.random.default_rng()
    n, cap = 4, 4096
    args = make_case(rng, batch, 1, [cap - 1] * batch, 32, 8, 128, "bf16", page=page, seqlen_new=1 if append else 0)
    news = [(torch.randn_like(args["k"]), torch.randn_like(args["v"])) if append else (None, None) for _ in range(n)]
    q0 = args["q"].clone()

    def chain():
        outs, q = [], q0
        for i in range(n):
            extra = {"k": news[i][0], "v": news[i][1]} if append else {}
            q = decode.flash_attn_with_kvcache(**dict(args, q=q, **extra))
            outs.append(q)
        return outs

    chain()   # plans and counters made outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain()
    for step, lens in enumerate([[cap - 1] * batch, list(rng.integers(0, cap - 1, size=batch))]):
        args["cache_seqlens"].copy_(torch.tensor(lens, dtype=torch.int32))
        for o in outs:
            o.fill_(float("nan"))
        q0.copy_(torch.randn_like(q0))
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
        for i in range(n):
            q = q0 if i == 0 else outs[i - 1]
            extra = {"k": news[i][0], "v": news[i][1]} if append else {}
            _step_ok(dict(args, q=q, **extra), outs[i], f"lens {lens} call {i}")
    _ran_pdl(pdl)
