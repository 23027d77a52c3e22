"""Measure where verifying inline stops paying off, per I/O class, and recommend thresholds.

For one class and one request size, tune forces the class inline (its threshold at the
maximum) and reads for a fixed time, then forces it to the pool (threshold 0) and reads
again. Reads come from this process through libnbd: `connections` clients, each on its
own connection with the export name `@CLASS` (so the server puts them in that class),
each reading `size` bytes at random size-aligned offsets of the first `span` bytes
(kept small enough that data and hash blocks stay cached: tune measures verification,
not the disk). libnbd releases the GIL while it waits, so the clients overlap.

Drift (other work on the machine) is cancelled by repetition: each repetition sweeps
every size, and alternates which mode goes first. A point's figure is the median of its
repetitions and its noise the coefficient of variation (stdev / mean) across them; the
inline/pool ratio of a size is the median of the ratios of each repetition's two runs,
which ran back to back, so that slow drift cancels in each ratio.

Recommendation: the kernel maintainers' rule for dm-verity's use_bh_bytes, "the largest
size at which inline is at least as fast as the pool". A threshold T sends every size up
to T inline and the rest to the pool; tune picks the T (0 or a swept size) that maximises
the summed log ratio inline/pool of the sizes it sends inline, the largest T on a tie.
When inline wins up to some size and loses above it (the usual shape) this is exactly that
size; a single noisy point in the middle cannot move it far, which keeps repeated runs on
the same or a neighbouring size.
"""

from __future__ import annotations

import contextlib
import math
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..ioclass import CLASSES
from ..limits import MAX_REQUEST_SIZE
from .table import INLINE, POOL

SIZES = tuple(4096 << i for i in range(8))  # 4 KiB .. 512 KiB
FORCE = {INLINE: MAX_REQUEST_SIZE, POOL: 0}  # the threshold that forces each mode


@dataclass(frozen=True)
class Settings:
    """How long and how hard to measure."""

    sizes: tuple[int, ...] = SIZES
    duration: float = 0.5  # seconds per measurement
    repeat: int = 5  # repetitions of each (size, mode)
    connections: int = 1  # concurrent clients
    span: int = 256 << 20  # bytes of the device the random offsets fall in

    def steps(self, classes: int) -> int:
        """Measurements one sweep makes (for a progress bar)."""
        return classes * self.repeat * len(self.sizes) * 2


@dataclass
class Point:
    """All repetitions of one (size, mode): bytes per second each."""

    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else 0.0

    @property
    def cv(self) -> float:
        """Coefficient of variation across repetitions (0 with fewer than two)."""
        if len(self.samples) < 2 or not statistics.mean(self.samples):
            return 0.0
        return statistics.stdev(self.samples) / statistics.mean(self.samples)


@dataclass
class ClassSweep:
    """The sweep of one class and what it recommends."""

    io_class: str
    points: dict[tuple[int, str], Point]
    sizes: tuple[int, ...]

    def mb_s(self, size: int, mode: str) -> float:
        return self.points[(size, mode)].median / 1e6

    def paired_ratios(self, size: int) -> list[float]:
        """inline/pool of each repetition: the two runs of a repetition are next to each
        other in time, so slow drift (other work on the machine) cancels in their ratio."""
        pairs = zip(self.points[(size, INLINE)].samples, self.points[(size, POOL)].samples,
                    strict=True)
        return [i / p if p else math.inf for i, p in pairs]

    def ratio(self, size: int) -> float:
        """The median of the paired ratios."""
        return statistics.median(self.paired_ratios(size))

    def noise(self, size: int) -> float:
        """Coefficient of variation of the paired ratios (0 with one repetition)."""
        return Point(self.paired_ratios(size)).cv

    @property
    def recommendation(self) -> int:
        return recommend(self.sizes, [self.ratio(s) for s in self.sizes])

    def close_calls(self) -> list[int]:
        """Sizes next to the recommendation whose inline/pool ratio is within noise of 1:
        there the choice is a coin toss, and a neighbouring threshold is as good."""
        chosen = self.recommendation
        index = self.sizes.index(chosen) if chosen else -1
        near = [i for i in (index, index + 1) if 0 <= i < len(self.sizes)]
        return [self.sizes[i] for i in near
                if abs(self.ratio(self.sizes[i]) - 1) <= self.noise(self.sizes[i])]

    def as_dict(self) -> dict:
        return {"class": self.io_class, "recommendation": self.recommendation,
                "points": [{"size": s, "inline_mb_s": round(self.mb_s(s, INLINE), 2),
                            "pool_mb_s": round(self.mb_s(s, POOL), 2),
                            "ratio": round(self.ratio(s), 4),
                            "noise": round(self.noise(s), 4),
                            "inline_samples": self.points[(s, INLINE)].samples,
                            "pool_samples": self.points[(s, POOL)].samples}
                           for s in self.sizes]}


