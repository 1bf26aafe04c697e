"""From a config to a loaded kernel: the one place where a config becomes CUDA source.

Rendering: ``render_source(family)`` reads ``kernels_cu/<family>.cu`` and inlines its local
``#include "*.cuh"`` headers, each behind a ``#line`` marker so compiler errors point at
the right file and line. The config itself enters only as the template arguments of the
name expression (``FwdConfig.kernel_name()``), which NVRTC instantiates through
``cupy.RawModule(name_expressions=...)``; the source text is the same for every config.

Caching: CuPy keeps compiled modules on disk (``CUPY_CACHE_DIR``), keyed by the rendered
source and options; on top of that loaded kernels are kept in process, keyed by (config,
device, source hash).

Switches:
  CUFLASH_DUMP_SOURCE=DIR  write each rendered source to DIR/<family>.<hash>.cu
  CUFLASH_LINEINFO=1       compile with -lineinfo (ncu source view, compute-sanitizer lines)
  CUFLASH_KERNEL_DIR=DIR   read the kernel sources from DIR instead of kernels_cu/ (an edited
                           copy: time a variant next to the original, tune it); its source
                           hash differs, so tuned-table entries of the original don't apply
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels_cu"
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


def kernel_dir() -> Path:
    """Where the kernel sources are read from: CUFLASH_KERNEL_DIR if set, else kernels_cu/.
    Looked up on every launch (through source_hash), so resolved once per value."""
    return _kernel_dir(os.environ.get("CUFLASH_KERNEL_DIR", ""))


@functools.lru_cache(maxsize=None)
def _kernel_dir(override: str) -> Path:
    if override:
        path = Path(override).resolve()
        if not (path / "flash_fwd.cu").is_file():
            raise FileNotFoundError(f"CUFLASH_KERNEL_DIR={override!r}: expected a directory with the "
                                    f"kernel sources (flash_fwd.cu, flash_bwd.cu, headers)")
        return path
    if KERNEL_DIR.is_dir():
        return KERNEL_DIR
    import kernels_cu  # installed as a data package next to cuflash

    return Path(kernels_cu.__file__).resolve().parent


def render_source(family: str) -> str:
    """The full, self-contained source of one kernel family (headers inlined once each)."""
    return _render(family, kernel_dir())


@functools.lru_cache(maxsize=None)
def _render(family: str, root: Path) -> str:
    seen: set[str] = set()

    def inline(name: str) -> list[str]:
        path = root / name
        if name in seen:
            return []
        seen.add(name)
        out = [f'#line 1 "{name}"']
        for lineno, line in enumerate(path.read_text().splitlines(), start=1):
            m = _INCLUDE.match(line)
            if m:
                out += inline(m.group(1))
                out.append(f'#line {lineno + 1} "{name}"')
            elif line.strip() == "#pragma once":
                out.append("")
            else:
                out.append(line)
        return out

    return "\n".join(inline(f"{family}.cu")) + "\n"


def source_hash(family: str) -> str:
    """First 16 hex digits of the rendered source's SHA-256 (the key of compiled kernels and of
    tuned-table entries)."""
    return _hash(family, kernel_dir())


@functools.lru_cache(maxsize=None)
def _hash(family: str, root: Path) -> str:
    return hashlib.sha256(_render(family, root).encode()).hexdigest()[:16]


def _options() -> tuple[str, ...]:
    opts = ("-std=c++17",)
    if os.environ.get("CUFLASH_LINEINFO", "") not in ("", "0"):
        opts += ("-lineinfo",)
    return opts


_loaded: dict = {}


def get_kernel(config, device_id: int, role: str = "main"):
    """The compiled, loaded ``cupy.RawKernel`` for ``config`` on device ``device_id``.

    A family may launch several kernels (the backward: preprocess, main, epilogues);
    ``config.kernel_names()`` lists them by role and they are compiled into one module.
    """
    return get_kernels(config, device_id)[role]


def get_kernels(config, device_id: int) -> dict:
    """{role: cupy.RawKernel} for every kernel of ``config``, compiled once per process."""
    import cupy

    key = (config, device_id, source_hash(config.family), _options())
    kernels = _loaded.get(key)
    if kernels is not None:
        return kernels
    source = render_source(config.family)
    dump = os.environ.get("CUFLASH_DUMP_SOURCE")
    if dump:
        Path(dump).mkdir(parents=True, exist_ok=True)
        (Path(dump) / f"{config.family}.{source_hash(config.family)}.cu").write_text(source)
    names = config.kernel_names()
    with cupy.cuda.Device(device_id):
        module = cupy.RawModule(code=source, options=_options(), name_expressions=list(names.values()))
        kernels = {role: module.get_function(name) for role, name in names.items()}
        # Above 48 KB, dynamic shared memory must be opted into per kernel.
        kernels["main"].max_dynamic_shared_size_bytes = config.smem_bytes
    _loaded[key] = kernels
    return kernels


def _compile_one(job):
    import time

    config, device_id = job
    start = time.perf_counter()
    try:
        get_kernels(config, device_id)
        return config, time.perf_counter() - start, ""
    except Exception as exc:  # noqa: BLE001 - reported to the caller, per config
        return config, time.perf_counter() - start, f"{type(exc).__name__}: {exc}"


def precompile(configs, device_id: int = 0, processes: Optional[int] = None) -> list:
    """Compile `configs` in parallel worker processes, filling CuPy's on-disk cache, so that
    this process (and later ones) load them without compiling. NVRTC compiles one module at
    a time per process; a cold tuning space or test grid takes minutes serially.

    Returns [(config, seconds, error or "")] in the order given.
    """
    import multiprocessing

    configs = list(dict.fromkeys(configs))
    if not configs:
        return []
    processes = processes or min(len(configs), os.cpu_count() or 1)
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        return pool.map(_compile_one, [(c, device_id) for c in configs])


# ---------------------------------------------------------------------------------------
# Ahead-of-time check with nvcc (no GPU needed): compile instantiations, read ptxas -v.

@dataclass(frozen=True)
class PtxasReport:
    arch: str
    kernel: str           # mangled name
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int


_ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(\S+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas(log: str) -> list[PtxasReport]:
    """Per-kernel registers and spills from `nvcc -Xptxas -v` output."""
    reports, current, frame = [], None, (0, 0, 0)
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current, frame = (m.group(1), m.group(2)), (0, 0, 0)
        elif (m := _FRAME.search(line)) and current:
            frame = tuple(int(x) for x in m.groups())
        elif (m := _REGS.search(line)) and current:
            reports.append(PtxasReport(current[1], current[0], int(m.group(1)),
                                       frame[1], frame[2], frame[0]))
            current = None
    return reports


def nvcc_compile(configs: Iterable, arch: str, nvcc: Optional[str] = None) -> list[PtxasReport]:
    """Compile `configs` (one family) into one cubin for `arch` (e.g. "sm_90a") with nvcc.

    Returns one report per instantiation, in the order given. Raises RuntimeError with the
    compiler's output if compilation fails.
    """
    configs = list(configs)
    if not configs:
        raise ValueError("configs: nvcc_compile needs at least one config")
    family = configs[0].family
    nvcc = nvcc or os.environ.get("NVCC", "nvcc")
    lines = [render_source(family), '#line 1 "instantiations"']
    params = {"flash_fwd": "cuflash::FwdParams", "flash_bwd": "cuflash::BwdParams"}[family]
    lines += [f"template __global__ void {c.kernel_name()}(const {params});" for c in configs]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / f"{family}.cu"
        src.write_text("\n".join(lines) + "\n")
        cmd = [nvcc, "-cubin", f"-arch={arch}", "-std=c++17", "-Xptxas", "-v",
               "-o", str(Path(tmp) / "out.cubin"), str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed for {arch}:\n{proc.stderr}\n{proc.stdout}")
    reports = parse_ptxas(proc.stderr + proc.stdout)
    if len(reports) != len(configs):
        raise RuntimeError(f"expected {len(configs)} ptxas reports, got {len(reports)}:\n{proc.stderr}")
    # ptxas reports kernels in its own order; match them to configs by their template args.
    by_args = {_mangled_args(r.kernel): r for r in reports}
    return [by_args[_config_args(c)] for c in configs]


def _mangled_args(mangled: str) -> tuple:
    """(ints..., dtype, bools...) from a mangled template instantiation, in declaration order."""
    ints = tuple(int(x) for x in re.findall(r"Li(\d+)E", mangled))
    dtype = "bf16" if "bf16" in mangled else "fp16"
    bools = tuple(bool(int(x)) for x in re.findall(r"Lb([01])E", mangled))
    return ints + (dtype,) + bools


def _config_args(config) -> tuple:
    return config.template_args()
