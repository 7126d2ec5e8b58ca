"""Calls at the same time through the transport: ``shardkit serve`` runs an engine's calls as
they arrive once it declares ``concurrent_calls`` (and one at a time until then), the remote
client may be called from several threads at once, and ``--isolate`` runs a parallel phase
in a worker process, whose death during the lanes is an ordinary failure.

Servers run in-process (``serve``) on a Unix socket, as in tests/test_remote.py, so that
the engines they build can be watched from here; isolated workers are child processes.
Runs are small: finding and not flagging is what they check, not shrinking."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import pytest
from hypothesis import settings

pytest.importorskip("grpc")

from shardkit import (
    DecodeRequest,
    EngineCapabilities,
    FakeShardEngine,
    LoadRequest,
    PrefillRequest,
    StatusCode,
    StepResult,
)
from shardkit._cli.main import main
from shardkit._core.driver import Driver, StepFailed
from shardkit._core.steps import Action, step_action
from shardkit._core.targets import IsolationOptions, parse_target
from shardkit._machine.build import build_machine
from shardkit._machine.spec import MachineOptions
from shardkit._parallel.phase import run_parallel
from shardkit._planted.dying import DyingEngine, HangsOnSecondDecode, SegfaultsOnDecodeAfterCancel
from shardkit._planted.racy import DecodeCounterLostUpdate
from shardkit._run.options import Budgets
from shardkit._run.result import FuzzResult
from shardkit._run.runner import run_machine
from shardkit._transport.isolation import isolated_target
from shardkit._transport.server import _Slot
from shardkit._transport.worker import TAIL_LINES, _engine_thread
from shardkit.remote import EngineServer, RemoteShardEngine, close_connections, serve

FULL = LoadRequest("shardkit-fuzz", 0, 3, 4)
#: Finding is what these runs check, not shrinking (see tests/test_parallel_racy.py).
FINDING_ONLY = Budgets(shrink_steps=100, shrink_examples=10)


class InFlight:
    """How many calls of the watched engines run at once, at most, since ``reset``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = 0
        self.most = 0

    def reset(self) -> None:
        with self._lock:
            self.now = self.most = 0

    def __enter__(self) -> None:
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self.now -= 1


IN_FLIGHT = InFlight()


class WatchedCounter(DecodeCounterLostUpdate):
    """The racy counter of decodes, its decodes watched (and long enough to overlap when the
    server lets them); it declares ``concurrent_calls`` as ``DECLARES`` says."""

    DECLARES: ClassVar[bool] = True

    def decode(self, request: DecodeRequest) -> StepResult:
        with IN_FLIGHT:
            time.sleep(0.01)
            return super().decode(request)

    def capabilities(self) -> EngineCapabilities:
        return replace(super().capabilities(), concurrent_calls=self.DECLARES)


class UndeclaredCounter(WatchedCounter):
    """The same engine with its declaration switched off."""

    DECLARES = False


class WatchedFake(FakeShardEngine):
    """The fake, every step it is sent watched (and giving up the interpreter, so that the calls of
    lanes overlap on the server when it lets them) before it takes its own lock."""

    def prefill(self, request: PrefillRequest) -> StepResult:
        with IN_FLIGHT:
            time.sleep(0)
            return super().prefill(request)

    def decode(self, request: DecodeRequest) -> StepResult:
        with IN_FLIGHT:
            time.sleep(0)
            return super().decode(request)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Callable[[object], EngineServer]]:
    """Serve a target on a Unix socket; every server is stopped and cached channels closed afterwards."""
    servers: list[EngineServer] = []
    IN_FLIGHT.reset()

    def start(target: object) -> EngineServer:
        server = serve(target, f"unix:{tmp_path / f'engine-{len(servers)}.sock'}")  # type: ignore[arg-type]
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(0)
    close_connections()


def fuzzed(target: str, seed: int, examples: int, concurrency: int, **options: object) -> FuzzResult:
    machine = build_machine(parse_target(target), MachineOptions(faults="none", concurrency=concurrency, **options))  # type: ignore[arg-type]
    run_settings = settings(max_examples=examples, stateful_step_count=20, database=None, deadline=None)
    try:
        return run_machine(machine, run_settings, seed=seed, out=None, minimize=False, budgets=FINDING_ONLY)
    finally:
        if machine._target.isolation is not None:
            machine._target.isolation.close()


