"""The registry of kernel families (cuflash/registry.py), what each family declares
(cuflash/families/), selection among them (cuflash/select.py: choose) and the launch plan a
family's declarations turn into (cuflash/launch.py: Plan), on the CPU: no GPU, no compiler."""
import ctypes
import dataclasses
import itertools
import re
from types import SimpleNamespace

import numpy as np
import pytest

import cuflash
from cuflash import _gpu, api, launch, registry, select
from cuflash.families.base import (MAX_SMEM_BY_ARCH, ConfigError, Family, KernelConfig,
                                   LaunchSpec)
from cuflash.families.fa2_bwd import ROW_PAD, BwdConfig, head_group
from cuflash.families.fa2_fwd import FwdConfig
from cuflash.families.sm90_fwd import Sm90FwdConfig
from cuflash.problem import DTYPES, Problem
from cuflash.select import UnsupportedProblem, choose

FAMILIES = registry.families()
ARCHS = [(8, 0), (8, 6), (9, 0)]
HEAD_DIMS = range(8, 257, 8)


def problem(op="fwd", head_dim=64, dtype="bf16", causal=False, deterministic=False, **kw):
    shape = dict(batch=2, seqlen_q=300, seqlen_k=200, nheads=8, nheads_kv=2)
    shape.update(kw)
    return Problem(op, dtype, shape["batch"], shape["seqlen_q"], shape["seqlen_k"],
                   shape["nheads"], shape["nheads_kv"], head_dim, causal, deterministic)


def family_ids(f):
    return f.name


def dtypes_of(family) -> tuple:
    """The input dtypes a family takes (Family.dtypes: fp8 families "e4m3" only)."""
    return tuple(getattr(family, "dtypes", DTYPES))


def dtype_for(family, want: str = "bf16") -> str:
    return want if want in dtypes_of(family) else dtypes_of(family)[0]


# ---------------------------------------------------------------------------------------
# what is registered

def test_the_fa2_families_are_registered():
    fwd, bwd = registry.get("fa2_fwd"), registry.get("fa2_bwd")
    assert (fwd.op, bwd.op) == ("fwd", "bwd")
    assert fwd in registry.families("fwd") and bwd in registry.families("bwd")
    assert fwd not in registry.families("bwd") and bwd not in registry.families("fwd")
    assert set(registry.families()) >= {fwd, bwd}
    assert fwd.config_cls is FwdConfig and bwd.config_cls is BwdConfig
    assert registry.family_of(FwdConfig(64, 32, 4, 2, 64, "bf16", False)) is fwd
    assert registry.family_of(BwdConfig(32, 128, 4, 2, 1, 64, "bf16", False)) is bwd
    assert set(registry.OPS) >= {"fwd", "bwd"}


def test_registry_errors():
    with pytest.raises(LookupError, match=r"unknown kernel family 'nope'; registered: \[.*'fa2_fwd'"):
        registry.get("nope")
    with pytest.raises(TypeError, match=r"expected a cuflash kernel config .* got dict"):
        registry.family_of({"Br": 64})


@pytest.mark.parametrize("family", FAMILIES, ids=family_ids)
def test_family_declarations(family):
    """What generic code reads of every family is there and consistent."""
    assert family.op in registry.OPS
    assert family.config_cls.family == family.name
    assert issubclass(family.config_cls, KernelConfig)
    assert family.space and all(len(v) == len(set(v)) >= 1 for v in family.space.values())
    fields = {f.name for f in dataclasses.fields(family.config_cls)}
    assert set(family.space) <= fields and set(family.fixed) <= fields
    assert {"head_dim", "dtype", "causal"} <= fields
    assert "warps" in fields or hasattr(family.config_cls, "warps")  # sm90_fwd: from consumers
    assert isinstance(family.version, int) and family.version >= 1
    assert len(family.min_arch) == 2
    dt = launch.struct_dtype(family.params_struct)
    # the pointer fields lead the struct, the op's tensors first (inputs, then outputs)
    assert dt.names[:len(family.pointer_fields)] == tuple(family.pointer_fields)
    op = registry.OPS[family.op]
    tensors = [{"out": "o"}.get(n, n) for n in op.inputs + op.outputs]
    assert list(family.pointer_fields[:len(tensors)]) == tensors
    # the rest are workspace pieces, the only names workspace() may give offsets for
    cfg = family.heuristic(problem(family.op))
    ws = family.workspace(cfg, problem(family.op))
    assert set(ws) - {"total"} <= set(family.pointer_fields[len(tensors):])
    assert "main" in family.kernel_names(cfg)
    assert repr(family).startswith(f"<family {family.name}: op {family.op}")


