"""An export file, `/etc/nbd-verity/NAME.conf`: one verified image, as one `serve` names it.

The one home of this format: `serve --export-file FILE` (the template units) and the
many-export server (`serve --exports DIR`, every `NAME.conf` of DIR) both read it here.
Its syntax is systemd's EnvironmentFile (the attach unit reads the same file with
systemd's own parser): `KEY=value` lines, `#` and `;` comment lines, blank lines, a value
in single or double quotes (backslash escapes inside double ones), a backslash at the
end of a line continuing it. The keys:

  DATA, HASH, ROOT_HASH   what `serve DATA [HASH [ROOT_HASH]]` takes (HASH and ROOT_HASH
                          may be empty: found beside DATA, or a DDI's own)
  ARGS                    more `serve` options, split on white space as systemd splits
                          `$ARGS` (no quoting)
  NBD_DEVICE, ATTACH_ARGS for nbd-verity-attach@NAME.service; not the server's

ARGS are parsed by OPTIONS below, the one table of the `serve` options a file may carry,
spelled as `serve` spells them (tests check it against the command). Each option is an
image's (its tree, root hash and own signature, FEC, modes, cache, readahead, sources)
or the server's (trust anchors and signature policy, as the kernel's keyring and
/etc/verity.d are the system's; restart on corruption; classes, pool, threads,
thresholds; listening, never in a file). A many-export server refuses the server's
options in its files (ExportFile.server_options); a file served alone is its one
image's server's config, so it may give them.

A path option (PATH_DESTS) takes a path, never a URL; a relative one is relative to the
file's directory. A file holding a secret (a URL's password or query) and readable by
other users is one warning line (secret_warning).
"""

from __future__ import annotations

import os
import re
import stat
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..log import log
from ..sources.remote import URI_SCHEMES, is_url, redact
from ..sources.source import read_small_file

KEYS = ("DATA", "HASH", "ROOT_HASH", "ARGS", "NBD_DEVICE", "ATTACH_ARGS")
MAX_EXPORT_FILE = 64 << 10  # bytes: a handful of lines
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}")  # an export name from a file name
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


IMAGE, SERVER = "image", "server"  # who an option belongs to (see the module)


@dataclass(frozen=True)
class Option:
    """One `serve` option an export file's ARGS may hold: its click parameter name, the
    value a flag stands for (None: the option takes a value), and whose it is."""

    dest: str
    flag_value: object = None
    owner: str = IMAGE  # SERVER: refused in a many-export server's files
    repeat: bool = False  # may be given several times (a list)

    @property
    def server(self) -> bool:
        """Whether the option is the server's (not an image's)."""
        return self.owner == SERVER


def _server(dest: str, flag_value: object = None, repeat: bool = False) -> Option:
    """A server's option (see the module)."""
    return Option(dest, flag_value, SERVER, repeat)


OPTIONS = {
    # ---- an image's ----
    # its tree (veritysetup's spelling)
    "--hash": Option("algorithm"), "--salt": Option("salt"),
    "--data-block-size": Option("data_block_size"),
    "--hash-block-size": Option("hash_block_size"),
    "--data-blocks": Option("data_blocks"), "--hash-offset": Option("hash_offset"),
    "--no-superblock": Option("no_superblock", True), "--format": Option("hash_type"),
    # its root hash and its own signature (checked against the server's certificates)
    "--root-hash-file": Option("root_hash_file"), "--partition": Option("partition"),
    "--root-hash-signature": Option("root_hash_signature"),
    # its FEC
    "--fec-device": Option("fec_device"), "--fec-roots": Option("fec_roots"),
    "--fec-offset": Option("fec_offset"),
    # reading and verifying it
    "--ignore-corruption": Option("ignore_corruption", True),
    "--ignore-zero-blocks": Option("ignore_zero_blocks", True),
    "--check-at-most-once": Option("check_at_most_once", True),
    "--cache-size": Option("cache_size"),  # in a many-export server: caps its share
    "--readahead": Option("readahead", True), "--no-readahead": Option("readahead", False),
    # its sources (remote images)
    "--source-timeout": Option("source_timeout"),
    "--upstream-cache": Option("upstream_cache", True),
    "--upstream-cache-size": Option("upstream_cache_size"),
    "--s3-endpoint": Option("s3_endpoint"), "--s3-profile": Option("s3_profile"),
    "--s3-credentials": Option("s3_credentials"),
    # ---- the server's, one for all its images ----
    # what it trusts: the anchors and the policy
    "--trusted-certs": _server("trusted_certs"),
    "--require-signatures": _server("require_signatures", True),
    # on corruption: exit (every export stops)
    "--restart-on-corruption": _server("restart_on_corruption", True),
    # classes, pool, threads, thresholds, log
    "--threshold": _server("thresholds", repeat=True),
    "--threshold-preset": _server("threshold_preset"),
    "--workers": _server("workers"),
    "--default-class": _server("default_class"),
    "--serialize": _server("serialize", True),
    "--parallel": _server("serialize", False),
    "--thread-model": _server("thread_model"),
    "--threads": _server("threads"),
    "--log-rate": _server("log_rate"),
    # who may do what: a class above the default by name, the export list
    "--allow-class": _server("allow_classes", repeat=True),
    "--list-exports": _server("list_exports", True),
}
LISTEN_OPTIONS = ("--unix", "--port", "--bind", "--pid-file", "--exit-with-parent",
                  "--control", "--verbose", "-v", "--exports", "--export-file")
