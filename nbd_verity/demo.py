"""`make demo`: a walkthrough of nbd-verity, run step by step with the installed CLI.

Usage: python -m nbd_verity.demo WORKDIR

Each step is a small function registered with @step; they run in order and share one
Walkthrough (paths, the root hash). A step prints every command it runs, as a user would
type it, with its output, and raises StepFailed when anything does not behave as
expected; the demo then stops and exits 1. To extend the demo, add @step functions at
the end of the steps below (above the __main__ guard).
"""

from __future__ import annotations

import random
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .params import VerityParams

IMAGE_SIZE = 64 << 20  # 16384 data blocks of 4096 bytes: a two-level tree (128 + 1)
IMAGE_SEED = 2024
# A fixed salt and UUID make the root hash the same on every run (format picks random ones).
SALT = "6e62642d7665726974792064656d6f2073616c74"
UUID = "5b1f0a52-7a3c-4d27-9d8e-1f1e0d3c2b4a"
CORRUPT_DATA_BLOCK = 12345


class StepFailed(Exception):
    """A step whose command did not behave as the walkthrough expects."""


@dataclass
class Walkthrough:
    """What the steps share: where the files are, and what earlier steps found."""

    workdir: Path
    cli: str
    root: str = ""
    facts: dict = field(default_factory=dict)  # anything a later step wants to reuse

    @property
    def data(self) -> Path:
        return self.workdir / "data.img"

    @property
    def hash(self) -> Path:
        return self.workdir / "data.hash"

    def say(self, text: str) -> None:
        print(text, flush=True)

    def run(self, *args, expect: int = 0) -> subprocess.CompletedProcess:
        """Run `nbd-verity ARGS` in the work directory, show it, check its exit status."""
        argv = [str(a) for a in args]
        self.say(f"$ nbd-verity {shlex.join(argv)}")
        done = subprocess.run([self.cli, *argv], cwd=self.workdir, capture_output=True,
                              text=True, check=False)
        for line in (done.stdout + done.stderr).splitlines():
            self.say(f"    {line}")
        if done.returncode != expect:
            raise StepFailed(f"`nbd-verity {shlex.join(argv)}` exited {done.returncode}, "
                             f"expected {expect}")
        return done

    def expect_in(self, text: str, output: str) -> None:
        if text not in output:
            raise StepFailed(f"expected {text!r} in the output")


Step = Callable[[Walkthrough], None]
STEPS: list[Step] = []


def step(fn: Step) -> Step:
    """Register fn as the next step of the walkthrough; its docstring is its title."""
    STEPS.append(fn)
    return fn


def flip_byte(path: Path, offset: int) -> None:
    """Invert one byte in place: the smallest possible corruption."""
    with open(path, "r+b") as f:
        f.seek(offset)
        value = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value ^ 0xFF]))


@step
def make_image(w: Walkthrough) -> None:
    """Create a 64 MiB sample data image (the same bytes on every run)."""
    w.data.write_bytes(random.Random(IMAGE_SEED).randbytes(IMAGE_SIZE))
    w.hash.unlink(missing_ok=True)  # format, like veritysetup, never truncates it
    w.say(f"wrote {w.data.name}: {IMAGE_SIZE >> 20} MiB of seeded random data")


@step
def format_image(w: Walkthrough) -> None:
    """Build the hash tree and print the root hash (publish this value, or sign it)."""
    done = w.run("format", w.data.name, w.hash.name, f"--salt={SALT}", f"--uuid={UUID}")
    for line in done.stdout.splitlines():
        if line.startswith("Root hash:"):
            w.root = line.split()[-1]
    if len(w.root) != 64:
        raise StepFailed("format printed no SHA-256 root hash")
    w.say(f"root hash: {w.root}")


@step
def dump_superblock(w: Walkthrough) -> None:
    """Read back the superblock, as `veritysetup dump` shows it."""
    done = w.run("dump", w.hash.name)
    w.expect_in("Data blocks:     \t16384", done.stdout)


@step
def verify_image(w: Walkthrough) -> None:
    """Check every block of the image against the tree and the trusted root hash."""
    done = w.run("verify", w.data.name, w.hash.name, w.root)
    w.expect_in("Verified 16384 data blocks: OK", done.stdout)


@step
def verify_corrupted_data(w: Walkthrough) -> None:
    """Flip one byte of a copy of the data: verify names the corrupted data block."""
    copy = w.workdir / "corrupt-data.img"
    shutil.copyfile(w.data, copy)
    flip_byte(copy, CORRUPT_DATA_BLOCK * 4096 + 100)
    w.say(f"flipped byte 100 of data block {CORRUPT_DATA_BLOCK} in {copy.name}")
    done = w.run("verify", copy.name, w.hash.name, w.root, expect=1)
    w.expect_in(f"data block {CORRUPT_DATA_BLOCK} is corrupted", done.stderr)
    copy.unlink()


@step
def verify_corrupted_tree(w: Walkthrough) -> None:
    """Flip one byte of a copy of the tree: verify names the hash block and its level."""
    copy = w.workdir / "corrupt.hash"
    shutil.copyfile(w.hash, copy)
    # The leaf that holds the digest of CORRUPT_DATA_BLOCK: the superblock is block 0,
    # then the root-most level first (level 1: block 1; level 0: 128 blocks from 2).
    geometry = VerityParams(data_blocks=IMAGE_SIZE // 4096).geometry()
    leaf, _ = geometry.slot_of(0, CORRUPT_DATA_BLOCK)
    flip_byte(copy, leaf * 4096 + 7)
    first = (leaf - geometry.level_start[0]) * geometry.hashes_per_block
    w.say(f"flipped byte 7 of hash block {leaf} (level 0: the digests of data blocks "
          f"{first}-{first + geometry.hashes_per_block - 1}) in {copy.name}")
    done = w.run("verify", w.data.name, copy.name, w.root, expect=1)
    w.expect_in(f"metadata block {leaf} is corrupted (level 0)", done.stderr)
    copy.unlink()


# The steps that serve the image over NBD live in demo_serve.py and register after these.
from . import demo_serve  # noqa: E402,F401


def cli_path() -> str:
    """The nbd-verity console script next to this interpreter, else the one on PATH."""
    beside = Path(sys.executable).parent / "nbd-verity"
    found = str(beside) if beside.exists() else shutil.which("nbd-verity")
    if not found:
        raise StepFailed("the nbd-verity command is not installed (run `make setup`)")
    return found


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m nbd_verity.demo WORKDIR", file=sys.stderr)
        return 2
    workdir = Path(args[0]).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        w = Walkthrough(workdir=workdir, cli=cli_path())
        w.say(f"nbd-verity demo in {workdir}")
        for number, fn in enumerate(STEPS, 1):
            title = (fn.__doc__ or fn.__name__).strip().splitlines()[0]
            w.say(f"\n== {number}. {title}")
            fn(w)
    except StepFailed as e:
        print(f"\ndemo FAILED: {e}", file=sys.stderr)
        return 1
    w.say(f"\ndemo OK: {len(STEPS)} steps behaved as expected")
    return 0


if __name__ == "__main__":
    # Run the imported module's main, so that demo_serve's steps and this module share
    # one step list (run as a script, this file would be a second module, __main__).
    from nbd_verity.demo import main as package_main

    sys.exit(package_main())
