"""The command line: main.py holds the group, common.py what commands share, and one
module per command family (tree: format/verify/dump; serve; ctl; tune)."""

from .main import main

__all__ = ["main"]
