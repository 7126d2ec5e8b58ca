"""``assert_shard_engine_contract``: a quick, fixed list of lifecycle checks.

Each check builds a fresh engine, drives a short scripted sequence through
it and through the reference model side by side, and compares every status,
retryable flag, cache result and output. It is the static counterpart of the
fuzzing machine: fast, readable, and a good first gate for a new engine.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from shardkit._core.checks import Tolerance, metrics_text, output_problems, payload_difference, payloads_of
from shardkit._core.model import Prediction, ReferenceModel, StepRequest
from shardkit._core.properties import read_more
from shardkit._core.steps import synthetic_bundle
from shardkit._core.targets import EngineFactory, Isolation
from shardkit._public import settle
from shardkit.contract import (
    BoundaryBundle,
    DecodeRequest,
    EngineError,
    LoadRequest,
    PrefillRequest,
    Role,
    StepResult,
    TokenOutput,
    role_of,
)
from shardkit.errors import ContractViolation, InvalidTarget

__all__ = ["CONTRACT_CHECKS", "assert_shard_engine_contract"]


class _RoleNotServed(Exception):
    """The engine refused to load a sub-range: contract §1 allows that, so the role's check is skipped."""


class _CheckFailed(Exception):
    """``call``: what was done; then what the contract expects and what the engine did."""

    def __init__(self, call: str, expected: str, observed: str) -> None:
        super().__init__(f"{call}: expected {expected}; observed {observed}")


def _describe_step(request: StepRequest) -> str:
    op = "prefill" if isinstance(request, PrefillRequest) else "decode"
    if request.token_ids is not None:
        inputs = f"token_ids={list(request.token_ids)}"
    else:
        assert request.bundle is not None
        inputs = f"bundle of {request.bundle.tensors[0].shape[0]} rows"
    return f"{op}(session={request.session_id!r}, epoch={request.epoch}, step={request.step}, {inputs})"


def _describe_result(result: StepResult) -> str:
    retry = " retryable" if result.status.retryable else ""
    return f"{result.status.code.name}/{result.cache.name}{retry}"


class _Probe:
    """An engine loaded for one role, driven in step with the reference model."""

    def __init__(self, make_engine: EngineFactory, role: Role = "full") -> None:
        self.engine = make_engine()
        largest = self.engine.capabilities()
        start, end = _range_for(role, largest.total_layers)
        request = LoadRequest("shardkit-contract", start, end, largest.total_layers)
        loaded = self.engine.load(request)
        if not loaded.status.ok:
            raise _CheckFailed(
                f"load(layers {start}..{end})", "OK", f"{loaded.status.code.name} {loaded.status.message!r}"
            )
        self.caps = self.engine.capabilities()
        self.model = ReferenceModel()
        self.model.load(self.caps)

    def prefill(self, session_id: str, epoch: int, step: int, count: int = 1, first: int = 1) -> StepResult:
        return self.send(PrefillRequest(session_id, epoch, step, *self._inputs(session_id, epoch, step, count, first)))

    def decode(self, session_id: str, epoch: int, step: int, first: int = 1) -> StepResult:
        return self.send(DecodeRequest(session_id, epoch, step, *self._inputs(session_id, epoch, step, 1, first)))

    def send(self, request: StepRequest) -> StepResult:
        if isinstance(request, PrefillRequest):
            predicted, observed = self.model.prefill(request), self.engine.prefill(request)
        else:
            predicted, observed = self.model.decode(request), self.engine.decode(request)
        _compare(_describe_step(request), predicted, observed)
        problems = output_problems(self.caps, request, observed)
        if problems:
            raise _CheckFailed(_describe_step(request), "a well-formed output", "; ".join(problems))
        return observed

    def cancel(self, session_id: str, epoch: int) -> None:
        predicted, observed = self.model.cancel(session_id, epoch), self.engine.cancel(session_id, epoch)
        if observed.code is not predicted.code:
            call = f"cancel(session={session_id!r}, epoch={epoch})"
            raise _CheckFailed(call, str(predicted), f"{observed.code.name} {observed.message!r}")

    def release(self, session_id: str) -> None:
        predicted, observed = self.model.release(session_id), self.engine.release(session_id)
        if observed.code is not predicted.code:
            call = f"release(session={session_id!r})"
            raise _CheckFailed(call, str(predicted), f"{observed.code.name} {observed.message!r}")

    def expect_metrics(self, when: str, rule: str = "every call counts, refused ones and retries included") -> None:
        """All four counters against the reference model's, which counted every call sent so far."""
        observed, expected = self.engine.metrics(), self.model.expected_metrics()
        if observed != expected:
            names = ("prefill_calls", "decode_calls", "active_sessions", "kv_tokens")
            differ = [name for name in names if getattr(observed, name) != getattr(expected, name)]
            raise _CheckFailed(
                f"metrics() {when}",
                f"{metrics_text(expected)} by §2 metrics ({rule})",
                f"{metrics_text(observed)} ({', '.join(differ)} {'differs' if len(differ) == 1 else 'differ'})",
            )

    def _inputs(
        self, session_id: str, epoch: int, step: int, count: int, first: int
    ) -> tuple[tuple[int, ...] | None, BoundaryBundle | None]:
        return self.inputs_of(
            session_id, epoch, step, tuple((first + index) % self.caps.vocab_size for index in range(count))
        )

    def inputs_of(
        self, session_id: str, epoch: int, step: int, token_ids: tuple[int, ...]
    ) -> tuple[tuple[int, ...] | None, BoundaryBundle | None]:
        """A step's inputs for ``token_ids``: the tokens themselves for a head or full shard,
        else the bundle a head would send for them."""
        if self.caps.role in ("head", "full"):
            return token_ids, None
        return None, synthetic_bundle(self.caps, session_id, epoch, step, token_ids)