def decode_from_threads(engine: RemoteShardEngine, decodes: int, epoch: int = 0) -> None:
    """Three threads, each decoding its own session (opened at ``epoch``) ``decodes`` times
    through one client."""
    for number, session in enumerate("abc"):
        assert engine.prefill(PrefillRequest(session, epoch, 0, token_ids=(number,))).status.ok
    failures: list[BaseException] = []

    def decode(session: str) -> None:
        try:
            for step in range(1, decodes + 1):
                result = engine.decode(DecodeRequest(session, epoch, step, token_ids=(step,)))
                assert result.status.code is StatusCode.OK, result.status
        except BaseException as error:  # reported by the test's thread
            failures.append(error)

    threads = [threading.Thread(target=decode, args=(session,)) for session in "abc"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures


# --- shardkit serve ------------------------------------------------------------------------


def test_serve_runs_calls_at_once_only_while_the_engine_declares_them(
    served: Callable[[object], EngineServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = RemoteShardEngine(served(WatchedCounter).url)
    engine.load(FULL)
    # Nothing declared yet: one at a time, and the racy count holds.
    decode_from_threads(engine, 4)
    assert IN_FLIGHT.most == 1
    assert engine.metrics().decode_calls == 12
    # Declared in its answer to capabilities(): the calls overlap (and the count may lose some).
    assert engine.capabilities().concurrent_calls
    IN_FLIGHT.reset()
    decode_from_threads(engine, 4, epoch=1)
    assert IN_FLIGHT.most >= 2
    # Taken back: one at a time again.
    monkeypatch.setattr(WatchedCounter, "DECLARES", False)
    assert not engine.capabilities().concurrent_calls
    IN_FLIGHT.reset()
    before = engine.metrics().decode_calls
    decode_from_threads(engine, 4, epoch=2)
    assert IN_FLIGHT.most == 1
    assert engine.metrics().decode_calls == before + 12


def test_the_racy_engine_with_its_declaration_off_is_called_one_at_a_time(
    served: Callable[[object], EngineServer],
) -> None:
    engine = RemoteShardEngine(served(UndeclaredCounter).url)
    engine.load(FULL)
    assert not engine.capabilities().concurrent_calls  # passed through as the engine answered
    decode_from_threads(engine, 5)
    assert IN_FLIGHT.most == 1
    assert engine.metrics().decode_calls == 15  # no update lost


def test_a_declaration_taken_back_waits_for_the_calls_already_running() -> None:
    slot = _Slot(FakeShardEngine())
    slot.declare(replace(FakeShardEngine().capabilities(), concurrent_calls=True))
    running, release = threading.Event(), threading.Event()
    order: list[str] = []

    def long_call() -> None:
        with slot.turn():
            running.set()
            release.wait(5)
            order.append("long call ends")

    def next_call() -> None:
        with slot.turn():
            order.append("next call runs")

    first = threading.Thread(target=long_call)
    first.start()
    assert running.wait(5)
    with slot.turn():  # declared: a second call runs beside the first
        order.append("beside")
    slot.declare(replace(FakeShardEngine().capabilities(), concurrent_calls=False))
    second = threading.Thread(target=next_call)
    second.start()
    second.join(0.2)
    assert second.is_alive(), "a call after the declaration was taken back ran beside a running one"
    release.set()
    first.join(5)
    second.join(5)
    assert order == ["beside", "long call ends", "next call runs"]
    slot.declare("not capabilities")  # an answer that is not EngineCapabilities declares nothing
    assert not slot.concurrent


def test_a_hung_workers_report_shows_the_thread_running_the_engine_not_one_waiting_its_turn() -> None:
    waiting = [
        "Thread 0x0001 (most recent call first):",
        '  File "/x/threading.py", line 331 in wait',
        '  File "/x/threading.py", line 359 in wait_for',
        '  File "/x/shardkit/_transport/server.py", line 108 in turn',
        '  File "/x/contextlib.py", line 137 in __enter__',
        '  File "/x/shardkit/_transport/server.py", line 321 in _run',
    ]
    running = [
        "Thread 0x0002 (most recent call first):",
        '  File "/x/engine.py", line 7 in decode',
        '  File "/x/shardkit/_transport/server.py", line 323 in _run',
    ]
    idle = ["Thread 0x0003 (most recent call first):", '  File "/x/threading.py", line 320 in wait']
    assert _engine_thread([*idle, *waiting, *running]) == tuple(running)
    assert _engine_thread([*idle, *waiting]) == tuple(waiting[:TAIL_LINES])
    assert _engine_thread(idle) == ()


def test_a_racy_engine_served_is_found_with_two_lanes_over_the_wire(
    served: Callable[[object], EngineServer],
) -> None:
    url = served(DecodeCounterLostUpdate).url
    for seed in (1, 2, 3):  # a race may not show at one seed on a busy machine
        result = fuzzed(url, seed, 30, 2)
        if result.failure is not None:
            break
    assert result.failure is not None, "the lost update was not found over the wire at seeds 1-3"
    assert result.failure.violation.property in DecodeCounterLostUpdate.PROPERTIES
    assert result.failure.records[-1].action.op == "parallel"


# --- the remote client ---------------------------------------------------------------------


@pytest.mark.parametrize(("concurrency", "seed"), [(2, 1), (2, 2), (3, 1), (3, 2)])
def test_the_served_fake_is_never_flagged_through_a_unix_socket(
    served: Callable[[object], EngineServer], concurrency: int, seed: int
) -> None:
    result = fuzzed(served(WatchedFake).url, seed, 8, concurrency)
    assert result.failure is None, result.failure.violation.message if result.failure else ""
    assert result.coverage[("decode", "OK")] > 0
    assert IN_FLIGHT.most >= 2, "no two calls of the lanes overlapped on the server"


def test_one_remote_engine_answers_three_threads_at_once_while_engines_come_and_go(
    served: Callable[[object], EngineServer],
) -> None:
    url = served(FakeShardEngine).url
    engine = RemoteShardEngine(url)
    engine.load(FULL)
    assert engine.capabilities().concurrent_calls  # the fake's declaration, passed through
    reference = FakeShardEngine()
    reference.load(FULL)
    answers: dict[str, list[object]] = {}
    failures: list[BaseException] = []

    def session(name: str, number: int) -> None:
        try:
            got = answers.setdefault(name, [])
            got.append(engine.prefill(PrefillRequest(name, 0, 0, token_ids=(number, 1))))
            for step in range(1, 9):
                got.append(engine.decode(DecodeRequest(name, 0, step, token_ids=(step + number,))))
                assert engine.capabilities().concurrent_calls
                assert engine.health().serving
                engine.metrics()
                RemoteShardEngine(url)  # built and dropped: closed on the server at a later NewEngine
        except BaseException as error:  # reported by the test's thread
            failures.append(error)

    threads = [threading.Thread(target=session, args=(name, number)) for number, name in enumerate("abc")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    for number, name in enumerate("abc"):  # each thread got its own session's answers
        expected = [reference.prefill(PrefillRequest(name, 0, 0, token_ids=(number, 1)))]
        expected += [reference.decode(DecodeRequest(name, 0, step, token_ids=(step + number,))) for step in range(1, 9)]
        assert answers[name] == expected
    assert engine.metrics() == reference.metrics()


# --- isolation -----------------------------------------------------------------------------


def test_a_racy_engine_is_found_through_isolate_with_two_lanes() -> None:
    for seed in (1, 2, 3):
        result = fuzzed("shardkit._planted.racy:DecodeCounterLostUpdate", seed, 30, 2, isolate=True)
        if result.failure is not None:
            break
    assert result.failure is not None, "the lost update was not found in a worker at seeds 1-3"
    assert result.failure.violation.property in DecodeCounterLostUpdate.PROPERTIES
    assert result.failure.records[-1].action.op == "parallel"


def test_the_fake_isolated_with_lanes_passes_from_the_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    argv = ["fuzz", "shardkit:FakeShardEngine", "--isolate", "--concurrency", "2", "--seed", "1"]
    code = main([*argv, "--examples", "10", "--steps", "20", "--faults", "none"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "no failure found" in out


@pytest.mark.parametrize(
    ("engine", "cancelled", "dies"),
    [(SegfaultsOnDecodeAfterCancel, True, "A1"), (HangsOnSecondDecode, False, "A2")],
    ids=lambda value: getattr(value, "__name__", None),
)
def test_a_worker_death_in_a_lane_is_the_failure_a_sequential_step_gets(
    engine: type[DyingEngine], cancelled: bool, dies: str
) -> None:
    """Lane A's call kills the worker (a read of address 0; a hang past the deadline). The
    failure is the death's, naming lane A's call; lane B's call, if it was running then and
    failed with the worker, is named with it, not reported as a failure of its own; the next
    engine comes from a fresh worker."""
    options = IsolationOptions(engine.STEP_TIMEOUT or 5.0)
    target = isolated_target(f"shardkit._planted.dying:{engine.__name__}", options)
    assert target.isolation is not None
    try:
        driver = Driver(target, FULL, twins=False)
        driver.execute(step_action("prefill", "a", 0, 0, (1, 2)))
        driver.execute(step_action("prefill", "b", 0, 0, (3, 2)))
        if cancelled:
            driver.execute(Action("cancel", {"session": "a", "epoch": 0}))
        lane_a = [step_action("decode", "a", 0, step, (5,)) for step in (1, 2)]
        lane_b = [step_action("decode", "b", 0, 1, (6,))]
        with pytest.raises(StepFailed) as failed:
            run_parallel(driver, [lane_a, lane_b])
        violation, record = failed.value.violation, failed.value.record
        assert violation.property == engine.PROPERTY, violation.message
        assert record.action.op == "parallel"
        assert record.expected == "an answer"
        assert record.observed.startswith(
            f"engine process {'killed by SIGSEGV' if cancelled else f'missed its {engine.STEP_TIMEOUT:g} s'}"
        )
        assert f"during step {record.index}, a parallel phase: no answer to " in record.observed
        assert f"{dies} decode(session='a', epoch=0, step={dies[1]}, tokens=[5])" in record.observed
        # Named: each lane's first call without an answer (its later calls found the worker gone).
        unanswered = [line.split()[0] for line in violation.message.splitlines() if line.endswith("→ no answer")]
        first_in_lane = {name[0]: name for name in reversed(unanswered)}
        assert re.findall(r"\b([AB]\d) decode\(", record.observed) == sorted(first_in_lane.values())
        assert "its output ended with:" in violation.message
        assert "unexplained exception" not in violation.message
        assert "RemoteUnavailable" not in violation.message
        assert driver.records[-1] is record
        after = Driver(target, FULL, twins=False)  # a fresh worker serves the next engine
        assert after.execute(step_action("prefill", "a", 0, 0, (1,))).outcome == "OK"
    finally:
        target.isolation.close()
