"""Ahead-of-time compile checks with nvcc (no GPU needed): every instantiation the library
can pick compiles for sm_80 and sm_90a, and ptxas reports no spills for the defaults.

Each kind of check compiles all of its configs for one arch in a single nvcc call (one
source file, many explicit instantiations); the two archs compile side by side.
Run with -s to see the register / spill table and the compile times.
"""
import hashlib
import itertools
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

if shutil.which("nvcc") is None:
    pytest.skip("nvcc is not on PATH: the ahead-of-time compile tests need the CUDA toolkit "
                "(no GPU needed)", allow_module_level=True)

from cuflash import kernels  # noqa: E402
from cuflash.config import (DTYPES, MAX_SMEM_BY_ARCH, FwdConfig, bwd_kernel_head_dim,  # noqa: E402
                            default_bwd_config, default_fwd_config, valid_bwd_configs,
                            valid_fwd_configs)
from cuflash.kernels import PtxasReport, nvcc_compile, parse_ptxas, render_source, source_hash  # noqa: E402

HEAD_DIMS = range(16, 257, 16)
# cubin arch -> the compute capabilities whose heuristic configs it must build
ARCHS = {"sm_80": [(8, 0), (8, 6)], "sm_90a": [(9, 0)]}


def _compile_all(jobs):
    """{arch: configs} -> {arch: (reports, seconds)}, one nvcc call per arch, in parallel."""
    def timed(arch):
        start = time.perf_counter()
        reports = nvcc_compile(jobs[arch], arch)
        return reports, time.perf_counter() - start

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {arch: pool.submit(timed, arch) for arch in jobs}
        return {arch: future.result() for arch, future in futures.items()}


def _print_table(title, configs, reports, seconds):
    print(f"\n{title}: {len(configs)} instantiations in {seconds:.1f} s")
    print(f"  {'config':<42} {'regs':>4} {'spill st':>8} {'spill ld':>8} {'stack':>5}")
    for cfg, rep in zip(configs, reports):
        flag = "  <- spills" if rep.spill_stores or rep.spill_loads else ""
        print(f"  {cfg.name:<42} {rep.registers:>4} {rep.spill_stores:>8} {rep.spill_loads:>8} "
              f"{rep.stack_bytes:>5}{flag}")


def _check_report_matches(cfg, rep, arch):
    assert isinstance(rep, PtxasReport)
    assert rep.arch == arch, cfg.name
    # the mangled name carries the template arguments in declaration order
    assert kernels._mangled_args(rep.kernel) == cfg.template_args(), (cfg.name, rep.kernel)
    assert cfg.family in rep.kernel, (cfg.name, rep.kernel)
    assert 0 < rep.registers <= 255, (cfg.name, rep.registers)


# ---------------------------------------------------------------------------------------
# the heuristic's configs: must compile without spilling

@pytest.fixture(scope="module")
def default_builds():
    jobs = {}
    for arch, ccs in ARCHS.items():
        configs = [default_fwd_config(d, dtype, causal, cc)
                   for cc in ccs for d in HEAD_DIMS for dtype in DTYPES for causal in (False, True)]
        jobs[arch] = list(dict.fromkeys(configs))   # one instantiation each
    return jobs, _compile_all(jobs)


@pytest.mark.parametrize("arch", ARCHS)
def test_default_configs_compile_without_spills(default_builds, arch):
    jobs, built = default_builds
    configs, (reports, seconds) = jobs[arch], built[arch]
    _print_table(f"default configs, {arch}", configs, reports, seconds)
    assert len(reports) == len(configs)
    spilled = []
    for cfg, rep in zip(configs, reports):
        _check_report_matches(cfg, rep, arch)
        if rep.spill_stores or rep.spill_loads:
            spilled.append(f"{cfg.name} on {arch}: {rep.spill_stores} bytes spill stores, "
                           f"{rep.spill_loads} bytes spill loads "
                           f"({cfg.accum_regs} accumulator registers per thread)")
    assert not spilled, "default configs spill:\n" + "\n".join(spilled)


# ---------------------------------------------------------------------------------------
# the tuner's space (bf16, head dims 64 and 128): must compile; spills are only recorded

