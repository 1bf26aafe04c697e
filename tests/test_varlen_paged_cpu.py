"""flash_attn_varlen_func with block_table (a paged K/V cache), the parts that need no GPU: the
torch CPU path (the float64 reference on the keys gathered from their pages) equals the packed
call; validation names block_table / k / v / cu_seqlens_k before any launch; selection runs
fa2_fwd_paged and only it; its params carry the page strides and the table; the torch host path
up to the launch (a fake plan) and its backward's refusal; nvcc builds (sm_80, sm_90a) with
zero spills.
"""
import shutil

import numpy as np
import pytest

import cuflash
from cuflash import api, registry, varlen
from cuflash.problem import Problem

torch = pytest.importorskip("torch")

LENS_Q, LENS_K = [3, 0, 5, 1], [7, 2, 0, 19]
PAGE, H, HKV, D = 4, 4, 2, 16


def paged_inputs(dtype=torch.bfloat16, d=D):
    torch.manual_seed(0)
    kc = torch.randn(12, PAGE, HKV, d, dtype=dtype)
    vc = torch.randn(12, PAGE, HKV, d, dtype=dtype)
    table = torch.tensor([[3, 1, -1, -1, -1], [5, -1, -1, -1, -1], [-1] * 5, [11, 2, 7, 9, 4]],
                         dtype=torch.int32)
    q = torch.randn(sum(LENS_Q), H, d, dtype=dtype)
    cu_q = torch.tensor([0] + list(np.cumsum(LENS_Q)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(np.cumsum(LENS_K)), dtype=torch.int32)
    return q, kc, vc, table, cu_q, cu_k


def test_gather_paged_addresses_keys_as_the_kernel():
    _, kc, _, table, _, _ = paged_inputs()
    kp = varlen.gather_paged(kc.view(torch.int16).numpy(), table.numpy(), LENS_K)
    assert kp.shape == (sum(LENS_K), HKV, D)
    starts = np.cumsum([0] + LENS_K)
    for b, n in enumerate(LENS_K):
        for j in range(n):
            page, row = table[b, j // PAGE].item(), j % PAGE
            assert np.array_equal(kp[starts[b] + j], kc[page, row].view(torch.int16).numpy())


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(3, 1), softcap=5.0),
                                dict(alibi_slopes=torch.rand(4, H), causal=True)])
def test_torch_cpu_paged_equals_the_packed_call(kw):
    q, kc, vc, table, cu_q, cu_k = paged_inputs()
    out, lse, _ = cuflash.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, max(LENS_Q), max(LENS_K),
                                                 return_attn_probs=True, block_table=table, **kw)
    kp, vp = (varlen.gather_paged(x, table, LENS_K, xp="torch") for x in (kc, vc))
    want, want_lse, _ = cuflash.flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, max(LENS_Q), max(LENS_K),
                                                       return_attn_probs=True, **kw)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(3, 1))])
def test_torch_cpu_paged_dropout_is_the_gathered_call(kw):
    """dropout with block_table: the varlen call on the keys gathered from their pages (its mask,
    its output, its gradients, reaching the paged k, v through the gather)."""
    q, kc, vc, table, cu_q, cu_k = paged_inputs(dtype=torch.float64)
    q, kc, vc = (x.requires_grad_() for x in (q, kc, vc))
    seed = (1234, 5)
    out, lse, mask = cuflash.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, max(LENS_Q), max(LENS_K), 0.3,
                                                    return_attn_probs=True, block_table=table,
                                                    dropout_seed=seed, **kw)
    kp, vp = (varlen.gather_paged(x, table, LENS_K, xp="torch") for x in (kc, vc))
    want, want_lse, want_mask = cuflash.flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, max(LENS_Q), max(LENS_K),
                                                               0.3, return_attn_probs=True, dropout_seed=seed, **kw)
    assert torch.equal(out, want) and torch.equal(lse, want_lse) and torch.equal(mask, want_mask)
    assert not mask[mask.any(-1).any(-1).any(-1)].all()   # something dropped
    g = torch.autograd.grad(out.sum(), (q, kc, vc))
    gw = torch.autograd.grad(want.sum(), (q, kc, vc))
    assert all(torch.equal(a, b) for a, b in zip(g, gw)) and g[1].abs().sum() > 0


