"""Which family and config run a problem: tuned table for this GPU, else the heuristic.

Order of choice:
1. ``config=`` given by the caller: its family, checked against the problem and device;
2. else the highest-ranked registered family of the op (``Family.rank(problem)``, its
   ``priority`` unless it ranks per problem) whose ``supports(arch, problem)`` says yes, with
   a. the tuned entry for (op, family, dtype, head dim, causal, features, seqlen bucket) of
      this GPU (exact bucket first, then the nearest), if it is not stale;
   b. else the family's heuristic.

Tuned tables are YAML, one file per GPU, named after it (``file_name``)::

    format: 2
    gpu: {name: NVIDIA H100 80GB HBM3, cc: '9.0'}
    entries:
    - key: {op: fwd, family: fa2_fwd, dtype: bf16, head_dim: 128, causal: true,
            features: [], seqlen: 4096}
      config: {Br: 128, Bc: 64, warps: 4, stages: 2}
      stamp: {version: 1, code_hash: 3f2a...}
      median_ms: 0.95
      tflops: 290.1
      runners_up: [...]
      note: '...'
      env: {...}

A table may also carry ``rules``: a family's heuristic rule parameters for this GPU, for families
whose heuristic takes them (``Family.heuristic_for_device``; decode_splitkv's: which loop, its
warps, the split rule), each with the problems it applies to::

    rules:
    - family: decode_splitkv
      match: {batch: [1, 1], seqlen_k: [0, 131072], paged: false}
      set: {regs: 0}
      note: 'H100, session 22: ...'

A rule applies only where no tuned entry does (it refines the heuristic): the first rule of the
family whose ``match`` holds for the problem (files in search order, rules in file order) gives
the heuristic its parameters; a malformed rule, or one whose parameters give no valid config,
is ignored with one warning per file.

An entry is stale when its family's ``version`` or the hash of the family's code (comments
and whitespace removed: ``cuflash.compile.code_hash``) differs from the running one;
stale and malformed entries are ignored with one warning per file, never an exception.

Only this GPU's files are read — ``$CUFLASH_TUNED_DIR`` (default ``~/.cache/cuflash/tuned``,
where ``python -m cuflash tune`` writes) before the shipped ``tuning/configs/`` — lazily,
on the first call that needs a config, with libyaml's C loader when it is there. A parsed copy
of each table (JSON, named by the table text's hash) is kept in ``$CUFLASH_CACHE_DIR/tables``
(default ``~/.cache/cuflash/tables``; CUFLASH_CACHE_DIR set empty: none), so a later process's
first call reads that instead of parsing the YAML (``parse_table``).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Optional

from .problem import SEQLEN_BUCKETS, Problem, seqlen_bucket
from .registry import families, family_of, get

log = logging.getLogger("cuflash")

FORMAT = 2
ENV_VAR = "CUFLASH_TUNED_DIR"
CACHE_ENV_VAR = "CUFLASH_CACHE_DIR"   # parsed copies of the tables (parse_table)


class TunedTableWarning(UserWarning):
    """A tuned table that cannot be used as it stands (stale or corrupt)."""


class UnsupportedProblem(ValueError):
    """No registered family can run this call; the message names the argument at fault."""


# ---------------------------------------------------------------------------------------
# files

def cc_str(cc) -> str:
    """Compute capability as 'major.minor': accepts (9, 0), '9.0', '90' or 9.0."""
    if isinstance(cc, (tuple, list)):
        return f"{int(cc[0])}.{int(cc[1])}"
    s = str(cc)
    if "." in s:
        major, minor = s.split(".", 1)
        return f"{int(major)}.{int(minor)}"
    return f"{int(s[:-1])}.{int(s[-1])}"


def file_name(gpu_name: str, cc) -> str:
    """A readable file name for one GPU's table, e.g. NVIDIA_H100_80GB_HBM3_sm90.yaml."""
    stem = re.sub(r"[^A-Za-z0-9]+", "_", gpu_name).strip("_") or "gpu"
    return f"{stem}_sm{cc_str(cc).replace('.', '')}.yaml"


