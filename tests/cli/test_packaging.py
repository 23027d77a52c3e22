"""What the Debian package is made of, checked in the checkout (make test-deb builds and
installs the package itself): the man pages written from the click commands, the one
version that debian/changelog and the project name, and the units' one substitution."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import click
import pytest

from nbd_verity.cli import main

TOP = Path(__file__).resolve().parents[2]
DEBIAN = TOP / "debian"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, DEBIAN / f"{name.replace('_', '-')}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("man")
    done = subprocess.run([sys.executable, str(DEBIAN / "manpages.py"), str(out)],
                          capture_output=True, text=True)
    assert (done.returncode, done.stderr) == (0, "")
    return {path.name: path.read_text() for path in out.iterdir()}


def test_one_page_per_command(pages):
    ctx = click.Context(main, info_name="nbd-verity")
    expected = {"nbd-verity.8"} | {f"nbd-verity-{name}.8" for name in main.list_commands(ctx)}
    assert set(pages) == expected


def test_every_option_of_every_command_is_on_its_page(pages):
    parent = click.Context(main, info_name="nbd-verity")
    for name in main.list_commands(parent):
        command = main.get_command(parent, name)
        ctx = click.Context(command, info_name=name, parent=parent)
        commands = [(command, ctx)]
        if isinstance(command, click.Group):
            commands += [(sub, click.Context(sub, info_name=sub_name, parent=ctx))
                         for sub_name, sub in ((n, command.get_command(ctx, n))
                                               for n in command.list_commands(ctx))]
        page = pages[f"nbd-verity-{name}.8"].replace("\\-", "-")
        for cmd, cmd_ctx in commands:
            for param in cmd.get_params(cmd_ctx):
                if isinstance(param, click.Option):
                    for opt in param.opts:
                        assert opt in page, f"{name}: {opt} missing"


def test_page_has_no_bare_control_lines(pages):
    """A help line that starts with '.' or "'" would be read as a roff request."""
    for name, text in pages.items():
        for line in text.splitlines():
            if line.startswith((".", "'")):
                assert line.split()[0] in {".TH", ".SH", ".SS", ".PP", ".TP", ".nf", ".fi"}, \
                    (name, line)


def test_pages_render_without_warnings(pages, tmp_path: Path):
    for name, text in pages.items():
        (tmp_path / name).write_text(text)
        out = subprocess.run(["groff", "-man", "-ww", "-z", str(tmp_path / name)],
                             capture_output=True, text=True)
        assert (out.returncode, out.stderr) == (0, ""), name


def test_manpages_rejects_a_missing_folder(tmp_path: Path):
    done = subprocess.run([sys.executable, str(DEBIAN / "manpages.py"), str(tmp_path / "no")],
                          capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr == f"manpages.py: {tmp_path / 'no'}: not a directory\n"


def test_changelog_names_the_project_version():
    found = load("check_version").versions()
    assert len(set(found.values())) == 1, found


def test_rules_substitute_only_the_command_path():
    """debian/rules turns the checkout's units into the package's with one sed of the
    path tests/test_systemd.py checks the checkout's units name."""
    rules = (DEBIAN / "rules").read_text()
    assert "CHECKOUT_BIN := /usr/local/bin/nbd-verity" in rules
    assert "PACKAGE_BIN := /usr/bin/nbd-verity" in rules
    assert rules.count("$(CHECKOUT_BIN)") == 1
