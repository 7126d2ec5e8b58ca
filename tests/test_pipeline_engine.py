"""PipelineEngine: stage engines chained into one full engine, fuzzed like any engine.

Three kinds of evidence: the static contract and the fuzzer find nothing wrong with
the pipeline over the fake (alone, and differentially against a single full fake);
the pipeline answers exactly what a single full fake answers, bit for bit, for the
same histories over many cut sets; and coordination bugs planted in subclasses are
found, named and shrunk to their minimal sequence.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, ClassVar

import pytest

from shardkit import (
    BoundaryBundle,
    CacheResult,
    DecodeRequest,
    EngineCapabilities,
    EngineError,
    FakeShardEngine,
    FakeShardEngineConfig,
    Fault,
    LoadRequest,
    MetricsResult,
    PrefillRequest,
    ShardEngine,
    StatusCode,
    StepResult,
    StructuredStatus,
    TokenOutput,
    assert_shard_engine_contract,
)
from shardkit._planted import minimal
from shardkit._run.runner import fuzz
from shardkit.engines.fake import FakeEngineCrash
from shardkit.engines.pipeline import PipelineEngine

StepRequest = PrefillRequest | DecodeRequest
LAYERS = 4
FULL = LoadRequest("pipeline-test", 0, LAYERS - 1, LAYERS)
CUT_SETS = [(), (0,), (1,), (2,), (0, 1), (0, 2), (1, 2), (0, 1, 2)]
ROLE_CHECKS = {
    "a head shard's outputs are well-formed",
    "a middle shard's outputs are well-formed",
    "a tail shard's outputs are well-formed",
}


def loaded(pipeline: PipelineEngine) -> PipelineEngine:
    assert pipeline.load(FULL).status.ok
    return pipeline


def stages_from(*configs: FakeShardEngineConfig) -> Callable[[], ShardEngine]:
    """A stage factory handing out one fake per config, in order."""
    queue = iter(configs)
    return lambda: FakeShardEngine(next(queue))


def prefill(session: str, epoch: int, step: int, *tokens: int) -> PrefillRequest:
    return PrefillRequest(session, epoch, step, token_ids=tokens)


def decode(session: str, epoch: int, step: int, token: int) -> DecodeRequest:
    return DecodeRequest(session, epoch, step, token_ids=(token,))


def send(engine: ShardEngine, request: StepRequest) -> StepResult:
    return engine.prefill(request) if isinstance(request, PrefillRequest) else engine.decode(request)


def stage_metrics(pipeline: PipelineEngine) -> list[tuple[int, int]]:
    return [(m.active_sessions, m.kv_tokens) for m in (stage.metrics() for stage in pipeline.stages)]


# --- the contract and the fuzzer find nothing ------------------------------------------


def test_the_static_contract_passes_and_skips_the_roles_a_pipeline_does_not_serve() -> None:
    """A pipeline loads only the full range (its load raises EngineError for the others, as
    SPEC §1 allows): the contract passes, skipping exactly the head/middle/tail checks."""
    skipped = assert_shard_engine_contract(PipelineEngine)
    assert {reason.partition(":")[0] for reason in skipped} == ROLE_CHECKS
    assert all("PipelineEngine serves the whole model only" in reason for reason in skipped)


@pytest.mark.parametrize(
    ("target", "seed"),
    [
        pytest.param(PipelineEngine, 1, id="default-cuts-seed-1"),
        pytest.param(PipelineEngine, 2, id="default-cuts-seed-2"),
        pytest.param(PipelineEngine.factory(FakeShardEngine, (0, 1, 2)), 1, id="four-stages-seed-1"),
    ],
)
def test_the_fuzzer_finds_nothing(target: Callable[[], ShardEngine], seed: int) -> None:
    result = fuzz(target, seed=seed, examples=100, steps=40, role="full")
    assert result.failure is None, result.failure.violation.message
    assert result.examples >= 100
    outcomes = {outcome for (op, outcome) in result.coverage if op in ("prefill", "decode")}
    assert {"OK", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "INVALID_ARGUMENT"} <= outcomes


def test_the_fuzzer_finds_nothing_differentially_against_a_single_full_fake() -> None:
    """The twin oracle is built from a single full FakeShardEngine: every first-seen history's
    output of the pipeline is compared with it."""
    target = PipelineEngine.factory(FakeShardEngine, (0, 2))
    result = fuzz(target, seed=5, examples=60, steps=40, role="full", reference=FakeShardEngine)
    assert result.failure is None, result.failure.violation.message


def test_factory_builds_fresh_pipelines_over_the_given_stages() -> None:
    build = PipelineEngine.factory(FakeShardEngine, [0, 1, 2])
    first, second = build(), build()
    assert first is not second
    assert first.cuts == (0, 1, 2)
    assert len(first.stages) == 4
    assert all(type(stage) is FakeShardEngine for stage in first.stages)
    assert build.__qualname__ == "PipelineEngine.factory(FakeShardEngine, (0, 1, 2))"


# --- differential: the same histories give the same answers as a single full fake -------


def random_script(seed: int) -> Iterator[tuple[str, Any]]:
    """A random walk of requests, cancels and releases, valid and not; the walk steers
    itself with the single engine's answers (see ``run_both``)."""
    rng = random.Random(seed)
    for _ in range(250):
        yield rng.choice(
            [
                ("next", (rng.choice("abcde"), rng.choice([1, 1, 2, 3, 5, 17]), rng.randrange(1000))),
                ("decode", (rng.choice("abcde"), rng.randrange(1000))),
                ("resend", rng.choice("abcde")),
                ("restart", (rng.choice("abcde"), rng.choice([1, 2, 1000]), rng.randrange(1000))),
                ("cancel", rng.choice("abcde")),
                ("release", rng.choice("abcde")),
                ("misstep", (rng.choice("abcde"), rng.choice([-1, 2]))),
                ("malformed", rng.choice("abcde")),
                ("stale", rng.choice("abcde")),
            ]
        )


