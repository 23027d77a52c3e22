#!/usr/bin/python3
"""The nbd-verity(8) man pages, written from the click commands themselves.

`manpages.py OUTDIR` writes nbd-verity.8 (the group: its options and its commands) and
one page per command, nbd-verity-COMMAND.8, with the command's usage, help and options
as `--help` prints them; a command group (ctl) gets one section per subcommand. The
pages come from the same objects that parse the command line, so they cannot drift from
it. debian/rules runs it on the installed package; tests/cli/test_manpages.py checks it.
Each page is written to a temporary file and renamed into place.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time
from pathlib import Path

import click

PROG = "nbd-verity"
SECTION = "8"


def roff_text(text: str) -> str:
    """Plain text as roff: backslashes, hyphens and a leading control character escaped."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join("\\&" + line if line.startswith((".", "'")) else line
                     for line in text.splitlines())


def roff_paragraphs(help_text: str) -> list[str]:
    """click help text as roff paragraphs: a paragraph after click's \\b marker keeps its
    lines (.nf), every other one is refilled by man, as --help refills it."""
    out = []
    for para in re.split(r"\n\s*\n", help_text.split("\f")[0].strip()):
        if para.startswith("\b"):
            out += [".PP", ".nf", roff_text(para[1:].strip("\n")), ".fi"]
        elif para.strip():
            out += [".PP", roff_text(" ".join(para.split()))]
    return out


def options_roff(command: click.Command, ctx: click.Context) -> list[str]:
    """One .TP entry per option, as --help lists them: its spellings, then its help."""
    out = []
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:
            continue
        names, help_text = record
        out += [".TP", f"\\fB{roff_text(names)}\\fR", roff_text(" ".join(help_text.split()))]
    return out


def usage_roff(command: click.Command, ctx: click.Context) -> list[str]:
    return [".SH SYNOPSIS", f"\\fB{roff_text(ctx.command_path)}\\fR "
            + roff_text(" ".join(command.collect_usage_pieces(ctx)))]


def subcommands(group: click.Group, ctx: click.Context) -> list[tuple[str, click.Command]]:
    return [(name, group.get_command(ctx, name)) for name in group.list_commands(ctx)]


def header(name: str, summary: str, version: str, date: str) -> list[str]:
    return [f'.TH "{name.upper()}" "{SECTION}" "{date}" "{PROG} {version}" '
            '"System Administration"', ".SH NAME", f"{roff_text(name)} \\- {roff_text(summary)}"]


def group_page(main: click.Group, version: str, date: str) -> str:
    """nbd-verity(8): the group's help, its own options and a list of its commands."""
    ctx = click.Context(main, info_name=PROG)
    lines = header(PROG, main.get_short_help_str(limit=200).rstrip("."), version, date)
    lines += [*usage_roff(main, ctx), ".SH DESCRIPTION", *roff_paragraphs(main.help or "")]
    lines += [".SH OPTIONS", *options_roff(main, ctx), ".SH COMMANDS"]
    for name, command in subcommands(main, ctx):
        lines += [".TP", f"\\fB{PROG}\\-{name}\\fR({SECTION})",
                  roff_text(command.get_short_help_str(limit=200))]
    lines += see_also([f"{PROG}-{name}" for name, _ in subcommands(main, ctx)])
    return "\n".join(lines) + "\n"


def command_page(main: click.Group, name: str, version: str, date: str) -> str:
    """nbd-verity-NAME(8): usage, help and options of one command; a group's subcommands
    each in a section of their own."""
    parent = click.Context(main, info_name=PROG)
    command = main.get_command(parent, name)
    ctx = click.Context(command, info_name=name, parent=parent)
    lines = header(f"{PROG}-{name}", command.get_short_help_str(limit=200).rstrip("."),
                   version, date)
    lines += [*usage_roff(command, ctx), ".SH DESCRIPTION", *roff_paragraphs(command.help or "")]
    lines += [".SH OPTIONS", *options_roff(command, ctx)]
    if isinstance(command, click.Group):
        lines.append(".SH COMMANDS")
        for sub_name, sub in subcommands(command, ctx):
            sub_ctx = click.Context(sub, info_name=sub_name, parent=ctx)
            lines += [f".SS {roff_text(sub_name)}", f"\\fB{roff_text(sub_ctx.command_path)}\\fR "
                      + roff_text(" ".join(sub.collect_usage_pieces(sub_ctx)))]
            lines += roff_paragraphs(sub.help or "") + options_roff(sub, sub_ctx)
    lines += see_also([PROG])
    return "\n".join(lines) + "\n"


def see_also(pages: list[str]) -> list[str]:
    refs = [f"\\fB{roff_text(page)}\\fR({SECTION})" for page in pages]
    refs += ["\\fBnbdkit\\fR(1)", "\\fBveritysetup\\fR(8)", "\\fBnbd\\-client\\fR(8)"]
    return [".SH SEE ALSO", ",\n".join(refs)]


def write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.rename(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def pages(version: str, date: str) -> dict[str, str]:
    """File name -> roff text of every page."""
    from nbd_verity.cli import main
    ctx = click.Context(main, info_name=PROG)
    out = {f"{PROG}.{SECTION}": group_page(main, version, date)}
    for name in main.list_commands(ctx):
        out[f"{PROG}-{name}.{SECTION}"] = command_page(main, name, version, date)
    return out


def build_date() -> str:
    """The date of the release (SOURCE_DATE_EPOCH, as dpkg sets it from debian/changelog),
    so a rebuild writes the same pages."""
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH") or time.time())
    return time.strftime("%Y-%m-%d", time.gmtime(epoch))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: manpages.py OUTDIR", file=sys.stderr)
        return 2
    out = Path(argv[1])
    if not out.is_dir():
        print(f"manpages.py: {out}: not a directory", file=sys.stderr)
        return 1
    from importlib.metadata import version
    for name, text in pages(version("nbd-verity"), build_date()).items():
        write_atomically(out / name, text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
