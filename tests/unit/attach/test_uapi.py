"""attach's kernel numbers against the kernel's own headers (Debian's linux-libc-dev).

The headers are the oracle: their enums and #defines are parsed here (an enum's members
count up from 0 or from their last explicit value; a #define is evaluated from the
numbers and names it is made of), and every constant nbd_verity.attach.uapi takes from
them must have the header's value. A missing header fails the test: linux-libc-dev comes
with gcc, which every build of this project has.
"""

from __future__ import annotations

import ast
import glob
import re
from pathlib import Path

import pytest

from nbd_verity.attach import uapi

INCLUDE = Path("/usr/include")
NBD_NETLINK_H = INCLUDE / "linux" / "nbd-netlink.h"
NBD_H = INCLUDE / "linux" / "nbd.h"
NETLINK_H = INCLUDE / "linux" / "netlink.h"
GENETLINK_H = INCLUDE / "linux" / "genetlink.h"
# SOL_NETLINK is glibc's (bits/socket.h), in the multiarch folder on Debian.
BITS_SOCKET_H = sorted(glob.glob(str(INCLUDE / "*" / "bits" / "socket.h"))
                       + glob.glob(str(INCLUDE / "bits" / "socket.h")))

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)
_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)\b(?!\()[ \t]*(.*)$",
                     re.MULTILINE)  # object-like only: NAME( is a function-like macro
_ENUM = re.compile(r"\benum\b\s*\w*\s*\{(.*?)\}", re.DOTALL)
_TOKEN = re.compile(r"\s*(0[xX][0-9a-fA-F]+|\d+|[A-Za-z_]\w*|<<|>>|[-+|&~()*])[uUlL]*")
_ALLOWED = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.BitOr, ast.BitAnd,
            ast.LShift, ast.RShift, ast.Add, ast.Sub, ast.Mult, ast.Invert, ast.USub)


class Header:
    """The enum members and object-like #defines of some C headers, evaluated on demand."""

    def __init__(self, *paths: Path) -> None:
        self.raw: dict[str, str] = {}  # NAME: its expression as written
        self.enums: list[list[str]] = []  # each enum's member names, in order
        self._values: dict[str, int | str] = {}
        for path in paths:
            if not path.is_file():
                pytest.fail(f"{path}: missing; it is the oracle of this test "
                            f"(apt-get install linux-libc-dev, which gcc pulls in)")
            self._read(_COMMENT.sub(" ", path.read_text().replace("\\\n", " ")))

    def _read(self, text: str) -> None:
        for name, expr in _DEFINE.findall(text):
            self.raw.setdefault(name, expr.strip())
        for body in _ENUM.findall(text):
            members, following = [], "0"
            for item in filter(None, (i.strip() for i in body.split(","))):
                name, _, expr = (part.strip() for part in item.partition("="))
                value = expr or following
                self.raw[name] = value
                following = f"({name}) + 1"
                members.append(name)
            self.enums.append(members)

    def __contains__(self, name: str) -> bool:
        return name in self.raw

    def __getitem__(self, name: str) -> int | str:
        if name not in self._values:
            self._values[name] = self._evaluate(self.raw[name], {name})
        return self._values[name]

    def _evaluate(self, expr: str, seen: set[str]) -> int | str:
        string = re.fullmatch(r'"([^"\\]*)"', expr)
        if string:
            return string.group(1)
        python, pos = [], 0
        while pos < len(expr):
            match = _TOKEN.match(expr, pos)
            assert match, f"cannot read {expr!r} at {expr[pos:]!r}"
            token, pos = match.group(1), match.end()
            if token[0].isalpha() or token[0] == "_":
                assert token not in seen, f"{token} is defined by itself"
                value = self._evaluate(self.raw[token], seen | {token})
                token = str(value)
            elif token[0].isdigit():
                token = str(int(token, 0))
            python.append(token)
        tree = ast.parse(" ".join(python), mode="eval")
        for node in ast.walk(tree):
            assert isinstance(node, _ALLOWED), f"{expr!r}: {type(node).__name__}"
        return eval(compile(tree, "<header>", "eval"), {"__builtins__": {}})

    def enum_of(self, member: str) -> list[str]:
        """The members of the enum that holds member."""
        for members in self.enums:
            if member in members:
                return members
        raise AssertionError(f"no enum holds {member}")


@pytest.fixture(scope="module")
def nbd_netlink() -> Header:
    return Header(NBD_NETLINK_H)


@pytest.fixture(scope="module")
def nbd_h() -> Header:
    return Header(NBD_H)


@pytest.fixture(scope="module")
def genl_h() -> Header:
    if not BITS_SOCKET_H:
        pytest.fail(f"no bits/socket.h under {INCLUDE} (apt-get install libc6-dev)")
    return Header(NETLINK_H, GENETLINK_H, Path(BITS_SOCKET_H[0]))


def uapi_names(*prefixes: str) -> list[str]:
    return sorted(n for n in vars(uapi) if n.startswith(prefixes) and n.isupper())


# -- the parser itself, on what it reads ------------------------------------------------

