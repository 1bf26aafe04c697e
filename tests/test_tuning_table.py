"""Tuned tables: written by the tuner (tuning/table.py, format 2), read by the library
(cuflash.select): YAML round trip, lookup order, every fallback path, stale entries (family
version or kernel code hash) and corrupt files (one warning per file, never an exception),
the code hash's indifference to comments, and the format-1 upgrade. CPU only."""
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from cuflash import compile as cucompile
from cuflash import registry, select
from cuflash.families.base import MAX_SMEM_BY_ARCH
from cuflash.families.fa2_fwd import FwdConfig
from cuflash.problem import Problem
from cuflash.select import Entry, TunedTableWarning, choose, lookup, read_file
from cuflash.tuning import table
from cuflash.tuning.table import save_entries, upgrade_v1

# The tests' GPU is an sm_80 one: there fa2_fwd and fa2_bwd are what choose() picks, so the
# fa2 tables written here are the ones it reads (on sm_90, sm90_fwd outranks fa2_fwd).
GPU, CC = "NVIDIA Test GPU 80GB", (8, 0)
SMEM = MAX_SMEM_BY_ARCH[CC]
H100_SMEM = MAX_SMEM_BY_ARCH[(9, 0)]
FWD, BWD = registry.get("fa2_fwd"), registry.get("fa2_bwd")
REPO = Path(__file__).resolve().parent.parent
SHIPPED_H100 = Path(select.shipped_dir()) / "NVIDIA_H100_80GB_HBM3_sm90.yaml"


@pytest.fixture(autouse=True)
def dirs(tmp_path, monkeypatch):
    """A private user cache dir and shipped dir for every test; a clean cache."""
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    monkeypatch.setenv(select.ENV_VAR, str(user))
    monkeypatch.setattr(select, "shipped_dir", lambda: shipped)
    select.clear_cache()
    yield user, shipped
    select.clear_cache()


def entry(seqlen=4096, head_dim=128, causal=True, dtype="bf16", family=FWD, stamp=None, **cfg):
    params = {"Br": 128, "Bc": 64, "warps": 4, "stages": 2}
    params.update(cfg)
    return Entry(family.op, family.name, dtype, head_dim, causal, seqlen, params,
                 stamp=dict(select.current_stamp(family) if stamp is None else stamp),
                 median_ms=1.25, tflops=300.0,
                 runners_up=[{"config": dict(params, stages=3), "median_ms": 1.3, "tflops": 290.0}],
                 env={"gpu": GPU, "cc": "8.0"})


def problem(op="fwd", head_dim=128, causal=True, dtype="bf16", seqlen=4096, **kw):
    return Problem(op, dtype, 1, seqlen, seqlen, 1, 1, head_dim, causal, **kw)


def find(family=FWD, gpu_name=GPU, cc=CC, max_smem=SMEM, dirs=None, **kw):
    return lookup(family, problem(family.op, **kw), gpu_name, cc, max_smem, dirs)


def pick(gpu_name=GPU, arch=CC, max_smem=SMEM, dirs=None, family=None, **kw):
    """select.choose: (config, source)."""
    fam, cfg, source = choose(problem(**kw), arch, gpu_name, max_smem, dirs=dirs, family=family)
    return cfg, source


def no_warnings():
    return warnings.catch_warnings(record=True)


# ---------------------------------------------------------------------------------------
# files

