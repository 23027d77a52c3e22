"""The demo's FEC steps: write Reed-Solomon parity beside the tree, then serve a copy
with a destroyed data block and read that block back intact, the repair counted."""

from __future__ import annotations

import random
import shutil

from .serving import nbd_connect, served_with
from .walkthrough import CORRUPT_DATA_BLOCK, StepFailed, Walkthrough

FEC_HASH, FEC = "fec-data.hash", "data.fec"


def format_with_fec(w: Walkthrough) -> None:
    """Format again with --fec-device: the same tree, plus parity that can repair it."""
    (w.workdir / FEC_HASH).unlink(missing_ok=True)
    (w.workdir / FEC).unlink(missing_ok=True)
    done = w.run("format", w.data.name, FEC_HASH, "--fec-device", FEC, "--fec-roots", "2",
                 *_same_salt(w))
    w.expect_in(f"Root hash:      \t{w.root}", done.stdout)
    w.expect_in("FEC RS roots:   \t2", done.stdout)
    size = (w.workdir / FEC).stat().st_size
    w.say(f"{FEC}: {size} bytes of parity, {100 * size / w.data.stat().st_size:.1f}% of "
          f"the data (roots/255 of data and tree)")


def _same_salt(w: Walkthrough) -> list[str]:
    """The salt and UUID the offline steps formatted with: the same root hash."""
    from .offline import SALT, UUID
    return [f"--salt={SALT}", f"--uuid={UUID}"]


def serve_repaired(w: Walkthrough) -> None:
    """Serve a copy with a destroyed data block and --fec-device: it reads back intact.

    verify --fec-device says it is repairable; `ctl stats` counts the repair
    (fec_corrected), and the status stays V: only what FEC cannot repair is corruption."""
    copy = w.workdir / "fec-damaged.img"
    shutil.copyfile(w.data, copy)
    offset = CORRUPT_DATA_BLOCK * 4096
    with open(copy, "r+b") as f:
        f.seek(offset)
        f.write(random.Random(7).randbytes(4096))
    w.say(f"overwrote data block {CORRUPT_DATA_BLOCK} of {copy.name} with random bytes")
    try:
        w.run("verify", copy.name, FEC_HASH, w.root, "--fec-device", FEC)
        args = [copy.name, FEC_HASH, w.root, "--fec-device", FEC]
        with served_with(w, "fec", args) as (sock, ctl):
            h = nbd_connect(sock)
            got = h.pread(4096, offset)
            h.shutdown()
            with open(w.data, "rb") as f:
                f.seek(offset)
                if got != f.read(4096):
                    raise StepFailed(f"data block {CORRUPT_DATA_BLOCK} was not repaired")
            w.say(f"read data block {CORRUPT_DATA_BLOCK}: the original bytes")
            done = w.run("ctl", "--control", ctl.name, "stats")
            w.expect_in("fec_corrected 1", done.stdout)
            done = w.run("ctl", "--control", ctl.name, "status")
            w.expect_in("V", done.stdout.split()[0])
    finally:
        copy.unlink(missing_ok=True)


STEPS = (format_with_fec, serve_repaired)
