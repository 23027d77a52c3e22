"""The table changed 100 times while fio reads: no read fails, every byte still matches.

fio (--ioengine=nbd, libnbd underneath) runs four jobs, two on an `@be` and two on a
`@none` connection (two classes of one rank: an idle one would wait for be at the class
gate, schedule/gate.py, and hardly run), with request sizes from 4 KiB to 256 KiB, for a
fixed time. Meanwhile the table alternates between all-pool (every class 0) and
all-inline (every class 256 KiB) through the control socket; after each change we wait
until the server has completed
more requests, so the changes are spread over the reads instead of landing between two
of them. fio's verify option only checks data it wrote, so instead: fio must exit 0 with
no job error, the server must log no error, and afterwards the whole device is read and
compared with the image.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import time

import pytest

from .harness import CLASSES, clean_env

FIO = shutil.which("fio") or "/usr/bin/fio"
RUNTIME_S = 5  # the 100 changes take about 0.5 s here: ample on a busy machine
CHANGES = 100
ALL_POOL = dict.fromkeys(CLASSES, 0)
ALL_INLINE = dict.fromkeys(CLASSES, 256 << 10)


def fio_argv(socket_path, output) -> list[str]:
    uri = f"nbd+unix:///{{}}?socket={socket_path}"
    common = ["--ioengine=nbd", "--rw=randread", "--bssplit=4k/30:16k/20:64k/25:256k/25",
              "--iodepth=4", "--time_based", f"--runtime={RUNTIME_S}"]
    return [FIO, "--output-format=json", f"--output={output}", *common,
            "--name=be", f"--uri={uri.format('@be')}", "--numjobs=2",
            "--name=none", f"--uri={uri.format('@none')}", "--numjobs=2"]


def total_requests(server) -> int:
    return sum(server.counts().values())


def wait_for_progress(server, fio, beyond: int) -> int:
    """Poll the server's counters until more than `beyond` requests completed."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        count = total_requests(server)
        if count > beyond:
            return count
        assert_running(fio)
    raise AssertionError("the server completed no request for 30 s")


def assert_running(fio) -> None:
    """fio must still be reading; if it stopped (a read error stops a job), say why."""
    if fio.poll() is not None:
        out, err = fio.communicate()
        raise AssertionError(f"fio ended (status {fio.returncode}) before the table changes "
                             f"were done:\n{err}\n{out}")


@pytest.fixture
def fio_run(tmp_path):
    """start(argv) → a running fio; killed by pid at teardown if still running."""
    procs = []

    def start(argv):
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=clean_env())
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.communicate()


def test_table_churn_under_fio(servers, image, tmp_path, fio_run):
    if not os.access(FIO, os.X_OK):
        pytest.fail(f"{FIO} is missing: run `make setup`")
    server = servers.start(image, "--workers", "2", "--threshold-preset", "fixed")
    output = tmp_path / "fio.json"
    before = server.thresholds()
    server.reset_stats()
    fio = fio_run(fio_argv(server.socket, output))

    seen = wait_for_progress(server, fio, 0)
    for change in range(CHANGES):
        table = ALL_POOL if change % 2 == 0 else ALL_INLINE
        assert server.set_thresholds(**table) == table
        seen = wait_for_progress(server, fio, seen)
    assert_running(fio)
    assert server.thresholds() == ALL_INLINE != before

    out, err = fio.communicate(timeout=RUNTIME_S + 60)
    assert fio.returncode == 0, f"fio failed ({fio.returncode}):\n{err}\n{out}"
    jobs = json.loads(output.read_text())["jobs"]
    assert len(jobs) == 4
    for job in jobs:
        assert job["error"] == 0, job
        assert job["read"]["total_ios"] > 0, job
        assert job["read"]["short_ios"] == 0 and job["read"]["drop_ios"] == 0, job

    counts = server.counts()
    for io_class in ("be", "none"):
        for path in ("inline", "pool"):
            assert counts[(io_class, path)] > 0, f"{io_class}/{path} never used: {counts}"
    assert all(counts[(c, p)] == 0 for c in ("idle", "rt") for p in ("inline", "pool"))
    assert sum(counts.values()) == sum(job["read"]["total_ios"] for job in jobs)

    status = server.ask({"cmd": "status"})["status"]
    assert (status["status"], status["corruptions"]) == ("V", 0)
    assert "error" not in server.log().lower(), server.log()
    assert_device_equals_image(server, image)


def assert_device_equals_image(server, image) -> None:
    """Read the whole device in mixed sizes (both paths) and compare with the image."""
    server.set_thresholds(be=64 << 10)
    rng = random.Random(7)
    digest = hashlib.sha256()
    with server.client("@be") as h:
        offset = 0
        while offset < image.size:
            length = min(rng.choice([4096, 12288, 65536, 65537, 262144]), image.size - offset)
            digest.update(h.pread(length, offset))
            offset += length
    with open(image.data, "rb") as f:
        assert digest.hexdigest() == hashlib.file_digest(f, "sha256").hexdigest()