def test_yaml_round_trip_and_merge(dirs):
    user, _ = dirs
    e1, e2 = entry(4096), entry(8192, Bc=32)
    path = save_entries([e1, e2], GPU, CC)
    assert path.parent == user and path.name == "NVIDIA_Test_GPU_80GB_sm80.yaml"
    assert path.name == select.file_name(GPU, CC)
    tf = read_file(path)
    assert (tf.gpu_name, tf.cc, tf.error, tf.bad_entries) == (GPU, "8.0", "", [])
    assert [e.to_dict() for e in tf.entries] == [e1.to_dict(), e2.to_dict()]
    assert tf.entries == [e1, e2]
    doc = yaml.safe_load(path.read_text())
    assert doc["format"] == select.FORMAT == 2
    assert doc["entries"][0]["key"] == {"op": "fwd", "family": "fa2_fwd", "dtype": "bf16",
                                        "head_dim": 128, "causal": True, "features": [],
                                        "seqlen": 4096}
    assert doc["entries"][0]["stamp"] == select.current_stamp(FWD)
    # same key replaced, others kept
    e1b = entry(4096, stages=3)
    save_entries([e1b], GPU, CC)
    tf = read_file(path)
    assert [e.config["stages"] for e in tf.entries] == [3, 2]
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o644)
    # both families in one file, kept apart by their key
    save_entries([entry(family=BWD, Br=64, Bc=128, warps=8, stages=2, dsplit=1, qsplit=2)], GPU, CC)
    tf = read_file(path)
    assert sorted({e.family for e in tf.entries}) == ["fa2_bwd", "fa2_fwd"] and len(tf.entries) == 3


def test_save_refuses_other_records(dirs):
    with pytest.raises(TypeError, match="cuflash.select.Entry"):
        save_entries([entry().to_dict()], GPU, CC)


def test_save_moves_a_corrupt_file_aside(dirs):
    user, _ = dirs
    user.mkdir()
    bad = user / select.file_name(GPU, CC)
    bad.write_text("{{{ not yaml")
    save_entries([entry()], GPU, CC)
    assert (user / (bad.name + ".corrupt")).read_text() == "{{{ not yaml"
    assert read_file(bad).entries[0].config["Br"] == 128


def test_save_then_lookup_sees_the_new_table_at_once(dirs):
    path = save_entries([entry(Bc=32)], GPU, CC)
    assert find()[0].Bc == 32
    save_entries([entry(Bc=64)], GPU, CC)      # same size, maybe the same mtime: still re-read
    cfg, source = find()
    assert cfg.Bc == 64 and str(path) in source


def test_cc_forms():
    assert select.cc_str((9, 0)) == select.cc_str("9.0") == select.cc_str("90") == "9.0"
    assert select.cc_str((12, 0)) == select.cc_str("120") == "12.0"


def test_user_dir_env_var_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv(select.ENV_VAR, str(tmp_path / "x"))
    assert select.user_dir() == tmp_path / "x"
    monkeypatch.delenv(select.ENV_VAR)
    assert select.user_dir().parts[-3:] == (".cache", "cuflash", "tuned")


# ---------------------------------------------------------------------------------------
# lookup order (cuflash.select)

def test_exact_key(dirs):
    path = save_entries([entry(4096, Bc=32), entry(8192)], GPU, CC)
    with no_warnings() as w:
        cfg, source = find(seqlen=4000)
    assert not w
    assert cfg == FwdConfig(128, 32, 4, 2, 128, "bf16", True)
    assert str(path) in source and "s4096" in source and "nearest" not in source


def test_nearest_bucket_and_tie_prefers_longer(dirs):
    save_entries([entry(1024, Bc=32), entry(4096)], GPU, CC)
    cfg, source = find(seqlen=512)
    assert cfg.Bc == 32 and "nearest bucket to s512" in source
    cfg, _ = find(seqlen=2048)              # 1024 and 4096 both one octave away
    assert cfg.Bc == 64
    cfg, _ = find(seqlen=16384)
    assert cfg.Bc == 64


def test_head_dim_is_rounded_like_the_kernel(dirs):
    save_entries([entry(head_dim=80)], GPU, CC)
    cfg, _ = find(head_dim=72)
    assert cfg is not None and cfg.head_dim == 80


@pytest.mark.parametrize("change", [dict(gpu_name="Other GPU"), dict(cc=(9, 0)),
                                    dict(dtype="fp16"), dict(causal=False), dict(head_dim=64),
                                    dict(family=BWD)])
def test_no_entry_for_other_keys(dirs, change):
    save_entries([entry()], GPU, CC)
    with no_warnings() as w:
        cfg, why = find(**change)
    assert cfg is None and "no usable tuned entry" in why and not w


