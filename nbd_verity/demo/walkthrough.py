"""The walkthrough machinery of `make demo`: what steps share, and how they run.

A step is a small function taking the Walkthrough; it prints every command it runs, as a
user would type it, with its output, and raises StepFailed when anything does not behave
as expected. `run_steps` runs them in order and stops at the first failure.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

CORRUPT_DATA_BLOCK = 12345  # the block the corruption steps damage


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


def flip_byte(path: Path, offset: int) -> None:
    """Invert one byte in place: the smallest possible corruption."""
    with open(path, "r+b") as f:
        f.seek(offset)
        value = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value ^ 0xFF]))


def cli_path() -> str:
    """The nbd-verity console script next to this interpreter, else the one on PATH."""
    beside = Path(sys.executable).parent / "nbd-verity"
    found = str(beside) if beside.exists() else shutil.which("nbd-verity")
    if not found:
        raise StepFailed("the nbd-verity command is not installed (run `make setup`)")
    return found


def run_steps(steps: Sequence[Step], argv: list[str]) -> int:
    """Run the steps in order in the WORKDIR argv names; 0, or 1 at the first failure."""
    if len(argv) != 1:
        print("usage: python -m nbd_verity.demo WORKDIR", file=sys.stderr)
        return 2
    workdir = Path(argv[0]).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        w = Walkthrough(workdir=workdir, cli=cli_path())
        w.say(f"nbd-verity demo in {workdir}")
        for number, fn in enumerate(steps, 1):
            title = (fn.__doc__ or fn.__name__).strip().splitlines()[0]
            w.say(f"\n== {number}. {title}")
            fn(w)
    except StepFailed as e:
        print(f"\ndemo FAILED: {e}", file=sys.stderr)
        return 1
    w.say(f"\ndemo OK: {len(steps)} steps behaved as expected")
    return 0
