"""The FEC codec and geometry: known parameters, both codecs against reedsolo and each
other, corrections up to the code's limits and refusals past them."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import reedsolo  # the oracle codec (test extra): a missing oracle fails, never skips
from hypothesis import given, settings
from hypothesis import strategies as st

from nbd_verity.errors import ConfigError
from nbd_verity.fec import layout as fec
from nbd_verity.fec import rs
from nbd_verity.format.params import VerityParams

CODECS = [pytest.param((rs.py_encode, rs.py_decode), id="python")]
if rs.NATIVE:
    from nbd_verity.fec import _rs
    CODECS.append(pytest.param((_rs.encode, _rs.decode), id="native"))


def rows_of(roots: int, width: int, seed: int) -> list[bytes]:
    rnd = random.Random(seed)
    return [rnd.randbytes(width) for _ in range(255 - roots)]


def test_native_codec_is_built():
    """make setup compiles it; without it format is far too slow for the issue's target."""
    assert rs.NATIVE


@pytest.mark.parametrize("roots", [2, 3, 8, 24])
@pytest.mark.parametrize("codec", CODECS)
def test_encode_matches_reedsolo(codec, roots):
    """reedsolo with prim 0x11d, generator 2, fcr 0 is the code the kernel builds with
    init_rs(8, 0x11d, 0, 1, roots) (nbd_verity/fec/_rs.c's header): the oracle."""
    encode, _ = codec
    reedsolo.init_tables(prim=0x11D, generator=2, c_exp=8)
    rows = rows_of(roots, 40, roots)
    parity = encode(roots, rows, 40)
    for c in range(40):
        word = reedsolo.rs_encode_msg(bytes(r[c] for r in rows), roots, fcr=0, generator=2)
        assert bytes(word[255 - roots:]) == parity[c * roots:(c + 1) * roots]


