"""One test per rejected input: exactly one clear line on stderr, exit status 2, no
traceback, nothing on stdout, the data image unchanged and no hash image left behind.

These run the installed console script, as a user would.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import struct
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def good(tmp_path_factory, tools):
    """A 1 MiB data image (256 blocks) and its valid tree: (dir, data, hash, root)."""
    where = tmp_path_factory.mktemp("rejects")
    data = tools.write_image(where / "data.img", 1 << 20)
    hash_image = where / "hash.img"
    run = tools.ours("format", data, hash_image, "--salt=abcd", f"--uuid={tools.uuid}")
    assert run.returncode == 0, run.stderr
    return where, data, hash_image, tools.root_hash(run.stdout)


def patched_hash(good, tmp_path: Path, offset: int, fmt: str, value) -> Path:
    """A copy of the good hash image with one superblock field overwritten."""
    buf = bytearray(good[2].read_bytes())
    struct.pack_into("<" + fmt, buf, offset, value)
    path = tmp_path / "patched.img"
    path.write_bytes(bytes(buf))
    return path


def truncated_hash(good, tmp_path: Path, size: int) -> Path:
    path = tmp_path / "short.img"
    path.write_bytes(good[2].read_bytes()[:size])
    return path


# (id, argv as a function of (good, tmp_path), the one stderr line as a regex)
REJECTS = [
    ("format-missing-data",
     lambda g, t: ["format", t / "missing.img", t / "h"],
     r"nbd-verity: .*/missing\.img: No such file or directory"),
    ("format-data-is-a-directory",
     lambda g, t: ["format", t, t / "h"],
     r"nbd-verity: data: .*: a directory, not a regular file or a block device"),
    ("format-hash-in-missing-directory",
     lambda g, t: ["format", g[1], t / "no" / "h"],
     r"nbd-verity: .*/no/h: No such file or directory"),
    ("verify-missing-data",
     lambda g, t: ["verify", t / "missing.img", g[2], g[3]],
     r"nbd-verity: .*/missing\.img: No such file or directory"),
    ("verify-missing-hash",
     lambda g, t: ["verify", g[1], t / "missing.img", g[3]],
     r"nbd-verity: .*/missing\.img: No such file or directory"),
    ("verify-unreadable-hash-directory",
     lambda g, t: ["verify", g[1], t, g[3]],
     r"nbd-verity: hash: .*: a directory, not a regular file or a block device"),
    ("dump-missing-hash",
     lambda g, t: ["dump", t / "missing.img"],
     r"nbd-verity: .*/missing\.img: No such file or directory"),
    ("verify-hash-image-too-small-for-geometry",
     lambda g, t: ["verify", g[1], truncated_hash(g, t, 8192), g[3]],
     r"nbd-verity: .*/short\.img: hash image is 8192 bytes, its geometry needs 16384"),
    ("verify-hash-image-smaller-than-a-superblock",
     lambda g, t: ["verify", g[1], truncated_hash(g, t, 100), g[3]],
     r"nbd-verity: .*/short\.img: too small to hold a superblock at offset 0"),
    ("dump-superblock-past-the-end",
     lambda g, t: ["dump", g[2], "--hash-offset=1048576"],
     r"nbd-verity: .*hash\.img: too small to hold a superblock at offset 1048576"),
    ("bad-superblock-magic",
     lambda g, t: ["verify", g[1], patched_hash(g, t, 0, "8s", b"verity\0X"), g[3]],
     r"nbd-verity: .*: superblock: not a verity superblock \(bad signature\)"),
    ("bad-superblock-magic-dump",
     lambda g, t: ["dump", patched_hash(g, t, 0, "8s", bytes(8))],
     r"nbd-verity: .*: superblock: not a verity superblock \(bad signature\)"),
    ("bad-superblock-version",
     lambda g, t: ["verify", g[1], patched_hash(g, t, 8, "I", 2), g[3]],
     r"nbd-verity: .*: superblock: unsupported version 2"),
    ("bad-superblock-hash-type",
     lambda g, t: ["dump", patched_hash(g, t, 12, "I", 2)],
     r"nbd-verity: .*: superblock: unsupported hash type 2"),
    ("bad-superblock-algorithm",
     lambda g, t: ["verify", g[1], patched_hash(g, t, 32, "32s", b"whirlpool"), g[3]],
     r"nbd-verity: .*: superblock: hash: unsupported algorithm 'whirlpool' \(supported: .*\)"),
    ("bad-superblock-salt-size",
     lambda g, t: ["verify", g[1], patched_hash(g, t, 80, "H", 300), g[3]],
     r"nbd-verity: .*: superblock: salt_size 300 exceeds 256"),
    ("bad-superblock-block-size",
     lambda g, t: ["verify", g[1], patched_hash(g, t, 68, "I", 3000), g[3]],
     r"nbd-verity: .*: superblock: unsupported hash block size 3000"),
    ("bad-superblock-zero-data-blocks",
     lambda g, t: ["dump", patched_hash(g, t, 72, "Q", 0)],
     r"nbd-verity: .*: superblock: data-blocks: 0 \(at least one block is needed\)"),
    ("format-unknown-algorithm",
     lambda g, t: ["format", g[1], t / "h", "--hash=whirlpool"],
     r"nbd-verity: hash: unsupported algorithm 'whirlpool' \(supported: md5, sha1, .*\)"),
    ("verify-unknown-algorithm-no-superblock",
     lambda g, t: ["verify", g[1], g[2], g[3], "--no-superblock", "--hash=sha257"],
     r"nbd-verity: hash: unsupported algorithm 'sha257' \(supported: .*\)"),
    ("data-block-size-not-a-power-of-two",
     lambda g, t: ["format", g[1], t / "h", "--data-block-size=1000"],
     r"nbd-verity: data-block-size: 1000 is not a power of two from 512 to 524288"),
    ("data-block-size-zero",
     lambda g, t: ["format", g[1], t / "h", "--data-block-size=0"],
     r"nbd-verity: data-block-size: 0 is not a power of two from 512 to 524288"),
    ("data-block-size-zero-verify",
     lambda g, t: ["verify", g[1], g[2], g[3], "--no-superblock", "--data-block-size=0"],
     r"nbd-verity: data-block-size: 0 is not a power of two from 512 to 524288"),
    ("data-block-size-too-small",
     lambda g, t: ["format", g[1], t / "h", "--data-block-size=256"],
     r"nbd-verity: data-block-size: 256 is not a power of two from 512 to 524288"),
    ("data-block-size-too-large",
     lambda g, t: ["format", g[1], t / "h", "--data-block-size=1048576"],
     r"nbd-verity: data-block-size: 1048576 is not a power of two from 512 to 524288"),
    ("hash-block-size-too-small",
     lambda g, t: ["format", g[1], t / "h", "--hash-block-size=256"],
     r"nbd-verity: hash-block-size: 256 is not a power of two from 512 to 524288"),
    ("hash-block-size-zero",
     lambda g, t: ["format", g[1], t / "h", "--hash-block-size=0"],
     r"nbd-verity: hash-block-size: 0 is not a power of two from 512 to 524288"),
    ("hash-block-size-not-a-power-of-two-verify",
     lambda g, t: ["verify", g[1], g[2], g[3], "--no-superblock", "--hash-block-size=1536"],
     r"nbd-verity: hash-block-size: 1536 is not a power of two from 512 to 524288"),
    ("salt-too-long",
     lambda g, t: ["format", g[1], t / "h", "--salt=" + "ab" * 257],
     r"nbd-verity: salt: 257 bytes exceeds the maximum of 256"),
    ("salt-not-hex",
     lambda g, t: ["format", g[1], t / "h", "--salt=xyz1"],
     r"nbd-verity: salt: 'xyz1' is not a hex string"),
    ("salt-odd-length",
     lambda g, t: ["format", g[1], t / "h", "--salt=abc"],
     r"nbd-verity: salt: 'abc' is not a hex string"),
    ("root-hash-wrong-length",
     lambda g, t: ["verify", g[1], g[2], g[3][:40]],
     r"nbd-verity: root-hash: 20 bytes, the algorithm's digest is 32 bytes"),
    ("root-hash-not-hex",
     lambda g, t: ["verify", g[1], g[2], "zz" + g[3][2:]],
     r"nbd-verity: root-hash: 'zz[0-9a-f]{62}' is not a hex string"),
    ("root-hash-missing",
     lambda g, t: ["verify", g[1], g[2]],
     r"nbd-verity: root-hash: missing \(give a root hash or a root-hash-file, or put "
     r".*/data\.img\.roothash beside the image\)"),
    ("root-hash-file-missing",
     lambda g, t: ["verify", g[1], g[2], f"--root-hash-file={t / 'none'}"],
     r"nbd-verity: root-hash-file: .*/none: No such file or directory"),
    ("hash-offset-overlaps-the-data",
     lambda g, t: ["format", g[1], g[1], "--hash-offset=524288"],
     r"nbd-verity: hash-offset: the data area \(bytes 0-1048575 of \S+data.img\) overlaps the "
     r"hash area \(bytes 524288-540671 of \S+data.img\) on the same device"),
    ("hash-offset-zero-on-the-data-image",
     lambda g, t: ["format", g[1], g[1]],
     r"nbd-verity: hash-offset: the data area \(bytes 0-1048575 of \S+data.img\) overlaps the "
     r"hash area \(bytes 0-\d+ of \S+data.img\) on the same device"),
    ("hash-offset-not-a-multiple-of-512",
     lambda g, t: ["format", g[1], t / "h", "--hash-offset=100"],
     r"nbd-verity: hash-offset: 100 is not a multiple of 512"),
    ("hash-offset-negative-verify",
     lambda g, t: ["verify", g[1], g[2], g[3], "--hash-offset=-512"],
     r"nbd-verity: hash-offset: -512 is not a multiple of 512"),
    ("hash-offset-not-a-multiple-of-512-dump",
     lambda g, t: ["dump", g[2], "--hash-offset=1000"],
     r"nbd-verity: hash-offset: 1000 is not a multiple of 512"),
    ("hash-offset-past-the-largest-file-offset",
     lambda g, t: ["format", g[1], t / "h", f"--hash-offset={1 << 63}"],
     r"nbd-verity: hash-offset: 9223372036854775808 is past the largest file offset "
     r"\(2\*\*63 - 1\)"),
    ("hash-offset-past-the-largest-file-offset-verify",
     lambda g, t: ["verify", g[1], g[2], g[3], f"--hash-offset={(1 << 63) - 512}"],
     r"nbd-verity: hash-offset: 9223372036854775296 is past the largest file offset .*"),
    ("format-unknown-hash-type",
     lambda g, t: ["format", g[1], t / "h", "--format=2"],
     r"nbd-verity: format: unsupported hash type 2 \(0 or 1\)"),
    ("format-bad-uuid",
     lambda g, t: ["format", g[1], t / "h", "--uuid=not-a-uuid"],
     r"nbd-verity: uuid: 'not-a-uuid' is not a UUID"),
    ("format-data-blocks-past-the-data",
     lambda g, t: ["format", g[1], t / "h", "--data-blocks=257"],
     r"nbd-verity: data-blocks: 257 blocks of 4096 bytes exceed .*data\.img \(1048576 bytes\)"),
    ("format-data-blocks-zero",
     lambda g, t: ["format", g[1], t / "h", "--data-blocks=0"],
     r"nbd-verity: data-blocks: 0 \(at least one block is needed\)"),
    ("format-data-smaller-than-a-block",
     lambda g, t: ["format", g[1], t / "h", "--data-block-size=524288", "--data-blocks=3"],
     r"nbd-verity: data-blocks: 3 blocks of 524288 bytes exceed .*"),
    ("verify-data-shorter-than-the-tree",
     lambda g, t: ["verify", truncated_hash(g, t, 4096), g[2], g[3]],
     r"nbd-verity: data: .*/short\.img is 4096 bytes, the tree covers 1048576"),
    ("verify-option-contradicts-the-superblock",
     lambda g, t: ["verify", g[1], g[2], g[3], "--hash=sha1"],
     r"nbd-verity: hash: 'sha1' contradicts the superblock's 'sha256'"),
    ("verify-salt-contradicts-the-superblock",
     lambda g, t: ["verify", g[1], g[2], g[3], "--salt=-"],
     r"nbd-verity: salt: '-' contradicts the superblock's 'abcd'"),
]


@pytest.mark.parametrize(("argv", "line"), [(r[1], r[2]) for r in REJECTS],
                         ids=[r[0] for r in REJECTS])
def test_rejected_input(tools, good, tmp_path, argv, line):
    _, data, hash_image, _ = good
    before = (tools.sha256(data), tools.sha256(hash_image))
    run = tools.ours(*argv(good, tmp_path))
    assert run.returncode == 2, run.stdout + run.stderr
    assert len(run.stderr.splitlines()) == 1, run.stderr
    assert re.fullmatch(line, run.stderr.rstrip("\n")), run.stderr
    assert "Traceback" not in run.stderr
    assert run.stdout == ""
    assert (tools.sha256(data), tools.sha256(hash_image)) == before
    assert not (tmp_path / "h").exists()  # a refused format creates no hash image


def test_data_smaller_than_one_block(tools, tmp_path):
    data = tools.write_image(tmp_path / "tiny.img", 100)
    run = tools.ours("format", data, tmp_path / "h")
    assert run.returncode == 2
    assert run.stderr == f"nbd-verity: {data}: 100 bytes, less than one 4096-byte data block\n"
    assert not (tmp_path / "h").exists()


def test_format_and_verify_never_write_to_the_data_image(tools, good, tmp_path):
    _, data, _, _ = good
    before = tools.sha256(data)
    mtime = data.stat().st_mtime_ns
    run = tools.ours("format", data, tmp_path / "h", "--hash-block-size=512")
    assert run.returncode == 0
    root = tools.root_hash(run.stdout)
    assert tools.ours("verify", data, tmp_path / "h", root).returncode == 0
    assert (tools.sha256(data), data.stat().st_mtime_ns) == (before, mtime)


def test_verify_of_a_wrong_root_hash_names_the_top_block(tools, good):
    _, data, hash_image, root = good
    wrong = ("0" if root[0] != "0" else "1") + root[1:]
    run = tools.ours("verify", data, hash_image, wrong)
    assert run.returncode == 1
    assert run.stderr.splitlines() == [
        "nbd-verity: metadata block 1 is corrupted (level 1)",
        "nbd-verity: verification failed: 1 corrupted block(s)"]


# -- odd files where an image belongs --------------------------------------------------
# Each is refused at once (no hang: a FIFO is never opened), in one line that names the
# role, the path and what the file is, before anything is written.

SETPRIV = shutil.which("setpriv") or "/usr/bin/setpriv"
# Root reads any file whatever its mode: without these two capabilities (dropped from
# the bounding and inheritable sets, so the command cannot regain them) it is held to
# the mode bits like any user, while every other file stays as it is.
NO_DAC = [SETPRIV, "--inh-caps=-dac_override,-dac_read_search",
          "--bounding-set=-dac_override,-dac_read_search"]


@pytest.fixture(scope="module")
def odd_files(tmp_path_factory):
    """kind -> (path, what the refusal calls it): a directory, a FIFO, a socket, and
    character devices (/dev/zero, /dev/null)."""
    where = tmp_path_factory.mktemp("odd")  # short: a socket's path holds 108 bytes
    (where / "dir").mkdir()
    os.mkfifo(where / "fifo")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(where / "sock"))  # the socket file outlives the socket
    return {"directory": (where / "dir", "a directory"), "fifo": (where / "fifo", "a FIFO"),
            "socket": (where / "sock", "a socket"),
            "dev-zero": (Path("/dev/zero"), "a character device"),
            "dev-null": (Path("/dev/null"), "a character device")}


# (id, role, argv as a function of (good, tmp_path, the odd path))
ODD_PLACES = [
    ("format-data", "data", lambda g, t, p: ["format", p, t / "h"]),
    ("format-hash", "hash", lambda g, t, p: ["format", g[1], p]),
    ("format-fec", "fec", lambda g, t, p: ["format", g[1], t / "h", "--fec-device", p]),
    ("verify-data", "data", lambda g, t, p: ["verify", p, g[2], g[3]]),
    ("verify-hash", "hash", lambda g, t, p: ["verify", g[1], p, g[3]]),
    ("verify-fec", "fec", lambda g, t, p: ["verify", g[1], g[2], g[3], "--fec-device", p]),
    ("dump-hash", "hash", lambda g, t, p: ["dump", p]),
    ("dump-fec", "fec", lambda g, t, p: ["dump", g[2], "--fec-device", p]),
]
ODD_KINDS = ["directory", "fifo", "socket", "dev-zero", "dev-null"]


@pytest.mark.parametrize("kind", ODD_KINDS)
@pytest.mark.parametrize(("role", "argv"), [(p[1], p[2]) for p in ODD_PLACES],
                         ids=[p[0] for p in ODD_PLACES])
def test_odd_file_as_an_image_is_refused(tools, good, odd_files, tmp_path, role, argv, kind):
    _, data, hash_image, _ = good
    path, what = odd_files[kind]
    before = (tools.sha256(data), tools.sha256(hash_image))
    run = tools.ours(*argv(good, tmp_path, path), timeout=30)  # a hang fails, not waits
    assert (run.returncode, run.stdout) == (2, ""), run.stdout + run.stderr
    assert run.stderr == (f"nbd-verity: {role}: {path}: {what}, not a regular file or a "
                          f"block device\n")
    assert (tools.sha256(data), tools.sha256(hash_image)) == before
    assert not (tmp_path / "h").exists()  # refused before the tree was written


@pytest.mark.parametrize(("role", "argv"), [
    ("data", lambda g, t, p: ["format", p, t / "h"]),
    ("data", lambda g, t, p: ["verify", p, g[2], g[3]]),
    ("hash", lambda g, t, p: ["verify", g[1], p, g[3]]),
    ("hash", lambda g, t, p: ["dump", p]),
    ("fec", lambda g, t, p: ["verify", g[1], g[2], g[3], "--fec-device", p]),
], ids=["format-data", "verify-data", "verify-hash", "dump-hash", "verify-fec"])
def test_unreadable_image_is_refused(tools, good, tmp_path, role, argv):
    _, data, hash_image, root = good
    # The same command reads readable images without the capabilities: only the mode
    # of the one unreadable file makes it fail.
    readable = tools.run([*NO_DAC, tools.nbd_verity_path, "verify", data, hash_image, root])
    assert readable.returncode == 0, readable.stderr
    unreadable = tmp_path / "unreadable.img"
    shutil.copyfile(data if role == "data" else hash_image, unreadable)
    unreadable.chmod(0)
    run = tools.run([*NO_DAC, tools.nbd_verity_path, *argv(good, tmp_path, unreadable)],
                    timeout=30)
    assert (run.returncode, run.stdout) == (2, ""), run.stdout + run.stderr
    assert run.stderr == f"nbd-verity: {role}: {unreadable}: Permission denied\n"
    assert not (tmp_path / "h").exists()