def _compare(call: str, predicted: Prediction, observed: StepResult) -> None:
    status = observed.status
    if (status.code, status.retryable, observed.cache) != (predicted.code, predicted.retryable, predicted.cache):
        message = status.message and f" {status.message!r}"
        raise _CheckFailed(call, str(predicted), f"{_describe_result(observed)}{message}")


def _range_for(role: Role, total_layers: int) -> tuple[int, int]:
    last = total_layers - 1
    ranges = {"full": (0, last), "head": (0, 0), "tail": (last, last), "middle": (1, last - 1)}
    return ranges[role]


# --- the checks --------------------------------------------------------------------------


def _health_and_capabilities(make_engine: EngineFactory) -> None:
    engine = make_engine()
    if engine.health().serving:
        raise _CheckFailed("health() before load", "serving=False", "serving=True")
    largest = engine.capabilities()
    if role_of(largest.shard_start, largest.shard_end, largest.total_layers) != "full":
        raise _CheckFailed(
            "capabilities() before load",
            f"the largest range, layers 0..{largest.total_layers - 1}",
            f"layers {largest.shard_start}..{largest.shard_end}",
        )
    probe = _Probe(lambda: engine, "full")
    if not probe.engine.health().serving:
        raise _CheckFailed("health() after load", "serving=True", "serving=False")
    if (probe.caps.shard_start, probe.caps.shard_end) != (0, largest.total_layers - 1):
        raise _CheckFailed(
            "capabilities() after a full load",
            f"layers 0..{largest.total_layers - 1}",
            f"layers {probe.caps.shard_start}..{probe.caps.shard_end}",
        )
    probe.expect_metrics("right after load")


def _prefill_then_decode_hits(make_engine: EngineFactory) -> None:
    probe = _Probe(make_engine)
    probe.prefill("a", 0, 0, count=3)
    probe.decode("a", 0, 1)
    probe.decode("a", 0, 2)


def _decode_unknown_session(make_engine: EngineFactory) -> None:
    probe = _Probe(make_engine)
    probe.decode("never-opened", 0, 1)


def _stale_epoch_aborted(make_engine: EngineFactory) -> None:
    probe = _Probe(make_engine)
    probe.prefill("a", 0, 0, count=2)
    probe.prefill("a", 1, 0, count=2)
    probe.decode("a", 0, 1)
    probe.prefill("a", 0, 0, count=2)


