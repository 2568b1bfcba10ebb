"""llama.cpp's RPC backend, both ends: a worker serves this machine's devices
(``ggml_backend_rpc_start_server``), a driver registers workers as devices
(``ggml_backend_rpc_add_server``) that ``llama_model_params.devices`` then lists.

Both ends are the same llama.cpp (specrun's build), so they speak the same protocol. llama.cpp
aborts the process when a connect or a reply fails, so a worker is checked here first, in
Python, with the protocol's own HELLO (and DEVICE_COUNT / GET_DEVICE_MEMORY): an unreachable,
busy or wrong-version worker is a one-line error before llama.cpp ever sees its address. A
worker lost mid-run still makes llama.cpp abort; ``on_abort`` turns that into one line naming the
worker and exit 1 (see ``install_abort_handler``).
"""

from __future__ import annotations

import ctypes
import os
import re
import socket
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import llama_cpp as ll

from specrun.errors import SpecrunError, UsageError
from specrun.llama.backend import Device, device_handles, device_of, init_backend, local_gpus

# ggml-rpc.h of the llama.cpp that llama-cpp-python 0.3.36 vendors (tests/test_rpc.py checks a
# live worker of this build answers with these): a worker whose major differs, or whose minor is
# newer, is refused by llama.cpp with an abort; here with a message.
PROTO_MAJOR, PROTO_MINOR, PROTO_PATCH = 7, 0, 0
DEFAULT_PORT = 50052
_CMD_GET_DEVICE_MEMORY, _CMD_HELLO, _CMD_DEVICE_COUNT = 11, 14, 15
_CONN_CAPS = 24  # RPC_CONN_CAPS_SIZE: all zero asks for plain TCP
CHECK_TIMEOUT = (
    5.0  # seconds for a worker to answer the check (a busy one does not: one client at a time)
)


