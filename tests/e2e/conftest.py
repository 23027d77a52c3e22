"""Fixtures of the real-kernel tests: host packages, and images shared by the whole session."""

from __future__ import annotations

import hashlib
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from .harness import BOOTS, NBD_VERITY, Export, ensure_packages, guest_system
from .images import random_file, verity_format

# 64 MiB: 16384 data blocks, 128 level-0 hash blocks under one level-1 block, so a scan of
# every block stays within seconds in the guest and level 0 is not the root.
DATA_SIZE = 64 * 1024 * 1024


@dataclass(frozen=True)
class Images:
    """The session's good data image, its veritysetup tree and its SHA-256."""

    export: Export
    sha256: str
    data_blocks: int


@pytest.fixture(scope="session")
def e2e_host() -> None:
    """The host can run guests: packages installed and this checkout's serve command present."""
    ensure_packages()
    guest_system()  # the kernel (downloaded once per machine) and the initramfs
    if not NBD_VERITY.exists():
        raise RuntimeError(f"e2e: {NBD_VERITY} is missing; run `make setup`")
    subprocess.run([str(NBD_VERITY), "serve", "--help"], check=True, capture_output=True)


@pytest.fixture(scope="session")
def images(e2e_host, tmp_path_factory) -> Images:
    folder: Path = tmp_path_factory.mktemp("e2e-images")
    data = random_file(folder / "data.img", DATA_SIZE, seed=20241130)
    export = verity_format(data, folder / "hash.img")
    sha = hashlib.sha256(data.read_bytes()).hexdigest()
    return Images(export=export, sha256=sha, data_blocks=DATA_SIZE // 4096)


def pytest_terminal_summary(terminalreporter):
    """One line per guest boot, so that a slow guest shows in every run, under the kernel
    they booted (the release's own: 6.1 on Debian 12, 6.12 on Debian 13)."""
    if BOOTS:
        terminalreporter.section(f"e2e guest boots (QEMU, {guest_system().kernel.package})")
        for line in BOOTS:
            terminalreporter.write_line(line)
