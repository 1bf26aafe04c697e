"""Ahead-of-time compile checks with nvcc (no GPU needed), for every registered kernel family:
the instantiations the library can pick compile for sm_80 and sm_90a, and ptxas reports no
spills for the forward heuristics.

What is built, by default (a few minutes of nvcc at most, cached):
  * every family's heuristic config for every compiled head dim, on both archs (the
    (dtype, causal, deterministic) flags rotate over the head dims, so each appears);
  * the configs named by the shipped tuned tables (tuning/configs/*.yaml), for their GPU;
  * a small sample of every family's space: points that together use every value of every
    tunable parameter at least once.
With ``--nvcc-all`` (or CUFLASH_TEST_NVCC_ALL=1): the full matrix instead — every valid
point of every family's space for every head dim, dtype and mask, and every heuristic
(dtype, causal, deterministic) combination: about 4000 instantiations, half an hour of
nvcc on 2 cores.

Builds run as parallel nvcc processes (one source file, many explicit instantiations per
call). ptxas results are cached in pytest's cache directory (.pytest_cache), keyed by the
nvcc version, the arch, the full rendered source, the instantiations and the code of
cuflash.compile's nvcc_compile / parse_ptxas, so a repeat run compiles only what changed;
``-p no:cacheprovider`` or ``--cache-clear`` compiles everything again.
Run with -s to see the register / spill table and the compile times.
"""
import dataclasses
import hashlib
import inspect
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import nvcc_all
from cuflash import compile as cc, registry, select
from cuflash.compile import (PtxasReport, code_hash, kernel_dir, nvcc_compile, parse_ptxas,
                             render_source, source_hash, strip_code)
from cuflash.families.base import default_max_smem
from cuflash.problem import DTYPES, Problem

NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH: the "
                                "ahead-of-time compile tests need the CUDA toolkit (no GPU needed)")

FAMILIES = registry.families()
# cubin arch -> the compute capabilities whose heuristic configs it must build
ARCHS = {"sm_80": [(8, 0), (8, 6)], "sm_90a": [(9, 0)]}
# Families whose heuristic may spill (recorded in the table, not an error), and why.
SPILLS_ALLOWED = {
    "fa2_bwd": "its heuristic sits at the 192-register accumulator budget, where ptxas "
               "(nvcc 13.0) spills a few bytes at some head dims; measured faster than the "
               "spill-free smaller tiles (FA2Backward.heuristic)",
}
CHUNK = 16  # instantiations per nvcc call


def builds_for(family, arch):
    """Whether `family` runs on a GPU that the cubin arch `arch` is built for (sm90_fwd: sm_90a
    only)."""
    return any(not family.supports(cc, cls_problem(family, 64)) for cc in ARCHS[arch])


def family_arch_ids():
    return [pytest.param(f, a, id=f"{f.name}-{a}") for f in FAMILIES for a in ARCHS if builds_for(f, a)]


def kernel_head_dims(family):
    return sorted({family.head_dim_of(d) for d in range(8, 257, 8)})


def flag_combos():
    return list(itertools.product(DTYPES, (False, True), (False, True)))  # dtype, causal, det


def cls_problem(family, head_dim, dtype="bf16", causal=False, deterministic=False):
    return Problem(family.op, dtype, 1, 1024, 1024, 1, 1, head_dim, causal, deterministic)


def cubin_arch(cc_text):
    """nvcc arch for a compute capability '9.0' -> sm_90a (arch-specific), '8.6' -> sm_86."""
    major, minor = (int(x) for x in str(cc_text).split("."))
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


# ---------------------------------------------------------------------------------------
# what is built

def heuristic_configs(family, ccs, full):
    """The family's heuristic for every compiled head dim on every cc. Default: the flags
    rotate over the head dims; full: every flag combination at every head dim."""
    combos = flag_combos()
    out = []
    for i, d in enumerate(kernel_head_dims(family)):
        for dtype, causal, det in combos if full else [combos[i % len(combos)]]:
            p = cls_problem(family, d, dtype, causal, det)
            out += [family.for_problem(family.heuristic(p, cc), p) for cc in ccs]
    return list(dict.fromkeys(out))


def sample_candidates(family, max_smem):
    """The valid points the sample is drawn from: head dims 64 / 128, both dtypes and masks."""
    candidates = []
    for d, dtype, causal in ((64, "bf16", False), (128, "fp16", True), (64, "fp16", True),
                             (128, "bf16", False)):
        candidates += family.valid(cls_problem(family, d, dtype, causal), max_smem)
    return candidates


