"""The example database (``--database``, ``SHARDKIT_DATABASE``): a failure one ``shardkit fuzz``
process finds is replayed first by another through a real Redis; one engine's examples never
replay against another; read-only runs never write; an unreachable or failing Redis is one
warning and a local folder; bad values are one-line usage errors; pytest suites use the variable.

The Redis tests run against the server ``SHARDKIT_TEST_REDIS_URL`` names (``.ci/run`` starts one
on 127.0.0.1); without it they skip, unless ``SHARDKIT_REQUIRE_REDIS=1`` makes that a failure.
The tests that need only the ``redis`` client (the ``redis`` extra, in ``.[test]``) skip without
it, under the same rule; the others (a folder database, the usage errors, a failing shared
database stood in for in memory) run without the client or a server.
They share that server's database with whatever else runs at the same time (another
pytest-xdist worker, another checkout's CI): each test fuzzes an engine file of its own under
``tmp_path``, and the database's keys carry the engine's identity (its absolute path), so no two
tests, nor two runs of this file, ever read each other's examples.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import unittest
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest
from hypothesis import settings
from hypothesis.database import InMemoryExampleDatabase

from shardkit._cli.main import main
from shardkit._core.targets import PythonTarget, parse_target
from shardkit._machine.build import build_machine
from shardkit._machine.profiles import CI_PROFILE
from shardkit._run.artefacts import _EngineKeyedDatabase, machine_identity
from shardkit._run.database import (
    DATABASE_VARIABLE,
    LOCAL_FALLBACK,
    NO_DATABASE,
    READ_ONLY_VARIABLE,
    REDIS_KEY_PREFIX,
    DatabaseChoice,
    _SharedWithLocalFallback,
    choose_database,
    open_database,
    parse_database,
)
from shardkit._run.options import FuzzOptions
from shardkit._run.suite import SuiteOverrides, machine_for, run_as_test
from shardkit.errors import SuiteFailure, UsageError

#: A planted engine whose one failure (a prefill, then a release that leaks its KV tokens) the
#: fuzzer finds within a few examples at seed 1, and not in the first example of seed 2.
ENGINE_SOURCE = "from shardkit._planted import ReleaseLeaksKvTokens as Engine\n"
FOUND_IN_THE_FIRST_EXAMPLE = "1 example (2 steps) until the first failure"
THE_FAILURE = "FAILURE (§2 metrics) in 2 steps:"
DATABASE_VARIABLES = (DATABASE_VARIABLE, READ_ONLY_VARIABLE)
#: Set by CI (``.ci/run``): a missing Redis server or ``redis`` client fails its tests instead of skipping them.
REDIS_REQUIRED = os.environ.get("SHARDKIT_REQUIRE_REDIS") == "1"
REDIS_CLIENT_MISSING = "the redis package is missing: pip install -e '.[test]'"


def skip_or_fail_without_redis(problem: str) -> NoReturn:
    """Skip the test that needs what ``problem`` says is missing; under ``SHARDKIT_REQUIRE_REDIS=1``, fail it."""
    if REDIS_REQUIRED:
        pytest.fail(f"SHARDKIT_REQUIRE_REDIS=1, but {problem}", pytrace=False)
    pytest.skip(problem)


def redis_client_installed() -> bool:
    try:
        import redis  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture
def redis_client() -> None:
    """For a test that needs the ``redis`` client but no server: skips without it (fails under
    ``SHARDKIT_REQUIRE_REDIS=1``)."""
    if not redis_client_installed():
        skip_or_fail_without_redis(REDIS_CLIENT_MISSING)


def engine_file(folder: Path) -> str:
    """A new engine target in ``folder``: the planted engine under an identity of its own."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "engine.py"
    path.write_text(ENGINE_SOURCE, encoding="utf-8")
    return f"{path}:Engine"