def run_both(pipeline: PipelineEngine, single: ShardEngine, seed: int) -> Counter[str]:
    """Drive both engines with one script; every answer and every metric must match
    (status code, retryable flag, cache, and the output bit for bit). Counts the step outcomes."""
    position: dict[str, tuple[int, int]] = {}  # session -> (epoch, next step), from the single engine
    last: dict[str, StepRequest] = {}
    outcomes: Counter[str] = Counter()
    for kind, args in random_script(seed):
        if kind in ("cancel", "release"):
            epoch = position.get(args, (0, 0))[0]
            expected = single.cancel(args, epoch) if kind == "cancel" else single.release(args)
            observed = pipeline.cancel(args, epoch) if kind == "cancel" else pipeline.release(args)
            assert (observed.code, observed.retryable) == (expected.code, expected.retryable), (kind, args)
            if kind == "release":
                position.pop(args, None)
            continue
        session = args if isinstance(args, str) else args[0]
        epoch, step = position.get(session, (0, 0))
        vocab = 32
        if kind == "next":
            tokens = tuple((args[2] + 7 * index) % vocab for index in range(args[1]))
            request: StepRequest = prefill(session, epoch, step, *tokens)
        elif kind == "decode":
            request = decode(session, epoch, step, args[1] % vocab)
        elif kind == "resend":
            if session not in last:
                continue
            request = last[session]
        elif kind == "restart":
            request = prefill(session, epoch + args[1], 0, *(args[2] % vocab,) * 2)
        elif kind == "misstep":
            request = decode(session, epoch, max(step + args[1], 0), 3)
        elif kind == "stale":
            request = prefill(session, max(epoch - 1, 0), step, 5)
        else:
            request = prefill(session, epoch, step, vocab + 1)
        expected_result, observed_result = send(single, request), send(pipeline, request)
        expected_status, observed_status = expected_result.status, observed_result.status
        assert (observed_status.code, observed_status.retryable, observed_result.cache, observed_result.output) == (
            expected_status.code,
            expected_status.retryable,
            expected_result.cache,
            expected_result.output,
        ), (request, observed_status.message)
        outcomes[expected_status.code.name] += 1
        if expected_status.ok:
            last[session] = request
            if request.step == 0 and isinstance(request, PrefillRequest):
                position[session] = (request.epoch, 1)
            elif request.step == position[session][1]:
                position[session] = (request.epoch, request.step + 1)
        single_metrics, pipeline_metrics = single.metrics(), pipeline.metrics()
        assert pipeline_metrics == single_metrics, request
    return outcomes