def test_paged_validation_names_the_argument():
    q, kc, vc, table, cu_q, cu_k = paged_inputs()
    call = lambda **kw: cuflash.flash_attn_varlen_func(  # noqa: E731
        kw.pop("q", q), kw.pop("k", kc), kw.pop("v", vc), cu_q, kw.pop("cu_k", cu_k), max(LENS_Q),
        kw.pop("max_k", max(LENS_K)), block_table=kw.pop("block_table", table), **kw)
    with pytest.raises(TypeError, match="^block_table: dtype must be int32"):
        call(block_table=table.long())
    with pytest.raises(ValueError, match=r"^block_table: expected shape \(batch, max_num_blocks\)"):
        call(block_table=table[:3])
    with pytest.raises(TypeError, match="^block_table: expected a torch array"):
        call(block_table=table.numpy())
    bad = table.clone()
    bad[3, 2] = 12
    with pytest.raises(ValueError, match=r"^block_table: sequence 3 uses page ids \[11, 2, 12, 9, 4\]"):
        call(block_table=bad)
    bad[3, 2] = -1
    with pytest.raises(ValueError, match=r"outside \[0, 12\)"):
        call(block_table=bad)
    with pytest.raises(ValueError, match="^block_table: sequence 3 has 19 keys, 5 pages of 4"):
        call(block_table=table[:, :4])
    with pytest.raises(ValueError, match="^block_table: needs at least one column"):
        call(block_table=table[:, :0])
    with pytest.raises(ValueError, match=r"^k: expected 4 dimensions \(num_blocks, page_block_size"):
        call(k=kc.reshape(-1, HKV, D))
    with pytest.raises(ValueError, match="^v: shape must equal k's"):
        call(v=vc[:11])
    with pytest.raises(ValueError, match="^cu_seqlens_k: must start at 0 and never decrease"):
        call(cu_k=torch.tensor([0, 7, 5, 9, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="^max_seqlen_k=5 is less than the longest"):
        call(max_k=5)
    with pytest.raises(ValueError, match="^block_table: sequence 3 has 19 keys"):   # dropout validates first too
        call(block_table=table[:, :4], dropout_p=0.1)
    # unused columns (-1 here) are never read: no error for them
    call()


def test_paged_problems_select_fa2_fwd_paged_only():
    from cuflash.select import choose

    p = varlen.features_problem("fwd", "bf16", 3, 100, 5000, 8, 2, 128, True, (256, -1), 0.0, False,
                                paged=True)
    fam, cfg, _ = choose(p, (9, 0))
    assert fam.name == "fa2_fwd_paged" and cfg.window and cfg.alibi and cfg.varlen and not cfg.dropout
    assert cfg.kernel_name().startswith("cuflash::fa2_fwd_paged<") and cfg.name.startswith("paged_fwd_")
    assert registry.get("fa2_fwd").supports((9, 0), p) == "fa2_fwd has no feature 'paged'"
    assert "sm90_fwd has no feature" in registry.get("sm90_fwd").supports((9, 0), p)
    plain = p.replace(features=("varlen",))
    assert "block_table" in fam.supports((9, 0), plain)
    assert "block_table" in fam.supports((9, 0), plain.replace(features=()))


def test_paged_params_carry_page_strides_and_the_table():
    from cuflash.launch import pack, struct_dtype

    fam = registry.get("fa2_fwd_paged")
    p = varlen.features_problem("fwd", "fp16", 3, 100, 5000, 8, 2, 64, False, paged=True)
    cfg = fam.for_problem(fam.heuristic(p, (8, 0)), p)
    strides = {"q": (0, 512, 64, 1), "o": (0, 512, 64, 1), "k": (16 * 128 * 64 * 2, 128, 64, 1),
               "v": (16 * 128 * 64 * 2, 128, 64, 1), "totals": (300, 0), "paged": (16, 40, 9, 9)}
    fields = fam.static_params(cfg, p, strides, {"total": 0}, 0.125, 132)
    assert fields["k_batch_stride"] == 16 * 128 * 64 * 2 and fields["q_batch_stride"] == 0
    assert (fields["page_block_size"], fields["num_pages"], fields["block_table_cols"],
            fields["block_table_stride"]) == (16, 40, 9, 9)
    rec = pack("FwdPagedParams", **dict.fromkeys(fam.pointer_fields, 0), **fields)
    names = struct_dtype("FwdPagedParams").names
    assert names[:5] == fam.pointer_fields and names[-5:] == (
        "block_table", "block_table_stride", "block_table_cols", "page_block_size", "num_pages")
    assert rec["num_pages"][0] == 40 and struct_dtype("FwdParams").names == names[:-5]


def test_torch_paged_plumbing_and_backward_refusal(monkeypatch):
    from cuflash import varlen_torch

    calls = []

    class FakePlan:
        device, workspace_bytes = 0, 0

        def __init__(self, problem, strides):
            self.problem, self.strides = problem, strides

        def run_with(self, ptrs, ws, stream, extra):
            calls.append((self, ptrs, dict(extra)))

    monkeypatch.setattr(api, "make_plan", lambda problem, strides, scale, device, config=None:
                        FakePlan(problem, strides))
    monkeypatch.setattr(varlen_torch, "_raw_stream", lambda device: 0)
    varlen._feature_plans.clear()
    q, kc, vc, table, cu_q, cu_k = paged_inputs(d=72)
    feats = api.check_features(api.describe("q", q[None]), 0.0, (5, -1), 0.0, None, True, 4, H)
    q.requires_grad_()
    out, lse = varlen_torch.attention_paged(q, kc, vc, cu_q, cu_k, table, max(LENS_Q), max(LENS_K),
                                            0.125, feats)
    plan, ptrs, extra = calls[-1]
    assert plan.problem.features == ("paged", "varlen", "window") and plan.problem.window == (5, 0)
    assert plan.problem.nheads_kv == HKV and plan.problem.head_dim == 72
    assert plan.strides["paged"] == (PAGE, 12, 5, 5) and plan.strides["k"] == tuple(kc.stride())
    assert extra["block_table"] == table.data_ptr() and extra["cu_seqlens_k"] == cu_k.data_ptr()
    assert out.shape == q.shape and lse.shape == (H, sum(LENS_Q))
    with pytest.raises(NotImplementedError, match="^block_table: the backward"):
        out.float().sum().backward()


# ---------------------------------------------------------------------------------------
# nvcc


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (no GPU needed)")
@pytest.mark.parametrize("arch,cc", [("sm_80", (8, 0)), ("sm_90a", (9, 0))])
def test_paged_instantiations_compile_without_spills(arch, cc, request):
    import hashlib
    import json

    from cuflash.compile import nvcc_compile, source_hash

    fam = registry.get("fa2_fwd_paged")
    configs = []
    for d in (64, 80, 128, 256):
        for feats, causal in ((("paged", "varlen"), True), (("paged", "varlen"), False),
                              (("alibi", "paged", "softcap", "varlen", "window"), False)):
            p = Problem("fwd", "bf16" if causal else "fp16", 3, 1000, 1200, 4, 2, d, causal, False, feats)
            configs.append(fam.for_problem(fam.heuristic(p, cc), p))
    key = hashlib.sha256(json.dumps([source_hash("fa2_fwd_paged"), arch] + [c.kernel_name() for c in configs])
                         .encode()).hexdigest()[:24]
    cached = request.config.cache.get(f"cuflash/paged/{key}", None)
    if cached is None:
        cached = [[c.name, r.registers, r.spill_stores, r.spill_loads]
                  for c, r in zip(configs, nvcc_compile(configs, arch))]
        request.config.cache.set(f"cuflash/paged/{key}", cached)
    for row in cached:
        print(arch, *row)
    assert not [row for row in cached if row[2] or row[3]], cached
