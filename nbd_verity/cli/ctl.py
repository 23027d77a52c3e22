"""`nbd-verity ctl --control PATH ...`: talk to a running server's control socket."""

from __future__ import annotations

import json

import click

from ..control.exports import RELOAD_DEADLINE_S
from ..control.protocol import CLIENT_TIMEOUT, request
from ..files import write_atomically
from ..ioclass import CLASSES
from .common import EXIT_CORRUPT, edge, fail


def checked(path: str, message: dict, timeout: float = CLIENT_TIMEOUT) -> dict:
    """A successful reply, or the server's refusal as one line and exit status 1."""
    reply = request(path, message, timeout)
    if not reply.get("ok"):
        fail(f"server: {reply.get('error', 'unknown error')}", EXIT_CORRUPT)
    return reply


@click.group("ctl")
@click.option("--control", required=True, metavar="PATH", envvar="NBD_VERITY_CONTROL",
              help="The server's control socket.")
@click.pass_context
def ctl(ctx: click.Context, control: str) -> None:
    """Inspect and tune a running server."""
    ctx.obj = control


def parse_assignments(items: tuple[str, ...]) -> dict[str, int]:
    """CLASS=BYTES arguments; the server validates classes and ranges."""
    changes: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise click.BadParameter(f"{item!r} is not CLASS=BYTES", param_hint="thresholds")
        try:
            changes[name] = int(value)
        except ValueError:
            raise click.BadParameter(f"{item!r}: {value!r} is not an integer",
                                     param_hint="thresholds") from None
    return changes


@ctl.command("thresholds")
@click.argument("assignments", nargs=-1, metavar="[CLASS=BYTES]...")
@click.option("--preset", default=None,
              help="Load a preset table (default, fixed, seed, kernel).")
@click.option("--json", "as_json", is_flag=True, help="Print the raw reply.")
@click.pass_obj
@edge
def thresholds_cmd(control: str, assignments, preset, as_json) -> None:
    """Show the inline threshold table, or change it (e.g. be=65536 rt=0)."""
    request: dict = {"cmd": "thresholds"}
    if preset and assignments:
        raise click.UsageError("give CLASS=BYTES or --preset, not both")
    if preset:
        request["preset"] = preset
    elif assignments:
        request["set"] = parse_assignments(assignments)
    reply = checked(control, request)
    if as_json:
        click.echo(json.dumps(reply))
        return
    pinned = set(reply.get("pinned", []))
    for name in CLASSES:
        click.echo(f"{name:<5} {reply['thresholds'][name]}" + ("  (pinned)" if name in pinned
                                                               else ""))


EXPORT_OPTION = click.option("--export", "export", default=None, metavar="NAME",
                             help="One export of a many-export server (default: all).")


@ctl.command("stats")
@click.option("--json", "as_json", is_flag=True, help="Print the raw reply.")
@click.option("--reset", is_flag=True, help="Zero the counters after reading them.")
@EXPORT_OPTION
@click.pass_obj
@edge
def stats_cmd(control: str, as_json: bool, reset: bool, export: str | None) -> None:
    """Requests per class and path, latencies, cache and hash-read counters."""
    reply = _ask(control, {"cmd": "stats", **({"reset": True} if reset else {})}, export,
                 as_json)
    if reply is None:
        return
    stats = reply["stats"]
    if "exports" not in stats:
        click.echo(format_stats(stats))
        return
    blocks = [f"export {name}\n{format_stats(one)}" for name, one in stats["exports"].items()]
    click.echo("\n\n".join(blocks) if blocks else "no exports")


def _ask(control: str, request: dict, export: str | None, as_json: bool) -> dict | None:
    """The reply to request (of one export, when named); None once --json printed it."""
    if export is not None:
        request["export"] = export
    reply = checked(control, request)
    if as_json:
        click.echo(json.dumps(reply))
        return None
    return reply


@ctl.command("exports")
@click.argument("action", required=False, type=click.Choice(["reload"]))
@click.option("--json", "as_json", is_flag=True, help="Print the raw reply.")
@click.option("--deadline", type=click.FloatRange(0, 600, min_open=True),
              default=RELOAD_DEADLINE_S, show_default=True, metavar="SECONDS",
              help="reload: the longest the server spends opening export files; one "
                   "still opening then is refused (not served) and named in the reply.")
@click.pass_obj
@edge
def exports_cmd(control: str, action: str | None, as_json: bool, deadline: float) -> None:
    """The exports of a many-export server, with their status; `reload` re-reads its
    directory of export files (new, changed and removed files; a bad one is refused)
    and waits for the server's answer: what it says was applied."""
    request: dict = {"cmd": "exports"}
    timeout = CLIENT_TIMEOUT
    if action == "reload":
        request.update(reload=True, deadline=deadline)
        timeout += deadline  # the server answers by its deadline, and this waits for it
    reply = checked(control, request, timeout)
    if as_json:
        click.echo(json.dumps(reply))
        return
    report = reply.get("reload")
    if report is not None:
        for what in ("added", "changed", "removed"):
            if report[what]:
                click.echo(f"{what}: {', '.join(report[what])}")
        for why in report["refused"].values():  # each names its file
            click.echo(f"refused: {why}")
    for item in reply["exports"]:
        click.echo(f"{item['name']:<16} {item['status']}  corruptions {item['corruptions']}  "
                   f"clients {item['connections']}  {item['description']}")
    if report is not None and report["refused"]:
        fail(f"{len(report['refused'])} export file(s) refused", EXIT_CORRUPT)


