"""Damaging an image in place, for the tests that expect the damage to be caught.

Writes go to the same inode, so a running server sees them (its open descriptor reads
the new bytes).
"""

from __future__ import annotations

from pathlib import Path


def flip_byte(path: Path, offset: int, xor: int = 0xFF) -> None:
    """XOR one byte of a file in place (every bit inverted by default)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([old ^ xor]))


def write_at(path: Path, offset: int, payload: bytes) -> None:
    """Overwrite bytes of a file in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(payload)
