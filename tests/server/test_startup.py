"""Start-up refusals (one clear line, no traceback) and `nbd-verity serve`'s lifecycle."""

from __future__ import annotations

import os
import shutil
import signal
import socket
from dataclasses import replace
from pathlib import Path

import pytest

from .serverlib import NBD_VERITY, NBDKIT, PLUGIN, Image, flip_byte, run_refusal


def plugin_argv(image: Image, sockdir: str, **keys) -> list[str]:
    pairs = image.pairs(**keys)
    return [NBDKIT, "-f", "-r", "-U", os.path.join(sockdir, "refused.sock"), "python",
            str(PLUGIN), *[f"{k}={v}" for k, v in pairs]]


def serve_argv(image: Image, sockdir: str) -> list[str]:
    return [str(NBD_VERITY), "serve", str(image.data), str(image.hash), image.root,
            "--unix", os.path.join(sockdir, "refused.sock"),
            "--pid-file", os.path.join(sockdir, "refused.pid")]


def wrong_root(image: Image, tmp_path) -> Image:
    last = "0" if image.root[-1] != "0" else "1"
    return replace(image, root=image.root[:-1] + last)


def corrupt_top(image: Image, tmp_path) -> Image:
    copy = image.copy(tmp_path)
    flip_byte(copy.hash, copy.top_block_offset() + 11)
    return copy


def assert_one_clear_line(result, *needles: str) -> str:
    """A non-zero exit, and stderr is one line that says what is wrong."""
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("front", ["plugin", "serve"])
@pytest.mark.parametrize("damage", [wrong_root, corrupt_top], ids=["wrong-root", "bad-top"])
def test_refuses_to_start_on_a_root_mismatch(default_image, tmp_path, sockdir, front, damage):
    image = damage(default_image, tmp_path)
    argv = (plugin_argv if front == "plugin" else serve_argv)(image, sockdir)
    result = run_refusal(argv)
    assert_one_clear_line(result, "root-hash", "does not match")
    if front == "serve":
        assert result.returncode == 2  # the CLI's "bad input" status
        assert not os.path.exists(os.path.join(sockdir, "refused.pid"))


def test_unknown_key_is_named(default_image, sockdir):
    result = run_refusal(plugin_argv(default_image, sockdir, no_such_key="1"))
    assert_one_clear_line(result, "unknown parameter: no-such-key")


@pytest.mark.parametrize("keys, needle", [
    ({"error_mode": "panic"}, "error-mode"),
    ({"cache_size": "lots"}, "cache-size"),
    ({"data_blocks": "0"}, "data-blocks"),
    ({"format": "0"}, "format"),  # contradicts the superblock's format 1
], ids=["error-mode", "cache-size", "data-blocks", "format"])
def test_bad_values_name_their_key(default_image, sockdir, keys, needle):
    assert_one_clear_line(run_refusal(plugin_argv(default_image, sockdir, **keys)), needle)


def test_short_data_image_is_refused(default_image, tmp_path, sockdir):
    image = default_image.copy(tmp_path)
    os.truncate(image.data, image.size - 1)
    assert_one_clear_line(run_refusal(plugin_argv(image, sockdir)), "data", "bytes")


def test_root_hash_of_the_wrong_length_is_refused(default_image, sockdir):
    image = replace(default_image, root=default_image.root[:40])
    assert_one_clear_line(run_refusal(plugin_argv(image, sockdir)), "root-hash")


def test_serve_runs_until_sigterm_then_exits_cleanly(default_image, servers):
    image = default_image
    server = servers.serve_cli([str(image.data), str(image.hash), image.root])
    # serve execs nbdkit: the pid we started is the pid nbdkit writes to its pid file.
    assert int(Path(server.pid_file).read_text()) == server.pid
    h = server.connect()
    assert h.pread(image.size, 0) == image.expected()
    for other in server.handles:  # the clients leave first, as a supervisor stops them
        other.shutdown()
    os.kill(server.pid, signal.SIGTERM)
    assert server.wait() == 0, server.log()
    log = server.log()
    assert "Traceback" not in log
    assert f"serving {image.size} bytes" in log