class WorkerError(SpecrunError):
    """An RPC worker is unreachable, busy, of another protocol version, or was lost."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoints(text: str, flag: str = "--rpc") -> list[Endpoint]:
    """``HOST:PORT[,HOST:PORT...]`` (llama.cpp's --rpc); a bare HOST gets the default port."""
    out: list[Endpoint] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            raise UsageError(f"{flag}: empty address in {text!r} (HOST:PORT[,HOST:PORT...])")
        host, sep, port_s = part.rpartition(":")
        if not sep:
            host, port_s = part, str(DEFAULT_PORT)
        if not host or any(c.isspace() for c in host) or "[" in host:
            raise UsageError(f"{flag}: {part!r} is not HOST:PORT (IPv4 address or host name)")
        try:
            port = int(port_s)
        except ValueError:
            raise UsageError(f"{flag}: port {port_s!r} in {part!r} is not a number") from None
        if not 1 <= port <= 65535:
            raise UsageError(f"{flag}: port {port} in {part!r} is not 1 to 65535")
        ep = Endpoint(host, port)
        if ep in out:
            raise UsageError(f"{flag}: {ep} is given twice")
        out.append(ep)
    if len(out) > 16:  # GGML_RPC_MAX_SERVERS
        raise UsageError(f"{flag}: at most 16 workers, got {len(out)}")
    return out


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker said when checked: its protocol version and its devices' memory."""

    endpoint: Endpoint
    version: tuple[int, int, int]
    memory: tuple[tuple[int, int], ...]  # (free, total) bytes per device


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionResetError("closed")
        buf += chunk
    return bytes(buf)


def _call(sock: socket.socket, cmd: int, payload: bytes) -> bytes:
    """One request/reply: | cmd u8 | size u64 | payload | -> | size u64 | reply |."""
    sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
    (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
    if size > 1 << 16:
        raise ValueError(f"reply of {size} bytes")
    return _recv_exact(sock, size)


def check_worker(ep: Endpoint, timeout: float = CHECK_TIMEOUT) -> WorkerInfo:
    """Connect, HELLO, count devices and read their memory, disconnect; raise WorkerError."""
    try:
        addrs = socket.getaddrinfo(ep.host, ep.port, socket.AF_INET, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise WorkerError(f"RPC worker {ep}: cannot resolve {ep.host!r} ({e})") from None
    where = f"RPC worker {ep}"
    try:
        with socket.create_connection((str(addrs[0][4][0]), ep.port), timeout=timeout) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                hello = _call(s, _CMD_HELLO, bytes(_CONN_CAPS))
            except (ConnectionError, ValueError):
                raise WorkerError(
                    f"{where} closed the connection on HELLO: not an RPC worker of protocol "
                    f"v{PROTO_MAJOR}.x (start it with this specrun: `specrun worker`)"
                ) from None
            if len(hello) < 3:
                raise WorkerError(
                    f"{where} answered HELLO with {len(hello)} bytes: not an RPC worker"
                )
            version = (hello[0], hello[1], hello[2])
            if (
                version[0] != PROTO_MAJOR
                or version[1] > PROTO_MINOR
                or len(hello) != 4 + _CONN_CAPS
            ):
                raise WorkerError(
                    f"{where} speaks RPC protocol v{'.'.join(map(str, version))}, this build "
                    f"v{PROTO_MAJOR}.{PROTO_MINOR}.{PROTO_PATCH}: run the same specrun (llama.cpp) on both ends"
                )
            (count,) = struct.unpack("<I", _call(s, _CMD_DEVICE_COUNT, b""))
            memory = []
            for i in range(count):
                free, total = struct.unpack(
                    "<QQ", _call(s, _CMD_GET_DEVICE_MEMORY, struct.pack("<I", i))
                )
                memory.append((free, total))
    except WorkerError:
        raise
    except TimeoutError:
        raise WorkerError(
            f"{where} did not answer within {timeout:g} s (busy with another client? a worker serves one at a time)"
        ) from None
    except ConnectionRefusedError:
        raise WorkerError(
            f"{where} refused the connection (no worker listening there: `specrun worker --port {ep.port}`)"
        ) from None
    except (OSError, ValueError, struct.error) as e:
        raise WorkerError(f"{where}: {getattr(e, 'strerror', None) or e}") from None
    if not memory:
        raise WorkerError(f"{where} has no devices")
    return WorkerInfo(ep, version, tuple(memory))


# -- the driver's side ---------------------------------------------------------------------


@dataclass
class _Registry:
    lock: threading.Lock = field(default_factory=threading.Lock)
    devices: dict[Endpoint, list[int]] = field(default_factory=dict)  # ggml_backend_dev_t handles


_registered = _Registry()


def _fn(name: str, restype: Any, argtypes: list[Any]) -> Callable[..., Any]:
    f: Callable[..., Any] = getattr(ll.llama_cpp._lib, name)
    f.restype, f.argtypes = restype, argtypes  # type: ignore[attr-defined]
    return f


def supports_rpc() -> bool:
    return bool(ll.llama_supports_rpc())


def _rpc_proc(name: str) -> int:
    init_backend()
    if not supports_rpc():
        raise SpecrunError(
            "this llama-cpp-python was built without the RPC backend: reinstall with `make install` "
            "(CMAKE_ARGS=-DGGML_RPC=ON)"
        )
    by_name = _fn("ggml_backend_reg_by_name", ctypes.c_void_p, [ctypes.c_char_p])
    proc = _fn(
        "ggml_backend_reg_get_proc_address", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]
    )
    addr = proc(by_name(b"RPC"), name.encode())
    if not addr:
        raise SpecrunError(f"llama.cpp's RPC backend has no {name}")
    return int(addr)


_checked: dict[Endpoint, WorkerInfo] = {}


def check_workers(endpoints: Sequence[str | Endpoint]) -> list[WorkerInfo]:
    """``check_worker`` each, once per process: a worker serves one client at a time, and once
    llama.cpp holds its connection here a second HELLO would wait for this very process."""
    out = []
    for e in endpoints:
        ep = e if isinstance(e, Endpoint) else parse_endpoints(e)[0]
        if ep not in _checked:
            _checked[ep] = check_worker(ep)
        out.append(_checked[ep])
    return out


def worker_free_memory(endpoints: Sequence[str | Endpoint]) -> int:
    """Free bytes over the workers' devices, as they reported it when checked."""
    return sum(free for info in check_workers(endpoints) for free, _total in info.memory)


def add_workers(endpoints: Sequence[str | Endpoint]) -> list[WorkerInfo]:
    """Check each worker, then register it with llama.cpp (once per process); returns the checks."""
    infos = check_workers(endpoints)
    add = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(
        _rpc_proc("ggml_backend_rpc_add_server")
    )
    n_dev = _fn("ggml_backend_reg_dev_count", ctypes.c_size_t, [ctypes.c_void_p])
    get_dev = _fn("ggml_backend_reg_dev_get", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t])
    install_abort_handler()
    with _registered.lock:
        for info in infos:
            ep = info.endpoint
            if ep in _registered.devices:
                continue
            if ep not in _watch:
                _watch.append(ep)
            reg = add(str(ep).encode())
            if not reg:
                raise WorkerError(f"RPC worker {ep} has no devices")
            _registered.devices[ep] = [int(get_dev(reg, i)) for i in range(int(n_dev(reg)))]
    return infos


def worker_devices(endpoints: Sequence[Endpoint]) -> list[int]:
    """The ggml_backend_dev_t handles of registered workers, in order."""
    return [d for ep in endpoints for d in _registered.devices[ep]]


# -- a worker lost mid-run ------------------------------------------------------------------

_watch: list[Endpoint] = []
_abort_cb: object = None
_on_fatal: Callable[[str], None] | None = None


def set_fatal_handler(fn: Callable[[str], None] | None) -> None:
    """What to do (last words, then exit 1) when llama.cpp aborts; default: one line on stderr."""
    global _on_fatal
    _on_fatal = fn


def lost_workers(timeout: float = 1.0) -> list[Endpoint]:
    """Registered workers that no longer accept a connection."""
    lost = []
    for ep in list(_watch):
        try:
            with socket.create_connection((ep.host, ep.port), timeout=timeout):
                pass
        except OSError:
            lost.append(ep)
    return lost


def abort_message(message: str) -> str:
    """llama.cpp's abort message -> one line; a lost RPC worker is named (the one whose port no
    longer takes a connection, else every worker of this process)."""
    text = message.strip().splitlines()[0] if message.strip() else "no message"
    text = re.sub(r"^\S+:\d+: ", "", text)  # ggml_abort's file:line
    if "RPC" not in message and "connect" not in message:
        return f"llama.cpp aborted: {text}"
    lost = lost_workers()
    who = lost or list(_watch)
    names = ", ".join(map(str, who)) or "?"
    what = "is gone (its port is closed)" if lost else "stopped answering"
    return f"RPC worker {names} {what}: llama.cpp cannot go on without it ({text})"


def install_abort_handler() -> None:
    """llama.cpp's abort goes through here: one line on stderr, exit 1, never a core dump.

    It runs on llama.cpp's RPC thread while the main thread waits in llama_decode; stdout is
    flushed first so what was generated stays printed.
    """
    global _abort_cb
    if _abort_cb is not None:
        return
    cb_type = ctypes.CFUNCTYPE(None, ctypes.c_char_p)

    def on_abort(msg: bytes | None) -> None:  # pragma: no cover - ends the process
        try:
            line = abort_message((msg or b"").decode("utf-8", "replace"))
            if _on_fatal is not None:
                _on_fatal(line)
            else:
                try:
                    sys.stdout.flush()
                except Exception:
                    pass
                sys.stderr.write(f"error: {line}\n")
                sys.stderr.flush()
        finally:
            os._exit(1)

    _abort_cb = cb_type(on_abort)
    setter = _fn("ggml_set_abort_callback", ctypes.c_void_p, [cb_type])
    setter(_abort_cb)


def keepalive(
    endpoints: Sequence[str | Endpoint], idle: int = 5, interval: int = 2, count: int = 3
) -> int:
    """TCP keepalive on llama.cpp's connections to these workers, so a worker machine that
    vanishes (no RST) ends the run within about idle + interval * count seconds instead of
    never. Returns how many sockets were set."""
    eps = [e if isinstance(e, Endpoint) else parse_endpoints(e)[0] for e in endpoints]
    want = {(socket.gethostbyname(ep.host), ep.port) for ep in eps}
    n = 0
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if (
                s.family == socket.AF_INET
                and s.type == socket.SOCK_STREAM
                and s.getpeername() in want
            ):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)
                s.setsockopt(
                    socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, (idle + interval * count) * 1000
                )
                n += 1
        except OSError:
            pass
        finally:
            s.close()
    return n


