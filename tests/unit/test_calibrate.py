"""serve/calibrate.py in process: its choice follows its own measurements, one worker
never calibrates, and the budget bounds it."""

from __future__ import annotations

from nbd_verity.control.table import FIXED
from nbd_verity.format.digest import Digester
from nbd_verity.limits import MAX_REQUEST_SIZE
from nbd_verity.serve.calibrate import POOL_WINS, SIZES, calibrate, describe


def digester() -> Digester:
    return Digester("sha256", bytes(range(32)), 1)


def test_the_choice_follows_the_figures():
    c = calibrate(digester(), 4096, 2)
    sizes = [s for s, _, _ in c.figures]
    assert sizes == list(SIZES[:len(sizes)])
    assert all(p > POOL_WINS * i for _, i, p in c.figures[:-1])
    if c.outcome == "crossover":
        size, inline, pool = c.figures[-1]
        assert pool <= POOL_WINS * inline and c.threshold == size // 2
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
