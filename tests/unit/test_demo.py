"""The `make demo` walkthrough: it succeeds end to end, and a misbehaving step fails it."""

from __future__ import annotations

import subprocess
import sys

from nbd_verity import demo


def test_demo_runs_every_step(tmp_path):
    run = subprocess.run([sys.executable, "-m", "nbd_verity.demo", str(tmp_path / "demo")],
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"demo OK: {len(demo.STEPS)} steps behaved as expected" in run.stdout
    assert "$ nbd-verity verify data.img data.hash " in run.stdout
    assert "data block 12345 is corrupted" in run.stdout


def test_a_step_that_misbehaves_fails_the_demo(tmp_path, monkeypatch, capsys):
    def expects_corruption(w: demo.Walkthrough) -> None:
        """Verify must fail here, but the image is intact."""
        w.run("verify", w.data.name, w.hash.name, w.root, expect=1)

    monkeypatch.setattr(demo, "STEPS", [demo.make_image, demo.format_image,
                                        expects_corruption, demo.verify_image])
    assert demo.main([str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert "== 3. Verify must fail here" in out.out
    assert "demo FAILED: `nbd-verity verify data.img data.hash" in out.err
    assert "exited 0, expected 1" in out.err
    assert "== 4." not in out.out  # the demo stops at the first failure


def test_usage(capsys):
    assert demo.main([]) == 2
    assert "usage: python -m nbd_verity.demo WORKDIR" in capsys.readouterr().err