@pytest.mark.parametrize("cuts", CUT_SETS, ids=lambda cuts: f"cuts={cuts}")
def test_same_histories_same_answers_as_a_single_full_fake(cuts: tuple[int, ...]) -> None:
    for seed in (0, 1):
        pipeline = loaded(PipelineEngine(FakeShardEngine, cuts))
        single = FakeShardEngine()
        assert single.load(FULL).status.ok
        outcomes = run_both(pipeline, single, seed)
        assert outcomes["OK"] > 50
        assert set(outcomes) >= {
            "OK",
            "INVALID_ARGUMENT",
            "NOT_FOUND",
            "FAILED_PRECONDITION",
            "CANCELLED",
            "RESOURCE_EXHAUSTED",
            "ABORTED",
        }, outcomes
        assert len(pipeline.stages) == len(cuts) + 1


def test_each_stage_gets_the_previous_stages_bundle_under_the_same_ids() -> None:
    seen: list[list[StepRequest]] = []

    class Recording(FakeShardEngine):
        def __init__(self) -> None:
            super().__init__()
            self.requests: list[StepRequest] = []
            seen.append(self.requests)

        def prefill(self, request: PrefillRequest) -> StepResult:
            self.requests.append(request)
            return super().prefill(request)

    pipeline = loaded(PipelineEngine(Recording, (0, 1, 2)))
    result = pipeline.prefill(prefill("s", 3, 0, 4, 5, 6))
    assert result.status.ok
    assert isinstance(result.output, TokenOutput)
    assert [len(requests) for requests in seen] == [1, 1, 1, 1]
    assert seen[0][0] == prefill("s", 3, 0, 4, 5, 6)
    points = []
    for requests in seen[1:]:
        bundle = requests[0].bundle
        assert isinstance(bundle, BoundaryBundle)
        assert (requests[0].session_id, requests[0].epoch, requests[0].step) == ("s", 3, 0)
        assert (bundle.session_id, bundle.epoch, bundle.step) == ("s", 3, 0)
        assert bundle.token_id_sideband == (4, 5, 6)
        points.append(bundle.boundary_point)
    # A middle takes only post_head_residual (SPEC §1), so the second middle gets the first's
    # bundle re-tagged: to it, the stages before it are its head. The tail takes either.
    assert points == ["post_head_residual", "post_head_residual", "post_middle_residual"]


# --- lifecycle details the coordinator owns ----------------------------------------------


def test_before_load_every_call_is_unavailable_and_counted() -> None:
    pipeline = PipelineEngine()
    caps = pipeline.capabilities()
    assert (caps.shard_start, caps.shard_end, caps.total_layers, caps.role) == (0, 3, 4, "full")
    assert not pipeline.health().serving
    for request in (prefill("a", 0, 0, 1), decode("a", 0, 0, 1)):
        result = send(pipeline, request)
        assert (result.status.code, result.cache, result.output) == (StatusCode.UNAVAILABLE, CacheResult.MISS, None)
    assert pipeline.cancel("a", 0).code is StatusCode.UNAVAILABLE
    assert pipeline.release("a").code is StatusCode.UNAVAILABLE
    assert pipeline.metrics() == MetricsResult(1, 1, 0, 0)


