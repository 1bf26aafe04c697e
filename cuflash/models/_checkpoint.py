"""Reading checkpoints for cuflash.models' ``from_pretrained`` (no packages beyond torch): a
``.safetensors`` file (parsed here: an 8-byte little-endian header length, the JSON header, the
tensors' bytes; the tensors are views of a private memory map, so only what is read is paged in),
a ``torch.save`` file (``torch.load`` with ``weights_only=True``, on the CPU), and a Hugging Face
model directory (``config.json`` and ``model.safetensors`` / ``model.safetensors.index.json`` /
``pytorch_model.bin`` / ``pytorch_model.bin.index.json``, or the directory's one ``*.safetensors``
file). A name that is no local path but a Hugging Face hub model id (``name`` or ``org/name``) is
resolved to the local Hugging Face cache, downloading what it lacks (``cuflash.utils.hub``);
anything else raises ``FileNotFoundError``. A malformed file raises ``ValueError`` naming it."""
from __future__ import annotations

import json
import mmap
import os
import struct
import sys
import types
from collections import OrderedDict
from collections.abc import Mapping

import torch

from ..api import UnsupportedFeature

__all__ = ["load_safetensors", "save_safetensors", "load_state_dict_from", "load_hf_config", "checkpoint_files",
           "resolve_source"]

_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
           "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
           "F64": torch.float64}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E4M3", "float8_e4m3fn"),
                     ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)
_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024       # the format's own limit on the JSON header


def load_safetensors(path) -> "OrderedDict[str, torch.Tensor]":
    """The tensors of a .safetensors file, in the header's order (CPU tensors viewing a private,
    copy-on-write memory map of the file; ``__metadata__`` is skipped)."""
    if sys.byteorder != "little":
        raise UnsupportedFeature("load_safetensors: the format is little-endian; this host is not")
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise ValueError(f"{path}: not a safetensors file (header length {n} for a file of {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: the safetensors header is not valid JSON ({e})") from None
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > 8 + n else None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object")
    out = OrderedDict()
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = [int(s) for s in info["shape"]]
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: tensor {name!r}: a header entry needs a known dtype (one of "
                             f"{sorted(_DTYPES)}), a shape and data_offsets, got {info!r}") from None
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if min(shape, default=0) < 0 or not 0 <= begin <= end or end - begin != nbytes or 8 + n + end > size:
            raise ValueError(f"{path}: tensor {name!r}: data_offsets {[begin, end]} do not fit its dtype "
                             f"{info['dtype']} and shape {shape} within the file")
        if numel == 0:
            out[name] = torch.empty(shape, dtype=dtype)
        else:
            out[name] = torch.frombuffer(data, dtype=dtype, count=numel, offset=8 + n + begin).reshape(shape)
    return out


def save_safetensors(tensors: Mapping, path, metadata=None) -> None:
    """Writes ``tensors`` (name → CPU-copyable tensor) as a .safetensors file (each tensor
    contiguous, the header padded with spaces to a multiple of 8 bytes, as the format's writers do)."""
    header, blobs, offset = {}, [], 0
    if metadata is not None:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, t in tensors.items():
        if t.dtype not in _NAMES:
            raise ValueError(f"save_safetensors: tensor {name!r} has dtype {t.dtype}, which the format lacks")
        t = t.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(os.fspath(path), "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)


def _load_file(path) -> dict:
    path = os.fspath(path)
    if path.endswith(".safetensors"):
        return load_safetensors(path)
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises several kinds for a file it cannot read
        raise ValueError(f"{path}: not a safetensors file nor a torch.save checkpoint readable with "
                         f"weights_only=True ({type(e).__name__}: {e})") from None
    # training checkpoints: {"state_dict": ...} or {"model": ...}
    if isinstance(sd, Mapping) and not any(isinstance(v, torch.Tensor) for v in sd.values()):
        for key in ("state_dict", "model", "module"):
            if isinstance(sd.get(key), Mapping):
                return sd[key]
    if not isinstance(sd, Mapping):
        raise ValueError(f"{path}: the checkpoint holds a {type(sd).__name__}, not a state dict")
    return sd


_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def checkpoint_files(directory) -> list:
    """The weight files of a Hugging Face model directory, in load order (see the module docstring)."""
    directory = os.fspath(directory)
    for name in _WEIGHTS:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        if not name.endswith(".index.json"):
            return [path]
        with open(path) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path}: a sharded checkpoint index needs a 'weight_map' object") from None
        shards = list(dict.fromkeys(weight_map.values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(directory, s))]
        if missing:
            raise ValueError(f"{path}: shard files missing in {directory}: {missing[:4]}")
        return [os.path.join(directory, s) for s in shards]
    singles = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    if len(singles) == 1:
        return [os.path.join(directory, singles[0])]
    raise ValueError(f"{directory}: no weights found (looked for {', '.join(_WEIGHTS)}, or one *.safetensors file)")


def resolve_source(source, who: str = "from_pretrained", revision: str = "main", token=None, cache_dir=None,
                   local_files_only: bool = False) -> str:
    """A local path for `source`: itself when it is a local file or directory, else (a hub model
    id, ``name`` or ``org/name``) the Hugging Face cache snapshot holding its config.json and
    weights, downloaded when the cache lacks them (``cuflash.utils.hub.resolve_model``)."""
    if isinstance(source, (str, os.PathLike)) and os.path.exists(source):
        return os.fspath(source)
    from ..utils import hub

    if not hub.is_repo_id(source):
        if isinstance(source, (str, os.PathLike)):
            raise FileNotFoundError(f"{who}({source!r}): no such local file or directory, and not a Hugging Face "
                                    "hub model id ('name' or 'org/name')")
        raise ValueError(f"{who}: the model name must be a local path or a hub model id, got "
                         f"{type(source).__name__} {source!r}")
    try:
        return hub.resolve_model(source, revision=revision, token=token, cache_dir=cache_dir,
                                 local_files_only=local_files_only, weight_files=_WEIGHTS)
    except hub.HubError as err:
        raise type(err)(f"{who}({source!r}): no local path of that name; from the Hugging Face hub: {err}") from None


def load_state_dict_from(source, who: str = "from_pretrained", **hub) -> "OrderedDict[str, torch.Tensor]":
    """A state dict from a local checkpoint file or model directory (all shards merged), or a hub
    model id (``hub``: revision, token, cache_dir, local_files_only; see resolve_source)."""
    source = resolve_source(source, who, **hub)
    files = checkpoint_files(source) if os.path.isdir(source) else [source]
    out = OrderedDict()
    for path in files:
        out.update(_load_file(path))
    return out


def load_hf_config(directory):
    """The directory's config.json as a SimpleNamespace (None when there is none)."""
    path = os.path.join(os.fspath(directory), "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        try:
            values = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path}: a model config must be a JSON object")
    return types.SimpleNamespace(**values)
