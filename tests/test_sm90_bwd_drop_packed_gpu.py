"""sm90_bwd's drop_packed (kDropPacked, kernels_cu/dropout_transposed.cuh) on the GPU, sm_90 only:

* the gradients of the dropout backward with the keep mask on Pᵀ's packed words within 3x the
  error of plain low-precision attention's gradients against the float64 reference with the
  mirror's mask (cuflash.dropout.keep_mask), after selection's dropout forward; head dims 64 and
  128, bf16 and fp16, causal and not, odd shapes (seqlens 1, 17, 113, 1023, 2049; s_q != s_k both
  ways; GQA / MQA), outputs poisoned (NaN) before each launch;
* dK bit for bit that of the backward it replaces (the same signed Pᵀ words feed dSᵀ, and dK_j's
  sum runs in one CTA in a fixed order), both forms (2: dS stored by stmatrix); dV within the
  reference rule (it rounds Pᵀ ∘ Z, not Pᵀ ∘ Z / (1 - p), to 16 bits).

15 compiles of sm90_bwd (drop_packed 1 and 2 and the backward without it, per (head dim, dtype,
causal)) and selection's 5 dropout forwards (tests/drop6_precompile.py compiles them in parallel first)."""
import pytest
from test_dropout_gpu import SHAPES_GRID   # seqlens 1, 17, 113, 1023, 2049; s_q != s_k both ways; GQA / MQA

pytestmark = pytest.mark.gpu

P_DROP = 0.17
SEED = (0x9E37_79B9_7F4A_7C15, (7 << 32) + 1234)
FORMS = (1, 2)   # drop_packed's forms
# (head dim, dtype, causal)
FLAGS = [(128, "bf16", True), (128, "bf16", False), (64, "bf16", True), (64, "bf16", False), (128, "fp16", False)]


def require_sm90():
    from cuflash import _gpu

    if tuple(_gpu.arch(0)) != (9, 0):
        pytest.skip(f"sm90_bwd needs sm_90, this GPU is sm_{''.join(map(str, _gpu.arch(0)))}")


def configs(d, dtype, causal):
    """(selection's dropout forward, sm90_bwd's dropout backwards with drop_packed (FORMS), the one
    without it), for one shape's problem, so that every test shape runs the same kernels."""
    from cuflash import _gpu, registry
    from cuflash.families import sm90_bwd
    from cuflash.problem import Problem

    problem = Problem("fwd", dtype, 2, 1000, 1000, 4, 2, d, causal, features=("dropout",), dropout_p=P_DROP)
    fwd, bwd = registry.get("sm90_fwd"), registry.get("sm90_bwd")
    fcfg = fwd.for_problem(fwd.heuristic(problem, _gpu.arch(0), _gpu.max_smem(0)), problem)
    bp = problem.replace(op="bwd")
    # (without the plain speed fields that DROPOUT_FAST adds to form 2: tests/test_drp8_gpu.py runs those)
    base = bwd.for_problem(bwd.heuristic(bp, _gpu.arch(0), _gpu.max_smem(0)), bp).replace(
        drop_packed=0, **{k: False for k in sm90_bwd.DROPOUT_FAST_FIELDS})
    packed = [bwd.for_problem(base.replace(drop_packed=form), bp) for form in FORMS]
    assert all(c.drop_packed == f and not c.problems(227 * 1024) for c, f in zip(packed, FORMS)), packed
    return fcfg, packed, base


def all_configs():
    """Every kernel these tests run (for tests/drop6_precompile.py)."""
    out = []
    for flags in FLAGS:
        fcfg, packed, base = configs(*flags)
        out += [fcfg, base, *packed]
    return out


@pytest.mark.parametrize("shape", SHAPES_GRID, ids=lambda s: "b{}_s{}x{}_h{}x{}".format(*s))
@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: f"d{f[0]}_{f[1]}_{'causal' if f[2] else 'full'}")
@pytest.mark.usefixtures("poison_outputs")
def test_drop_packed_backward_against_reference(flags, shape, monkeypatch):
    import torch

    import cuflash
    from cuflash.families import sm90_bwd
    from test_dropout_gpu import attention_with_mask, check_dropout_grads, dropout_case, dtype_of

    require_sm90()
    # the backward without drop_packed too: for_problem keeps a config's own form, but turns a 0 into
    # DROPOUT_PACKED's (on at d128)
    monkeypatch.setattr(sm90_bwd, "DROPOUT_PACKED", {})
    d, name, causal = flags
    dtype = dtype_of(name)
    fcfg, packed, base = configs(d, name, causal)
    q, k, v, dout, scale, keep = dropout_case(*shape, d, dtype, SEED, P_DROP)
    grads = {}
    for bcfg in (*packed, base):
        out = cuflash.flash_attn_func(q, k, v, P_DROP, causal=causal, dropout_seed=SEED, config=fcfg,
                                      bwd_config=bcfg)
        grads[bcfg.name] = torch.autograd.grad(out, (q, k, v), dout)
    for bcfg in packed:   # (the references' graphs anew per check: check_dropout_grads frees them)
        ref_out, _ = attention_with_mask(q, k, v, causal, scale, torch.float64, keep, P_DROP)
        low_out, _ = attention_with_mask(q, k, v, causal, scale, dtype, keep, P_DROP)
        check_dropout_grads(grads[bcfg.name], ref_out, low_out, q, k, v, dout, out, scale, bcfg.name)
        assert torch.equal(grads[bcfg.name][1], grads[base.name][1]), f"{bcfg.name}: dK differs from {base.name}'s"
