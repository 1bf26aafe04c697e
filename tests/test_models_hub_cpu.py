"""Hugging Face hub model ids in cuflash.models' ``from_pretrained`` (cuflash.utils.hub), without a
GPU and without the network: a local ``http.server`` plays the hub (``/{repo}/resolve/{revision}/
{file}``, X-Repo-Commit, ETag / X-Linked-Etag, 302 redirects of the weights to a second server
on another port that plays the CDN, 401 / 403 / 404 with X-Error-Code) and ``HF_ENDPOINT`` points
at it. Checked: the cache layout (blobs, relative snapshot symlinks, refs), the cache used before
the network (and a cache written by hand, as huggingface_hub writes it, with the endpoint dead),
``HF_HUB_OFFLINE``, the bearer token (sent to the hub, not to the CDN), the error texts (401, 403,
404 of a repo / revision / file, a dead endpoint, a broken or corrupt download, no weights), the
weights fallback chain (safetensors → sharded → bin) and that a downloaded tiny GPT-2 / Llama /
BERT / ViT loads and gives the plain-torch reference forward of tests/test_models_*_cpu.py."""
import hashlib
import http.server
import json
import os
import socket
import sys
import tempfile
import threading
import types

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_models_bert_cpu as tb  # noqa: E402
import test_models_gpt_cpu as g  # noqa: E402
import test_models_vit_cpu as tv  # noqa: E402

from cuflash.models import bert  # noqa: E402
from cuflash.models._checkpoint import save_safetensors  # noqa: E402
from cuflash.models.gpt import GPT2Config, GPTLMHeadModel  # noqa: E402
from cuflash.models.vit import load_pretrained  # noqa: E402
from cuflash.utils import hub  # noqa: E402
from cuflash.utils.pretrained import config_from_pretrained, state_dict_from_pretrained  # noqa: E402

F64 = torch.float64
LFS = (".safetensors", ".bin")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _commit(*parts) -> str:
    return hashlib.sha1("/".join(parts).encode()).hexdigest()