def space_sample(family, max_smem):
    """A few valid points of the space that together use every value of every parameter
    that some candidate uses (greedy cover, deterministic)."""
    candidates = sample_candidates(family, max_smem)
    values = lambda cfg: {(k, getattr(cfg, k)) for k in family.space}  # noqa: E731
    need = set().union(*(values(c) for c in candidates)) if candidates else set()
    chosen = []
    while need:
        best = max(candidates, key=lambda c: len(values(c) & need))
        chosen.append(best)
        need -= values(best)
    return chosen


def space_all(family, max_smem):
    return [cfg for d in kernel_head_dims(family) for dtype in DTYPES for causal in (False, True)
            for cfg in family.valid(cls_problem(family, d, dtype, causal), max_smem)]


def tuned_configs():
    """{(family name, arch): [configs]} of the shipped tables' entries, plus what was skipped."""
    out, skipped = {}, []
    for path in sorted(select.shipped_dir().glob("*.yaml")):
        tf = select.read_file(path)
        if tf.error:
            skipped.append(f"{path.name}: {tf.error}")
            continue
        arch = cubin_arch(tf.cc)
        for e in tf.entries:
            try:
                family = registry.get(e.family)
            except LookupError as exc:
                skipped.append(f"{path.name}: {exc}")
                continue
            if str(e.stamp.get("version")) != str(family.version):
                # a config of an older meaning of the family's parameters: selection ignores it
                skipped.append(f"{path.name} {e.key}: family version {e.stamp.get('version')} "
                               f"!= {family.version} (stale; re-tune)")
                continue
            cfg = family.make(e.config, cls_problem(family, e.head_dim, e.dtype, e.causal))
            out.setdefault((family.name, arch), []).append((cfg, f"{path.name} {e.key}", tf.cc))
    return out, skipped


# ---------------------------------------------------------------------------------------
# building, cached

def _impl_fingerprint():
    return hashlib.sha256((inspect.getsource(nvcc_compile) + inspect.getsource(parse_ptxas)
                           + inspect.getsource(cc._mangled_args)).encode()).hexdigest()


def _nvcc_version():
    return subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout


class Builder:
    """nvcc_compile over many configs: per-config cache, misses in parallel chunks."""

    def __init__(self, cache_dir):
        self.cache_dir = cache_dir
        self.version = _nvcc_version()
        self.impl = _impl_fingerprint()
        self.seconds = 0.0
        self.compiled = 0

    def _key(self, config, arch):
        family = registry.family_of(config)
        blob = json.dumps([self.version, self.impl, arch, render_source(family.name),
                           family.params_struct, sorted(family.kernel_names(config).items()),
                           list(map(str, config.template_args()))])
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    def _load(self, key):
        if self.cache_dir is None:
            return None
        path = self.cache_dir / f"{key}.json"
        try:
            d = json.loads(path.read_text())
            return PtxasReport(**dict(d, warnings=tuple(d["warnings"])))
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def _store(self, key, report):
        if self.cache_dir is not None:
            (self.cache_dir / f"{key}.json").write_text(json.dumps(dataclasses.asdict(report)))

    def build(self, jobs):
        """jobs: {(family name, arch): [configs]} -> {(config, arch): PtxasReport}."""
        results, misses = {}, []
        for (_, arch), configs in jobs.items():
            todo = []
            for cfg in dict.fromkeys(configs):
                key = self._key(cfg, arch)
                rep = self._load(key)
                if rep is None:
                    todo.append((cfg, key))
                else:
                    results[(cfg, arch)] = rep
            misses += [(arch, todo[i:i + CHUNK]) for i in range(0, len(todo), CHUNK)]

        def run(job):
            arch, chunk = job
            return arch, chunk, nvcc_compile([c for c, _ in chunk], arch, NVCC)

        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            for arch, chunk, reports in pool.map(run, misses):
                for (cfg, key), rep in zip(chunk, reports):
                    results[(cfg, arch)] = rep
                    self._store(key, rep)
        self.seconds += time.perf_counter() - start
        self.compiled += sum(len(chunk) for _, chunk in misses)
        return results


