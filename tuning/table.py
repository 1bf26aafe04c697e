"""Tuned tables: the best config per GPU and problem class, as YAML, and the lookup.

One file per GPU, found by its contents (``gpu: {name, cc}``), not its file name::

    format: 1
    gpu: {name: NVIDIA H100 80GB HBM3, cc: '9.0'}
    entries:
    - key: {kernel: fwd, dtype: bf16, head_dim: 128, causal: true, seqlen: 4096}
      config: {Br: 128, Bc: 64, warps: 4, stages: 2}
      median_ms: 0.95
      tflops: 290.1
      runners_up: [{config: {...}, median_ms: 0.97, tflops: 283.4}, ...]
      note: 'heuristic kept: best Br128_Bc128_w4_s2 is +0.4% vs heuristic (< min gain 1.0%)'
      env: {gpu: ..., cc: ..., driver: ..., cuda_runtime: ..., cupy: ..., cuflash: 0.1.0,
            source_hash: 3f2a..., ...}

``note`` (optional, absent when empty) says why the config is not simply the fastest one
measured: the tuner keeps the heuristic unless the best beats it by a margin
(tuning.study.MIN_GAIN), and then the real best is the first runner-up.

Files live in two places, searched in this order: the user's cache directory
(``$CUFLASH_TUNED_DIR``, default ``~/.cache/cuflash/tuned``), where ``python -m cuflash tune``
writes, and the files shipped with the package (``tuning/configs/*.yaml``).

Lookup: the exact key, then the nearest seqlen bucket with an entry, then nothing (the
caller uses its heuristic). An entry whose kernel source hash or cuflash version differs
from the running ones is stale and ignored; an unreadable file, or an entry that does not
make a valid config, is skipped. Either way one warning per file, never an exception.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Optional

from .space import SEQLEN_BUCKETS, get_family, seqlen_bucket

log = logging.getLogger("cuflash.tuning")

FORMAT = 1
ENV_VAR = "CUFLASH_TUNED_DIR"
SHIPPED_DIR = Path(__file__).resolve().parent / "configs"


class TunedTableWarning(UserWarning):
    """A tuned table that cannot be used as it stands (stale or corrupt)."""


# ---------------------------------------------------------------------------------------
# records

@dataclasses.dataclass
class Entry:
    """One tuned result: the key, the winning config's parameters and how it was measured."""

    kernel: str
    dtype: str
    head_dim: int
    causal: bool
    seqlen: int
    config: dict
    median_ms: Optional[float] = None
    tflops: Optional[float] = None
    runners_up: list = dataclasses.field(default_factory=list)
    env: dict = dataclasses.field(default_factory=dict)
    note: str = ""           # why the config is not the fastest measured ('' when it is)

    @property
    def key(self) -> tuple:
        return (self.kernel, self.dtype, self.head_dim, self.causal, self.seqlen)

    def to_dict(self) -> dict:
        d = {"key": {"kernel": self.kernel, "dtype": self.dtype, "head_dim": self.head_dim,
                     "causal": self.causal, "seqlen": self.seqlen},
             "config": dict(self.config), "median_ms": self.median_ms, "tflops": self.tflops,
             "runners_up": list(self.runners_up), "env": dict(self.env)}
        if self.note:
            d["note"] = self.note
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Entry":
        """Raises (KeyError, TypeError, ValueError) on a malformed record."""
        key = d["key"]
        if not isinstance(d["config"], dict) or not isinstance(d.get("env", {}), dict):
            raise TypeError("config and env must be mappings")
        causal = key["causal"]
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be true or false, got {causal!r}")
        return cls(kernel=str(key["kernel"]), dtype=str(key["dtype"]),
                   head_dim=int(key["head_dim"]), causal=causal, seqlen=int(key["seqlen"]),
                   config=dict(d["config"]),
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


def table_dirs() -> list[Path]:
    """Where tuned tables are looked for, first match wins: user cache, then shipped."""
    return [user_dir(), SHIPPED_DIR]


# ---------------------------------------------------------------------------------------
# reading (cached by file identity; one warning per file)

_cache: dict[Path, tuple[tuple, TunedFile]] = {}
_warned: set[Path] = set()


def clear_cache() -> None:
    """Forget loaded files and the warnings already given (tests; after re-tuning)."""
    _cache.clear()
    _warned.clear()


def _warn_once(path: Path, message: str) -> None:
    if path in _warned:
        return
    _warned.add(path)
    log.warning("%s", message)
    warnings.warn(message, TunedTableWarning, stacklevel=4)


def read_file(path: Path) -> TunedFile:
    """Parse one YAML table. Never raises: problems go into ``.error`` / ``.bad_entries``."""
    import yaml

    path = Path(path)
    out = TunedFile(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        out.error = f"cannot be read as YAML ({exc.__class__.__name__}: {str(exc)[:200]})"
        return out
    try:
        if not isinstance(data, dict):
            raise TypeError("the top level must be a mapping")
        if data.get("format", FORMAT) != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, this cuflash reads format {FORMAT}")
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
    return out


def load(path: Path) -> TunedFile:
    path = Path(path)
    try:
        st = path.stat()
        ident = (st.st_mtime_ns, st.st_size)
    except OSError:
        ident = None
    hit = _cache.get(path)
    if hit is not None and hit[0] == ident:
        return hit[1]
    tf = read_file(path)
    _cache[path] = (ident, tf)
    return tf


def table_files(dirs: Optional[list] = None) -> list[TunedFile]:
    """Every table in ``dirs`` (default: ``table_dirs()``), in search order."""
    out = []
    for d in table_dirs() if dirs is None else dirs:
        d = Path(d)
        if d.is_dir():
            out += [load(p) for p in sorted(d.glob("*.yaml"))]
    return out


def files_for_gpu(gpu_name: str, cc, dirs: Optional[list] = None) -> list[TunedFile]:
    """The readable tables for one GPU, in search order; unreadable ones warn once."""
    cc = cc_str(cc)
    out = []
    for tf in table_files(dirs):
        if tf.error:
            _warn_once(tf.path, f"cuflash: ignoring tuned table {tf.path}: it {tf.error}. "
                                "Falling back to other tables or the heuristic; delete or "
                                "re-tune it (python -m cuflash tune).")
        elif tf.gpu_name == gpu_name and tf.cc == cc:
            out.append(tf)
    return out


# ---------------------------------------------------------------------------------------
# staleness and lookup

def current_stamp(kernel: str) -> dict:
    """What a fresh entry for ``kernel`` must carry: cuflash version and kernel source hash."""
    import cuflash
    from cuflash.kernels import source_hash

    fam = get_family(kernel)
    try:
        h = source_hash(fam.source)
    except OSError as exc:
        h = f"unavailable ({exc.__class__.__name__})"
    return {"cuflash": cuflash.__version__, "source_hash": h}


def stale_reasons(entry: Entry, stamp: dict) -> list[str]:
    """Why an entry no longer describes the running code (empty: it does)."""
    out = []
    for field, what in (("source_hash", "kernel source hash"), ("cuflash", "cuflash version")):
        have = entry.env.get(field)
        if str(have) != str(stamp[field]):
            out.append(f"{what} {have} != running {stamp[field]}")
    return out


def _entry_config(entry: Entry, max_smem: Optional[int]):
    """The config an entry stands for, or (None, reason) when it does not make a valid one."""
    fam = get_family(entry.kernel)
    try:
        cfg = fam.make(entry.config, entry.head_dim, entry.dtype, entry.causal)
        why = cfg.problems(max_smem)
    except (TypeError, ValueError) as exc:
        return None, f"{exc.__class__.__name__}: {exc}"
    return (cfg, "") if not why else (None, "; ".join(why))


def _distance(bucket: int, seqlen: int) -> tuple:
    # log-scale distance; on a tie prefer the longer bucket (the kernel's steady state)
    return abs(math.log2(bucket) - math.log2(seqlen)), -bucket


def lookup(kernel: str, gpu_name: str, cc, dtype: str, head_dim: int, causal: bool,
           seqlen: Optional[int] = None, max_smem: Optional[int] = None,
           dirs: Optional[list] = None):
    """The tuned config for one problem on one GPU: ``(config, source)`` or ``(None, why)``.

    kernel: "fwd" or "bwd"; gpu_name and cc as ``cuflash._gpu.name()`` / ``arch()`` give
    them; head_dim is rounded up to the compiled head dim; seqlen (use max(seqlen_q,
    seqlen_k)) picks the bucket, None means the longest bucket with an entry. max_smem, when
    given, rejects entries the device cannot launch.

    Order: the exact bucket in the first file that has it (user cache before shipped
    files), else the nearest bucket over all files, else ``(None, reason)``. Stale and
    invalid entries are skipped with one warning per file. Never raises for bad files.
    """
    fam = get_family(kernel)
    d = fam.head_dim_of(head_dim)
    want = (fam.kernel, dtype, d, bool(causal))
    stamp = current_stamp(fam.kernel)
    candidates = []                      # (entry, file, config) usable for this problem
    skipped = []
    for tf in files_for_gpu(gpu_name, cc, dirs):
        if tf.bad_entries:
            i, why = tf.bad_entries[0]
            _warn_once(tf.path, f"cuflash: tuned table {tf.path}: {len(tf.bad_entries)} malformed "
                                f"entries ignored (entry {i}: {why}).")
        for e in tf.entries:
            if e.key[:4] != want:
                continue
            stale = stale_reasons(e, stamp)
            if stale:
                skipped.append("stale")
                _warn_once(tf.path, f"cuflash: tuned table {tf.path} has stale entries "
                                    f"({'; '.join(stale)}); they are ignored and the "
                                    "heuristic is used instead. Re-tune with python -m cuflash tune.")
                continue
            cfg, why = _entry_config(e, max_smem)
            if cfg is None:
                skipped.append("invalid")
                _warn_once(tf.path, f"cuflash: tuned table {tf.path}: entry {e.key} does not "
                                    f"give a valid config ({why}); ignored.")
                continue
            candidates.append((e, tf, cfg))
    what = f"{fam.kernel} {dtype} d{d} {'causal' if causal else 'full'}"
    if not candidates:
        why = f"no usable tuned entry for {what} on {gpu_name} (sm_{cc_str(cc).replace('.', '')})"
        if skipped:
            why += f" ({len(skipped)} {'/'.join(sorted(set(skipped)))} skipped)"
        log.debug("%s", why)
        return None, why
    target = seqlen_bucket(seqlen) if seqlen is not None else max(e.seqlen for e, _, _ in candidates)
    exact = [c for c in candidates if c[0].seqlen == target]
    if exact:
        e, tf, cfg = exact[0]
        source = f"tuned {tf.path} [{what} s{e.seqlen}]"
    else:
        e, tf, cfg = min(candidates, key=lambda c: _distance(c[0].seqlen, target))
        source = f"tuned {tf.path} [{what} s{e.seqlen}, nearest bucket to s{target}]"
    log.debug("config for %s s%s: %s from %s", what, seqlen, cfg.name, source)
    return cfg, source


def choose(kernel: str, head_dim: int, dtype: str, causal: bool, seqlen: Optional[int] = None,
           *, gpu_name: str, cc, max_smem: Optional[int] = None, deterministic: bool = False,
           dirs: Optional[list] = None):
    """The config to run: the tuned one if there is one, else the heuristic.

    Returns ``(config, source)``; source names the tuned file or says "heuristic (why)".
    deterministic (backward only): the tuned tiles with ``deterministic=True`` when that is
    a valid config, else the heuristic's deterministic config. This is what
    ``cuflash.config_for`` / ``bwd_config_for`` call.
    """
    fam = get_family(kernel)
    cfg, source = lookup(kernel, gpu_name, cc, dtype, head_dim, causal, seqlen, max_smem, dirs)
    if cfg is not None and deterministic and fam.kernel == "bwd":
        det = cfg.replace(deterministic=True)
        cfg, source = (det, source + " (deterministic variant)") if not det.problems(max_smem) \
            else (None, f"tuned {cfg.name} has no valid deterministic variant")
    if cfg is not None:
        return cfg, source
    major, minor = cc_str(cc).split(".")
    arch = (int(major), int(minor))
    if deterministic and fam.kernel == "bwd":
        cfg = fam.default_config(head_dim, dtype, causal, arch, max_smem, deterministic=True)
    else:
        cfg = fam.heuristic(head_dim, dtype, causal, arch, max_smem)
    log.debug("config for %s %s d%s causal=%s: heuristic %s (%s)", kernel, dtype, head_dim,
              causal, cfg.name, source)
    return cfg, f"heuristic ({source})"


# ---------------------------------------------------------------------------------------
# writing

def save_entries(entries: list, gpu_name: str, cc, directory=None) -> Path:
    """Merge ``entries`` into the GPU's table in ``directory`` (default: the user cache).

    Entries with the same key are replaced. The file is written atomically; an existing
    file that cannot be read is moved aside to ``*.corrupt`` rather than overwritten.
    """
    import yaml

    directory = Path(directory) if directory is not None else user_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / file_name(gpu_name, cc)
    merged: dict[tuple, Entry] = {}
    if path.exists():
        old = read_file(path)
        if old.error or (old.gpu_name, old.cc) != (gpu_name, cc_str(cc)):
            aside = path.with_suffix(".yaml.corrupt")
            os.replace(path, aside)
            log.warning("moved unreadable or foreign tuned table %s to %s", path, aside)
        else:
            merged = {e.key: e for e in old.entries}
    for e in entries:
        merged[e.key] = e
    order = sorted(merged.values(), key=lambda e: (e.kernel, e.dtype, e.head_dim, e.causal, e.seqlen))
    doc = {"format": FORMAT, "gpu": {"name": gpu_name, "cc": cc_str(cc)},
           "entries": [e.to_dict() for e in order]}
    text = ("# cuflash tuned configs; written by python -m cuflash tune. "
            "Lookup: tuning.table.lookup\n" + yaml.safe_dump(doc, sort_keys=False, width=100))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".", suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    _cache.pop(path, None)
    _warned.discard(path)
    return path


__all__ = ["Entry", "TunedFile", "TunedTableWarning", "SEQLEN_BUCKETS", "lookup", "choose",
           "save_entries", "read_file", "table_files", "table_dirs", "user_dir", "file_name",
           "current_stamp", "stale_reasons", "clear_cache", "cc_str"]
