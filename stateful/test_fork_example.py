"""A second worked example: a backend with ``fork`` (prefix sharing), on the public API only.

Our imaginary backend adds ``fork(session_id, epoch, new_session_id) -> StructuredStatus``:
copy a live session's KV state into a new session id, so the new session continues
from the same history without recomputing it (as a server does for parallel sampling
or beam search over one prompt). The semantics, which the model below encodes:

- **What is copied.** The new session gets the source's epoch, its next step and its
  whole history: its next prefill or decode is step ``next_step`` of that epoch, a HIT,
  and its outputs are those of the source's history followed by its own inputs. From
  then on the two sessions are independent: a step, cancel, restart or release of one
  never changes the other.
- **Costs.** The copy is a copy: it holds a session slot and as many KV tokens as the
  source (``metrics().kv_tokens`` counts both). A fork that would exceed
  ``max_sessions`` or the current KV limit is ``RESOURCE_EXHAUSTED``, retryable, and
  changes nothing.
- **Retries.** A fork is not a step of the new session: it has accepted no request yet,
  so nothing sent to it is an idempotent retry (rule 6) until it accepts one of its own;
  a repeat of the source's last step, addressed to the new id, is FAILED_PRECONDITION.
- **Refusals**, in this order: UNAVAILABLE before load; INVALID_ARGUMENT for an empty id
  or a fork onto itself; NOT_FOUND for an unknown source or an epoch ahead of it;
  ABORTED for a stale epoch; CANCELLED for a cancelled source; FAILED_PRECONDITION when
  the new id is already held (release it first); RESOURCE_EXHAUSTED as above.

The pieces, as in ``stateful/test_extending_rules.py`` (docs/extending.md explains each):

1. the **engine** — the fake wrapped in a ``RecordingEngine`` (which keeps each session's
   accepted steps) that implements ``fork`` by replaying the source's accepted steps
   under the new id with ``inner_step`` (a real backend copies KV blocks; replaying gives
   the same observable result), which hides those calls from ``metrics()``;
2. the **model** — ``ForkModel(ReferenceModel)`` with a ``fork`` rule returning a
   ``Prediction`` and opening the new session with ``set_session``;
3. the **step** — a ``CustomOp`` calling ``engine.fork`` and ``model.fork`` from the
   step's plain arguments;
4. the **rule** — ``ForkMachine(ShardMachine)`` with ``custom_ops`` and a ``@step_rule``
   drawing three small integers, 0 the simplest (the first live session, forked at its
   epoch onto an id nobody holds).

The planted bug at the end, ``ForkSharesRecord``, gives the copy a reference to the
source's list of accepted steps instead of a copy of the list, so a later step on either
session is recorded for both. Its shortest failing sequences are four steps long — open
the source, fork it, one step on one of the two, then either

- one step on the other: if the source stepped first, the shared list makes the copy's
  first own step look like a repeat of a step it never took, and the engine refuses what
  the model admits (property "§2 rule 8"); or
- a fork of the session that did not step: it replays the other one's step too, and its
  copy holds one KV token too many ("§2 metrics").

The test fuzzes it at three seeds and checks that each run reports one of these.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, ClassVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st

from shardkit import (
    AcceptedSteps,
    Action,
    CacheResult,
    CustomOp,
    DecodeRequest,
    FakeShardEngine,
    FuzzResult,
    Prediction,
    PrefillRequest,
    RecordingEngine,
    ReferenceModel,
    SessionState,
    ShardMachine,
    StatusCode,
    StepResult,
    StructuredStatus,
    fuzz,
    machine_for,
    replay,
    step_rule,
)

StepRequest = PrefillRequest | DecodeRequest

# --- the backend: the fake, plus fork -----------------------------------------------------------


def _addressed_to(request: StepRequest, session_id: str) -> StepRequest:
    """``request`` as if it had been sent to ``session_id`` (its bundle too, for a middle or tail)."""
    bundle = request.bundle if request.bundle is None else replace(request.bundle, session_id=session_id)
    return replace(request, session_id=session_id, bundle=bundle)


class ForkEngine(RecordingEngine[FakeShardEngine]):
    """The fake engine plus ``fork``, implemented by sending the source's steps again.

    ``RecordingEngine`` keeps what each session accepted in its epoch (``self.accepted``),
    hides the steps ``inner_step`` sends from ``metrics()``, and leaves only
    ``memory_pressure`` native: the kit injects the other faults at its boundary, where
    the calls fork makes itself cannot spend them."""

    def __init__(self) -> None:
        super().__init__(FakeShardEngine())
        #: Sessions opened by a fork that have accepted no step of their own yet: no request
        #: sent to one is a retry (an id leaves the set at its first accepted step).
        self.forked: set[str] = set()

    def fork(self, session_id: str, epoch: int, new_session_id: str) -> StructuredStatus:
        if not self.inner.health().serving:
            return StructuredStatus(StatusCode.UNAVAILABLE, "fork before load; call load() first")
        if not session_id or not new_session_id:
            return StructuredStatus(StatusCode.INVALID_ARGUMENT, "a session id is empty; pass non-empty ids")
        if new_session_id == session_id:
            return StructuredStatus(StatusCode.INVALID_ARGUMENT, f"cannot fork {session_id!r} onto itself")
        source = self.accepted.get(session_id)
        if source is None or epoch > source.epoch:
            return StructuredStatus(StatusCode.NOT_FOUND, f"session {session_id!r} has no epoch {epoch}")
        if epoch < source.epoch:
            return StructuredStatus(StatusCode.ABORTED, f"epoch {epoch} is stale: {session_id!r} is at {source.epoch}")
        if source.cancelled:
            return StructuredStatus(StatusCode.CANCELLED, f"session {session_id!r} was cancelled")
        if new_session_id in self.accepted:
            return StructuredStatus(StatusCode.FAILED_PRECONDITION, f"{new_session_id!r} is held; release it first")
        for request in source.requests:
            result = self.inner_step(_addressed_to(request, new_session_id))
            if not result.status.ok:  # no slot or no room: undo the partial copy
                self.inner.release(new_session_id)
                return result.status
        self.accepted[new_session_id] = AcceptedSteps(source.epoch, self._copy(source.requests))
        self.forked.add(new_session_id)
        return StructuredStatus(StatusCode.OK)

    def _copy(self, requests: list[StepRequest]) -> list[StepRequest]:
        return list(requests)

    def record_step(self, request: StepRequest, result: StepResult) -> StepResult:
        copy = self.accepted.get(request.session_id)
        if (
            result.status.ok
            and request.session_id in self.forked
            and copy is not None
            and request.epoch == copy.epoch
            and request.step < len(copy.requests)
        ):  # the inner engine took it for a retry of a step this session never took
            message = f"step {request.step} does not follow: {request.session_id!r} expects {len(copy.requests)}"
            return StepResult(StructuredStatus(StatusCode.FAILED_PRECONDITION, message), CacheResult.MISS)
        if result.status.ok:
            self.forked.discard(request.session_id)
        return super().record_step(request, result)


# --- the model ------------------------------------------------------------------------------------


class ForkModel(ReferenceModel):
    """``ReferenceModel`` plus the fork rule of the module docstring."""

    def fork(self, session_id: str, epoch: int, new_session_id: str) -> Prediction:
        def verdict(code: StatusCode, because: str, *, retryable: bool = False) -> Prediction:
            return Prediction(op="fork", code=code, rule="fork", because=because, retryable=retryable)

        caps = self.capabilities
        if caps is None:
            return verdict(StatusCode.UNAVAILABLE, "the engine is not loaded")
        if not session_id or not new_session_id:
            return verdict(StatusCode.INVALID_ARGUMENT, "empty session id")
        if new_session_id == session_id:
            return verdict(StatusCode.INVALID_ARGUMENT, f"a fork of {session_id!r} onto itself")
        source = self.sessions.get(session_id)
        if source is None or epoch > source.epoch:
            return verdict(StatusCode.NOT_FOUND, f"session {session_id!r} has no epoch {epoch}")
        if epoch < source.epoch:
            return verdict(StatusCode.ABORTED, f"epoch {epoch} is stale: {session_id!r} is at epoch {source.epoch}")
        if source.cancelled:
            return verdict(StatusCode.CANCELLED, f"session {session_id!r} was cancelled")
        if new_session_id in self.sessions:
            return verdict(StatusCode.FAILED_PRECONDITION, f"{new_session_id!r} is held by a session")
        if len(self.sessions) >= caps.max_sessions:
            return verdict(StatusCode.RESOURCE_EXHAUSTED, f"all {caps.max_sessions} slots are held", retryable=True)
        # max_kv_tokens, not caps.max_kv_tokens: a memory_pressure fault lowers the model's limit.
        if self.kv_tokens + source.kv_tokens > self.max_kv_tokens:
            because = f"{self.kv_tokens} cached + {source.kv_tokens} copied > max_kv_tokens {self.max_kv_tokens}"
            return verdict(StatusCode.RESOURCE_EXHAUSTED, because, retryable=True)
        copy = SessionState(
            epoch=source.epoch,
            next_step=source.next_step,
            kv_tokens=source.kv_tokens,
            history=source.history,  # what the copy's outputs must agree with: the source's history, then its own
        )  # no last_request: the copy has accepted no step, so nothing sent to it is a retry yet
        self.set_session(new_session_id, copy)
        return verdict(StatusCode.OK, f"{new_session_id!r} continues {session_id!r} at step {source.next_step}")


# --- the step and the rule ------------------------------------------------------------------------


def _call_fork(engine: ForkEngine, args: Mapping[str, Any]) -> StructuredStatus:
    return engine.fork(args["session"], args["epoch"], args["new_session"])


def _predict_fork(model: ForkModel, args: Mapping[str, Any]) -> Prediction:
    return model.fork(args["session"], args["epoch"], args["new_session"])


class ForkMachine(ShardMachine):
    custom_ops: ClassVar[Mapping[str, CustomOp[ForkEngine, ForkModel]]] = {
        "fork": CustomOp(_call_fork, _predict_fork, engine_type=ForkEngine, model_type=ForkModel)
    }
    model_factory = ForkModel

    @step_rule(session=st.integers(0, 7), new=st.integers(0, 3), epoch=st.integers(0, 3))
    def fork(self, session: int, new: int, epoch: int) -> None:
        """Fork a session (``session`` as the built-in rules pick one: 0-5 live, 6-7 unknown)
        onto ``new``: 0-2 an id no session holds, 3 the oldest live session's (refused); at
        the source's epoch (``epoch`` 0-2: the case that copies, made the likeliest), or
        (3) one below it, or one above when it is at epoch 0 (refused)."""
        source = self.session_id(session)
        target = self.session_id(6 + new) if new < 3 else self.session_id(0)
        state = self.sessions.get(source)
        at = state.epoch if state is not None else 0
        if epoch == 3:
            at = at - 1 if at > 0 else 1
        self.run(Action("fork", {"session": source, "epoch": at, "new_session": target}))


CI_SETTINGS = settings(settings.get_profile("shardkit-ci"), database=None)
_machine = machine_for(ForkEngine, role="full", base=ForkMachine, name="Fork")
_machine.TestCase.settings = CI_SETTINGS
TestForkBackend = _machine.TestCase


# --- the new rule finds a bug in the new operation ------------------------------------------------


class ForkSharesRecord(ForkEngine):
    """Planted bug: the copy shares the source's list of accepted steps instead of copying
    it, so a later step on either session is recorded for both, and a later fork of the
    copy replays a step the copy never took (one KV token too many)."""

    def _copy(self, requests: list[StepRequest]) -> list[StepRequest]:
        return requests


#: The shortest sequences that show the bug (see the module docstring): open the source, fork
#: it, one step on one of the two, then one step on the other or a fork of the other.
MINIMAL_STEPS = 4
SEEDS = (1, 2, 3)
#: Enough for every seed to meet the bug: a run stops at its first failing example (the
#: seeds above meet it within their first 200).
EXAMPLES = 1000


@pytest.fixture(scope="module")
def planted_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, FuzzResult]:
    """The planted bug fuzzed at each seed, its trace written (to replay it against the fix)."""
    return {
        seed: fuzz(
            ForkSharesRecord,
            seed=seed,
            examples=EXAMPLES,
            steps=50,
            role="full",
            base=ForkMachine,
            out=tmp_path_factory.mktemp(f"fork-seed-{seed}"),
        )
        for seed in SEEDS
    }


@pytest.mark.parametrize("seed", SEEDS)
def test_the_fork_rule_finds_the_shared_record_and_shrinks_it_to_four_steps(
    seed: int, planted_runs: dict[int, FuzzResult]
) -> None:
    result = planted_runs[seed]
    assert result.failure is not None, f"seed {seed}: no failure in {result.examples} examples"
    records = result.failure.records
    print(f"seed {seed}: {result.failure.violation.property} in {len(records)} steps")
    for record in records:
        print(f"  {record.action.describe()}")
    assert len(records) == MINIMAL_STEPS, [record.action.describe() for record in records]
    opened, forked, stepped, last = (record.action for record in records)
    assert (opened.op, forked.op) == ("prefill", "fork")
    pair = {forked.args["session"], forked.args["new_session"]}
    assert opened.args["session"] == forked.args["session"]
    assert stepped.op in ("prefill", "decode")
    assert stepped.args["session"] in pair
    (other,) = pair - {stepped.args["session"]}
    if result.failure.violation.property == "§2 rule 8":  # the copy's first own step, refused
        assert stepped.args["session"] == forked.args["session"]
        assert last.op in ("prefill", "decode")
        assert last.args["session"] == other
    else:  # a fork of the session that did not step copies the other's step too
        assert result.failure.violation.property == "§2 metrics"
        assert last.op == "fork"
        assert last.args["session"] == other


def test_the_same_steps_pass_on_the_correct_engine(planted_runs: dict[int, FuzzResult]) -> None:
    """The failing sequence replays against ``ForkEngine`` (the fix) without any violation."""
    trace = planted_runs[SEEDS[0]].trace_path
    assert trace is not None
    assert replay(trace, ForkSharesRecord, model=ForkModel, custom_ops=ForkMachine.custom_ops).reproduced
    fixed = replay(trace, ForkEngine, model=ForkModel, custom_ops=ForkMachine.custom_ops)
    assert fixed.failure is None, fixed.failure
    assert len(fixed.records) == MINIMAL_STEPS
