"""Host mirror of the kernels' argument structs (kernels_cu/params.cuh).

The field list is read from the C++ header itself, so the struct has a single definition.
A NumPy record of the matching (aligned, C) layout is what CuPy passes by value to the
kernel.
"""
from __future__ import annotations

import functools
import re

import numpy as np

from .kernels import kernel_dir

_CTYPES = {"const void*": np.uint64, "void*": np.uint64, "const float*": np.uint64,
           "float*": np.uint64, "int*": np.uint64,
           "i64": np.int64, "int": np.int32, "float": np.float32}
_FIELD = re.compile(r"^\s*(const void\*|void\*|const float\*|float\*|int\*|i64|int|float)\s+(\w+);")


@functools.lru_cache(maxsize=None)
def struct_dtype(name: str) -> np.dtype:
    """NumPy dtype laid out like `struct <name>` in params.cuh (C alignment rules)."""
    text = (kernel_dir() / "params.cuh").read_text()
    m = re.search(r"struct\s+" + name + r"\s*\{(.*?)\};", text, re.S)
    if not m:
        raise KeyError(f"struct {name} not found in params.cuh")
    fields = []
    for line in m.group(1).splitlines():
        line = line.split("//")[0]
        if not line.strip():
            continue
        fm = _FIELD.match(line)
        if not fm:
            raise ValueError(f"params.cuh: cannot mirror field line {line.strip()!r} of {name}")
        fields.append((fm.group(2), _CTYPES[fm.group(1)]))
    return np.dtype(fields, align=True)


def pack(name: str, **values) -> np.ndarray:
    """A one-element record array of struct `name`, every field given exactly once."""
    dtype = struct_dtype(name)
    missing = set(dtype.names) - set(values)
    extra = set(values) - set(dtype.names)
    if missing or extra:
        raise TypeError(f"struct {name}: missing fields {sorted(missing)}, unknown {sorted(extra)}")
    return np.array([tuple(values[name] for name in dtype.names)], dtype=dtype)