def test_capabilities_combine_the_stages_conservatively() -> None:
    class RealWithTolerance(FakeShardEngine):
        EVIDENCE_CLASS = "real"  # type: ignore[assignment]

        def capabilities(self) -> EngineCapabilities:
            return replace(super().capabilities(), tolerance=0.25)

    configs = [
        FakeShardEngineConfig(max_sessions=2, max_kv_tokens=40),
        FakeShardEngineConfig(),
        FakeShardEngineConfig(),
    ]
    queue = iter(configs)
    pipeline = PipelineEngine(lambda: RealWithTolerance(next(queue)))
    for caps in (pipeline.capabilities(), loaded(pipeline).capabilities()):
        assert (caps.shard_start, caps.shard_end, caps.role) == (0, 3, "full")
        assert (caps.max_sessions, caps.max_kv_tokens) == (2, 40)
        assert caps.tolerance == 0.75
        assert caps.evidence_class == "real"
        assert caps.supported_faults == frozenset()
        assert (caps.hidden_size, caps.vocab_size, caps.dtype, caps.architecture) == (8, 32, "float32", "shardkit-fake")
    mixed = iter([RealWithTolerance(), FakeShardEngine(), RealWithTolerance()])
    assert PipelineEngine(lambda: next(mixed)).capabilities().evidence_class == "fixture"
    assert loaded(PipelineEngine()).health().serving


def test_a_malformed_request_is_refused_by_the_coordinator_and_counted() -> None:
    pipeline = loaded(PipelineEngine())
    for request in (
        prefill("a", 0, 0, 32),
        prefill("", 0, 0, 1),
        prefill("a", 2**63, 0, 1),
        PrefillRequest("a", 0, 0, token_ids=()),
        DecodeRequest("a", 0, 0, token_ids=(1, 2)),
    ):
        result = send(pipeline, request)
        assert (result.status.code, result.cache, result.output) == (
            StatusCode.INVALID_ARGUMENT,
            CacheResult.MISS,
            None,
        )
    bundle = pipeline.stages[0].prefill(prefill("x", 0, 0, 1))  # stage 1 itself makes a valid-looking bundle
    assert isinstance(bundle.output, BoundaryBundle)
    assert pipeline.prefill(PrefillRequest("x", 0, 1, bundle=replace(bundle.output, step=1))).status.code is (
        StatusCode.INVALID_ARGUMENT
    )
    assert pipeline.cancel("", 0).code is StatusCode.INVALID_ARGUMENT
    assert pipeline.cancel("a", -1).code is StatusCode.INVALID_ARGUMENT
    metrics = pipeline.metrics()
    assert (metrics.prefill_calls, metrics.decode_calls) == (5, 1)  # the coordinator's own count
    assert pipeline.stages[0].metrics().prefill_calls == 1  # only the direct call reached stage 1


def test_a_stage_1_refusal_is_passed_through_with_the_stage_named() -> None:
    pipeline = loaded(PipelineEngine())
    result = pipeline.decode(decode("never", 0, 1, 1))
    assert result.status.code is StatusCode.NOT_FOUND
    assert result.status.message.startswith("stage 1 of 3 (layers 0..1): ")
    assert [stage.metrics().decode_calls for stage in pipeline.stages] == [1, 0, 0]


def test_a_retry_reaches_every_stage_as_a_retry() -> None:
    pipeline = loaded(PipelineEngine(cuts=(0, 1, 2)))
    first = pipeline.prefill(prefill("a", 0, 0, 1, 2, 3))
    second = pipeline.decode(decode("a", 0, 1, 4))
    assert (first.cache, second.cache) == (CacheResult.MISS, CacheResult.HIT)
    before = stage_metrics(pipeline)
    assert pipeline.decode(decode("a", 0, 1, 4)) == second
    assert pipeline.prefill(prefill("a", 0, 0, 1, 2, 3)).status.code is StatusCode.FAILED_PRECONDITION
    assert stage_metrics(pipeline) == before == [(1, 4)] * 4


