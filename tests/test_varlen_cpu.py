"""Variable-length plumbing without a GPU: the varlen Problem, the families' launch plans and
params for it, and the backward's token-indexed workspace layout (kernels_cu/varlen.cuh)."""
import numpy as np
import pytest

from cuflash import launch, registry, varlen
from cuflash.families.fa2_bwd import ROW_PAD, VARLEN_ROW_PAD, varlen_ws_rows
from cuflash.compile import render_source


def strides(nheads, nheads_kv, d):
    q, k = (nheads * d, d, 1), (nheads_kv * d, d, 1)
    out = {n: varlen.strides4(s) for n, s in
           {"dout": q, "q": q, "k": k, "v": k, "o": q, "dq": q, "dk": k, "dv": k}.items()}
    return out


@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_varlen_params_pack_and_launch(op):
    fam = registry.get("fa2_fwd" if op == "fwd" else "fa2_bwd")
    p = varlen.problem_of(op, "bf16", 3, 300, 500, 8, 2, 64, True, op == "bwd")
    cfg = fam.for_problem(fam.heuristic(p, (9, 0)), p)
    assert cfg.varlen and cfg.name.endswith("_varlen")
    assert all("true>" in name or ", true" in name for name in fam.kernel_names(cfg).values())
    st = dict(strides(8, 2, 64), totals=(600, 900))
    ws = fam.workspace(cfg, p, st)
    fields = fam.static_params(cfg, p, st, ws, 0.125, 132)
    rec = launch.pack(fam.params_struct, **dict.fromkeys(fam.pointer_fields, 0), **fields)
    assert rec["total_q"][0] == 600 and rec["cu_seqlens_q"][0] == 0
    assert all(v == 0 for k, v in fields.items() if k.endswith("_batch_stride"))
    grids = {s.role: s.grid for s in fam.launches(cfg, p, 132)}
    if op == "fwd":
        assert grids["main"] == (-(-300 // cfg.Br), 8, 3)
    else:
        assert rec["total_k"][0] == 900 and rec["ws_rows"][0] == varlen_ws_rows(600, 3)
        assert ws["dk_accum"] + 8 * 900 * cfg.head_dim * 4 <= ws["dv_accum"]
        assert grids["preprocess"][2] == 3 and grids["main"][0] == 3 * 8 * (-(-500 // cfg.Bc))


def test_fixed_length_params_are_unchanged():
    fam = registry.get("fa2_fwd")
    p = varlen.problem_of("fwd", "bf16", 2, 64, 64, 2, 2, 64, False).replace(features=())
    cfg = fam.for_problem(fam.heuristic(p), p)
    assert not cfg.varlen
    st = {n: (64 * 128, 128, 64) for n in ("q", "k", "v", "o")}
    fields = fam.static_params(cfg, p, st, {"total": 0}, 0.125, 132)
    assert fields["q_batch_stride"] == 64 * 128 and fields["total_q"] == 0


def test_kernel_constants_match():
    src = render_source("fa2_bwd")
    assert f"constexpr int kVarlenRowPad = {VARLEN_ROW_PAD};" in src
    assert VARLEN_ROW_PAD >= ROW_PAD + 8


@pytest.mark.parametrize("seed", range(20))
def test_workspace_rows_of_sequences_are_disjoint(seed):
    """varlen.cuh ws_row_offset: sequence b's rows [floor8(cu[b] + pad·b), + round_up(len, 128))
    (the preprocess writes them; every Q block read or dQ atomic of b stays inside) are 16-byte
    aligned, disjoint, and inside ws_rows."""
    rng = np.random.default_rng(seed)
    lens = rng.choice([0, 1, 7, 8, 17, 113, 127, 128, 129, 1023], size=rng.integers(1, 40))
    cu = np.concatenate([[0], np.cumsum(lens)])
    rows = varlen_ws_rows(cu[-1], len(lens))
    assert rows % 8 == 0
    end = 0
    for b, n in enumerate(lens):
        start = (int(cu[b]) + VARLEN_ROW_PAD * b) & ~7
        assert start % 4 == 0 and start >= end
        end = start + -(-int(n) // ROW_PAD) * ROW_PAD
        assert end <= rows


def test_features_with_varlen_are_supported_and_dropout_with_band_too():
    p = varlen.problem_of("fwd", "bf16", 2, 64, 64, 2, 2, 64, False)
    for feats in (("varlen", "window"), ("alibi", "softcap", "varlen", "window"), ("dropout", "varlen"),
                  ("dropout", "varlen", "window"), ("alibi", "dropout", "softcap", "varlen", "window")):
        assert registry.get("fa2_fwd").supports((9, 0), p.replace(features=feats)) == ""
        assert registry.get("fa2_bwd").supports((9, 0), p.replace(op="bwd", features=feats)) == ""
    assert registry.get("fa2_fwd").supports((9, 0), p) == ""
    assert registry.get("sm90_fwd").supports((9, 0), p) == ""    # the Hopper forward runs varlen too


class _FakeDev(np.ndarray):
    """A NumPy array posing as a CuPy one (device.id, data.ptr) for host-side tests."""

    @property
    def device(self):
        import types
        return types.SimpleNamespace(id=0)

    @property
    def data(self):
        import types
        return types.SimpleNamespace(ptr=self.ctypes.data)


def _fake_cupy():
    import contextlib
    import types

    wrap = lambda a: np.asarray(a).view(_FakeDev)  # noqa: E731
    cuda = types.SimpleNamespace(Device=lambda i: contextlib.nullcontext(),
                                 get_current_stream=lambda: types.SimpleNamespace(ptr=0))
    return types.SimpleNamespace(cuda=cuda, uint16=np.uint16, uint8=np.uint8, float32=np.float32,
                                 empty=lambda s, d: wrap(np.empty(s, d)),
                                 ascontiguousarray=lambda a: wrap(np.ascontiguousarray(a)))


def test_cupy_varlen_launches_read_strided_cu_seqlens_as_their_values(monkeypatch):
    """The kernels read cu_seqlens as a dense int32 array: a strided CuPy view must be
    copied, not passed by its address (which would hand the kernels other offsets)."""
    import ctypes

    from cuflash import varlen

    seen = []

    class Plan:
        workspace_bytes = 0

        def run_varlen(self, ptrs, ws, stream, cu_q, cu_k):
            seen.append([list((ctypes.c_int32 * 3).from_address(p)) for p in (cu_q, cu_k)])

    monkeypatch.setattr(varlen, "_cupy", _fake_cupy)
    strides = []
    monkeypatch.setattr(varlen, "get_plan", lambda *a, **k: strides.append(a[8]) or Plan())
    full = np.array([0, 99, 5, 99, 9, 99], np.int32).view(_FakeDev)
    cu = full[::2]                                   # (0, 5, 9), strided
    q = np.zeros((9, 2, 64), np.float16).view(_FakeDev)
    varlen.forward_cupy(q, q, q, cu, cu, 5, 5, 0.125, False)
    o = np.zeros((9, 2, 65), np.float16).view(_FakeDev)[..., :64]   # out: strides not the kernels'
    varlen.backward_cupy(q, q, q, q, o, np.zeros((2, 9), np.float32).view(_FakeDev), cu, cu, 5, 5,
                         0.125, False)
    assert seen == [[[0, 5, 9], [0, 5, 9]]] * 2
    assert strides[1]["o"] == (128, 64, 1)           # out copied, not launched at strides 130, 65


def test_varlen_forward_outputs_for_empty_batches():
    """varlen_torch._outputs: fresh out / lse, and the calls that need no kernel (no query rows:
    untouched; no keys: O = 0, LSE = +inf)."""
    torch = pytest.importorskip("torch")
    from cuflash import varlen_torch

    q = torch.zeros(5, 2, 8, dtype=torch.float16)
    out, lse, done = varlen_torch._outputs(q, 7, 3, 4)
    assert not done and out.shape == q.shape and lse.shape == (2, 5) and lse.dtype == torch.float32
    out, lse, done = varlen_torch._outputs(q, 0, 3, 0)
    assert done and bool((out == 0).all()) and bool(torch.isinf(lse).all())
    assert varlen_torch._outputs(q[:0], 7, 0, 4)[2]
