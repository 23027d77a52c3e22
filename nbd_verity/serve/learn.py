"""The inline-or-pool choice learned from live requests, per class and size.

The start-up calibration (calibrate.py) times one request at a time on an idle server,
and a start on a busy machine, or one core's neighbour at work, keeps what it measured
then (measured: three starts on the same quiet machine chose 4 MiB, 4 MiB and all
inline, minutes after one chose 256 KiB, while fio's 2 MiB reads from one client ran
1009 MB/s on the pool and 760 inline). So for a class nobody pinned, a request of at
least LEARN_MIN bytes takes the path that won its size's last trial:

- Requests are grouped by class and size bucket (powers of two: 64 KiB up to 128 KiB,
  ... up to 32 MiB). A request's cost is its cycle as its client sees it: from its start
  to the start of the same connection's next request (dispatch.py, Dispatcher._learned),
  in seconds per byte, under whatever load there is.
- A trial is two runs back to back: RUN requests on the chosen path, then RUN on the
  other; a run's cost is the median of its requests but its first SKIP. A path's cost is
  its median over the last TRIALS trials (the newer of two), and the cheaper path is
  the choice until the next trial. A bucket starts with a trial (the table's path
  first), and one starts every EXPLORE requests after (every EXPLORE_FAR when one path
  cost over FAR times the other): at most RUN in EXPLORE (6%) or in EXPLORE_FAR (1.6%)
  of the requests take the worse path. Between trials the chosen path's last WINDOW
  requests are watched: when their median costs over EARLY_RATIO times the other path,
  a trial starts at once (but not within EARLY requests of the last one's start), so a
  change of load moves the choice within a few hundred requests.
- Why trials, not the cost of each path's latest requests: the machine's speed drifts
  from second to second (CPU steal from other guests comes in bursts of seconds), and
  the path taken now and then pays more than the path taken all the time (measured on
  this 2-core VM: 2 MiB requests on the pool took 1.1-1.2 ms each in a stream of pool
  requests, 1.4-2.2 ms when one in sixteen took it; likely because its workers' CPUs
  had gone idle, not measured apart). Comparing the latest samples of each path, taken
  at different moments and one path cold, kept one client's 2 MiB reads 40% on the
  slower path. Two runs back to back see the same moment, a run's first SKIP requests
  pay for its cold start, and the median over trials keeps one disturbed trial from
  moving the choice. Why the cycle, not the time inside the server: one client's 2 MiB
  reads took 20% longer on the pool timed inside, and were 8% faster on it as the
  client saw them.
- The load rule of dispatch.py still applies on top: a request that should take the pool
  is verified inline when no worker is free (`busy_inline`; such a request is no sample
  of the pool's run).

What was learned is in `ctl stats` and `ctl thresholds` (`learned`: per class the
buckets with their microseconds per MiB on each path over the last trials and the
choice, and the smallest size the pool is chosen for). Explicit thresholds pin their
class: the table alone decides, exactly. Updates take no lock: under a race a sample or a request
of a run may be lost, which costs the trial one sample.
"""

from __future__ import annotations

from collections import deque

from ..control.table import CLASSES, INLINE, POOL

LEARN_MIN = 64 << 10  # smaller requests follow the table (inline, where it was measured)
BUCKETS = 10  # 64 KiB, 128 KiB, ... 32 MiB (MAX_REQUEST_SIZE)
RUN = 32  # requests of each of a trial's two runs
SKIP = 4  # of which the first are not counted
EXPLORE = 512  # a trial starts every this-many requests of a bucket
EXPLORE_FAR = 2048  # ... or this many, when the worse path cost over FAR times as much
FAR = 1.5
TRIALS = 3  # a path's cost: its median over the last this-many trials
WINDOW = 8  # between trials: the chosen path's latest requests watched ...
EARLY = 128  # ... and a trial starts as soon as this many requests after the last one's
EARLY_RATIO = 1.25  # start when their median costs over this times what the other path
# did in the last trial (not at any excess: paths a few % apart would trial every EARLY)


def bucket(length: int) -> int:
    """0 for LEARN_MIN..2*LEARN_MIN-1 bytes, 1 for the next power of two, ..."""
    return min(BUCKETS - 1, length.bit_length() - LEARN_MIN.bit_length())


def _other(path: str) -> str:
    return POOL if path == INLINE else INLINE