# --- where stages could disagree ------------------------------------------------------------


def test_capacity_is_decided_by_stage_1_which_must_be_the_tightest() -> None:
    tight, roomy = FakeShardEngineConfig(max_sessions=2, max_kv_tokens=10), FakeShardEngineConfig()
    pipeline = loaded(PipelineEngine(stages_from(tight, roomy, roomy)))
    assert pipeline.prefill(prefill("a", 0, 0, *range(6))).status.ok
    assert pipeline.prefill(prefill("b", 0, 0, 1)).status.ok
    for refused in (prefill("c", 0, 0, 1), prefill("a", 0, 1, *range(4))):
        result = pipeline.prefill(refused)
        assert (result.status.code, result.status.retryable) == (StatusCode.RESOURCE_EXHAUSTED, True)
        assert result.status.message.startswith("stage 1 of 3")
    # Nothing was allocated anywhere: every stage still holds the same two sessions and 7 tokens.
    assert stage_metrics(pipeline) == [(2, 7)] * 3
    assert pipeline.metrics() == MetricsResult(4, 0, 2, 7)


@pytest.mark.parametrize("budget", ["max_sessions", "max_kv_tokens"])
def test_a_later_stage_tighter_than_stage_1_is_refused_at_load(budget: str) -> None:
    tighter = FakeShardEngineConfig(**{budget: 1})  # type: ignore[arg-type]
    pipeline = PipelineEngine(stages_from(FakeShardEngineConfig(), FakeShardEngineConfig(), tighter))
    with pytest.raises(EngineError) as refused:
        pipeline.load(FULL)
    assert refused.value.status.code is StatusCode.FAILED_PRECONDITION
    assert f"stage 3 of 3 (layers 3..3) has {budget}=1" in refused.value.status.message
    assert not pipeline.health().serving
    assert all(not stage.health().serving for stage in pipeline.stages)  # refused before any stage loaded


def test_a_later_stage_refusing_what_stage_1_accepted_is_an_internal_desync() -> None:
    """A budget lowered under the coordinator's feet: stage 1 has advanced and cannot be
    rolled back, so the pipeline says INTERNAL (not retryable) rather than pretending."""
    pipeline = loaded(PipelineEngine())
    assert pipeline.stages[2].inject_fault(Fault("memory_pressure", 0)).ok  # type: ignore[attr-defined]
    assert pipeline.capabilities().max_kv_tokens == 0
    result = pipeline.prefill(prefill("a", 0, 0, 1))
    assert (result.status.code, result.status.retryable, result.output) == (StatusCode.INTERNAL, False, None)
    assert "pipeline desync: stage 3 of 3 (layers 3..3) refused a step stage 1 accepted" in result.status.message
    assert "RESOURCE_EXHAUSTED" in result.status.message
    assert stage_metrics(pipeline) == [(1, 1), (1, 1), (0, 0)]
    assert pipeline.metrics().kv_tokens == 1  # the most any stage holds


def test_a_later_stage_answering_another_cache_result_is_an_internal_desync() -> None:
    class AlwaysHit(FakeShardEngine):
        def prefill(self, request: PrefillRequest) -> StepResult:
            return replace(super().prefill(request), cache=CacheResult.HIT)

    built = iter([FakeShardEngine(), AlwaysHit(), FakeShardEngine()])
    pipeline = loaded(PipelineEngine(lambda: next(built)))
    result = pipeline.prefill(prefill("a", 0, 0, 1))
    assert result.status.code is StatusCode.INTERNAL
    assert "stage 2 of 3 (layers 2..2) answered HIT where stage 1 answered MISS" in result.status.message