@ctl.command("metrics")
@click.option("--output", "-o", default=None, metavar="FILE",
              help="Write to FILE (atomically: a temporary file renamed over it), as "
                   "node_exporter's textfile collector wants; default standard output.")
@click.pass_obj
@edge
def metrics_cmd(control: str, output: str | None) -> None:
    """The counters and per-class latency in Prometheus' text exposition format."""
    from ..control.metrics import exposition
    text = exposition(checked(control, {"cmd": "stats"})["stats"])  # with export labels
    if output is None:
        click.echo(text, nl=False)
        return
    write_atomically(output, text, 0o644)  # metrics, not secrets: the collector reads it


def _us(value) -> str:
    return "-" if value is None else f"{value:.0f}"


def format_stats(stats: dict) -> str:
    """A readable table: one row per class and path, then the totals."""
    lines = [f"{'class':<6}{'path':<8}{'threshold':>10}{'requests':>10}{'MiB':>10}"
             f"{'p50 us':>9}{'p99 us':>9}"]
    for name in CLASSES:
        for path in ("inline", "pool"):
            row = stats["classes"][name][path]
            lines.append(f"{name:<6}{path:<8}{stats['thresholds'][name]:>10}"
                         f"{row['requests']:>10}{row['bytes'] / 2**20:>10.1f}"
                         f"{_us(row['p50_us']):>9}{_us(row['p99_us']):>9}")
    totals = stats["totals"]
    lines.append("")
    lines.append(f"status {stats['status']}  corruptions {stats['corruptions']}  "
                 f"uptime {stats['uptime_s']:.0f} s  workers {stats['workers']}  "
                 f"kept thread states {stats.get('kept_thread_states', 0)}  "
                 f"nbdkit {stats.get('nbdkit', 'unknown')}")
    lines.append("  ".join(f"{k} {v}" for k, v in totals.items()))
    if "class_gate" in stats:
        lines.append(dispatch_line(stats))
    if "trust" in stats:
        lines.append(trust_line(stats["trust"]))
    return "\n".join(lines)


def dispatch_line(stats: dict) -> str:
    """Why requests went where they did: the pinned classes, the pool-sized requests
    verified inline because the pool was busy, and the class gate's waits."""
    pinned = ",".join(stats.get("pinned", [])) or "none"
    busy = " ".join(f"{c} {n}" for c, n in stats.get("busy_inline", {}).items() if n) or "0"
    gate = "  ".join(f"{rank} {row['waited']} ({row['aged']} at the bound, "
                     f"{row['waited_s']:.1f} s)"
                     for rank, row in stats["class_gate"].items() if rank != "rt")
    return f"dispatch  pinned {pinned}  busy inline {busy}  waited for a better class: {gate}"


def trust_line(trust: dict) -> str:
    """Whether the served root hash is signed, and by which certificate."""
    if not trust.get("signed"):
        return f"trust  root hash {trust['root_hash']} unsigned ({trust['root_hash_source']})"
    expired = ", certificate expired" if trust.get("expired") else ""
    return (f"trust  root hash {trust['root_hash']} signed by {trust['subject']} "
            f"(sha256 {trust['fingerprint']}){expired}")


@ctl.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print the raw reply.")
@EXPORT_OPTION
@click.pass_obj
@edge
def status_cmd(control: str, as_json: bool, export: str | None) -> None:
    """V (all verified) or C (corruption seen), as dmsetup status prints."""
    reply = _ask(control, {"cmd": "status"}, export, as_json)
    if reply is None:
        return
    status = reply["status"]
    if "exports" in status:
        for name, one in status["exports"].items():
            click.echo(f"{name:<16} {one['status']}  corruptions {one['corruptions']}  "
                       f"mode {one['mode']}  clients {one['connections']}")
        return
    click.echo(f"{status['status']}  corruptions {status['corruptions']}  "
               f"mode {status['mode']}  uptime {status['uptime_s']:.0f} s")
    if "trust" in status:
        click.echo(trust_line(status["trust"]))


@ctl.command("stop")
@click.option("--json", "as_json", is_flag=True, help="Print the raw reply.")
@click.pass_obj
@edge
def stop_cmd(control: str, as_json: bool) -> None:
    """Stop the server without costing a client a read: new connections are refused, each
    client connection is closed at a moment it has nothing in flight (a client such as
    `nbd-verity attach` then reconnects), then the server exits."""
    from ..serve.drain import DRAIN_S
    reply = checked(control, {"cmd": "stop"}, timeout=DRAIN_S + 10)
    if as_json:
        click.echo(json.dumps(reply))
        return
    click.echo(f"stopping: {reply['drained']} connection(s) drained, {reply['cut']} cut, "
               f"in {reply['seconds']} s" if "drained" in reply else "stopping (already asked)")