def test_no_files_at_all():
    cfg, why = find()
    assert cfg is None and "no usable tuned entry for fa2_fwd bf16 d128 causal" in why


def test_user_cache_wins_over_shipped(dirs):
    _, shipped = dirs
    save_entries([entry(Bc=32)], GPU, CC, directory=shipped)
    save_entries([entry(Bc=64, warps=8)], GPU, CC)   # user cache
    cfg, source = find()
    assert (cfg.Bc, cfg.warps) == (64, 8) and "user" in source
    # an exact bucket in the shipped file beats a nearest one in the user's
    save_entries([entry(1024, Bc=32)], GPU, CC, directory=shipped)
    cfg, source = find(seqlen=1024)
    assert cfg.Bc == 32 and "shipped" in source


def test_only_this_gpus_file_is_read(dirs):
    _, shipped = dirs
    path = save_entries([entry()], GPU, CC, directory=shipped)
    path.rename(shipped / "whatever.yaml")          # not named after the GPU: not read
    assert find()[0] is None
    # named after it but holding another GPU's table: not used either
    other = save_entries([entry()], "Other GPU", CC, directory=shipped)
    other.rename(shipped / select.file_name(GPU, CC))
    select.clear_cache()
    assert find()[0] is None


def test_entry_that_the_device_cannot_run_is_skipped(dirs):
    save_entries([entry()], GPU, CC)        # 104 KB of shared memory
    with pytest.warns(TunedTableWarning, match="does not give a valid config.*shared memory"):
        cfg, why = find(max_smem=48 * 1024)
    assert cfg is None and "1 invalid skipped" in why


# ---------------------------------------------------------------------------------------
# stale and corrupt: one warning per file, then the fallback

@pytest.mark.parametrize("field, value", [("code_hash", "0000-old"), ("version", 0)])
def test_stale_entry_warns_once_and_the_heuristic_is_used(dirs, tmp_path, field, value):
    stamp = dict(select.current_stamp(FWD))
    stamp[field] = value
    tdir = tmp_path / "t"
    path = save_entries([entry(stamp=stamp)], GPU, CC, directory=tdir)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3):
            cfg, why = find(dirs=[tdir])
            assert cfg is None and "stale skipped" in why
        cfg, source = pick(dirs=[tdir])
    assert len(w) == 1 and issubclass(w[0].category, TunedTableWarning)
    assert str(path) in str(w[0].message) and str(value) in str(w[0].message)
    assert cfg == FWD.heuristic(problem(), CC, SMEM)
    assert source.startswith("heuristic (") and "stale" in source


def test_stale_exact_bucket_uses_a_fresh_neighbour(dirs):
    stale = dict(select.current_stamp(FWD), code_hash="old")
    save_entries([entry(4096, stamp=stale), entry(8192, Bc=32)], GPU, CC)
    with pytest.warns(TunedTableWarning, match="stale"):
        cfg, source = find(seqlen=4096)
    assert cfg.Bc == 32 and "s8192" in source


@pytest.mark.parametrize("text, what", [
    ("{{{ not: yaml", "cannot be read as YAML"),
    ("- just\n- a list\n", "top level must be a mapping"),
    ("format: 2\nentries: []\n", "is not a tuned table"),
    ("format: 99\ngpu: {name: x, cc: '9.0'}\n", "format 99"),
    ("format: 1\ngpu: {name: x, cc: '9.0'}\nentries: []\n", "format 1"),
    (b"\xff\xfe\x00garbage", "cannot be read as YAML"),
])
def test_corrupt_file_warns_once_and_others_still_work(dirs, text, what):
    user, shipped = dirs
    user.mkdir()
    bad = user / select.file_name(GPU, CC)
    bad.write_bytes(text if isinstance(text, bytes) else text.encode())
    save_entries([entry()], GPU, CC, directory=shipped)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3):
            cfg, source = find()
            assert cfg is not None and "shipped" in source
    assert len(w) == 1 and what in str(w[0].message) and str(bad) in str(w[0].message)


