"""Pure parts of the hostile-client defences: the log rate limit and its summary, and the
nbdkit version rules (nbdkit_compat)."""

from __future__ import annotations

import os
import subprocess

from nbd_verity import logbound
from nbd_verity.launch import NBDKIT
from nbd_verity.serve.nbdkit_compat import (
    auto_thread_model,
    has_send_race,
    leaks_failures,
    nbdkit_version,
    parse_version,
    say_one_at_a_time,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_rate_limit_counts_what_it_holds_back_and_rolls_per_window():
    clock = Clock()
    limit = logbound.RateLimit(3, 60.0, clock)
    assert [limit.admit() for _ in range(5)] == [True, True, True, False, False]
    clock.now = 59.9
    assert limit.roll() is None
    clock.now = 60.0
    assert limit.roll() == (2, 60.0)
    assert limit.admit()


def test_summary_line_of_a_window_with_lines_held_back():
    totals = iter([(0, 0), (57, 1203)])
    bounded = logbound.BoundedLog(2, lambda: next(totals))
    clock = Clock()
    bounded.limit = logbound.RateLimit(2, 60.0, clock)
    read_fd, write_fd = os.pipe()
    bounded.out_fd = write_fd
    for n in range(5):
        bounded.emit(f"nbd-verity: line {n}\n")
    clock.now = 61.0
    bounded.emit("nbd-verity: next window\n")
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as f:
        out = f.read().decode().splitlines()
    assert out == ["nbd-verity: line 0", "nbd-verity: line 1",
                   "nbd-verity: 57 more corruptions, 1203 failed reads in the last 61 s; 3 log"
                   " lines not shown (log-rate=2 a minute)", "nbd-verity: next window"]


def test_nbdkit_error_lines_are_limited_and_others_pass():
    assert logbound.NBDKIT_ERROR.match(b"nbdkit: python[4]: error: write reply: x: Broken pipe")
    assert logbound.NBDKIT_ERROR.match(b"nbdkit: python[1]: error: /p/plugin.py: pread: error: x")
    assert not logbound.NBDKIT_ERROR.match(b"nbdkit: python[1]: debug: python: pread")


def test_nbdkit_versions():
    assert parse_version("binary=/usr/bin/nbdkit\nversion=1.32.5\n") == (1, 32, 5)
    assert parse_version("") is None
    dump_1_42 = ("binary=/usr/bin/nbdkit\nbindir=/usr/bin\nsbindir=/usr/bin\n"
                 "version=1.42.3\nversion_major=1\nversion_minor=42\nzstd=yes\n")
    assert parse_version(dump_1_42) == (1, 42, 3)  # Debian 13's, in /usr/bin
    assert not has_send_race((1, 42, 3)) and leaks_failures((1, 42, 3)) is None
    assert has_send_race((1, 32, 5)) and has_send_race((1, 33, 9)) and has_send_race(None)
    assert not has_send_race((1, 34, 0)) and not has_send_race((1, 30, 0))
    assert leaks_failures((1, 32, 5)) is True and leaks_failures((1, 34, 0)) is None
    assert leaks_failures(None) is None  # unknown: found out at the first failures


def test_auto_thread_model_serves_a_network_images_requests_together_where_safe(capfd):
    """thread-model=auto: parallel only for an image read over a network on an nbdkit
    without the disconnect race that can shut a connection; else one at a time, and for
    a network image a line that says so."""
    assert auto_thread_model(False, (1, 42, 3), True) == "serialize-requests"
    assert auto_thread_model(False, (1, 32, 5), False) == "serialize-requests"
    assert capfd.readouterr().err == ""  # a local image: nothing to say
    assert auto_thread_model(True, (1, 42, 3), True) == "parallel"
    assert auto_thread_model(True, (1, 34, 0), True) == "parallel"
    assert capfd.readouterr().err == ""
    assert auto_thread_model(True, (1, 34, 0), False) == "serialize-requests"
    assert auto_thread_model(True, (1, 32, 5), False) == "serialize-requests"
    assert auto_thread_model(True, None, True) == "serialize-requests"  # unknown: as 1.32
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 3 and all("one at a time" in line for line in lines), lines
    assert "nbdkit 1.32.5 a client can abort" in lines[1], lines


def test_a_network_image_served_one_request_at_a_time_says_how_to_get_more(capfd):
    """The start-up line of serialize-requests for a network image: the workarounds, and
    the parallel model's risk where nbdkit has the disconnect race."""
    say_one_at_a_time((1, 42, 3))
    say_one_at_a_time((1, 32, 5))
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert all("one at a time" in line and "nbd-client -C N" in line and
               "--thread-model parallel" in line for line in lines), lines
    assert "abort" not in lines[0] and "nbdkit 1.32.5 a client can abort" in lines[1]


def test_nbdkit_version_is_asked_of_each_binary(tmp_path):
    """One answer per binary: a missing one says None without hiding the real one."""
    assert nbdkit_version(str(tmp_path / "no-nbdkit")) is None
    dumped = subprocess.run([NBDKIT, "--dump-config"], capture_output=True, text=True,
                            check=True).stdout
    assert parse_version(dumped) is not None
    assert nbdkit_version(NBDKIT) == parse_version(dumped)
