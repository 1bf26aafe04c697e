"""From a config to a loaded kernel: the one place where a config becomes CUDA source.

Knows no family by name: a family gives its source file (``kernels_cu/<family>.cu``), its
kernels by role as C++ name expressions (``family.kernel_names(config)``) and its params
struct.

Rendering: ``render_source(name)`` reads ``kernels_cu/<name>.cu`` and inlines its local
``#include "*.cuh"`` headers, each behind a ``#line`` marker so compiler errors point at
the right file and line. The config enters only as the template arguments of the name
expressions, which NVRTC instantiates through ``cupy.RawModule(name_expressions=...)``; the
source text is the same for every config of a family.

Caching: CuPy keeps compiled modules on disk (``CUPY_CACHE_DIR``), keyed by the rendered
source and options; on top of that loaded kernels are kept in process, keyed by (config,
device, kernel directory, options).

The *code hash* (``code_hash``) stamps tuned-table entries: the SHA-256 of the rendered
source with comments, ``#line`` markers and whitespace removed, so editing a comment does
not retire a tuned table, while any change to the code does.

Switches:
  CUFLASH_DUMP_SOURCE=DIR  write each rendered source to DIR/<family>.<hash>.cu
  CUFLASH_LINEINFO=1       compile with -lineinfo (ncu source view, compute-sanitizer lines)
  CUFLASH_KERNEL_DIR=DIR   read the kernel sources from DIR instead of kernels_cu/ (an edited
                           copy: time a variant next to the original, tune it); read at import,
                           set_kernel_dir(DIR) switches in-process
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


# CUFLASH_KERNEL_DIR is read once, at import; set_kernel_dir() switches in-process (the
# hot path never reads the environment).
_override = os.environ.get("CUFLASH_KERNEL_DIR", "")
_on_change: list = []     # callables that drop caches keyed on the kernel sources


def kernel_dir() -> Path:
    """Where the kernel sources are read from: CUFLASH_KERNEL_DIR / set_kernel_dir, else kernels_cu/."""
    return _kernel_dir(_override)


def set_kernel_dir(path=None) -> Path:
    """Compile from the kernel sources in ``path`` (an edited copy of kernels_cu/) from now on;
    None goes back to kernels_cu/. Plans and choices made so far are dropped, so one script
    can time a variant next to the original. Returns the directory in force."""
    global _override
    new = str(path) if path else ""
    resolved = _kernel_dir(new)  # raises for a directory without sources; the old one stays
    _override = new
    for drop in _on_change:
        drop()
    return resolved


def on_change(drop) -> None:
    """Register ``drop()`` to run when set_kernel_dir switches the sources (cache owners)."""
    _on_change.append(drop)


@functools.lru_cache(maxsize=None)
def _kernel_dir(override: str) -> Path:
    if override:
        path = Path(override).resolve()
        if not any(path.glob("*.cu")):
            raise FileNotFoundError(f"CUFLASH_KERNEL_DIR={override!r}: expected a directory with the "
                                    f"kernel sources (*.cu and their headers)")
        return path
    from . import kernels_cu  # kernels_cu/ beside cuflash/ in a checkout, inside it installed

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


_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_LINE_MARK = re.compile(r'^\s*#line [^\n]*$', re.M)
# a space beside a character that is neither a word character nor a space: the same text as
# re.sub(r" ?([^\w ]) ?", r"\1", ...) without a template expansion per match (less
# time: strip_code of sm90_bwd's 383 kB 0.119 -> 0.041 s on the 2-core CPU host, 25.8 -> 19.6 ms on
# the H100's host, session 25 (tests/startup_parts_timing.py); it runs on the first call of a
# family that has tuned entries, for their stamps)
_PUNCT_SPACE = re.compile(r" (?=[^\w ])|(?<=[^\w ]) ")


def strip_code(source: str) -> str:
    """The code of a source: comments, #line markers and whitespace runs removed (a space
    stays only between two word characters). A newline stays where it ends a preprocessor
    directive: there it is code (``#define N 4`` then ``f();`` differs from ``#define N 4 f();``)."""
    return _PUNCT_SPACE.sub("", code_words(source)).strip().replace("\0", "\n")


def code_words(source: str) -> str:
    """strip_code before its last step: comments and #line markers removed, whitespace runs as
    one space, a directive's end marked by a NUL."""
    code = _LINE_MARK.sub("", _COMMENT.sub(" ", source))
    parts, directive = [], False
    for line in code.split("\n"):
        s = line.strip()
        if not s:
            if directive:  # a blank line ends a continued directive
                parts.append("\0")
                directive = False
            continue
        starts = directive or s.startswith("#")
        directive = starts and s.endswith("\\")
        parts.append(s + ("\0" if starts and not directive else " "))
    return re.sub(r"\s+", " ", "".join(parts))


def code_hash(family: str) -> str:
    """First 16 hex digits of the SHA-256 of the family's code (see strip_code)."""
    return _code_hash(family, kernel_dir())


@functools.lru_cache(maxsize=None)
def _code_hash(family: str, root: Path) -> str:
    return hashlib.sha256(strip_code(_render(family, root)).encode()).hexdigest()[:16]


def source_hash(family: str) -> str:
    """First 16 hex digits of the SHA-256 of the rendered source, comments included."""
    return hashlib.sha256(render_source(family).encode()).hexdigest()[:16]


def _options(arch_suffix: str = "", device_id: int = 0) -> tuple[str, ...]:
    opts = ("-std=c++17",)
    if arch_suffix:  # arch-specific instructions (wgmma, setmaxnreg) need e.g. sm_90a
        from . import _gpu

        major, minor = _gpu.arch(device_id)
        opts += (f"-arch=sm_{major}{minor}{arch_suffix}",)
    if os.environ.get("CUFLASH_LINEINFO", "") not in ("", "0"):
        opts += ("-lineinfo",)
    return opts


_loaded: dict = {}


def get_kernels(config, device_id: int) -> dict:
    """{role: cupy.RawKernel} for every kernel of ``config``'s family, compiled into one
    module, once per process (and from CuPy's disk cache across processes)."""
    from .registry import family_of

    family = family_of(config)
    options = _options(family.arch_suffix, device_id)
    key = (config, device_id, kernel_dir(), options)
    kernels = _loaded.get(key)
    if kernels is not None:
        return kernels
    import cupy

    source = render_source(family.name)
    dump = os.environ.get("CUFLASH_DUMP_SOURCE")
    if dump:
        Path(dump).mkdir(parents=True, exist_ok=True)
        (Path(dump) / f"{family.name}.{source_hash(family.name)}.cu").write_text(source)
    names = family.kernel_names(config)
    with cupy.cuda.Device(device_id):
        module = cupy.RawModule(code=source, options=options, name_expressions=list(names.values()))
        kernels = {role: module.get_function(name) for role, name in names.items()}
        for role, smem in family.smem_roles(config).items():
            if smem > 48 * 1024:  # above 48 KB, dynamic shared memory is opted into per kernel
                kernels[role].max_dynamic_shared_size_bytes = smem
        attributes = getattr(family, "kernel_attributes", None)   # e.g. a non-portable cluster size
        for role, attrs in (attributes(config) if attributes is not None else {}).items():
            from cupy_backends.cuda.api import driver

            for attr, value in attrs.items():
                driver.funcSetAttribute(kernels[role].kernel.ptr, attr, value)
    _loaded[key] = kernels
    return kernels


def get_helper_kernels(source: str, names: tuple, device_id: int) -> dict:
    """{name expression: cupy.RawKernel} for the templates ``names`` of ``kernels_cu/<source>.cu``,
    a helper kernel that no family owns (rotary.cu: elementwise, untuned, outside the registry),
    compiled into one module, once per process (and from CuPy's disk cache across processes)."""
    options = _options("", device_id)
    key = ("helper", source, tuple(names), device_id, kernel_dir(), options)
    kernels = _loaded.get(key)
    if kernels is not None:
        return kernels
    import cupy

    code = render_source(source)
    with cupy.cuda.Device(device_id):
        module = cupy.RawModule(code=code, options=options, name_expressions=list(names))
        kernels = {name: module.get_function(name) for name in names}
    _loaded[key] = kernels
    return kernels


@dataclass(frozen=True)
class HelperModule:
    """One helper module to precompile (``precompile`` takes it beside family configs): the
    source ``kernels_cu/<source>.cu`` and the name expressions ``get_helper_kernels`` loads it
    with (the same tuple, so the disk-cache key is the call's)."""
    source: str
    names: tuple

    @property
    def name(self) -> str:
        return f"{self.source}: {self.names[0]}" + (f" +{len(self.names) - 1}" if len(self.names) > 1 else "")


def get_helper_functions(source: str, names: tuple, device_id: int) -> tuple:
    """The CUfunction handles (ints, in ``names``' order) of ``get_helper_kernels``' kernels for a
    launcher that calls the driver itself (rotary.py, cross_entropy.py). A RawKernel loads its module
    on the device current when its function is first asked for, so the handles are taken with
    ``device_id`` current, whatever device the caller had."""
    import cupy

    kernels = get_helper_kernels(source, names, device_id)
    with cupy.cuda.Device(device_id):
        return tuple(kernels[name].kernel.ptr for name in names)


def _compile_one(job):
    config, device_id = job
    start = time.perf_counter()
    try:
        if isinstance(config, HelperModule):
            get_helper_kernels(config.source, config.names, device_id)
        else:
            get_kernels(config, device_id)
        return config, time.perf_counter() - start, ""
    except Exception as exc:  # noqa: BLE001 - reported to the caller, per config
        return config, time.perf_counter() - start, f"{type(exc).__name__}: {exc}"


def precompile(configs, device_id: int = 0, processes: Optional[int] = None, progress=None) -> list:
    """Compile `configs` (family configs, or ``HelperModule``s) in parallel worker processes,
    filling CuPy's on-disk cache, so that
    this process (and later ones) load them without compiling. NVRTC compiles one module at
    a time per process; a cold tuning space or test grid takes minutes serially.

    progress: called as progress(done, total, (config, seconds, error)) after each config.
    Returns [(config, seconds, error or "")] in the order given.
    """
    import multiprocessing

    configs = list(dict.fromkeys(configs))
    if not configs:
        return []
    processes = processes or min(len(configs), os.cpu_count() or 1)
    jobs = [(c, device_id) for c in configs]
    results = {}
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        for i, res in enumerate(pool.imap_unordered(_compile_one, jobs), start=1):
            results[res[0]] = res
            if progress is not None:
                progress(i, len(jobs), res)
    return [results[c] for c in configs]


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
    warnings: tuple = ()  # ptxas warnings about this kernel, and its wgmma-serialization infos


_ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(\S+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
# wgmma serialization: ptxas 13 prints C7510-C7516 and C7520 as "info", not "warning" (C7519, an
# injected warpgroup.arrive, is not a serialization and is not counted)
_SERIALIZED = re.compile(r"\(C751[0-6]\)|\(C7520\)")


def _is_serialized(line: str) -> bool:
    return bool(_SERIALIZED.search(line)) or ("serialized" in line and "(C7519)" not in line)


def parse_ptxas(log: str) -> list[PtxasReport]:
    """Per-kernel registers, spills and warnings from `nvcc -Xptxas -v` output."""
    reports, current, frame, warns = [], None, (0, 0, 0), {}
    for line in log.splitlines():
        if "ptxas" in line and ("warning" in line or _is_serialized(line)):
            names = re.findall(r"'(_Z\S+)'", line)
            for n in names or [None]:
                warns.setdefault(n, []).append(line.strip())
        if m := _ENTRY.search(line):
            current, frame = (m.group(1), m.group(2)), (0, 0, 0)
        elif (m := _FRAME.search(line)) and current:
            frame = tuple(int(x) for x in m.groups())
        elif (m := _REGS.search(line)) and current:
            reports.append(PtxasReport(current[1], current[0], int(m.group(1)),
                                       frame[1], frame[2], frame[0]))
            current = None
    if warns:
        reports = [PtxasReport(r.arch, r.kernel, r.registers, r.spill_stores, r.spill_loads,
                               r.stack_bytes, tuple(warns.get(r.kernel, []) + warns.get(None, [])))
                   for r in reports]
    return reports


def kernel_param_decl(family, role: str = "main", expr: str = "") -> str:
    """The kernels' one parameter as their template declares it, for explicit instantiation:
    ``const cuflash::<params_struct>``, or the family's ``kernel_param_decl`` where it differs
    (sm_90a families take ``const __grid_constant__ ...`` so TMA can read tensor maps in
    place; an instantiation must repeat that annotation). A family whose roles differ (sm90_bwd
    reuses fa2_bwd's kernels, which take ``const BwdParams``, a prefix of its own struct) names
    them in ``kernel_param_decls`` ({role: declaration}); one whose configs pick different kernel
    templates for one role (decode_splitkv's Hopper loop) names them by template in
    ``kernel_param_decls_by_kernel`` ({template name: declaration}), matched on ``expr``."""
    by_kernel = getattr(family, "kernel_param_decls_by_kernel", None) or {}
    if expr and expr.split("<", 1)[0].strip() in by_kernel:
        return by_kernel[expr.split("<", 1)[0].strip()]
    by_role = getattr(family, "kernel_param_decls", None) or {}
    return (by_role.get(role) or getattr(family, "kernel_param_decl", "")
            or f"const cuflash::{family.params_struct}")


def nvcc_compile(configs: Iterable, arch: str, nvcc: Optional[str] = None) -> list[PtxasReport]:
    """Compile `configs` (one family) into one cubin for `arch` (e.g. "sm_90a") with nvcc.

    Every role's kernel is instantiated; returns the main kernel's report per config, in
    the order given. Raises RuntimeError with the compiler's output if compilation fails.
    """
    from .registry import family_of

    configs = list(configs)
    if not configs:
        raise ValueError("configs: nvcc_compile needs at least one config")
    family = family_of(configs[0])
    nvcc = nvcc or os.environ.get("NVCC", "nvcc")
    lines = [render_source(family.name), '#line 1 "instantiations"']
    exprs = {e: role for c in configs for role, e in family.kernel_names(c).items()}
    lines += [f"template __global__ void {e}({kernel_param_decl(family, role, e)});" for e, role in exprs.items()]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / f"{family.name}.cu"
        src.write_text("\n".join(lines) + "\n")
        cmd = [nvcc, "-cubin", f"-arch={arch}", "-std=c++17", "-Xptxas", "-v",
               "-o", str(Path(tmp) / "out.cubin"), str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed for {arch}:\n{proc.stderr}\n{proc.stdout}")
    reports = parse_ptxas(proc.stderr + proc.stdout)
    if len(reports) != len(exprs):
        raise RuntimeError(f"expected {len(exprs)} ptxas reports, got {len(reports)}:\n{proc.stderr}")
    # ptxas reports kernels in its own order; match the main kernels to configs by their
    # template args.
    by_args = {_mangled_args(r.kernel): r for r in reports}
    return [by_args[tuple(c.template_args())] for c in configs]


def _mangled_args(mangled: str) -> tuple:
    """The template arguments (ints, bools, the element type's name) of a mangled instantiation,
    in declaration order."""
    return tuple(int(i) if i else bool(int(b)) if b else dt
                 for i, b, dt in re.findall(r"Li(\d+)E|Lb([01])E|(bf16|fp16)", mangled))
