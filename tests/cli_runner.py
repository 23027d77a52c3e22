"""click's in-process runner with stderr kept apart from stdout, on either click: 8.1
(Debian 12's python3-click, which the venv takes when it is installed) mixes them unless
told, 8.2 on always keeps them apart and has no such argument."""

from __future__ import annotations

import inspect

from click.testing import CliRunner


def cli_runner() -> CliRunner:
    if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters:
        return CliRunner(mix_stderr=False)
    return CliRunner()
