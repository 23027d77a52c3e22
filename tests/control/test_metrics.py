"""`nbd-verity ctl metrics`: the stats snapshot in Prometheus' text format, parsed by
prometheus_client's own parser, from a real server whose counters real reads moved.

The server serves the damaged image (conftest: blocks 20 and 300 flipped), so reads of
good blocks count as verified and reads of a bad block as corruptions and EIO.
"""

from __future__ import annotations

import errno
import math
import os

import nbd
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nbd_verity.control.metrics import exposition

from .conftest import BAD_BLOCKS, BLOCK_SIZE
from .harness import ctl, one_error_line

KIB = 1024


def parse(text: str) -> dict:
    """{family name: family} of a whole exposition; the parser raises on bad syntax."""
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families, text
    return families


def sample(families: dict, family: str, name: str | None = None, **labels) -> float:
    """The value of the one sample of FAMILY (named NAME) whose labels include LABELS."""
    name = name or family
    found = [s.value for s in families[family].samples
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (family, name, labels, families[family].samples)
    return found[0]


@pytest.fixture
def moved(servers, damaged_image):
    """A server after 4 inline reads and 1 pool read on @be, 2 on @idle, and one read
    of a corrupt block (EIO): (server, what was read)."""
    server = servers.start(damaged_image)
    server.set_thresholds(be=64 * KIB, idle=1 << 20)
    with server.client("@be") as h:
        for i in range(4):
            assert h.pread(16 * KIB, i * 16 * KIB) == damaged_image.expected(i * 16 * KIB,
                                                                             16 * KIB)
        assert h.pread(256 * KIB, 1280 * KIB) == damaged_image.expected(1280 * KIB, 256 * KIB)
        with pytest.raises(nbd.Error) as caught:
            h.pread(BLOCK_SIZE, BAD_BLOCKS[0] * BLOCK_SIZE)
        assert caught.value.errnum == errno.EIO
    with server.client("@idle") as h:
        for offset in (2 << 20, 3 << 20):
            h.pread(8 * KIB, offset)
    return server


def test_metrics_parse_and_match_the_reads(moved):
    result = ctl(moved.control, "metrics")
    assert result.returncode == 0, result.stderr
    families = parse(result.stdout)
    # per class and path: the requests and bytes the clients sent (the EIO one included)
    assert families["nbd_verity_requests"].type == "counter"
    requests = {(c, p): sample(families, "nbd_verity_requests", "nbd_verity_requests_total",
                               **{"class": c, "path": p})
                for c in ("none", "rt", "be", "idle") for p in ("inline", "pool")}
    assert requests == {("none", "inline"): 0, ("none", "pool"): 0, ("rt", "inline"): 0,
                        ("rt", "pool"): 0, ("be", "inline"): 5, ("be", "pool"): 1,
                        ("idle", "inline"): 2, ("idle", "pool"): 0}
    assert sample(families, "nbd_verity_read_bytes", "nbd_verity_read_bytes_total",
                  **{"class": "be", "path": "pool"}) == 256 * KIB
    assert sample(families, "nbd_verity_read_bytes", "nbd_verity_read_bytes_total",
                  **{"class": "idle", "path": "inline"}) == 16 * KIB
    # latency: quantiles in seconds where there were requests, NaN where there were none
    assert families["nbd_verity_request_latency_seconds"].type == "summary"
    p50 = sample(families, "nbd_verity_request_latency_seconds",
                 **{"class": "be", "path": "inline", "quantile": "0.5"})
    p99 = sample(families, "nbd_verity_request_latency_seconds",
                 **{"class": "be", "path": "inline", "quantile": "0.99"})
    assert 0 < p50 <= p99 < 10
    assert math.isnan(sample(families, "nbd_verity_request_latency_seconds",
                             **{"class": "rt", "path": "pool", "quantile": "0.99"}))
    # totals, corruption and status
    good_blocks = (4 * 16 + 256 + 2 * 8) // 4
    assert sample(families, "nbd_verity_data_blocks_verified",
                  "nbd_verity_data_blocks_verified_total") >= good_blocks
    assert sample(families, "nbd_verity_corruptions", "nbd_verity_corruptions_total") >= 1
    assert sample(families, "nbd_verity_io_errors", "nbd_verity_io_errors_total") == 0
    assert families["nbd_verity_cached_hash_blocks"].type == "gauge"
    assert sample(families, "nbd_verity_corrupted") == 1
    assert sample(families, "nbd_verity_uptime_seconds") > 0
    assert sample(families, "nbd_verity_inline_threshold_bytes", **{"class": "be"}) == 65536
    info = families["nbd_verity_info"].samples[0].labels
    assert info["mode"] == "eio" and info["signed"] == "false"
    assert info["root_hash"] == moved.image.root


def test_metrics_agree_with_stats_json(moved):
    """Every number of `stats --json` totals appears under its metric name."""
    stats = moved.stats()
    families = parse(exposition(stats))
    for name, value in stats["totals"].items():
        family = f"nbd_verity_{name}"
        metric = family if families[family].type == "gauge" else f"{family}_total"
        assert sample(families, family, metric) == value, name


def test_metrics_of_a_clean_server_say_verified(servers, image):
    server = servers.start(image)
    with server.client() as h:
        assert h.pread(64 * KIB, 0) == image.expected(0, 64 * KIB)
    families = parse(ctl(server.control, "metrics").stdout)
    assert sample(families, "nbd_verity_corrupted") == 0
    assert sample(families, "nbd_verity_corruptions", "nbd_verity_corruptions_total") == 0
    assert sample(families, "nbd_verity_data_blocks_verified",
                  "nbd_verity_data_blocks_verified_total") == 16


def test_metrics_output_file_for_the_textfile_collector(moved, tmp_path):
    target = tmp_path / "nbd_verity.prom"
    target.write_text("stale\n")
    result = ctl(moved.control, "metrics", "--output", str(target))
    assert result.returncode == 0 and result.stdout == "", result
    families = parse(target.read_text())
    assert sample(families, "nbd_verity_corrupted") == 1
    assert os.stat(target).st_mode & 0o777 == 0o644
    assert sorted(os.listdir(tmp_path)) == ["nbd_verity.prom"]  # no temporary left


def test_metrics_of_no_server_is_one_line(tmp_path):
    line = one_error_line(ctl(tmp_path / "absent.ctl", "metrics"))
    assert "No such file or directory" in line, line


def test_label_values_are_escaped():
    stats = {"classes": {}, "totals": {}, "status": "V", "uptime_s": 1.0, "mode": "eio",
             "trust": {"signed": True, "root_hash": "ab", "subject": 'CN=a "q" \\ b\nc'}}
    families = parse(exposition(stats))
    assert families["nbd_verity_info"].samples[0].labels["signer"] == 'CN=a "q" \\ b\nc'
