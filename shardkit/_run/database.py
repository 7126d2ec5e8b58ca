"""The example database a run saves its failing examples to and replays them from first.

``--database`` (or ``SHARDKIT_DATABASE``) names one: ``none`` (the default: a seed alone
decides what runs), a folder (Hypothesis's ``DirectoryBasedExampleDatabase``) or a Redis
server, ``redis://HOST:PORT/N`` (Hypothesis's ``RedisExampleDatabase``), shared by every
runner that names it so that a failure one of them found is replayed first by all the
others. ``--database-read-only`` (or ``SHARDKIT_DATABASE_READ_ONLY=1``) replays without
saving: for runs, such as a pull request's, whose findings should not reach the others.

A Redis that cannot be reached never stops a run and never loses what it finds: the run
warns in one line and saves to a local folder instead (``LOCAL_FALLBACK``), and a Redis that
fails in the middle of a run is replaced by that folder from then on (warned once). The
local folder is read as well as Redis on every run, so an example saved there while Redis
was away is replayed, and (still failing) saved to Redis, once it is back.

``parse_database`` checks a value before any run starts (a bad one is a ``UsageError``
naming it and the fix); ``open_database`` opens it. Every key is prefixed by the engine's
identity later, by ``shardkit._run.artefacts``, whatever the database.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase, ReadOnlyDatabase

from shardkit.errors import UsageError

__all__ = [
    "DATABASE_VARIABLE",
    "LOCAL_FALLBACK",
    "NO_DATABASE",
    "READ_ONLY_VARIABLE",
    "DatabaseChoice",
    "choose_database",
    "database_from_environment",
    "open_database",
    "parse_database",
]

DATABASE_VARIABLE = "SHARDKIT_DATABASE"
READ_ONLY_VARIABLE = "SHARDKIT_DATABASE_READ_ONLY"
#: Where examples go when the named Redis cannot take them (relative to the folder the run starts in).
LOCAL_FALLBACK = Path(".shardkit") / "examples"
#: Before Hypothesis's own prefix, so that shardkit's sets stand apart in a Redis other tools share.
REDIS_KEY_PREFIX = b"shardkit-example:"
#: How long a connection to Redis may take to open or to answer before the local folder takes over:
#: a deadline on the network, not on the engine, so it decides where examples go, never a result.
REDIS_TIMEOUT_S = 5.0

_REDIS_SCHEMES = ("redis", "rediss")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
_FIX = "name a Redis server (redis://HOST:PORT/N), a folder, or none"

Warn = Callable[[str], None]


@dataclass(frozen=True)
class DatabaseChoice:
    """A checked ``--database`` value. ``kind`` is "none", "directory" or "redis"; ``value``
    is the folder or the URL as written; ``source`` is where it was written
    (``--database`` or ``SHARDKIT_DATABASE``), which a rerun command prints instead of a
    password."""

    kind: Literal["none", "directory", "redis"]
    value: str
    read_only: bool = False
    source: str = "--database"

    @property
    def shown(self) -> str:
        """The value as printed: a Redis URL's password, if any, replaced by ``****``."""
        if self.kind != "redis":
            return self.value
        parts = urlsplit(self.value)
        if parts.password is None:
            return self.value
        user = parts.username or ""
        host = parts.netloc.rpartition("@")[2]
        return parts._replace(netloc=f"{user}:****@{host}").geturl()

    def command_options(self) -> list[str]:
        """The options that name this database on a ``shardkit fuzz`` command line, quoted for a
        shell. A password is never printed: from the environment, the line names the variable
        (it reruns where the variable is set); from the command line, it is masked."""
        if self.kind == "none":
            return []
        if self.shown != self.value and self.source == DATABASE_VARIABLE:
            named = f'"${DATABASE_VARIABLE}"'
        else:
            named = shlex.quote(self.shown)
        return ["--database", named, *(["--database-read-only"] if self.read_only else [])]


NO_DATABASE = DatabaseChoice("none", "none")


def parse_database(text: str, *, read_only: bool = False, source: str = "--database") -> DatabaseChoice:
    """The database ``text`` names, checked: ``none``, a folder, or ``redis://HOST:PORT/N``
    (``rediss://`` for TLS). A bad value raises ``UsageError`` naming ``source`` and the value."""
    if not text.strip():
        raise UsageError(f"{source} is empty; {_FIX}")
    if text.strip().lower() == "none":
        return DatabaseChoice("none", "none", source=source)  # nothing to write: read-only changes nothing
    scheme, separator, _ = text.partition("://")
    if separator:
        if scheme.lower() not in _REDIS_SCHEMES:
            raise UsageError(f"{source} {text!r}: unknown scheme {scheme!r}; {_FIX}")
        return _redis_choice(text, read_only, source)
    folder = Path(text)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{source} {text!r} is a file, not a folder; name a folder for the example database, or none")
    return DatabaseChoice("directory", text, read_only, source)