def test_register_checks_the_family():
    class NoOp(Family):
        name, op, config_cls = "no_op", "decode2", FwdConfig

    with pytest.raises(ValueError, match=r"family no_op: unknown op 'decode2'"):
        registry.register(NoOp())

    class Mismatch(Family):
        name, op, config_cls = "mismatch", "fwd", FwdConfig

    with pytest.raises(ValueError, match=r"config class FwdConfig must set family = 'mismatch'"):
        registry.register(Mismatch())
    assert "no_op" not in registry._FAMILIES and "mismatch" not in registry._FAMILIES


# ---------------------------------------------------------------------------------------
# heuristics, spaces, supports()

@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"sm{a[0]}{a[1]}")
@pytest.mark.parametrize("family", FAMILIES, ids=family_ids)
def test_heuristic_supported_and_valid_for_every_head_dim(family, arch):
    if family.supports(arch, problem(family.op, dtype=dtype_for(family))):  # arch-specific (sm90_fwd: sm_90 only)
        pytest.skip(family.supports(arch, problem(family.op, dtype=dtype_for(family))))
    max_smem = MAX_SMEM_BY_ARCH[arch]
    # every head dim the family takes (fp8: multiples of 16)
    head_dims = [d for d in HEAD_DIMS if not family.supports(arch, problem(family.op, d, dtype_for(family)))]
    for d, dtype, causal, det in itertools.product(head_dims, dtypes_of(family), (False, True), (False, True)):
        p = problem(family.op, d, dtype, causal, det)
        if d > getattr(family, "max_head_dim", HEAD_DIMS[-1]):   # a family that stops short (sm90_bwd)
            assert "headdim" in family.supports(arch, p), (family.name, d)
            continue
        assert family.supports(arch, p) == "", (family.name, d)
        cfg = family.for_problem(family.heuristic(p, arch, max_smem), p)
        assert cfg.problems(max_smem) == [], (d, dtype, causal, cfg.name)
        assert family.fits(cfg, p) == "", cfg.name
        assert cfg.head_dim == family.head_dim_of(d) >= d
        # what selection gives without a tuned table
        fam, chosen, source = choose(p, arch, max_smem=max_smem, family=family)
        assert (fam, chosen) == (family, cfg) and source.startswith("heuristic")


@pytest.mark.parametrize("family", FAMILIES, ids=family_ids)
def test_space_enumeration(family):
    p = problem(family.op, 128, dtype_for(family, "fp16"), True)
    size = int(np.prod([len(v) for v in family.space.values()]))
    points = list(family.enumerate(p))
    assert len(points) == size
    assert len({family.point(c).values().__repr__() for c, _ in points}) == size
    valid = family.valid(p, MAX_SMEM_BY_ARCH[(9, 0)])
    assert 0 < len(valid) <= size
    space_points = {repr(family.point(c)) for c, _ in points}   # once: the space's points, by their repr
    for cfg in valid:
        assert cfg.validate(MAX_SMEM_BY_ARCH[(9, 0)]) is cfg
        assert family.make(family.point(cfg), p) == cfg
        assert all(repr(n) in space_points for n in family.neighbours(cfg))


@pytest.mark.parametrize("family", FAMILIES, ids=family_ids)
def test_supports_reasons_name_the_argument(family):
    op, dt = family.op, dtype_for(family)
    # features every problem of the family has (fa2_fwd_paged: paged, varlen); else none
    required = tuple(getattr(family, "requires", ()))
    base = lambda *a, **kw: problem(*a, **kw).replace(features=required)  # noqa: E731
    assert family.supports((9, 0), base(op, dtype=dt)) == ""
    if required:
        assert family.supports((9, 0), problem(op, dtype=dt)) != ""
    for d in (4, 12, 60, 264, 512):
        why = family.supports((9, 0), base(op, d, dt))
        assert re.match(r"q: headdim must be a multiple of (8|16)", why), why
        assert str(d) in why
    other = "bwd" if op == "fwd" else "fwd"
    assert f"implements op {op!r}, not {other!r}" in family.supports((9, 0), base(other, dtype=dt))
    assert f"needs sm_{family.min_arch[0]}{family.min_arch[1]}" in family.supports((7, 5), base(op, dtype=dt))
    for feature in ("window", "dropout", "varlen"):
        feats = tuple(sorted(set(required + (feature,))))
        why = family.supports((9, 0), problem(op, dtype=dt).replace(features=feats))
        assert (why == "") == (feature in family.features), (feature, why)
        if why:
            assert f"{family.name} has no feature {feature!r}" == why