def test_malformed_and_invalid_entries_are_skipped_not_fatal(dirs):
    path = save_entries([entry(4096)], GPU, CC)
    text = path.read_text() + (
        "- key: {op: fwd, family: fa2_fwd, dtype: bf16, head_dim: 128, causal: maybe, seqlen: 8192}\n"
        "  config: {Br: 128, Bc: 64, warps: 4, stages: 2}\n"
        "- key: {op: fwd, family: fa2_fwd, dtype: bf16, head_dim: 128, causal: true, seqlen: 16384}\n"
        "  config: {Br: 96, Bc: 64, warps: 4, stages: 2, Bz: 1}\n")
    path.write_text(text)
    select.clear_cache()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cfg, source = find(seqlen=16384)
        cfg2, _ = find(seqlen=4096)
    assert len(w) == 1 and "malformed" in str(w[0].message)
    assert cfg is not None and "nearest bucket" in source and cfg == cfg2


def test_an_entry_of_a_config_the_kernel_rejects(dirs):
    save_entries([entry(Br=96)], GPU, CC)   # 96 is not a multiple of 16 * 4 warps
    with pytest.warns(TunedTableWarning, match="Br=96"):
        cfg, source = pick()
    assert source.startswith("heuristic") and cfg.Br != 96


def test_changed_file_is_reloaded(dirs):
    path = save_entries([entry(Bc=32)], GPU, CC)
    assert find()[0].Bc == 32
    text = path.read_text().replace("Bc: 32", "Bc: 64")
    path.write_text(text + "\n")   # a different size: the cache sees the change
    assert find()[0].Bc == 64


def test_choose_returns_tuned_or_heuristic(dirs):
    save_entries([entry(Bc=32, stages=3)], GPU, CC)
    cfg, source = pick()
    assert (cfg.Bc, cfg.stages) == (32, 3) and source.startswith("tuned ")
    cfg, source = pick(head_dim=64, dtype="fp16", causal=False)
    assert cfg == FWD.heuristic(problem(head_dim=64, dtype="fp16", causal=False), CC, SMEM)
    assert source.startswith("heuristic (no usable tuned entry")


def test_choose_on_sm90_prefers_sm90_fwd_over_a_tuned_fa2_fwd_entry(dirs):
    """On sm_90 the forward is sm90_fwd's (priority 1), a fa2_fwd entry notwithstanding;
    family="fa2_fwd" still reads it. The backward is sm90_bwd's at head dims 97..128 (its rank),
    fa2_bwd's at 64."""
    sm90 = registry.get("sm90_fwd")
    save_entries([entry(Bc=32, stages=3)], GPU, (9, 0))
    fam, cfg, source = choose(problem(), (9, 0), GPU, H100_SMEM)
    assert fam is sm90 and source.startswith("heuristic (no usable tuned entry for sm90_fwd")
    assert cfg == sm90.heuristic(problem(), (9, 0), H100_SMEM)
    cfg, source = pick(arch=(9, 0), max_smem=H100_SMEM, family="fa2_fwd")
    assert (cfg.Bc, cfg.stages) == (32, 3) and source.startswith("tuned ")
    bwd = problem("bwd")
    # sm90_bwd ranks first at every head dim up to 128 (D64_ABOVE_FA2, D96_ABOVE_FA2)
    assert choose(bwd, (9, 0), GPU, H100_SMEM)[0] is registry.get(
        "sm90_bwd" if bwd.head_dim <= 128 else "fa2_bwd")
    assert choose(bwd.replace(head_dim=64), (9, 0), GPU, H100_SMEM)[0] is registry.get("sm90_bwd")


def test_backward_entries_and_deterministic_variant(dirs):
    p = problem("bwd")
    heur = BWD.heuristic(p, CC, SMEM)
    save_entries([Entry("bwd", "fa2_bwd", "bf16", 128, True, 4096, BWD.point(heur),
                        stamp=select.current_stamp(BWD))], GPU, CC)
    fam, cfg, source = choose(p, CC, GPU, SMEM)
    assert fam is BWD and cfg == heur and source.startswith("tuned")
    fam, cfg, source = choose(problem("bwd", deterministic=True), CC, GPU, SMEM)
    assert cfg == heur.replace(deterministic=True) and source.startswith("tuned")
    # the forward table is separate
    assert find()[0] is None