def shardkit_process(*argv: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``shardkit`` in a process of its own, in ``cwd``, with no database from the environment."""
    cwd.mkdir(parents=True, exist_ok=True)
    env = {key: value for key, value in os.environ.items() if key not in DATABASE_VARIABLES}
    return subprocess.run(
        [sys.executable, "-m", "shardkit", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def identity_prefix(target: str) -> bytes:
    """The key prefix of ``target`` fuzzed with the default options, as Redis stores it."""
    machine = build_machine(parse_target(target), FuzzOptions())
    return REDIS_KEY_PREFIX + _EngineKeyedDatabase(InMemoryExampleDatabase(), machine_identity(machine)).prefix


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(autouse=True)
def no_database_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in DATABASE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)


# --- the Redis server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_url() -> str:
    """The URL of the Redis server to test against, checked to answer."""
    url = os.environ.get("SHARDKIT_TEST_REDIS_URL", "")
    problem = None
    if not url:
        problem = (
            "SHARDKIT_TEST_REDIS_URL is unset: start redis-server and export redis://127.0.0.1:PORT/0 (.ci/run does)"
        )
    else:
        try:
            import redis
        except ImportError:
            problem = REDIS_CLIENT_MISSING
        else:
            client = redis.Redis.from_url(url, socket_connect_timeout=5)
            try:
                client.ping()
            except (redis.RedisError, OSError) as error:
                problem = f"the Redis at SHARDKIT_TEST_REDIS_URL={url} does not answer ({error})"
            finally:
                client.close()
    if problem is not None:
        skip_or_fail_without_redis(problem)
    return url


@pytest.fixture
def redis_keys(redis_url: str) -> Iterator[Callable[[bytes], list[bytes]]]:
    """A function listing the keys that start with a prefix, in the test server's database."""
    import redis

    client = redis.Redis.from_url(redis_url)

    def keys_starting(prefix: bytes) -> list[bytes]:
        return [key for key in client.scan_iter(count=1000) if key.startswith(prefix)]

    yield keys_starting
    client.close()


@pytest.fixture(scope="module")
def saved_in_redis(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, subprocess.CompletedProcess[str], Path]:
    """An engine file, and a first process that fuzzed it at seed 1 and saved its failure in Redis."""
    folder = tmp_path_factory.mktemp("saved")
    target = engine_file(folder / "engine")
    first = shardkit_process(
        "fuzz", target, "--seed", "1", "--database", redis_url, "--out", "out", cwd=folder / "first"
    )
    assert first.returncode == 1, first.stdout + first.stderr
    return target, first, folder


def test_a_failure_one_process_finds_is_replayed_first_by_another_through_redis(
    saved_in_redis: tuple[str, subprocess.CompletedProcess[str], Path], redis_url: str
) -> None:
    target, first, folder = saved_in_redis
    lines = first.stdout.splitlines()
    assert lines[0] == f"shardkit fuzz {target} --seed 1 --database {redis_url}", first.stdout
    assert f"  the whole run:   shardkit fuzz {target} --seed 1 --database {redis_url}" in lines
    assert first.stderr == ""
    assert not (folder / "first" / LOCAL_FALLBACK).exists()  # saved in Redis, not in the local fallback

    # Another process, another folder, another seed: the saved failure is its first example.
    second_argv = ["fuzz", target, "--seed", "2", "--examples", "1", "--out", "out"]
    second = shardkit_process(*second_argv, "--database", redis_url, cwd=folder / "second")
    assert second.returncode == 1, second.stdout + second.stderr
    assert FOUND_IN_THE_FIRST_EXAMPLE in second.stdout
    assert THE_FAILURE in second.stdout
    # The control: the same seed with no database finds nothing in that example.
    control = shardkit_process(*second_argv, cwd=folder / "control")
    assert control.returncode == 0, control.stdout + control.stderr
    assert "no failure found" in control.stdout
    for run in (first, second, control):
        print(
            next(line for line in run.stdout.splitlines() if "until the first failure" in line or "examples (" in line)
        )


def test_one_engines_saved_examples_never_replay_against_another(
    saved_in_redis: tuple[str, subprocess.CompletedProcess[str], Path], redis_url: str
) -> None:
    """The same buggy engine under another file (so the same Hypothesis key, and a failure if
    the saved example ran) replays nothing: the keys carry the engine's identity."""
    _, _, folder = saved_in_redis
    other = engine_file(folder / "other_engine")
    argv = ["fuzz", other, "--seed", "2", "--examples", "1", "--database", redis_url, "--out", "out"]
    run = shardkit_process(*argv, cwd=folder / "other")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "no failure found" in run.stdout


def test_a_read_only_run_replays_the_database_and_never_writes_to_it(
    saved_in_redis: tuple[str, subprocess.CompletedProcess[str], Path],
    redis_url: str,
    redis_keys: Callable[[bytes], list[bytes]],
    tmp_path: Path,
) -> None:
    keys_starting = redis_keys
    saved_target, _, _ = saved_in_redis
    replay = ["fuzz", saved_target, "--seed", "2", "--examples", "1", "--database", redis_url, "--database-read-only"]
    replayed = shardkit_process(*replay, "--out", "out", cwd=tmp_path / "replay")
    assert replayed.returncode == 1, replayed.stdout + replayed.stderr
    assert FOUND_IN_THE_FIRST_EXAMPLE in replayed.stdout
    assert replayed.stdout.splitlines()[0].endswith(f"--database {redis_url} --database-read-only")

    # A new engine found failing in read-only mode leaves no key; the same run writable does.
    target = engine_file(tmp_path / "new_engine")
    prefix = identity_prefix(target)
    fuzz = ["fuzz", target, "--seed", "1", "--database", redis_url, "--out", "out"]
    read_only = shardkit_process(*fuzz, "--database-read-only", cwd=tmp_path / "read_only")
    assert read_only.returncode == 1, read_only.stdout + read_only.stderr
    assert keys_starting(prefix) == []
    writable = shardkit_process(*fuzz, cwd=tmp_path / "writable")
    assert writable.returncode == 1, writable.stdout + writable.stderr
    assert keys_starting(prefix) != []


# --- without a server ---------------------------------------------------------------------------


def run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.usefixtures("redis_client")
def test_an_unreachable_redis_is_one_warning_and_the_run_saves_locally(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    url = f"redis://127.0.0.1:{closed_port()}/0"
    code, out, err = run(capsys, "fuzz", engine_file(tmp_path), "--seed", "1", "--database", url, "--out", "out")
    assert code == 1, out + err
    [warning] = err.splitlines()
    assert warning.startswith(f"shardkit: warning: the example database {url} cannot be reached (")
    assert warning.endswith(f"saving examples to the local database {LOCAL_FALLBACK} instead")
    assert THE_FAILURE in out
    assert any(path.is_file() for path in LOCAL_FALLBACK.rglob("*"))
    # What was saved locally is replayed first by the next run, Redis or not.
    code, out, err = run(
        capsys, "fuzz", engine_file(tmp_path), "--seed", "2", "--examples", "1", "--database", url, "--out", "out"
    )
    assert code == 1, out + err
    assert FOUND_IN_THE_FIRST_EXAMPLE in out
    assert len(err.splitlines()) == 1


class _DyingShared(InMemoryExampleDatabase):
    """A shared database that answers ``calls`` operations, then fails as a lost server does."""

    def __init__(self, calls: int) -> None:
        super().__init__()
        self.calls = calls

    def _spend(self) -> None:
        self.calls -= 1
        if self.calls < 0:
            raise ConnectionError("Connection closed by server.")

    def save(self, key: bytes, value: bytes) -> None:
        self._spend()
        super().save(key, value)

    def fetch(self, key: bytes) -> Iterator[bytes]:
        self._spend()
        yield from super().fetch(key)


def test_a_redis_that_fails_mid_run_warns_once_and_the_saves_go_local(tmp_path: Path) -> None:
    shared = _DyingShared(calls=2)
    local = InMemoryExampleDatabase()
    warnings: list[str] = []
    choice = DatabaseChoice("redis", "redis://cache.example:6379/0")
    database = _SharedWithLocalFallback(shared, local, choice, tmp_path / "examples", warnings.append)
    database.save(b"key", b"first")
    assert list(database.fetch(b"key")) == [b"first"]
    database.save(b"key", b"second")  # the server is gone
    database.save(b"key", b"third")
    assert shared.data == {b"key": {b"first"}}
    assert sorted(local.fetch(b"key")) == [b"second", b"third"]
    assert sorted(database.fetch(b"key")) == [b"second", b"third"]
    [warning] = warnings
    assert warning == (
        "shardkit: warning: the example database redis://cache.example:6379/0 failed during the run "
        f"(Connection closed by server.); saving examples to the local database {tmp_path / 'examples'} from now on"
    )


class _FullShared(InMemoryExampleDatabase):
    """A Redis over its memory limit: redis-py's own pipeline error, which quotes the command
    with the example's key, binary bytes."""

    def save(self, key: bytes, value: bytes) -> None:
        from redis.client import Pipeline
        from redis.exceptions import ResponseError

        error = ResponseError("command not allowed when used memory > 'maxmemory'.")
        Pipeline.annotate_exception(None, error, 1, ("SADD", b"shardkit-example:" + key, value))  # type: ignore[arg-type]
        raise error


@pytest.mark.usefixtures("redis_client")
def test_a_redis_warning_never_prints_an_examples_key_bytes(tmp_path: Path) -> None:
    warnings: list[str] = []
    choice = DatabaseChoice("redis", "redis://cache.example:6379/0")
    database = _SharedWithLocalFallback(
        _FullShared(), InMemoryExampleDatabase(), choice, tmp_path / "examples", warnings.append
    )
    database.save(b"\x8f\x00\xff\x1b[31mkey", b"value")
    [warning] = warnings
    assert warning.isascii(), warning
    assert warning.isprintable(), warning
    assert "(SADD: command not allowed when used memory > 'maxmemory'.)" in warning
    assert "key" not in warning.partition("(")[2]


@pytest.mark.usefixtures("redis_client")
def test_a_redis_that_refuses_the_password_says_so_not_that_it_is_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wrong password is a mistake to fix, not an outage to wait out."""
    from redis import Redis
    from redis.exceptions import AuthenticationError

    from shardkit._run.database import open_database

    def refuse(self: Redis) -> bool:
        raise AuthenticationError("invalid username-password pair or user is disabled.")

    monkeypatch.setattr(Redis, "ping", refuse)
    warnings: list[str] = []
    choice = DatabaseChoice("redis", "redis://:secret@cache.example:6379/0")
    open_database(choice, fallback=tmp_path / "examples", warn=warnings.append)
    [warning] = warnings
    assert warning.startswith(
        "shardkit: warning: the example database redis://:****@cache.example:6379/0 refused the login ("
    ), warning
    assert "secret" not in warning


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (
            "http://cache.example:6379/0",
            "unknown scheme 'http'; name a Redis server (redis://HOST:PORT/N), a folder, or none",
        ),
        ("redis://cache.example:port/0", "the port 'port' must be a number from 1 to 65535"),
        ("redis://cache.example:70000/0", "the port '70000' must be a number from 1 to 65535"),
        ("redis://cache.example:6379/zero", "the database number 'zero' must be an integer"),
        ("redis://:6379/0", "names no host; write redis://HOST:PORT/N"),
        ("", "--database is empty"),
    ],
)
def test_a_bad_database_value_exits_2_in_one_line_naming_it(
    capsys: pytest.CaptureFixture[str], value: str, expected: str
) -> None:
    code, out, err = run(capsys, "fuzz", "--seed", "1", "--database", value)
    assert code == 2, out + err
    [line] = err.splitlines()
    assert line.startswith("shardkit fuzz: --database")
    assert repr(value) in line or not value
    assert expected in line
    assert out == ""  # refused before the run


def test_a_file_named_as_the_database_folder_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    file = tmp_path / "examples"
    file.write_text("not a folder\n")
    code, out, err = run(capsys, "fuzz", "--seed", "1", "--database", file)
    assert code == 2, out + err
    assert (
        err
        == f"shardkit fuzz: --database '{file}' is a file, not a folder; name a folder for the example database, or none\n"
    )


def test_a_redis_database_without_the_redis_package_exits_2_naming_the_extra(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "redis", None)  # what importlib finds when it is not installed
    code, out, err = run(capsys, "fuzz", "--seed", "1", "--database", "redis://cache.example:6379/0")
    assert code == 2, out + err
    assert (
        err
        == "shardkit fuzz: --database 'redis://cache.example:6379/0' needs the redis package: pip install 'shardkit[redis]'\n"
    )


@pytest.mark.parametrize(
    ("variables", "argv", "expected"),
    [
        (
            {DATABASE_VARIABLE: "ftp://cache.example/0"},
            [],
            "SHARDKIT_DATABASE 'ftp://cache.example/0': unknown scheme 'ftp'",
        ),
        (
            {DATABASE_VARIABLE: "none", READ_ONLY_VARIABLE: "maybe"},
            [],
            "SHARDKIT_DATABASE_READ_ONLY='maybe': set it to 1",
        ),
        ({}, ["--database-read-only"], "--database-read-only replays a database without saving to it; name one"),
    ],
    ids=["bad SHARDKIT_DATABASE", "bad SHARDKIT_DATABASE_READ_ONLY", "read-only without a database"],
)
def test_bad_database_settings_from_the_environment_or_flags_exit_2_in_one_line(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    variables: dict[str, str],
    argv: list[str],
    expected: str,
) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    code, out, err = run(capsys, "fuzz", "--seed", "1", *argv)
    assert code == 2, out + err
    [line] = err.splitlines()
    assert expected in line


def test_no_database_is_the_default_and_the_variable_is_the_options_default() -> None:
    assert choose_database(None, False, {}) == NO_DATABASE
    assert FuzzOptions().database_choice == NO_DATABASE
    assert "--database" not in FuzzOptions().command(PythonTarget("shardkit:FakeShardEngine"), 1, None, None)
    from_environment = choose_database(None, False, {DATABASE_VARIABLE: "examples", READ_ONLY_VARIABLE: "1"})
    assert from_environment == DatabaseChoice("directory", "examples", True, DATABASE_VARIABLE)
    assert choose_database("none", False, {DATABASE_VARIABLE: "examples"}) == DatabaseChoice(
        "none", "none", False, "--database"
    )


def test_read_only_from_the_environment_applies_to_a_named_database_and_leaves_none_alone() -> None:
    """A CI sets SHARDKIT_DATABASE_READ_ONLY=1 for every pull-request job, some naming no database."""
    read_only = {READ_ONLY_VARIABLE: "1"}
    assert choose_database("examples", False, read_only).read_only
    assert choose_database("none", False, read_only) == NO_DATABASE
    assert choose_database(None, False, read_only) == NO_DATABASE
    with pytest.raises(UsageError, match="database_read_only"):
        FuzzOptions(database="none", database_read_only=True)
    assert FuzzOptions(database="examples", database_read_only=True).database_choice.read_only


@pytest.mark.usefixtures("redis_client")
def test_read_only_from_the_environment_applies_to_a_named_redis() -> None:
    assert choose_database("redis://cache.example:6379/0", False, {READ_ONLY_VARIABLE: "1"}).read_only


@pytest.mark.parametrize(
    ("value", "how", "printed"),
    [
        ("redis://cache.example:6379/2", {}, " --database redis://cache.example:6379/2"),
        ("shared examples", {"read_only": True}, " --database 'shared examples' --database-read-only"),
        ("redis://:hunter2@cache.example:6379/0", {}, " --database 'redis://:****@cache.example:6379/0'"),
        ("redis://:hunter2@cache.example/0", {"source": DATABASE_VARIABLE}, ' --database "$SHARDKIT_DATABASE"'),
    ],
    ids=["redis", "a folder, read-only", "a password typed", "a password from the environment"],
)
def test_the_rerun_command_names_the_database_and_never_a_password(
    value: str, how: dict[str, Any], printed: str, request: pytest.FixtureRequest
) -> None:
    if value.startswith("redis://"):
        request.getfixturevalue("redis_client")  # parse_database checks that a redis:// value can be opened
    choice = parse_database(value, **how)
    command = FuzzOptions(database=choice).command(PythonTarget("shardkit:FakeShardEngine"), 7, None, None)
    assert command == f"shardkit fuzz shardkit:FakeShardEngine --seed 7{printed}"
    assert "hunter2" not in command


def test_shardkit_database_reaches_a_suite_under_the_derandomized_ci_profile(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Hypothesis drops the database of derandomized settings; shardkit keeps the one the user set."""
    examples = tmp_path / "examples"
    monkeypatch.setenv(DATABASE_VARIABLE, str(examples))
    machine = machine_for(engine_file(tmp_path))
    test = unittest.TestCase()
    test.settings = settings.get_profile(CI_PROFILE)  # type: ignore[attr-defined]
    assert test.settings.derandomize  # type: ignore[attr-defined]
    assert test.settings.database is None  # type: ignore[attr-defined]
    test.shardkit_overrides = SuiteOverrides(out=tmp_path / "out")  # type: ignore[attr-defined]
    with pytest.raises(SuiteFailure) as failure:
        run_as_test(machine, test)
    assert any(path.is_file() for path in examples.rglob("*"))
    assert f"{DATABASE_VARIABLE}={examples} pytest" in str(failure.value)


def test_a_directory_database_is_hypothesiss_and_read_only_wraps_it(tmp_path: Path) -> None:
    from hypothesis.database import DirectoryBasedExampleDatabase, ReadOnlyDatabase

    assert open_database(NO_DATABASE) is None
    assert isinstance(open_database(parse_database(str(tmp_path))), DirectoryBasedExampleDatabase)
    assert isinstance(open_database(parse_database(str(tmp_path), read_only=True)), ReadOnlyDatabase)
    with pytest.raises(UsageError, match="unknown scheme 'memory'"):
        parse_database("memory://")