@pytest.mark.parametrize("family", FAMILIES, ids=family_ids)
def test_fits(family):
    p = problem(family.op, 80, dtype_for(family, "fp16"), True)
    cfg = family.heuristic(p)
    assert family.fits(cfg, p) == ""
    for bad in (p.replace(dtype="bf16" if p.dtype != "bf16" else "fp16"), p.replace(causal=False), p.replace(head_dim=cfg.head_dim + 8)):
        why = family.fits(cfg, bad)
        assert why.startswith(f"{cfg.name} does not fit this call"), why


# ---------------------------------------------------------------------------------------
# encode / decode: what crosses the torch op boundary

@pytest.mark.parametrize("family", FAMILIES, ids=family_ids)
def test_encode_decode_round_trip_every_valid_config(family):
    n = 0
    seen, classes = set(), set()
    head_dims = sorted({family.head_dim_of(d) for d in HEAD_DIMS})
    for d, dtype, causal in itertools.product(head_dims, dtypes_of(family), (False, True)):
        for cfg in family.valid(problem(family.op, d, dtype, causal)):
            variants = [cfg]
            if "deterministic" in {f.name for f in dataclasses.fields(cfg)}:
                variants.append(cfg.replace(deterministic=True))
            for c in variants:
                text = family.encode(c)
                assert text.startswith(family.name + ":") and " " not in text
                assert family.decode(text, dtype, causal) == c, text
                seen.add(text)
                classes.add(dataclasses.replace(c, dtype="", causal=False))
                n += 1
    assert n > 0
    # dtype and causal come from the call, not the string: one string per class of configs (a class
    # may be valid for one mask only: sm90_fwd's p_smem register budget is the mask's)
    assert len(seen) == len(classes)


def test_encode_example():
    fwd = registry.get("fa2_fwd")
    cfg = FwdConfig(128, 64, 4, 2, 96, "fp16", True)
    assert fwd.encode(cfg) == "fa2_fwd:Br=128,Bc=64,warps=4,stages=2,head_dim=96,varlen=0,dropout=0"
    assert fwd.decode(fwd.encode(cfg.replace(varlen=True)), "fp16", True) == cfg.replace(varlen=True)
    bwd = registry.get("fa2_bwd")
    cfg = BwdConfig(64, 128, 8, 2, 1, 128, "bf16", False, True, 2)
    assert bwd.encode(cfg) == ("fa2_bwd:Br=64,Bc=128,warps=8,stages=2,dsplit=1,head_dim=128,"
                               "deterministic=1,qsplit=2,varlen=0,dropout=0")
    assert bwd.decode(bwd.encode(cfg), "bf16", False) == cfg


# ---------------------------------------------------------------------------------------
# selection

def test_choose_config_of_the_wrong_op_names_config():
    fwd_cfg = FwdConfig(64, 32, 4, 2, 64, "bf16", False)
    with pytest.raises(ValueError, match=r"^config: fwd_bf16_d64_full_\w+ is a fwd config, this call needs bwd"):
        choose(problem("bwd"), (9, 0), config=fwd_cfg)


@pytest.mark.parametrize("change", [{"dtype": "fp16"}, {"causal": True}, {"head_dim": 48}])
def test_choose_config_that_does_not_fit_names_config(change):
    cfg = FwdConfig(64, 32, 4, 2, 64, "bf16", False)
    with pytest.raises(ValueError, match=r"^config: .* does not fit this call"):
        choose(problem("fwd", 64).replace(**{k: v for k, v in change.items() if k != "head_dim"}),
               (9, 0), config=cfg.replace(**change) if "head_dim" in change else cfg)


def test_choose_config_unsupported_or_too_big():
    cfg = FwdConfig(128, 128, 8, 3, 256, "bf16", False)
    with pytest.raises(ValueError, match=r"^config: .*needs sm_80"):
        choose(problem("fwd", 256), (7, 5), config=cfg)
    with pytest.raises(ConfigError, match=r"shared memory"):
        choose(problem("fwd", 256), (8, 6), max_smem=99 * 1024, config=cfg)


