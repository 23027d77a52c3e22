"""`nbd-verity attach` and `detach`: the kernel's NBD client that outlives its servers."""

from __future__ import annotations

import json

import click

from .common import edge, say


@click.command("attach")
@click.argument("args", nargs=-1, metavar="URI... DEVICE")
@click.option("-C", "--connections", type=click.IntRange(1, 16), default=1, show_default=True,
              help="Connections to the server (it must allow several: multi-conn).")
@click.option("--dead-timeout", type=click.IntRange(1, 86400), default=60, show_default=True,
              metavar="SECONDS", help="How long reads wait for a server before they fail.")
@click.option("-t", "--timeout", type=click.IntRange(0, 86400), default=0, show_default=True,
              metavar="SECONDS", help="The kernel's request timeout: a request this old "
              "cuts its connection and is sent again (0: a slow server is waited for).")
@click.option("--root-hash", default=None, metavar="HEX",
              help="Attach only to servers of this image (default: the first server's).")
@click.option("-l", "--list", "as_list", is_flag=True,
              help="List attached devices: server, connections, reconnects.")
@click.option("--json", "as_json", is_flag=True, help="With --list: JSON.")
@edge
def attach_cmd(args, connections, dead_timeout, timeout, root_hash, as_list, as_json) -> None:
    """Attach DEVICE (/dev/nbdN) to the image the URIs serve, and keep it attached.

    Each URI (nbd+unix:///EXPORT?socket=PATH, nbd://HOST[:PORT]/EXPORT, or a socket
    path) is a server of the same image. attach stays in the foreground: when a server
    stops, crashes or is replaced, it reconnects to any of them and reads wait instead
    of failing. Stopping attach leaves the device attached (a new attach adopts it);
    `nbd-verity detach DEVICE` ends it.
    """
    from ..attach import session, status
    from ..attach.handshake import Uri
    if as_list:
        _list(status.listing(), as_json)
        return
    if len(args) < 2:
        raise click.UsageError("give one or more server URIs and the device (/dev/nbdN)")
    from ..attach import kernel
    options = session.Options(uris=[Uri.parse(text) for text in args[:-1]],
                              device=kernel.device_index(args[-1]), connections=connections,
                              dead_timeout_s=dead_timeout, timeout_s=timeout,
                              root_hash=root_hash)
    attached = session.Session(options, say=_info, notify=status.sd_notify)
    try:
        attached.start()
        attached.run()
    finally:
        attached.close()


def _info(line: str) -> None:
    click.echo(f"nbd-verity attach: {line}", err=True)


def _list(rows: list[dict], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    if not rows:
        say("no nbd device is attached")
        return
    for row in rows:
        if "pid" in row:
            click.echo(f"{row['device']}  {row['size']} bytes  root hash "
                       f"{row['root_hash'][:16]}...  {row['server']}  "
                       f"{row['connections']} connection(s)  {row['reconnects']} reconnect(s)"
                       f"  attach pid {row['pid']}")
        else:
            click.echo(f"{row['device']}  {row['size']} bytes  {row['backend'] or '-'}  "
                       f"(no attach running)")


@click.command("detach")
@click.argument("device", metavar="DEVICE")
@edge
def detach_cmd(device: str) -> None:
    """Detach DEVICE (/dev/nbdN): its reads end, its size drops to 0, its attach exits."""
    from ..attach.status import detach
    detach(device)