class FakeHub:
    """Repos: id → {"branches": {name: commit}, "commits": {commit: {file: bytes}}, "token": str|None,
    "gated": bool}. Every request is logged as (server, method, path, Authorization header)."""

    def __init__(self):
        self.repos, self.log, self.blobs = {}, [], {}
        self.truncate = self.corrupt = False

    def add(self, repo_id, files, branch="main", token=None, gated=False):
        commit = _commit(repo_id, branch, *sorted(files))
        repo = self.repos.setdefault(repo_id, {"branches": {}, "commits": {}, "token": token, "gated": gated})
        repo["branches"][branch] = commit
        repo["commits"][commit] = dict(files)
        for data in files.values():
            self.blobs[_sha(data)] = data
        return commit

    def handler(self, name):
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def send(self, code, headers=(), body=b""):
                self.send_response(code)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_HEAD(self):            # huggingface_hub asks for the headers first (the interop test)
                return self.do_GET()

            def do_GET(self):
                fake.log.append((name, self.command, self.path, self.headers.get("Authorization")))
                if name == "cdn":
                    data = fake.blobs.get(self.path.rsplit("/", 1)[-1])
                    if data is None:
                        return self.send(404)
                    if fake.corrupt:
                        data = bytes([data[0] ^ 1]) + data[1:]
                    if fake.truncate and self.command == "GET":       # promise the full length, send half, close
                        self.send_response(200)
                        self.send_header("Content-Length", str(len(data)))
                        self.end_headers()
                        self.wfile.write(data[:len(data) // 2])
                        self.close_connection = True
                        return None
                    return self.send(200, body=data)
                repo_id, sep, rest = self.path.lstrip("/").partition("/resolve/")
                revision, _, filename = rest.partition("/")
                repo = fake.repos.get(repo_id)
                if not sep or repo is None:
                    return self.send(404, [("X-Error-Code", "RepoNotFound"),
                                           ("X-Error-Message", "Repository not found")])
                if repo["token"] is not None and self.headers.get("Authorization") != f"Bearer {repo['token']}":
                    if repo["gated"] and self.headers.get("Authorization"):
                        return self.send(403, [("X-Error-Code", "GatedRepo"),
                                               ("X-Error-Message", "Access to this model is restricted")])
                    return self.send(401, [("X-Error-Code", "RepoNotFound"),
                                           ("X-Error-Message", "Invalid credentials in Authorization header")])
                commit = repo["branches"].get(revision, revision if revision in repo["commits"] else None)
                if commit is None:
                    return self.send(404, [("X-Error-Code", "RevisionNotFound")])
                data = repo["commits"][commit].get(filename)
                if data is None:
                    return self.send(404, [("X-Error-Code", "EntryNotFound"), ("X-Repo-Commit", commit)])
                if filename.endswith(LFS):
                    return self.send(302, [("Location", f"{fake.cdn_url}/blobs/{_sha(data)}"),
                                           ("X-Repo-Commit", commit), ("X-Linked-Etag", f'"{_sha(data)}"'),
                                           ("X-Linked-Size", str(len(data)))])
                blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()   # git's blob id
                return self.send(200, [("X-Repo-Commit", commit), ("ETag", f'"{blob}"')], data)

        return Handler

    def hub_paths(self):
        return [path for server, _, path, _ in self.log if server == "hub"]


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    fake = FakeHub()
    servers = []
    for name in ("hub", "cdn"):
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), fake.handler(name))
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
    fake.url = f"http://127.0.0.1:{servers[0].server_address[1]}"
    fake.cdn_url = f"http://127.0.0.1:{servers[1].server_address[1]}"
    fake.cache = tmp_path / "hf" / "hub"
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN_PATH",
                "HUGGINGFACE_HUB_CACHE", "http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy",
                "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("no_proxy", "*")
    monkeypatch.setenv("NO_PROXY", "*")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(fake.cache))
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    yield fake
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _safetensors(sd) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        save_safetensors(sd, os.path.join(d, "m.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(d, "m.safetensors"), "rb") as f:
            return f.read()


def _config(c, model_type) -> bytes:
    return json.dumps({**vars(c), "model_type": model_type, "architectures": ["X"]}).encode()


def gpt2_repo():
    c = types.SimpleNamespace(**g.TINY, layer_norm_epsilon=1e-5, activation_function="gelu_new")
    sd = {"transformer." + k: v for k, v in g.hf_gpt2_state(GPT2Config(**g.TINY)).items()}
    ref = lambda ids: g.plain_gpt2({k[len("transformer."):]: v for k, v in sd.items()},  # noqa: E731
                                   GPT2Config(**g.TINY), ids)
    return {"config.json": _config(c, "gpt2"), "model.safetensors": _safetensors(sd)}, sd, ref, c.vocab_size


def llama_sharded_repo():
    c = g.llama_cfg()
    sd = g.hf_llama_state(c)
    keys = list(sd)
    files, weight_map = {"config.json": _config(c, "llama")}, {}
    for i, part in enumerate((keys[:len(keys) // 2], keys[len(keys) // 2:])):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        files[name] = _safetensors({k: sd[k] for k in part})
        weight_map.update({k: name for k in part})
    files["model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    return files, sd, (lambda ids: g.plain_llama(sd, c, ids)), c.vocab_size


def _logits_match(m, ref, vocab, tol=None):
    ids = torch.randint(0, vocab, (2, 9))
    got, want = m(ids).logits[..., :vocab], ref(ids)
    assert torch.allclose(got, want, **(tol or dict(atol=1e-9, rtol=1e-8))), (got - want).abs().max()


def _no_partial_files(cache):
    left = [p for p in cache.rglob("*") if p.name.endswith(".incomplete") or p.name.startswith(".tmp-")]
    assert not left, left


# ---------------------------------------------------------------------------------------


def test_gpt2_download_cache_layout_and_reuse(fake_hub):
    files, sd, ref, vocab = gpt2_repo()
    commit = fake_hub.add("tiny-org/gpt2", files)
    m = GPTLMHeadModel.from_pretrained("tiny-org/gpt2", dtype=F64).eval()
    _logits_match(m, ref, vocab)
    folder = fake_hub.cache / "models--tiny-org--gpt2"
    assert (folder / "refs" / "main").read_text() == commit
    snap = folder / "snapshots" / commit
    for name, data in files.items():
        link = snap / name
        assert link.is_symlink() and not os.path.isabs(os.readlink(link)), name
        assert os.path.realpath(link).startswith(str((folder / "blobs").resolve()))
        assert link.read_bytes() == data
    assert os.path.basename(os.path.realpath(snap / "model.safetensors")) == _sha(files["model.safetensors"])
    _no_partial_files(fake_hub.cache)
    assert fake_hub.hub_paths() == ["/tiny-org/gpt2/resolve/main/config.json",
                                    f"/tiny-org/gpt2/resolve/{commit}/model.safetensors"]
    # the cache first: no request at all the second time, nor offline
    n = len(fake_hub.log)
    _logits_match(GPTLMHeadModel.from_pretrained("tiny-org/gpt2", dtype=F64).eval(), ref, vocab)
    assert len(fake_hub.log) == n
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        sd2 = state_dict_from_pretrained("tiny-org/gpt2", dtype=torch.float32)
    finally:
        del os.environ["HF_HUB_OFFLINE"]
    assert len(fake_hub.log) == n
    assert all(sd2[k].dtype == torch.float32 and torch.equal(sd2[k], sd[k].float()) for k in sd)
    # the config helpers read the same config.json
    cfg = GPT2Config.from_pretrained("tiny-org/gpt2", use_flash_attn=True)
    assert cfg.n_embd == g.TINY["n_embd"] and cfg.use_flash_attn and cfg.architectures == ["X"]
    assert config_from_pretrained("tiny-org/gpt2").model_type == "gpt2" and len(fake_hub.log) == n


def test_llama_sharded_fallback_chain_and_revision(fake_hub):
    files, sd, ref, vocab = llama_sharded_repo()
    commit = fake_hub.add("tiny-org/llama", files)
    other = fake_hub.add("tiny-org/llama", {**files, "config.json": files["config.json"] + b" "}, branch="dev")
    m = GPTLMHeadModel.from_pretrained("tiny-org/llama", dtype=F64).eval()
    _logits_match(m, ref, vocab, g.ROTARY_TOL)
    assert fake_hub.hub_paths() == ["/tiny-org/llama/resolve/main/config.json",
                                    f"/tiny-org/llama/resolve/{commit}/model.safetensors",
                                    f"/tiny-org/llama/resolve/{commit}/model.safetensors.index.json",
                                    f"/tiny-org/llama/resolve/{commit}/model-00001-of-00002.safetensors",
                                    f"/tiny-org/llama/resolve/{commit}/model-00002-of-00002.safetensors"]
    # another branch is another snapshot; the same blobs are not stored twice
    _logits_match(GPTLMHeadModel.from_pretrained("tiny-org/llama", revision="dev", dtype=F64).eval(), ref, vocab,
                  g.ROTARY_TOL)
    folder = fake_hub.cache / "models--tiny-org--llama"
    assert (folder / "refs" / "dev").read_text() == other and (folder / "snapshots" / other).is_dir()
    assert len(list((folder / "blobs").iterdir())) == 5       # 2 configs, index, 2 shards
    # a commit hash as the revision: no ref needed
    n = len(fake_hub.log)
    GPTLMHeadModel.from_pretrained("tiny-org/llama", revision=commit, dtype=F64)
    assert len(fake_hub.log) == n


def test_bin_only_repo_and_state_dict_from_pretrained(fake_hub, tmp_path):
    sd = {"w": torch.randn(3, 4), "ids": torch.arange(5)}
    torch.save(sd, tmp_path / "x.bin")
    fake_hub.add("bin-only", {"pytorch_model.bin": (tmp_path / "x.bin").read_bytes()})     # no config.json
    got = state_dict_from_pretrained("bin-only", dtype=F64)
    assert got["w"].dtype == F64 and torch.equal(got["w"], sd["w"].double()) and got["ids"].dtype == torch.int64
    assert [p.rsplit("/", 1)[-1] for p in fake_hub.hub_paths()] == [
        "config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"]
    with pytest.raises(ValueError, match="config is needed"):
        GPTLMHeadModel.from_pretrained("bin-only")


def test_token_header_sent_to_the_hub_only(fake_hub, monkeypatch, tmp_path):
    files, sd, ref, vocab = gpt2_repo()
    fake_hub.add("org/private", files, token="s3cret")
    with pytest.raises(hub.HubError, match=r"org/private.*config\.json.*HTTP 401.*HF_TOKEN"):
        GPTLMHeadModel.from_pretrained("org/private")
    with pytest.raises(hub.HubError, match="HTTP 401.*refused"):
        GPTLMHeadModel.from_pretrained("org/private", token="wrong")
    assert not (fake_hub.cache / "models--org--private" / "snapshots").exists()
    monkeypatch.setenv("HF_TOKEN", "s3cret")
    _logits_match(GPTLMHeadModel.from_pretrained("org/private", dtype=F64).eval(), ref, vocab)
    hub_auth = [a for s, _, p, a in fake_hub.log if s == "hub" and a is not None]
    cdn_auth = [a for s, _, p, a in fake_hub.log if s == "cdn"]
    assert hub_auth[-2:] == ["Bearer s3cret"] * 2 and cdn_auth == [None]
    # token=False sends none; the token file of huggingface-cli login is read when no variable is set
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(hub.HubError, match="401"):
        state_dict_from_pretrained("org/private", token=False, revision="dev")
    (tmp_path / "hf" / "token").write_text("s3cret\n")
    fake_hub.add("org/private2", files, token="s3cret")
    assert set(state_dict_from_pretrained("org/private2")) == set(sd)


def test_errors_name_repo_file_and_revision(fake_hub, monkeypatch):
    files, _, _, _ = gpt2_repo()
    fake_hub.add("org/gated", files, token="granted", gated=True)
    fake_hub.add("org/empty", {"config.json": files["config.json"]})
    fake_hub.add("org/ok", files)
    with pytest.raises(hub.HubError, match=r"org/nope.*HTTP 404 \(no such repo\)"):
        GPTLMHeadModel.from_pretrained("org/nope")
    with pytest.raises(hub.HubError, match=r"org/gated.*HTTP 403.*gated"):
        GPTLMHeadModel.from_pretrained("org/gated", token="someone-else")
    with pytest.raises(hub.HubError, match=r"org/ok.*revision 'v9'.*no such revision"):
        GPTLMHeadModel.from_pretrained("org/ok", revision="v9")
    with pytest.raises(hub.HubError, match=r"org/empty at revision 'main': the repo has none of model\.safetensors"):
        GPTLMHeadModel.from_pretrained("org/empty")
    with pytest.raises(hub.EntryNotFoundError, match=r"org/ok: tokenizer\.json.*no such file"):
        hub.cached_file("org/ok", "tokenizer.json")
    # a broken or corrupt download leaves nothing under the file's name
    fake_hub.truncate = True
    with pytest.raises(hub.HubError, match=r"org/ok: model\.safetensors"):
        GPTLMHeadModel.from_pretrained("org/ok")
    fake_hub.truncate, fake_hub.corrupt = False, True
    with pytest.raises(hub.HubError, match="sha256"):
        GPTLMHeadModel.from_pretrained("org/ok")
    fake_hub.corrupt = False
    snap = next((fake_hub.cache / "models--org--ok" / "snapshots").iterdir())
    assert sorted(p.name for p in snap.iterdir()) == ["config.json"]
    _no_partial_files(fake_hub.cache)
    # offline and not cached; a dead endpoint
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(hub.HubError, match=r"from_pretrained\('org/other'\).*not in the Hugging Face cache.*"
                                           "HF_HUB_OFFLINE"):
        GPTLMHeadModel.from_pretrained("org/other")
    with pytest.raises(hub.HubError, match="HF_HUB_OFFLINE"):
        GPT2Config.from_pretrained("org/other")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(hub.HubError, match="local_files_only"):
        GPTLMHeadModel.from_pretrained("org/other", local_files_only=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{dead}")
    with pytest.raises(hub.HubError, match=r"org/other: config\.json.*could not download.*HF_HUB_OFFLINE=1"):
        GPTLMHeadModel.from_pretrained("org/other")
    # not a path and not a hub id; bad arguments
    with pytest.raises(FileNotFoundError, match="no such local file"):
        GPTLMHeadModel.from_pretrained("./no/such/dir/here")
    with pytest.raises(ValueError, match="revision"):
        hub.cached_file("org/ok", "config.json", revision="../x")
    with pytest.raises(hub.HubError, match="not a file name"):
        hub.cached_file("org/ok", "../../etc/passwd")


def test_prepopulated_cache_without_network(fake_hub, monkeypatch):
    """A cache written as huggingface_hub writes it; the endpoint is dead, so only the cache can serve."""
    files, sd, ref, vocab = llama_sharded_repo()
    commit = "0123456789abcdef0123456789abcdef01234567"
    folder = fake_hub.cache / "models--meta-llama--Tiny-hf"
    (folder / "blobs").mkdir(parents=True)
    (folder / "snapshots" / commit).mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    for name, data in files.items():
        (folder / "blobs" / _sha(data)).write_bytes(data)
        os.symlink(os.path.join("..", "..", "blobs", _sha(data)), folder / "snapshots" / commit / name)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    _logits_match(GPTLMHeadModel.from_pretrained("meta-llama/Tiny-hf", dtype=F64).eval(), ref, vocab, g.ROTARY_TOL)
    assert set(state_dict_from_pretrained("meta-llama/Tiny-hf", revision=commit)) == set(sd)
    assert fake_hub.log == []
    # a missing shard is not a complete snapshot: the download is tried (and fails on the dead endpoint)
    os.unlink(folder / "snapshots" / commit / "model-00002-of-00002.safetensors")
    with pytest.raises(hub.HubError, match="could not download"):
        GPTLMHeadModel.from_pretrained("meta-llama/Tiny-hf")


def test_bert_and_vit_by_hub_name(fake_hub):
    cfg = bert.BertConfig(**tb.TINY)
    sd = tb.hf_bert_state(cfg, dtype=torch.float32)   # the model is made in fp32, then moved to fp64
    conf = {k: v for k, v in vars(cfg).items()}
    fake_hub.add("tiny/bert", {"config.json": json.dumps({**conf, "model_type": "bert"}).encode(),
                               "model.safetensors": _safetensors(sd)})
    m = bert.BertForPreTraining.from_pretrained("tiny/bert").to(F64).eval()     # config from config.json
    assert m.config == bert.BertConfig.from_pretrained("tiny/bert")
    ids, types_, mask = tb.batch(cfg, [7, 3], 7)
    out = m(ids, token_type_ids=types_, attention_mask=mask)
    seq, _, mlm, _ = tb.plain_bert({k: v.double() for k, v in sd.items()}, cfg, ids, types_, mask)
    assert torch.allclose(out.prediction_logits[mask], mlm[mask], atol=1e-10, rtol=1e-9)
    enc = bert.BertModel.from_pretrained("tiny/bert", cfg).to(F64).eval()
    assert torch.allclose(enc(ids, token_type_ids=types_, attention_mask=mask).last_hidden_state[mask], seq[mask],
                          atol=1e-10, rtol=1e-9)
    timm_sd = tv.timm_state()
    fake_hub.add("timm/tiny_vit", {"model.safetensors": _safetensors(timm_sd), "config.json": b'{"num_classes": 5}'})
    img = tv.rnd(2, tv.C, *tv.IMG, scale=1.0)
    want = tv.make(True).eval()
    want.load_state_dict(timm_sd)
    got = load_pretrained(tv.make(True).eval(), "timm/tiny_vit")
    assert torch.equal(got(img), want(img))


def test_repo_id_rules():
    assert hub.is_repo_id("gpt2") and hub.is_repo_id("meta-llama/Llama-2-7b-hf") and hub.is_repo_id("a.b/c_d-1")
    for bad in ("", "/abs", "a/b/c", "a--b/c", "../x", "a/..", ".x", "x.", "a b", None, 3):
        assert not hub.is_repo_id(bad), bad


def test_cache_shared_with_huggingface_hub(fake_hub, monkeypatch, tmp_path):
    """Where huggingface_hub is installed (it is not a dependency): what cuflash downloads is what
    huggingface_hub finds in the cache, and what huggingface_hub downloads cuflash reads offline."""
    hfh = pytest.importorskip("huggingface_hub")
    files, sd, ref, vocab = gpt2_repo()
    commit = fake_hub.add("tiny-org/gpt2", files)
    GPTLMHeadModel.from_pretrained("tiny-org/gpt2")
    for name in files:
        found = hfh.try_to_load_from_cache("tiny-org/gpt2", name, cache_dir=str(fake_hub.cache))
        assert isinstance(found, str) and os.path.samefile(found, fake_hub.cache / "models--tiny-org--gpt2" /
                                                           "snapshots" / commit / name), name
    report = hfh.scan_cache_dir(str(fake_hub.cache))
    assert not report.warnings and [r.repo_id for r in report.repos] == ["tiny-org/gpt2"]
    assert {f.file_name for r in report.repos for rev in r.revisions for f in rev.files} == set(files)
    # the other way: huggingface_hub's download, read by cuflash with the endpoint dead
    files2, sd2, ref2, vocab2 = llama_sharded_repo()
    fake_hub.add("tiny-org/llama", files2)
    other = tmp_path / "hfh_cache"
    for name in files2:
        hfh.hf_hub_download("tiny-org/llama", name, cache_dir=str(other), endpoint=fake_hub.url)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    m = GPTLMHeadModel.from_pretrained("tiny-org/llama", cache_dir=other, dtype=F64).eval()
    _logits_match(m, ref2, vocab2, g.ROTARY_TOL)