def test_a_stage_returning_the_wrong_output_kind_is_an_internal_desync() -> None:
    class TokenNotBundle(FakeShardEngine):
        def prefill(self, request: PrefillRequest) -> StepResult:
            return replace(super().prefill(request), output=TokenOutput(0))

    built = iter([TokenNotBundle(), FakeShardEngine()])
    pipeline = loaded(PipelineEngine(lambda: next(built), (1,)))
    result = pipeline.prefill(prefill("a", 0, 0, 1))
    assert result.status.code is StatusCode.INTERNAL
    assert "stage 1 of 2 (layers 0..1) answered OK with TokenOutput, not a BoundaryBundle" in result.status.message


def test_cancel_and_release_reach_every_stage_and_disagreement_is_internal() -> None:
    pipeline = loaded(PipelineEngine())
    assert pipeline.prefill(prefill("a", 0, 0, 1, 2)).status.ok
    assert pipeline.cancel("a", 1).code is StatusCode.NOT_FOUND
    assert pipeline.cancel("a", 0).ok
    assert stage_metrics(pipeline) == [(1, 0)] * 3
    assert pipeline.release("a").ok
    assert stage_metrics(pipeline) == [(0, 0)] * 3
    assert pipeline.prefill(prefill("b", 0, 0, 1)).status.ok
    assert pipeline.stages[1].release("b").ok  # behind the coordinator's back
    assert pipeline.metrics().active_sessions == 1  # the most any stage holds
    status = pipeline.cancel("b", 0)
    assert status.code is StatusCode.INTERNAL
    assert "stage 1: OK, stage 2: NOT_FOUND, stage 3: OK" in status.message
    decoded = pipeline.decode(decode("b", 0, 1, 1))
    assert decoded.status.code is StatusCode.CANCELLED  # stage 1 decides


def test_an_exception_out_of_a_stage_propagates() -> None:
    pipeline = loaded(PipelineEngine())
    assert pipeline.stages[1].inject_fault(Fault("crash", 1)).ok  # type: ignore[attr-defined]
    with pytest.raises(FakeEngineCrash):
        pipeline.prefill(prefill("a", 0, 0, 1))


# --- load errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_", "named"),
    [
        (LoadRequest("m", 0, 1, 4), "got layers 0..1 of 4"),
        (LoadRequest("m", 2, 3, 4), "got layers 2..3 of 4"),
        (LoadRequest("m", 1, 2, 4), "got layers 1..2 of 4"),
        (LoadRequest("m", 0, 4, 5), "got layers 0..4 of 5"),
    ],
)
def test_load_refuses_anything_but_the_full_range(request_: LoadRequest, named: str) -> None:
    pipeline = PipelineEngine()
    with pytest.raises(EngineError) as refused:
        pipeline.load(request_)
    assert refused.value.status.code is StatusCode.INVALID_ARGUMENT
    assert named in refused.value.status.message
    loaded(pipeline)  # nothing was loaded: the right request still works


@pytest.mark.parametrize(("cuts", "cut"), [((3,), 3), ((1, 3), 3), ((-1, 1), -1), ((0, 1, 2, 3), 3)])
def test_load_refuses_a_cut_outside_the_model(cuts: tuple[int, ...], cut: int) -> None:
    with pytest.raises(EngineError) as refused:
        PipelineEngine(cuts=cuts).load(FULL)
    assert refused.value.status.code is StatusCode.INVALID_ARGUMENT
    assert f"cut {cut} (of cuts {cuts}) does not fit a 4-layer model" in refused.value.status.message


def test_the_default_cuts_do_not_fit_a_two_layer_model() -> None:
    two = FakeShardEngineConfig(total_layers=2)
    with pytest.raises(EngineError, match="cut 1 "):
        PipelineEngine(lambda: FakeShardEngine(two)).load(LoadRequest("m", 0, 1, 2))
    assert loaded_two(PipelineEngine(lambda: FakeShardEngine(two), (0,)))