def test_choose_given_config_takes_the_calls_flags():
    cfg = BwdConfig(32, 128, 4, 2, 1, 64, "bf16", False)
    fam, chosen, source = choose(problem("bwd", deterministic=True), (9, 0), config=cfg)
    assert fam.name == "fa2_bwd" and source == "given"
    assert chosen == cfg.replace(deterministic=True)


def test_choose_without_any_supporting_family():
    with pytest.raises(UnsupportedProblem, match=r"q: headdim must be a multiple of 8 in 8\.\.256, got 12"):
        choose(problem("fwd", 12), (9, 0))
    with pytest.raises(UnsupportedProblem, match=r"needs sm_80"):
        choose(problem("fwd"), (7, 5))


# ---- a family registered by a test --------------------------------------------------

@dataclasses.dataclass(frozen=True)
class FakeConfig(KernelConfig):
    tile: int
    warps: int
    head_dim: int
    dtype: str
    causal: bool

    family = "fake_fwd"

    @property
    def name(self):
        return f"fake_{self.dtype}_d{self.head_dim}_{'causal' if self.causal else 'full'}_t{self.tile}_w{self.warps}"

    def _problems(self):
        return [] if self.tile in (32, 64) else [f"tile must be 32 or 64, got {self.tile}"]


class FakeForward(Family):
    name = "fake_fwd"
    op = "fwd"
    config_cls = FakeConfig
    space = {"tile": (32, 64)}
    fixed = {"warps": 4}
    params_struct = "FwdParams"
    pointer_fields = ("q", "k", "v", "o", "lse")
    priority = 10
    only = (64, 512)   # the head dims it claims (512: beyond what fa2 supports)

    def supports(self, arch, p):
        return super().supports(arch, p) or (
            "" if p.head_dim in self.only else f"q: {self.name} needs headdim in {self.only}, got {p.head_dim}")

    def head_dim_of(self, head_dim):
        return head_dim

    def heuristic(self, p, arch=(9, 0), max_smem=None):
        return FakeConfig(64, 4, p.head_dim, p.dtype, p.causal)


@pytest.fixture
def fake_family():
    """FakeForward registered (priority above fa2_fwd) for one test, then removed."""
    fam = registry.register(FakeForward())
    try:
        yield fam
    finally:
        registry._FAMILIES.pop(fam.name, None)
        select.clear_cache()


def test_fake_family_is_chosen_for_what_it_supports(fake_family):
    assert registry.families("fwd")[0] is fake_family         # highest priority first
    assert registry.get("fake_fwd") is fake_family
    fam, cfg, source = choose(problem("fwd", 64), (9, 0))
    assert fam is fake_family and cfg == FakeConfig(64, 4, 64, "bf16", False)
    assert source.startswith("heuristic")
    for d in (32, 72, 128, 256):       # everything else: sm90_fwd on sm_90, fa2_fwd on sm_80
        fam, cfg, _ = choose(problem("fwd", d), (9, 0))
        assert fam.name == "sm90_fwd" and isinstance(cfg, Sm90FwdConfig)
        fam, cfg, _ = choose(problem("fwd", d), (8, 0))
        assert fam.name == "fa2_fwd" and isinstance(cfg, FwdConfig)
    assert choose(problem("fwd", 64), (8, 0))[0] is fake_family
    # its config can be given explicitly, and fa2's for a problem it would win
    fam, cfg, source = choose(problem("fwd", 64), (9, 0), config=FakeConfig(32, 4, 64, "bf16", False))
    assert fam is fake_family and source == "given"
    fa2 = FwdConfig(64, 32, 4, 2, 64, "bf16", False)
    assert choose(problem("fwd", 64), (9, 0), config=fa2)[0].name == "fa2_fwd"
    # the backward is untouched
    assert choose(problem("bwd", 64), (9, 0))[0].name == "sm90_bwd"
    # a round trip through the torch op's string form
    assert fake_family.decode(fake_family.encode(cfg), "bf16", False) == cfg


def test_fake_family_extends_what_the_api_accepts(fake_family):
    """A head dim only the fake family supports passes validation (and reaches the GPU
    check); without it, the same call is refused naming q's headdim."""
    q = np.zeros((1, 4, 2, 512), np.float16)
    api.check_supported(problem("fwd", 512))
    if not _gpu.available():
        with pytest.raises(cuflash.NoGPUError):
            cuflash.flash_attn_func(q, q, q)
    registry._FAMILIES.pop("fake_fwd")
    with pytest.raises(UnsupportedProblem, match=r"^q: headdim must be a multiple of 8 in 8\.\.256, got 512"):
        cuflash.flash_attn_func(q, q, q)


