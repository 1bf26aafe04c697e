"""Tuned tables (tuning/table.py): YAML round trip, lookup order, every fallback path,
stale and corrupt files (one warning per file, never an exception). CPU only."""
import logging
import os
import warnings

import pytest

import cuflash.config as cc
from tuning import table
from tuning.table import Entry, TunedTableWarning, choose, lookup, read_file, save_entries

GPU, CC = "NVIDIA Test GPU 80GB", (9, 0)
H100_SMEM = cc.MAX_SMEM_BY_ARCH[(9, 0)]


@pytest.fixture(autouse=True)
def dirs(tmp_path, monkeypatch):
    """A private user cache dir and shipped dir for every test; a clean cache."""
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    monkeypatch.setenv(table.ENV_VAR, str(user))
    monkeypatch.setattr(table, "SHIPPED_DIR", shipped)
    table.clear_cache()
    yield user, shipped
    table.clear_cache()


def entry(seqlen=4096, head_dim=128, causal=True, dtype="bf16", kernel="fwd", stamp=None, **cfg):
    params = {"Br": 128, "Bc": 64, "warps": 4, "stages": 2}
    params.update(cfg)
    env = dict(table.current_stamp(kernel) if stamp is None else stamp, gpu=GPU, cc="9.0")
    return Entry(kernel, dtype, head_dim, causal, seqlen, params, median_ms=1.25, tflops=300.0,
                 runners_up=[{"config": dict(params, stages=3), "median_ms": 1.3, "tflops": 290.0}],
                 env=env)


def find(**kw):
    args = dict(kernel="fwd", gpu_name=GPU, cc=CC, dtype="bf16", head_dim=128, causal=True,
                seqlen=4096, max_smem=H100_SMEM)
    args.update(kw)
    return lookup(**args)


def no_warnings():
    return warnings.catch_warnings(record=True)


# ---------------------------------------------------------------------------------------
# files

def test_yaml_round_trip_and_merge(dirs):
    user, _ = dirs
    e1, e2 = entry(4096), entry(8192, Bc=32)
    path = save_entries([e1, e2], GPU, CC)
    assert path.parent == user and path.name == "NVIDIA_Test_GPU_80GB_sm90.yaml"
    tf = read_file(path)
    assert (tf.gpu_name, tf.cc, tf.error, tf.bad_entries) == (GPU, "9.0", "", [])
    assert [e.to_dict() for e in tf.entries] == [e1.to_dict(), e2.to_dict()]
    # same key replaced, others kept
    e1b = entry(4096, stages=3)
    save_entries([e1b], GPU, CC)
    tf = read_file(path)
    assert [e.config["stages"] for e in tf.entries] == [3, 2]
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o644)


def test_save_moves_a_corrupt_file_aside(dirs):
    user, _ = dirs
    user.mkdir()
    bad = user / table.file_name(GPU, CC)
    bad.write_text("{{{ not yaml")
    save_entries([entry()], GPU, CC)
    assert (user / (bad.name + ".corrupt")).read_text() == "{{{ not yaml"
    assert read_file(bad).entries[0].config["Br"] == 128


def test_cc_forms():
    assert table.cc_str((9, 0)) == table.cc_str("9.0") == table.cc_str("90") == "9.0"
    assert table.cc_str((12, 0)) == table.cc_str("120") == "12.0"


def test_user_dir_env_var_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv(table.ENV_VAR, str(tmp_path / "x"))
    assert table.user_dir() == tmp_path / "x"
    monkeypatch.delenv(table.ENV_VAR)
    assert table.user_dir().parts[-3:] == (".cache", "cuflash", "tuned")


# ---------------------------------------------------------------------------------------
# lookup order

def test_exact_key(dirs):
    path = save_entries([entry(4096, Bc=32), entry(8192)], GPU, CC)
    with no_warnings() as w:
        cfg, source = find(seqlen=4000)
    assert not w
    assert cfg == cc.FwdConfig(128, 32, 4, 2, 128, "bf16", True)
    assert str(path) in source and "s4096" in source and "nearest" not in source