@pytest.fixture(scope="session")
def builder(request):
    cache = getattr(request.config, "cache", None)
    cache_dir = None
    if cache is not None:
        cache_dir = Path(cache.mkdir("cuflash_nvcc"))
    return Builder(cache_dir)


@pytest.fixture(scope="session")
def builds(request, builder):
    """Everything the build tests check, compiled in one go: {kind: {(family, arch): configs}}
    and {(config, arch): report}."""
    full = nvcc_all(request.config)
    kinds = {"heuristic": {}, "space": {}, "tuned": {}}
    for family in FAMILIES:
        for arch, ccs in ARCHS.items():
            if not builds_for(family, arch):
                continue
            ccs = [cc for cc in ccs if not family.supports(cc, cls_problem(family, 64))]
            kinds["heuristic"][(family.name, arch)] = heuristic_configs(family, ccs, full)
            smem = default_max_smem(ccs[0])
            kinds["space"][(family.name, arch)] = (space_all if full else space_sample)(family, smem)
    tuned, _ = tuned_configs()
    invalid = []
    for key, entries in tuned.items():
        kinds["tuned"][key] = []
        for cfg, where, cc_text in entries:
            why = cfg.problems(default_max_smem(tuple(int(x) for x in cc_text.split("."))))
            if why:
                invalid.append(f"{where}: {cfg.name}: {'; '.join(why)}")
            else:
                kinds["tuned"][key].append(cfg)
    jobs = {}
    for per_kind in kinds.values():
        for key, configs in per_kind.items():
            jobs.setdefault(key, []).extend(configs)
    results = builder.build(jobs)
    print(f"\nnvcc: {builder.compiled} instantiations compiled in {builder.seconds:.1f} s "
          f"({len(results) - builder.compiled} from the cache)")
    return kinds, results, invalid


def _print_table(title, configs, reports):
    print(f"\n{title}: {len(configs)} instantiations")
    print(f"  {'config':<48} {'regs':>4} {'spill st':>8} {'spill ld':>8} {'stack':>5}")
    for cfg, rep in zip(configs, reports):
        flag = "  <- spills" if rep.spill_stores or rep.spill_loads else ""
        print(f"  {cfg.name:<48} {rep.registers:>4} {rep.spill_stores:>8} {rep.spill_loads:>8} "
              f"{rep.stack_bytes:>5}{flag}")


def _check_report_matches(cfg, rep, arch):
    assert isinstance(rep, PtxasReport)
    assert rep.arch == arch, cfg.name
    # the mangled name carries the template arguments in declaration order
    assert cc._mangled_args(rep.kernel) == tuple(cfg.template_args()), (cfg.name, rep.kernel)
    assert cfg.family in rep.kernel, (cfg.name, rep.kernel)
    assert 0 < rep.registers <= 255, (cfg.name, rep.registers)


def _reports(builds, kind, family, arch):
    kinds, results, _ = builds
    configs = kinds[kind].get((family.name, arch), [])
    return configs, [results[(c, arch)] for c in configs]


# ---------------------------------------------------------------------------------------
# the build tests

@needs_nvcc
@pytest.mark.parametrize("family,arch", family_arch_ids())
def test_heuristic_configs_compile_without_spills(builds, family, arch):
    configs, reports = _reports(builds, "heuristic", family, arch)
    assert configs, (family.name, arch)
    # every compiled head dim is covered
    assert {c.head_dim for c in configs} == set(kernel_head_dims(family))
    _print_table(f"{family.name} heuristic configs, {arch}", configs, reports)
    spilled = []
    for cfg, rep in zip(configs, reports):
        _check_report_matches(cfg, rep, arch)
        if rep.spill_stores or rep.spill_loads:
            spilled.append(f"{cfg.name} on {arch}: {rep.spill_stores} bytes spill stores, "
                           f"{rep.spill_loads} bytes spill loads "
                           f"({cfg.accum_regs} accumulator registers per thread)")
    if family.name in SPILLS_ALLOWED:
        print(f"  {len(spilled)} spill (allowed: {SPILLS_ALLOWED[family.name]})")
    else:
        assert not spilled, "heuristic configs spill:\n" + "\n".join(spilled)


