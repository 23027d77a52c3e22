"""The demo's step machinery: a misbehaving step stops the walkthrough and fails it.
(tests/test_demo.py runs the whole walkthrough.)"""

from __future__ import annotations

from nbd_verity import demo


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
