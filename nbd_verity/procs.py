"""Ending a process we started, by its pid: SIGTERM, then SIGKILL if it hangs."""

from __future__ import annotations

import signal
import subprocess


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> int | None:
    """Stop proc (ours, so its pid is its own) and reap it; return its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