def _median(samples: list[float]) -> float | None:
    """The lower middle one; None for no samples."""
    if not samples:
        return None
    return sorted(samples)[(len(samples) - 1) // 2]


class _Row:
    """One class's bucket."""

    __slots__ = ("choice", "costs", "early", "left", "next_trial", "path", "requests", "run",
                 "samples", "skip", "steady", "trial_start", "trials", "tried")

    def __init__(self) -> None:
        self.choice: str | None = None  # None: before its first trial
        self.requests = 0
        self.trial_start = 0  # the request count at which the last trial started
        self.next_trial = 0  # ... and the next one starts
        self.run = 0  # 0: no trial; 1, 2: the trial's first or second run
        self.path = INLINE  # the run's path
        self.left = 0  # requests of the run still to hand out
        self.skip = 0  # its samples still not to count
        self.samples: tuple[list, list] = ([], [])  # the trial's, per run
        self.costs: dict = {INLINE: None, POOL: None}  # seconds per byte, of the TRIALS
        self.trials: deque = deque(maxlen=TRIALS)  # the last ones' {path: cost}
        self.tried = 0  # trials started
        self.early = 0  # of which early (the chosen path's cost rose)
        self.steady: deque = deque(maxlen=WINDOW)  # the choice's, since the last trial


class Learner:
    """Per (class, bucket): the choice, and the trial under way."""

    def __init__(self) -> None:
        self._rows = [[_Row() for _ in range(BUCKETS)] for _ in CLASSES]

    def choose(self, io_class: int, length: int, table_path: str) -> str:
        row = self._rows[io_class][bucket(length)]
        count = row.requests
        row.requests = count + 1
        if row.run and row.left == 0:  # the run's requests are all handed out
            if row.run == 1:
                self._start_run(row, 2, _other(row.path))
            else:
                self._decide(row)
        if not row.run and count >= row.next_trial:  # a trial: this path, then the other
            row.choice = row.choice or table_path
            row.samples = ([], [])
            row.steady.clear()
            row.trial_start = count
            row.tried += 1
            row.next_trial = count + self._every(row)
            self._start_run(row, 1, row.choice)
        if row.run:
            row.left -= 1
            return row.path
        return row.choice

    @staticmethod
    def _start_run(row: _Row, run: int, path: str) -> None:
        row.run, row.path, row.left, row.skip = run, path, RUN, SKIP

    @staticmethod
    def _every(row: _Row) -> int:
        inline, pool = row.costs[INLINE], row.costs[POOL]
        if inline is None or pool is None:
            return EXPLORE
        far = max(inline, pool) > FAR * max(min(inline, pool), 1e-12)
        return EXPLORE_FAR if far else EXPLORE

    @staticmethod
    def _decide(row: _Row) -> None:
        """The trial's end: the cheaper run's path is the choice (a run without samples,
        every request of it verified elsewhere, changes nothing)."""
        first, second = (_median(s) for s in row.samples)
        row.run = 0
        if first is None or second is None:
            return
        row.trials.append({row.choice: first, _other(row.choice): second})
        if len(row.trials) == 2:  # the newer one: a change of load shows at once
            row.costs = dict(row.trials[-1])
        else:
            row.costs = {p: sorted(t[p] for t in row.trials)[len(row.trials) // 2]
                         for p in (INLINE, POOL)}
        row.choice = INLINE if row.costs[INLINE] <= row.costs[POOL] else POOL
        row.next_trial = row.trial_start + Learner._every(row)

    def record(self, io_class: int, length: int, path: str, seconds: float) -> None:
        row = self._rows[io_class][bucket(length)]
        if not row.run:  # between trials: does the choice still cost what it did?
            other = row.costs[_other(path)]
            if path == row.choice and other is not None:
                row.steady.append(seconds / length)
                if (len(row.steady) == WINDOW
                        and _median(list(row.steady)) > EARLY_RATIO * other
                        and row.next_trial > row.trial_start + EARLY):
                    row.next_trial = max(row.trial_start + EARLY, row.requests)
                    row.early += 1
            return
        if path != row.path:  # another run's request
            return
        if row.skip:  # a run's first requests: not counted
            row.skip -= 1
            return
        samples = row.samples[row.run - 1]
        samples.append(seconds / length)
        if row.run == 2 and row.left == 0 and len(samples) >= RUN - SKIP:
            self._decide(row)  # the trial's last request (else at the next choose)

    def reset(self) -> None:
        for rows in self._rows:
            for i in range(len(rows)):
                rows[i] = _Row()

    def snapshot(self) -> dict:
        """Per class with requests: its buckets (bytes from) with µs per MiB on each path
        over the last trials, the choice (None before a trial ended) and the trials
        started (early ones apart), and the smallest bucket the pool is chosen for (None:
        none)."""
        out: dict = {}
        for c, rows in enumerate(self._rows):
            buckets = {}
            pool_from = None
            for b, row in enumerate(rows):
                if not row.requests:
                    continue
                size = LEARN_MIN << b
                decided = row.costs[INLINE] is not None
                choice = row.choice if decided else None
                if choice == POOL and pool_from is None:
                    pool_from = size
                buckets[str(size)] = {
                    "requests": row.requests, "choice": choice, "trials": row.tried,
                    "early_trials": row.early,
                    "inline_us_per_mib": _per_mib(row.costs[INLINE]),
                    "pool_us_per_mib": _per_mib(row.costs[POOL])}
            if buckets:
                out[CLASSES[c]] = {"pool_from": pool_from, "buckets": buckets}
        return out


def _per_mib(seconds_per_byte: float | None) -> float | None:
    return None if seconds_per_byte is None else round(seconds_per_byte * (1 << 20) * 1e6, 1)
