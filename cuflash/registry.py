"""The one registry of kernel families.

An *op* is what a user asks for (``fwd``, ``bwd``; ``decode`` and ``combine`` are coming):
one signature, one reference, one FLOP count. A *family* is one way to implement an op on
some GPUs (``cuflash/families/<name>.py`` + ``kernels_cu/<name>.cu``). Families register
themselves when their module is imported; every module in ``cuflash/families/`` is
imported the first time the registry is asked anything, so adding a family is its ``.cu``,
its module and the ``register(...)`` line at the module's end, and nothing else changes.

The API, selection (``cuflash.select``), the torch ops, the tuner, the benchmarks and the
GPU tests all iterate this registry.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    inputs: tuple          # tensor arguments, in order
    outputs: tuple         # tensor results, in order
    flops_factor: float    # x the forward's 4·b·h·s_q·s_k·d (÷2 causal): FA convention
    doc: str = ""


OPS = {
    "fwd": Op("fwd", ("q", "k", "v"), ("out", "lse"), 1.0,
              "O = softmax(Q Kᵀ · scale [+ mask]) V and LSE"),
    "bwd": Op("bwd", ("dout", "q", "k", "v", "out", "lse"), ("dq", "dk", "dv"), 2.5,
              "dQ, dK, dV from dO and the forward's O, LSE (P recomputed)"),
}

_FAMILIES: dict = {}      # name -> Family, in registration order
_loaded = False


def register(family):
    """Add a family (an instance of a ``cuflash.families.base.Family`` subclass)."""
    if family.op not in OPS:
        raise ValueError(f"family {family.name}: unknown op {family.op!r}; ops: {sorted(OPS)}")
    if getattr(family.config_cls, "family", None) != family.name:
        raise ValueError(f"family {family.name}: its config class {family.config_cls.__name__} "
                         f"must set family = {family.name!r}")
    _FAMILIES[family.name] = family
    return family


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    pkg = importlib.import_module(f"{__package__}.families")

    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if info.name != "base" and not info.name.startswith("_"):
            importlib.import_module(f"{pkg.__name__}.{info.name}")


def families(op: str | None = None, dtype: str | None = None) -> list:
    """Registered families (of one op; taking one input dtype: ``Family.dtypes``), highest
    priority first, then registration order."""
    _load()
    fams = [f for f in _FAMILIES.values() if (op is None or f.op == op)
            and (dtype is None or dtype in getattr(f, "dtypes", ("bf16", "fp16")))]
    return sorted(fams, key=lambda f: -f.priority)


def get(name: str):
    _load()
    try:
        return _FAMILIES[name]
    except KeyError:
        raise LookupError(f"unknown kernel family {name!r}; registered: {sorted(_FAMILIES)}") from None


def family_of(config):
    """The family a config object belongs to."""
    name = getattr(type(config), "family", None)
    if not name:
        raise TypeError(f"expected a cuflash kernel config (e.g. cuflash.FwdConfig), "
                        f"got {type(config).__name__}")
    return get(name)


def op_flops(problem) -> float:
    """FlashAttention convention: 4·b·h·s_q·s_k·d (÷2 causal when s_q = s_k), x the op's factor."""
    p = problem
    f = 4.0 * p.batch * p.nheads * p.seqlen_q * p.seqlen_k * p.head_dim
    if p.causal:
        f /= 2
    return f * OPS[p.op].flops_factor
