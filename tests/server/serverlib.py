"""Helpers for the server tests: real veritysetup images, real nbdkit, real NBD clients.

Every image is made by `veritysetup format` in a temporary directory; every server is a
real `nbdkit python plugin.py` (or `nbd-verity serve`, which execs nbdkit) listening on a
Unix socket, started in the foreground with a pid file and stopped by its pid when the
test ends, whatever happened, by nbd_verity.launch (readiness: the pid file, which nbdkit
writes only once it listens, and the socket accepting a connection). Hash-block
positions are found from the images themselves (the block whose salted digest is the
root, or that holds a data block's digest), not from nbd_verity's own geometry, so a
geometry bug cannot hide itself.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import re
import shutil
import socket
import struct
import subprocess
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import nbd
import pytest

from nbd_verity.control.protocol import checked_request
from nbd_verity.launch import Launched, run_to_end
from nbd_verity.sources import handles

from ..damage import flip_byte, write_at  # noqa: F401  (re-exported to the tests)

PROJECT = Path(__file__).resolve().parents[2]
PLUGIN = PROJECT / "plugin.py"
NBD_VERITY = PROJECT / ".venv" / "bin" / "nbd-verity"
NBDKIT = shutil.which("nbdkit") or "/usr/sbin/nbdkit"
VERITYSETUP = shutil.which("veritysetup") or "/usr/sbin/veritysetup"
START_TIMEOUT = 20.0  # seconds for nbdkit to listen (the machine is shared and small)
STOP_TIMEOUT = 10.0
MIB = 1 << 20


# The hashing engines a server can run on (nbd_verity.format.digest): servers run on the engine
# of the `engine` fixture, native unless the test run itself has NBD_VERITY_PURE=1.
ENGINES = ("native", "python")
PURE_ENV = "NBD_VERITY_PURE"
DEFAULT_ENGINE = "python" if os.environ.get(PURE_ENV, "") not in ("", "0") else "native"
# The read paths (nbd_verity/serve/fastpath.py): the fast path answers the common request,
# the general path everything (and everything when NBD_VERITY_FAST_PATH=0). The suites of
# FAST_PATH_BOTH (conftest.py) run on both; the others on the test run's own.
PATHS = ("fast", "general")
FAST_PATH_ENV = "NBD_VERITY_FAST_PATH"
DEFAULT_PATH = "general" if os.environ.get(FAST_PATH_ENV, "") == "0" else "fast"


def server_env(engine: str = DEFAULT_ENGINE, path: str = DEFAULT_PATH) -> dict:
    """The environment of a server on this engine and read path: NBD_VERITY_PURE=1 forces
    the pure-Python engine (without it the native one runs), NBD_VERITY_FAST_PATH=0 the
    general path (launch adds PYTHONPATH)."""
    env = dict(os.environ)
    env.pop(PURE_ENV, None)
    env.pop(FAST_PATH_ENV, None)
    if engine == "python":
        env[PURE_ENV] = "1"
    if path == "general":
        env[FAST_PATH_ENV] = "0"
    return env


# -- images ---------------------------------------------------------------------------


@dataclass
class Image:
    """A data image and its tree as veritysetup made them, plus the plugin keys to serve it."""

    data: Path
    hash: Path
    root: str  # hex root hash printed by veritysetup
    salt: bytes
    hash_type: int
    algorithm: str
    data_block_size: int
    hash_block_size: int
    data_blocks: int
    hash_offset: int = 0
    keys: dict = field(default_factory=dict)  # geometry keys beyond data/hash/root-hash

    @property
    def size(self) -> int:
        """Bytes of the exported device."""
        return self.data_blocks * self.data_block_size

    def expected(self, offset: int = 0, length: int | None = None) -> bytes:
        """What the device must read back: the data image's bytes."""
        length = self.size - offset if length is None else length
        with open(self.data, "rb") as f:
            f.seek(offset)
            return f.read(length)

    def pairs(self, **extra) -> list[tuple[str, str]]:
        """The plugin's key=value pairs; extra keys are spelled with '_' for '-'."""
        pairs = [("data", str(self.data)), ("hash", str(self.hash)), ("root-hash", self.root)]
        pairs += [(k, str(v)) for k, v in self.keys.items()]
        pairs += [(k.replace("_", "-"), str(v)) for k, v in extra.items()]
        return pairs

    def copy(self, directory: Path) -> Image:
        """A private copy (one file when data and tree share it) that a test may damage."""
        directory.mkdir(parents=True, exist_ok=True)
        data = directory / self.data.name
        shutil.copyfile(self.data, data)
        if self.hash == self.data:
            return replace(self, data=data, hash=data)
        hash_copy = directory / (self.hash.name + ".hash")
        shutil.copyfile(self.hash, hash_copy)
        return replace(self, data=data, hash=hash_copy)

    def block_digest(self, block: bytes) -> bytes:
        """The salted digest veritysetup stores (format 1: salt first; format 0: last)."""
        h = hashlib.new(self.algorithm)
        if self.hash_type == 1:
            h.update(self.salt)
        h.update(block)
        if self.hash_type == 0:
            h.update(self.salt)
        return h.digest()

    def _hash_blocks(self):
        """(offset, bytes) of every hash-block-aligned block of the hash image."""
        hbs = self.hash_block_size
        raw = self.hash.read_bytes()
        first = self.hash_offset // hbs
        for start in range(first * hbs, len(raw) - hbs + 1, hbs):
            yield start, raw[start:start + hbs]

    def top_block_offset(self) -> int:
        """Byte offset in the hash image of the top hash block (the root's preimage)."""
        root = bytes.fromhex(self.root)
        for offset, block in self._hash_blocks():
            if self.block_digest(block) == root:
                return offset
        raise AssertionError("no hash block has the root hash as its digest")

    def _holder(self, digest: bytes, what: str) -> int:
        hits = [off for off, block in self._hash_blocks() if digest in block]
        assert len(hits) == 1, f"digest of {what} found {len(hits)} times"
        return hits[0]

    def leaf_offset(self, data_block: int) -> int:
        """Byte offset in the hash image of the level-0 block holding data_block's digest."""
        digest = self.block_digest(self.expected(data_block * self.data_block_size,
                                                 self.data_block_size))
        return self._holder(digest, f"data block {data_block}")

    def parent_offset(self, hash_offset: int) -> int:
        """Byte offset of the hash block holding the digest of the hash block at offset."""
        with open(self.hash, "rb") as f:
            f.seek(hash_offset)
            digest = self.block_digest(f.read(self.hash_block_size))
        return self._holder(digest, f"the hash block at {hash_offset}")