# -- the worker's side ----------------------------------------------------------------------


def serving_devices() -> list[tuple[int, Device]]:
    """What a worker serves, as llama.cpp's rpc-server picks: the GPUs, else the CPU."""
    devs = [(h, device_of(h)) for h in device_handles()]
    gpus = [(h, d) for h, d in devs if d.kind not in ("cpu", "accel")]
    return gpus or [(h, d) for h, d in devs if d.kind == "cpu"][:1]


def is_loopback(host: str) -> bool:
    return host.startswith("127.") or host == "localhost"


def listen_address(host: str, port: int) -> str:
    """The IPv4 address llama.cpp's server will bind (it takes a literal), checked free now so a
    taken port is a message here rather than a silent return from the server."""
    if not 1 <= port <= 65535:
        raise UsageError(f"--port must be 1 to 65535, got {port}")
    try:
        addr = socket.gethostbyname(host)
    except (socket.gaierror, UnicodeError) as e:
        raise UsageError(
            f"--host {host!r}: not an IPv4 address or a name that resolves to one ({e})"
        ) from None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as llama.cpp's server does
        try:
            s.bind((addr, port))
        except OSError as e:
            raise WorkerError(f"cannot listen on {addr}:{port}: {e.strerror or e}") from None
    return addr


def serve(
    host: str, port: int, n_threads: int, cache_dir: str | None, devices: Sequence[int]
) -> threading.Thread:
    """Start llama.cpp's RPC server on a daemon thread (it never returns while it serves)."""
    start_t = ctypes.CFUNCTYPE(
        None,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_void_p),
    )
    start = start_t(_rpc_proc("ggml_backend_rpc_start_server"))
    arr = (ctypes.c_void_p * len(devices))(*devices)
    endpoint = f"{host}:{port}".encode()
    cache = cache_dir.encode() if cache_dir else None

    def run() -> None:
        start(endpoint, cache, n_threads, len(devices), arr)

    t = threading.Thread(target=run, name="rpc-server", daemon=True)
    t.start()
    return t


