"""Launch plans: everything a repeat call needs, computed once per call shape.

A ``Plan`` is made for one (family, config, shapes, strides, dtype, device, flags, scale):
the loaded kernels, the grid of every launch, and the params struct with every field but
the per-call pointers already packed. A repeat call only writes the pointers (one
``struct.pack_into``) and launches by raw driver call on a raw stream — no dataclass, no
string, no file, no allocation on the host side.

The struct layouts are read from ``kernels_cu/params.cuh`` itself (``struct_dtype``), so
each struct has a single definition.
"""
from __future__ import annotations

import ctypes
import functools
import re
import struct
import threading

import numpy as np

from . import _gpu
from .compile import get_kernels, kernel_dir
from .registry import OPS

_CTYPES = {"const void*": np.uint64, "void*": np.uint64, "const float*": np.uint64,
           "float*": np.uint64, "int*": np.uint64,
           "i64": np.int64, "int": np.int32, "float": np.float32}
_FIELD = re.compile(r"^\s*(const void\*|void\*|const float\*|float\*|int\*|i64|int|float|TmaDesc)\s+(\w+);")
# TmaDesc (params_sm90.cuh): a TMA tensor map, 128 opaque bytes, 64-byte aligned in C. NumPy
# cannot express that alignment, so a struct with one gets explicit C offsets.
_TMA_DESC = np.dtype((np.uint64, 16))
_TMA_ALIGN = 64


def struct_dtype(name: str) -> np.dtype:
    """NumPy dtype laid out like `struct <name>` in params.cuh (C alignment rules)."""
    return _struct_dtype(name, kernel_dir())


