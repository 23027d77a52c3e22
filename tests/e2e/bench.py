"""fio figures from a guest run, as a Markdown table for docs/e2e-benchmarks.md.

The guest writes one fio JSON file per job; this module reads the aggregate read bandwidth
and IOPS from each and renders them. The doc is rewritten only when NBD_VERITY_E2E_RECORD=1
(`make e2e-bench`), so that an ordinary test run never edits a tracked file.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "e2e-benchmarks.md"
RECORD_ENV = "NBD_VERITY_E2E_RECORD"


@dataclass(frozen=True)
class FioResult:
    """One fio job's aggregate reads: bytes per second and I/O per second."""

    bw_bytes: float
    iops: float

    @property
    def mb_s(self) -> float:
        return self.bw_bytes / 1e6


def read_fio(path: Path) -> FioResult:
    """The aggregate read figures of a `--group_reporting --output-format=json` file."""
    report = json.loads(path.read_text())
    (job,) = report["jobs"]
    if job["error"]:
        raise ValueError(f"{path}: fio job failed with error {job['error']}")
    read = job["read"]
    return FioResult(bw_bytes=float(read["bw_bytes"]), iops=float(read["iops"]))


def recording() -> bool:
    """Whether this run rewrites the tracked doc (NBD_VERITY_E2E_RECORD=1)."""
    return os.environ.get(RECORD_ENV) == "1"


def _cell(results: list[FioResult]) -> str:
    """Median MB/s and IOPS of the rounds, and the MB/s spread when there are several."""
    ordered = sorted(results, key=lambda r: r.bw_bytes)
    mid = ordered[len(ordered) // 2]
    cell = f"{mid.mb_s:.1f} MB/s ({mid.iops:.0f} IOPS)"
    if len(ordered) > 1:
        cell += f", {ordered[0].mb_s:.1f} to {ordered[-1].mb_s:.1f}"
    return cell


def render(rows: dict[str, dict[str, list[FioResult]]], columns: dict[str, str],
           note: str) -> str:
    """The doc: one row per device, one column per fio job: the median of the rounds."""
    header = ["device", *columns.values()]
    lines = [
        "# Real-kernel benchmarks (QEMU guest, Debian's kernel)",
        "",
        "Written by `make e2e-bench` (tests/e2e/test_guest.py::test_fio_figures); do not edit.",
        "",
        note,
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for device, results in rows.items():
        cells = [_cell(results[job]) for job in columns]
        lines.append(f"| {device} | " + " | ".join(cells) + " |")
    load = os.getloadavg()[0]
    lines += ["", f"Recorded {time.strftime('%Y-%m-%d')}: {os.cpu_count()} host cores, "
              f"host kernel {platform.release()}, host load average "
              f"{load:.1f} at the end (other work on the host lowers every row).", ""]
    return "\n".join(lines)


def record(text: str, copy: Path) -> bool:
    """Always write text to copy; also to the tracked doc when recording. True if recorded."""
    copy.write_text(text)
    if recording():
        DOC.parent.mkdir(parents=True, exist_ok=True)
        DOC.write_text(text)
        return True
    return False
