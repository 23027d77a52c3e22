"""`nbd-verity ctl`, run as a user runs it: its output, and its one-line failures."""

from __future__ import annotations

import contextlib
import json
import socket
import threading

import nbd
import pytest

from nbd_verity.launch import NBDKIT
from nbd_verity.serve.nbdkit_compat import nbdkit_version, version_text

from .harness import CLASSES, ctl, one_error_line

KIB = 1024


@pytest.fixture(scope="module")
def server(module_servers, image):
    return module_servers.start(image)


def table_lines(stdout: str, pinned: tuple[str, ...] = ()) -> dict:
    """`ctl thresholds` prints one "CLASS VALUE" line per class, in class order, with
    "(pinned)" after the pinned ones, and nothing else."""
    lines = stdout.strip().splitlines()
    rows = [line.split() for line in lines[:len(CLASSES)]]
    assert [r[0] for r in rows] == list(CLASSES), stdout
    assert [r[0] for r in rows if r[2:] == ["(pinned)"]] == list(pinned), stdout
    rest = lines[len(CLASSES):]
    assert rest == [], stdout
    return {r[0]: int(r[1]) for r in rows}


def stats_rows(stdout: str) -> dict:
    """(class, path) -> (threshold, requests, p50) from `ctl stats`' table."""
    lines = stdout.splitlines()
    assert lines[0].split()[:4] == ["class", "path", "threshold", "requests"], stdout
    rows = {}
    for line in lines[1:9]:
        name, path, threshold, requests, _mib, p50, _p99 = line.split()
        rows[(name, path)] = (int(threshold), int(requests), p50)
    assert sorted(rows) == sorted((c, p) for c in CLASSES for p in ("inline", "pool"))
    return rows


def test_thresholds_show_set_and_preset(server):
    server.ask({"cmd": "thresholds", "preset": "seed"})
    shown = ctl(server.control, "thresholds")
    assert shown.returncode == 0, shown.stderr
    assert table_lines(shown.stdout, CLASSES) == dict.fromkeys(CLASSES, 4096)

    changed = ctl(server.control, "thresholds", "be=65536", "rt=0")
    assert changed.returncode == 0, changed.stderr
    want = {"none": 4096, "rt": 0, "be": 65536, "idle": 4096}
    assert table_lines(changed.stdout, CLASSES) == want  # a preset pinned every class
    assert server.thresholds() == want

    kernel = ctl(server.control, "thresholds", "--preset", "kernel", "--json")
    assert kernel.returncode == 0, kernel.stderr
    reply = json.loads(kernel.stdout)
    assert reply["ok"] is True and sorted(reply) == ["ok", "pinned", "thresholds"]
    assert reply["thresholds"] == {"none": 8192, "rt": 8192, "be": 8192, "idle": 0}
    assert reply["pinned"] == list(CLASSES)  # a fixed preset: the table alone decides
    assert server.thresholds() == reply["thresholds"]


def test_stats_table_json_and_reset(server, image):
    server.set_thresholds(be=65536)
    server.reset_stats()
    with server.client("@be") as h:
        assert h.pread(64 * KIB, 0) == image.expected(0, 64 * KIB)

    table = ctl(server.control, "stats")
    assert table.returncode == 0, table.stderr
    rows = stats_rows(table.stdout)
    assert rows[("be", "inline")][:2] == (65536, 1)
    assert rows[("be", "inline")][2] != "-"  # a latency was measured
    assert all(n == 0 for key, (_, n, _) in rows.items() if key != ("be", "inline"))
    assert "status V" in table.stdout
    running = version_text(nbdkit_version(NBDKIT))  # the nbdkit that runs the server
    assert running != "unknown" and f"nbdkit {running}" in table.stdout

    raw = ctl(server.control, "stats", "--json")
    assert raw.returncode == 0, raw.stderr
    reply = json.loads(raw.stdout)
    assert reply["ok"] is True
    assert reply["stats"]["classes"]["be"]["inline"]["requests"] == 1
    assert reply["stats"]["classes"]["be"]["inline"]["bytes"] == 64 * KIB
    assert reply["stats"]["thresholds"]["be"] == 65536
    assert reply["stats"]["nbdkit"] == running

    # --reset prints the counters it zeroes; afterwards every row is zero, latencies "-"
    reset = ctl(server.control, "stats", "--reset", "--json")
    assert reset.returncode == 0, reset.stderr
    assert json.loads(reset.stdout)["stats"]["classes"]["be"]["inline"]["requests"] == 1
    after = ctl(server.control, "stats")
    assert after.returncode == 0, after.stderr
    assert all((n, p50) == (0, "-") for _, n, p50 in stats_rows(after.stdout).values())
    assert server.stats()["totals"]["data_blocks_verified"] == 0


