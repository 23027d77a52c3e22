"""A verifier's counters and options: what `ctl stats` reports of one export, counted per
thread without a lock (tally.py), and dm-verity's optional behaviours."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import ClassVar

from .tally import Tally

# dm-verity's error modes (docs/server.md, "Error modes"), the one home of their names:
# what a corruption does (error-mode), the kernel's default and its two options
EIO, IGNORE_CORRUPTION, RESTART_ON_CORRUPTION = "eio", "ignore-corruption", "restart-on-corruption"
MODES = (EIO, IGNORE_CORRUPTION, RESTART_ON_CORRUPTION)
MAX_LOGGED_ERRORS = 100  # the kernel's DM_VERITY_MAX_CORRUPTED_ERRS
PREFETCH_CLUSTER = 256 << 10  # bytes: the kernel's dm_verity.prefetch_cluster default


@dataclass(frozen=True)
class VerifyOptions:
    """dm-verity's optional behaviours (the kernel's table arguments; docs/server.md), and
    its module parameter prefetch_cluster (read/beside.py)."""

    mode: str = EIO
    ignore_zero_blocks: bool = False
    check_at_most_once: bool = False
    prefetch_cluster: int = PREFETCH_CLUSTER


class Counters:
    """Totals kept for the control socket, counted per thread without a lock (tally.py)."""

    FIELDS = ("data_blocks_verified", "hash_reads", "hash_blocks_read", "corruptions",
              "readaheads", "io_errors", "fec_corrected", "fec_failed",
              "io_errors_repaired")
    _INDEX: ClassVar[dict[str, int]] = {name: i for i, name in enumerate(FIELDS)}

    def __init__(self) -> None:
        self._tally = Tally(len(self.FIELDS))
        self._lock = threading.Lock()  # orders corruptions for the log cap only
        self._seen = 0
        self._repaired = 0  # FEC repairs, ordered for the log cap
        self.corrupted = False  # status 'C' once any corruption was seen; never cleared

    def reset(self) -> None:
        self._tally.reset()
        with self._lock:
            self._seen = self._repaired = 0

    def row(self) -> list[int]:
        """This thread's row, in FIELDS order (serve/fastpath.py adds to it in place)."""
        return self._tally.row()

    def add(self, **amounts: int) -> None:
        row = self._tally.row()
        for name, amount in amounts.items():
            row[self._INDEX[name]] += amount

    def verified(self, blocks: int) -> None:
        """The hot path's one counter: data blocks that matched their trusted digest
        (data_blocks_verified; a corrupt block counts in corruptions instead)."""
        self._tally.row()[0] += blocks

    def corruption(self) -> int:
        """Count a corruption; return how many were seen, this one included (in order)."""
        self.corrupted = True
        self.add(corruptions=1)
        with self._lock:
            self._seen += 1
            return self._seen

    def fec_corrected(self) -> int:
        """Count a block FEC rebuilt; return how many were, this one included. The status
        stays 'V': as the kernel, only what FEC cannot repair is a corruption."""
        self.add(fec_corrected=1)
        with self._lock:
            self._repaired += 1
            return self._repaired

    def snapshot(self) -> dict:
        return dict(zip(self.FIELDS, self._tally.totals(), strict=True))

    @property
    def corruptions(self) -> int:
        return self.snapshot()["corruptions"]

    @property
    def status(self) -> str:
        """'V' while every check passed, 'C' after a corruption (as dmsetup status)."""
        return "C" if self.corrupted else "V"