def place_devices(
    mparams: object, endpoints: Sequence[str], tensor_split: Sequence[float]
) -> object:
    """Point llama_model_params at the workers' devices (then this machine's GPUs, llama.cpp's
    order) and at the split; returns the arrays, which must outlive the model."""
    if not endpoints and not tensor_split:
        return None
    keep: list[object] = []
    n_devices = len(local_gpus())
    if endpoints:
        eps = [parse_endpoints(e)[0] for e in endpoints]
        add_workers(eps)
        handles = worker_devices(eps) + [
            h for h in device_handles() if device_of(h).kind in ("gpu", "igpu")
        ]
        arr = (ctypes.c_void_p * (len(handles) + 1))(*handles, None)
        mparams.devices = ctypes.cast(arr, ctypes.c_void_p)  # type: ignore[attr-defined]
        keep.append(arr)
        n_devices = len(handles)
    if tensor_split:
        if len(tensor_split) > n_devices:
            raise UsageError(
                f"--tensor-split has {len(tensor_split)} shares for {n_devices} device(s) "
                "(the RPC workers' devices, then this machine's GPUs)"
            )
        ts = (ctypes.c_float * int(ll.llama_max_devices()))(*tensor_split)
        mparams.tensor_split = ts  # type: ignore[attr-defined]
        keep.append(ts)
    return keep
