"""Random geometries against veritysetup (hypothesis; few examples, each runs 3 commands).

Any combination of format, algorithm, block sizes, block count, salt, superblock and hash
offset must give the same root and the same hash image bytes as veritysetup, and
veritysetup must accept our tree.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nbd_verity.format.digest import supported_algorithms


@st.composite
def geometries(draw) -> tuple[int, list[str], str]:
    """(data size, format options, salt hex) for one random layout."""
    dbs = draw(st.sampled_from([512, 1024, 2048, 4096, 8192]))
    hbs = draw(st.sampled_from([512, 1024, 2048, 4096, 8192]))
    blocks = draw(st.integers(1, 600))
    tail = draw(st.sampled_from([0, 0, 0, 1, dbs - 1]))
    salt = draw(st.binary(max_size=256)).hex() or "-"
    options = [f"--data-block-size={dbs}", f"--hash-block-size={hbs}",
               f"--hash={draw(st.sampled_from(supported_algorithms()))}",
               f"--format={draw(st.sampled_from([0, 1]))}"]
    superblock = draw(st.booleans())
    if not superblock:
        options.append("--no-superblock")
    hashed = blocks
    if draw(st.booleans()) and blocks > 1:
        hashed = draw(st.integers(1, blocks))
        options.append(f"--data-blocks={hashed}")
    offset = draw(st.sampled_from([0, 512 * draw(st.integers(0, 40))]))
    # veritysetup 2.6.1 fails ("Error during update of verity header") to write a
    # superblock that no tree follows (one data block) at an offset not aligned to
    # min(hash block size, 4096): it writes that whole block and reads it first.
    if superblock and hashed == 1 and offset % min(hbs, 4096):
        offset = 0
    if offset:
        options.append(f"--hash-offset={offset}")
    return blocks * dbs + tail, options, salt


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(geometry=geometries(), seed=st.integers(0, 2**16))
def test_random_geometry_matches_veritysetup(tools, geometry, seed):
    size, options, salt = geometry
    common = [*options, f"--salt={salt}", f"--uuid={tools.uuid}"]
    with tempfile.TemporaryDirectory() as tmp:
        data = tools.write_image(Path(tmp, "data"), size, seed)
        theirs, ours = Path(tmp, "theirs"), Path(tmp, "ours")
        their_run = tools.theirs("format", data, theirs, *common)
        our_run = tools.ours("format", data, ours, *common)
        assert their_run.returncode == 0, their_run.stderr
        assert our_run.returncode == 0, our_run.stderr
        root = tools.root_hash(their_run.stdout)
        assert tools.root_hash(our_run.stdout) == root
        assert ours.read_bytes() == theirs.read_bytes()
        sb = "--no-superblock" not in options
        verify_options = [o for o in common if o.startswith("--hash-offset") or (
            not sb and not o.startswith("--uuid"))]
        check = tools.theirs("verify", data, ours, root, *verify_options)
        assert check.returncode == 0, check.stderr
