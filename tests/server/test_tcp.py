"""A client over TCP, where nbdkit knows no client pid: the connection takes the default
I/O class (nbdkit 1.42's nbdkit.peer_pid() raises ValueError there, 1.32's
nbdkit_peer_pid returns -1) and reads verify as over a Unix socket."""

from __future__ import annotations

import hashlib
import socket

from nbd_verity.launch import plugin_environment, run_to_end

from .serverlib import NBDKIT, PLUGIN, server_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_tcp_client_reads_the_verified_device(default_image, tmp_path):
    out = tmp_path / "copy.img"
    pairs = [f"{k}={v}" for k, v in default_image.pairs()]
    argv = [NBDKIT, "-r", "--exit-with-parent", "-i", "127.0.0.1", "-p", str(free_port()),
            "--run", f'nbdcopy "$uri" {out}', "python", str(PLUGIN), *pairs]
    done = run_to_end(argv, timeout=120, env=plugin_environment(server_env()))
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "error" not in done.stderr, done.stderr
    assert hashlib.sha256(out.read_bytes()).digest() == \
        hashlib.sha256(default_image.expected()).digest()
