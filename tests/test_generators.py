"""The generators reach the states where real engines break: sizes from the engine's own
capabilities, long sessions, prefix families, every session id, ghosts of gone sessions,
and epochs that shrink to 0."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit import FakeShardEngine, machine_for
from shardkit._core.steps import synthetic_bundle, synthetic_rows
from shardkit._machine.state_machine import SESSION_IDS, ShardMachine
from shardkit._run.report import LONG_SESSION_DECODES, long_session_share, session_histogram
from shardkit._run.runner import fuzz
from shardkit.contract import (
    RESIDUAL_TENSOR,
    DecodeRequest,
    EngineTensor,
    LoadRequest,
    PrefillRequest,
    StatusCode,
    StepResult,
)
from shardkit.engines.fake import FakeShardEngineConfig
from tests.planted import PlantedEngine


def big_fake() -> FakeShardEngine:
    """A fake with the budget of a small real engine."""
    return FakeShardEngine(FakeShardEngineConfig(max_kv_tokens=4096, vocab_size=50_000, max_sessions=8))


def started(target: object = FakeShardEngine, faults: str = "none") -> ShardMachine:
    """A machine for ``target`` with its engine loaded, as the minimiser replays one."""
    machine = machine_for(target, role="full", faults=faults)()
    machine.load_engine(layout=0)
    return machine


def last_action(machine: ShardMachine) -> tuple[str, dict[str, object], str]:
    record = machine._driver.records[-1]
    return record.action.op, dict(record.action.args), record.outcome


def test_chunk_lengths_are_sized_to_the_engine() -> None:
    small, big = started(), started(big_fake)
    assert [small._chunk_length(code, small.room()) for code in range(8)] == [1, 2, 3, 8, 17, 32, 64, 65]
    assert [big._chunk_length(code, big.room()) for code in range(8)] == [1, 2, 3, 8, 1025, 2048, 4096, 4097]
    big.prefill(session=0, chunk=5)  # 2 048 tokens: a long prefill is one small integer away
    assert last_action(big)[2] == "OK"
    assert big._driver.model.kv_tokens == 2048
    # "Exactly the remaining budget" follows what is left, and fills it.
    big.prefill(session=0, chunk=6)
    assert last_action(big)[2] == "OK"
    assert big._driver.model.kv_tokens == 4096


def test_one_small_integer_fills_the_fakes_budget_exactly() -> None:
    """The planted capacity bugs rely on it: prefill(b, tokens=64 of them) is chunk code 6."""
    machine = started()
    assert len(machine.chunk(6, "a")) == machine._driver.caps.max_kv_tokens


def test_chunks_make_prefix_families_repeats_and_use_both_ends_of_the_vocabulary() -> None:
    machine = started(big_fake)
    vocab = machine._driver.caps.vocab_size
    machine.prefill(session=0, chunk=3)  # 'a': the low ramp, 8 tokens
    a = machine.history_tokens("a")
    assert a == (0, 3, 6, 9, 12, 15, 18, 21)
    machine.prefill(session=6, chunk=3 * 8 + 3)  # 'b': follows a's history, then differs
    b = machine.history_tokens("b")
    assert len(b) == len(a)
    assert b[:7] == a[:7]
    assert b[7] != a[7]
    repeats = machine.chunk(2 * 8 + 3, "c")
    assert repeats == (0, 0, vocab - 1, 0, 0, vocab - 1, 0, 0)
    assert machine.chunk(8, "c") == (vocab - 1,)
    # A continuation follows the longer history from where the shorter one ends.
    machine.prefill(session=0, chunk=8 * 3 + 2)  # 'a' grows by 3 (no longer history to follow: the ramp's)
    following = machine.chunk(8 * 3 + 1, "b")
    assert following[:1] == machine.history_tokens("a")[8:9]


def test_every_session_id_is_one_step_away_while_unknown() -> None:
    machine = started(FakeShardEngine)
    machine.prefill(session=0, chunk=0)  # 'a' is live
    machine.prefill(session=6, chunk=0)  # 'b' is live
    reached = {machine.session_id(choice) for choice in range(6, 14)}
    assert reached == set(SESSION_IDS) - {"a", "b"}
    assert SESSION_IDS[2:5] == ("req-0001", "req-00010", "req-0001/retry")  # the ones sharing a prefix open together


def test_an_example_of_the_family_pool_holds_only_ids_that_share_a_prefix() -> None:
    """Swarm-style focus: the second pool's sessions are all of one family, so a cancel of
    ``req-0001`` while ``req-00010`` is live is three steps away with any choices."""
    machine = machine_for(FakeShardEngine, role="full", faults="none")()
    machine.load_engine(layout=0, id_pool=1)
    for choice in (0, 6, 13):
        machine.prefill(session=choice, chunk=0)
    assert list(machine.sessions) == ["req-0001", "req-00010", "req-0001/retry"]
    # Every id of the pool is live: every choice, however high, names one of them.
    assert {machine.session_id(choice) for choice in range(14)} == set(machine.sessions)
    machine.cancel(session=0, epoch_choice=0)
    assert last_action(machine) == ("cancel", {"session": "req-0001", "epoch": 0}, "OK")


def test_most_cancels_name_the_session_at_its_own_epoch() -> None:
    """Five of a cancel's eight choices are the session's own epoch: with one in four, 33 of
    1 000 cancels of a run were accepted, and bugs that follow a cancel went unseen."""
    machine = started(FakeShardEngine)
    machine.restart(session=0, jump=1, chunk=0)  # 'a' opens at epoch 1
    epochs = []
    for choice in range(8):
        machine.cancel(session=0, epoch_choice=choice)
        _, args, _ = last_action(machine)
        epochs.append(args["epoch"] if args["session"] else "empty id")
    assert epochs == [1, 1, 1, 1, 1, 0, 2, "empty id"]


def test_decode_run_grows_one_session_long_in_one_rule_one_step_per_call() -> None:
    machine = started()
    machine.prefill(session=0, chunk=0)
    before = len(machine._driver.records)
    machine.decode_run(session=0, length=2, token=0)
    assert len(machine._driver.records) - before == 32
    assert machine.position("a") == (0, 33)
    machine.decode_run(session=0, length=3, token=0)  # as many as the budget leaves room for
    assert machine._driver.model.kv_tokens == machine._driver.caps.max_kv_tokens
    assert machine._stats.longest_session == {63: 1}


def test_a_restart_of_an_unknown_id_opens_at_epoch_0_when_it_shrinks_to_0() -> None:
    machine = started()
    machine.restart(session=0, jump=0, chunk=0)
    assert last_action(machine)[1]["epoch"] == 0
    machine.restart(session=6, jump=1, chunk=0)
    assert last_action(machine)[1]["epoch"] == 1
    machine.restart(session=0, jump=0, chunk=0)  # a known id goes up by one
    assert last_action(machine)[1]["epoch"] == 1


def test_resend_sends_a_ghost_of_a_released_session_and_of_one_lost_in_a_crash() -> None:
    machine = started(faults="crash")
    machine.prefill(session=0, chunk=0)
    machine.decode(session=0, token=0)
    machine.release(session=0)
    machine.resend(session=0, back=0)  # no session is live: the ghost of 'a'
    op, args, outcome = last_action(machine)
    assert (op, args["session"], args["epoch"], args["step"], outcome) == ("decode", "a", 0, 1, "NOT_FOUND")
    machine.prefill(session=0, chunk=0)
    machine.decode(session=0, token=1)
    machine.inject_fault(kind=0, value=0)  # the engine dies at its next call
    machine.decode(session=0, token=2)
    assert last_action(machine)[2] == "CRASH"
    assert not machine._driver.logs  # the restarted engine's logs start again...
    machine.resend(session=0, back=0)  # ...the machine's do not: the decode lost in the crash
    op, args, outcome = last_action(machine)
    assert (op, args["session"], args["epoch"], args["step"], outcome) == ("decode", "a", 0, 2, "NOT_FOUND")
    machine.resend(session=0, back=1)  # further back: the decode before it
    assert last_action(machine)[1]["step"] == 1


class ServesPreCrashRequests(PlantedEngine):
    """An answer cache that outlives the process (kept outside it, as in a shared store):
    after a crash, a request the dead engine served is answered again from that cache
    instead of NOT_FOUND. Only a ghost reaches it: the exact request, from before the crash."""

    BUG = "a request served before a crash is served again after it, from a cache that outlived the process"
    PROPERTY = "§2 rule 3"
    #: What the dying engine leaves behind for the one started after it.
    outlived: ClassVar[dict[object, StepResult] | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.inherited, ServesPreCrashRequests.outlived = ServesPreCrashRequests.outlived or {}, None
        self.answers: dict[object, StepResult] = {}

    def decode(self, request: DecodeRequest) -> StepResult:
        return self._serve(request, self.inner.decode)

    def prefill(self, request: PrefillRequest) -> StepResult:
        return self._serve(request, self.inner.prefill)

    def _serve(self, request: DecodeRequest | PrefillRequest, call: Callable[[Any], StepResult]) -> StepResult:
        try:
            result = call(request)
        except BaseException:
            ServesPreCrashRequests.outlived = {**self.inherited, **self.answers}
            raise
        if result.status.code is StatusCode.NOT_FOUND and request in self.inherited:
            return self.inherited[request]
        if result.status.ok:
            self.answers[request] = result
        return result


def test_an_engine_whose_answers_outlive_a_crash_is_found_by_a_ghost() -> None:
    result = fuzz(ServesPreCrashRequests, seed=3, examples=200, steps=50, role="full", faults="crash", minimize=False)
    assert result.failure is not None
    assert result.failure.violation.property.startswith("§2 rule 3"), result.failure.violation.message
    outcomes = [record.outcome for record in result.failure.records]
    assert "CRASH" in outcomes  # the ghost is from before a crash
    assert result.failure.records[-1].action.op == "decode"


def test_at_least_a_tenth_of_the_fakes_examples_reach_a_session_of_32_decodes() -> None:
    result = fuzz(FakeShardEngine, seed=1, examples=200, steps=50, role="full", faults="all")
    assert result.failure is None
    share = long_session_share(result)
    assert share >= 0.10, session_histogram(result)
    assert sum(session_histogram(result).values()) == result.examples
    assert LONG_SESSION_DECODES == 32


@given(
    hidden_size=st.integers(1, 300),
    dtype=st.sampled_from(["float32", "float16", "float64"]),
    tokens=st.lists(st.integers(0, 100_000), min_size=1, max_size=70).map(tuple),
)
@settings(deadline=None, max_examples=300)
def test_a_synthetic_bundle_holds_synthetic_rows_bit_for_bit(
    hidden_size: int, dtype: str, tokens: tuple[int, ...]
) -> None:
    """A middle or tail is sent each token's row from a cache of rows; the rows are those of
    ``synthetic_rows``, computed for the whole chunk at once, bit for bit."""
    engine = FakeShardEngine()
    engine.load(LoadRequest("m", 1, 3, 4))
    caps = dataclasses.replace(engine.capabilities(), hidden_size=hidden_size, dtype=dtype)
    bundle = synthetic_bundle(caps, "s", 0, 0, tokens)
    assert bundle.tensors == (EngineTensor.from_array(RESIDUAL_TENSOR, synthetic_rows(caps, tokens)),)
