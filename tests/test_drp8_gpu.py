"""Issue 12's dropout backward with the plain call's speed fields (session 27, drp8) on the GPU, sm_90 only:
sm90_bwd's drop_packed 2 backward with the plain heuristic's speed fields (DROPOUT_FAST_SETS' widest: dynamic,
ds_double, dq_early, dk_late, frag_pin, wide_epi; DROPOUT_FAST's default for bf16 d128), after selection's
dropout forward: the gradients within
3x the error of plain low-precision attention's against the float64 reference with the mirror's keep mask,
and dK, dV bit for bit those of the drop_packed 2 backward without the fields (the same words in the same
order; dQ's additions are unordered); bf16 and fp16, causal and not, head dim 128, odd shapes
(test_dropout_gpu.SHAPES_GRID: seqlens 1, 17, 113, 1023, 2049; s_q != s_k both ways; GQA / MQA), outputs
poisoned before each launch. tests/drp8_precompile.py compiles the kernels first."""
import pytest
from test_dropout_gpu import SHAPES_GRID

pytestmark = pytest.mark.gpu

P_DROP = 0.17
SEED = (0x9E37_79B9_7F4A_7C15, (7 << 32) + 1234)
FLAGS = [("bf16", True), ("bf16", False), ("fp16", True), ("fp16", False)]


def require_sm90():
    from cuflash import _gpu

    if tuple(_gpu.arch(0)) != (9, 0):
        pytest.skip(f"sm90 kernels need sm_90, this GPU is sm_{''.join(map(str, _gpu.arch(0)))}")


def configs(dtype, causal):
    """(selection's dropout forward, the drop_packed 2 backward without the fields, with them) for the tests'
    problem shape."""
    from cuflash import registry
    from cuflash.families import sm90_bwd
    from cuflash.problem import Problem
    from cuflash.select import choose

    problem = Problem("fwd", dtype, 2, 1000, 1000, 4, 2, 128, causal, features=("dropout",), dropout_p=P_DROP)
    fwd, bwd = registry.get("sm90_fwd"), registry.get("sm90_bwd")
    f0 = fwd.for_problem(fwd.heuristic(problem), problem)
    bp = problem.replace(op="bwd")
    sel = choose(bp, (9, 0), "", 227 * 1024)[1]
    b0 = sel.replace(drop_packed=2, **{k: False for k in sm90_bwd.DROPOUT_FAST_FIELDS})
    b1 = b0.replace(**{k: True for k in sm90_bwd.DROPOUT_FAST_FIELDS})
    if sm90_bwd.DROPOUT_FAST.get((128, dtype, causal)):   # selection runs it
        assert sel == b1, sel.name
    for c in (b0, b1):
        assert bwd.for_problem(c, bp) == c and not c.problems(227 * 1024), c.name
    return f0, b0, b1


def all_configs():
    return list(dict.fromkeys(c for flags in FLAGS for c in configs(*flags)))


@pytest.mark.parametrize("shape", SHAPES_GRID, ids=lambda s: "b{}_s{}x{}_h{}x{}".format(*s))
@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: f"{f[0]}_{'causal' if f[1] else 'full'}")
@pytest.mark.usefixtures("poison_outputs")
def test_fast_dropout_backward(flags, shape):
    import torch

    import cuflash
    from test_dropout_gpu import attention_with_mask, check_dropout_grads, dropout_case, dtype_of

    require_sm90()
    name, causal = flags
    dtype = dtype_of(name)
    f0, b0, b1 = configs(name, causal)
    q, k, v, dout, scale, keep = dropout_case(*shape, 128, dtype, SEED, P_DROP)
    grads = {}
    for bcfg in (b0, b1):
        out = cuflash.flash_attn_func(q, k, v, P_DROP, causal=causal, dropout_seed=SEED, config=f0, bwd_config=bcfg)
        grads[bcfg.name] = torch.autograd.grad(out, (q, k, v), dout)
    for bcfg in (b1,):
        ref_out, _ = attention_with_mask(q, k, v, causal, scale, torch.float64, keep, P_DROP)
        low_out, _ = attention_with_mask(q, k, v, causal, scale, dtype, keep, P_DROP)
        check_dropout_grads(grads[bcfg.name], ref_out, low_out, q, k, v, dout, out.detach(), scale, bcfg.name)
        for i, what in ((1, "dK"), (2, "dV")):
            assert torch.equal(grads[bcfg.name][i], grads[b0.name][i]), f"{bcfg.name}: {what} differs from {b0.name}'s"
