"""The inline-or-pool choice learned from live requests, per class, size and load.

For a class nobody pinned, a request of at least LEARN_MIN bytes (two pool chunks: a
smaller one gets nothing from the pool but its hand-off) takes the path a rule gives it,
unless trials of both paths find the other clearly cheaper; smaller requests and pinned
classes follow the table alone (dispatch.py).
- Rows: per class, size bucket (powers of two, 512 KiB up to 32 MiB) and load: how many
  connections sent the last LOAD_LAST learned requests within LOAD_S (LOADS), so that a
  change of load takes what that load learned before at once.
- The rule (Learner.rule): the pool while there are fewer clients than workers and the
  request spans two chunks, inline when every worker has a client.
- A request's cost is its cycle as its client sees it, from its start to the start of
  the same connection's next request (dispatch.Cycle), in seconds per byte.
- A trial is three runs: the chosen path, the other, the chosen again (COUNT / 2, COUNT,
  COUNT / 2 samples), each run's first SKIP requests not counted, nor the pool's first
  WARM_S after inline's. A run's cost is its mean without the costliest TRIM share; the
  verdict is the pool/inline ratio two of the last TRIALS reach; the choice turns over
  MARGIN either way, and a lone trial never overturns the rule's path.
- Trials come EXPLORE requests apart, twice as far after each that kept the choice, up
  to EXPLORE_FAR. Between them the chosen path's last WINDOW costs are watched: when
  their median stays over FAR times off the trials' for WATCH_S, the next trial comes
  sooner (a pause of QUIET_S starts the watch afresh).
Invariants: the learner only chooses and records; dispatch.py serves. What it learned
is in `ctl stats` (`learned`). Locking: none; under a race a sample or a run's request
may be lost, which costs a trial one sample.
Why each rule and constant (every figure as measured): docs/decisions/learner.md.
"""

from __future__ import annotations

import time
from collections import deque

from ..control.table import INLINE, POOL
from ..ioclass import CLASSES

LEARN_MIN = 512 << 10  # two pool chunks (dispatch.POOL_CHUNK_SIZE); smaller ones follow the table
BUCKETS = 7  # 512 KiB, 1 MiB, ... 32 MiB (MAX_REQUEST_SIZE)
COUNT = 32  # a trial's samples of the other path (and of the chosen one, half before)
WARM_S = 0.15  # a pool run's requests that start this soon after its first: not counted, ...
SKIP = 2  # ... but at least this many of them
SKIP_MAX = 128  # ... and at most this many (small requests: 50 ms would be thousands)
RUN_MAX = 4 * COUNT + SKIP_MAX  # a run handed this many out without its samples: given up
EXPLORE = 2048  # a trial starts this many requests of a bucket after the last one, ...
EXPLORE_FAR = 8192  # ... twice as many after each trial that kept the choice, up to this
                    # many, and this many at once when the worse path cost over FAR times