def _redis_choice(text: str, read_only: bool, source: str) -> DatabaseChoice:
    parts = urlsplit(text)
    choice = DatabaseChoice("redis", text, read_only, source)
    shown = choice.shown
    host_and_port = parts.netloc.rpartition("@")[2]
    after_host = host_and_port.partition("]")[2] if host_and_port.startswith("[") else host_and_port
    _, colon, port = after_host.partition(":")
    if colon and not (port.isdigit() and 1 <= int(port) <= 65535):
        message = (
            f"{source} {shown!r}: the port {port!r} must be a number from 1 to 65535, e.g. redis://localhost:6379/0"
        )
        raise UsageError(message)
    if not parts.hostname:
        raise UsageError(f"{source} {shown!r} names no host; write redis://HOST:PORT/N, e.g. redis://localhost:6379/0")
    number = parts.path.strip("/")
    if number and not number.isdigit():
        message = f"{source} {shown!r}: the database number {number!r} must be an integer (0 to 15 on a default Redis), e.g. redis://localhost:6379/0"
        raise UsageError(message)
    if importlib.util.find_spec("redis") is None:
        raise UsageError(f"{source} {shown!r} needs the redis package: pip install 'shardkit[redis]'")
    return choice


def read_only_from_environment(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``SHARDKIT_DATABASE_READ_ONLY`` asks for read-only (1/true/yes/on; unset, empty
    and 0/false/no/off do not). Anything else is a ``UsageError``."""
    text = (os.environ if environ is None else environ).get(READ_ONLY_VARIABLE, "")
    if text.strip().lower() in _TRUE:
        return True
    if text.strip().lower() in _FALSE:
        return False
    raise UsageError(f"{READ_ONLY_VARIABLE}={text!r}: set it to 1 (replay without saving) or 0 (replay and save)")


def database_from_environment(environ: Mapping[str, str] | None = None) -> DatabaseChoice | None:
    """What ``SHARDKIT_DATABASE`` (and ``SHARDKIT_DATABASE_READ_ONLY``) name, or None when it
    is unset or empty."""
    environ = os.environ if environ is None else environ
    text = environ.get(DATABASE_VARIABLE, "")
    if not text:
        return None
    return parse_database(text, read_only=read_only_from_environment(environ), source=DATABASE_VARIABLE)


def choose_database(
    option: str | None, read_only_option: bool, environ: Mapping[str, str] | None = None
) -> DatabaseChoice:
    """The database of a command: its ``--database`` value, else ``SHARDKIT_DATABASE``, else
    none; read-only when ``--database-read-only`` or ``SHARDKIT_DATABASE_READ_ONLY`` asks.
    The flag without a database is a ``UsageError`` (the variable alone is not: it may be set
    for every job of a CI, some of which name no database)."""
    environ = os.environ if environ is None else environ
    read_only = read_only_option or read_only_from_environment(environ)
    choice = parse_database(option) if option is not None else database_from_environment(environ) or NO_DATABASE
    if choice.kind == "none":
        if read_only_option:
            message = f"--database-read-only replays a database without saving to it; name one with --database or {DATABASE_VARIABLE}"
            raise UsageError(message)
        return choice
    return replace(choice, read_only=read_only)


def print_warning(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def open_database(
    choice: DatabaseChoice, *, fallback: Path = LOCAL_FALLBACK, warn: Warn = print_warning
) -> ExampleDatabase | None:
    """The database ``choice`` names, ready for Hypothesis's settings (None for ``none``).

    A Redis that does not answer is a one-line ``warn`` and the local folder ``fallback``
    instead; one that answers is read together with ``fallback`` and, should it fail
    later, replaced by it (warned once)."""
    database: ExampleDatabase
    if choice.kind == "none":
        return None
    if choice.kind == "directory":
        database = DirectoryBasedExampleDatabase(choice.value)
    else:
        database = _open_redis(choice, fallback, warn)
    return ReadOnlyDatabase(database) if choice.read_only else database


def _open_redis(choice: DatabaseChoice, fallback: Path, warn: Warn) -> ExampleDatabase:
    from hypothesis.extra.redis import RedisExampleDatabase
    from redis import Redis
    from redis.backoff import NoBackoff
    from redis.exceptions import AuthenticationError, AuthenticationWrongNumberOfArgsError, ResponseError
    from redis.retry import Retry

    local = DirectoryBasedExampleDatabase(fallback)
    client: Redis = Redis.from_url(
        choice.value,
        socket_connect_timeout=REDIS_TIMEOUT_S,
        socket_timeout=REDIS_TIMEOUT_S,
        # One attempt: a server that is down is the local folder's at once, not after retries.
        retry=Retry(NoBackoff(), 0),
    )
    try:
        client.ping()
    except Exception as error:  # redis.RedisError, OSError, or a TLS error: all mean "not this server"
        client.close()
        # A wrong password is no outage: said as such, a CI that never shares is fixed at once.
        refused = isinstance(error, AuthenticationError | AuthenticationWrongNumberOfArgsError) or (
            isinstance(error, ResponseError) and "NOAUTH" in str(error)
        )
        problem = "refused the login" if refused else "cannot be reached"
        warn(
            f"shardkit: warning: the example database {choice.shown} {problem} ({_reason(error)}); "
            f"{_using_local(fallback, choice.read_only)} instead"
        )
        return local
    shared = RedisExampleDatabase(client, key_prefix=REDIS_KEY_PREFIX)
    return _SharedWithLocalFallback(shared, local, choice, fallback, warn)


def _using_local(fallback: Path, read_only: bool) -> str:
    if read_only:
        return f"replaying from the local database {fallback} (read-only: nothing is saved)"
    return f"saving examples to the local database {fallback}"


#: redis-py's note on an error inside a pipeline, which quotes the command's arguments: an
#: example's key, binary bytes that would reach the terminal as they are.
_PIPELINE_COMMAND = re.compile(r"^Command # \d+ \((?P<command>[A-Za-z]+)\b.*\) of pipeline caused error: ", re.DOTALL)


def _reason(error: BaseException) -> str:
    """The error in one printable line: a pipeline command named without its arguments, and
    any character that is not printable ASCII escaped."""
    text = " ".join(str(error).split()) or type(error).__name__
    text = _PIPELINE_COMMAND.sub(lambda match: f"{match['command']}: ", text, count=1)
    return "".join(char if char.isascii() and char.isprintable() else ascii(char)[1:-1] for char in text)


class _SharedWithLocalFallback(ExampleDatabase):
    """A shared database (Redis) read together with a local folder, which takes every write
    once the shared one has failed. Whatever a failing server raises is caught: a database
    going away must never end a run that may have found a failure."""

    def __init__(
        self, shared: ExampleDatabase, local: ExampleDatabase, choice: DatabaseChoice, fallback: Path, warn: Warn
    ) -> None:
        super().__init__()
        self.shared = shared
        self.local = local
        self.choice = choice
        self.fallback = fallback
        self.warn = warn
        self.failed = False

    def __repr__(self) -> str:
        return f"SharedWithLocalFallback({self.shared!r}, {self.local!r})"

    def _shared_call(self, call: Callable[[], Any]) -> bool:
        """Run ``call`` on the shared database; False (and the one warning) if it failed."""
        if self.failed:
            return False
        try:
            call()
        except Exception as error:
            self.failed = True
            self.warn(
                f"shardkit: warning: the example database {self.choice.shown} failed during the run "
                f"({_reason(error)}); {_using_local(self.fallback, self.choice.read_only)} from now on"
            )
            return False
        return True

    def fetch(self, key: bytes) -> Iterable[bytes]:
        found: list[bytes] = []
        self._shared_call(lambda: found.extend(self.shared.fetch(key)))
        seen = set(found)
        found.extend(value for value in self.local.fetch(key) if value not in seen)
        return found

    def save(self, key: bytes, value: bytes) -> None:
        if not self._shared_call(lambda: self.shared.save(key, value)):
            self.local.save(key, value)

    def delete(self, key: bytes, value: bytes) -> None:
        self._shared_call(lambda: self.shared.delete(key, value))
        self.local.delete(key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        if self._shared_call(lambda: self.shared.move(src, dest, value)):
            # The value lives in the shared database now; a copy saved locally while it was away goes.
            self.local.delete(src, value)
        else:
            self.local.move(src, dest, value)