def test_serve_with_root_hash_file_and_error_mode(default_image, servers, tmp_path):
    image = default_image.copy(tmp_path)
    root_file = tmp_path / "root.txt"
    root_file.write_text(image.root + "\n")
    flip_byte(image.data, 5 * image.data_block_size)
    server = servers.serve_cli([str(image.data), str(image.hash), "--root-hash-file",
                                str(root_file), "--ignore-corruption"])
    h = server.connect()
    assert h.pread(image.size, 0) == image.expected()
    assert "data block 5 is corrupted" in server.log()


# -- odd files where an image belongs: one line at start-up, no hang ---------------------

SETPRIV = "/usr/bin/setpriv"
# Root reads any file whatever its mode; without these capabilities it cannot (see
# tests/cli/test_cli_rejects.py).
NO_DAC = [SETPRIV, "--inh-caps=-dac_override,-dac_read_search",
          "--bounding-set=-dac_override,-dac_read_search"]


def odd_file(kind: str, directory: str) -> tuple[str, str]:
    """(path, what the refusal calls it) of an odd file made in directory."""
    path = os.path.join(directory, kind)
    if kind == "directory":
        os.mkdir(path)
        return path, "a directory"
    if kind == "fifo":
        os.mkfifo(path)
        return path, "a FIFO"
    if kind == "socket":
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(path)
        return path, "a socket"
    return f"/dev/{kind}", "a character device"


def argv_with(front: str, image: Image, sockdir: str, role: str, path: str) -> list[str]:
    """The plugin's or serve's command line with path as the data, hash or FEC image."""
    if role == "data":
        image = replace(image, data=Path(path))
    elif role == "hash":
        image = replace(image, hash=Path(path))
    if front == "plugin":
        return plugin_argv(image, sockdir, **({"fec_device": path} if role == "fec" else {}))
    return serve_argv(image, sockdir) + (["--fec-device", path] if role == "fec" else [])


@pytest.mark.parametrize("kind", ["directory", "fifo", "socket", "zero", "null"])
@pytest.mark.parametrize("role", ["data", "hash", "fec"])
@pytest.mark.parametrize("front", ["plugin", "serve"])
def test_odd_file_as_an_image_is_refused_at_start_up(default_image, sockdir, front, role,
                                                     kind):
    path, what = odd_file(kind, sockdir)
    result = run_refusal(argv_with(front, default_image, sockdir, role, path), timeout=20)
    line = assert_one_clear_line(result)
    assert line.endswith(f"{role}: {path}: {what}, not a regular file or a block device")
    if front == "serve":
        assert result.returncode == 2
        assert not os.path.exists(os.path.join(sockdir, "refused.pid"))


@pytest.mark.parametrize("role", ["data", "hash", "fec"])
@pytest.mark.parametrize("front", ["plugin", "serve"])
def test_unreadable_image_is_refused_at_start_up(default_image, tmp_path, sockdir, front,
                                                 role):
    unreadable = tmp_path / "unreadable.img"
    shutil.copyfile(default_image.data if role == "data" else default_image.hash, unreadable)
    unreadable.chmod(0)
    result = run_refusal([*NO_DAC, *argv_with(front, default_image, sockdir, role,
                                              str(unreadable))], timeout=20)
    line = assert_one_clear_line(result)
    assert line.endswith(f"{role}: {unreadable}: Permission denied")


# -- a path option takes a path: a URL there is never read under the working directory ----

@pytest.mark.parametrize("option", ["--root-hash-file", "--trusted-certs",
                                    "--root-hash-signature", "--fec-device"])
def test_a_url_given_to_a_path_option_is_refused(default_image, sockdir, tmp_path, option):
    planted = tmp_path / "http:" / "images.example" / "b"
    planted.parent.mkdir(parents=True)
    planted.write_text(default_image.root + "\n")  # what `./http://images.example/b` names
    argv = ["/usr/bin/env", "--chdir", str(tmp_path), str(NBD_VERITY), "serve",
            str(default_image.data), str(default_image.hash),
            "--unix", os.path.join(sockdir, "refused.sock"), option, "http://images.example/b"]
    result = run_refusal(argv)
    assert_one_clear_line(result, option.removeprefix("--"), "takes a path, not a URL")
