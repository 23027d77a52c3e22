"""The Reed-Solomon codec of dm-verity FEC: the C extension, or pure Python without it.

RS(255, 255 - roots) over GF(2^8) with field polynomial 0x11d, generator roots alpha^0 ..
alpha^(roots-1) (fcr 0, prim 1): the kernel's init_rs(8, 0x11d, 0, 1, roots) and
cryptsetup's init_rs_char(8, 0x11d, 0, 1, roots, 0). Both codecs take the interleaved
form dm-verity stores: rows[i] is message symbol i of every codeword (one per column),
and parity is laid out codeword after codeword, `roots` bytes each.

    encode(roots, rows, width) -> parity bytes (width * roots)
    decode(roots, rows, parity, erasures, target) -> (corrected, failed, row or None)

The pure-Python codec works a whole row at a time (bytes.translate multiplies a row by a
constant, int XOR adds two rows), so it is slow but usable; only columns whose syndromes
are not zero go through the per-codeword decoder. Tests use it as the reference.
"""

from __future__ import annotations

from collections.abc import Sequence

NN = 255
PRIM_POLY = 0x11d


def _tables() -> tuple[list[int], list[int]]:
    exp, log = [0] * (2 * NN), [0] * 256
    x = 1
    for i in range(NN):
        exp[i] = exp[i + NN] = x
        log[x] = i
        x <<= 1
        if x & 0x100:
            x ^= PRIM_POLY
    return exp, log


EXP, LOG = _tables()


def gf_mul(a: int, b: int) -> int:
    return EXP[LOG[a] + LOG[b]] if a and b else 0


def gf_inv(a: int) -> int:
    return EXP[NN - LOG[a]]


def _row_table(c: int) -> bytes:
    """The 256-byte table that multiplies every byte of a row by c (for bytes.translate)."""
    return bytes(gf_mul(c, x) for x in range(256))


def generator(roots: int) -> list[int]:
    """prod_{i<roots} (x + alpha^i); coefficient of x^j at index j, monic."""
    gen = [1] + [0] * roots
    for i in range(roots):
        root = EXP[i]
        for j in range(i + 1, 0, -1):
            gen[j] = gen[j - 1] ^ gf_mul(gen[j], root)
        gen[0] = gf_mul(gen[0], root)
    return gen


def _xor(a: bytes, b: bytes) -> bytes:
    n = len(a)
    return (int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).to_bytes(n, "little")


def py_encode(roots: int, rows: Sequence, width: int) -> bytes:
    """Parity of every column, one LFSR step per row (encode_rs.c, vectorised)."""
    gen = generator(roots)
    tables = [_row_table(g) for g in gen]
    par = [bytes(width)] * roots
    for i in range(NN - roots):
        fb = _xor(bytes(rows[i][:width]), par[0])
        par = [_xor(par[j + 1], fb.translate(tables[roots - 1 - j]))
               for j in range(roots - 1)] + [fb.translate(tables[0])]
    out = bytearray(width * roots)
    for j in range(roots):
        out[j::roots] = par[j]
    return bytes(out)


def decode_codeword(roots: int, cw: bytearray, erasures: Sequence[int] = ()) -> int:
    """Correct cw (255 symbols, message first) in place; return the symbols corrected,
    or -1 when it cannot be decoded. Berlekamp-Massey with erasures, Chien, Forney."""
    if len(erasures) > roots:
        return -1
    synd = []
    for i in range(roots):
        acc, a = 0, EXP[i]
        for sym in cw:
            acc = gf_mul(acc, a) ^ sym
        synd.append(acc)
    if not any(synd):
        return 0
    lam = [1] + [0] * roots
    for e, pos in enumerate(erasures):
        x = EXP[NN - 1 - pos]
        for j in range(e + 1, 0, -1):
            lam[j] ^= gf_mul(x, lam[j - 1])
    b, el, s = list(lam), len(erasures), len(erasures)
    for r in range(s + 1, roots + 1):
        d = 0
        for i in range(r):
            d ^= gf_mul(lam[i], synd[r - i - 1])
        if not d:
            b = [0, *b[:-1]]
            continue
        t = [lam[0]] + [lam[i + 1] ^ gf_mul(d, b[i]) for i in range(roots)]
        if 2 * el <= r + s - 1:
            el, di = r + s - el, gf_inv(d)
            b = [gf_mul(x, di) for x in lam]
        else:
            b = [0, *b[:-1]]
        lam = t
    deg = max((i for i, x in enumerate(lam) if x), default=0)
    if deg == 0:
        return -1
    locs = [i for i in range(1, NN + 1)
            if not _eval(lam[:deg + 1], EXP[i % NN])][:deg]
    if len(locs) != deg:
        return -1
    omega = [0] * roots
    for i in range(roots):
        for j in range(min(i, deg) + 1):
            omega[i] ^= gf_mul(synd[i - j], lam[j])
    for i in locs:
        xinv = EXP[i % NN]
        den = _eval([lam[j] if j % 2 else 0 for j in range(1, deg + 1)], xinv)
        if not den:
            return -1
        cw[i - 1] ^= gf_mul(gf_mul(_eval(omega, xinv), EXP[(NN - i) % NN]), gf_inv(den))
    return deg


def _eval(poly: Sequence[int], x: int) -> int:
    """poly (coefficient of x^j at index j) at x."""
    acc = 0
    for c in reversed(poly):
        acc = gf_mul(acc, x) ^ c
    return acc


def check_erasures(erasures: Sequence[int], rsn: int, target: int) -> None:
    """Refuse what _rs.decode refuses, with its messages: more erasures than a codeword
    has symbols, one outside the message, one given twice, a target below -1."""
    if len(erasures) > NN:
        raise ValueError(f"rs: {len(erasures)} erasures, at most {NN}")
    seen = set()
    for pos in erasures:
        if not 0 <= pos < rsn:
            raise ValueError(f"rs: erasure {pos} is outside 0..{rsn - 1}")
        if pos in seen:
            raise ValueError(f"rs: erasure {pos} is given twice")
        seen.add(pos)
    if not -1 <= target < rsn:
        raise ValueError("rs: target or parity length out of range")


def py_decode(roots: int, rows: Sequence, parity: bytes, erasures: Sequence[int],
              target: int) -> tuple[int, int, bytes | None]:
    """Decode every column; the syndromes are computed a row at a time first, and only
    columns with a non-zero syndrome are decoded one by one."""
    width = len(parity) // roots
    rsn = NN - roots
    check_erasures(erasures, rsn, target)
    cols = [bytes(r[:width]) for r in rows] + [bytes(parity[j::roots]) for j in range(roots)]
    dirty = 0
    for i in range(roots):
        table, acc = _row_table(EXP[i]), bytes(width)
        for col in cols:
            acc = _xor(acc.translate(table), col)
        dirty |= int.from_bytes(acc, "little")
    out = bytearray(cols[target]) if target >= 0 else None
    corrected = failed = 0
    for c in range(width):
        if not (dirty >> (8 * c)) & 0xFF:
            continue
        cw = bytearray(col[c] for col in cols)
        n = decode_codeword(roots, cw, sorted(erasures))
        if n < 0:
            failed += 1
        else:
            corrected += n
            if out is not None and target < rsn:
                out[c] = cw[target]
    return corrected, failed, bytes(out) if out is not None else None


try:
    from ._rs import decode, encode
    NATIVE = True
except ImportError:  # built without a compiler: correct, much slower
    encode, decode = py_encode, py_decode
    NATIVE = False
