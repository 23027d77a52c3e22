"""Fuzzing what a stranger controls (hypothesis): a superblock, plugin keys, export names
and control-socket lines. Whatever the input, the answer is a value or one of our
errors with a one-line message, never another exception (no traceback reaches a log).
"""

from __future__ import annotations

import json
import string

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nbd_verity.control.protocol import MAX_DEPTH, Control, nesting_depth
from nbd_verity.errors import VerityError
from nbd_verity.format.params import VerityParams, params_from_superblock
from nbd_verity.format.superblock import SUPERBLOCK_SIZE, Superblock
from nbd_verity.ioclass import CLASSES, class_from_export_name
from nbd_verity.prepare.config import KEYS, ConfigBuilder

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VALID = VerityParams(data_blocks=1000, salt=bytes(range(32)), uuid=bytes(16)).check()
GOOD_SUPERBLOCK = VALID.to_superblock().pack()


def one_line(error: Exception) -> None:
    text = str(error)
    assert text and "\n" not in text and "Traceback" not in text, text


# -- superblock ----------------------------------------------------------------------


def parse(buf: bytes) -> None:
    """What the server does with a superblock: decode, validate, build parameters."""
    try:
        params_from_superblock(Superblock.unpack(buf).validate()).geometry()
    except VerityError as e:
        one_line(e)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, SUPERBLOCK_SIZE - 1), st.integers(0, 255)),
                min_size=1, max_size=12))
def test_superblock_with_bytes_changed(changes):
    buf = bytearray(GOOD_SUPERBLOCK)
    for offset, value in changes:
        buf[offset] = value
    parse(bytes(buf))


@FUZZ
@given(st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
       st.integers(0, 2**16 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1))
def test_superblock_with_any_numbers(data_blocks, dbs, hbs, salt_size, version, hash_type):
    """The numeric fields at their full on-disk width (little-endian, cryptsetup layout:
    version at 8, hash_type at 12, data_block_size at 64, hash_block_size at 68,
    data_blocks at 72, salt_size at 80); the decoded superblock shows each value."""
    buf = bytearray(GOOD_SUPERBLOCK)
    buf[8:12] = version.to_bytes(4, "little")
    buf[12:16] = hash_type.to_bytes(4, "little")
    buf[64:68] = dbs.to_bytes(4, "little")
    buf[68:72] = hbs.to_bytes(4, "little")
    buf[72:80] = data_blocks.to_bytes(8, "little")
    buf[80:82] = salt_size.to_bytes(2, "little")
    sb = Superblock.unpack(bytes(buf))
    assert (sb.version, sb.hash_type, sb.data_block_size, sb.hash_block_size,
            sb.data_blocks, sb.salt_size) == (version, hash_type, dbs, hbs, data_blocks,
                                             salt_size)
    assert sb.salt == GOOD_SUPERBLOCK[88:88 + min(salt_size, 256)]  # the salt is untouched
    parse(bytes(buf))


def test_superblock_numbers_land_in_their_fields():
    """The fuzzed offsets are the fields: the good values written back give the good
    superblock, and a bad one at each offset is refused by that field's message."""
    for offset, width, bad, message in ((64, 4, 1000, "unsupported data block size 1000"),
                                        (68, 4, 768, "unsupported hash block size 768"),
                                        (72, 8, 0, "data-blocks: 0"),
                                        (80, 2, 257, "salt_size 257 exceeds 256")):
        buf = bytearray(GOOD_SUPERBLOCK)
        buf[offset:offset + width] = bad.to_bytes(width, "little")
        try:
            params_from_superblock(Superblock.unpack(bytes(buf)).validate())
        except VerityError as e:
            assert message in str(e)
        else:
            raise AssertionError(f"offset {offset}: {bad} was accepted")


@FUZZ
@given(st.binary(max_size=2 * SUPERBLOCK_SIZE))
def test_superblock_from_random_bytes(buf):
    parse(buf)


# -- plugin keys ---------------------------------------------------------------------

KEY_NAMES = [key.name for key in KEYS]
TEXT = st.text(alphabet=string.printable + "é\x00", max_size=40)


@FUZZ
@given(st.lists(st.tuples(st.one_of(st.sampled_from(KEY_NAMES), TEXT), TEXT), max_size=8))
def test_plugin_keys(pairs):
    builder = ConfigBuilder()
    try:
        for key, value in pairs:
            builder.add(key, value)
        builder.build()
    except VerityError as e:
        one_line(e)


# -- export names --------------------------------------------------------------------


@FUZZ
@given(st.text(max_size=80))
def test_export_names(name):
    try:
        index = class_from_export_name(name)
    except VerityError as e:
        one_line(e)
        assert "@" in name
        return
    if index is None:
        assert "@" not in name
    else:
        assert name.rpartition("@")[2].strip().lower() == CLASSES[index]


@given(st.sampled_from(CLASSES), st.sampled_from([str.upper, str.title, str.lower]))
def test_class_names_are_case_insensitive(name, case):
    assert class_from_export_name(f"disk@{case(name)}") == CLASSES.index(name)


# -- control protocol ----------------------------------------------------------------


class FakeDispatcher:
    table = (4096, 4096, 4096, 4096)
    pinned = frozenset()

    def set_table(self, table, pinned=None):
        self.table = table
        if pinned is not None:
            self.pinned = frozenset(pinned)


class FakeDevice:
    """What Control asks of a Device, with no images behind it."""

    def __init__(self) -> None:
        self.dispatcher = FakeDispatcher()

    def stats(self) -> dict:
        return {"totals": {}}

    def reset_stats(self) -> None:
        pass

    def status(self) -> dict:
        return {"status": "V"}

    explicit: dict = {}  # noqa: RUF012 - no --threshold given


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)
REQUESTS = st.fixed_dictionaries(
    {"cmd": st.sampled_from(["thresholds", "stats", "status", "x"])},
    optional={"set": st.dictionaries(st.sampled_from(["be", "RT", "idle", "bogus"]), JSON),
              "preset": JSON, "reset": JSON, "extra": JSON})


def answer(line: bytes) -> dict:
    reply = Control(FakeDevice()).handle_line(line)
    json.dumps(reply)  # always serialisable
    assert reply["ok"] in (True, False)
    if not reply["ok"]:
        assert isinstance(reply["error"], str) and "\n" not in reply["error"]
    return reply


@FUZZ
@given(st.one_of(REQUESTS, JSON))
def test_control_requests(request):
    answer(json.dumps(request).encode())


@FUZZ
@given(st.binary(max_size=200))
def test_control_bytes(line):
    answer(line)


@FUZZ
@given(st.integers(MAX_DEPTH + 1, 30000), st.sampled_from(["[", '{"a":']))
def test_control_nesting_is_an_error_reply(depth, opener):
    closer = "]" if opener == "[" else "}"
    line = (opener * depth + "1" + closer * depth).encode()
    assert nesting_depth(line) == depth
    assert "nesting deeper" in answer(line)["error"]


def test_brackets_inside_strings_do_not_count():
    line = json.dumps({"cmd": "status", "x": "[" * 100 + '\\"{' * 50}).encode()
    assert nesting_depth(line) <= 1
    assert "unknown field" in answer(line)["error"]


def test_upper_case_class_names_in_set_are_accepted():
    reply = answer(b'{"cmd": "thresholds", "set": {"BE": 8192, "Rt": 0}}')
    assert reply["ok"] and reply["thresholds"]["be"] == 8192 and reply["thresholds"]["rt"] == 0
