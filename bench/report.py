"""Turn benchmark results into Markdown tables, PNG plots and docs/benchmarks.md.

bench/run.py owns the part of docs/benchmarks.md between the two marker comments below;
everything outside them (the "Format and verify" section, written by bench/format.py) is
kept as it is. Plots are drawn with matplotlib's Agg backend into docs/benchmarks-*.png.
"""

from __future__ import annotations

import math
import os
import platform
import time
from pathlib import Path

from fiorun import Result, size_label

DOCS = Path(__file__).resolve().parents[1] / "docs"
DOC = DOCS / "benchmarks.md"
BEGIN = "<!-- bench/run.py: begin (written by `make bench`; edit bench/report.py instead) -->"
END = "<!-- bench/run.py: end -->"


def machine() -> str:
    """CPU model, cores, kernel: one line for the record."""
    model = "unknown CPU"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model}, {os.cpu_count()} cores, Linux {platform.release()}"


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def ratio(a: float, b: float) -> str:
    return "-" if not b or math.isnan(a) or math.isnan(b) else f"{a / b:.2f}x"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def main_table(main: dict[str, dict[str, Result]], tools: dict[str, float],
               labels: tuple[str, str], file_name: str, pass_name: str) -> str:
    """Servers x (4 KiB random, 512 KiB sequential), with the ratios the issue asks for."""
    rand, seq = labels
    openssl = tools.get("openssl dgst -sha256", float("nan"))
    header = ["server", f"{rand} MB/s", "IOPS", "vs file", "vs pass-through",
              f"{seq} MB/s", "IOPS", "vs file", "vs pass-through", "seq vs openssl"]
    rows = []
    for name, res in main.items():
        r, s = res[rand], res[seq]
        rows.append([name, f"{r.mb_s:.1f}", f"{r.iops:.0f}",
                     ratio(r.mb_s, main[file_name][rand].mb_s),
                     ratio(r.mb_s, main[pass_name][rand].mb_s), f"{s.mb_s:.1f}", f"{s.iops:.0f}",
                     ratio(s.mb_s, main[file_name][seq].mb_s),
                     ratio(s.mb_s, main[pass_name][seq].mb_s), ratio(s.mb_s, openssl)])
    for name, mb_s in tools.items():
        rows.append([f"`{name}` (one pass, wall time)", "", "", "", "", f"{mb_s:.1f}", "", "",
                     "", ratio(mb_s, openssl)])
    return table(header, rows)


def sweep_table(sweep: dict[str, dict[int, Result]], pass_name: str, verity_name: str) -> str:
    names = list(sweep)
    sizes = sorted(next(iter(sweep.values())))
    header = ["block size", *[f"{n} MB/s" for n in names], f"{verity_name} vs pass-through"]
    rows = []
    for bs in sizes:
        cells = [f"{sweep[n][bs].mb_s:.1f}" for n in names]
        rows.append([size_label(bs), *cells,
                     ratio(sweep[verity_name][bs].mb_s, sweep[pass_name][bs].mb_s)])
    return table(header, rows)


def readahead_table(rows_in: list[dict]) -> str:
    header = ["workload", "readahead", "MB/s", "MiB read", "hash reads", "hash reads / MiB",
              "hash blocks read / MiB", "readaheads"]
    rows = []
    for r in rows_in:
        mib = r["mib"] or float("nan")
        rows.append([r["workload"], "on" if r["readahead"] else "off", f"{r['result'].mb_s:.1f}",
                     f"{r['mib']:.0f}", r["hash_reads"], f"{r['hash_reads'] / mib:.3f}",
                     f"{r['hash_blocks_read'] / mib:.3f}", r["readaheads"]])
    return table(header, rows)


