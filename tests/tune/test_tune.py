"""`nbd-verity tune` end to end against real servers, and its recommendation rule.

Runs are tiny (two sizes, 50 ms per point): they check the plumbing, the output and what
happens to the server's table, not the figures.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from nbd_verity.control.tune import SIZES, ClassSweep, Point, recommend

QUICK = ["--sizes", "4k,64k", "--duration", "0.05", "--repeat", "2"]


# -- the rule -------------------------------------------------------------------------


@pytest.mark.parametrize(("ratios", "expected"), [
    ([2.0, 1.8, 1.5, 1.3, 1.2, 1.1, 1.05, 1.01], SIZES[-1]),  # inline always wins
    ([0.9, 0.8, 0.7, 0.6, 0.5, 0.5, 0.4, 0.4], 0),  # the pool always wins
    ([1.5, 1.4, 1.3, 1.1, 1.02, 0.8, 0.7, 0.6], SIZES[4]),  # the usual crossover
    ([1.5, 1.4, 0.97, 1.3, 1.2, 0.8, 0.7, 0.6], SIZES[4]),  # one noisy dip does not stop it
    ([1.5, 1.4, 1.3, 1.2, 0.8, 1.03, 0.7, 0.6], SIZES[3]),  # one noisy win does not extend it
    ([1.0] * 8, SIZES[-1]),  # a tie goes inline: "at least as fast"
    ([1.3, 0.0, 1.3, 1.3, 1.3, 1.3, 1.3, 1.3], SIZES[0]),  # a size with no inline throughput
])
def test_recommend(ratios, expected):
    assert recommend(SIZES, ratios) == expected


def _sweep(inline: list[list[float]], pool: list[list[float]]) -> ClassSweep:
    sizes = SIZES[:len(inline)]
    points = {}
    for size, i, p in zip(sizes, inline, pool, strict=True):
        points[(size, "inline")] = Point(i)
        points[(size, "pool")] = Point(p)
    return ClassSweep("be", points, sizes)


def test_noise_and_close_calls():
    sweep = _sweep([[200, 200, 200], [100, 110, 90], [50, 50, 50]],
                   [[100, 100, 100], [100, 100, 100], [100, 100, 100]])
    assert sweep.recommendation == SIZES[1]
    assert sweep.noise(SIZES[0]) == 0
    assert math.isclose(sweep.noise(SIZES[1]), 0.1)
    assert sweep.close_calls() == [SIZES[1]]  # 1.0x ± 10% at the threshold itself


# -- end to end -----------------------------------------------------------------------


def _recommendations(stdout: str) -> dict[str, int]:
    return {c: int(v) for c, v in re.findall(r"^(\w+): recommend (\d+)", stdout, re.M)}


def test_self_served_prints_table_and_recommendation(tools, tune_image):
    result = tools.ours("tune", tune_image.data, tune_image.hash, tune_image.root,
                        "--class", "be", *QUICK)
    assert result.returncode == 0, result.stderr
    assert re.search(r"size\s+inline MB/s\s+pool MB/s\s+inline/pool\s+noise", result.stdout)
    assert re.search(r"^\s+4k\s+[\d.]+\s+[\d.]+\s+[\d.]+x\s+±[\d.]+%", result.stdout, re.M)
    assert re.search(r"^noise: ±[\d.]+%", result.stdout, re.M)
    assert _recommendations(result.stdout)["be"] in (0, 4096, 65536)
    assert "serve with: --threshold be=" in result.stdout


def test_without_apply_the_table_is_restored(tools, server):
    server.ctl({"cmd": "thresholds", "set": {"be": 12345, "rt": 777}})
    before = server.table()
    result = tools.ours("tune", "--control", server.control, "--socket", server.socket,
                        "--class", "be", *QUICK)
    assert result.returncode == 0, result.stderr
    assert server.table() == before
    assert (f"table restored: none={before['none']} rt=777 be=12345 idle={before['idle']}"
            in result.stdout)


def test_apply_sets_the_recommendation(tools, server):
    server.ctl({"cmd": "thresholds", "set": {"be": 12345, "rt": 777}})
    result = tools.ours("tune", "--control", server.control, "--socket", server.socket,
                        *QUICK, "--apply", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    chosen = {c["class"]: c["recommendation"] for c in report["classes"]}
    assert list(chosen) == ["none", "rt", "be", "idle"]  # every class by default
    assert set(chosen.values()) <= {0, 4096, 65536}
    shown = tools.ours("ctl", "--control", server.control, "thresholds", "--json")
    assert json.loads(shown.stdout)["thresholds"] == chosen == report["table"]


def test_a_class_the_server_does_not_grant_is_one_line_not_a_sweep(tools, server_without_rt):
    """Connections named @rt get be where naming rt is not allowed: tune says so in one
    line instead of sweeping be's behaviour as rt's."""
    server = server_without_rt
    result = tools.ours("tune", "--control", server.control, "--socket", server.socket,
                        *QUICK, "--class", "rt")
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs `serve --allow-class rt`" in lines[0], lines


def test_plot_without_matplotlib_or_with_it(tools, tune_image, tmp_path):
    """--plot writes a PNG when matplotlib is there, and fails in one line otherwise."""
    plot = tmp_path / "p.png"
    result = tools.ours("tune", tune_image.data, tune_image.hash, tune_image.root,
                        "--class", "idle", "--sizes", "4k", "--duration", "0.05",
                        "--repeat", "1", "--plot", plot)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert result.returncode == 2
        assert result.stderr.strip() == ("nbd-verity: plot: matplotlib is not installed "
                                         "(pip install matplotlib)")
    else:
        assert result.returncode == 0, result.stderr
        assert plot.read_bytes()[:4] == b"\x89PNG"


# -- bad arguments: one line, non-zero exit, the server untouched ---------------------


@pytest.mark.parametrize(("args", "message"), [
    ([], "needs both --control PATH and --socket PATH"),
    (["data.img", "hash.img"], "give DATA HASH ROOT_HASH, or --control"),
    (["--control", "/nonexistent.ctl"], "needs both --control PATH and --socket PATH"),
    (["--class", "fast", "--control", "c", "--socket", "s"], "unknown I/O class 'fast'"),
    (["--sizes", "4k,abc", "--control", "c", "--socket", "s"], "sizes: 'abc' is not a size"),
    (["--sizes", "64M", "--control", "c", "--socket", "s"], "each size must be 1..33554432"),
    (["--duration", "0", "--control", "c", "--socket", "s"], "duration: 0.0 is not within"),
    (["--duration", "abc", "--control", "c", "--socket", "s"], "'abc' is not a valid float"),
    (["--repeat", "0", "--control", "c", "--socket", "s"], "repeat: 0 is not within 1..100"),
    (["--connections", "0", "--control", "c", "--socket", "s"], "connections: 0 is not"),
    (["--span", "4k", "--control", "c", "--socket", "s"], "span: 4096 is smaller than"),
    (["d", "h", "r", "--apply"], "--apply changes a running server"),
    (["--workers", "2", "--control", "c", "--socket", "s"], "--workers and --threads apply"),
    (["--frobnicate"], "No such option"),  # then ": --frobnicate" (click 8.1) or " '--...'"
    (["--control", "/nonexistent.ctl", "--socket", "/nonexistent.sock"],
     "control: /nonexistent.ctl: No such file or directory"),
])
def test_bad_arguments_give_one_line(tools, args, message):
    result = tools.ours("tune", *args)
    assert result.returncode == 2, result
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("nbd-verity: ") and message in lines[0], lines[0]


def test_wrong_root_hash_is_one_line(tools, tune_image):
    result = tools.ours("tune", tune_image.data, tune_image.hash, "00" * 32, *QUICK)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("nbd-verity: root-hash: does not match the top of the tree")


def test_size_larger_than_the_device(tools, server):
    before = server.table()
    result = tools.ours("tune", "--control", server.control, "--socket", server.socket,
                        "--sizes", "8M", "--span", "8M", "--duration", "0.05")
    assert result.returncode == 2
    assert result.stderr.strip() == ("nbd-verity: sizes: 8388608 bytes is more than the "
                                     "device (4194304 bytes)")
    assert server.table() == before
