"""The demo's step machinery: a misbehaving step stops the walkthrough and fails it.
(tests/test_demo.py runs the whole walkthrough.)"""

from __future__ import annotations

from nbd_verity.demo import offline
from nbd_verity.demo.__main__ import main
from nbd_verity.demo.walkthrough import Walkthrough, run_steps


def test_a_step_that_misbehaves_fails_the_demo(tmp_path, capsys):
    def expects_corruption(w: Walkthrough) -> None:
        """Verify must fail here, but the image is intact."""
        w.run("verify", w.data.name, w.hash.name, w.root, expect=1)

    steps = (offline.make_image, offline.format_image, expects_corruption,
             offline.verify_image)
    assert run_steps(steps, [str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert "== 3. Verify must fail here" in out.out
    assert "demo FAILED: `nbd-verity verify data.img data.hash" in out.err
    assert "exited 0, expected 1" in out.err
    assert "== 4." not in out.out  # the demo stops at the first failure


def test_usage(capsys):
    assert main([]) == 2
    assert "usage: python -m nbd_verity.demo WORKDIR" in capsys.readouterr().err
