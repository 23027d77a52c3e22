"""serve/calibrate.py in process: its choice follows its own measurements, one worker
never calibrates, and the budget bounds it."""

from __future__ import annotations

from nbd_verity.control.table import FIXED
from nbd_verity.format.digest import Digester
from nbd_verity.limits import MAX_REQUEST_SIZE
from nbd_verity.serve.calibrate import CONFIRM, POOL_WINS, SIZES, calibrate, describe


def digester() -> Digester:
    return Digester("sha256", bytes(range(32)), 1)


def wins(figures) -> list[bool]:
    return [pool <= POOL_WINS * inline for _, inline, pool in figures]


def test_the_choice_follows_the_figures():
    c = calibrate(digester(), 4096, 2)
    sizes = [s for s, _, _ in c.figures]
    assert sizes == list(SIZES[:len(sizes)])
    won = wins(c.figures)
    streaks = [all(won[i:i + CONFIRM]) for i in range(len(won) - CONFIRM + 1)]
    if c.outcome == "crossover":  # the first CONFIRM wins in a row (or a win at 8 MiB)
        first = next((i for i, ok in enumerate(streaks) if ok), len(won) - 1)
        assert all(won[first:]) and not any(streaks[:first])
        assert c.threshold == sizes[first] // 2
        assert f"inline up to {c.threshold >> 10} KiB" in describe(c.as_dict())
    elif c.outcome == "inline wins":
        assert len(c.figures) == len(SIZES) and c.threshold == MAX_REQUEST_SIZE
    else:
        assert c.outcome == "over budget" and c.threshold == FIXED[0]
    assert describe(c.as_dict()).startswith("calibrated at start-up in ")


def test_one_worker_keeps_everything_inline_without_measuring():
    c = calibrate(digester(), 4096, 1)
    assert (c.threshold, c.outcome, c.figures) == (MAX_REQUEST_SIZE, "one worker", ())


def test_an_empty_budget_keeps_the_fixed_table():
    c = calibrate(digester(), 4096, 2, budget=0.0)
    assert (c.threshold, c.outcome) == (FIXED[0], "over budget")
    assert "fixed table is kept" in describe(c.as_dict())


def test_format_0_and_small_blocks_calibrate_too():
    c = calibrate(Digester("sha256", b"salt", 0), 512, 2)
    assert c.outcome in ("crossover", "inline wins", "over budget")