def test_status_shows_v_then_c(servers, damaged_image):
    server = servers.start(damaged_image)
    before = ctl(server.control, "status")
    assert before.returncode == 0, before.stderr
    assert before.stdout.split()[:3] == ["V", "corruptions", "0"], before.stdout

    with server.client() as h:
        assert h.pread(4096, 0) == damaged_image.expected(0, 4096)
        assert ctl(server.control, "status").stdout.split()[0] == "V"
        with pytest.raises(nbd.Error):
            h.pread(64 * KIB, 64 * KIB)  # covers damaged block 20

    after = ctl(server.control, "status")
    assert after.returncode == 0, after.stderr
    assert after.stdout.split()[:3] == ["C", "corruptions", "1"], after.stdout
    assert json.loads(ctl(server.control, "status", "--json").stdout)["status"][
        "status"] == "C"
    # a reset zeroes the counters, but C stays: dm-verity never clears hash_failed
    assert ctl(server.control, "stats", "--reset").returncode == 0
    assert ctl(server.control, "status").stdout.split()[:3] == ["C", "corruptions", "0"]


@pytest.mark.parametrize(("args", "phrase"), [
    (["thresholds", "bogus=1"], "unknown I/O class 'bogus'"),
    (["thresholds", "be=-1"], "outside 0.."),
    (["thresholds", "be=99999999999"], "outside 0.."),
    (["thresholds", "--preset", "turbo"], "unknown preset 'turbo'"),
])
def test_server_error_is_one_line(server, args, phrase):
    before = server.thresholds()
    line = one_error_line(ctl(server.control, *args))
    assert line.startswith("nbd-verity: server: "), line
    assert phrase in line
    assert server.thresholds() == before


REPLIES = {"mute": b"", "garbage": b"hello\n"}


def answer_once(listener: socket.socket, reply: bytes) -> None:
    with contextlib.suppress(OSError):  # the listener closes at teardown
        conn, _ = listener.accept()
        with conn, conn.makefile("rb") as requests:
            requests.readline()
            conn.sendall(reply)


@pytest.fixture
def unreachable(tmp_path):
    """kind → a control path that cannot answer; listeners are closed at the end."""
    held = []

    def make(kind: str):
        path = tmp_path / f"{kind}.sock"
        if kind == "missing":
            return path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        held.append(sock)
        sock.bind(str(path))
        if kind in REPLIES:  # reads the request, answers REPLIES[kind], closes
            sock.listen(1)
            threading.Thread(target=answer_once, args=(sock, REPLIES[kind]),
                             daemon=True).start()
        return path  # "stale": bound, never listening

    yield make
    for sock in held:
        sock.close()


@pytest.mark.parametrize(("kind", "phrase"), [
    ("missing", "No such file or directory"),
    ("stale", "Connection refused"),
    ("mute", "the server closed the connection without a reply"),
    ("garbage", "no valid reply"),
])
def test_unreachable_control_is_one_line(unreachable, kind, phrase):
    path = unreachable(kind)
    line = one_error_line(ctl(path, "status"))
    assert line == f"nbd-verity: control: {path}: {phrase}"