@pytest.fixture(scope="module")
def space_builds():
    jobs = {}
    for arch, ccs in ARCHS.items():
        max_smem = MAX_SMEM_BY_ARCH[ccs[0]]
        jobs[arch] = [cfg for d, causal in itertools.product((64, 128), (False, True))
                      for cfg in valid_fwd_configs(d, "bf16", causal, max_smem)]
    return jobs, _compile_all(jobs)


@pytest.mark.parametrize("arch", ARCHS)
def test_valid_space_compiles(space_builds, arch):
    jobs, built = space_builds
    configs, (reports, seconds) = jobs[arch], built[arch]
    assert configs, arch
    _print_table(f"valid bf16 configs, d64/d128, {arch}", configs, reports, seconds)
    spilling = [c.name for c, r in zip(configs, reports) if r.spill_stores or r.spill_loads]
    print(f"  {len(spilling)} of {len(configs)} spill")
    assert len(reports) == len(configs)
    for cfg, rep in zip(configs, reports):
        _check_report_matches(cfg, rep, arch)


# ---------------------------------------------------------------------------------------
# the rendered source

def test_render_source_is_self_contained():
    src = render_source("flash_fwd")
    directives = [line for line in src.splitlines() if re.match(r"\s*#\s*include\b", line)]
    assert not [d for d in directives if "<" in d], "system header included"
    assert directives == [], f"includes left un-inlined: {directives}"
    assert not re.search(r"^\s*#\s*pragma\s+once", src, re.M)


def test_render_source_inlines_each_header_once():
    src = render_source("flash_fwd")
    for header in ("ptx.cuh", "params.cuh"):
        assert src.count(f'#line 1 "{header}"') == 1, header
        first_line = (kernels.kernel_dir() / header).read_text().splitlines()[0]
        assert src.count(first_line) == 1, (header, first_line)
    assert len(re.findall(r"struct\s+FwdParams\s*\{", src)) == 1
    assert len(re.findall(r"__device__ __forceinline__ u32 smem_u32\(", src)) == 1
    # ptx.cuh (the definitions params.cuh relies on) comes before params.cuh
    assert src.index('#line 1 "ptx.cuh"') < src.index('#line 1 "params.cuh"')


def test_render_source_line_markers_point_at_the_right_lines():
    src = render_source("flash_fwd")
    lines = src.split("\n")
    assert lines[0] == '#line 1 "flash_fwd.cu"'
    assert lines[-1] == ""                                   # ends with a newline
    files = {}
    where = None
    markers = 0
    for line in lines[:-1]:
        m = re.fullmatch(r'#line (\d+) "([^"]+)"', line)
        if m:
            where = [m[2], int(m[1])]
            markers += 1
            continue
        name, lineno = where
        text = files.setdefault(name, (kernels.kernel_dir() / name).read_text().splitlines())
        expected = text[lineno - 1]
        if expected.strip() == "#pragma once":
            expected = ""
        assert line == expected, f"{name}:{lineno}: rendered {line!r}, file has {expected!r}"
        where[1] += 1
    # flash_fwd.cu (once at the top, once after each of its 3 includes), ptx.cuh,
    # params.cuh and tile.cuh (once at the top, once after their include of ptx.cuh)
    assert markers >= 8
    assert set(files) == {"flash_fwd.cu", "ptx.cuh", "params.cuh", "tile.cuh"}


def test_source_hash_stable():
    h = source_hash("flash_fwd")
    assert re.fullmatch(r"[0-9a-f]{16}", h)
    assert source_hash("flash_fwd") == h
    assert h == hashlib.sha256(render_source("flash_fwd").encode()).hexdigest()[:16]
    kernels._render.cache_clear()                            # re-read from disk
    kernels._hash.cache_clear()
    assert source_hash("flash_fwd") == h


# ---------------------------------------------------------------------------------------
# parse_ptxas

