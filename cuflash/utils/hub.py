"""Hugging Face hub names for cuflash.models' ``from_pretrained`` (stdlib only: urllib, no
``huggingface_hub`` / ``transformers``).

A model name ``org/name`` (or a bare ``name``, e.g. ``gpt2``) that is not a local path resolves to a
folder of the Hugging Face cache, the layout ``huggingface_hub`` writes and reads:
``<cache>/models--org--name/blobs/<etag>`` (the files), ``snapshots/<commit>/<file>`` (relative
symlinks to the blobs; copies where links fail) and ``refs/<revision>`` (the commit of a branch or
tag). The cache is ``cache_dir=``, else ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``.

``resolve_model`` looks in the cache first: a snapshot of the revision that holds the weights
(``model.safetensors``, its ``.index.json`` and shards, ``pytorch_model.bin`` or its index) is used
with no network at all (a branch once cached is not looked up again: delete ``refs/<branch>``, or
pass a commit, to move on). Otherwise it downloads ``config.json`` (when the repo has one), then the
first of those weights the repo has, from ``{$HF_ENDPOINT or https://huggingface.co}/{repo}/resolve/
{revision}/{file}``; every file after the first is asked for at the commit the first one came from,
so a branch that moves meanwhile cannot mix two commits. Each file is written to a temporary file in
``blobs/`` and renamed into place (a killed download leaves no partial file under its name); its
length is checked against Content-Length and, for LFS files, its sha256 against the hub's etag.

``token=`` (a string; ``False``: none), else ``$HF_TOKEN``, else the file ``$HF_TOKEN_PATH`` /
``$HF_HOME/token`` that ``huggingface-cli login`` writes, is sent as ``Authorization: Bearer``, only
to the endpoint's host (not to the CDN the hub redirects large files to). ``HF_HUB_OFFLINE=1`` (or
``local_files_only=True``) uses the cache only. Failures raise ``HubError`` (an ``OSError``) naming
the repo, the file and the revision: 401 / 403 (private or gated repos, with what to do), 404 (no
such repo, revision or file), other HTTP statuses, network errors and timeouts
(``$HF_HUB_DOWNLOAD_TIMEOUT`` seconds, default 10), and a name missing from the cache when offline.
There is no fallback to random weights: a model is loaded from the files or not made. Each download
is logged at INFO level (logger ``cuflash.utils.hub``) with its size."""
from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import urllib.error
import urllib.parse
import urllib.request

__all__ = ["HubError", "EntryNotFoundError", "hub_cache_dir", "is_repo_id", "cached_file", "resolve_model",
           "WEIGHT_FILES"]

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
_TRUE = ("1", "true", "yes", "on")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")
_CHUNK = 1 << 20
logger = logging.getLogger(__name__)


class HubError(OSError):
    """A hub name that cannot be resolved to local files (see the module docstring)."""


class EntryNotFoundError(HubError, FileNotFoundError):
    """The repo (at that revision) has no such file: HTTP 404 for the file, or offline and not cached."""


def hub_cache_dir(cache_dir=None) -> str:
    """The Hugging Face hub cache folder (see the module docstring for the order)."""
    if cache_dir is not None:
        return os.fspath(cache_dir)
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return os.path.expanduser(os.environ[var])
    return os.path.join(_hf_home(), "hub")


def _hf_home() -> str:
    if os.environ.get("HF_HOME"):
        return os.path.expanduser(os.environ["HF_HOME"])
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "huggingface")


