"""Every malformed control message gets one error reply, changes nothing, and the server
keeps serving.

Before each message the table is set to values no preset has and one read is counted;
after it the table and the counters must be exactly as they were (so a half-applied
change, a preset or a reset slipping through all fail), and a read must still return the
image's bytes.
"""

from __future__ import annotations

import json
import socket

import pytest

from .harness import exchange

KNOWN = {"none": 1000, "rt": 2000, "be": 3000, "idle": 5000}
MAX = 32 << 20
MAX_REQUEST_LINE = 64 << 10  # the documented longest request line
SET_BE = b'{"cmd": "thresholds", "set": {"be": 65536}}'


def line(obj) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def padded(request: bytes, size: int) -> bytes:
    """request padded with spaces (still valid JSON) to size bytes, then a newline."""
    return request[:1] + b" " * (size - len(request)) + request[1:] + b"\n"


# id -> (raw request, a phrase the error must contain)
MALFORMED = {
    "bad-json": (b'{"cmd": "thresholds"\n', "malformed JSON"),
    "not-utf8": (b'\xff\xfe{}\n', "malformed JSON"),
    "array": (b'["thresholds"]\n', "JSON object"),
    "string": (b'"thresholds"\n', "JSON object"),
    "number": (b'42\n', "JSON object"),
    "null": (b'null\n', "JSON object"),
    "missing-cmd": (line({}), "cmd"),
    "missing-cmd-with-set": (line({"set": {"be": 65536}}), "cmd"),
    "unknown-cmd": (line({"cmd": "frobnicate"}), "unknown command 'frobnicate'"),
    "cmd-not-string": (line({"cmd": 5}), "cmd: expected str"),
    "cmd-null": (line({"cmd": None}), "cmd"),
    "unknown-class": (line({"cmd": "thresholds", "set": {"bogus": 65536}}),
                      "unknown I/O class 'bogus'"),
    "negative": (line({"cmd": "thresholds", "set": {"be": -1}}), "outside 0.."),
    "float": (line({"cmd": "thresholds", "set": {"be": 65536.0}}), "not an integer"),
    "float-exponent": (b'{"cmd": "thresholds", "set": {"be": 6.5e4}}\n', "not an integer"),
    "bool": (line({"cmd": "thresholds", "set": {"be": True}}), "not an integer"),
    "string-value": (line({"cmd": "thresholds", "set": {"be": "65536"}}), "not an integer"),
    "null-value": (line({"cmd": "thresholds", "set": {"be": None}}), "not an integer"),
    "too-large": (line({"cmd": "thresholds", "set": {"be": MAX + 1}}), "outside 0.."),
    "huge": (line({"cmd": "thresholds", "set": {"be": 2**80}}), "outside 0.."),
    "one-bad-of-two": (line({"cmd": "thresholds", "set": {"be": 65536, "rt": -1}}),
                       "outside 0.."),
    "set-not-object": (line({"cmd": "thresholds", "set": [65536]}), "set: expected dict"),
    "set-and-preset": (line({"cmd": "thresholds", "set": {"be": 65536}, "preset": "kernel"}),
                       "not both"),
    "unknown-preset": (line({"cmd": "thresholds", "preset": "turbo"}), "unknown preset"),
    "preset-not-string": (line({"cmd": "thresholds", "preset": 1}), "preset: expected str"),
    "unknown-field-thresholds": (line({"cmd": "thresholds", "sett": {"be": 65536}}),
                                 "unknown field"),
    "reset-not-bool": (line({"cmd": "stats", "reset": "yes"}), "reset: expected bool"),
    "reset-number": (line({"cmd": "stats", "reset": 1}), "reset: expected bool"),
    # a typo must not pass silently: {"cmd": "stats", "rest": true} would not reset
    "unknown-field-stats": (line({"cmd": "stats", "rest": True}), "unknown field"),
    "unknown-field-status": (line({"cmd": "status", "verbose": True}), "unknown field"),
    # overlong: far past the limit; one byte past it, and 100 KB, each a valid request
    # whose newline comes with a later recv than the limit check sees
    "overlong-200k": (b'{"cmd": "thresholds"' + b" " * 200_000 + b"}\n", "longer than"),
    "overlong-by-one-valid": (padded(SET_BE, MAX_REQUEST_LINE + 1), "longer than"),
    "overlong-100k-valid": (padded(SET_BE, 100_000), "longer than"),
    "overlong-no-newline": (b"x" * 300_000, "longer than"),
}


@pytest.fixture(scope="module")
def server(module_servers, image):
    return module_servers.start(image)


@pytest.fixture
def primed(server, image):
    """The server with KNOWN as its table and exactly one read counted."""
    server.set_thresholds(**KNOWN)
    server.reset_stats()
    with server.client("@be") as h:
        assert h.pread(4096, 0) == image.expected(0, 4096)
    return server


def snapshot(server) -> tuple:
    stats = server.stats()
    rows = {(c, p): (row["requests"], row["bytes"])
            for c, paths in stats["classes"].items() for p, row in paths.items()}
    return server.thresholds(), rows, stats["totals"]["data_blocks_verified"]


@pytest.mark.parametrize(("raw", "phrase"), list(MALFORMED.values()), ids=list(MALFORMED))
def test_malformed_message_is_refused(primed, image, raw, phrase):
    server = primed
    before = snapshot(server)
    reply_line = exchange(server.control, raw)
    assert reply_line.endswith(b"\n") and reply_line.count(b"\n") == 1, reply_line
    reply = json.loads(reply_line)
    assert reply["ok"] is False, reply
    assert set(reply) == {"ok", "error"}, reply
    assert phrase in reply["error"], reply
    assert "\n" not in reply["error"]
    assert snapshot(server) == before
    assert server.thresholds() == KNOWN
    with server.client("@be") as h:
        assert h.pread(65536, 4096) == image.expected(4096, 65536)


def test_errors_do_not_end_the_conversation(primed):
    """Several lines on one connection: each gets its own reply, in order."""
    raw = (b'{"cmd": "nope"}\n' b'not json\n' b'{"cmd": "thresholds"}\n'
           b'{"cmd": "thresholds", "set": {"be": -5}}\n' b'{"cmd": "status"}\n')
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(primed.control))
        sock.sendall(raw)
        sock.shutdown(socket.SHUT_WR)
        replies = sock.makefile("rb").read().splitlines()
    oks = [json.loads(r)["ok"] for r in replies]
    assert oks == [False, False, True, False, True]
    assert json.loads(replies[2])["thresholds"] == KNOWN
    assert primed.thresholds() == KNOWN


def test_good_messages_still_work_afterwards(primed):
    """The control socket itself is not wedged by all of the above."""
    assert primed.ask({"cmd": "thresholds", "preset": "kernel"})["thresholds"] == {
        "none": 8192, "rt": 8192, "be": 8192, "idle": 0}
    assert primed.set_thresholds(be=0, idle=MAX) == {
        "none": 8192, "rt": 8192, "be": 0, "idle": MAX}


def test_a_line_of_exactly_the_limit_is_answered(primed):
    reply = json.loads(exchange(primed.control, padded(b'{"cmd": "thresholds"}', MAX_REQUEST_LINE)))
    assert reply["ok"] is True and reply["thresholds"] == KNOWN