def test_nearest_bucket_and_tie_prefers_longer(dirs):
    save_entries([entry(1024, Bc=32), entry(4096)], GPU, CC)
    cfg, source = find(seqlen=512)
    assert cfg.Bc == 32 and "nearest bucket to s512" in source
    cfg, _ = find(seqlen=2048)              # 1024 and 4096 both one octave away
    assert cfg.Bc == 64
    cfg, _ = find(seqlen=16384)
    assert cfg.Bc == 64
    cfg, source = find(seqlen=None)          # no seqlen: the longest bucket
    assert cfg.Bc == 64 and "s4096" in source


def test_head_dim_is_rounded_like_the_kernel(dirs):
    save_entries([entry(head_dim=80)], GPU, CC)
    cfg, _ = find(head_dim=72)
    assert cfg is not None and cfg.head_dim == 80


@pytest.mark.parametrize("change", [dict(gpu_name="Other GPU"), dict(cc=(8, 0)),
                                    dict(dtype="fp16"), dict(causal=False), dict(head_dim=64),
                                    dict(kernel="flash_fwd", head_dim=256)])
def test_no_entry_for_other_keys(dirs, change):
    save_entries([entry()], GPU, CC)
    with no_warnings() as w:
        cfg, why = find(**change)
    assert cfg is None and "no usable tuned entry" in why and not w


def test_no_files_at_all():
    cfg, why = find()
    assert cfg is None and "no usable tuned entry for fwd bf16 d128 causal" in why


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


def test_files_are_found_by_content_not_name(dirs):
    _, shipped = dirs
    path = save_entries([entry()], GPU, CC, directory=shipped)
    path.rename(shipped / "whatever.yaml")
    cfg, source = find()
    assert cfg is not None and "whatever.yaml" in source


def test_entry_that_the_device_cannot_run_is_skipped(dirs):
    save_entries([entry()], GPU, CC)        # 104 KB of shared memory
    with pytest.warns(TunedTableWarning, match="does not give a valid config.*shared memory"):
        cfg, why = find(max_smem=48 * 1024)
    assert cfg is None and "1 invalid skipped" in why


def test_debug_log_names_the_choice(dirs, caplog):
    save_entries([entry()], GPU, CC)
    with caplog.at_level(logging.DEBUG, logger="cuflash.tuning"):
        cfg, _ = find()
    assert cfg.name in caplog.text


# ---------------------------------------------------------------------------------------
# stale and corrupt: one warning per file, then the fallback

@pytest.mark.parametrize("field", ["source_hash", "cuflash"])
def test_stale_entry_warns_once_and_falls_back(dirs, field):
    stamp = dict(table.current_stamp("fwd"))
    stamp[field] = "0000-old"
    path = save_entries([entry(stamp=stamp)], GPU, CC)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3):
            cfg, why = find()
            assert cfg is None and "stale skipped" in why
    assert len(w) == 1 and issubclass(w[0].category, TunedTableWarning)
    assert str(path) in str(w[0].message) and "0000-old" in str(w[0].message)
    cfg, source = choose("fwd", 128, "bf16", True, 4096, gpu_name=GPU, cc=CC, max_smem=H100_SMEM)
    assert cfg == cc.default_fwd_config(128, "bf16", True, (9, 0), H100_SMEM)
    assert source.startswith("heuristic (") and "stale" in source


def test_stale_exact_bucket_uses_a_fresh_neighbour(dirs):
    stale = dict(table.current_stamp("fwd"), source_hash="old")
    save_entries([entry(4096, stamp=stale), entry(8192, Bc=32)], GPU, CC)
    with pytest.warns(TunedTableWarning, match="stale"):
        cfg, source = find(seqlen=4096)
    assert cfg.Bc == 32 and "s8192" in source


@pytest.mark.parametrize("text, what", [
    ("{{{ not: yaml", "cannot be read as YAML"),
    ("- just\n- a list\n", "top level must be a mapping"),
    ("format: 1\nentries: []\n", "is not a tuned table"),
    ("format: 99\ngpu: {name: x, cc: '9.0'}\n", "format 99"),
    (b"\xff\xfe\x00garbage", "cannot be read as YAML"),
])
def test_corrupt_file_warns_once_and_others_still_work(dirs, text, what):
    user, shipped = dirs
    user.mkdir()
    bad = user / "broken.yaml"
    bad.write_bytes(text if isinstance(text, bytes) else text.encode())
    save_entries([entry()], GPU, CC, directory=shipped)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3):
            cfg, source = find()
            assert cfg is not None and "shipped" in source
    assert len(w) == 1 and what in str(w[0].message) and "broken.yaml" in str(w[0].message)


