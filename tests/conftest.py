"""Fixtures shared by every test: the installed CLI, the veritysetup oracle, images,
loop devices.

`tools` runs `nbd-verity` (the console script of this venv, as a user would) and the real
`veritysetup` in subprocesses with a clean environment, so a test sees exactly what a user
sees: stdout, stderr and the exit status. It is session-scoped, so hypothesis tests may use
it. Images are made from a seeded random generator and are the same on every run.
`loop_device` attaches a file as a block device (`losetup -f --show`) and detaches it, by
the name losetup printed, when the test ends.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

NBD_VERITY = str(Path(sys.executable).parent / "nbd-verity")
VERITYSETUP = shutil.which("veritysetup") or "/usr/sbin/veritysetup"
LOSETUP = shutil.which("losetup") or "/usr/sbin/losetup"
# A fixed UUID and salt make both tools' output deterministic, hence comparable byte for byte.
UUID = "a60c98d2-ae9b-4865-bfcb-b4e3ace11033"
SALT = "e48da609055204e89ae53b655ca2216dd983cf3cb829f34f63a297d106d53e2d"


def _clean_env() -> dict:
    """The caller's environment without NBD_VERITY_* defaults, in the C locale."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBD_VERITY_")}
    env["LC_ALL"] = "C"
    return env


def random_bytes(size: int, seed: int) -> bytes:
    """size bytes from a generator seeded with seed: the same on every run."""
    return random.Random(seed).randbytes(size)


def write_image(path: Path, size: int, seed: int = 0) -> Path:
    """A fresh file of size deterministic random bytes."""
    path.write_bytes(random_bytes(size, seed))
    return path


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class Tools:
    """Runs the two command lines and reads what they print; holds the image helpers."""

    nbd_verity_path = NBD_VERITY
    veritysetup_path = VERITYSETUP
    uuid = UUID
    salt = SALT
    random_bytes = staticmethod(random_bytes)
    write_image = staticmethod(write_image)
    sha256 = staticmethod(file_sha256)

    def run(self, argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                              env=_clean_env(), timeout=timeout, check=False)

    def ours(self, *args, timeout: float = 300) -> subprocess.CompletedProcess:
        return self.run([NBD_VERITY, *args], timeout=timeout)

    def theirs(self, *args) -> subprocess.CompletedProcess:
        return self.run([VERITYSETUP, *args])

    @staticmethod
    def root_hash(stdout: str) -> str:
        """The hex root hash from a `format` header ("Root hash:      \\t<hex>")."""
        for line in stdout.splitlines():
            if line.startswith("Root hash:"):
                return line.split("\t", 1)[1].strip()
        raise AssertionError(f"no 'Root hash:' line in:\n{stdout}")

    @staticmethod
    def fields(stdout: str) -> list[str]:
        """The field lines of a header ("Name: \\tvalue"), without the file-name line."""
        return [line for line in stdout.splitlines()
                if ":" in line and not line.startswith("VERITY header information")]


@pytest.fixture(scope="session")
def tools() -> Tools:
    for path in (NBD_VERITY, VERITYSETUP):
        if not os.access(path, os.X_OK):
            pytest.fail(f"{path} is missing: run `make setup` (it installs cryptsetup-bin)")
    return Tools()


@pytest.fixture
def loop_device(request):
    """attach(path, writable=False, offset=0) -> Path of a loop device over path from byte
    offset on (read-only unless writable); each one is detached by its name when the test
    ends, whatever happened."""
    def attach(path, writable: bool = False, offset: int = 0) -> Path:
        argv = [LOSETUP, "-f", "--show", *([] if writable else ["-r"]),
                *(["-o", str(offset)] if offset else []), str(path)]
        run = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        if run.returncode != 0:
            pytest.fail(f"losetup: {run.stderr.strip()}")
        name = run.stdout.strip()
        request.addfinalizer(lambda: subprocess.run([LOSETUP, "-d", name], timeout=60,
                                                    check=True))
        return Path(name)
    return attach
