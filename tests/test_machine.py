"""The state machine finds each planted bug, names the rule it breaks, and shrinks it to the minimum."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from io import StringIO

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from shardkit import FakeShardEngine, ShardkitError, machine_for
from shardkit._machine.observer import RunObserver, observed
from shardkit._run.options import DEFAULT_BUDGETS
from shardkit._run.report import print_summary
from shardkit._run.result import FuzzResult
from shardkit._run.runner import fuzz
from tests.planted import PLANTED, PlantedEngine, names_its_property

#: Every outcome SPEC §2 allows for each operation (UNAVAILABLE comes from calls
#: to a never-loaded engine; fault injections answer OK).
ALLOWED_OUTCOMES = {
    "prefill": {
        "OK",
        "UNAVAILABLE",
        "INVALID_ARGUMENT",
        "FAILED_PRECONDITION",
        "NOT_FOUND",
        "ABORTED",
        "CANCELLED",
        "RESOURCE_EXHAUSTED",
    },
    "decode": {
        "OK",
        "UNAVAILABLE",
        "INVALID_ARGUMENT",
        "FAILED_PRECONDITION",
        "NOT_FOUND",
        "ABORTED",
        "CANCELLED",
        "RESOURCE_EXHAUSTED",
    },
    "cancel": {"OK", "UNAVAILABLE", "INVALID_ARGUMENT", "NOT_FOUND", "ABORTED"},
    "release": {"OK", "UNAVAILABLE"},
    "health": {"OK"},
    "fault": {"OK"},
}


@pytest.mark.parametrize("engine", PLANTED, ids=lambda engine: engine.__name__)
def test_each_planted_bug_is_found_named_and_shrunk_to_its_minimum(
    engine: type[PlantedEngine], planted_runs: Mapping[type[PlantedEngine], FuzzResult]
) -> None:
    result = planted_runs[engine]
    assert result.failure is not None, f"{engine.__name__} ({engine.BUG}) was not found"
    violation = result.failure.violation
    assert names_its_property(engine, violation.property), violation.message
    steps = [record.action.describe() for record in result.failure.records]
    # The minimum is stated next to each engine (tests/planted), e.g. 2 steps for a leak on release;
    # a bug that needs dozens of steps only has to come within one step of it.
    slack = 1 if engine.LATE else 0
    minimum = engine.minimum_for(violation.property)
    assert minimum <= len(steps) <= minimum + slack, f"shrunk to {steps}, minimum is {minimum}: {engine.MINIMAL}"


def test_a_failure_message_names_the_step_the_call_and_the_rule() -> None:
    from tests.planted import StaleEpochAccepted

    result = fuzz(StaleEpochAccepted, seed=3, examples=200, steps=50, role="full")
    assert result.failure is not None
    message = result.failure.violation.message
    assert message.startswith("step 2: prefill(session='a', epoch=0, step=1, tokens=[0])")
    assert "expected: ABORTED/MISS by §2 rule 4: epoch 0 is stale: session 'a' is at epoch 1" in message
    assert "observed: OK/HIT" in message


@pytest.mark.parametrize("role", ["full", "head", "middle", "tail"])
def test_the_fake_is_not_flagged_in_any_role_with_every_fault(role: str) -> None:
    """No false alarm: 4 roles × 250 examples = 1 000 examples with every fault."""
    result = fuzz(FakeShardEngine, seed=11, examples=250, steps=50, role=role, faults="all")
    assert result.failure is None, result.failure and result.failure.violation.message
    assert result.examples >= 250


def test_every_allowed_outcome_is_reached_under_the_ci_profile() -> None:
    observer = RunObserver()
    machine = observed(machine_for(FakeShardEngine, role="full", faults="all"), observer)
    run_state_machine_as_test(machine, settings=settings(settings.get_profile("shardkit-ci"), database=None))
    reached: dict[str, set[str]] = {}
    for op, outcome in observer.coverage:
        reached.setdefault(op, set()).add(outcome)
    missing = {op: sorted(outcomes - reached.get(op, set())) for op, outcomes in ALLOWED_OUTCOMES.items()}
    assert not any(missing.values()), f"never reached: {missing}"
    assert "FAILED" not in {outcome for outcomes in reached.values() for outcome in outcomes}


def test_an_undetected_malformed_output_is_a_failure_of_the_kit() -> None:
    """If the engine 'corrupts' an output into an identical one, the kit must say its checks missed it."""

    class CorruptsNothing(FakeShardEngine):
        def inject_fault(self, fault):  # type: ignore[no-untyped-def]
            if fault.kind == "malformed_output":
                from shardkit import StatusCode, StructuredStatus

                return StructuredStatus(StatusCode.OK)
            return super().inject_fault(fault)

    result = fuzz(CorruptsNothing, seed=3, examples=200, steps=50, role="full", faults="malformed_output")
    assert result.failure is not None
    assert result.failure.violation.property == "§4 malformed_output"
    assert len(result.failure.records) == 2


def test_a_crash_that_does_not_happen_when_injected_is_reported() -> None:
    class NeverCrashes(FakeShardEngine):
        def inject_fault(self, fault):  # type: ignore[no-untyped-def]
            from shardkit import StatusCode, StructuredStatus

            return StructuredStatus(StatusCode.OK)

    result = fuzz(NeverCrashes, seed=3, examples=200, steps=50, role="full", faults="crash")
    assert result.failure is not None
    assert result.failure.violation.property == "§4 crash"


def test_boundary_faults_are_injected_into_an_engine_that_supports_none() -> None:
    class NoNativeFaults(FakeShardEngine):
        def capabilities(self):  # type: ignore[no-untyped-def]
            from dataclasses import replace

            return replace(super().capabilities(), supported_faults=frozenset())

    machine = machine_for(NoNativeFaults, role="full", faults="all")
    assert machine._fault_kinds == {"delay", "malformed_output", "crash"}
    result = fuzz(NoNativeFaults, seed=5, examples=100, steps=50, role="full", faults="all")
    assert result.failure is None, result.failure and result.failure.violation.message
    assert result.coverage[("prefill", "CRASH")] + result.coverage[("decode", "CRASH")] > 0


def test_asking_for_a_fault_the_engine_cannot_take_is_an_error() -> None:
    class NoNativeFaults(FakeShardEngine):
        def capabilities(self):  # type: ignore[no-untyped-def]
            from dataclasses import replace

            return replace(super().capabilities(), supported_faults=frozenset())

    machine = machine_for(NoNativeFaults, faults="memory_pressure")  # builds no engine yet
    with pytest.raises(ShardkitError, match=r"cannot take the fault\(s\) \['memory_pressure'\]"):
        machine.prepare()


def test_a_role_the_engine_cannot_serve_is_an_error() -> None:
    from shardkit import FakeShardEngineConfig

    machine = machine_for(lambda: FakeShardEngine(FakeShardEngineConfig(total_layers=2)), role="middle")
    with pytest.raises(ShardkitError, match="cannot serve a middle shard"):
        machine.prepare()
    with pytest.raises(ShardkitError, match="cannot serve a middle shard"):
        machine.TestCase("runTest").runTest()  # a run meets the engine, and says so


def test_building_a_machine_builds_no_engine_and_starts_no_worker() -> None:
    """Importing a test module that calls machine_for does no work: the engine is met on first use."""
    built: list[int] = []

    class Counted(FakeShardEngine):
        def __init__(self) -> None:
            built.append(1)
            super().__init__()

    machine = machine_for(Counted, role="full")
    isolated = machine_for("shardkit:FakeShardEngine", isolate=True)
    assert built == []
    assert isolated.__name__ == "ShardMachine_FakeShardEngine_any"
    assert machine.prepare()._roles == ("full", "head", "tail", "middle")
    assert built, "prepare() meets the engine"


def test_bad_machine_options_are_clear_errors() -> None:
    with pytest.raises(
        ValueError, match=r"role \(--role\) must be one of full, head, tail, middle or 'any', got 'edge'"
    ):
        machine_for(FakeShardEngine, role="edge")
    with pytest.raises(ValueError, match=r"faults \(--faults\) must be 'all', 'none' or a comma-separated list"):
        machine_for(FakeShardEngine, faults="flood")


def test_the_same_seed_gives_the_same_failure_and_steps() -> None:
    from tests.planted import SessionStateBleeds

    first = fuzz(SessionStateBleeds, seed=9, examples=100, steps=50, role="full")
    second = fuzz(SessionStateBleeds, seed=9, examples=100, steps=50, role="full")
    assert first.failure is not None
    assert second.failure is not None
    assert first.failure.violation == second.failure.violation
    assert [r.action for r in first.failure.records] == [r.action for r in second.failure.records]
    assert (first.examples, first.steps, first.coverage) == (second.examples, second.steps, second.coverage)


def test_without_twins_the_malformed_output_fault_is_left_out_or_refused() -> None:
    """Without twins a wrong output of a new history cannot be caught, so the fault would only cry wolf."""
    assert "malformed_output" not in machine_for(FakeShardEngine, faults="all", twins=False)._fault_kinds
    with pytest.raises(ShardkitError, match="malformed_output fault needs the twin oracle"):
        machine_for(FakeShardEngine, faults="malformed_output,crash", twins=False)


def test_a_reference_engine_fuzzes_the_target_differentially() -> None:
    """Twins built from another implementation: the fake agrees with itself, a chunking bug does not."""
    from tests.planted import OutputDependsOnChunking

    clean = fuzz(FakeShardEngine, seed=2, examples=60, steps=40, role="full", reference="shardkit:FakeShardEngine")
    assert clean.failure is None, clean.failure and clean.failure.violation.message
    buggy = fuzz(OutputDependsOnChunking, seed=3, examples=100, steps=40, role="full", reference=FakeShardEngine)
    assert buggy.failure is not None
    assert buggy.failure.violation.property == "§3 determinism"
    assert "FakeShardEngine" in buggy.failure.violation.message
    with pytest.raises(ShardkitError, match="reference engine is compared through the twin oracle"):
        machine_for(FakeShardEngine, twins=False, reference=FakeShardEngine)


def test_an_exception_from_metrics_is_a_reported_failure_not_a_crash_of_the_kit() -> None:
    class MetricsExplode(FakeShardEngine):
        def metrics(self):  # type: ignore[no-untyped-def]
            if self.health().serving and super().metrics().prefill_calls > 0:
                message = "metrics backend unreachable"
                raise RuntimeError(message)
            return super().metrics()

    result = fuzz(MetricsExplode, seed=3, examples=50, steps=20, role="full")
    assert result.failure is not None
    assert result.failure.violation.property == "unexplained exception"
    assert "RuntimeError: metrics backend unreachable" in result.failure.violation.message
    assert len(result.failure.records) == 1


def test_rounding_noise_is_not_taken_for_a_detected_corruption() -> None:
    """An engine with a tolerance that accepts malformed_output but corrupts nothing: the
    noise between chunkings (within tolerance) must not count as catching the injection."""
    from shardkit import Fault, NumpyShardEngine, StatusCode, StructuredStatus

    class NumpyCorruptsNothing(NumpyShardEngine):
        def inject_fault(self, fault: Fault) -> StructuredStatus:
            if fault.kind == "malformed_output":
                return StructuredStatus(StatusCode.OK)
            return super().inject_fault(fault)

    # Only the property is asked for, not the shortest sequence: no replay minimiser, and
    # Hypothesis's shrinking cut short (it took most of this test's 40 s).
    quick = replace(DEFAULT_BUDGETS, shrink_examples=50)
    for role in ("head", "full"):
        result = fuzz(
            NumpyCorruptsNothing,
            seed=3,
            examples=100,
            steps=30,
            role=role,
            faults="malformed_output",
            minimize=False,
            budgets=quick,
        )
        assert result.failure is not None, role
        assert result.failure.violation.property == "§4 malformed_output", result.failure.violation.message


def test_a_check_the_run_could_not_make_is_listed_under_the_coverage() -> None:
    """An engine that loads only its whole range cannot be split into a pipeline of twins:
    the run says composition went unchecked, instead of passing in silence."""
    from shardkit import EngineError, LoadRequest, LoadResult, StatusCode, StructuredStatus

    class WholeOnly(FakeShardEngine):
        def load(self, request: LoadRequest) -> LoadResult:
            if (request.shard_start, request.shard_end) != (0, request.total_layers - 1):
                raise EngineError(StructuredStatus(StatusCode.INVALID_ARGUMENT, "whole model only"))
            return super().load(request)

    result = fuzz(WholeOnly, seed=1, examples=30, steps=20, role="full")
    assert result.failure is None
    ((caveat, examples),) = result.caveats.items()
    assert caveat.startswith("composition (docs/contract.md#composition): the engine cannot load a split")
    assert 0 < examples <= result.examples
    printed = StringIO()
    print_summary(result, printed)
    assert f"not checked in {examples} of {result.examples} examples: {caveat}" in printed.getvalue()
    assert fuzz(FakeShardEngine, seed=1, examples=30, steps=20, role="full").caveats == {}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_counts_and_the_coverage_of_a_failing_run_cover_the_same_steps(seed: int) -> None:
    """Both stop at the first failure: the coverage once went on counting the shrinker's
    replays, so a report said "195 steps" above a table of thousands."""
    from tests.planted import ReleaseLeaksKvTokens

    result = fuzz(ReleaseLeaksKvTokens, seed=seed, examples=200, steps=50)
    assert result.failure is not None
    assert result.shrink_steps > 0
    assert sum(result.coverage.values()) == result.steps
