"""Who may use the control socket, and what start-up does with a socket file already there.

Another user is refused twice over: the socket file is 0600 (connect fails with EACCES),
and, should its mode ever be loosened, the server checks each peer's uid (SO_PEERCRED) and
answers a stranger with an error. Both are tried as `nobody`, which needs root to become.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from .harness import NBD_VERITY, clean_env, one_error_line, run

SETPRIV = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
# Run as nobody: try to change the table, print EACCES or the server's reply.
STRANGER = textwrap.dedent("""
    import socket, sys
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    try:
        sock.connect(sys.argv[1])
    except PermissionError:
        print("EACCES")
        sys.exit(0)
    try:
        sock.sendall(b'{"cmd": "thresholds", "set": {"be": 1}}\\n')
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server may refuse and close before we send: read its reply anyway
    reply = b""
    while not reply.endswith(b"\\n"):
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:  # closed on us with our line unread
            break
        if not chunk:
            break
        reply += chunk
    print(reply.decode().strip() or "NO REPLY")
""")


def as_nobody(control: Path) -> str:
    if os.geteuid() != 0:
        pytest.skip("becoming nobody needs root")
    result = run([*SETPRIV, PYTHON, "-c", STRANGER, control], cwd="/")
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def open_to_nobody(directory: Path) -> None:
    """Let nobody reach files in the server's directory: only the socket's mode decides."""
    os.chmod(directory, 0o711)


def test_control_socket_is_0600_and_ours(servers, image):
    server = servers.start(image)
    info = os.lstat(server.control)
    assert stat.S_ISSOCK(info.st_mode)
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_uid == os.getuid()


# Loaded by every Python of the server (`nbd-verity serve`, then nbdkit's embedded one) from
# PYTHONPATH: an audit hook that writes down each bind and each chmod, changing nothing.
WATCH_CHMOD = textwrap.dedent("""
    import os, sys
    def _watch(event, args):
        if event in ("os.chmod", "socket.bind"):
            with open(os.environ["NVT_AUDIT_LOG"], "a") as f:
                f.write(f"{event} {args[1] if event == 'socket.bind' else args[0]}\\n")
    sys.addaudithook(_watch)
""")


def test_no_chmod_follows_the_bind(servers, image, tmp_path):
    """The socket's mode comes from the umask around bind alone: a chmod by path after bind
    would follow a symlink swapped in meanwhile. The umask is the caller's again after."""
    (tmp_path / "sitecustomize.py").write_text(WATCH_CHMOD)
    audit = tmp_path / "audit.log"
    server = servers.start(image, env={"PYTHONPATH": str(tmp_path),
                                       "NVT_AUDIT_LOG": str(audit)})
    events = audit.read_text().splitlines()
    assert f"socket.bind {server.control}" in events, events  # the hook did watch the bind
    assert not [e for e in events if e.startswith("os.chmod")], events
    assert stat.S_IMODE(os.lstat(server.control).st_mode) == 0o600
    umask = os.umask(0)
    os.umask(umask)
    with open(f"/proc/{server.pid}/status") as f:
        assert f"Umask:\t{umask:04o}\n" in f.read()


def test_another_user_cannot_connect(servers, image):
    server = servers.start(image)
    before = server.thresholds()
    open_to_nobody(servers.directory)
    assert as_nobody(server.control) == "EACCES"
    assert server.thresholds() == before


def test_another_user_is_refused_by_uid_even_if_the_mode_is_loosened(servers, image):
    """An admin chmods the socket 0666 by mistake: SO_PEERCRED still refuses nobody."""
    server = servers.start(image)
    before = server.thresholds()
    open_to_nobody(servers.directory)
    os.chmod(server.control, 0o666)
    reply = as_nobody(server.control)
    assert reply != "EACCES", "the loosened socket should have let nobody connect"
    assert json.loads(reply) == {"ok": False, "error": "permission denied: uid not allowed"}
    assert server.thresholds() == before
    server.ask({"cmd": "status"})  # root still gets answers


def test_stale_socket_file_is_replaced(servers, image):
    """A socket file that is bound but not listening (its server died) is replaced."""
    control = servers.directory / "stale.ctl"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
        stale.bind(str(control))  # bound, never listened: connect is refused
        server = servers.start(image, control=control)
        assert server.ask({"cmd": "status"})["status"]["status"] == "V"
    assert stat.S_IMODE(os.lstat(control).st_mode) == 0o600
    with server.client() as h:
        assert h.pread(4096, 0) == image.expected(0, 4096)


def test_live_socket_is_refused_with_one_line(servers, image):
    first = servers.start(image)
    first.set_thresholds(be=12345)
    second = servers.start(image, control=first.control, ready=False)
    status = second.proc.wait(timeout=60)
    assert status != 0
    lines = second.log().strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("nbd-verity: control: ")
    assert "in use by a running server" in lines[0]
    assert not second.socket.exists()
    # the first server is untouched: same socket file, same table, still serving
    assert stat.S_ISSOCK(os.lstat(first.control).st_mode)
    assert first.thresholds()["be"] == 12345
    with first.client() as h:
        assert h.pread(4096, 0) == image.expected(0, 4096)


def test_a_file_that_is_not_a_socket_is_left_alone(servers, image):
    control = servers.directory / "notes.ctl"
    control.write_text("keep me\n")
    result = run([NBD_VERITY, "serve", image.data, image.hash, image.root,
                  "--unix", servers.directory / "x.sock", "--control", control],
                 env=clean_env())
    assert "is not a socket" in one_error_line(result)
    assert control.read_text() == "keep me\n"


def test_clean_stop_removes_the_control_socket(servers, image):
    server = servers.start(image)
    assert server.stop() == 0
    assert not server.control.exists()