SAMPLE_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_ZN7cuflash9flash_fwdILi64ELi32ELi4ELi2ELi16ENS_4fp16ELb1EEEvNS_9FwdParamsE' for 'sm_90a'
ptxas info    : Function properties for _ZN7cuflash9flash_fwdILi64ELi32ELi4ELi2ELi16ENS_4fp16ELb1EEEvNS_9FwdParamsE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 48 registers, used 1 barriers
ptxas info    : Compile time = 62.387 ms
ptxas info    : Compiling entry function '_ZN7cuflash9flash_fwdILi128ELi128ELi4ELi3ELi64ENS_4bf16ELb0EEEvNS_9FwdParamsE' for 'sm_90a'
ptxas info    : Function properties for _ZN7cuflash9flash_fwdILi128ELi128ELi4ELi3ELi64ENS_4bf16ELb0EEEvNS_9FwdParamsE
    96 bytes stack frame, 128 bytes spill stores, 148 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 96 bytes cumulative stack size
ptxas info    : Compile time = 375.472 ms
"""


def test_parse_ptxas_sample():
    reports = parse_ptxas(SAMPLE_LOG)
    assert reports == [
        PtxasReport("sm_90a", "_ZN7cuflash9flash_fwdILi64ELi32ELi4ELi2ELi16ENS_4fp16ELb1EEEvNS_9FwdParamsE",
                    registers=48, spill_stores=0, spill_loads=0, stack_bytes=0),
        PtxasReport("sm_90a", "_ZN7cuflash9flash_fwdILi128ELi128ELi4ELi3ELi64ENS_4bf16ELb0EEEvNS_9FwdParamsE",
                    registers=255, spill_stores=128, spill_loads=148, stack_bytes=96),
    ]


def test_parse_ptxas_older_format_and_noise():
    # CUDA 11-style lines (cmem instead of barriers), warnings interleaved, no properties
    # line for the second kernel (its frame must not leak from the first).
    log = ("ptxas info    : Compiling entry function '_Z1av' for 'sm_80'\n"
           "ptxas info    : Function properties for _Z1av\n"
           "    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
           "ptxas warning : Registers are spilled to local memory in function '_Z1av', 4 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 168 registers, 464 bytes cmem[0]\n"
           "ptxas info    : Compiling entry function '_Z1bv' for 'sm_80'\n"
           "ptxas info    : Used 32 registers, 400 bytes cmem[0]\n")
    a, b = parse_ptxas(log)
    assert (a.kernel, a.arch, a.registers, a.spill_stores, a.spill_loads, a.stack_bytes) == \
        ("_Z1av", "sm_80", 168, 4, 12, 8)
    assert (b.kernel, b.registers, b.spill_stores, b.spill_loads, b.stack_bytes) == \
        ("_Z1bv", 32, 0, 0, 0)
    assert parse_ptxas("") == []
    assert parse_ptxas("nvcc warning : something unrelated\n") == []


# ---------------------------------------------------------------------------------------
# the struct layout NumPy builds (cuflash/params.py) is the one the compiler uses

@pytest.mark.parametrize("struct", ["FwdParams", "BwdParams"])
def test_params_layout_matches_nvcc(tmp_path, struct):
    from cuflash.params import struct_dtype

    dt = struct_dtype(struct)
    checks = [f"static_assert(sizeof(cuflash::{struct}) == {dt.itemsize}, \"sizeof\");"]
    checks += [f"static_assert(__builtin_offsetof(cuflash::{struct}, {name}) == {dt.fields[name][1]}, "
               f"\"offset of {name}\");" for name in dt.names]
    checks += [f"static_assert(sizeof(cuflash::{struct}::{name}) == {dt.fields[name][0].itemsize}, "
               f"\"size of {name}\");" for name in dt.names]
    src = tmp_path / "layout.cu"
    src.write_text('#include "params.cuh"\n' + "\n".join(checks) + "\n")
    proc = subprocess.run(["nvcc", "-cubin", "-arch=sm_80", "-std=c++17",
                           f"-I{kernels.kernel_dir()}", "-o", str(tmp_path / "layout.cubin"), str(src)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr + proc.stdout


def test_nvcc_compile_reports_in_config_order():
    # ptxas reports kernels in its own order; nvcc_compile must hand them back in ours.
    configs = [FwdConfig(64, 32, 4, 2, 16, "fp16", True), FwdConfig(64, 32, 4, 2, 16, "bf16", True),
               FwdConfig(64, 16, 4, 3, 32, "fp16", False)]
    for order in (configs, configs[::-1]):
        reports = nvcc_compile(order, "sm_80")
        for cfg, rep in zip(order, reports):
            _check_report_matches(cfg, rep, "sm_80")


# ---------------------------------------------------------------------------------------
# backward: the heuristic's configs for every head dim, and the tuning space (sm_90a)

BWD_HEAD_DIMS = sorted({bwd_kernel_head_dim(d) for d in range(8, 257, 8)})


@pytest.fixture(scope="module")
def bwd_builds():
    jobs = {}
    for arch, ccs in ARCHS.items():
        configs = [default_bwd_config(d, dtype, causal, cc)
                   for cc in ccs for d in BWD_HEAD_DIMS for dtype in DTYPES for causal in (False, True)]
        configs.append(default_bwd_config(128, "bf16", True, ccs[0], deterministic=True))
        if arch == "sm_90a":
            configs += [cfg for d, causal in itertools.product((64, 128), (False, True))
                        for cfg in valid_bwd_configs(d, "bf16", causal, MAX_SMEM_BY_ARCH[ccs[0]])]
        jobs[arch] = list(dict.fromkeys(configs))
    return jobs, _compile_all(jobs)


@pytest.mark.parametrize("arch", ARCHS)
def test_backward_configs_compile(bwd_builds, arch):
    """Every default backward (all head dims) and, on sm_90a, every point of the bf16 d64 /
    d128 tuning space compiles. Spills are recorded, not forbidden: see BwdConfig's notes."""
    jobs, built = bwd_builds
    configs, (reports, seconds) = jobs[arch], built[arch]
    _print_table(f"backward configs, {arch}", configs, reports, seconds)
    assert len(reports) == len(configs)
    for cfg, rep in zip(configs, reports):
        _check_report_matches(cfg, rep, arch)