def user_dir() -> Path:
    env = os.environ.get(ENV_VAR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "cuflash" / "tuned"


def shipped_dir() -> Path:
    """tuning/configs/, found without importing the tuner."""
    spec = importlib.util.find_spec("cuflash.tuning")
    return Path(list(spec.submodule_search_locations)[0]) / "configs"


def table_dirs() -> list[Path]:
    """Where tuned tables are looked for, first match wins: user cache, then shipped."""
    return [user_dir(), shipped_dir()]


@dataclasses.dataclass
class Entry:
    """One tuned result: its key, the winning config's parameters and how it was measured."""

    op: str
    family: str
    dtype: str
    head_dim: int
    causal: bool
    seqlen: int
    config: dict
    features: tuple = ()
    stamp: dict = dataclasses.field(default_factory=dict)
    median_ms: Optional[float] = None
    tflops: Optional[float] = None
    runners_up: list = dataclasses.field(default_factory=list)
    env: dict = dataclasses.field(default_factory=dict)
    note: str = ""           # why the config is not the fastest measured ('' when it is)

    @property
    def key(self) -> tuple:
        return (self.op, self.family, self.dtype, self.head_dim, self.causal, self.features, self.seqlen)

    def to_dict(self) -> dict:
        d = {"key": {"op": self.op, "family": self.family, "dtype": self.dtype,
                     "head_dim": self.head_dim, "causal": self.causal,
                     "features": list(self.features), "seqlen": self.seqlen},
             "config": dict(self.config), "stamp": dict(self.stamp), "median_ms": self.median_ms,
             "tflops": self.tflops, "runners_up": list(self.runners_up), "env": dict(self.env)}
        if self.note:
            d["note"] = self.note
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Entry":
        """Raises (KeyError, TypeError, ValueError) on a malformed record."""
        key = d["key"]
        if not isinstance(d["config"], dict) or not isinstance(d.get("stamp", {}), dict):
            raise TypeError("config and stamp must be mappings")
        causal = key["causal"]
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be true or false, got {causal!r}")
        return cls(op=str(key["op"]), family=str(key["family"]), dtype=str(key["dtype"]),
                   head_dim=int(key["head_dim"]), causal=causal, seqlen=int(key["seqlen"]),
                   features=tuple(sorted(str(f) for f in key.get("features") or ())),
                   config=dict(d["config"]), stamp=dict(d.get("stamp") or {}),
                   median_ms=None if d.get("median_ms") is None else float(d["median_ms"]),
                   tflops=None if d.get("tflops") is None else float(d["tflops"]),
                   runners_up=list(d.get("runners_up") or []), env=dict(d.get("env") or {}),
                   note=str(d.get("note") or ""))


@dataclasses.dataclass
class TunedFile:
    path: Path
    gpu_name: str = ""
    cc: str = ""
    entries: list = dataclasses.field(default_factory=list)
    error: str = ""          # why the whole file is unusable ('' when readable)
    bad_entries: list = dataclasses.field(default_factory=list)  # (index, reason)
    rules: list = dataclasses.field(default_factory=list)        # Rule, in file order
    bad_rules: list = dataclasses.field(default_factory=list)    # (index, reason)


@dataclasses.dataclass
class Rule:
    """One device rule: ``family``'s heuristic parameters (``set``) for the problems ``match``
    describes (the family reads both: ``Family.heuristic_for_device``)."""

    family: str
    set: dict
    match: dict = dataclasses.field(default_factory=dict)
    note: str = ""

    def to_dict(self) -> dict:
        d = {"family": self.family, "match": dict(self.match), "set": dict(self.set)}
        if self.note:
            d["note"] = self.note
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Rule":
        """Raises (KeyError, TypeError) on a malformed record."""
        match, params = d.get("match") or {}, d["set"]
        if not isinstance(match, dict) or not isinstance(params, dict) or not params:
            raise TypeError("match must be a mapping and set a non-empty mapping")
        return cls(family=str(d["family"]), set=dict(params), match=dict(match), note=str(d.get("note") or ""))


def _yaml_load(text: str):
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(text, Loader=loader)


def parsed_dir() -> Optional[Path]:
    """Where parsed copies of tuned tables are kept: ``$CUFLASH_CACHE_DIR/tables`` (default
    ``~/.cache/cuflash/tables``); None when CUFLASH_CACHE_DIR is set empty (no copies)."""
    env = os.environ.get(CACHE_ENV_VAR)
    if env is None:
        return Path.home() / ".cache" / "cuflash" / "tables"
    return Path(env).expanduser() / "tables" if env else None


def parse_table(text: str):
    """The data of a table's YAML text, from its parsed copy where one is kept (JSON, named by the
    text's SHA-256, so an edited table is parsed anew), else parsed, and the copy written where
    JSON gives back exactly the same data. Parsing the shipped H100 table takes longer than the
    rest of a warm first call's selection (PyYAML with libyaml: 0.2 s on the 2-core CPU host,
    0.006 s from JSON; session 25): the copy is what a later process reads."""
    import hashlib
    import json

    where = parsed_dir()
    copy = None if where is None else where / (hashlib.sha256(text.encode()).hexdigest()[:32] + ".json")
    if copy is not None:
        try:
            data = json.loads(copy.read_text())
            if isinstance(data, dict):
                return data
        except (OSError, ValueError):   # none yet, or unreadable: parse the YAML
            pass
    data = _yaml_load(text)
    if copy is not None:
        tmp = copy.with_name(f"{copy.name}.{os.getpid()}.tmp")
        try:
            dumped = json.dumps(data)
            if json.loads(dumped) == data:   # (dates, non-string keys: no copy)
                copy.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_text(dumped)
                os.replace(tmp, copy)       # whole or not at all, for a process reading it
        except (OSError, TypeError, ValueError):
            pass
        finally:
            if tmp.exists():
                tmp.unlink(missing_ok=True)
    return data


def read_file(path) -> TunedFile:
    """Parse one YAML table. Never raises: problems go into ``.error`` / ``.bad_entries``."""
    path = Path(path)
    out = TunedFile(path)
    try:
        data = parse_table(path.read_text())
    except Exception as exc:  # noqa: BLE001 - named below; yaml is imported only to parse
        yaml = sys.modules.get("yaml")
        if not isinstance(exc, (OSError, UnicodeDecodeError)) and not (
                yaml is not None and isinstance(exc, yaml.YAMLError)):
            raise
        out.error = f"cannot be read as YAML ({exc.__class__.__name__}: {str(exc)[:200]})"
        return out
    try:
        if not isinstance(data, dict):
            raise TypeError("the top level must be a mapping")
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, this cuflash reads format {FORMAT} "
                             "(re-tune with python -m cuflash tune)")
        gpu = data["gpu"]
        out.gpu_name, out.cc = str(gpu["name"]), cc_str(gpu["cc"])
        records = data.get("entries") or []
        if not isinstance(records, list):
            raise TypeError("entries must be a list")
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        out.error = f"is not a tuned table ({exc.__class__.__name__}: {exc})"
        return out
    for i, rec in enumerate(records):
        try:
            out.entries.append(Entry.from_dict(rec))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            out.bad_entries.append((i, f"{exc.__class__.__name__}: {exc}"))
    rules = data.get("rules") or []
    for i, rec in enumerate(rules if isinstance(rules, list) else [rules]):
        try:
            if not isinstance(rules, list):
                raise TypeError("rules must be a list")
            out.rules.append(Rule.from_dict(rec))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            out.bad_rules.append((i, f"{exc.__class__.__name__}: {exc}"))
    return out