def _cancel_then_decode(make_engine: EngineFactory) -> None:
    probe = _Probe(make_engine)
    probe.prefill("a", 0, 0, count=2)
    probe.cancel("a", 0)
    probe.decode("a", 0, 1)
    probe.cancel("a", 0)


def _release_then_decode(make_engine: EngineFactory) -> None:
    probe = _Probe(make_engine)
    probe.prefill("a", 0, 0, count=2)
    probe.release("a")
    probe.decode("a", 0, 1)
    probe.release("a")


def _retry_is_idempotent(make_engine: EngineFactory) -> None:
    probe = _Probe(make_engine)
    probe.prefill("a", 0, 0, count=3)
    first = probe.decode("a", 0, 1, first=5)
    probe.expect_metrics("after a decode")
    again = probe.decode("a", 0, 1, first=5)
    if again != first:
        raise _CheckFailed("decode(step=1) sent twice", f"the first result again, {first!r}", repr(again))
    # The model's counts, not the engine's before the retry: a retry is a call (decode_calls
    # grows by one) that caches nothing (kv_tokens and active_sessions stay).
    probe.expect_metrics("after a repeated decode", "a retry counts as a call and adds no tokens")
    probe.decode("a", 0, 2)
    probe.expect_metrics("after the next decode")


def _same_inputs_same_outputs(make_engine: EngineFactory) -> None:
    probe = _Probe(make_engine)
    sessions = ("first", "second-session")
    outputs = {
        session_id: [probe.prefill(session_id, 0, 0, count=3), probe.decode(session_id, 0, 1, first=7)]
        for session_id in sessions
    }
    for first, second in zip(*outputs.values(), strict=True):
        # The machine's determinism check, tolerance and near ties included: no stricter here.
        difference = _payloads_difference(first.output, second.output, Tolerance.of(probe.caps))
        if difference is not None:
            raise _CheckFailed("the same inputs in a second session", "the first session's outputs", difference)


def _payloads_difference(first: object, second: object, tolerance: Tolerance) -> str | None:
    if not isinstance(first, BoundaryBundle | TokenOutput) or not isinstance(second, BoundaryBundle | TokenOutput):
        return None if first == second else f"{second!r}, not {first!r}"
    everything = 1 << 62  # every row of a bundle
    expected, observed = payloads_of(first, everything), payloads_of(second, everything)
    if len(expected) != len(observed):
        return f"{len(observed)} rows, expected {len(expected)}"
    for row, (want, got) in enumerate(zip(expected, observed, strict=True)):
        difference = payload_difference(want, got, tolerance)
        if difference is not None:
            return f"at row {row}: {difference}" if isinstance(first, BoundaryBundle) else difference
    return None


def _metrics_after_release(make_engine: EngineFactory) -> None:
    probe = _Probe(make_engine)
    probe.prefill("a", 0, 0, count=3)
    probe.decode("a", 0, 1)
    probe.prefill("b", 0, 0, count=2)
    probe.cancel("b", 0)
    probe.expect_metrics("with one live and one cancelled session")
    probe.release("a")
    probe.release("b")
    probe.expect_metrics("after releasing every session")


def _malformed_is_invalid(make_engine: EngineFactory) -> None:
    probe = _Probe(make_engine)
    probe.send(PrefillRequest("a", 0, 0, token_ids=(probe.caps.vocab_size,)))
    probe.send(PrefillRequest("", 0, 0, token_ids=(1,)))
    probe.prefill("a", 0, 0)
    probe.send(DecodeRequest("a", 0, 1, token_ids=(1, 2)))


def _capacity_is_refused(make_engine: EngineFactory) -> None:
    probe = _Probe(make_engine)
    for index in range(probe.caps.max_sessions):
        probe.prefill(f"s{index}", 0, 0)
    probe.prefill("one-too-many", 0, 0)
    probe.release("s0")
    probe.prefill("s0", 0, 0, count=probe.caps.max_kv_tokens)
    probe.prefill("s1", 0, 1)