def _field(text: str, name: str) -> str:
    match = re.search(rf"^{name}:\s*(\S+)\s*$", text, re.MULTILINE)
    assert match, f"veritysetup printed no {name!r}:\n{text}"
    return match.group(1)


def veritysetup_format(data: Path, hash_path: Path, *options: str) -> str:
    """Run `veritysetup format`; return its output."""
    result = subprocess.run([VERITYSETUP, "format", *options, str(data), str(hash_path)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, f"veritysetup format failed: {result.stderr}"
    return result.stdout


def make_image(directory: Path, content: bytes, *options: str, hash_offset: int = 0,
               same_file: bool = False, geometry_keys: bool = False) -> Image:
    """Write content, build its tree with veritysetup and describe the result.

    same_file puts the tree in the data file at hash_offset; geometry_keys passes every
    geometry key to the plugin (needed with --no-superblock)."""
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "data.img"
    data.write_bytes(content)
    hash_path = data if same_file else directory / "hash.img"
    args = list(options)
    if hash_offset:
        args.append(f"--hash-offset={hash_offset}")
    out = veritysetup_format(data, hash_path, *args)
    salt_text = _field(out, "Salt")
    image = Image(
        data=data, hash=hash_path, root=_field(out, "Root hash"),
        salt=b"" if salt_text == "-" else bytes.fromhex(salt_text),
        hash_type=int(_field(out, "Hash type")), algorithm=_field(out, "Hash algorithm"),
        data_block_size=int(_field(out, "Data block size")),
        hash_block_size=int(_field(out, "Hash block size")),
        data_blocks=int(_field(out, "Data blocks")), hash_offset=hash_offset,
    )
    if hash_offset:
        image.keys["hash-offset"] = hash_offset
    if geometry_keys:
        image.keys.update({
            "no-superblock": "true", "format": image.hash_type, "algorithm": image.algorithm,
            "salt": salt_text, "data-block-size": image.data_block_size,
            "hash-block-size": image.hash_block_size, "data-blocks": image.data_blocks,
        })
    return image


def random_bytes(seed: int, size: int) -> bytes:
    """Reproducible incompressible content."""
    return random.Random(seed).randbytes(size)


def error_number(e: nbd.Error) -> int:
    """The errno of an nbd.Error as a number: libnbd 1.14's .errno is the name ("EIO"),
    its .errnum the number; newer bindings give the number as .errno."""
    number = getattr(e, "errnum", None)
    return number if isinstance(number, int) else e.errno


def expect_eio(h, count: int, offset: int) -> nbd.Error:
    """pread must fail with EIO (not another errno, not a dead connection)."""
    with pytest.raises(nbd.Error) as caught:
        h.pread(count, offset)
    assert error_number(caught.value) == errno.EIO, f"{caught.value} at {offset}+{count}"
    return caught.value


def close_handle(h) -> None:
    """Disconnect and free a libnbd handle now, once, on every libnbd (sources/handles.py)."""
    handles.close(h)


# -- servers --------------------------------------------------------------------------


class Server(Launched):
    """One nbdkit process on a Unix socket (nbd_verity.launch), with libnbd clients that
    are closed before it is stopped."""

    def __init__(self, argv: list[str], socket_path: str, pid_file: str, log_path: Path,
                 engine: str = DEFAULT_ENGINE, path: str = DEFAULT_PATH):
        super().__init__(argv, socket=socket_path, pid_file=pid_file, log_path=log_path,
                         env=server_env(engine, path))
        self.engine, self.path = engine, path
        self.handles: list = []
        self.start(ready=False)

    @property
    def uri(self) -> str:
        return f"nbd+unix:///?socket={self.socket}"

    def wait_ready(self, timeout: float = START_TIMEOUT) -> Server:
        return super().wait_ready(timeout)

    def connect(self):
        """A new libnbd client connected to this server (closed when the test ends)."""
        h = nbd.NBD()
        self.handles.append(h)
        h.connect_unix(self.socket)
        return h

    def loaded_native(self) -> bool:
        """Whether the server process has nbd_verity's compiled module mapped (the pure
        engine never imports it)."""
        maps = Path(f"/proc/{self.pid}/maps").read_text()
        return "nbd_verity/format/_native." in maps

    def stop(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """Close our clients, then stop the server by its pid."""
        for h in self.handles:
            close_handle(h)
        self.handles.clear()
        return super().stop(timeout)


def run_refusal(argv: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
    """Run a server command that must refuse to start; killed by pid if it does not."""
    return run_to_end(argv, timeout)


# -- a raw NBD client, for what libnbd will not do (drop a connection mid-request) -----

NBD_OPTS_MAGIC = 0x49484156454F5054  # "IHAVEOPT"
NBD_REQUEST_MAGIC = 0x25609513
NBD_SIMPLE_REPLY_MAGIC = 0x67446698
NBD_FLAG_FIXED_NEWSTYLE = 1
NBD_FLAG_NO_ZEROES = 2
NBD_OPT_EXPORT_NAME = 1
NBD_CMD_READ = 0


def recv_exact(sock: socket.socket, size: int) -> bytes:
    """Exactly size bytes, or AssertionError if the server closes first."""
    chunks, got = [], 0
    while got < size:
        chunk = sock.recv(size - got)
        assert chunk, f"server closed the connection after {got} of {size} bytes"
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def raw_connect(path: str) -> tuple[socket.socket, int]:
    """Fixed-newstyle handshake with NBD_OPT_EXPORT_NAME: (socket, export size)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(STOP_TIMEOUT)
    sock.connect(path)
    hello = recv_exact(sock, 18)
    assert hello[:8] == b"NBDMAGIC", hello
    opts_magic, flags = struct.unpack(">QH", hello[8:])
    assert opts_magic == NBD_OPTS_MAGIC and flags & NBD_FLAG_NO_ZEROES, hello
    sock.sendall(struct.pack(">I", NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES))
    sock.sendall(struct.pack(">QII", NBD_OPTS_MAGIC, NBD_OPT_EXPORT_NAME, 0))
    size, _flags = struct.unpack(">QH", recv_exact(sock, 10))
    return sock, size


def raw_read_request(sock: socket.socket, handle: int, offset: int, length: int) -> None:
    sock.sendall(struct.pack(">IHHQQI", NBD_REQUEST_MAGIC, 0, NBD_CMD_READ, handle, offset,
                             length))


def raw_read_reply(sock: socket.socket, handle: int, length: int) -> tuple[int, bytes]:
    """(error, data) of a simple reply to a read."""
    magic, error, got = struct.unpack(">IIQ", recv_exact(sock, 16))
    assert magic == NBD_SIMPLE_REPLY_MAGIC and got == handle, (magic, got)
    return error, (b"" if error else recv_exact(sock, length))


def control_request(path: str, request: dict) -> dict:
    """One request on the server's control socket; it must succeed."""
    return checked_request(path, request)


def wait_for(condition, what: str, timeout: float = 90.0) -> None:
    """Poll condition() until it holds; fail the test naming what after timeout s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def reads_across_an_outage(h, expected: bytes, outage, chunk: int = 64 << 10) -> dict:
    """Read the whole device over and over in a thread while outage() takes the upstream
    away and back: every read must be EIO or the right bytes (nothing else), and reads
    must go on afterwards. Returns how many were each."""
    outcomes = {"ok": 0, "eio": 0}
    done = threading.Event()
    problems: list[str] = []

    def reader():
        while not done.is_set():
            for offset in range(0, len(expected), chunk):
                try:
                    got = h.pread(chunk, offset)
                except nbd.Error as e:
                    if error_number(e) != errno.EIO:
                        problems.append(f"{offset}: {e}")
                    outcomes["eio"] += 1
                    continue
                if got != expected[offset:offset + chunk]:
                    problems.append(f"wrong bytes at {offset}")
                outcomes["ok"] += 1

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        wait_for(lambda: outcomes["ok"] >= 8, "reads before the outage")
        outage()
        before = outcomes["ok"] + outcomes["eio"]
        wait_for(lambda: outcomes["ok"] + outcomes["eio"] >= before + 40,
                 "reads after the outage")
    finally:
        done.set()
        thread.join(120)
    assert not problems, problems
    return outcomes


def read_general(conn, buf, offset):
    """The general path, as the callbacks' pread takes it after the fast path."""
    conn.device.dispatcher.read(buf, offset, conn)


def connect(server, name: str):
    """A libnbd handle on server's socket, to export name (closed with the server)."""
    h = nbd.NBD()
    server.handles.append(h)
    h.set_export_name(name)
    h.connect_unix(server.socket)
    return h