_files: dict = {}        # path -> ((mtime, size), TunedFile)
_warned: set = set()


def clear_cache() -> None:
    """Forget loaded tables, warnings and chosen configs (tests; after re-tuning)."""
    _files.clear()
    _warned.clear()
    _chosen.clear()


def _warn_once(path, message: str) -> None:
    if path in _warned:
        return
    _warned.add(path)
    log.warning("%s", message)
    warnings.warn(message, TunedTableWarning, stacklevel=5)


def load(path) -> TunedFile:
    """One table, parsed once per (path, mtime, size)."""
    path = Path(path)
    try:
        st = path.stat()
        ident = (st.st_mtime_ns, st.st_size)
    except OSError:
        ident = None
    hit = _files.get(path)
    if hit is not None and hit[0] == ident:
        return hit[1]
    tf = read_file(path) if ident is not None else TunedFile(path, error="does not exist")
    _files[path] = (ident, tf)
    return tf


def files_for_gpu(gpu_name: str, cc, dirs: Optional[list] = None) -> list[TunedFile]:
    """This GPU's readable tables, in search order (only files named after it are read)."""
    name = file_name(gpu_name, cc)
    out = []
    for d in table_dirs() if dirs is None else dirs:
        path = Path(d) / name
        if not path.is_file():
            continue
        tf = load(path)
        if tf.error:
            _warn_once(path, f"cuflash: ignoring tuned table {path}: it {tf.error}. Falling back "
                             "to other tables or the heuristic; delete or re-tune it "
                             "(python -m cuflash tune).")
        elif tf.gpu_name == gpu_name and tf.cc == cc_str(cc):
            out.append(tf)
    return out