def test_fake_family_with_a_lower_priority_is_not_chosen(fake_family, monkeypatch):
    monkeypatch.setattr(FakeForward, "priority", -1)
    assert registry.families("fwd")[-1] is fake_family
    assert choose(problem("fwd", 64), (9, 0))[0].name == "sm90_fwd"
    assert choose(problem("fwd", 64), (8, 0))[0].name == "fa2_fwd"
    assert choose(problem("fwd", 512), (9, 0))[0] is fake_family


def test_fake_family_is_gone_after_its_test():
    assert "fake_fwd" not in registry._FAMILIES
    assert all(f.name != "fake_fwd" for f in registry.families())


# ---------------------------------------------------------------------------------------
# launch plans, packed on the CPU (kernels and the driver faked)

class Recorder:
    """Stands in for driver.launchKernel: records each launch and the params struct bytes
    its argument array points at, as the driver would copy them."""

    def __init__(self, struct):
        self.dtype = launch.struct_dtype(struct)
        self.calls = []

    def __call__(self, fn, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        struct_ptr = ctypes.c_uint64.from_address(argv).value
        raw = ctypes.string_at(struct_ptr, self.dtype.itemsize)
        self.calls.append(dict(fn=fn, grid=(gx, gy, gz), block=(bx, by, bz), smem=smem,
                               stream=stream, params=np.frombuffer(raw, self.dtype)[0]))


@pytest.fixture
def fake_device(monkeypatch):
    """Plan builds without a GPU: fake kernels (by role), 132 SMs, a recording driver."""
    recorders = {}

    def get_kernels(config, device):
        names = registry.family_of(config).kernel_names(config)
        return {role: SimpleNamespace(kernel=SimpleNamespace(ptr=1000 + i))
                for i, role in enumerate(names)}

    def driver_launch():
        return recorders["current"]

    monkeypatch.setattr(launch, "get_kernels", get_kernels)
    monkeypatch.setattr(_gpu, "sm_count", lambda device=0: 132)
    monkeypatch.setattr(launch, "_driver_launch", driver_launch)
    monkeypatch.setattr(launch, "_device_fns", lambda: (lambda: 0, lambda device: None))

    def make(family, config, p, strides, scale=0.125):
        recorders["current"] = Recorder(family.params_struct)
        plan = launch.Plan(family, config, p, strides, scale, 0)
        return plan, recorders["current"]

    return make


def _strides(p):
    q = api.out_strides((p.batch, p.seqlen_q, p.nheads, p.head_dim))
    k = api.out_strides((p.batch, p.seqlen_k, p.nheads_kv, p.head_dim))
    return {"q": q, "k": k, "v": k, "o": q, "dout": q, "dq": q, "dk": k, "dv": k}


def test_forward_plan_launch(fake_device):
    fam = registry.get("fa2_fwd")
    p = problem("fwd", 72, "fp16", True)
    cfg = fam.heuristic(p)
    plan, rec = fake_device(fam, cfg, p, _strides(p))
    assert plan.workspace_bytes == 0
    ptrs = (0x1000, 0x2000, 0x3000, 0x4000, 0x5000)
    plan.run(ptrs, 0, stream=77)
    assert len(rec.calls) == 1
    call = rec.calls[0]
    assert call["grid"] == (-(-300 // cfg.Br), 8, 2) and call["block"] == (cfg.threads, 1, 1)
    assert call["smem"] == cfg.smem_bytes and call["stream"] == 77 and call["fn"] == 1000
    params = call["params"]
    assert tuple(int(params[n]) for n in fam.pointer_fields) == ptrs
    assert (params["head_dim"], params["seqlen_q"], params["seqlen_k"], params["nheads_kv"]) == (72, 300, 200, 2)
    assert params["q_row_stride"] == 8 * 72 and params["k_batch_stride"] == 200 * 2 * 72
    assert params["softmax_scale"] == np.float32(0.125)
    # a second run writes only the pointers: the rest of the struct is unchanged
    plan.run((0x9000,) * 5, 0, stream=78)
    again = rec.calls[1]["params"]
    assert int(again["q"]) == 0x9000 and int(again["lse"]) == 0x9000
    for name in launch.struct_dtype("FwdParams").names[5:]:
        assert again[name] == params[name], name


def test_plan_loads_and_launches_on_its_own_device(monkeypatch):
    """A plan for device 1 built and run while device 0 is current (CuPy arrays on device 1,
    torch tensors on cuda:1): a cupy.RawKernel resolves ``.kernel`` on the current device, so
    the plan takes its kernel handles and launches with device 1 current, then restores 0."""
    state, sets, launches = {"current": 0}, [], []

    def set_device(device):
        sets.append(device)
        state["current"] = device

    class PerDeviceKernel:  # like cupy.RawKernel: one CUfunction per device
        @property
        def kernel(self):
            return SimpleNamespace(ptr=1000 + state["current"])

    def record(fn, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        launches.append((fn, state["current"], stream))

    monkeypatch.setattr(launch, "get_kernels", lambda config, device: {"main": PerDeviceKernel()})
    monkeypatch.setattr(_gpu, "sm_count", lambda device=0: 132)
    monkeypatch.setattr(launch, "_driver_launch", lambda: record)
    monkeypatch.setattr(launch, "_device_fns", lambda: (lambda: state["current"], set_device))
    fam = registry.get("fa2_fwd")
    p = problem("fwd")
    plan = launch.Plan(fam, fam.heuristic(p), p, _strides(p), 0.125, 1)
    assert state["current"] == 0 and sets == [1, 0]
    plan.run((0x1000,) * 5, 0, stream=3)
    assert launches == [(1001, 1, 3)] and state["current"] == 0      # device 1's kernel, on device 1
    sets.clear()
    state["current"] = 1
    plan.run((0x1000,) * 5, 0, stream=4)                               # already current: no switch
    assert launches[-1] == (1001, 1, 4) and sets == []


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("det", [False, True], ids=["atomic", "deterministic"])
def test_backward_plan_launch_and_workspace(fake_device, gqa, det):
    fam = registry.get("fa2_bwd")
    p = problem("bwd", 128, "bf16", False, det, nheads_kv=2 if gqa else 8)
    cfg = fam.for_problem(fam.heuristic(p), p)
    assert cfg.deterministic == det
    ws = fam.workspace(cfg, p)
    plan, rec = fake_device(fam, cfg, p, _strides(p))
    assert plan.workspace_bytes == ws["total"] > 0
    # the workspace pieces: 256-byte aligned, in order, disjoint, inside the total
    pieces = [n for n in fam.pointer_fields[9:] if n in ws]
    want = ["lse_log2", "D", "dq_accum"] + (["dk_accum", "dv_accum"] if gqa else []) \
        + (["dq_semaphore"] if det else [])
    assert pieces == want
    rows = -(-p.seqlen_q // ROW_PAD) * ROW_PAD
    sizes = {"lse_log2": 16 * rows * 4, "D": 16 * rows * 4, "dq_accum": 16 * rows * 128 * 4,
             "dk_accum": 16 * 200 * 128 * 4, "dv_accum": 16 * 200 * 128 * 4,
             "dq_semaphore": 16 * (rows // 16) * 4}
    end = 0
    for name in pieces:
        assert ws[name] % 256 == 0 and ws[name] >= end, name
        end = ws[name] + sizes[name]
    assert end <= ws["total"] < end + 256
    tensors = tuple(0x10000 * (i + 1) for i in range(9))    # dout q k v o lse dq dk dv
    plan.run(tensors, workspace_ptr=0x7700000, stream=5)
    roles = ["preprocess", "main", "convert_dq"] + (["reduce_dkv"] if gqa else [])
    assert [c["fn"] for c in rec.calls] == [1000 + list(fam.kernel_names(cfg)).index(r) for r in roles]
    for call in rec.calls:
        params = call["params"]
        # the pointer fields lead the struct in pointer_fields order: the op's tensors ...
        assert tuple(int(params[n]) for n in fam.pointer_fields[:9]) == tensors
        # ... then the workspace pieces at their offsets (0 for a piece this call lacks)
        for name in fam.pointer_fields[9:]:
            assert int(params[name]) == (0x7700000 + ws[name] if name in ws else 0), name
    kv_ctas = -(-200 // cfg.Bc) * cfg.dsplit
    main = rec.calls[1]
    assert main["grid"] == (16 * kv_ctas, 1, 1) and main["smem"] == cfg.smem_bytes
    assert main["params"]["head_group"] == head_group(16, kv_ctas, 132)
    assert main["params"]["seqlen_q_rounded"] == rows and main["params"]["head_dim_rounded"] == 128
    assert main["params"]["do_row_stride"] == 8 * 128
    assert rec.calls[0]["grid"][1:] == (8, 2)                  # preprocess: (rows, heads, batch)
    if gqa:
        assert rec.calls[3]["grid"][1:] == (2, 2)               # reduce_dkv: per K/V head


@pytest.mark.parametrize("dout_strides,copy", [
    ((0, 0, 0, 0), True),                         # out.sum().backward(): a broadcast scalar
    ((300 * 8 * 256, 8 * 256, 256, 2), True),     # head dim not contiguous
    ((300 * 8 * 131, 8 * 131, 131, 1), True),     # rows not whole 16-byte chunks
    ((300 * 8 * 128, 8 * 128, 128, 1), False),    # contiguous: read in place
    ((8 * 128, 2 * 8 * 128, 128, 1), False),      # seqlen-major view, whole chunks: in place
])
def test_backward_reads_dout_through_any_strides(fake_device, dout_strides, copy):
    fam = registry.get("fa2_bwd")
    p = problem("bwd", 128, "bf16", False, False)
    cfg = fam.heuristic(p)
    strides = dict(_strides(p), dout=dout_strides)
    ws = fam.workspace(cfg, p, strides)
    assert ("dout_copy" in ws) == copy
    plan, rec = fake_device(fam, cfg, p, strides)
    assert plan.workspace_bytes == ws["total"]
    plan.run(tuple(0x10000 * (i + 1) for i in range(9)), workspace_ptr=0x7700000, stream=5)
    params = rec.calls[0]["params"]
    # the preprocess reads dout through the caller's strides, the head dim's too
    assert tuple(int(params[f"do_src_{n}_stride"]) for n in ("batch", "row", "head", "col")) == dout_strides
    main = rec.calls[1]["params"]
    if copy:   # the main kernel reads the contiguous copy in the workspace
        assert int(main["dout_copy"]) == 0x7700000 + ws["dout_copy"]
        assert ws["total"] - ws["dout_copy"] >= 2 * 300 * 8 * 128 * 2
        assert tuple(int(main[f"do_{n}_stride"]) for n in ("batch", "row", "head")) == \
            (300 * 8 * 128, 8 * 128, 128)
    else:
        assert int(main["dout_copy"]) == 0
        assert tuple(int(main[f"do_{n}_stride"]) for n in ("batch", "row", "head")) == dout_strides[:3]


def test_plan_refuses_a_struct_whose_pointers_do_not_lead(fake_device, monkeypatch):
    fam = registry.get("fa2_fwd")
    monkeypatch.setattr(type(fam), "pointer_fields", ("k", "q", "v", "o", "lse"))
    p = problem("fwd")
    with pytest.raises(RuntimeError, match=r"FwdParams must begin with the pointer fields"):
        fake_device(fam, fam.heuristic(p), p, _strides(p))


def test_head_group(monkeypatch):
    monkeypatch.delenv("CUFLASH_BWD_HEAD_GROUP", raising=False)
    assert head_group(pairs=16, kv_ctas=128, sms=132) == 3     # 16k: three heads, 384 CTAs
    assert head_group(pairs=128, kv_ctas=16, sms=132) == 17    # 2k
    assert head_group(pairs=4, kv_ctas=16, sms=132) == 4       # never more than there are
    assert head_group(pairs=8, kv_ctas=10 ** 6, sms=132) == 1
    monkeypatch.setenv("CUFLASH_BWD_HEAD_GROUP", "5")
    assert head_group(pairs=16, kv_ctas=128, sms=132) == 5
    assert head_group(pairs=4, kv_ctas=128, sms=132) == 4


def test_launch_spec_and_flops():
    assert LaunchSpec("main", (1, 2, 3), 128).smem == 0
    p = problem("fwd", 64, causal=False)
    f = 4.0 * 2 * 8 * 300 * 200 * 64
    assert registry.op_flops(p) == f
    assert registry.op_flops(p.replace(causal=True)) == f / 2
    assert registry.op_flops(p.replace(op="bwd")) == 2.5 * f
    assert registry.get("fa2_fwd").flops(p) == f