PATH_DESTS = {"root_hash_file", "root_hash_signature", "trusted_certs", "fec_device",
              "s3_credentials"}
INT_DESTS = {"data_block_size", "hash_block_size", "data_blocks", "hash_offset", "hash_type",
             "fec_roots", "fec_offset", "workers", "threads", "log_rate"}


@dataclass(frozen=True)
class ExportFile:
    """What one export file says."""

    path: str
    name: str
    data: str
    hash_image: str | None = None
    root_hash: str | None = None
    options: dict = field(default_factory=dict)  # serve's click parameter names -> values

    def server_options(self) -> list[str]:
        """The server-wide options given (as spelled), for a refusal."""
        return [flag for flag, option in OPTIONS.items()
                if option.server and option.dest in self.options
                and (flag not in ("--serialize", "--parallel")
                     or self.options[option.dest] == option.flag_value)]


def export_name(path: str) -> str:
    """The export a file NAME.conf serves: NAME, which must be a plain name."""
    base = os.path.basename(path)
    name = base.removesuffix(".conf")
    if name == base or not NAME.fullmatch(name):
        raise ConfigError(f"{path}: an export file is NAME.conf, NAME of letters, digits "
                          f"and _.+- (at most 128, not starting with punctuation)")
    return name


def read_export_file(path: str, warn: Callable[[str], None] = log) -> ExportFile:
    """Read and check one export file; ConfigError in one line naming it otherwise. warn
    gets the one line of secret_warning, if any."""
    values = parse_environment(_read_text(path), path)
    warning = secret_warning(path, values)
    if warning:
        warn(warning)
    if not values.get("DATA"):
        raise ConfigError(f"{path}: DATA: missing (the data image, a path or a URL)")
    options = parse_args(values.get("ARGS", ""), f"{path}: ARGS")
    base = os.path.dirname(os.path.abspath(path))
    for dest in PATH_DESTS & set(options):
        options[dest] = os.path.join(base, options[dest])  # an absolute one stays as it is
    return ExportFile(path, export_name(path), _beside(base, values["DATA"], f"{path}: DATA"),
                      _beside(base, values.get("HASH") or None, f"{path}: HASH"),
                      values.get("ROOT_HASH") or None, options)


def _beside(base: str, location: str | None, where: str) -> str | None:
    """An image: a URL nbd-verity reads, or a path, relative to the file's directory
    (an absolute path, or nothing, stays as it is); anything else with :// is refused."""
    if not location or is_url(location):
        return location
    if "://" in location:
        raise ConfigError(f"{where}: {redact(location)} is neither a path nor a URL "
                          f"nbd-verity reads (nbd, nbds, nbd+unix, nbds+unix, http, "
                          f"https, s3)")
    return os.path.join(base, location)