def test_unreadable_path_named_like_a_table(dirs):
    user, _ = dirs
    (user / "dir.yaml").mkdir(parents=True)
    with pytest.warns(TunedTableWarning, match="dir.yaml"):
        cfg, _ = find()
    assert cfg is None


def test_malformed_and_invalid_entries_are_skipped_not_fatal(dirs):
    user, _ = dirs
    path = save_entries([entry(4096)], GPU, CC)
    text = path.read_text() + (
        "- key: {kernel: fwd, dtype: bf16, head_dim: 128, causal: maybe, seqlen: 8192}\n"
        "  config: {Br: 128, Bc: 64, warps: 4, stages: 2}\n"
        "- key: {kernel: fwd, dtype: bf16, head_dim: 128, causal: true, seqlen: 16384}\n"
        "  config: {Br: 96, Bc: 64, warps: 4, stages: 2, Bz: 1}\n")
    path.write_text(text)
    table.clear_cache()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cfg, source = find(seqlen=16384)
        cfg2, _ = find(seqlen=4096)
    assert len(w) == 1 and "malformed" in str(w[0].message)
    assert cfg is not None and "nearest bucket" in source and cfg == cfg2


def test_an_entry_of_a_config_the_kernel_rejects(dirs):
    save_entries([entry(Br=96)], GPU, CC)   # 96 is not a multiple of 16 * 4 warps
    with pytest.warns(TunedTableWarning, match="Br=96"):
        cfg, source = choose("fwd", 128, "bf16", True, 4096, gpu_name=GPU, cc=CC,
                             max_smem=H100_SMEM)
    assert source.startswith("heuristic") and cfg.Br != 96


def test_changed_file_is_reloaded(dirs):
    path = save_entries([entry(Bc=32)], GPU, CC)
    assert find()[0].Bc == 32
    text = path.read_text().replace("Bc: 32", "Bc: 64")
    path.write_text(text + "\n")   # a different size: the cache sees the change
    assert find()[0].Bc == 64


def test_choose_returns_tuned_or_heuristic(dirs):
    save_entries([entry(Bc=32, stages=3)], GPU, CC)
    cfg, source = choose("fwd", 128, "bf16", True, 4096, gpu_name=GPU, cc="9.0", max_smem=H100_SMEM)
    assert (cfg.Bc, cfg.stages) == (32, 3) and source.startswith("tuned ")
    cfg, source = choose("fwd", 64, "fp16", False, gpu_name=GPU, cc=CC, max_smem=H100_SMEM)
    assert cfg == cc.default_fwd_config(64, "fp16", False, (9, 0), H100_SMEM)
    assert source.startswith("heuristic (no usable tuned entry")


@pytest.mark.skipif(not hasattr(cc, "BwdConfig"), reason="cuflash.config has no BwdConfig yet")
def test_backward_entries_and_deterministic_variant(dirs):
    fresh = table.current_stamp("bwd")
    params = cc.default_bwd_config(128, "bf16", True, (9, 0), H100_SMEM)
    from tuning.space import get_family

    fam = get_family("bwd")
    e = Entry("bwd", "bf16", 128, True, 4096, fam.params(params), 2.0, 250.0, [], dict(fresh))
    save_entries([e], GPU, CC)
    cfg, source = choose("bwd", 128, "bf16", True, 4096, gpu_name=GPU, cc=CC, max_smem=H100_SMEM)
    assert cfg == params and source.startswith("tuned")
    cfg, source = choose("bwd", 128, "bf16", True, 4096, gpu_name=GPU, cc=CC, max_smem=H100_SMEM,
                         deterministic=True)
    assert cfg == params.replace(deterministic=True) and "deterministic variant" in source
    # the forward table is separate
    assert find()[0] is None