def _role_outputs(role: Role) -> Callable[[EngineFactory], None]:
    def check(make_engine: EngineFactory) -> None:
        engine = make_engine()
        total = engine.capabilities().total_layers
        start, end = _range_for(role, total)
        try:
            engine.load(LoadRequest("shardkit-contract", start, end, total))
        except EngineError as refusal:
            message = f"the engine does not serve a {role} range (layers {start}..{end}): {refusal}"
            raise _RoleNotServed(message) from None
        probe = _Probe(make_engine, role)
        probe.prefill("a", 0, 0, count=3)
        probe.decode("a", 0, 1)

    return check


@dataclass(frozen=True)
class ContractCheck:
    name: str
    run: Callable[[EngineFactory], None]
    min_layers: int = 1


CONTRACT_CHECKS: tuple[ContractCheck, ...] = (
    ContractCheck("health and capabilities before and after load", _health_and_capabilities),
    ContractCheck("prefill then decode is a HIT", _prefill_then_decode_hits),
    ContractCheck("decode of an unknown session is NOT_FOUND/MISS", _decode_unknown_session),
    ContractCheck("a stale epoch is ABORTED", _stale_epoch_aborted),
    ContractCheck("cancel then decode is CANCELLED", _cancel_then_decode),
    ContractCheck("release then decode is NOT_FOUND", _release_then_decode),
    ContractCheck("a retry is idempotent", _retry_is_idempotent),
    ContractCheck("two fresh sessions with the same inputs give the same outputs", _same_inputs_same_outputs),
    ContractCheck("metrics return to zero after release", _metrics_after_release),
    ContractCheck("a malformed request is INVALID_ARGUMENT", _malformed_is_invalid),
    ContractCheck("capacity limits are RESOURCE_EXHAUSTED", _capacity_is_refused),
    ContractCheck("a head shard's outputs are well-formed", _role_outputs("head"), min_layers=2),
    ContractCheck("a middle shard's outputs are well-formed", _role_outputs("middle"), min_layers=3),
    ContractCheck("a tail shard's outputs are well-formed", _role_outputs("tail"), min_layers=2),
)


@contextmanager
def _recording(failures: list[tuple[str, str]], name: str, isolation: Isolation | None) -> Iterator[None]:
    try:
        yield
    except _CheckFailed as failure:
        failures.append((name, str(failure)))
    except (_RoleNotServed, InvalidTarget):  # InvalidTarget: no engine to check (a worker that cannot start)
        raise
    except Exception as error:  # an engine that raises is a finding, not a crash of the check
        # An engine in a worker process (--isolate, --worker-command) may have died of the call.
        death = isolation.death(error) if isolation is not None else None
        if death is not None:
            failures.append((name, f"the engine process {death.summary}; {death.output_detail()}"))
            return
        where = traceback.format_exception_only(error)[-1].strip()
        failures.append((name, f"the engine raised {where}"))


def assert_shard_engine_contract(make_engine: EngineFactory) -> list[str]:
    """Run every check of ``CONTRACT_CHECKS`` on fresh engines from ``make_engine``.

    Raises ``ContractViolation`` listing each failed check by name, with the
    call, the expected answer (and the §2 rule behind it) and the observed one.
    Returns the checks skipped, each with why: a role check for a layer range
    the engine refuses to load (contract §1 allows that), or one that needs more layers.
    """
    isolation: Isolation | None = getattr(make_engine, "isolation", None)
    failures: list[tuple[str, str]] = []
    skipped: list[str] = []
    total_layers = 0
    with _recording(failures, "capabilities", isolation):
        total_layers = make_engine().capabilities().total_layers
    for check in CONTRACT_CHECKS if not failures else ():
        if total_layers < check.min_layers:
            skipped.append(f"{check.name}: needs {check.min_layers} layers, the engine has {total_layers}")
            continue
        try:
            with _recording(failures, check.name, isolation):
                check.run(make_engine)
        except _RoleNotServed as refusal:
            skipped.append(f"{check.name}: {refusal}")
    if failures:
        lines = "\n".join(f"  [{name}] {detail}" for name, detail in failures)
        summary = f"{len(failures)} contract check(s) failed:\n{lines}"
        where = read_more(lines)
        if where is not None:
            summary += f"\nthe rules cited are explained in shardkit's {where}"
        raise ContractViolation(summary, failed_checks=[name for name, _ in failures])
    return skipped


settle(__name__, globals())