def current_stamp(family) -> dict:
    """What a fresh entry of ``family`` must carry: its version and its code hash."""
    from .compile import code_hash

    try:
        h = code_hash(family.name)
    except OSError as exc:
        h = f"unavailable ({exc.__class__.__name__})"
    return {"version": family.version, "code_hash": h}


def stale_reasons(entry: Entry, stamp: dict) -> list[str]:
    """Why an entry no longer describes the running code (empty: it does)."""
    out = []
    for field, what in (("version", "family version"), ("code_hash", "kernel code hash")):
        have = entry.stamp.get(field)
        if str(have) != str(stamp[field]):
            out.append(f"{what} {have} != running {stamp[field]}")
    return out


def device_rules(family, gpu_name: str, cc, dirs: Optional[list] = None) -> list:
    """``family``'s device rules on one GPU: (Rule, path) in search order (files as
    ``files_for_gpu``, rules in file order); malformed ones are skipped with one warning per file."""
    out = []
    for tf in files_for_gpu(gpu_name, cc, dirs):
        if tf.bad_rules:
            i, why = tf.bad_rules[0]
            _warn_once((tf.path, "rules"), f"cuflash: tuned table {tf.path}: {len(tf.bad_rules)} malformed "
                                           f"rules ignored (rule {i}: {why}).")
        out += [(r, tf.path) for r in tf.rules if r.family == family.name]
    return out


def heuristic_on_device(family, problem: Problem, arch, gpu_name: str, max_smem: Optional[int] = None,
                        dirs: Optional[list] = None):
    """``(config, note)``: the family's heuristic for ``problem``, with the parameters of this GPU's
    first matching device rule where the family takes rules (``heuristic_for_device``); note ''
    when no rule applied, else which rule did."""
    hook = getattr(family, "heuristic_for_device", None)
    rules = device_rules(family, gpu_name, arch, dirs) if gpu_name and hook is not None else []
    for i, (rule, path) in enumerate(rules):
        try:
            cfg = hook(problem, arch, max_smem, rule)
        except (TypeError, ValueError, KeyError) as exc:
            _warn_once((path, "rule", rule.family, str(rule.match), str(rule.set)),
                       f"cuflash: tuned table {path}: a {rule.family} rule ({rule.to_dict()}) cannot be "
                       f"used ({exc.__class__.__name__}: {exc}); ignored.")
            continue
        if cfg is not None:
            return cfg, f"device rule {path.name} {rule.match}"
    return family.heuristic(problem, arch, max_smem), ""


def _distance(bucket: int, seqlen: int) -> tuple:
    # log-scale distance; on a tie prefer the longer bucket (the kernel's steady state)
    return abs(math.log2(bucket) - math.log2(seqlen)), -bucket