@needs_nvcc
@pytest.mark.parametrize("family,arch", family_arch_ids())
def test_space_compiles(builds, request, family, arch):
    configs, reports = _reports(builds, "space", family, arch)
    assert configs, (family.name, arch)
    what = "every valid point" if nvcc_all(request.config) else "a sample"
    _print_table(f"{family.name} space ({what}), {arch}", configs, reports)
    if not nvcc_all(request.config):  # the sample uses every value of every parameter
        candidates = sample_candidates(family, default_max_smem(ARCHS[arch][0]))
        for key in family.space:
            assert {getattr(c, key) for c in configs} == {getattr(c, key) for c in candidates}, key
    spilling = [c.name for c, r in zip(configs, reports) if r.spill_stores or r.spill_loads]
    print(f"  {len(spilling)} of {len(configs)} spill")
    for cfg, rep in zip(configs, reports):
        _check_report_matches(cfg, rep, arch)


@needs_nvcc
def test_tuned_table_configs_compile(builds):
    """Every config the shipped tuned tables name is valid for its GPU and compiles for it."""
    kinds, results, invalid = builds
    _, skipped = tuned_configs()
    for why in skipped:
        print(f"  skipped {why}")
    assert not invalid, "tuned tables name invalid configs:\n" + "\n".join(invalid)
    tuned = {k: v for k, v in kinds["tuned"].items() if v}
    if not tuned:
        pytest.skip("no readable tuned table entries in tuning/configs/"
                    + (f" ({'; '.join(skipped)})" if skipped else ""))
    for (name, arch), configs in tuned.items():
        configs = list(dict.fromkeys(configs))
        reports = [results[(c, arch)] for c in configs]
        _print_table(f"{name} tuned configs, {arch}", configs, reports)
        for cfg, rep in zip(configs, reports):
            _check_report_matches(cfg, rep, arch)


@needs_nvcc
def test_nvcc_compile_reports_in_config_order():
    # ptxas reports kernels in its own order; nvcc_compile must hand them back in ours.
    fam = registry.get("fa2_fwd")
    configs = [fam.config_cls(64, 32, 4, 2, 16, "fp16", True), fam.config_cls(64, 32, 4, 2, 16, "bf16", True),
               fam.config_cls(64, 16, 4, 3, 32, "fp16", False)]
    for order in (configs, configs[::-1]):
        reports = nvcc_compile(order, "sm_80")
        assert len(reports) == len(order)
        for cfg, rep in zip(order, reports):
            _check_report_matches(cfg, rep, "sm_80")


def test_nvcc_compile_needs_configs():
    with pytest.raises(ValueError, match="^configs: "):
        nvcc_compile([], "sm_80")


