"""flash_attn_with_kvcache's host path without a GPU (issue 13's host budget): the plan key
(contiguous layouts as one flag, what tells call shapes apart), the no-LSE run (no tensor, a null
pointer), non-tensors reaching validation, and tests/decode_host_profile.py's stubbed timing."""
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cuflash  # noqa: E402
from cuflash import decode  # noqa: E402

SCALARS = (None, False, (-1, -1), 0.0, True, 0)


def _args(q=None, kc=None, lens=None, **more):
    q = torch.zeros(2, 1, 8, 16, dtype=torch.bfloat16) if q is None else q
    kc = torch.zeros(2, 32, 2, 16, dtype=torch.bfloat16) if kc is None else kc
    lens = torch.zeros(2, dtype=torch.int32) if lens is None else lens
    args = [q, kc, kc.copy() if isinstance(kc, np.ndarray) else kc.clone(), None, None, None, None, lens, None, None, None, None]
    for i, name in enumerate(decode._ARG_NAMES):
        if name in more:
            args[i] = more[name]
    return tuple(args)


def key(args, scalars=SCALARS):
    return decode._gpu_key(args, *scalars)


def test_key_contiguous_layout_is_one_flag():
    base = key(_args())
    assert base[2] is True and base[7] is True and base[12] is True   # q, k_cache, v_cache
    # a size-1 dimension's stride is ignored by is_contiguous, never read by the kernels
    q = torch.zeros(2, 1, 8, 16, dtype=torch.bfloat16).as_strided((2, 1, 8, 16), (128, 7, 16, 1))
    assert q.is_contiguous() and key(_args(q=q)) == base
    # strided: the strides themselves
    qs = torch.zeros(2, 1, 16, 16, dtype=torch.bfloat16)[:, :, ::2]
    assert key(_args(q=qs))[2] == qs.stride() and key(_args(q=qs)) != base
    # an empty tensor is contiguous whatever its strides: they key it
    k0 = torch.zeros(2, 0, 2, 16, dtype=torch.bfloat16)
    assert key(_args(kc=k0))[7] == k0.stride()


def test_key_tells_apart_classes_dtypes_and_patterns():
    base = key(_args())
    assert key(_args(q=torch.zeros(2, 1, 8, 16, dtype=torch.float16))) != base
    param = torch.nn.Parameter(torch.zeros(2, 32, 2, 16, dtype=torch.bfloat16), requires_grad=False)
    assert key(_args(kc=param)) != base                     # a subclass keys its own plan
    assert key(_args(lens=5)) != key(_args(lens=torch.full((2,), 5, dtype=torch.int32)))
    assert key(_args(lens=5)) != key(_args(lens=6)) and key(_args(lens=5)) == key(_args(lens=5))
    kn = torch.zeros(2, 1, 2, 16, dtype=torch.bfloat16)
    appended = key(_args(k=kn, v=kn))
    assert appended != base and len(appended) == len(base)
    table = torch.zeros(2, 4, dtype=torch.int32)
    assert key(_args(block_table=table)) != key(_args(alibi_slopes=table))   # same tensor, other slot
    # the scalars' last ten entries as before (test_decode_cpu.test_gpu_key_tells_apart_what_validation_does)
    assert key(_args(), (None, True, (-1, -1), 0.0, 1, 0))[-10:] == key(_args(), (None, 1, (-1, -1), 0.0, True, 0))[-10:]
    assert key(_args(), (torch.tensor(1.0),) + SCALARS[1:]) is None  # a 0-d tensor scale: no caching


def test_non_tensor_arguments_reach_validation(monkeypatch):
    """A NumPy k_cache (no stride()) or an unhashable window raise in the key; _run_cached then
    validates, whose error names the argument."""
    args = _args(kc=np.zeros((2, 32, 2, 16), np.float16))
    with pytest.raises(AttributeError):
        key(args)
    with pytest.raises(TypeError, match="^k_cache"):
        decode._run_cached({}, args, SCALARS)
    with pytest.raises(TypeError, match="window_size"):
        decode._run_cached({}, _args(), (None, False, ([-1], -1), 0.0, True, 0))


class _Plan:
    def __init__(self):
        self.calls = []

    def run(self, ptrs, ws, stream):
        self.calls.append(ptrs)


def _entry():
    entry = decode._GpuEntry()
    entry.plan, entry.out_shape, entry.lse_shape = _Plan(), (2, 1, 8, 16), (2, 8, 1)
    entry.ws_bytes, entry.empty, entry.device, entry.contiguous, entry.counters = 0, False, None, (), None
    entry.raw_stream = lambda device: 0
    entry.f32, entry.u8 = torch.float32, torch.uint8
    entry.slots = (0, 1, 2, 7)
    return entry


@pytest.mark.parametrize("poison", [False, True])
def test_run_without_lse_passes_a_null_pointer(poison, monkeypatch):
    from cuflash import api

    monkeypatch.setattr(api, "POISON_OUTPUTS", poison)
    entry, args = _entry(), _args()
    out, lse = entry.run(args, False)
    assert lse is None and out.shape == (2, 1, 8, 16) and out.dtype == torch.bfloat16
    ptrs = entry.plan.calls[-1]
    assert len(ptrs) == 14 and ptrs[12] == out.data_ptr() and ptrs[13] == 0
    assert ptrs[:3] == tuple(a.data_ptr() for a in args[:3]) and ptrs[7] == args[7].data_ptr()
    out, lse = entry.run(args)
    assert lse.shape == (2, 8, 1) and entry.plan.calls[-1][13] == lse.data_ptr() != 0
    entry.empty = True
    out, lse = entry.run(args, False)
    assert lse is None and not out.any()


def test_kvcache_returns_out_alone_through_the_no_lse_run(monkeypatch):
    """flash_attn_with_kvcache's GPU branch passes return_softmax_lse through (want_lse)."""
    seen = []

    def fake(plans, args, scalars, array_class=None, arrays=None, config=None, want_lse=True):
        seen.append(want_lse)
        return "out", ("lse" if want_lse else None)

    monkeypatch.setattr(decode, "_run_cached", fake)

    class Q(torch.Tensor):   # a CPU tensor that says it is on the GPU
        is_cuda = True

    q = torch.zeros(1, 1, 8, 16).as_subclass(Q)
    assert decode.flash_attn_with_kvcache(q, None, None) == "out"
    assert decode.flash_attn_with_kvcache(q, None, None, return_softmax_lse=True) == ("out", "lse")
    assert seen == [False, True]


def test_host_profile_script_runs(monkeypatch):
    """The script stubs the GPU queries and the launch (setattr, for good: it is a script); here
    through monkeypatch, so that no later test meets a stubbed cuflash._gpu.require."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import decode_host_profile

    stub = decode_host_profile.stub_gpu
    monkeypatch.setattr(decode_host_profile, "stub_gpu",
                        lambda pkg=cuflash, monkeypatch_attr=None: stub(pkg, monkeypatch.setattr))
    monkeypatch.setattr(decode, "_gpu_plans", {})   # its plans hold the stubbed kernels
    decode_host_profile.main(["--calls", "20", "--rounds", "1"])


def test_host_timing_loads_another_revisions_decode(tmp_path):
    """tests/decode_host_timing.py --old-decode: a decode.py file loads as cuflash._decode_old, its
    own plan cache, this checkout's cuflash beneath."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import decode_host_timing

    path = tmp_path / "decode.py"
    path.write_text(open(decode.__file__).read())
    old = decode_host_timing.load_decode(str(path))
    assert old.__name__ == "cuflash._decode_old" and old._gpu_plans is not decode._gpu_plans
    assert old.api is decode.api
