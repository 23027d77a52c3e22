"""python -m nbd_verity.demo WORKDIR: the offline steps, the serving ones, trust, then FEC."""

from __future__ import annotations

import sys

from . import fec, offline, remote, serving, trust
from .walkthrough import run_steps

STEPS = (*offline.STEPS, *serving.STEPS, *trust.STEPS, *fec.STEPS, *remote.STEPS)


def main(argv: list[str] | None = None) -> int:
    return run_steps(STEPS, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
