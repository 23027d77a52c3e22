"""The control socket's `stats` reply in Prometheus' text exposition format (version
0.0.4), for `nbd-verity ctl metrics`: node_exporter's textfile collector reads a file of
it, and any scrape wrapper can serve it.

A pure function of the stats snapshot (the same dict `ctl stats --json` prints), so the
server side stays the one source of every number: a counter added to `totals` appears
here as `nbd_verity_<name>_total` without a change in this module. Names follow
Prometheus' conventions: base units (seconds, bytes), `_total` on counters, one family
per meaning with labels for the I/O class and path. `ctl stats --reset` zeroes the
counters; Prometheus' rate() treats that as a counter reset, as after a restart.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

PREFIX = "nbd_verity_"
PATHS = ("inline", "pool")
QUANTILES = (("0.5", "p50_us"), ("0.99", "p99_us"))
GAUGES = {"cached_hash_blocks"}  # totals that are a level now, not a count of events
HELP = {  # totals' help; an unknown counter still gets a generic line
    "data_blocks_verified": "Data blocks that matched their trusted digest.",
    "hash_reads": "Read calls on the hash image.",
    "hash_blocks_read": "Hash blocks read from the hash image.",
    "readaheads": "Merkle readahead windows read.",
    "cache_hits": "Lookups served by the verified hash-block cache.",
    "cache_misses": "Lookups the verified hash-block cache could not serve.",
    "cache_evictions": "Hash blocks evicted from the verified hash-block cache.",
    "cached_hash_blocks": "Verified hash blocks held in the cache now.",
    "corruptions": "Blocks that failed verification (data or hash).",
    "io_errors": "Requests that failed with an I/O error.",
    "source_errors": "Failed reads of an NBD (or captive HTTP/S3) source.",
    "reconnects": "Reconnections to an NBD source.",
    "fec_corrected": "Blocks rebuilt by forward error correction.",
    "fec_failed": "Blocks forward error correction could not rebuild.",
    "io_errors_repaired": "Unreadable blocks rebuilt by forward error correction.",
}


def _label_value(value) -> str:
    """A label value with backslash, double quote and newline escaped."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_label_value(v)}"' for k, v in labels.items())
    return "{" + inner + "}"


def _number(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "NaN"
    if isinstance(value, bool):
        return "1" if value else "0"
    # 10 significant digits: a latency of 120.6 us is 0.0001206, not 0.00012059999999999999
    return f"{value:.10g}" if isinstance(value, float) else str(int(value))


def _family(name: str, kind: str, help_text: str,
            samples: Iterable[tuple[str, dict, object]]) -> list[str]:
    """# HELP, # TYPE and the samples (suffix, labels, value) of one family."""
    lines = [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}"]
    lines += [f"{PREFIX}{name}{suffix}{_labels(labels)} {_number(value)}"
              for suffix, labels, value in samples]
    return lines


def _per_class(stats: dict, field: str):
    for io_class, paths in stats.get("classes", {}).items():
        for path in PATHS:
            if path in paths:
                yield io_class, path, paths[path].get(field)


def _class_families(stats: dict) -> list[str]:
    """Requests, bytes and latency quantiles per I/O class and verification path."""
    lines = _family("requests_total", "counter", "Read requests, by I/O class and path "
                    "(inline: in the nbdkit thread; pool: split across the workers).",
                    (("", {"class": c, "path": p}, v)
                     for c, p, v in _per_class(stats, "requests")))
    lines += _family("read_bytes_total", "counter", "Bytes read, by I/O class and path.",
                     (("", {"class": c, "path": p}, v)
                      for c, p, v in _per_class(stats, "bytes")))
    samples = []
    for quantile, field in QUANTILES:
        for c, p, us in _per_class(stats, field):
            seconds = None if us is None else us / 1e6
            samples.append(("", {"class": c, "path": p, "quantile": quantile}, seconds))
    lines += _family("request_latency_seconds", "summary",
                     "Request latency quantiles over the most recent 4096 requests of "
                     "each class and path (NaN before the first).", samples)
    return lines


def _total_families(totals: dict) -> list[str]:
    lines: list[str] = []
    for name, value in totals.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        help_text = HELP.get(name, f"The server's {name} counter.")
        if name in GAUGES:
            lines += _family(name, "gauge", help_text, [("", {}, value)])
        else:
            lines += _family(f"{name}_total", "counter", help_text, [("", {}, value)])
    return lines


def _state_families(stats: dict) -> list[str]:
    """Status, uptime, thresholds and what the server was started with."""
    lines = _family("corrupted", "gauge", "1 once any corruption was seen (status C), "
                    "0 while every read verified (V); never reset.",
                    [("", {}, stats.get("status") == "C")])
    lines += _family("uptime_seconds", "gauge", "Seconds since the server started.",
                     [("", {}, stats.get("uptime_s"))])
    lines += _family("inline_threshold_bytes", "gauge", "Largest request of each I/O class "
                     "verified inline; larger ones go to the pool.",
                     (("", {"class": c}, v) for c, v in stats.get("thresholds", {}).items()))
    for name, key, help_text in (("workers", "workers", "Verification pool threads."),
                                 ("chunk_size_bytes", "chunk_size", "Bytes per pool chunk."),
                                 ("kept_thread_states", "kept_thread_states",
                                  "nbdkit threads whose Python thread state is kept "
                                  "between requests (serve/threadstate.py).")):
        if key in stats:
            lines += _family(name, "gauge", help_text, [("", {}, stats[key])])
    trust = stats.get("trust", {})
    info = {"mode": stats.get("mode", ""), "signed": "true" if trust.get("signed") else "false",
            "root_hash": trust.get("root_hash", "")}
    if trust.get("signed"):
        info["signer"] = trust.get("subject", "")
    lines += _family("info", "gauge", "Constant 1; the labels say how the server runs and "
                     "what vouches for its root hash.", [("", info, 1)])
    return lines


def _one(stats: dict) -> list[str]:
    return [*_class_families(stats), *_total_families(stats.get("totals", {})),
            *_state_families(stats)]


def exposition(stats: dict) -> str:
    """The whole stats snapshot as Prometheus text, ending in a newline. A many-export
    server's (stats["exports"]) has every sample labelled with its export, and each
    family's HELP and TYPE once, its samples together, as the format requires."""
    if "exports" not in stats:
        return "\n".join(_one(stats)) + "\n"
    headers: dict[str, list[str]] = {}  # family -> its HELP and TYPE lines
    samples: dict[str, list[str]] = {}
    for name, one in stats["exports"].items():
        label = f'export="{_label_value(name)}"'
        for line in _one(one):
            if line.startswith("# "):
                family = line.split()[2]
                if len(headers.setdefault(family, [])) < 2:
                    headers[family].append(line)
                continue
            metric, _, value = line.partition(" ")
            family, brace, labels = metric.partition("{")  # every sample is its family's
            labelled = f"{family}{{{label},{labels}" if brace else f"{family}{{{label}}}"
            samples.setdefault(family, []).append(f"{labelled} {value}")
    return "".join(line + "\n" for family in headers
                   for line in (*headers[family], *samples.get(family, ())))