@functools.lru_cache(maxsize=None)
def _struct_dtype(name: str, root) -> np.dtype:
    # params.cuh, then the arch-specific params_*.cuh (params_sm90.cuh)
    for path in [root / "params.cuh", *sorted(root.glob("params_*.cuh"))]:
        m = re.search(r"struct\s+" + name + r"\s*(?::\s*(\w+)\s*)?\{(.*?)\};", path.read_text(), re.S)
        if m:
            break
    else:
        raise KeyError(f"struct {name} not found in params.cuh or params_*.cuh")
    base = _struct_dtype(m.group(1), root) if m.group(1) else None  # `struct X : Base {`
    fields = []
    for line in m.group(2).splitlines():
        line = line.split("//")[0]
        if not line.strip():
            continue
        fm = _FIELD.match(line)
        if not fm:
            raise ValueError(f"params.cuh: cannot mirror field line {line.strip()!r} of {name}")
        fields.append((fm.group(2), _TMA_DESC if fm.group(1) == "TmaDesc" else np.dtype(_CTYPES[fm.group(1)])))
    if base is None and all(dt is not _TMA_DESC for _, dt in fields):
        return np.dtype(fields, align=True)
    # explicit offsets: a base's fields where the base has them, the struct's own fields from
    # sizeof(base) on (its tail padding is not reused: the bases are plain C structs)
    offsets, end, align = [], 0, 1
    if base is not None:
        fields = [(n, base.fields[n][0]) for n in base.names] + fields
        offsets = [base.fields[n][1] for n in base.names]
        end, align = base.itemsize, max(base.fields[n][0].alignment for n in base.names)
    for _, dt in fields[len(offsets):]:  # C rules: each field at its alignment, the size a multiple of the largest
        a = _TMA_ALIGN if dt is _TMA_DESC else dt.itemsize
        end = -(-end // a) * a
        offsets.append(end)
        end, align = end + dt.itemsize, max(align, a)
    return np.dtype({"names": [n for n, _ in fields], "formats": [dt for _, dt in fields],
                     "offsets": offsets, "itemsize": -(-end // align) * align})


def pack(name: str, **values) -> np.ndarray:
    """A one-element record array of struct `name`, every field given exactly once."""
    dtype = struct_dtype(name)
    missing, extra = set(dtype.names) - set(values), set(values) - set(dtype.names)
    if missing or extra:
        raise TypeError(f"struct {name}: missing fields {sorted(missing)}, unknown {sorted(extra)}")
    return np.array([tuple(values[n] for n in dtype.names)], dtype=dtype)


class ParamsRecord:
    """A packed params struct (``pack``'s array) and the kernel-argument array that points at it,
    for launchers that call the driver with one by-value struct argument (cross entropy, the
    norms): ``argv_ptr`` is cuLaunchKernel's kernelParams; ``bytes`` the struct to patch per call."""
    __slots__ = ("record", "bytes", "argv", "argv_ptr")

    def __init__(self, record):
        self.record = record
        self.bytes = record.view(np.uint8)
        self.argv = np.array([self.bytes.ctypes.data], dtype=np.uint64)
        self.argv_ptr = int(self.argv.ctypes.data)


class RecordPlan:
    """The base of the helper modules' call plans (the norms, dense_act): one packed ParamsRecord per
    call shape (``rec``, made by the subclass), whose leading pointers each call writes through the
    subclass's ``PTRS`` struct, and a run of launch steps ``(fn, grid x, grid y, threads, smem)`` on
    the plan's device, under a lock (the record is shared; the driver copies it at each launch)."""
    __slots__ = ("device", "rec", "lock", "launch", "get_device", "set_device")
    PTRS: struct.Struct

    def __init__(self, device_index: int):
        from cupy_backends.cuda.api import driver

        self.device = device_index
        self.launch = driver.launchKernel
        self.get_device, self.set_device = _device_fns()
        self.lock = threading.Lock()

    def run(self, ptrs, steps, stream):
        with self.lock:
            self.PTRS.pack_into(self.rec.bytes, 0, *ptrs)
            current = self.get_device()
            if current != self.device:
                self.set_device(self.device)
            try:
                for fn, gx, gy, threads, smem in steps:
                    self.launch(fn, gx, gy, 1, threads, 1, 1, smem, stream, self.rec.argv_ptr, 0)
            finally:
                if current != self.device:
                    self.set_device(current)


def _zeroed_i32(n: int, device: int, what: str):
    """A zeroed device buffer of n int32 on ``device`` (CuPy's pool), complete before it returns
    (a synchronizing memset: the first launch may come on any stream). Not during a CUDA-graph
    capture: the memset would only run at replay."""
    import cupy

    with cupy.cuda.Device(device):
        try:
            if cupy.cuda.get_current_stream().is_capturing():
                raise RuntimeError("stream capturing")
            buf = cupy.cuda.alloc(4 * n)
            cupy.cuda.runtime.memset(buf.ptr, 0, 4 * n)
            cupy.cuda.runtime.deviceSynchronize()
        except Exception as exc:  # noqa: BLE001 - named, with what to do
            raise RuntimeError(f"{what}: the plan allocates and zeroes its counters on a call shape's "
                               f"first call, which failed ({exc}); if a CUDA graph was being captured, "
                               "make that call once before capturing") from exc
    return buf


def _stream_capturing(stream: int) -> bool:
    """Whether the raw CUDA stream ``stream`` is capturing a graph (a legal query during capture)."""
    from cupy_backends.cuda.api import runtime

    try:
        return runtime.streamIsCapturing(stream) != runtime.streamCaptureStatusNone
    except runtime.CUDARuntimeError:  # no driver (a CPU test's faked launches): nothing captures
        return False


class StreamCounters:
    """One plan's zeroed int32 counters (``n`` of them), one buffer per CUDA stream.

    Kernels that count across CTAs (the fused decode combine's finished splits, the dynamic
    scheduler's tile counter) reset their counters themselves when done, so a buffer is zeroed
    once and reused by every later launch. Launches on one stream run in order and may share a
    buffer; two calls of one plan on two streams may overlap and must not, or their counts mix.
    ``address(stream)`` hands each raw stream its own buffer: a dict lookup on the hot path, an
    allocation on a stream's first use. A spare buffer, zeroed when the plan is made (never during
    a CUDA-graph capture: the zeroing would only run at replay), serves a stream first seen while
    it captures (torch.cuda.graph's capture stream after an eager warm-up on another stream), and
    is made again by the next first use outside a capture. A graph keeps the buffer of the stream
    it was captured on: replay two graphs captured on one stream on one stream, not two at once.
    """

    def __init__(self, n: int, device: int, what: str):
        self.n, self.device, self.what = n, device, what
        self._by_stream: dict = {}   # raw stream -> buffer address (the hot path's lookup)
        self.buffers: dict = {}      # raw stream -> buffer (kept alive with the plan)
        self._spare = _zeroed_i32(n, device, what)
        self._lock = threading.Lock()

    def address(self, stream: int) -> int:
        addr = self._by_stream.get(stream)
        return addr if addr is not None else self._first_use(stream)

    def _first_use(self, stream: int) -> int:
        with self._lock:
            addr = self._by_stream.get(stream)
            if addr is not None:
                return addr
            capturing = _stream_capturing(stream)
            buf, self._spare = self._spare, None
            if buf is None:
                if capturing:
                    raise RuntimeError(
                        f"{self.what}: this plan's counters for a new CUDA stream cannot be zeroed "
                        "during a graph capture and its spare buffer is taken; make one call of this "
                        "shape on the capturing stream, or eagerly on another new stream, before capturing")
                buf = _zeroed_i32(self.n, self.device, self.what)
            if not capturing:  # the spare for a stream first seen in a capture
                self._spare = _zeroed_i32(self.n, self.device, self.what)
            self.buffers[stream] = buf
            addr = self._by_stream[stream] = int(buf.ptr)
            return addr


def _driver_launch():
    from cupy_backends.cuda.api import driver

    return driver.launchKernel


@functools.lru_cache(maxsize=1)
def libcuda():
    """The CUDA driver library through ctypes, loaded on first use (not at import: a machine
    without a driver still imports cuflash), for the entry points CuPy's driver module lacks
    (cuLaunchKernelEx here, cuTensorMapEncodeTiled in the sm90 families)."""
    import sys

    return ctypes.WinDLL("nvcuda.dll") if sys.platform == "win32" else ctypes.CDLL("libcuda.so.1")


class LaunchAttribute(ctypes.Structure):
    """cuda.h's CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union (72 bytes)."""
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_uint), ("value", ctypes.c_uint * 16)]


class LaunchConfig(ctypes.Structure):
    """cuda.h's CUlaunchConfig (56 bytes on 64-bit hosts)."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


class LaunchEx:
    """driver.launchKernel's signature for a plan with launch attributes: the kernels in ``attrs``
    ({CUfunction: (CTAs per cluster along x, pdl)}) launch through cuLaunchKernelEx (CuPy's driver
    module has launchKernel only), the others through launchKernel.
      cluster > 1: a cluster-dimension attribute (a kernel compiled without __cluster_dims__ keeps one
        instantiation, and so its SASS, for both launches);
      pdl: programmatic stream serialization (sm_90): the kernel may be scheduled before the stream's
        previous kernel has finished (once that one's CTAs have all issued griddepcontrol.launch_dependents
        or exited) and waits for it on the device (griddepcontrol.wait, its kPdl). A CUDA graph captures the
        launch as a programmatic edge (CUDA 12.3 and newer).
    Only plans with such a launch use it (Plan: one ctypes call per such launch); the launch config is
    shared, so calls run under the plan's lock, as Plan's do."""

    _CLUSTER_DIMENSION = 4   # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    _PROGRAMMATIC = 6        # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION

    def __init__(self, attrs: dict):
        self._ex = libcuda().cuLaunchKernelEx
        self._ex.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._ex.restype = ctypes.c_int
        self._config = LaunchConfig()
        self._config_ptr = ctypes.addressof(self._config)
        # per kernel: its own attribute array (kept alive here) and its count
        self._by_fn = {}
        for fn, (cluster, pdl) in attrs.items():
            items = []
            if cluster > 1:
                a = LaunchAttribute(self._CLUSTER_DIMENSION, 0)
                a.value[0], a.value[1], a.value[2] = cluster, 1, 1
                items.append(a)
            if pdl:
                a = LaunchAttribute(self._PROGRAMMATIC, 0)
                a.value[0] = 1   # programmaticStreamSerializationAllowed
                items.append(a)
            if items:
                arr = (LaunchAttribute * len(items))(*items)
                self._by_fn[fn] = (ctypes.cast(arr, ctypes.POINTER(LaunchAttribute)), len(items), arr, cluster, pdl)
        self.clusters = {fn: v[3] for fn, v in self._by_fn.items() if v[3] > 1}
        self.pdl = frozenset(fn for fn, v in self._by_fn.items() if v[4])
        self._plain = _driver_launch()

    def __call__(self, fn, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        attrs = self._by_fn.get(fn)
        if attrs is None:
            return self._plain(fn, gx, gy, gz, bx, by, bz, smem, stream, argv, extra)
        c = self._config
        c.grid[0], c.grid[1], c.grid[2], c.block[0], c.block[1], c.block[2] = gx, gy, gz, bx, by, bz
        c.smem, c.stream = smem, stream or None
        c.attrs, c.num_attrs = attrs[0], attrs[1]
        err = self._ex(self._config_ptr, fn, argv, None)
        if err:
            raise RuntimeError(f"cuLaunchKernelEx (clusters of {attrs[3]} CTAs, pdl {attrs[4]}, grid {(gx, gy, gz)}, "
                               f"{bx} threads, {smem} bytes of shared memory): CUDA driver error {err}")


def _device_fns():
    """(getDevice, setDevice) of the CUDA runtime: a plan loads its kernels and launches them
    with its own device current (a CuPy RawKernel resolves ``.kernel`` per current device, and
    torch tensors on cuda:1 may arrive while device 0 is current)."""
    from cupy_backends.cuda.api import runtime

    return runtime.getDevice, runtime.setDevice


class Plan:
    """One call shape of one config, ready to launch (see the module docstring).

    run(ptrs, workspace_ptr, stream): ``ptrs`` are the op's tensors' addresses in the op's
    order (inputs, then outputs; ``cuflash.registry.OPS``), ``workspace_ptr`` the start of
    ``workspace_bytes`` of scratch (0 when none is needed), ``stream`` a raw cudaStream_t.
    """

    def __init__(self, family, config, problem, strides: dict, softmax_scale: float, device: int):
        config = family.for_bounds(config, problem)   # (flags the call's exact bounds rule out)
        self.family, self.config, self.problem, self.device = family, config, problem, device
        kernels = get_kernels(config, device)
        sms = _gpu.sm_count(device)
        ws = family.workspace(config, problem, strides)
        self.workspace_bytes = ws["total"]
        static = family.static_params(config, problem, strides, ws, softmax_scale, sms)
        dtype = struct_dtype(family.params_struct)
        # counters kept between calls (zeroed once, reset by the kernels themselves), owned by the
        # plan for its lifetime, one buffer per CUDA stream (StreamCounters): each launch writes
        # its stream's buffer address into the params
        counters = getattr(family, "zeroed_counters", None)
        self.counters = {}
        for name, n in (counters(config, problem) if counters is not None else {}).items():
            self.counters[name] = StreamCounters(n, device, f"{config.name} ({name})")
            static[name] = 0
        self._counter_fields = tuple((dtype.fields[name][1], sc.address) for name, sc in self.counters.items())
        n_ptr = len(family.pointer_fields)
        if dtype.names[:n_ptr] != tuple(family.pointer_fields):
            raise RuntimeError(f"{family.params_struct} must begin with the pointer fields "
                               f"{family.pointer_fields}, got {dtype.names[:n_ptr]}")
        self._record = pack(family.params_struct, **dict.fromkeys(family.pointer_fields, 0), **static)
        self._bytes = self._record.view(np.uint8)
        self._argv = np.array([self._bytes.ctypes.data], dtype=np.uint64)  # one pointer per kernel argument
        self._argv_ptr = int(self._argv.ctypes.data)
        op = OPS[family.op]
        n_tensors = len(op.inputs) + len(op.outputs)
        self._ws_offsets = tuple(ws.get(name, -1) for name in family.pointer_fields[n_tensors:])
        self._pack = struct.Struct(f"<{n_ptr}Q").pack_into
        self.launches = family.launches(config, problem, sms)
        self._get_device, self._set_device = _device_fns()
        current = self._get_device()
        if current != device:  # RawKernel.kernel loads the module on the *current* device
            self._set_device(device)
        try:
            self._calls = tuple((kernels[spec.role].kernel.ptr, *(tuple(spec.grid) + (1, 1))[:3],
                                 spec.threads, spec.smem) for spec in self.launches)
        finally:
            if current != device:
                self._set_device(current)
        attrs = {call[0]: (spec.cluster, spec.pdl) for call, spec in zip(self._calls, self.launches)
                 if spec.cluster > 1 or getattr(spec, "pdl", False)}
        self._launch = LaunchEx(attrs) if attrs else _driver_launch()
        self._lock = threading.Lock()
        self._fields_lock = threading.Lock()  # run_fields: its fields and its launch together
        # A family whose params carry per-call data besides the pointers (sm90_fwd: TMA tensor
        # maps, which embed the tensors' addresses) gives a writer; the others run _run_plain.
        writer = getattr(family, "call_writer", None)
        self._write_call = writer(config, problem, strides, dtype) if writer is not None else None
        self._run = self._run_with_writer if self._write_call is not None else self._run_plain
        # run() for a caller that has checked that the plan's device is current (one
        # runtime call less on its hot path)
        self.run_current = self._run
        self._role_calls: dict = {}  # run_roles: frozenset of roles -> those launches
        self.workspace_offsets = dict(ws)  # byte offsets of the workspace pieces, and 'total'
        # byte offsets of the params' other pointer fields (e.g. rng_state), for run_with
        self._field_offsets = {name: dtype.fields[name][1] for name in dtype.names[n_ptr:]
                               if dtype.fields[name][0] == np.uint64}

    def run(self, ptrs: tuple, workspace_ptr: int, stream: int) -> None:
        """Launch on ``stream`` with the plan's device current (switched for the launch and
        back when another one is; cudaSetDevice is legal during CUDA-graph capture)."""
        current = self._get_device()
        if current == self.device:
            return self._run(ptrs, workspace_ptr, stream)
        self._set_device(self.device)
        try:
            return self._run(ptrs, workspace_ptr, stream)
        finally:
            self._set_device(current)

    def run_fields(self, fields: dict, ptrs: tuple, workspace_ptr: int, stream: int) -> None:
        """run(), with further per-call fields of the params struct written first (e.g. a
        feature's ``alibi_slopes`` address). The fields stay in the packed record until the next
        run_fields; a plan whose problem has such fields is only ever run through here."""
        with self._fields_lock:
            for name, value in fields.items():
                self._record[name] = value
            self.run(ptrs, workspace_ptr, stream)

    def _run_plain(self, ptrs: tuple, workspace_ptr: int, stream: int, calls=None) -> None:
        if self._ws_offsets:
            ptrs = ptrs + tuple(workspace_ptr + off if off >= 0 else 0 for off in self._ws_offsets)
        launch, argv = self._launch, self._argv_ptr
        with self._lock:  # the packed struct is shared; the driver copies it at each launch
            self._pack(self._bytes, 0, *ptrs)
            for off, address in self._counter_fields:  # this stream's counters (none: no loop)
                _U64.pack_into(self._bytes, off, address(stream))
            for fn, gx, gy, gz, threads, smem in (self._calls if calls is None else calls):
                launch(fn, gx, gy, gz, threads, 1, 1, smem, stream, argv, 0)

    def _run_with_writer(self, ptrs: tuple, workspace_ptr: int, stream: int, calls=None) -> None:
        """run(), plus the family's per-call writer after the pointers (see __init__)."""
        if self._ws_offsets:
            ptrs = ptrs + tuple(workspace_ptr + off if off >= 0 else 0 for off in self._ws_offsets)
        launch, argv = self._launch, self._argv_ptr
        with self._lock:
            self._pack(self._bytes, 0, *ptrs)
            for off, address in self._counter_fields:
                _U64.pack_into(self._bytes, off, address(stream))
            self._write_call(self._bytes, ptrs)
            for fn, gx, gy, gz, threads, smem in (self._calls if calls is None else calls):
                launch(fn, gx, gy, gz, threads, 1, 1, smem, stream, argv, 0)

    def run_roles(self, roles, ptrs: tuple, workspace_ptr: int, stream: int) -> None:
        """run(), launching only the launches whose role is in ``roles`` (in the plan's order),
        e.g. a backward's main kernel alone on a workspace whose preprocess already ran
        (cuflash.distributed's ring adds every step's dQ into one accumulator this way)."""
        key = frozenset(roles)
        calls = self._role_calls.get(key)
        if calls is None:
            calls = self._role_calls[key] = tuple(
                c for c, spec in zip(self._calls, self.launches) if spec.role in key)
        current = self._get_device()
        if current != self.device:
            self._set_device(self.device)
        try:
            self._run(ptrs, workspace_ptr, stream, calls)
        finally:
            if current != self.device:
                self._set_device(current)

    # ---- variable-length batches ----
    def run_varlen(self, ptrs: tuple, workspace_ptr: int, stream: int, cu_seqlens_q: int,
                   cu_seqlens_k: int) -> None:
        """run(), for a family built with varlen (kernels_cu/varlen.cuh): the params'
        cu_seqlens_q / cu_seqlens_k fields (device addresses of int32 offsets) are per call
        like the tensors' pointers, written under the same lock before the launches."""
        offsets = self.__dict__.get("_cu_offsets")
        if offsets is None:
            fields = self._record.dtype.fields
            if "cu_seqlens_q" not in fields or "cu_seqlens_k" not in fields:
                raise TypeError(f"{self.family.params_struct} has no cu_seqlens fields: "
                                f"{self.family.name} cannot run variable-length batches")
            offsets = self._cu_offsets = (fields["cu_seqlens_q"][1], fields["cu_seqlens_k"][1])
        if self._ws_offsets:
            ptrs = ptrs + tuple(workspace_ptr + off if off >= 0 else 0 for off in self._ws_offsets)
        current = self._get_device()
        if current != self.device:
            self._set_device(self.device)
        try:
            launch, argv = self._launch, self._argv_ptr
            with self._lock:
                self._pack(self._bytes, 0, *ptrs)
                struct.pack_into("<Q", self._bytes, offsets[0], cu_seqlens_q)
                struct.pack_into("<Q", self._bytes, offsets[1], cu_seqlens_k)
                for off, address in self._counter_fields:
                    _U64.pack_into(self._bytes, off, address(stream))
                if self._write_call is not None:   # sm90_fwd: the tensor maps of the packed tensors
                    self._write_call(self._bytes, ptrs)
                for fn, gx, gy, gz, threads, smem in self._calls:
                    launch(fn, gx, gy, gz, threads, 1, 1, smem, stream, argv, 0)
        finally:
            if current != self.device:
                self._set_device(current)

    # ---- per-call pointer fields (dropout's RNG state) ----
    def run_with(self, ptrs: tuple, workspace_ptr: int, stream: int, extra: tuple) -> None:
        """run(), with per-call pointers besides the leading ones: ``extra`` is ((field, address),
        ...), e.g. (("rng_state", p),) for dropout, whose (seed, offset) the kernels read from
        device memory. The fields go back to 0 after the launch (a later plain run sees none)."""
        for name, _ in extra:
            if name not in self._field_offsets:
                raise KeyError(f"{self.family.params_struct} has no per-call pointer field {name!r}")
        current = self._get_device()
        if current != self.device:
            self._set_device(self.device)
        try:
            if self._ws_offsets:
                ptrs = ptrs + tuple(workspace_ptr + off if off >= 0 else 0 for off in self._ws_offsets)
            launch, argv, u64 = self._launch, self._argv_ptr, _U64.pack_into
            with self._lock:
                self._pack(self._bytes, 0, *ptrs)
                for name, value in extra:
                    u64(self._bytes, self._field_offsets[name], value)
                for off, address in self._counter_fields:
                    u64(self._bytes, off, address(stream))
                if self._write_call is not None:
                    self._write_call(self._bytes, ptrs)
                try:
                    for fn, gx, gy, gz, threads, smem in self._calls:
                        launch(fn, gx, gy, gz, threads, 1, 1, smem, stream, argv, 0)
                finally:
                    for name, _ in extra:
                        u64(self._bytes, self._field_offsets[name], 0)
        finally:
            if current != self.device:
                self._set_device(current)


_U64 = struct.Struct("<Q")