def loaded_two(pipeline: PipelineEngine) -> bool:
    return pipeline.load(LoadRequest("m", 0, 1, 2)).status.ok


@pytest.mark.parametrize(
    ("other", "figure"),
    [
        (FakeShardEngineConfig(hidden_size=16), "hidden_size=16"),
        (FakeShardEngineConfig(vocab_size=64), "vocab_size=64"),
        (FakeShardEngineConfig(architecture="other"), "architecture='other'"),
        (FakeShardEngineConfig(total_layers=5), "total_layers=5"),
    ],
)
def test_load_refuses_stages_that_do_not_split_one_model(other: FakeShardEngineConfig, figure: str) -> None:
    pipeline = PipelineEngine(stages_from(FakeShardEngineConfig(), other, FakeShardEngineConfig()))
    with pytest.raises(EngineError) as refused:
        pipeline.load(FULL)
    assert refused.value.status.code is StatusCode.FAILED_PRECONDITION
    assert f"stage 2 has {figure}" in refused.value.status.message
    with pytest.raises(EngineError, match=f"stage 2 has {figure}"):
        pipeline.capabilities()


def test_a_stage_refusing_its_range_is_named_and_the_pipeline_cannot_be_reloaded() -> None:
    class NoMiddles(FakeShardEngine):
        def load(self, request: LoadRequest) -> Any:
            if request.role == "middle":
                raise EngineError(StructuredStatus(StatusCode.UNIMPLEMENTED, "no middle shards here"))
            return super().load(request)

    pipeline = PipelineEngine(NoMiddles)
    with pytest.raises(EngineError) as refused:
        pipeline.load(FULL)
    assert refused.value.status.code is StatusCode.UNIMPLEMENTED
    assert (
        refused.value.status.message
        == "PipelineEngine stage 2 of 3 (layers 2..2) refused to load: no middle shards here"
    )
    with pytest.raises(EngineError, match="half-loaded") as again:
        pipeline.load(FULL)
    assert again.value.status.code is StatusCode.FAILED_PRECONDITION
    assert loaded(PipelineEngine(NoMiddles, (1,))).capabilities().role == "full"


def test_a_second_load_is_refused() -> None:
    pipeline = loaded(PipelineEngine())
    with pytest.raises(EngineError, match="already serves") as again:
        pipeline.load(FULL)
    assert again.value.status.code is StatusCode.FAILED_PRECONDITION


def test_cuts_must_be_increasing_ints() -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        PipelineEngine(cuts=(2, 1))
    with pytest.raises(ValueError, match="strictly increasing"):
        PipelineEngine(cuts=(1, 1))
    with pytest.raises(TypeError, match="must be ints"):
        PipelineEngine(cuts=(1.0,))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sequence of ints"):
        PipelineEngine(cuts=1)  # type: ignore[arg-type]


# --- planted coordination bugs: found, named, shrunk -----------------------------------------


class PlantedPipeline(PipelineEngine):
    BUG: ClassVar[str]
    PROPERTY: ClassVar[str]
    MINIMAL: ClassVar[tuple[minimal.Step, ...]]  # runs: see tests/test_planted_minimal.py


class CancelReachesStage1Only(PlantedPipeline):
    BUG = "cancel is sent to the first stage only; the later stages keep the session's KV tokens"
    PROPERTY = "§2 metrics"
    MINIMAL = (minimal.prefill("a"), minimal.cancel("a"))

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        return self.stages[0].cancel(session_id, epoch)


class ReleaseReachesStage1Only(PlantedPipeline):
    BUG = "release frees the session on the first stage only; the later stages keep its slot"
    PROPERTY = "§2 metrics"
    MINIMAL = (minimal.prefill("a"), minimal.release("a"))

    def release(self, session_id: str) -> StructuredStatus:
        return self.stages[0].release(session_id)