def scaling_table(rows_in: list[dict]) -> str:
    header = ["data image", "tree made by", "levels", "start-up (median)", "start-up (min..max)",
              "RSS idle", "RSS after 1 GiB read", "MB/s of that read"]
    rows = []
    for r in rows_in:
        rows.append([r["image"], r["how"], r.get("levels", "-"),
                     f"{r['startup'][len(r['startup']) // 2] * 1000:.0f} ms",
                     f"{r['startup'][0] * 1000:.0f}..{r['startup'][-1] * 1000:.0f} ms",
                     f"{r['rss_idle'] / 1024:.1f} MiB" if r.get("rss_idle") else "-",
                     f"{r['rss_after'] / 1024:.1f} MiB" if r.get("rss_after") else "-",
                     f"{r['result'].mb_s:.1f}" if r.get("result") else "-"])
    return table(header, rows)


def knob_table(knob: str, rows_in: list[tuple]) -> str:
    """One row per knob value (in the order first seen), one column per workload."""
    labels = list(dict.fromkeys(label for _, label, _ in rows_in))
    values = list(dict.fromkeys(v for v, _, _ in rows_in))
    by = {(v, label): res for v, label, res in rows_in}
    header = [knob, *[f"{label} MB/s (IOPS)" for label in labels]]
    rows = [[v, *[f"{by[(v, lab)].mb_s:.1f} ({by[(v, lab)].iops:.0f})" for lab in labels]]
            for v in values]
    return table(header, rows)


# -- plots ---------------------------------------------------------------------------


def plot_main(path: Path, main: dict[str, dict[str, Result]], tools: dict[str, float],
              labels: tuple[str, str]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    names = list(main)
    for ax, label in zip(axes, labels, strict=True):
        values = [main[n][label].mb_s for n in names]
        bars = ax.barh(names, values, color="#4477aa")
        ax.bar_label(bars, fmt="%.0f", padding=3, fontsize=8)
        ax.set_title(label)
        ax.set_xlabel("MB/s")
        ax.invert_yaxis()
    for (name, mb_s), style in zip(tools.items(), ("--", ":"), strict=False):
        axes[1].axvline(mb_s, color="#cc6677", linestyle=style, label=f"{name}: {mb_s:.0f}")
    if tools:
        axes[1].legend(fontsize=7, loc="lower right")
    axes[1].set_yticklabels([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(path: Path, sweep: dict[str, dict[int, Result]], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, points in sweep.items():
        sizes = sorted(points)
        ax.plot(sizes, [points[s].mb_s for s in sizes], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    sizes = sorted(next(iter(sweep.values())))
    ax.set_xticks(sizes, [size_label(s) for s in sizes])
    ax.set_xlabel("request size (random reads)")
    ax.set_ylabel("MB/s (log)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the doc -------------------------------------------------------------------------


def header(command: str, settings: str, load_before: str, load_after: str) -> str:
    return "\n".join([
        f"Recorded {time.strftime('%Y-%m-%d %H:%M %Z')} on {machine()}, with "
        f"`{command}` ({settings}). Load average (1/5/15 min) {load_before} before and "
        f"{load_after} after the run: the machine is shared, so compare rows of one run "
        f"with each other rather than with other machines.",
    ])


def write_doc(body: str) -> Path:
    """Replace the text between the markers (or add it), keeping everything else.

    A new block goes before the first '## ' section, so that bench/format.py, which
    replaces its section up to the next '## ' heading, never swallows our markers."""
    block = f"{BEGIN}\n{body.rstrip()}\n{END}\n"
    if DOC.exists():
        text = DOC.read_text()
        if BEGIN in text and END in text:
            head, rest = text.split(BEGIN, 1)
            tail = rest.split(END, 1)[1].lstrip("\n")
            text = head + block + ("\n" + tail if tail else "")
        elif "\n## " in text:  # before the first section: bench/format.py's section runs
            cut = text.index("\n## ") + 1  # from its heading to the next '## ' or the end
            text = text[:cut] + block + "\n" + text[cut:]
        else:
            text = text.rstrip() + "\n\n" + block
    else:
        text = "# Benchmarks\n\n" + block
    DOC.write_text(text)
    return DOC