# ---------------------------------------------------------------------------------------
# the code hash: comments and whitespace do not retire a table, code does

def kernel_copy(tmp_path, name, edit=None) -> Path:
    d = tmp_path / name
    shutil.copytree(cucompile.kernel_dir(), d, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    if edit is not None:
        src = d / "fa2_fwd.cu"
        src.write_text(edit(src.read_text()))
    return d


def use_kernel_dir(monkeypatch, d) -> None:
    """Compile and hash from ``d`` (None: kernels_cu/), as CUFLASH_KERNEL_DIR=d does."""
    if d is None:
        monkeypatch.delenv("CUFLASH_KERNEL_DIR", raising=False)
    else:
        monkeypatch.setenv("CUFLASH_KERNEL_DIR", str(d))
    if hasattr(cucompile, "set_kernel_dir"):   # the variable is read at import
        cucompile.set_kernel_dir(d)
    select.clear_cache()


@pytest.fixture
def kernel_dir_back(monkeypatch):
    yield
    use_kernel_dir(monkeypatch, None)


def test_code_hash_ignores_comments_and_whitespace_not_code(tmp_path, monkeypatch, kernel_dir_back):
    base = cucompile.code_hash("fa2_fwd")
    copies = {
        "same": kernel_copy(tmp_path, "same"),
        "comment": kernel_copy(tmp_path, "comment", lambda s: "// a new comment\n/* and a\n block */\n"
                               + s.replace("\n", "  \n\n", 5).replace(";\n", " ;   // note\n", 3)),
        "code": kernel_copy(tmp_path, "code",
                            lambda s: s + "\nnamespace cuflash { constexpr int kUnused = 1; }\n"),
    }
    hashes = {}
    for name, d in copies.items():
        use_kernel_dir(monkeypatch, d)
        assert cucompile.kernel_dir() == d.resolve()
        hashes[name] = cucompile.code_hash("fa2_fwd")
        assert select.current_stamp(FWD)["code_hash"] == hashes[name]
    assert hashes["same"] == hashes["comment"] == base
    assert hashes["code"] != base
    # an entry tuned on the original stays fresh under the comment edit, goes stale under
    # the code edit
    use_kernel_dir(monkeypatch, None)
    tdir = tmp_path / "t"
    save_entries([entry(stages=3)], GPU, CC, directory=tdir)     # not the heuristic
    for name, stale in (("comment", False), ("code", True)):
        use_kernel_dir(monkeypatch, copies[name])
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            cfg, source = pick(dirs=[tdir])
        assert source.startswith("heuristic") == stale and len(w) == int(stale), source
        assert (cfg.stages == 3) != stale
    # the environment variable, in a fresh process
    code = "from cuflash.compile import code_hash; print(code_hash('fa2_fwd'))"
    for name, want in (("comment", base), ("code", hashes["code"])):
        env = dict(os.environ, CUFLASH_KERNEL_DIR=str(copies[name]))
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == want, out.stderr


# ---------------------------------------------------------------------------------------
# format 1 -> 2

V1 = """# cuflash tuned configs; written by python -m cuflash tune. Lookup: tuning.table.lookup
format: 1
gpu: {name: NVIDIA Test GPU 80GB, cc: '8.0'}
entries:
- key: {kernel: bwd, dtype: bf16, head_dim: 64, causal: false, seqlen: 512}
  config: {Br: 32, Bc: 128, warps: 4, stages: 2, dsplit: 1, qsplit: 1}
  median_ms: 0.85
  tflops: 202.2
  runners_up:
  - config: {Br: 32, Bc: 128, warps: 4, stages: 3, dsplit: 1, qsplit: 1}
    median_ms: 0.849
    tflops: 202.2
  env: {kernel: bwd, cuflash: 0.1.0, source_hash: de0fc6d47bc8c80f, gpu: NVIDIA Test GPU 80GB}
- key: {kernel: fwd, dtype: fp16, head_dim: 128, causal: true, seqlen: 4096}
  config: {Br: 128, Bc: 64, warps: 4, stages: 2}
  median_ms: 0.95
  tflops: 290.1
  runners_up: []
  note: 'heuristic kept: best Br128_Bc128_w4_s2 is +0.4% vs heuristic (< min gain 1.0%)'
  env: {kernel: fwd, cuflash: 0.1.0, source_hash: 70ed6ddee1ee9645}
"""


def test_format_1_table_upgraded_loads_stale(dirs, tmp_path):
    path = tmp_path / "t" / select.file_name(GPU, CC)
    path.parent.mkdir()
    path.write_text(V1)
    assert "format 1" in read_file(path).error          # the library reads format 2 only
    assert upgrade_v1(path) == path
    tf = read_file(path)
    assert (tf.error, tf.bad_entries, tf.gpu_name, tf.cc) == ("", [], GPU, "8.0")
    bwd, fwd = tf.entries
    assert bwd.key == ("bwd", "fa2_bwd", "bf16", 64, False, (), 512)
    assert fwd.key == ("fwd", "fa2_fwd", "fp16", 128, True, (), 4096)
    assert bwd.stamp == {"version": 1, "code_hash": "retired-de0fc6d47bc8c80f"}
    assert fwd.stamp == {"version": 1, "code_hash": "retired-70ed6ddee1ee9645"}
    assert bwd.config == {"Br": 32, "Bc": 128, "warps": 4, "stages": 2, "dsplit": 1, "qsplit": 1}
    assert bwd.runners_up[0]["median_ms"] == 0.849 and fwd.note.startswith("heuristic kept")
    assert bwd.env["source_hash"] == "de0fc6d47bc8c80f"    # the record is kept
    assert upgrade_v1(path) == path and read_file(path).entries == tf.entries   # idempotent
    # stale on purpose: one warning, the heuristic
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cfg, source = pick(dtype="fp16", dirs=[path.parent])
        cfg2, source2 = pick(dtype="fp16", dirs=[path.parent])
    assert len(w) == 1 and "retired-70ed6ddee1ee9645" in str(w[0].message)
    assert source.startswith("heuristic (") and "stale" in source and cfg == cfg2
    # upgrading to another file leaves the original alone
    v1 = tmp_path / "v1.yaml"
    v1.write_text(V1)
    out = upgrade_v1(v1, tmp_path / "v2.yaml")
    assert v1.read_text() == V1 and read_file(out).entries == tf.entries


def test_format_1_upgrade_refuses_junk(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text(V1.replace("kernel: fwd, dtype: fp16", "kernel: sideways, dtype: fp16"))
    with pytest.raises(ValueError, match="entry 1: KeyError"):
        upgrade_v1(path)


def test_shipped_tables_load_and_make_valid_configs(monkeypatch):
    """The shipped tables load without errors, whatever families their entries are of
    (the H100's: sm90_fwd and fa2_bwd since the re-tune); every entry names a registered family and
    a valid config; a table holds entries or device rules (the H200's: rules only)."""
    monkeypatch.undo()
    shipped = list(Path(select.shipped_dir()).glob("*.yaml"))
    assert SHIPPED_H100 in shipped
    for path in shipped:
        tf = read_file(path)
        assert (tf.error, tf.bad_entries) == ("", []), path
        assert (tf.entries or tf.rules) and path.name == select.file_name(tf.gpu_name, tf.cc)
        for e in tf.entries:
            fam = registry.get(e.family)
            assert fam.op == e.op and set(e.stamp) == {"version", "code_hash"}
            if str(e.stamp["version"]) != str(fam.version):
                continue  # an older meaning of the family's parameters: selection ignores it
            cfg = fam.make(e.config, Problem(e.op, e.dtype, 1, e.seqlen, e.seqlen, 1, 1,
                                             e.head_dim, e.causal))
            assert not cfg.problems(H100_SMEM), (path.name, e.key)