FAR = 1.5
TRIALS = 3  # the verdict: the ratio two of the last this-many trials reach
TRIM = 0.125  # a run's cost: the mean of its samples but this share of the costliest
WATCH_S = 1.0  # ... and when their median stayed out of line this long, a trial sooner
WINDOW = 8  # trials EXPLORE_FAR apart: the chosen path's latest requests watched
QUIET_S = 0.25  # ... and after a pause this long, watched afresh (the pause is no load)
LOAD_LAST = 16  # a request's load: the connections among the last this-many learned requests
LOAD_S = 0.25  # ... that started within this many seconds before it, counted again
LOAD_FRESH_S = 0.01  # ... this long after the last count, or for a connection not in it
LOADS = ("1", "2", "3-4", "5-8", "9-16")  # the rows per class and bucket, by those clients
MARGIN = 1.15  # the trials overturn the rule's path when the other cost this much less
_RUNS = (0, 1, 0)  # a trial's runs: the chosen path (0), the other (1), the chosen
_WANT = (COUNT // 2, COUNT, COUNT // 2)  # ... and the samples each counts


def bucket(length: int) -> int:
    """0 for LEARN_MIN..2*LEARN_MIN-1 bytes, 1 for the next power of two, ..."""
    return min(BUCKETS - 1, length.bit_length() - LEARN_MIN.bit_length())


def _other(path: str) -> str:
    return POOL if path == INLINE else INLINE


def _trimmed_mean(samples: list[float]) -> float | None:
    """The mean without the costliest TRIM share (a preempted request): a throughput's
    cost is the mean, and a path that serves some requests slower (the pool's choice
    when no worker is free) must pay for them; None for no samples."""
    if not samples:
        return None
    kept = sorted(samples)[:max(1, len(samples) - int(TRIM * len(samples)))]
    return sum(kept) / len(kept)


def _ratio(trial: dict) -> float:
    """A trial's verdict: the pool's cost over inline's."""
    return trial[POOL] / max(trial[INLINE], 1e-12)


def _far(ratio: float) -> bool:
    """Whether a ratio finds one path over FAR times the other's cost."""
    return max(ratio, 1 / max(ratio, 1e-12)) > FAR


def _verdict(ratios: list[float]) -> float:
    """The trials' verdict: the pool/inline ratio that two of them reach (the median of
    three; of two, the nearer 1 when both find the same path cheaper, 1.0 when they
    disagree); a lone trial's own ratio."""
    ratios = sorted(ratios)
    if len(ratios) == 1:
        return ratios[0]
    if ratios[-2] > 1:
        return ratios[-2]
    return ratios[1] if ratios[1] < 1 else 1.0


def _path(ratio: float) -> str | None:
    """The path a verdict finds cheaper by MARGIN; None within it."""
    return INLINE if ratio > MARGIN else POOL if ratio < 1 / MARGIN else None


def _median(samples: list[float]) -> float | None:
    """The lower middle one; None for no samples."""
    if not samples:
        return None
    return sorted(samples)[(len(samples) - 1) // 2]


class _Row:
    """One class's bucket."""

    __slots__ = ("agreed", "choice", "costs", "counted", "early", "handed", "next_trial",
                 "off_since", "path", "ratio", "requests", "rule", "run_start", "samples",
                 "seen", "stage", "steady", "trial_start", "trials", "tried", "watched")

    def __init__(self, first: int) -> None:
        self.choice: str | None = None  # None: before its first request
        self.rule: str | None = None  # Learner.rule's path for it
        self.requests = 0
        self.trial_start = 0  # the request count at which the last trial started
        self.next_trial = first  # ... and the next one starts
        self.stage = -1  # the trial's run (0, 1, 2: _RUNS); -1: no trial under way
        self.path = INLINE  # the run's path
        self.run_start: float | None = None  # when the run's first request was handed out
        self.handed = 0  # the run's requests handed out
        self.seen = 0  # ... its samples come back
        self.counted = 0  # ... and of them counted
        self.samples: dict = {INLINE: [], POOL: []}  # the trial's, per path
        self.costs: dict = {INLINE: None, POOL: None}  # seconds per byte, over the trials
        self.ratio: float | None = None  # the verdict: pool's cost / inline's
        self.trials: deque = deque(maxlen=TRIALS)  # the last ones' {path: cost}
        self.tried = 0  # trials started
        self.early = 0  # of which sooner than planned (the chosen path's cost moved)
        self.agreed = 0  # trials in a row that kept the path chosen before them (-1:
                         # the load changed since the last, the next one does not count)
        self.steady: deque = deque(maxlen=WINDOW)  # the choice's, since the last trial
        self.off_since: float | None = None  # since when their median is out of line
        self.watched = 0.0  # when the last of them started


class Learner:
    """Per (class, load, bucket): the choice, and the trial under way. warm_s: WARM_S,
    first: the requests before a bucket's first trial (EXPLORE), watch_s: WATCH_S (the
    tests' synthetic samples take 0: a first trial at once, no warm or watch time)."""

    def __init__(self, warm_s: float = WARM_S, cores: int = 1, spread: int = 0,
                 first: int = EXPLORE, watch_s: float = WATCH_S) -> None:
        self.first = first
        self._rows = [[[_Row(first) for _ in range(BUCKETS)] for _ in LOADS] for _ in CLASSES]
        self._recent: deque = deque(maxlen=LOAD_LAST)  # (started, connection)
        self._count: tuple = (float("-inf"), frozenset(), 0)  # (when, connections, load)
        self.warm_s = warm_s
        self.watch_s = watch_s
        self.cores = cores  # the pool's workers that can run at once
        self.spread = spread  # the least bytes the pool splits across two of them (0: none)

    def rule(self, load: int, length: int, table_path: str) -> str:
        """The path before and beside the trials: the pool when it has idle workers (fewer
        clients than workers) and the request spans two of them, inline when every worker
        has a client; otherwise the table's."""
        if self.cores <= 1 or not self.spread:
            return table_path
        if 1 << load >= self.cores:  # the most clients the load stands for
            return INLINE
        return POOL if length >= self.spread else table_path

    def load(self, connection: object, now: float) -> int:
        """A learned request's load (an index of LOADS): how many connections sent the
        last LOAD_LAST learned requests within LOAD_S, this one included. Counted at
        most LOAD_FRESH_S ago (a new connection at once): the count costs a few
        microseconds, which every learned request paid while its load stayed the same
        (the fast path's 512 KiB reads from eight clients: 0.96 of all inline with no
        trials, for the learner's bookkeeping alone)."""
        self._recent.append((now, connection))
        when, clients, level = self._count
        if 0 <= now - when < LOAD_FRESH_S and connection in clients:
            return level
        cutoff = now - LOAD_S
        clients = frozenset(c for t, c in tuple(self._recent) if t >= cutoff)  # a copy: racy
        level = min(len(LOADS) - 1, (len(clients) - 1).bit_length())
        self._count = (now, clients, level)  # one assignment: a reader sees all or none
        return level

    def choose(self, io_class: int, length: int, table_path: str, load: int = 0) -> str:
        row = self._rows[io_class][load][bucket(length)]
        count = row.requests
        row.requests = count + 1
        if row.stage < 0:
            if count < row.next_trial:
                if row.choice is None:  # before its first trial: the rule's path
                    row.rule = row.choice = self.rule(load, length, table_path)
                return row.choice
            if row.rule is None:
                row.rule = self.rule(load, length, table_path)
            row.choice = row.choice or row.rule  # a trial, the choice's path first
            row.samples = {INLINE: [], POOL: []}
            row.steady.clear()
            row.off_since = None
            row.trial_start = count
            row.tried += 1
            row.next_trial = count + self._every(row)
            self._start_run(row, 0)
        elif row.handed >= RUN_MAX:  # its samples did not come (verified elsewhere)
            row.stage = -1
            return row.choice
        if row.run_start is None:
            row.run_start = time.perf_counter()
        row.handed += 1
        return row.path

    @staticmethod
    def _start_run(row: _Row, stage: int) -> None:
        row.stage = stage
        row.path = _other(row.choice) if _RUNS[stage] else row.choice
        row.run_start = None
        row.handed = row.seen = row.counted = 0

    @staticmethod
    def _every(row: _Row) -> int:
        """Requests from one trial's start to the next one's."""
        if row.ratio is None:
            return EXPLORE
        last = [_ratio(t) for t in list(row.trials)[-2:]]
        if len(last) == 2 and all(_far(r) and (r > 1) == (row.ratio > 1) for r in last):
            return EXPLORE_FAR  # the last two trials found the same path far worse
        return min(EXPLORE_FAR, EXPLORE << max(0, row.agreed))

    @staticmethod
    def _decide(row: _Row) -> None:
        """The trial's end: the verdict over the last trials picks the choice."""
        row.stage = -1
        inline, pool = _trimmed_mean(row.samples[INLINE]), _trimmed_mean(row.samples[POOL])
        row.trials.append({INLINE: inline, POOL: pool})
        # each path's cost, which the watch holds the chosen path to: the median of three,
        # of two the newer's (a change of load shows at once)
        recent = list(row.trials)[-1:] if len(row.trials) == 2 else list(row.trials)
        row.costs = {p: sorted(t[p] for t in recent)[len(recent) // 2] for p in (INLINE, POOL)}
        row.ratio = _verdict([_ratio(t) for t in row.trials])
        before = row.choice
        row.choice = _path(row.ratio) if len(row.trials) > 1 else None
        row.choice = row.choice or row.rule  # a lone trial does not overturn the rule
        newest = _path(_ratio(row.trials[-1]))
        # kept the choice, and did not find the other path cheaper (one that did is
        # checked EXPLORE on, not twice as far)
        kept = row.choice == before and newest in (None, row.choice)
        row.agreed = row.agreed + 1 if kept else 0
        row.next_trial = row.trial_start + Learner._every(row)

    def record(self, io_class: int, length: int, path: str, seconds: float,
               started: float | None = None, load: int = 0) -> None:
        """A learned request's cost: seconds from its start (perf_counter; None: now less
        seconds), at the load it was chosen at."""
        row = self._rows[io_class][load][bucket(length)]
        if row.stage < 0:  # between trials: does the choice still cost what it did?
            mine = row.costs[path]
            if path == row.choice and mine is not None and (
                    row.next_trial > row.trial_start + EXPLORE):
                now = started if started is not None else time.perf_counter()
                if now - row.watched > QUIET_S:  # a pause: what came before it is gone
                    row.steady.clear()
                    row.off_since = None
                row.watched = max(row.watched, now)  # a sample may start before others
                cost = seconds / length
                row.steady.append(cost)
                if row.off_since is None and mine / FAR <= cost <= FAR * mine:
                    return  # in line, as the median was: not taken (sorting costs)
                cost = _median(list(row.steady)) if len(row.steady) == WINDOW else None
                if cost is None or mine / FAR <= cost <= FAR * mine:
                    row.off_since = None
                    return
                if row.off_since is None:
                    row.off_since = now
                if now - row.off_since >= self.watch_s:  # held out of line: not a burst
                    row.off_since = None
                    row.steady.clear()
                    sooner = max(row.trial_start + EXPLORE, row.requests)
                    row.agreed = -1  # the load changed: trials EXPLORE apart again
                    if sooner < row.next_trial:
                        row.next_trial = sooner
                        row.early += 1
            return
        if path != row.path or row.run_start is None:  # another run's request
            return
        row.seen += 1
        if started is None:
            started = time.perf_counter() - seconds
        if row.seen <= SKIP or (row.stage and path == POOL and self.warm_s
                                and row.seen <= SKIP_MAX
                                and started < row.run_start + self.warm_s):
            return  # a run's first requests (the pool's after a change of path: CPUs wake)
        row.samples[path].append(seconds / length)
        row.counted += 1
        if row.counted >= _WANT[row.stage]:
            if row.stage == len(_RUNS) - 1:
                self._decide(row)
            else:
                self._start_run(row, row.stage + 1)

    def reset(self) -> None:
        for loads in self._rows:
            for rows in loads:
                for i in range(len(rows)):
                    rows[i] = _Row(self.first)
        self._recent.clear()
        self._count = (float("-inf"), frozenset(), 0)

    def snapshot(self) -> dict:
        """Per class with requests, per load (LOADS: the clients) with requests: its
        buckets (bytes from) with µs per MiB on each path over the last trials (the median
        of each), the verdict (the median of the trials' pool/inline ratios) and those
        trials' ratios, oldest first, the choice (None before a trial ended), the trials
        started (early ones apart), and the smallest bucket the pool is chosen for (None:
        none)."""
        out: dict = {}
        for c, loads in enumerate(self._rows):
            per_load = {}
            for level, rows in enumerate(loads):
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
                        "pool_to_inline": None if row.ratio is None else round(row.ratio, 3),
                        "last_trials": [round(_ratio(t), 3) for t in row.trials],
                        "inline_us_per_mib": _per_mib(row.costs[INLINE]),
                        "pool_us_per_mib": _per_mib(row.costs[POOL])}
                if buckets:
                    per_load[LOADS[level]] = {"pool_from": pool_from, "buckets": buckets}
            if per_load:
                out[CLASSES[c]] = {"loads": per_load}
        return out


def _per_mib(seconds_per_byte: float | None) -> float | None:
    return None if seconds_per_byte is None else round(seconds_per_byte * (1 << 20) * 1e6, 1)
