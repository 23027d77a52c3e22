"""One frozen server configuration, built from nbdkit keys (or `serve`'s options).

Every key is parsed by its own typed function and every problem is reported as
"KEY: problem" (nbdkit's own `unknown parameter: KEY` convention for unknown keys).
`nbd-verity serve` builds the same key list it passes to nbdkit, so the two front ends
cannot drift apart.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .cache import DEFAULT_CACHE_SIZE
from .digest import parse_salt
from .errors import ConfigError
from .verifier import MODES

READAHEAD_MIN_SIZE = 128 << 10  # a request this large triggers Merkle readahead

_SUFFIXES = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(key: str, text: str) -> int:
    """A non-negative size: bytes, or with a K/M/G/T suffix (powers of 1024)."""
    raw = text.strip().lower().removesuffix("ib").removesuffix("i")
    number, suffix = raw, ""
    if raw and raw[-1] in _SUFFIXES:
        number, suffix = raw[:-1], raw[-1]
    try:
        value = int(number) * _SUFFIXES[suffix]
    except ValueError:
        raise ConfigError(f"{key}: {text!r} is not a size") from None
    if value < 0:
        raise ConfigError(f"{key}: {text!r} is negative")
    return value


def parse_int(key: str, text: str, minimum: int = 0) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise ConfigError(f"{key}: {text!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"{key}: {value} is less than {minimum}")
    return value


def parse_bool(key: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{key}: {text!r} is not a boolean (true/false)")


def absolute_file(key: str, text: str) -> str:
    """A path made absolute (nbdkit changes directory to / when it daemonizes)."""
    if not text:
        raise ConfigError(f"{key}: empty path")
    return os.path.abspath(text)


@dataclass(frozen=True)
class ServerConfig:
    """Everything the server needs, validated."""

    data: str
    hash: str
    root_hash: str  # hex, checked against the digest size once params are known
    tree: dict = field(default_factory=dict)  # options for params.load_params
    mode: str = "eio"
    ignore_zero_blocks: bool = False
    check_at_most_once: bool = False
    cache_size: int = DEFAULT_CACHE_SIZE
    readahead: bool = True
    readahead_min_size: int = READAHEAD_MIN_SIZE
    control: str | None = None
    thresholds: dict = field(default_factory=dict)  # class name -> bytes
    threshold_preset: str = "default"
    workers: int = 0  # 0: the number of CPUs
    default_class: str = "be"
    serialize: bool = False


# key -> (ServerConfig field or tree option, parser)
_KEYS = {
    "data": ("data", absolute_file),
    "hash": ("hash", absolute_file),
    "root-hash": ("root_hash", lambda k, v: v.strip()),
    "root-hash-file": ("root_hash_file", absolute_file),
    "hash-offset": ("tree.hash_offset", parse_size),
    "no-superblock": ("tree.no_superblock", parse_bool),
    "format": ("tree.hash_type", lambda k, v: parse_int(k, v)),
    "algorithm": ("tree.algorithm", lambda k, v: v.strip()),
    "salt": ("tree.salt", lambda k, v: _salt(k, v)),
    "data-block-size": ("tree.data_block_size", parse_size),
    "hash-block-size": ("tree.hash_block_size", parse_size),
    "data-blocks": ("tree.data_blocks", lambda k, v: parse_int(k, v, 1)),
    "error-mode": ("mode", lambda k, v: _choice(k, v, MODES)),
    "ignore-zero-blocks": ("ignore_zero_blocks", parse_bool),
    "check-at-most-once": ("check_at_most_once", parse_bool),
    "cache-size": ("cache_size", parse_size),
    "readahead": ("readahead", parse_bool),
    "readahead-min-size": ("readahead_min_size", parse_size),
    "control": ("control", absolute_file),
    "threshold-preset": ("threshold_preset", lambda k, v: v.strip()),
    "workers": ("workers", lambda k, v: parse_int(k, v, 0)),
    "default-class": ("default_class", lambda k, v: v.strip().lower()),
    "serialize": ("serialize", parse_bool),
}


def _salt(key: str, text: str) -> bytes:
    try:
        return parse_salt(text)
    except ConfigError as e:
        raise ConfigError(f"{key}: {str(e).split(': ', 1)[1]}") from None


def _choice(key: str, text: str, choices) -> str:
    if text not in choices:
        raise ConfigError(f"{key}: {text!r} is not one of {', '.join(choices)}")
    return text


class ConfigBuilder:
    """Collects key=value pairs one at a time, then builds a ServerConfig."""

    def __init__(self) -> None:
        self.values: dict = {}
        self.tree: dict = {}
        self.thresholds: dict[str, str] = {}

    def add(self, key: str, value: str) -> None:
        if key == "threshold":  # repeatable: threshold=CLASS=BYTES
            name, sep, amount = value.partition("=")
            if not sep:
                raise ConfigError(f"threshold: {value!r} is not CLASS=BYTES")
            self.thresholds[name.strip().lower()] = amount.strip()
            return
        if key not in _KEYS:
            raise ConfigError(f"unknown parameter: {key}")
        target, parser = _KEYS[key]
        parsed = parser(key, value)
        if target.startswith("tree."):
            self.tree[target[5:]] = parsed
        else:
            self.values[target] = parsed

    def build(self) -> ServerConfig:
        values = dict(self.values)
        for required in ("data", "hash"):
            if required not in values:
                raise ConfigError(f"{required}: missing (give {required}=PATH)")
        root_file = values.pop("root_hash_file", None)
        if root_file is not None:
            if "root_hash" in values:
                raise ConfigError("root-hash-file: give root-hash or root-hash-file, not both")
            try:
                with open(root_file) as f:
                    values["root_hash"] = f.read().strip()
            except OSError as e:
                raise ConfigError(f"root-hash-file: {root_file}: {e.strerror}") from None
        if "root_hash" not in values:
            raise ConfigError("root-hash: missing (give root-hash=HEX or root-hash-file=PATH)")
        return ServerConfig(tree=dict(self.tree), thresholds=dict(self.thresholds), **values)


def config_from_pairs(pairs) -> ServerConfig:
    """Build a config from (key, value) pairs, as nbdkit would pass them."""
    builder = ConfigBuilder()
    for key, value in pairs:
        builder.add(key, value)
    return builder.build()