def test_the_parser_reads_enums_and_composite_defines(genl_h, nbd_netlink):
    """Known values from the headers themselves, so a parser bug shows as itself."""
    assert nbd_netlink["NBD_ATTR_UNSPEC"] == 0
    assert nbd_netlink["NBD_ATTR_MAX"] == nbd_netlink["__NBD_ATTR_MAX"] - 1
    assert genl_h["NLM_F_DUMP"] == genl_h["NLM_F_ROOT"] | genl_h["NLM_F_MATCH"]
    assert genl_h["NLA_F_NESTED"] == 1 << 15
    assert genl_h["GENL_ID_CTRL"] == genl_h["NLMSG_MIN_TYPE"]
    assert genl_h["CTRL_ATTR_POLICY_DUMP_MAX"] == genl_h["__CTRL_ATTR_POLICY_DUMP_MAX"] - 1


# -- linux/nbd-netlink.h ------------------------------------------------------------------

NETLINK_PREFIXES = ("NBD_ATTR_", "NBD_DEVICE_", "NBD_SOCK_", "NBD_GENL_")
NETLINK_COMMANDS = ("NBD_CMD_CONNECT", "NBD_CMD_DISCONNECT", "NBD_CMD_RECONFIGURE",
                    "NBD_CMD_LINK_DEAD", "NBD_CMD_STATUS")


def test_every_nbd_netlink_constant_is_the_headers(nbd_netlink):
    names = uapi_names(*NETLINK_PREFIXES) + list(NETLINK_COMMANDS)
    assert len(names) >= 22, names  # 10 attributes, 4 device/socket, 3 family, 5 commands
    absent = [n for n in names if n not in nbd_netlink]
    assert not absent, f"not in linux/nbd-netlink.h: {absent}"
    wrong = {n: (getattr(uapi, n), nbd_netlink[n]) for n in names
             if getattr(uapi, n) != nbd_netlink[n]}
    assert not wrong, f"uapi value vs linux/nbd-netlink.h: {wrong}"


def test_every_attribute_the_header_has_is_known(nbd_netlink):
    """NBD_ATTR_* 1..MAX all in uapi (a renumbered or inserted attribute shows here)."""
    members = nbd_netlink.enum_of("NBD_ATTR_INDEX")
    named = [m for m in members if not m.startswith("__") and not m.endswith("_UNSPEC")]
    assert [getattr(uapi, m, None) for m in named] == [nbd_netlink[m] for m in named]


def test_the_netlink_commands_are_the_netlink_enums(nbd_netlink, nbd_h):
    """uapi holds two NBD_CMD_* families: the netlink commands and the protocol's
    NBD_CMD_DISC (linux/nbd.h). Each name belongs to exactly one header's enum."""
    netlink_cmds = set(nbd_netlink.enum_of("NBD_CMD_CONNECT"))
    protocol_cmds = set(nbd_h.enum_of("NBD_CMD_READ"))
    for name in uapi_names("NBD_CMD_"):
        assert (name in netlink_cmds) != (name in protocol_cmds), name
        header = nbd_netlink if name in netlink_cmds else nbd_h
        assert getattr(uapi, name) == header[name], name
    assert set(NETLINK_COMMANDS) <= netlink_cmds


# -- linux/nbd.h --------------------------------------------------------------------------

NBD_H_NAMES = ("NBD_FLAG_HAS_FLAGS", "NBD_FLAG_READ_ONLY", "NBD_FLAG_CAN_MULTI_CONN",
               "NBD_REQUEST_MAGIC", "NBD_CMD_DISC")


@pytest.mark.parametrize("name", NBD_H_NAMES)
def test_nbd_h_constant(nbd_h, name):
    assert getattr(uapi, name) == nbd_h[name], f"uapi {name} vs linux/nbd.h"


def test_uapi_flags_the_kernel_header_has_agree(nbd_h):
    """The transmission flags uapi shares with linux/nbd.h (the rest are handshake flags
    of proto.md, which the kernel's header does not carry)."""
    shared = [n for n in uapi_names("NBD_FLAG_") if n in nbd_h]
    assert set(NBD_H_NAMES) - {"NBD_REQUEST_MAGIC", "NBD_CMD_DISC"} <= set(shared)
    assert {n: getattr(uapi, n) for n in shared} == {n: nbd_h[n] for n in shared}


# -- linux/netlink.h, linux/genetlink.h, bits/socket.h --------------------------------------

GENL_NAMES = ("NETLINK_GENERIC", "SOL_NETLINK", "NETLINK_ADD_MEMBERSHIP", "NLM_F_REQUEST",
              "NLM_F_ACK", "NLM_F_DUMP", "NLMSG_ERROR", "NLMSG_DONE", "NLA_F_NESTED",
              "GENL_ID_CTRL", "CTRL_CMD_GETFAMILY", "CTRL_ATTR_FAMILY_ID",
              "CTRL_ATTR_FAMILY_NAME", "CTRL_ATTR_MCAST_GROUPS", "CTRL_ATTR_MCAST_GRP_NAME",
              "CTRL_ATTR_MCAST_GRP_ID")


@pytest.mark.parametrize("name", GENL_NAMES)
def test_genl_constant(genl_h, name):
    assert name in genl_h, f"{name} is in none of the netlink headers"
    assert getattr(uapi, name) == genl_h[name], f"uapi {name} vs the headers"


def test_no_genl_constant_goes_unchecked():
    checked = set(GENL_NAMES)
    names = uapi_names("NETLINK_", "SOL_", "NLM_", "NLMSG_", "NLA_", "GENL_ID", "CTRL_")
    assert set(names) <= checked, sorted(set(names) - checked)