@pytest.mark.parametrize("roots", [2, 3, 8, 24])
@pytest.mark.parametrize("codec", CODECS)
def test_corrects_up_to_half_roots_errors(codec, roots):
    encode, decode = codec
    rnd = random.Random(roots)
    rows = rows_of(roots, 24, roots + 1)
    parity = encode(roots, rows, 24)
    bad = [bytearray(r) for r in rows]
    for c in range(24):
        for pos in rnd.sample(range(255 - roots), roots // 2):
            bad[pos][c] ^= rnd.randrange(1, 256)
    for target in (0, 100, 254 - roots):
        corrected, failed, row = decode(roots, bad, parity, [], target)
        assert (failed, row) == (0, rows[target])
        assert corrected == 24 * (roots // 2)


@pytest.mark.parametrize("erasures, target, message", [
    (list(range(256)), 0, "256 erasures, at most 255"),
    ([3, 7, 3], 0, "erasure 3 is given twice"),
    ([-1], 0, r"erasure -1 is outside 0\.\.246"),
    ([-2], 0, r"erasure -2 is outside 0\.\.246"),
    ([247], 0, r"erasure 247 is outside 0\.\.246"),
    ([], -2, "target or parity length out of range"),
])
@pytest.mark.parametrize("codec", CODECS)
def test_bad_erasure_lists_are_refused_not_dropped(codec, erasures, target, message):
    """Both codecs refuse a list no caller should build instead of decoding with part
    of it; -1 is a target (no row), never an erasure."""
    encode, decode = codec
    rows = rows_of(8, 4, 1)
    with pytest.raises(ValueError, match=message):
        decode(8, rows, encode(8, rows, 4), erasures, target)


@pytest.mark.parametrize("roots", [2, 3, 8, 24])
@pytest.mark.parametrize("codec", CODECS)
def test_erasures_up_to_roots(codec, roots):
    """roots whole rows replaced: rebuilt when their positions are given, never beyond."""
    encode, decode = codec
    rnd = random.Random(roots)
    rows = rows_of(roots, 16, roots + 2)
    parity = encode(roots, rows, 16)
    lost = sorted(rnd.sample(range(255 - roots), roots + 1))
    bad = [bytearray(r) for r in rows]
    for pos in lost:
        bad[pos] = bytearray(rnd.randbytes(16))
    fixable = list(bad)
    fixable[lost[roots]] = rows[lost[roots]]  # roots rows lost: exactly what erasures fix
    for pos in lost[:roots]:
        _, failed, row = decode(roots, fixable, parity, lost[:roots], pos)
        assert (failed, row) == (0, rows[pos])
    _, failed, _ = decode(roots, bad, parity, lost, lost[0])
    assert failed == 16


@settings(max_examples=30, deadline=None)
@given(roots=st.integers(2, 24), seed=st.integers(0, 2**32), errors=st.integers(0, 6),
       erasures=st.integers(0, 6))
def test_native_and_python_decoders_agree(roots, seed, errors, erasures):
    """Both decoders give the same answer, past the limits too (where they may miscorrect)."""
    if not rs.NATIVE:
        pytest.skip("no native codec to compare")
    rnd = random.Random(seed)
    rows = rows_of(roots, 8, seed)
    parity = _rs.encode(roots, rows, 8)
    bad = [bytearray(r) for r in rows]
    hit = rnd.sample(range(255 - roots), errors + erasures)
    for pos in hit:
        bad[pos] = bytearray(rnd.randbytes(8))
    given_erasures = sorted(hit[:erasures])
    assert _rs.decode(roots, bad, parity, given_erasures, hit[0] if hit else 0) == \
        rs.py_decode(roots, bad, parity, given_erasures, hit[0] if hit else 0)


def params(blocks: int = 768, bs: int = 4096, **kw) -> VerityParams:
    return VerityParams(data_blocks=blocks, data_block_size=bs, hash_block_size=bs, **kw)


def test_geometry_of_spec_example():
    """768 data blocks and an 8-block hash file give fec_blocks 775; roots 7 gives rsn 248,
    4 rounds, 28 parity blocks (veritysetup format --fec-roots 7: "FEC blocks: 28")."""
    geo = fec.FecGeometry.from_params(params(), 7, 8 * 4096)
    assert (geo.fec_blocks, geo.rsn, geo.rounds, geo.parity_blocks) == (775, 248, 4, 28)
    assert geo.dump_lines() == ["FEC RS roots:   \t7", "FEC blocks:     \t28"]
    assert geo.locate(5) == (1, 1) and list(geo.group(1))[:3] == [1, 5, 9]
    assert geo.source_run(760, 20) == ("data", 760, 8)
    assert geo.source_run(768, 20) == ("hash", 1, 7)
    assert geo.source_run(775, 20) == (None, 0, 20)
    assert geo.index_of_hash_block(7) == 774
    assert geo.parity_span(3) == (3 * 4096 * 7, 4096 * 7)


def test_geometry_on_hash_device_ends_at_fec_offset():
    geo = fec.FecGeometry.from_params(params(), 2, 100 * 4096, 8 * 4096, on_hash_device=True)
    assert geo.fec_blocks == 775 and geo.fec_offset == 8 * 4096


@pytest.mark.parametrize(("kw", "message"), [
    ({"roots": 1}, "fec-roots: 1 is outside 2..24"),
    ({"roots": 25}, "fec-roots: 25 is outside 2..24"),
    ({"fec_offset": 1000}, "fec-offset: 1000 is not a multiple of 512"),
    ({"fec_offset": 4096, "on_hash_device": True}, "fec-offset: 4096 is inside the hash tree"),
])
def test_geometry_refuses(kw, message):
    args = {"roots": 2, "hash_image_size": 8 * 4096, **kw}
    with pytest.raises(ConfigError, match=message):
        fec.FecGeometry.from_params(params(), **args)


def test_geometry_refuses_different_block_sizes():
    p = VerityParams(data_blocks=768, data_block_size=4096, hash_block_size=1024)
    with pytest.raises(ConfigError, match="Block sizes must match for FEC"):
        fec.FecGeometry.from_params(p, 2, 1 << 20)


def test_decode_block_needs_the_digest_to_match():
    """A group rebuilt from bad erasure hints is refused by check, as the kernel does."""
    geo = fec.FecGeometry.from_params(params(blocks=600, bs=512), 2, 43 * 512)
    rnd = random.Random(5)
    group = [rnd.randbytes(512) for _ in range(geo.rsn)]
    parity = rs.encode(2, group, 512)
    index = geo.group(0)[3]
    bad = list(group)
    bad[3] = rnd.randbytes(512)
    assert fec.decode_block(geo, index, bad, parity) == group[3]  # errors-only suffices
    bad[7] = rnd.randbytes(512)
    good = group[3]
    assert fec.decode_block(geo, index, bad, parity, {3, 7}, lambda b: b == good) == good
    assert fec.decode_block(geo, index, bad, parity, {3, 8}, lambda b: b == good) is None
    bad[9] = None  # unreadable: an erasure too, one more than roots
    assert fec.decode_block(geo, index, bad, parity, {3, 7}, lambda b: b == good) is None


def test_scalar_and_vector_encoders_agree():
    """NBD_VERITY_RS_SCALAR=1 forces the table-lookup path the AVX2 path replaces."""
    if not rs.NATIVE:
        pytest.skip("no native codec")
    code = ("import random, sys; from nbd_verity.fec import _rs\n"
            "for roots in (2, 3, 8, 24):\n"
            "    rnd = random.Random(roots)\n"
            "    rows = [rnd.randbytes(1000) for _ in range(255 - roots)]\n"
            "    sys.stdout.write(_rs.encode(roots, rows, 1000).hex())\n")
    outputs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True, env={**os.environ, **extra}).stdout
               for extra in ({}, {"NBD_VERITY_RS_SCALAR": "1"})]
    assert outputs[0] == outputs[1] and len(outputs[0]) > 0