@needs_nvcc
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_helper_kernels_compile_without_spills(tmp_path, family):
    """The kernels of a family's other roles (the backward's preprocess and epilogues), for
    both dtypes: they compile and do not spill."""
    exprs = {}
    for dtype in DTYPES:
        cfg = family.heuristic(cls_problem(family, 64, dtype))
        exprs.update({e: role for role, e in family.kernel_names(cfg).items() if role != "main"})
    if not exprs:
        pytest.skip(f"{family.name} has a main kernel only")
    src = [render_source(family.name)]
    src += [f"template __global__ void {e}({cc.kernel_param_decl(family, role)});" for e, role in exprs.items()]
    path = tmp_path / "helpers.cu"
    path.write_text("\n".join(src) + "\n")
    proc = subprocess.run([NVCC, "-cubin", "-arch=sm_80", "-std=c++17", "-Xptxas", "-v",
                           "-o", str(tmp_path / "helpers.cubin"), str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    reports = parse_ptxas(proc.stderr)
    assert len(reports) == len(exprs), proc.stderr
    assert all(r.spill_stores == 0 and r.spill_loads == 0 for r in reports), proc.stderr


# ---------------------------------------------------------------------------------------
# the rendered source

def _local_includes(name, seen=None):
    """Every file reached from `name` through local #include "..." lines, `name` first."""
    seen = [] if seen is None else seen
    if name in seen:
        return seen
    seen.append(name)
    for line in (kernel_dir() / name).read_text().splitlines():
        m = re.match(r'^\s*#\s*include\s+"([^"]+)"\s*$', line)
        if m:
            _local_includes(m.group(1), seen)
    return seen


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_render_source_is_self_contained(family):
    src = render_source(family.name)
    directives = [line for line in src.splitlines() if re.match(r"\s*#\s*include\b", line)]
    assert not [d for d in directives if "<" in d], "system header included"
    assert directives == [], f"includes left un-inlined: {directives}"
    assert not re.search(r"^\s*#\s*pragma\s+once", src, re.M)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_render_source_inlines_each_header_once(family):
    src = render_source(family.name)
    files = _local_includes(f"{family.name}.cu")
    assert "params.cuh" in files and "ptx.cuh" in files
    for header in files[1:]:
        assert src.count(f'#line 1 "{header}"') == 1, header
    first_line = (kernel_dir() / "ptx.cuh").read_text().splitlines()[0]
    assert src.count(first_line) == 1, first_line
    assert len(re.findall(r"struct\s+" + family.params_struct + r"\s*(?::\s*\w+\s*)?\{", src)) == 1
    assert len(re.findall(r"__device__ __forceinline__ u32 smem_u32\(", src)) == 1
    # ptx.cuh (the definitions params.cuh relies on) comes before params.cuh
    assert src.index('#line 1 "ptx.cuh"') < src.index('#line 1 "params.cuh"')


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_render_source_line_markers_point_at_the_right_lines(family):
    src = render_source(family.name)
    lines = src.split("\n")
    assert lines[0] == f'#line 1 "{family.name}.cu"'
    assert lines[-1] == ""                                   # ends with a newline
    files, where, markers = {}, None, 0
    for line in lines[:-1]:
        m = re.fullmatch(r'#line (\d+) "([^"]+)"', line)
        if m:
            where = [m[2], int(m[1])]
            markers += 1
            continue
        name, lineno = where
        text = files.setdefault(name, (kernel_dir() / name).read_text().splitlines())
        expected = text[lineno - 1]
        if expected.strip() == "#pragma once":
            expected = ""
        assert line == expected, f"{name}:{lineno}: rendered {line!r}, file has {expected!r}"
        where[1] += 1
    # every file reached by #include is rendered, and each file gets a marker at its top and
    # after each of its includes
    assert set(files) == set(_local_includes(f"{family.name}.cu"))
    assert markers >= 2 * len(files)


# ---------------------------------------------------------------------------------------
# source_hash and code_hash

def _clear_caches():
    cc._render.cache_clear()                              # re-read from disk
    cc._code_hash.cache_clear()


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_source_hash_and_code_hash_stable(family):
    h, c = source_hash(family.name), code_hash(family.name)
    assert re.fullmatch(r"[0-9a-f]{16}", h) and re.fullmatch(r"[0-9a-f]{16}", c)
    assert source_hash(family.name) == h and code_hash(family.name) == c
    assert h == hashlib.sha256(render_source(family.name).encode()).hexdigest()[:16]
    assert c == hashlib.sha256(strip_code(render_source(family.name)).encode()).hexdigest()[:16]
    _clear_caches()
    assert source_hash(family.name) == h and code_hash(family.name) == c


def test_strip_code():
    src = ('#line 1 "a.cu"\n// a comment\nint  f( int x ) {  /* block\n comment */ return x+1; }\n'
           "#define N 4\nconst int y = N ;\n")
    assert strip_code(src) == "int f(int x){return x+1;}#define N 4\nconst int y=N;"
    # whitespace between two words stays (a single space), elsewhere it goes
    assert strip_code("unsigned   int\n\tx ;") == "unsigned int x;"
    # a newline ends a preprocessor directive: moving code into one is a code change
    assert strip_code("#define N 4\nfoo();") != strip_code("#define N 4 foo();")
    assert strip_code("#define N(a) \\\n  (a + 1)\nfoo();") == "#define N(a)\\(a+1)\nfoo();"


@pytest.fixture
def kernel_copy(tmp_path):
    """An editable copy of the kernel sources, made current with set_kernel_dir; yields
    (copy, back) where back() returns to the sources in force before (also at teardown)."""
    previous = cc._override or None
    copy = tmp_path / "kernels"
    shutil.copytree(kernel_dir(), copy, ignore=shutil.ignore_patterns("__pycache__"))
    cc.set_kernel_dir(copy)
    back = lambda: cc.set_kernel_dir(previous)  # noqa: E731
    try:
        yield copy, back
    finally:
        back()


def _edit(path, old, new, count=1):
    text = path.read_text()
    assert old in text, (path.name, old)
    path.write_text(text.replace(old, new, count))


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_code_hash_ignores_comments_and_whitespace(request, family):
    """Editing comments, blank lines or indentation changes source_hash but not code_hash,
    so a tuned table survives a comment fix."""
    original_src, original_code = source_hash(family.name), code_hash(family.name)
    copy, back = request.getfixturevalue("kernel_copy")
    main = copy / f"{family.name}.cu"
    text = main.read_text()
    # a new comment, a reworded one, blank lines, re-indented code and a line reflowed
    text = "// a new first line\n\n" + text.replace("namespace cuflash {", "namespace  cuflash\n{", 1)
    text = re.sub(r"^(    )(\S)", r"\1  \2", text, count=20, flags=re.M)
    text = text.replace("//", "//  reworded:", 3)
    main.write_text(text + "\n/* a block\n   comment */\n\n")
    _edit(copy / "params.cuh", "struct FwdParams {", "struct FwdParams {  // edited comment")
    assert source_hash(family.name) != original_src
    assert code_hash(family.name) == original_code
    back()
    assert source_hash(family.name) == original_src and code_hash(family.name) == original_code


@pytest.mark.parametrize("edit", ["constant", "header", "operator"])
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_code_hash_changes_with_the_code(request, family, edit):
    original = code_hash(family.name)
    copy, back = request.getfixturevalue("kernel_copy")
    if edit == "constant":
        _edit(copy / f"{family.name}.cu", "namespace cuflash {",
              "namespace cuflash {\nconstexpr int kUnused = 1;")
    elif edit == "header":      # a header every family includes
        _edit(copy / "params.cuh", "    int nheads;", "    int nheads_;")
    else:                       # one character of code, no whitespace involved
        text = (copy / "ptx.cuh").read_text()
        i = text.index("smem_u32(")
        (copy / "ptx.cuh").write_text(text[:i] + "smem_u33(" + text[i + len("smem_u32("):])
    assert code_hash(family.name) != original
    back()
    assert code_hash(family.name) == original


# ---------------------------------------------------------------------------------------
# parse_ptxas

SAMPLE_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_ZN7cuflash7fa2_fwdILi64ELi32ELi4ELi2ELi16ENS_4fp16ELb1EEEvNS_9FwdParamsE' for 'sm_90a'
ptxas info    : Function properties for _ZN7cuflash7fa2_fwdILi64ELi32ELi4ELi2ELi16ENS_4fp16ELb1EEEvNS_9FwdParamsE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 48 registers, used 1 barriers
ptxas info    : Compile time = 62.387 ms
ptxas info    : Compiling entry function '_ZN7cuflash7fa2_fwdILi128ELi128ELi4ELi3ELi64ENS_4bf16ELb0EEEvNS_9FwdParamsE' for 'sm_90a'
ptxas info    : Function properties for _ZN7cuflash7fa2_fwdILi128ELi128ELi4ELi3ELi64ENS_4bf16ELb0EEEvNS_9FwdParamsE
    96 bytes stack frame, 128 bytes spill stores, 148 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 96 bytes cumulative stack size
ptxas info    : Compile time = 375.472 ms
"""


def test_parse_ptxas_sample():
    reports = parse_ptxas(SAMPLE_LOG)
    assert reports == [
        PtxasReport("sm_90a", "_ZN7cuflash7fa2_fwdILi64ELi32ELi4ELi2ELi16ENS_4fp16ELb1EEEvNS_9FwdParamsE",
                    registers=48, spill_stores=0, spill_loads=0, stack_bytes=0),
        PtxasReport("sm_90a", "_ZN7cuflash7fa2_fwdILi128ELi128ELi4ELi3ELi64ENS_4bf16ELb0EEEvNS_9FwdParamsE",
                    registers=255, spill_stores=128, spill_loads=148, stack_bytes=96),
    ]
    assert cc._mangled_args(reports[0].kernel) == (64, 32, 4, 2, 16, "fp16", True)
    assert cc._mangled_args("_ZN7cuflash7fa2_bwdILi64ELi128ELi8ELi2ELi1ELi2ELi128ENS_4bf16ELb0ELb1EEEvNS_9BwdParamsE") \
        == (64, 128, 8, 2, 1, 2, 128, "bf16", False, True)


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
    # the warning names kernel a: it is a's, not b's
    assert len(a.warnings) == 1 and "spilled" in a.warnings[0] and b.warnings == ()
    assert parse_ptxas("") == []
    assert parse_ptxas("nvcc warning : something unrelated\n") == []


def test_parse_ptxas_counts_serialization_infos():
    # ptxas 13 prints wgmma serialization (C7510-C7516, C7520) as "info": it counts as a warning of
    # the kernel it names; C7519 (an injected warpgroup.arrive) does not
    log = ("ptxas info    : Compiling entry function '_Z1av' for 'sm_90a'\n"
           "ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are "
           "serialized due to the presence of Extern calls in the function '_Z1av'\n"
           "ptxas info    : Used 168 registers\n"
           "ptxas info    : Compiling entry function '_Z1bv' for 'sm_90a'\n"
           "ptxas info    : (C7519) Potential Performance Loss: warpgroup.arrive injected in '_Z1bv'\n"
           "ptxas info    : Used 90 registers\n")
    a, b = parse_ptxas(log)
    assert len(a.warnings) == 1 and "C7515" in a.warnings[0]
    assert b.warnings == ()


# ---------------------------------------------------------------------------------------
# the struct layout NumPy builds (cuflash/launch.py) is the one the compiler uses

@needs_nvcc
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_params_layout_matches_nvcc(tmp_path, family):
    from cuflash.launch import struct_dtype

    struct = family.params_struct
    dt = struct_dtype(struct)
    checks = [f"static_assert(sizeof(cuflash::{struct}) == {dt.itemsize}, \"sizeof\");"]
    checks += [f"static_assert(__builtin_offsetof(cuflash::{struct}, {name}) == {dt.fields[name][1]}, "
               f"\"offset of {name}\");" for name in dt.names]
    checks += [f"static_assert(sizeof(cuflash::{struct}::{name}) == {dt.fields[name][0].itemsize}, "
               f"\"size of {name}\");" for name in dt.names]
    src = tmp_path / "layout.cu"
    headers = ["params.cuh"] + sorted(p.name for p in kernel_dir().glob("params_*.cuh"))
    src.write_text("".join(f'#include "{h}"\n' for h in headers) + "\n".join(checks) + "\n")
    proc = subprocess.run([NVCC, "-cubin", "-arch=sm_80", "-std=c++17",
                           f"-I{kernel_dir()}", "-o", str(tmp_path / "layout.cubin"), str(src)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr + proc.stdout


# ---------------------------------------------------------------------------------------
# CUFLASH_KERNEL_DIR

def test_kernel_dir_override_renders_an_edited_copy(request):
    """set_kernel_dir points the renderer at an edited copy of kernels_cu/: its source and
    hashes are the copy's (so tuned entries of the original don't apply), caches keyed on the
    sources are dropped, and going back brings the original back."""
    name = "fa2_bwd"
    original_dir = kernel_dir()
    original_src, original_hash = render_source(name), source_hash(name)
    original_code = code_hash(name)
    dropped = []
    cc.on_change(lambda: dropped.append(True))
    try:
        copy, back = request.getfixturevalue("kernel_copy")
        tile = copy / "tile.cuh"
        tile.write_text(tile.read_text() + "\n// an edit\nconstexpr int kEdit = 1;\n")
        assert kernel_dir() == copy.resolve() and dropped
        assert "// an edit" in render_source(name)
        assert source_hash(name) != original_hash and code_hash(name) != original_code
        assert select.current_stamp(registry.get(name))["code_hash"] == code_hash(name)
        back()
        assert kernel_dir() == original_dir
        assert render_source(name) == original_src and source_hash(name) == original_hash
        assert code_hash(name) == original_code
    finally:
        cc._on_change.pop()


def test_kernel_dir_override_must_hold_the_sources(tmp_path):
    before = kernel_dir()
    with pytest.raises(FileNotFoundError, match="CUFLASH_KERNEL_DIR"):
        cc.set_kernel_dir(tmp_path)
    assert kernel_dir() == before          # a bad directory leaves the sources in force
    assert render_source("fa2_fwd")


def test_kernel_dir_env_is_read_at_import(tmp_path):
    """CUFLASH_KERNEL_DIR=DIR in the environment: a fresh process compiles from DIR."""
    copy = tmp_path / "kernels"
    shutil.copytree(kernel_dir(), copy, ignore=shutil.ignore_patterns("__pycache__"))
    code = "from cuflash import compile as c; print(c.kernel_dir()); print(c.source_hash('fa2_fwd'))"
    env = dict(os.environ, CUFLASH_KERNEL_DIR=str(copy))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(copy.resolve()), source_hash("fa2_fwd")]