def test_backward_helper_kernels_compile(tmp_path):
    """The preprocess and epilogue kernels that every backward module also instantiates."""
    src = [render_source("flash_bwd")]
    for dtype in DTYPES:
        for name in ("preprocess", "convert_dq", "reduce_dkv"):
            src.append(f"template __global__ void cuflash::flash_bwd_{name}<cuflash::{dtype}>"
                       "(const cuflash::BwdParams);")
    path = tmp_path / "helpers.cu"
    path.write_text("\n".join(src) + "\n")
    proc = subprocess.run(["nvcc", "-cubin", "-arch=sm_80", "-std=c++17", "-Xptxas", "-v",
                           "-o", str(tmp_path / "helpers.cubin"), str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    reports = parse_ptxas(proc.stderr)
    assert len(reports) == 6 and all(r.spill_stores == 0 for r in reports), proc.stderr


def test_backward_kernel_names_match_the_source():
    cfg = default_bwd_config(128, "fp16", True)
    names = cfg.kernel_names()
    assert set(names) == {"main", "preprocess", "convert_dq", "reduce_dkv"}
    src = render_source("flash_bwd")
    for name in names.values():
        assert name.split("<")[0].split("::")[1] in src


def test_kernel_dir_override_renders_an_edited_copy(tmp_path, monkeypatch):
    """CUFLASH_KERNEL_DIR points the renderer at an edited copy of kernels_cu/: its source and
    hash are the copy's (so tuned entries of the original don't apply), and unsetting it
    brings the original back."""

    original_src, original_hash = render_source("flash_bwd"), source_hash("flash_bwd")
    copy = tmp_path / "kernels"
    shutil.copytree(kernels.kernel_dir(), copy, ignore=shutil.ignore_patterns("__pycache__"))
    tile = copy / "tile.cuh"
    tile.write_text(tile.read_text() + "\n// an edit\n")
    monkeypatch.setenv("CUFLASH_KERNEL_DIR", str(copy))
    assert kernels.kernel_dir() == copy.resolve()
    assert "// an edit" in render_source("flash_bwd")
    assert source_hash("flash_bwd") != original_hash
    monkeypatch.delenv("CUFLASH_KERNEL_DIR")
    assert render_source("flash_bwd") == original_src and source_hash("flash_bwd") == original_hash


def test_kernel_dir_override_must_hold_the_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("CUFLASH_KERNEL_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="CUFLASH_KERNEL_DIR"):
        render_source("flash_fwd")
