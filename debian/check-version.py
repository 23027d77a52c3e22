#!/usr/bin/python3
"""Exit 1 with one line unless debian/changelog, pyproject.toml and nbd_verity/__init__.py
name the same version (run by debian/rules before the build, and by the test suite)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

TOP = Path(__file__).resolve().parent.parent


def versions() -> dict[str, str]:
    changelog = subprocess.run(["dpkg-parsechangelog", "-l", str(TOP / "debian/changelog"),
                                "-S", "Version"], check=True, capture_output=True,
                               text=True).stdout.strip()
    with open(TOP / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]["version"]
    init = re.search(r'^__version__ = "([^"]+)"', (TOP / "nbd_verity/__init__.py").read_text(),
                     re.M)
    return {"debian/changelog": changelog, "pyproject.toml": project,
            "nbd_verity/__init__.py": init.group(1) if init else "(none)"}


def main() -> int:
    found = versions()
    if len(set(found.values())) != 1:
        print("version mismatch: " + ", ".join(f"{k} {v}" for k, v in found.items()),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