class RetryRenumberedDownstream(PlantedPipeline):
    BUG = (
        "the coordinator numbers the tail's steps from its own count of forwarded steps, so a retry "
        "(answered by stage 1 from its cache) reaches the tail as a new step"
    )
    PROPERTY = "§2 rule 6"
    MINIMAL = (minimal.prefill("a"), minimal.prefill("a", note="resent"))

    def __init__(self) -> None:
        super().__init__(cuts=(1,))  # two stages: the hook runs once per step
        self.forwarded: dict[tuple[str, int], int] = {}

    def _downstream_request(self, request: StepRequest, bundle: BoundaryBundle) -> StepRequest:
        key = (request.session_id, request.epoch)
        step = self.forwarded.get(key, 0)
        self.forwarded[key] = step + 1
        return super()._downstream_request(replace(request, step=step), replace(bundle, step=step))

    def release(self, session_id: str) -> StructuredStatus:
        self.forwarded = {key: count for key, count in self.forwarded.items() if key[0] != session_id}
        return super().release(session_id)


class CallsCountedByStage1(PlantedPipeline):
    BUG = "call counters are read from the first stage, missing the calls the coordinator refused itself"
    PROPERTY = "§2 metrics"
    MINIMAL = (minimal.prefill("a", malformed="token_out_of_vocab", note="refused by the coordinator itself"),)

    def metrics(self) -> MetricsResult:
        first = self.stages[0].metrics()
        return replace(super().metrics(), prefill_calls=first.prefill_calls, decode_calls=first.decode_calls)


class TailGetsTheHeadsBundle(PlantedPipeline):
    BUG = "the coordinator fans the head's bundle out to every later stage instead of chaining them"
    PROPERTY = "§3 determinism"
    MINIMAL = (minimal.prefill("a"),)

    def __init__(self) -> None:
        super().__init__()
        self.head_bundle: BoundaryBundle | None = None

    def _downstream_request(self, request: StepRequest, bundle: BoundaryBundle) -> StepRequest:
        if bundle.boundary_point == "post_head_residual":
            self.head_bundle = bundle
        assert self.head_bundle is not None
        return super()._downstream_request(request, replace(self.head_bundle, boundary_point=bundle.boundary_point))


PLANTED: Sequence[type[PlantedPipeline]] = (
    CancelReachesStage1Only,
    ReleaseReachesStage1Only,
    RetryRenumberedDownstream,
    CallsCountedByStage1,
)


@pytest.mark.parametrize("engine", [*PLANTED, TailGetsTheHeadsBundle], ids=lambda engine: engine.__name__)
def test_a_planted_coordination_bug_is_found_named_and_shrunk(engine: type[PlantedPipeline]) -> None:
    """Shrunk to the stated minimum: 2 steps for the lost cancel, the lost release and the
    renumbered retry, 1 for the miscounted calls and the fanned-out bundle."""
    # The fan-out breaks no lifecycle rule, and twins of the same pipeline repeat it: only a
    # differential oracle (twins built from a single full fake) sees its outputs are wrong.
    reference = FakeShardEngine if engine is TailGetsTheHeadsBundle else None
    result = fuzz(engine, seed=3, examples=100, steps=40, role="full", reference=reference)
    assert result.failure is not None, f"{engine.__name__} ({engine.BUG}) was not found"
    assert result.failure.violation.property == engine.PROPERTY, result.failure.violation.message
    steps = [record.action.describe() for record in result.failure.records]
    assert len(steps) == len(engine.MINIMAL), f"shrunk to {steps}, minimum is {engine.MINIMAL}"


def test_without_a_reference_the_fanned_out_bundle_goes_unnoticed() -> None:
    """What the differential run adds: against itself the fan-out pipeline is consistent."""
    result = fuzz(TailGetsTheHeadsBundle, seed=3, examples=40, steps=30, role="full")
    assert result.failure is None