def lookup(family, problem: Problem, gpu_name: str, cc, max_smem: Optional[int] = None,
           dirs: Optional[list] = None, seqlen: Optional[int] = None):
    """The tuned config of ``family`` for ``problem``'s class on one GPU: ``(config, source)``
    or ``(None, why)``. The bucket is that of max(seqlen_q, seqlen_k) (or ``seqlen``); the
    exact bucket in the first file that has it, else the nearest over all files."""
    d = family.head_dim_of(problem.head_dim)
    want = (problem.op, family.name, problem.dtype, d, bool(problem.causal), tuple(problem.features))
    stamp = None   # the code hash only where an entry of this class is there to check (a first call's cost)
    candidates, skipped = [], []
    for tf in files_for_gpu(gpu_name, cc, dirs):
        if tf.bad_entries:
            i, why = tf.bad_entries[0]
            _warn_once(tf.path, f"cuflash: tuned table {tf.path}: {len(tf.bad_entries)} malformed "
                                f"entries ignored (entry {i}: {why}).")
        for e in tf.entries:
            if e.key[:6] != want:
                continue
            if stamp is None:
                stamp = current_stamp(family)
            stale = stale_reasons(e, stamp)
            if stale:
                skipped.append("stale")
                _warn_once(tf.path, f"cuflash: tuned table {tf.path} has stale entries "
                                    f"({'; '.join(stale)}); they are ignored and the heuristic is "
                                    "used instead. Re-tune with python -m cuflash tune.")
                continue
            try:
                cfg = family.make(e.config, problem.replace(head_dim=d))
                why = cfg.problems(max_smem)
            except (TypeError, ValueError) as exc:
                why = [f"{exc.__class__.__name__}: {exc}"]
            if why:
                skipped.append("invalid")
                _warn_once(tf.path, f"cuflash: tuned table {tf.path}: entry {e.key} does not give "
                                    f"a valid config ({'; '.join(why)}); ignored.")
                continue
            candidates.append((e, tf, cfg))
    what = f"{family.name} {problem.dtype} d{d} {'causal' if problem.causal else 'full'}"
    if not candidates:
        why = f"no usable tuned entry for {what} on {gpu_name} (sm_{cc_str(cc).replace('.', '')})"
        if skipped:
            why += f" ({len(skipped)} {'/'.join(sorted(set(skipped)))} skipped)"
        return None, why
    target = seqlen_bucket(seqlen) if seqlen is not None else problem.bucket
    exact = [c for c in candidates if c[0].seqlen == target]
    if exact:
        e, tf, cfg = exact[0]
        return cfg, f"tuned {tf.path} [{what} s{e.seqlen}]"
    e, tf, cfg = min(candidates, key=lambda c: _distance(c[0].seqlen, target))
    return cfg, f"tuned {tf.path} [{what} s{e.seqlen}, nearest bucket to s{target}]"


# ---------------------------------------------------------------------------------------
# choice

def dtype_refusal(family, problem: Problem) -> str:
    """Why ``family`` does not take ``problem``'s dtype ('' when it does): ``Family.dtypes``."""
    dtypes = getattr(family, "dtypes", ("bf16", "fp16"))
    if problem.dtype not in dtypes:
        return f"{family.name} runs dtypes {', '.join(dtypes)}, not {problem.dtype}"
    return ""