def secret_warning(path: str, values: dict[str, str]) -> str | None:
    """One line when the file holds a secret (a URL's password, or a query: tokens,
    presigned signatures) and other users can read it: o+r on the file and o+x on its
    directory. A group that may read it is the admin's choice (0640), as systemd's
    credentials allow; the line never holds the secret."""
    words = [values.get("DATA", ""), values.get("HASH", ""), *values.get("ARGS", "").split()]
    if not any(_holds_secret(word) for word in words):
        return None
    try:
        file_mode = os.stat(path).st_mode
        dir_mode = os.stat(os.path.dirname(os.path.abspath(path))).st_mode
    except OSError:
        return None
    if not (file_mode & stat.S_IROTH and dir_mode & stat.S_IXOTH):
        return None
    return (f"warning: {path}: holds a secret (a URL's password or query) and other users "
            f"can read it: chmod 0600 (or 0640 for a group), or keep the secret in a "
            f"credential (systemd's LoadCredential=; see docs/trust.md)")


def _holds_secret(word: str) -> bool:
    """Whether a word is a URL with a password in its user part, or with a query (an NBD
    URI's query holds file names, not secrets)."""
    if "://" not in word:
        return False
    try:
        parts = urllib.parse.urlsplit(word)
    except ValueError:  # not even a URL (an odd [host]): warn rather than miss one
        return True
    return parts.password is not None or bool(parts.query and parts.scheme not in URI_SCHEMES)


def _read_text(path: str) -> str:
    """The file's text: a regular file (a FIFO is never opened), UTF-8, at most 64 KiB."""
    blob = read_small_file(path, MAX_EXPORT_FILE, ConfigError)
    try:
        return blob.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None


def parse_environment(text: str, path: str) -> dict[str, str]:
    """KEY=value lines as systemd's EnvironmentFile reads them (see the module)."""
    values: dict[str, str] = {}
    lines = text.split("\n")
    number = 0
    while number < len(lines):
        start = number + 1
        line = lines[number].strip()
        number += 1
        while line.endswith("\\") and number < len(lines):  # a continued line
            line = line[:-1] + lines[number].strip()
            number += 1
        if not line or line[0] in "#;":
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not _KEY.fullmatch(key):
            raise ConfigError(f"{path}: line {start}: not KEY=value")
        if key not in KEYS:
            raise ConfigError(f"{path}: line {start}: unknown key {key} ({', '.join(KEYS)})")
        values[key] = _unquote(value.strip(), path, start)
    return values


def _unquote(value: str, path: str, line: int) -> str:
    if len(value) >= 2 and value[0] == value[-1] == "'":
        return value[1:-1]
    if len(value) >= 2 and value[0] == value[-1] == '"':
        return re.sub(r'\\(["\\$`])', r"\1", value[1:-1])
    if value and value[0] in "'\"":
        raise ConfigError(f"{path}: line {line}: unterminated quote")
    return value


def parse_args(text: str, where: str) -> dict:
    """ARGS as serve's options (click parameter names -> values), by OPTIONS."""
    words = text.split()
    options: dict = {}
    i = 0
    while i < len(words):
        word = words[i]
        flag, eq, inline = word.partition("=")
        i += 1
        if flag in LISTEN_OPTIONS:
            raise ConfigError(f"{where}: {flag} is the server's own (give it to `nbd-verity "
                              f"serve`, not in an export file)")
        option = OPTIONS.get(flag)
        if option is None:
            raise ConfigError(f"{where}: {word!r} is not an option an export may give")
        if option.flag_value is not None:
            if eq:
                raise ConfigError(f"{where}: {flag} takes no value")
            options[option.dest] = option.flag_value
            continue
        if not eq:
            if i >= len(words):
                raise ConfigError(f"{where}: {flag} needs a value")
            inline = words[i]
            i += 1
        if option.dest in PATH_DESTS and "://" in inline:
            raise ConfigError(f"{where}: {flag} takes a path, not a URL")
        value = _typed(option.dest, inline, where, flag)
        if option.repeat:
            options.setdefault(option.dest, []).append(value)
        else:
            options[option.dest] = value
    return options


def _typed(dest: str, text: str, where: str, flag: str):
    if dest in INT_DESTS:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{where}: {flag}: {text!r} is not an integer") from None
    if dest == "source_timeout":
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{where}: {flag}: {text!r} is not a number") from None
    return text


def export_files(directory: str) -> list[str]:
    """The export files of a directory (NAME.conf, sorted); hidden files are skipped."""
    try:
        names = os.listdir(directory)
    except OSError as e:
        raise ConfigError(f"exports: {directory}: {e.strerror}") from None
    return sorted(os.path.join(directory, n) for n in names
                  if n.endswith(".conf") and not n.startswith("."))
