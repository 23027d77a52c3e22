"""One frozen server configuration, built from nbdkit keys (or `serve`'s options).

Every key is parsed by its own typed function and every problem is reported as
"KEY: problem" (nbdkit's own `unknown parameter: KEY` convention for unknown keys).
KEYS is the one table of plugin keys; `nbd-verity serve` derives the key list it passes
to nbdkit from it (plugin_pairs), so the two front ends cannot drift apart.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from ..errors import ConfigError
from ..format.digest import parse_salt
from ..format.roothash import root_hash_text
from ..logbound import DEFAULT_LOG_RATE
from ..read.cache import DEFAULT_CACHE_SIZE
from ..read.counters import EIO, MODES, PREFETCH_CLUSTER

READAHEAD_MIN_SIZE = 128 << 10  # a request this large triggers Merkle readahead
# nbdkit thread models by name. AUTO is the default: PARALLEL (a connection's requests
# served together) where the image's reads wait (read over a network, or a local image
# mostly not in the page cache at start-up: sources/resident.py) and nbdkit has neither the
# disconnect race nor a lack of nbdkit.disconnect, SERIALIZE_REQUESTS otherwise (requests
# of one connection in order, connections in parallel, multi-conn advertised). PARALLEL
# can be aborted by a client on nbdkit 1.32.4-1.33.9 (nbd_verity/serve/nbdkit_compat.py).
SERIALIZE_REQUESTS, SERIALIZE_ALL_REQUESTS = "serialize-requests", "serialize-all-requests"
PARALLEL, AUTO = "parallel", "auto"
THREAD_MODELS = (AUTO, SERIALIZE_REQUESTS, SERIALIZE_ALL_REQUESTS, PARALLEL)

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
    """A path made absolute (nbdkit changes directory to / when it daemonizes); a URL
    is refused, never read as a local path under the working directory."""
    if not text:
        raise ConfigError(f"{key}: empty path")
    if "://" in text:
        raise ConfigError(f"{key}: takes a path, not a URL")
    return os.path.abspath(text)


def image_location(key: str, text: str) -> str:
    """An image: an NBD URI (nbd://, nbds://, nbd+unix://) as given, else a path made
    absolute."""
    from ..sources.remote import check_uri, is_uri  # no libnbd import until a URI is opened
    return check_uri(key, text) if is_uri(text) else absolute_file(key, text)


@dataclass(frozen=True)
class ServerConfig:
    """Everything the server needs, validated."""

    data: str
    hash: str | None = None  # None: IMAGE.verity beside the data (trust.root.resolve_root)
    root_hash: str | None = None  # hex, checked against the digest size once params are
    # known; None: IMAGE.roothash beside the data, or a verity.sig's rootHash
    tree: dict = field(default_factory=dict)  # options for params.load_params
    mode: str = EIO
    ignore_zero_blocks: bool = False
    check_at_most_once: bool = False
    cache_size: int = DEFAULT_CACHE_SIZE
    readahead: bool | None = None  # None (auto): on for an NBD hash source, off for a file
    readahead_min_size: int = READAHEAD_MIN_SIZE
    prefetch_cluster: int = PREFETCH_CLUSTER  # level-0 hash bytes a cold read fetches
    control: str | None = None
    thresholds: dict = field(default_factory=dict)  # class name -> bytes
    threshold_preset: str = "default"
    workers: int = 0  # 0: the number of CPUs
    default_class: str = "be"
    serialize: bool = False
    root_hash_signature: str | None = None  # DER PKCS#7, or a verity.sig JSON file
    trusted_certs: str | None = None  # a PEM file or a directory; None: verity.d places
    require_signatures: bool = False  # the kernel's require_signatures: no start unsigned
    thread_model: str = AUTO
    log_rate: int = DEFAULT_LOG_RATE
    fec_device: str | None = None  # Reed-Solomon parity, as veritysetup --fec-device
    fec_roots: int = 2  # veritysetup's default --fec-roots
    fec_offset: int = 0  # bytes into fec_device where the parity starts
    partition: str | None = None  # a DDI: "auto", "root" or "usr" (prepare/disk.py); None:
    # a DDI only if no hash image is given or found and the data starts with a GPT
    source_timeout: float = 60.0  # seconds a connect or read of an NBD source may take
    exports: str | None = None  # a directory of export files: serve them all (exports.py)
    # class name -> the peer uids that may choose it by name (None: every client); a class
    # above the default chosen by name needs this (ioclass.py)
    allow_classes: dict = field(default_factory=dict)
    list_exports: bool = False  # NBD_OPT_LIST answered (nbd-server's allowlist)

    def __post_init__(self) -> None:
        if self.serialize and self.thread_model == PARALLEL:
            raise ConfigError("serialize: true conflicts with thread-model=parallel")

    @property
    def effective_thread_model(self) -> str:
        """serialize=true is serialize-all-requests; otherwise thread-model decides (AUTO
        left for the server to settle: serve/callbacks.py thread_model)."""
        return SERIALIZE_ALL_REQUESTS if self.serialize else self.thread_model

    @property
    def waits(self) -> bool:
        """Whether the image is read over a network (an NBD, HTTP or S3 URL), where a
        read waits and a connection's requests pay to be served together."""
        from ..sources.remote import is_url
        return any(is_url(name) for name in (self.data, self.hash) if name)


def _text(key: str, text: str) -> str:
    return text.strip()


def _salt(key: str, text: str) -> bytes:
    try:
        return parse_salt(text)
    except ConfigError as e:
        raise ConfigError(f"{key}: {str(e).split(': ', 1)[1]}") from None


def _choice(choices):
    def parse(key: str, text: str) -> str:
        if text not in choices:
            raise ConfigError(f"{key}: {text!r} is not one of {', '.join(choices)}")
        return text
    return parse


def _seconds(key: str, text: str) -> float:
    """A positive number of seconds (at most a day)."""
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{key}: {text!r} is not a number of seconds") from None
    if not 0 < value <= 86400:
        raise ConfigError(f"{key}: {text} is outside 0 (exclusive) to 86400 seconds")
    return value


def _threshold(key: str, text: str) -> tuple[str, str]:
    """threshold=CLASS=BYTES (repeatable); the class and size are checked by the Device."""
    name, sep, amount = text.partition("=")
    if not sep:
        raise ConfigError(f"threshold: {text!r} is not CLASS=BYTES")
    return name.strip().lower(), amount.strip()


def _allow_class(key: str, text: str) -> tuple[str, frozenset | None]:
    """allow-class=CLASS or CLASS=UID[,UID...] (repeatable): who may name CLASS."""
    from ..ioclass import class_index
    name, sep, uids = text.partition("=")
    name = name.strip().lower()
    class_index(name, key)
    if not sep:
        return name, None
    try:
        allowed = frozenset(int(uid, 10) for uid in uids.split(","))
    except ValueError:
        raise ConfigError(f"{key}: {text!r} is not CLASS or CLASS=UID[,UID...]") from None
    if any(uid < 0 for uid in allowed):
        raise ConfigError(f"{key}: {text!r}: a uid is not negative")
    return name, allowed


@dataclass(frozen=True)
class Key:
    """One plugin key: where its value goes, how it is parsed, and which `serve` option
    (a click parameter name) feeds it, if any."""

    name: str  # the nbdkit key
    target: str  # a ServerConfig field, or "tree.NAME" for params.load_params
    parse: Callable[[str, str], object]
    option: str | None = None


# Every plugin key, once: nbdkit's config() parses with it and `serve` derives its nbdkit
# argument list from it (plugin_pairs), so the two front ends cannot drift apart.
def explicit_thresholds(config: ServerConfig) -> dict[str, int]:
    """The thresholds given by --threshold (or the key): bytes, with an optional K/M
    suffix; they win over any preset and pin their class."""
    return {name: parse_size(f"threshold {name}", value) if isinstance(value, str) else value
            for name, value in config.thresholds.items()}


KEYS = (
    Key("data", "data", image_location, "data"),
    Key("hash", "hash", image_location, "hash_image"),
    Key("root-hash", "root_hash", _text, "root_hash"),
    Key("root-hash-file", "root_hash_file", absolute_file, "root_hash_file"),
    Key("hash-offset", "tree.hash_offset", parse_size, "hash_offset"),
    Key("no-superblock", "tree.no_superblock", parse_bool, "no_superblock"),
    Key("format", "tree.hash_type", lambda k, v: parse_int(k, v), "hash_type"),
    Key("algorithm", "tree.algorithm", _text, "algorithm"),
    Key("salt", "tree.salt", _salt, "salt"),
    Key("data-block-size", "tree.data_block_size", parse_size, "data_block_size"),
    Key("hash-block-size", "tree.hash_block_size", parse_size, "hash_block_size"),
    Key("data-blocks", "tree.data_blocks", lambda k, v: parse_int(k, v, 1), "data_blocks"),
    Key("error-mode", "mode", _choice(MODES), "error_mode"),
    Key("ignore-zero-blocks", "ignore_zero_blocks", parse_bool, "ignore_zero_blocks"),
    Key("check-at-most-once", "check_at_most_once", parse_bool, "check_at_most_once"),
    Key("cache-size", "cache_size", parse_size, "cache_size"),
    Key("readahead", "readahead", lambda k, v: None if v.strip().lower() == "auto" else
        parse_bool(k, v), "readahead"),
    Key("readahead-min-size", "readahead_min_size", parse_size),
    Key("prefetch-cluster", "prefetch_cluster", parse_size),
    Key("control", "control", absolute_file, "control"),
    Key("threshold", "thresholds", _threshold, "thresholds"),  # repeatable
    Key("threshold-preset", "threshold_preset", _text, "threshold_preset"),
    Key("workers", "workers", lambda k, v: parse_int(k, v, 0), "workers"),
    Key("default-class", "default_class", lambda k, v: v.strip().lower(), "default_class"),
    Key("serialize", "serialize", parse_bool, "serialize"),
    Key("root-hash-signature", "root_hash_signature", absolute_file, "root_hash_signature"),
    Key("trusted-certs", "trusted_certs", absolute_file, "trusted_certs"),
    Key("require-signatures", "require_signatures", parse_bool, "require_signatures"),
    Key("thread-model", "thread_model", _choice(THREAD_MODELS), "thread_model"),
    Key("log-rate", "log_rate", lambda k, v: parse_int(k, v, 0), "log_rate"),
    Key("fec-device", "fec_device", absolute_file, "fec_device"),
    Key("fec-roots", "fec_roots", lambda k, v: parse_int(k, v, 0), "fec_roots"),
    Key("fec-offset", "fec_offset", parse_size, "fec_offset"),
    Key("partition", "partition", _choice(("auto", "root", "usr")), "partition"),
    Key("source-timeout", "source_timeout", _seconds, "source_timeout"),
    Key("exports", "exports", absolute_file, "exports"),
    Key("allow-class", "allow_classes", _allow_class, "allow_classes"),  # repeatable
    Key("list-exports", "list_exports", parse_bool, "list_exports"),
)
_BY_NAME = {key.name: key for key in KEYS}
_DEFAULTS = {f.name: f.default for f in fields(ServerConfig)}


def _render(key: Key, value) -> str:
    """A `serve` option's value as the plugin key's text (paths made absolute)."""
    if key.parse is absolute_file:
        return absolute_file(key.name, value)
    if key.parse is image_location:
        return image_location(key.name, value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, bytes):
        return value.hex() or "-"
    return str(value)


def plugin_pairs(options: dict) -> list[tuple[str, str]]:
    """The plugin's key=value pairs for `serve`'s options (click parameter names).

    An option that is unset (None) or equal to the server's default adds no key."""
    pairs = []
    for key in KEYS:
        if key.option is None or options.get(key.option) is None:
            continue
        value = options[key.option]
        if key.target.startswith("tree.") and value is False:
            continue  # a flag not given
        if key.name in ("threshold", "allow-class"):
            pairs.extend((key.name, str(item)) for item in value)
            continue
        if value == _DEFAULTS.get(key.target) and not key.target.startswith("tree."):
            continue
        pairs.append((key.name, _render(key, value)))
    return pairs


class ConfigBuilder:
    """Collects key=value pairs one at a time, then builds a ServerConfig."""

    def __init__(self) -> None:
        self.values: dict = {}
        self.tree: dict = {}
        self.thresholds: dict[str, str] = {}
        self.allowed: dict[str, frozenset | None] = {}

    def add(self, key: str, value: str) -> None:
        if key not in _BY_NAME:  # quoted only when it would not print as one line
            shown = key if key.isprintable() else repr(key)
            raise ConfigError(f"unknown parameter: {shown}")
        spec = _BY_NAME[key]
        parsed = spec.parse(key, value)
        if spec.target == "thresholds":
            name, amount = parsed
            self.thresholds[name] = amount
        elif spec.target == "allow_classes":  # uids add up; one without uids: everyone
            name, uids = parsed
            before = self.allowed.get(name, frozenset())
            self.allowed[name] = None if uids is None or before is None else before | uids
        elif spec.target.startswith("tree."):
            self.tree[spec.target[5:]] = parsed
        else:
            self.values[spec.target] = parsed

    def build(self) -> ServerConfig:
        values = dict(self.values)
        if "exports" in values:  # every image comes from its export file
            if "data" in values:
                raise ConfigError("exports: give data=PATH or exports=DIR, not both")
            values["data"] = ""
        elif "data" not in values:
            raise ConfigError("data: missing (give data=PATH, or exports=DIR)")
        # hash and root-hash may come from sidecars beside the data (the Device finds them)
        values["root_hash"] = root_hash_text(values.get("root_hash"),
                                             values.pop("root_hash_file", None),
                                             required=False)
        return ServerConfig(tree=dict(self.tree), thresholds=dict(self.thresholds),
                            allow_classes=dict(self.allowed), **values)


def config_from_pairs(pairs) -> ServerConfig:
    """Build a config from (key, value) pairs, as nbdkit would pass them."""
    builder = ConfigBuilder()
    for key, value in pairs:
        builder.add(key, value)
    return builder.build()
