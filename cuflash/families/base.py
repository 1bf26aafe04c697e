"""What every kernel family declares, and the config base class they share.

A *family* is one way to implement an *op* on some GPUs: one ``kernels_cu/<name>.cu``
and one module here that subclasses ``Family`` and registers an instance
(``cuflash.registry.register``). The family owns:

* its config dataclass (a ``KernelConfig``), search space (``space``), ``validate()`` rules
  (the config's ``problems()``), and heuristic (``heuristic()``);
* ``supports(arch, problem)``: '' when it can run the problem on that GPU, else why not;
* its kernels by role (``kernel_names()``) and its launch plan (``launches()``: grid,
  block, shared memory per role; ``workspace()``: scratch bytes; ``static_params()``: the
  per-shape fields of its params struct);
* its FLOP count (the op's, by default) and a ``version`` (bump it when the meaning of a
  config changes; tuned entries carry it).

Everything generic — compiling, caching, packing params, launching, selection, tuning,
benchmarks, tests — reads these declarations and never a family's name.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, ClassVar, Iterator, Mapping, Optional

from ..problem import DTYPES, Problem

# Shared memory a CTA may opt into (bytes), by compute capability; the H100's is 227 KB.
# Used when no device is at hand (the CPU compile test, the tuner's replay mode).
MAX_SMEM_BY_ARCH = {(8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 7): 163 * 1024,
                    (8, 9): 99 * 1024, (9, 0): 227 * 1024, (10, 0): 227 * 1024,
                    (12, 0): 99 * 1024}


def default_max_smem(arch) -> int:
    return MAX_SMEM_BY_ARCH.get(tuple(arch), 99 * 1024)


class ConfigError(ValueError):
    """A configuration the kernel cannot run; the message says which rule it breaks."""


class KernelConfig:
    """Base of every family's frozen config dataclass.

    A config is the single source of truth for one compiled kernel: the tuner's trial
    point, the compile-cache key, the test id and a column in ``results/``. Subclasses are
    frozen dataclasses with at least ``warps``, ``head_dim``, ``dtype``, ``causal``; they set
    ``family`` (the registered family's name) and define ``name`` and ``_problems()``.
    """

    family: ClassVar[str] = ""
    _what: ClassVar[str] = "kernel"
    dtypes: ClassVar[tuple] = DTYPES     # the input dtypes its kernels take (fp8 families: "e4m3")

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def _problems(self) -> list[str]:
        raise NotImplementedError

    def _common_problems(self, max_head_dim: int) -> list[str]:
        """The rules every mma-tiled family shares: head dim in whole 16-column tiles, 1..16 warps,
        at least two pipeline stages."""
        out = []
        if self.head_dim % 16 or not 16 <= self.head_dim <= max_head_dim:
            out.append(f"head_dim must be a multiple of 16 in 16..{max_head_dim}, got {self.head_dim}")
        if not 1 <= self.warps <= 16:
            out.append(f"warps must be in 1..16, got {self.warps}")
        if self.stages < 2:
            out.append(f"stages must be >= 2, got {self.stages}")
        return out

    def problems(self, max_smem: Optional[int] = None) -> list[str]:
        """Every rule this config breaks (empty when valid), the device's shared memory too."""
        out = []
        if self.dtype not in self.dtypes:
            out.append(f"dtype must be one of {self.dtypes}, got {self.dtype!r}")
        out += self._problems()
        smem = getattr(self, "smem_bytes", 0)
        if not out and max_smem is not None and smem > max_smem:
            out.append(f"needs {smem} bytes of shared memory, the device allows {max_smem}")
        return out

    def validate(self, max_smem: Optional[int] = None):
        problems = self.problems(max_smem)
        if problems:
            raise ConfigError(f"invalid {self._what} config {self.name}: " + "; ".join(problems))
        return self

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """One kernel launch of a plan: the role's kernel, its grid, threads and dynamic smem; cluster:
    CTAs per thread-block cluster along x (0: no cluster launch); pdl: launched as a programmatic
    dependent of the stream's previous kernel (sm_90; the kernel must wait for it before touching
    global memory: griddepcontrol.wait). Both through cuflash.launch.LaunchEx."""

    role: str
    grid: tuple
    threads: int
    smem: int = 0
    cluster: int = 0
    pdl: bool = False


class Family:
    """One kernel family (subclass it; see the module docstring)."""

    name: ClassVar[str]                  # e.g. "fa2_fwd"; also the kernels_cu/<name>.cu file
    op: ClassVar[str]                    # "fwd", "bwd", ...
    version: ClassVar[int] = 1           # in every tuned entry's stamp
    config_cls: ClassVar[type]
    space: ClassVar[Mapping[str, tuple]]  # tunable parameter -> candidate values
    fixed: ClassVar[Mapping[str, Any]] = {}  # constructor args held fixed while tuning
    params_struct: ClassVar[str]         # the params struct of kernels_cu/params.cuh
    # The per-call pointer fields: the leading fields of params_struct, in this order. The
    # op's tensors come first (in the op's order: inputs, then outputs), then the pieces
    # of the scratch workspace (``workspace()`` names them).
    pointer_fields: ClassVar[tuple]
    priority: ClassVar[int] = 0          # among families supporting a problem, highest wins
    min_arch: ClassVar[tuple] = (8, 0)
    arch_suffix: ClassVar[str] = ""      # "a" for arch-specific code (sm_90a)
    description: ClassVar[str] = ""
    # The input dtypes it runs. Selection offers a problem only to the families that list its
    # dtype, so a dtype that one family claims (fp8 "e4m3": sm90_fwd_fp8) never reaches the
    # others, whose supports() need not know of it.
    dtypes: ClassVar[tuple] = DTYPES
    # Problem.features names the family implements: compile-time flags, bool fields of its
    # config of the same names (cuflash.features); supports() refuses any other feature.
    features: ClassVar[tuple] = ()

    # ---- what it can run ----
    def supports(self, arch, problem: Problem) -> str:
        """'' when this family can run ``problem`` on a GPU of compute capability ``arch``,
        else the reason (naming the argument at fault)."""
        if tuple(arch) < tuple(self.min_arch):
            return f"{self.name} needs sm_{self.min_arch[0]}{self.min_arch[1]} or newer"
        if problem.op != self.op:
            return f"{self.name} implements op {self.op!r}, not {problem.op!r}"
        return self.feature_problem(problem)

    def feature_problem(self, problem: Problem) -> str:
        """'' when the family implements every feature of ``problem``, else which it lacks."""
        missing = [f for f in problem.features if f not in self.features]
        return f"{self.name} has no feature {missing[0]!r}" if missing else ""

    def with_features(self, config, problem: Problem):
        """``config`` with the feature flags of ``problem`` (tuned tables, heuristics and
        explicit configs carry none)."""
        if not self.features:
            return config
        from ..features import flags_of

        # only the features that are compile-time flags of the config (decode's are run-time)
        fields = {f.name for f in dataclasses.fields(config)}
        want = {f: v for f, v in flags_of(problem).items() if f in self.features and f in fields}
        if all(getattr(config, f) == v for f, v in want.items()):
            return config
        return config.replace(**want)

    def rank(self, problem: Problem) -> int:
        """Selection order for ``problem`` among the families that support it: highest first
        (ties: registration order). ``priority`` by default; a family measured faster on
        part of its range only ranks itself per problem."""
        return self.priority

    def head_dim_of(self, head_dim: int) -> int:
        """The compile-time head dim that serves a real one (rounded up)."""
        return -(-head_dim // 16) * 16

    def fits(self, config, problem: Problem) -> str:
        """'' when ``config`` (this family's) can run ``problem``, else why not."""
        if config.dtype != problem.dtype or config.causal != problem.causal \
                or config.head_dim < problem.head_dim:
            return (f"{config.name} does not fit this call (dtype {problem.dtype}, "
                    f"causal={problem.causal}, headdim {problem.head_dim})")
        return ""

    def for_problem(self, config, problem: Problem):
        """``config`` with the call's own run-time flags applied (e.g. deterministic) and
        its feature flags."""
        return self.with_features(config, problem)

    def for_bounds(self, config, problem: Problem):
        """``config`` less the flags that ``problem``'s exact run-time values (window bounds, each
        side's length) rule out. Applied to every plan (cuflash.launch.Plan), after the choice,
        which is cached per problem class and seqlen bucket and so cannot see them."""
        return config

    # ---- configs ----
    def heuristic(self, problem: Problem, arch=(9, 0), max_smem: Optional[int] = None):
        raise NotImplementedError

    def make(self, point: Mapping[str, Any], problem: Problem):
        """The config of one point of the space for ``problem``'s class (not validated)."""
        unknown, missing = set(point) - set(self.space), set(self.space) - set(point)
        if unknown or missing:
            raise ValueError(f"{self.name} parameters must be exactly {sorted(self.space)}; "
                             f"unknown {sorted(unknown)}, missing {sorted(missing)}")
        return self.with_features(
            self.config_cls(head_dim=self.head_dim_of(problem.head_dim), dtype=problem.dtype,
                            causal=bool(problem.causal), **self.fixed,
                            **{k: point[k] for k in self.space}), problem)

    def point(self, config) -> dict:
        """The tunable part of a config (what optuna and the YAML tables store)."""
        return {k: getattr(config, k) for k in self.space}

    def enumerate(self, problem: Problem, max_smem: Optional[int] = None
                  ) -> Iterator[tuple[Any, list[str]]]:
        """Every point of the space as a config, with the rules it breaks (empty: valid)."""
        keys = list(self.space)
        for values in itertools.product(*(self.space[k] for k in keys)):
            cfg = self.make(dict(zip(keys, values)), problem)
            yield cfg, cfg.problems(max_smem)

    def valid(self, problem: Problem, max_smem: Optional[int] = None) -> list:
        return [cfg for cfg, why in self.enumerate(problem, max_smem) if not why]

    def neighbours(self, config) -> list[dict]:
        """Points one step away from ``config`` in one parameter, in space order."""
        out = []
        for key, values in self.space.items():
            value = getattr(config, key)
            if value not in values:
                continue
            i = values.index(value)
            for j in (i + 1, i - 1):
                if 0 <= j < len(values):
                    out.append({**self.point(config), key: values[j]})
        return out

    def encode(self, config) -> str:
        """A config as a short string (what crosses the torch op boundary)."""
        return self.name + ":" + ",".join(f"{k}={int(v)}" for k, v in self._fields(config))

    def decode(self, text: str, dtype: str, causal: bool):
        """The config ``encode`` gave ``text`` for (its family name is checked by the caller)."""
        fields = dict(item.split("=") for item in text.split(":", 1)[1].split(","))
        bools = {f.name for f in dataclasses.fields(self.config_cls) if f.type in ("bool", bool)}
        kw = {k: bool(int(v)) if k in bools else int(v) for k, v in fields.items()}
        return self.config_cls(dtype=dtype, causal=bool(causal), **kw)

    def _fields(self, config):
        # window / softcap / ALiBi flags are not encoded: the call's features set them (for_problem)
        from ..features import KERNEL_FLAGS

        for f in dataclasses.fields(config):
            if f.name not in ("dtype", "causal") and f.name not in KERNEL_FLAGS:
                yield f.name, getattr(config, f.name)

    # ---- kernels and launches ----
    def kernel_names(self, config) -> dict:
        """{role: C++ name expression} of every kernel the config launches (one module)."""
        raise NotImplementedError

    def launches(self, config, problem: Problem, sm_count: int) -> list[LaunchSpec]:
        raise NotImplementedError

    def workspace(self, config, problem: Problem, strides: Optional[dict] = None) -> dict:
        """{pointer field: byte offset} of the scratch pieces, plus 'total' bytes. ``strides``:
        the call's (as static_params gets them), for pieces that depend on the layout; None
        asks for the layout-independent pieces (the common, contiguous case)."""
        return {"total": 0}

    def static_params(self, config, problem: Problem, strides: dict, workspace: dict,
                      softmax_scale: float, sm_count: int) -> dict:
        """The params struct's non-pointer fields for one call shape."""
        raise NotImplementedError

    def smem_roles(self, config) -> dict:
        """{role: dynamic shared memory bytes} to opt into above the 48 KB default."""
        return {"main": getattr(config, "smem_bytes", 0)}

    # ---- accounting ----
    def flops(self, problem: Problem) -> float:
        from ..registry import op_flops

        return op_flops(problem)

    def __repr__(self) -> str:
        return f"<family {self.name}: op {self.op}, sm_{self.min_arch[0]}{self.min_arch[1]}+>"