def _endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _offline(local_files_only: bool) -> bool:
    return bool(local_files_only) or any(os.environ.get(v, "").lower() in _TRUE
                                         for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _timeout() -> float:
    value = os.environ.get("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"HF_HUB_DOWNLOAD_TIMEOUT must be a number of seconds, got {value!r}") from None


def _token(token):
    """The bearer token to send (None: none)."""
    if token is False:
        return None
    if token is not None and token is not True:
        if not isinstance(token, str) or not token.strip():
            raise ValueError(f"token must be a non-empty string, True, False or None, got {token!r}")
        return token.strip()
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        if os.environ.get(var, "").strip():
            return os.environ[var].strip()
    path = os.environ.get("HF_TOKEN_PATH") or os.path.join(_hf_home(), "token")
    try:
        with open(os.path.expanduser(path)) as f:
            return f.read().strip() or None
    except OSError:
        return None


def is_repo_id(name) -> bool:
    """Whether `name` can be a hub model id: ``name`` or ``org/name`` (letters, digits, ``. _ -``;
    no ``--`` or ``..``, not starting with ``.`` or ``-``)."""
    return (isinstance(name, str) and _REPO_ID.fullmatch(name) is not None and "--" not in name
            and ".." not in name and not name.endswith("."))


def _check_revision(revision) -> str:
    if not isinstance(revision, str) or not revision or ".." in revision or revision.startswith("/"):
        raise ValueError(f"revision must be a branch, tag or commit name, got {revision!r}")
    return revision


def _check_filename(filename, repo_id: str) -> str:
    """A file name of the repo (shard names come from the repo's index: none may leave the snapshot)."""
    parts = filename.split("/") if isinstance(filename, str) else []
    if not parts or "\\" in filename or any(p in ("", ".", "..") for p in parts):
        raise HubError(f"{repo_id}: {filename!r} is not a file name inside the repo")
    return filename


def _repo_folder(repo_id: str, cache_dir) -> str:
    return os.path.join(hub_cache_dir(cache_dir), "models--" + repo_id.replace("/", "--"))


def _cached_commit(folder: str, revision: str):
    """The commit `revision` names in the cache (None: unknown there)."""
    ref = os.path.join(folder, "refs", revision)
    if os.path.isfile(ref):
        with open(ref) as f:
            commit = f.read().strip()
        return commit or None
    return revision if _COMMIT.fullmatch(revision) else None


def _atomic_write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _link(blob: str, pointer: str) -> None:
    """pointer → blob (a relative symlink, renamed into place; a copy where links fail)."""
    os.makedirs(os.path.dirname(pointer), exist_ok=True)
    tmp = os.path.join(os.path.dirname(pointer),
                       f".tmp-{os.getpid()}-{threading.get_ident()}-{os.path.basename(pointer)}")
    _unlink(tmp)
    try:
        os.symlink(os.path.relpath(blob, os.path.dirname(pointer)), tmp)
    except (OSError, NotImplementedError):
        shutil.copyfile(blob, tmp)
    try:
        os.replace(tmp, pointer)
    except BaseException:
        _unlink(tmp)
        raise


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows redirects, keeps the hub's headers of every hop (X-Repo-Commit and the etags come
    with the hub's own answer, not the CDN's) and sends the token to the endpoint's host only."""

    def __init__(self, origin: str, auth):
        self.origin, self.auth, self.hops = origin, auth, []

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        self.hops.append(headers)
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and self.auth and _origin(new.full_url) == self.origin:
            new.add_unredirected_header("Authorization", self.auth)
        return new


def _origin(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


def _header(hops, name):
    for headers in hops:
        value = headers.get(name)
        if value:
            return value
    return None


def _error_text(err: urllib.error.HTTPError, what: str, has_token: bool) -> str:
    code = err.headers.get("X-Error-Code", "") if err.headers else ""
    detail = err.headers.get("X-Error-Message", "") if err.headers else ""
    detail = f" ({detail})" if detail else ""
    if err.code == 401:
        hint = ("the token sent (token= / HF_TOKEN) was refused, or the repo does not exist" if has_token else
                "the repo is private or gated, or does not exist: pass token= or set HF_TOKEN")
        return f"{what}: HTTP 401 Unauthorized{detail}: {hint}"
    if err.code == 403:
        return (f"{what}: HTTP 403 Forbidden{detail}: the token has no access to this repo (a gated repo needs its "
                "terms accepted on the hub with the token's account)")
    if err.code == 404:
        kind = {"RepoNotFound": "no such repo", "RevisionNotFound": "no such revision",
                "EntryNotFound": "no such file in the repo"}.get(code, "not found")
        return f"{what}: HTTP 404 ({kind}){detail}"
    return f"{what}: HTTP {err.code} {err.reason}{detail}"


def _download(repo_id: str, filename: str, revision: str, folder: str, token):
    """Downloads one file into the cache; returns (snapshot path, commit). A missing file raises
    EntryNotFoundError, every other failure HubError."""
    _check_filename(filename, repo_id)
    endpoint = _endpoint()
    url = (f"{endpoint}/{urllib.parse.quote(repo_id)}/resolve/{urllib.parse.quote(revision, safe='')}/"
           f"{urllib.parse.quote(filename)}")
    what = f"{repo_id}: {filename} at revision {revision!r} ({url})"
    auth = f"Bearer {token}" if token else None
    redirects = _Redirects(_origin(url), auth)
    opener = urllib.request.build_opener(redirects)
    req = urllib.request.Request(url, headers={"User-Agent": "cuflash (urllib)", "Accept-Encoding": "identity"})
    if auth:
        req.add_unredirected_header("Authorization", auth)
    try:
        resp = opener.open(req, timeout=_timeout())
    except urllib.error.HTTPError as err:
        text = _error_text(err, what, bool(token))
        code = err.headers.get("X-Error-Code", "") if err.headers else ""
        err.close()
        if err.code == 404 and code not in ("RepoNotFound", "RevisionNotFound"):
            raise EntryNotFoundError(text) from None
        raise HubError(text) from None
    except (urllib.error.URLError, http.client.HTTPException, socket.timeout, TimeoutError, ConnectionError) as err:
        reason = getattr(err, "reason", err)
        raise HubError(f"{what}: could not download ({type(err).__name__}: {reason}); check the network or "
                       "HF_ENDPOINT, or set HF_HUB_OFFLINE=1 to use the local cache only") from None
    with resp:
        hops = redirects.hops + [resp.headers]
        commit = _header(hops, "X-Repo-Commit")
        if commit is None and _COMMIT.fullmatch(revision):
            commit = revision
        if commit is None or not _COMMIT.fullmatch(commit):
            raise HubError(f"{what}: the server sent no commit hash (X-Repo-Commit: {commit!r}); HF_ENDPOINT must be "
                           "a Hugging Face hub (or a mirror that passes its headers on)")
        etag = _header(hops, "X-Linked-Etag") or _header(hops, "ETag")
        etag = etag.strip().removeprefix("W/").strip('"') if etag else None
        if etag is not None and not re.fullmatch(r"[0-9A-Za-z_-]{8,128}", etag):
            etag = None                                # not usable as a file name: named by its sha256
        length = resp.headers.get("Content-Length")
        logger.info("downloading %s/%s (%s bytes, commit %s) into %s", repo_id, filename, length or "?", commit, folder)
        blobs = os.path.join(folder, "blobs")
        os.makedirs(blobs, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=blobs, suffix=".incomplete")
        try:
            sha, size = hashlib.sha256(), 0
            with os.fdopen(fd, "wb") as f:
                while True:
                    try:
                        chunk = resp.read(_CHUNK)
                    except (OSError, http.client.HTTPException) as err:
                        raise HubError(f"{what}: the download broke off after {size} bytes ({type(err).__name__}: "
                                       f"{err})") from None
                    if not chunk:
                        break
                    f.write(chunk)
                    sha.update(chunk)
                    size += len(chunk)
            if length is not None and length.isdigit() and int(length) != size:
                raise HubError(f"{what}: got {size} bytes of {length} (the download broke off)")
            digest = sha.hexdigest()
            if etag is not None and re.fullmatch(r"[0-9a-f]{64}", etag) and etag != digest:
                raise HubError(f"{what}: the file's sha256 {digest} differs from the hub's {etag} (a corrupt "
                               "download)")
            blob = os.path.join(blobs, etag or digest)
            os.replace(tmp, blob)
        except BaseException:
            _unlink(tmp)
            raise
    pointer = os.path.join(folder, "snapshots", commit, *filename.split("/"))
    _link(blob, pointer)
    if revision != commit:
        _atomic_write_text(os.path.join(folder, "refs", revision), commit)
    return pointer, commit


def cached_file(repo_id: str, filename: str, revision: str = "main", token=None, cache_dir=None,
                local_files_only: bool = False):
    """The local path of `filename` of hub repo `repo_id` at `revision`: from the cache if there,
    else downloaded (see the module docstring). A file the repo lacks raises EntryNotFoundError."""
    if not is_repo_id(repo_id):
        raise ValueError(f"{repo_id!r} is not a Hugging Face hub model id ('name' or 'org/name')")
    revision = _check_revision(revision)
    _check_filename(filename, repo_id)
    folder = _repo_folder(repo_id, cache_dir)
    commit = _cached_commit(folder, revision)
    if commit is not None:
        path = os.path.join(folder, "snapshots", commit, *filename.split("/"))
        if os.path.isfile(path):
            return path
    if _offline(local_files_only):
        raise EntryNotFoundError(f"{repo_id}: {filename} at revision {revision!r} is not in the Hugging Face cache "
                                 f"({folder}) and downloads are off (HF_HUB_OFFLINE=1 or local_files_only=True)")
    return _download(repo_id, filename, revision, folder, _token(token))[0]


def _shards(index_path: str):
    with open(index_path) as f:
        try:
            weight_map = json.load(f)["weight_map"]
            shards = list(dict.fromkeys(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{index_path}: a sharded checkpoint index needs a 'weight_map' object") from None
    for shard in shards:
        _check_filename(shard, index_path)
    return shards


def _complete_snapshot(snapshot: str, weight_files) -> bool:
    """Whether a cached snapshot already holds a full set of weights (config.json is taken as it is)."""
    for name in weight_files:
        path = os.path.join(snapshot, name)
        if os.path.isfile(path):
            if not name.endswith(".index.json"):
                return True
            return all(os.path.isfile(os.path.join(snapshot, s)) for s in _shards(path))
    return False


def resolve_model(repo_id: str, revision: str = "main", token=None, cache_dir=None, local_files_only: bool = False,
                  weight_files=WEIGHT_FILES, config: bool = True) -> str:
    """The cache snapshot folder of hub model `repo_id` at `revision` holding its config.json (when
    `config` and the repo has one) and the first of `weight_files` it has (with the shards of an
    ``*.index.json``), downloading what the cache lacks (see the module docstring)."""
    if not is_repo_id(repo_id):
        raise ValueError(f"{repo_id!r} is not a Hugging Face hub model id ('name' or 'org/name')")
    revision = _check_revision(revision)
    folder = _repo_folder(repo_id, cache_dir)
    commit = _cached_commit(folder, revision)
    if commit is not None:
        snapshot = os.path.join(folder, "snapshots", commit)
        if os.path.isdir(snapshot) and _complete_snapshot(snapshot, weight_files):
            return snapshot
    if _offline(local_files_only):
        raise HubError(f"{repo_id} at revision {revision!r}: not in the Hugging Face cache ({folder}) with its "
                       f"weights ({' / '.join(weight_files)}), and downloads are off (HF_HUB_OFFLINE=1 or "
                       "local_files_only=True)")
    token = _token(token)
    at = revision
    if config:
        try:
            at = _download(repo_id, "config.json", revision, folder, token)[1]
        except EntryNotFoundError:
            pass
    for name in weight_files:
        try:
            path, at = _download(repo_id, name, at, folder, token)
        except EntryNotFoundError:
            continue
        snapshot = os.path.join(folder, "snapshots", at)
        if name.endswith(".index.json"):
            for shard in _shards(path):
                if not os.path.isfile(os.path.join(snapshot, shard)):
                    try:
                        _download(repo_id, shard, at, folder, token)
                    except EntryNotFoundError as err:
                        raise HubError(f"{err} (a shard named by {name})") from None
        if revision != at:
            _atomic_write_text(os.path.join(folder, "refs", revision), at)
        return snapshot
    raise HubError(f"{repo_id} at revision {revision!r}: the repo has none of {', '.join(weight_files)} "
                   f"({_endpoint()}/{repo_id})")