def recommend(sizes: tuple[int, ...], ratios: list[float]) -> int:
    """The threshold (0 or one of sizes) that maximises the summed log(inline/pool) of
    the sizes it sends inline; the largest one on a tie (inline when it is as fast)."""
    best, best_score, score = 0, 0.0, 0.0
    for size, r in zip(sizes, ratios, strict=True):
        score += math.log(r) if r > 0 else -math.inf
        if score >= best_score - 1e-12:
            best, best_score = size, score
    return best


def median_noise(sweeps: list[ClassSweep]) -> float:
    """One figure for a run: the median CV over every measured point."""
    cvs = [p.cv for s in sweeps for p in s.points.values()]
    return statistics.median(cvs) if cvs else 0.0


# -- measuring ------------------------------------------------------------------------


class Clients:
    """`connections` libnbd handles on one class, reading in parallel threads."""

    def __init__(self, connect: Callable[[str], object], io_class: str, settings: Settings):
        self.handles = [connect(f"@{io_class}") for _ in range(settings.connections)]
        size = self.handles[0].get_size()
        if size < settings.sizes[-1]:
            self.close()
            raise ConfigError(f"sizes: {settings.sizes[-1]} bytes is more than the device "
                              f"({size} bytes)")
        self.span = min(settings.span, size)

    def warm(self) -> None:
        """Verify and cache the span's hash blocks (NBD_CMD_CACHE), then read it once so
        its data is in the page cache: every point starts equally warm."""
        h = self.handles[0]
        for offset in range(0, self.span, MAX_REQUEST_SIZE):  # the server's largest request
            n = min(MAX_REQUEST_SIZE, self.span - offset)
            if h.can_cache():
                h.cache(n, offset)
            h.pread(n, offset)

    def measure(self, size: int, duration: float) -> float:
        """Bytes per second over `duration` seconds of random reads of `size` bytes."""
        slots = max(1, self.span // size)
        done = [0] * len(self.handles)
        errors: list[BaseException] = []
        start = threading.Barrier(len(self.handles) + 1)
        ends = [0.0] * len(self.handles)

        def reader(i: int) -> None:
            h, rng = self.handles[i], random.Random(i * 7919 + size)
            start.wait()
            deadline = time.perf_counter() + duration
            try:
                while time.perf_counter() < deadline:
                    h.pread(size, rng.randrange(slots) * size)
                    done[i] += size
            except BaseException as e:  # re-raised by measure()
                errors.append(e)
            ends[i] = time.perf_counter()

        threads = [threading.Thread(target=reader, args=(i,), daemon=True)
                   for i in range(len(self.handles))]
        for t in threads:
            t.start()
        start.wait()
        began = time.perf_counter()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return sum(done) / (max(ends) - began)

    def close(self) -> None:
        for h in self.handles:
            with contextlib.suppress(Exception):  # the server may be gone already
                h.shutdown()


def sweep_class(clients: Clients, io_class: str, set_threshold: Callable[[str, int], None],
                settings: Settings, step: Callable[[], None] = lambda: None) -> ClassSweep:
    """Measure every (size, mode) `repeat` times, alternating which mode goes first."""
    points = {(s, m): Point() for s in settings.sizes for m in (INLINE, POOL)}
    for rep in range(settings.repeat):
        for index, size in enumerate(settings.sizes):
            order = (INLINE, POOL) if (rep + index) % 2 == 0 else (POOL, INLINE)
            for mode in order:
                set_threshold(io_class, FORCE[mode])
                points[(size, mode)].samples.append(clients.measure(size, settings.duration))
                step()
    return ClassSweep(io_class, points, settings.sizes)


def parse_classes(names: tuple[str, ...]) -> tuple[str, ...]:
    """Classes to tune, in the table's order; 'all' (or nothing) means every class."""
    if not names or "all" in names:
        return CLASSES
    unknown = [n for n in names if n not in CLASSES]
    if unknown:
        raise ConfigError(f"class: unknown I/O class {unknown[0]!r} (one of "
                          f"{', '.join(CLASSES)}, all)")
    return tuple(c for c in CLASSES if c in names)