def choose(problem: Problem, arch, gpu_name: str = "", max_smem: Optional[int] = None,
           config=None, dirs: Optional[list] = None, family=None):
    """``(family, config, source)`` for ``problem`` on a GPU of compute capability ``arch``.

    ``source`` says where the config came from: "given", the tuned file, or "heuristic
    (why)". Raises UnsupportedProblem when no registered family supports the problem, and
    ConfigError / ValueError for a ``config`` that cannot run it. ``family`` (a family or its
    name) restricts the choice to that one family (the benchmarks time every family).
    """
    arch = tuple(arch)
    if config is not None:
        fam = family_of(config)
        if fam.op != problem.op:
            raise ValueError(f"config: {config.name} is a {fam.op} config, this call needs {problem.op}")
        why = dtype_refusal(fam, problem) or fam.supports(arch, problem) or fam.fits(config, problem)
        if why:
            raise ValueError(f"config: {why}")
        return fam, fam.for_problem(config, problem).validate(max_smem), "given"
    reasons = []
    candidates = sorted(families(problem.op), key=lambda f: -f.rank(problem)) if family is None \
        else [get(family) if isinstance(family, str) else family]
    refused = []      # families that do not take the dtype: named only when none does
    for fam in candidates:
        why = dtype_refusal(fam, problem)
        if why:
            refused.append(why)
            continue
        why = fam.supports(arch, problem)
        if why:
            reasons.append(why)
            continue
        cfg, source = (None, "no GPU name") if not gpu_name else \
            lookup(fam, problem, gpu_name, arch, max_smem, dirs)
        if cfg is not None:
            cfg = fam.for_problem(cfg, problem)
            if cfg.problems(max_smem):
                cfg, source = None, f"tuned {cfg.name} has no valid variant for this call"
        if cfg is None:
            cfg, rule = heuristic_on_device(fam, problem, arch, gpu_name, max_smem, dirs)
            cfg, source = fam.for_problem(cfg, problem), \
                f"heuristic ({source}{'; ' + rule if rule else ''})"
        return fam, cfg, source
    reasons = reasons or refused
    if not reasons:
        raise UnsupportedProblem(f"no kernel family implements op {problem.op!r}")
    raise UnsupportedProblem("; ".join(dict.fromkeys(reasons)))


_chosen: dict = {}


def _on_sources_changed() -> None:
    _chosen.clear()


def _register_drop() -> None:
    from . import compile as compile_mod

    compile_mod.on_change(_on_sources_changed)


_register_drop()


# Calls of at most SHORT_EXACT keys are cached per seqlen_k, not per bucket: heuristics may depend on a short
# seqlen_k (sm90_fwd's short_keys_bn: the K/V block width of the least padding). seqlen_q is not part of the key
# (no heuristic reads it below the buckets), so the cache holds at most SHORT_EXACT entries more per class.
SHORT_EXACT = 1024


def choose_on_device(problem: Problem, device: int, config=None):
    """``choose`` for the GPU ``device``, cached per (problem class, bucket, flags, device,
    kernel directory, config) and the softcap's value (sm90_fwd's heuristic picks the step's copies by
    whether the cap allows the fixed max: MASKED_COPY_ROW_MAX); short calls per seqlen_k too (SHORT_EXACT)."""
    from . import _gpu

    short_k = problem.seqlen_k if problem.seqlen_k <= SHORT_EXACT else None
    key = (problem.class_key, problem.bucket, problem.deterministic, device, config,
           problem.softcap if "softcap" in problem.features else 0.0, short_k)
    hit = _chosen.get(key)
    if hit is None:
        arch = _gpu.arch(device)
        hit = choose(problem, arch, _gpu.name(device), _gpu.max_smem(device), config)
        _chosen[key] = hit
    return hit


def config_for(op: str, head_dim: int, dtype: str, causal: bool, device: int = 0,
               seqlen: Optional[int] = None, deterministic: bool = False, *,
               with_source: bool = False):
    """The config (tuned or heuristic) that ``op`` runs for this problem class on ``device``.
    with_source=True returns (config, source)."""
    s = seqlen or SEQLEN_BUCKETS[-1]
    problem = Problem(op, dtype, 1, s, s, 1, 1, head_dim, bool(causal), bool(deterministic))
    _, cfg, source = choose_on_device(problem, device)
    return (cfg, source) if with_source else cfg


__all__ = ["choose", "choose_on_device", "config_for", "lookup", "Entry", "TunedFile", "Rule", "device_rules",
           "heuristic_on_device",
           "TunedTableWarning", "UnsupportedProblem", "read_file", "files_for_gpu", "table_dirs",
           "user_dir", "shipped_dir", "file_name", "cc_str", "current_stamp", "stale_reasons",
           "clear_cache", "FORMAT", "get"]
