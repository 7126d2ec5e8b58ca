"""The numpy llama engine: real arithmetic, SPEC §2 lifecycle (from SessionEngine), §3 within tolerance.

The numerics are checked against an independent float64 reference written here with
explicit loops over tokens and heads, so a wrong rotary layout, head grouping or MLP
shows up as a wrong number, not only as a broken property.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit import assert_shard_engine_contract
from shardkit._core.steps import synthetic_rows
from shardkit._run.runner import fuzz
from shardkit.contract import (
    FAULT_KINDS,
    BoundaryBundle,
    CacheResult,
    DecodeRequest,
    EngineError,
    EngineTensor,
    Fault,
    LoadRequest,
    PrefillRequest,
    StatusCode,
    StepResult,
    TokenOutput,
)
from shardkit.engines import NumpyShardEngine
from shardkit.engines.llama_weights import LlamaConfig, LlamaWeights, random_weights
from shardkit.engines.numpy_llama import NumpyEngineCrash, default_weights

LAYERS, HIDDEN, VOCAB = 4, 64, 256
TOLERANCE = NumpyShardEngine.TOLERANCE
ROLES = {"head": (0, 1), "middle": (1, 2), "tail": (2, 3), "full": (0, 3)}
SPLITS = [((0, a), (a + 1, 3)) for a in range(3)] + [
    ((0, a), (a + 1, b), (b + 1, 3)) for a in range(3) for b in range(a + 1, 3)
]
Op = Literal["prefill", "decode"]
Chunks = list[tuple[Op, tuple[int, ...]]]


def loaded(start: int = 0, end: int = 3, weights: LlamaWeights | None = None, **limits: int) -> NumpyShardEngine:
    engine = NumpyShardEngine(weights, **limits)
    total = engine.capabilities().total_layers
    assert engine.load(LoadRequest("tiny-llama", start, end, total)).status.ok
    return engine


def role_engine(role: str, **limits: int) -> NumpyShardEngine:
    return loaded(*ROLES[role], **limits)


def bundle_of(engine: NumpyShardEngine, tokens: tuple[int, ...], session: str, epoch: int, step: int) -> BoundaryBundle:
    """What the kit sends a middle or tail: rows synthesised from token ids, the ids as sideband."""
    rows = synthetic_rows(engine.capabilities(), tokens)
    residual = (EngineTensor.from_array("residual", rows),)
    return BoundaryBundle(session, epoch, step, "post_head_residual", "llama", residual, tokens)


def send(
    engine: NumpyShardEngine, op: Op, tokens: Sequence[int], *, session: str = "s", epoch: int = 0, step: int = 0
) -> StepResult:
    """One step carrying ``tokens`` in the input kind of the engine's role."""
    cls = PrefillRequest if op == "prefill" else DecodeRequest
    ids = tuple(tokens)
    if engine.capabilities().role in ("head", "full"):
        request = cls(session, epoch, step, token_ids=ids)
    else:
        request = cls(session, epoch, step, bundle=bundle_of(engine, ids, session, epoch, step))
    return engine.prefill(request) if isinstance(request, PrefillRequest) else engine.decode(request)


def run_pipeline(
    stages: Sequence[NumpyShardEngine], chunks: Chunks, *, session: str = "s", epoch: int = 0
) -> list[Any]:
    """Feed each chunk through the stages in order; return the last stage's outputs."""
    outputs = []
    for step, (op, tokens) in enumerate(chunks):
        cls = PrefillRequest if op == "prefill" else DecodeRequest
        output: Any = None
        for stage in stages:
            if output is None:
                result = send(stage, op, tokens, session=session, epoch=epoch, step=step)
            else:
                request = cls(session, epoch, step, bundle=output)
                result = stage.prefill(request) if isinstance(request, PrefillRequest) else stage.decode(request)
            assert result.status.ok, result.status
            output = result.output
        outputs.append(output)
    return outputs


def rows_of(outputs: Sequence[Any]) -> np.ndarray:
    return np.concatenate([output.tensors[0].to_array() for output in outputs])


def flatten(chunks: Chunks) -> tuple[int, ...]:
    return tuple(token for _, chunk in chunks for token in chunk)


def assert_rows_close(observed: np.ndarray, expected: np.ndarray) -> None:
    assert observed.shape == expected.shape
    difference = float(np.abs(observed - expected).max(initial=0.0))
    assert difference <= TOLERANCE, f"max abs difference {difference:.3g} > tolerance {TOLERANCE}"


def assert_same_token(observed: TokenOutput, expected: TokenOutput) -> None:
    """SPEC §3: tokens are equal, unless a margin below the tolerance lets a near-tie flip."""
    assert observed.margin is not None
    assert expected.margin is not None
    if observed.token_id != expected.token_id:
        assert min(observed.margin, expected.margin) < TOLERANCE, (observed, expected)
    assert abs(observed.margin - expected.margin) <= TOLERANCE


@st.composite
def chunked_histories(draw: st.DrawFn, max_tokens: int = 40) -> Chunks:
    """A random token history cut into a prefill, then prefill chunks and single-token decodes."""
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=max_tokens))
    chunks: Chunks = []
    start = 0
    while start < len(tokens):
        size = draw(st.integers(1, len(tokens) - start))
        op: Op = "decode" if chunks and size == 1 and draw(st.booleans()) else "prefill"
        chunks.append((op, tuple(tokens[start : start + size])))
        start += size
    return chunks


PROPERTY_SETTINGS = settings(max_examples=60, deadline=None)


# --- an independent float64 reference ------------------------------------------------------


def reference_forward(
    weights: LlamaWeights, tokens: Sequence[int], layers: range, rows: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(residual rows after ``layers``, logits of the last row), one token and one head at a time."""
    config = weights.config
    head_dim, group = config.head_dim, config.n_heads // config.n_kv_heads

    def f64(array: np.ndarray) -> np.ndarray:
        return array.astype(np.float64)

    def rms_norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x) + config.rms_eps) * f64(weight)

    def rotate(vector: np.ndarray, position: int) -> np.ndarray:
        out = vector.copy()
        for pair in range(head_dim // 2):
            angle = position * config.rope_theta ** (-2 * pair / head_dim)
            x0, x1 = vector[2 * pair], vector[2 * pair + 1]
            out[2 * pair] = x0 * np.cos(angle) - x1 * np.sin(angle)
            out[2 * pair + 1] = x0 * np.sin(angle) + x1 * np.cos(angle)
        return out

    stream = [f64(weights.token_embd[token]) for token in tokens] if rows is None else [f64(row) for row in rows]
    for index in layers:
        layer = weights.layers[index]
        keys: list[list[np.ndarray]] = []
        values: list[list[np.ndarray]] = []
        updated = []
        for position, x in enumerate(stream):
            h = rms_norm(x, layer.attn_norm)
            q, k, v = f64(layer.attn_q) @ h, f64(layer.attn_k) @ h, f64(layer.attn_v) @ h
            keys.append([rotate(k[i * head_dim : (i + 1) * head_dim], position) for i in range(config.n_kv_heads)])
            values.append([v[i * head_dim : (i + 1) * head_dim] for i in range(config.n_kv_heads)])
            heads = []
            for head in range(config.n_heads):
                query = rotate(q[head * head_dim : (head + 1) * head_dim], position)
                kv = head // group
                scores = np.array([query @ keys[j][kv] for j in range(position + 1)]) / np.sqrt(head_dim)
                probabilities = np.exp(scores - scores.max())
                probabilities /= probabilities.sum()
                heads.append(sum(probabilities[j] * values[j][kv] for j in range(position + 1)))
            x = x + f64(layer.attn_output) @ np.concatenate(heads)
            h = rms_norm(x, layer.ffn_norm)
            gate, up = f64(layer.ffn_gate) @ h, f64(layer.ffn_up) @ h
            updated.append(x + f64(layer.ffn_down) @ (gate / (1 + np.exp(-gate)) * up))
        stream = updated
    logits = f64(weights.output) @ rms_norm(stream[-1], weights.output_norm)
    return np.array(stream), logits


GQA_WEIGHTS = random_weights(LlamaConfig(vocab_size=40, hidden_size=48, n_layers=3, n_heads=6, n_kv_heads=2), seed=5)


@pytest.mark.parametrize("weights", [None, GQA_WEIGHTS], ids=["default", "grouped-query"])
def test_the_arithmetic_matches_an_independent_float64_reference(weights: LlamaWeights | None) -> None:
    """Rotary layout, head grouping, causal attention, SwiGLU and the head: all as the loop reference computes."""
    weights = weights or default_weights()
    last = weights.config.n_layers - 1
    tokens = tuple(int(token) for token in np.random.default_rng(3).integers(0, weights.config.vocab_size, 12))
    expected_rows, _ = reference_forward(weights, tokens, range(last))
    head = loaded(0, last - 1, weights)
    assert_rows_close(residual_of(send(head, "prefill", tokens)), expected_rows)
    _, expected_logits = reference_forward(weights, tokens, range(last + 1))
    full = loaded(0, last, weights)
    send(full, "prefill", tokens[:5])
    token = None
    for step, token_id in enumerate(tokens[5:], start=1):
        token = send(full, "decode", [token_id], step=step).output
    assert isinstance(token, TokenOutput)
    top_two = np.sort(expected_logits)[-2:]
    assert token.token_id == int(np.argmax(expected_logits))
    assert token.margin == pytest.approx(top_two[1] - top_two[0], abs=TOLERANCE)


def test_a_middle_and_a_tail_compute_on_the_rows_they_are_given() -> None:
    """Middle and tail inputs are residual rows: the reference run from those rows agrees."""
    weights = default_weights()
    tokens = (5, 200, 17, 9)
    middle = loaded(1, 2)
    rows = synthetic_rows(middle.capabilities(), tokens)
    expected_rows, _ = reference_forward(weights, tokens, range(1, 3), rows)
    assert_rows_close(residual_of(send(middle, "prefill", tokens)), expected_rows)
    _, expected_logits = reference_forward(weights, tokens, range(2, 4), rows)
    token = send(loaded(2, 3), "prefill", tokens).output
    assert isinstance(token, TokenOutput)
    assert token.token_id == int(np.argmax(expected_logits))


def residual_of(result: StepResult) -> np.ndarray:
    assert isinstance(result.output, BoundaryBundle), result.status
    return result.output.tensors[0].to_array()


# --- construction, loading, capabilities ------------------------------------------------------


def test_capabilities_describe_a_real_tiny_llama() -> None:
    caps = NumpyShardEngine().capabilities()
    assert (caps.architecture, caps.evidence_class, caps.dtype) == ("llama", "real", "float32")
    assert (caps.total_layers, caps.shard_start, caps.shard_end, caps.role) == (LAYERS, 0, 3, "full")
    assert (caps.hidden_size, caps.vocab_size, caps.max_sessions, caps.max_kv_tokens) == (HIDDEN, VOCAB, 4, 256)
    assert caps.supported_faults == frozenset(FAULT_KINDS)
    assert 0 < caps.tolerance == TOLERANCE < 0.01


def test_the_default_weights_are_generated_once_and_are_the_documented_ones() -> None:
    assert NumpyShardEngine().weights is NumpyShardEngine().weights is default_weights()
    expected = random_weights(LlamaConfig(), seed=0)
    assert np.array_equal(default_weights().layers[2].ffn_up, expected.layers[2].ffn_up)


@pytest.mark.parametrize(("name", "value"), [("max_sessions", 0), ("max_kv_tokens", -1), ("max_sessions", True)])
def test_a_bad_limit_is_refused_naming_it(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"{name} must be an int >= \d, got {value!r}"):
        NumpyShardEngine(**{name: value})


def test_weights_of_another_type_are_refused() -> None:
    with pytest.raises(TypeError, match="LlamaWeights"):
        NumpyShardEngine("model.gguf")  # type: ignore[arg-type]


@pytest.mark.parametrize("role", ROLES)
def test_every_role_loads_and_reports_its_range(role: str) -> None:
    caps = role_engine(role).capabilities()
    assert (caps.shard_start, caps.shard_end, caps.role) == (*ROLES[role], role)


def test_a_second_load_and_another_depth_raise_engine_error() -> None:
    engine = loaded(0, 1)
    with pytest.raises(EngineError, match=r"NumpyShardEngine already serves layers 0\.\.1"):
        engine.load(LoadRequest("tiny-llama", 0, 3, LAYERS))
    fresh = NumpyShardEngine()
    with pytest.raises(EngineError, match="total_layers=5, but the model has 4") as raised:
        fresh.load(LoadRequest("tiny-llama", 0, 4, 5))
    assert raised.value.status.code is StatusCode.INVALID_ARGUMENT
    assert not fresh.health().serving


@pytest.mark.parametrize("role", ROLES)
def test_outputs_have_the_declared_shape_and_tags(role: str) -> None:
    engine = role_engine(role)
    result = send(engine, "prefill", (1, 2, 3), session="x", epoch=4)
    assert (result.status.code, result.cache) == (StatusCode.OK, CacheResult.MISS)
    output = result.output
    if role in ("tail", "full"):
        assert isinstance(output, TokenOutput)
        assert 0 <= output.token_id < VOCAB
        assert output.margin is not None
        assert output.margin >= 0
        return
    assert isinstance(output, BoundaryBundle)
    assert (output.session_id, output.epoch, output.step, output.architecture) == ("x", 4, 0, "llama")
    assert output.boundary_point == f"post_{role}_residual"
    assert output.token_id_sideband == (1, 2, 3)
    (tensor,) = output.tensors
    assert (tensor.name, tensor.dtype, tensor.shape) == ("residual", "float32", (3, HIDDEN))
    assert np.isfinite(tensor.to_array()).all()


def test_huge_but_finite_input_rows_still_give_finite_outputs() -> None:
    """Any finite row is valid input (SPEC §2 rule 2); the norm must not overflow on it."""
    rows = np.full((2, HIDDEN), 3e38, dtype=np.float32)
    rows[1] *= -1
    for start, end in ((1, 2), (2, 3)):
        engine = loaded(start, end)
        bundle = BoundaryBundle("s", 0, 0, "post_head_residual", "llama", (EngineTensor.from_array("residual", rows),))
        result = engine.prefill(PrefillRequest("s", 0, 0, bundle=bundle))
        assert result.status.ok, result.status
        if isinstance(result.output, BoundaryBundle):
            assert np.isfinite(residual_of(result)).all()


# --- SPEC §3 properties -------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(chunked_histories())
def test_kv_cached_steps_equal_recomputing_the_whole_history(chunks: Chunks) -> None:
    """After every chunk, the cached engine agrees with one prefill of that prefix in a fresh
    session: residual rows (head) within tolerance, tokens (full) equal."""
    head_rows = rows_of(run_pipeline([loaded(0, 2)], chunks))
    whole = rows_of(run_pipeline([loaded(0, 2)], [("prefill", flatten(chunks))]))
    assert_rows_close(head_rows, whole)
    tokens = run_pipeline([loaded()], chunks)
    reference = loaded()
    for index in range(len(chunks)):
        recomputed = run_pipeline([reference], [("prefill", flatten(chunks[: index + 1]))], session=f"p{index}")[0]
        reference.release(f"p{index}")
        assert_same_token(tokens[index], recomputed)


@PROPERTY_SETTINGS
@given(chunked_histories(), st.sampled_from(["middle", "tail"]))
def test_middle_and_tail_do_not_depend_on_the_chunking_either(chunks: Chunks, role: str) -> None:
    outputs = run_pipeline([role_engine(role)], chunks)
    whole = run_pipeline([role_engine(role)], [("prefill", flatten(chunks))])
    if role == "middle":
        assert_rows_close(rows_of(outputs), rows_of(whole))
    else:
        assert_same_token(outputs[-1], whole[0])


@settings(max_examples=25, deadline=None)
@given(chunked_histories(max_tokens=32))
def test_every_layer_split_composes_to_the_full_model(chunks: Chunks) -> None:
    """head→tail and head→middle→tail equal the full model for every split of the 4 layers,
    and head→middle equals the wider head, within tolerance (bit for bit, in fact)."""
    full = run_pipeline([loaded()], chunks)
    for split in SPLITS:
        piped = run_pipeline([loaded(*span) for span in split], chunks)
        for observed, expected in zip(piped, full, strict=True):
            assert_same_token(observed, expected)
    for cut in range(2):
        for end in range(cut + 1, 3):
            wide = rows_of(run_pipeline([loaded(0, end)], chunks))
            assert_rows_close(rows_of(run_pipeline([loaded(0, cut), loaded(cut + 1, end)], chunks)), wide)


def test_the_same_history_gives_identical_outputs_in_any_session_epoch_or_engine() -> None:
    """Determinism and isolation: other sessions, a restart at a higher epoch, another engine."""
    chunks: Chunks = [("prefill", (3, 1, 4, 1, 5)), ("decode", (9,)), ("prefill", (2, 6)), ("decode", (5,))]
    noise: Chunks = [("prefill", (7, 7, 7)), ("decode", (8,))]
    for role in ("head", "tail"):
        expected = run_pipeline([role_engine(role)], chunks)
        engine = role_engine(role)
        run_pipeline([engine], noise, session="a", epoch=0)
        run_pipeline([engine], noise, session="bystander", epoch=3)
        interleaved = [run_pipeline([engine], chunks, session="a", epoch=2**40)]
        interleaved.append(run_pipeline([engine], chunks, session="b", epoch=0))
        interleaved.append(run_pipeline([engine], chunks, session="a", epoch=2**40 + 1))
        for outputs in interleaved:
            for observed, wanted in zip(outputs, expected, strict=True):
                if isinstance(wanted, TokenOutput):
                    assert observed == wanted
                else:
                    assert observed.tensors == wanted.tensors
                    assert observed.token_id_sideband == wanted.token_id_sideband


# --- SPEC §2 capacity ---------------------------------------------------------------------------


def test_opening_a_session_beyond_max_sessions_is_retryable_resource_exhausted() -> None:
    engine = loaded(max_sessions=2)
    assert send(engine, "prefill", (1,), session="a").status.ok
    assert send(engine, "prefill", (1,), session="b").status.ok
    refused = send(engine, "prefill", (1,), session="c")
    assert (refused.status.code, refused.status.retryable, refused.cache) == (
        StatusCode.RESOURCE_EXHAUSTED,
        True,
        CacheResult.MISS,
    )
    assert (engine.metrics().active_sessions, engine.metrics().kv_tokens) == (2, 2)
    engine.cancel("a", 0)
    assert send(engine, "prefill", (1,), session="c").status.code is StatusCode.RESOURCE_EXHAUSTED
    engine.release("a")
    assert send(engine, "prefill", (1,), session="c").status.ok


def test_kv_tokens_fill_max_kv_tokens_exactly_and_a_refused_step_changes_nothing() -> None:
    """used + new > max_kv_tokens is refused; the refused session continues as if it never happened."""
    engine, clean = loaded(0, 2, max_kv_tokens=6), loaded(0, 2)
    for target in (engine, clean):
        assert send(target, "prefill", (1, 2, 3, 4)).status.ok
    refused = send(engine, "prefill", (5, 6, 7), step=1)
    assert (refused.status.code, refused.status.retryable) == (StatusCode.RESOURCE_EXHAUSTED, True)
    assert send(engine, "prefill", (1,), session="t").status.ok
    assert send(engine, "decode", (5,), step=1).status.ok
    assert send(engine, "decode", (6,), step=2).status.code is StatusCode.RESOURCE_EXHAUSTED
    assert engine.metrics().kv_tokens == 6
    engine.release("t")
    continued = send(engine, "decode", (6,), step=2)
    send(clean, "decode", (5,), step=1)
    assert residual_of(continued).tobytes() == residual_of(send(clean, "decode", (6,), step=2)).tobytes()


def test_a_restart_frees_its_old_tokens_only_if_admitted() -> None:
    engine = loaded(max_kv_tokens=10)
    send(engine, "prefill", (1,) * 6, session="a")
    send(engine, "prefill", (1,) * 3, session="b")
    assert send(engine, "prefill", (2,) * 8, session="a", epoch=1).status.code is StatusCode.RESOURCE_EXHAUSTED
    assert send(engine, "decode", (2,), session="a", step=1).cache is CacheResult.HIT
    assert send(engine, "prefill", (2,) * 6, session="a", epoch=1).status.ok
    assert engine.metrics().kv_tokens == 9


def test_memory_pressure_lowers_the_limit_and_keeps_live_caches() -> None:
    engine = loaded()
    send(engine, "prefill", (1, 2, 3))
    assert engine.inject_fault(Fault("memory_pressure", 4)).ok
    assert engine.capabilities().max_kv_tokens == 4
    assert send(engine, "decode", (4,), step=1).status.ok
    assert send(engine, "decode", (5,), step=2).status.code is StatusCode.RESOURCE_EXHAUSTED


# --- faults -------------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ROLES)
def test_a_malformed_output_is_well_formed_but_clearly_wrong(role: str) -> None:
    """The fault moves every residual value by far more than the tolerance, or picks another
    in-vocabulary token; the cache still advances truthfully and a retry repeats the wrong output."""
    engine, clean = role_engine(role), role_engine(role)
    send(engine, "prefill", (1, 2))
    send(clean, "prefill", (1, 2))
    assert engine.inject_fault(Fault("malformed_output")).ok
    wrong, right = send(engine, "decode", (3,), step=1), send(clean, "decode", (3,), step=1)
    assert dataclasses.replace(wrong, output=None) == dataclasses.replace(right, output=None)
    if isinstance(right.output, TokenOutput):
        assert isinstance(wrong.output, TokenOutput)
        assert wrong.output.token_id != right.output.token_id
        assert 0 <= wrong.output.token_id < VOCAB
    else:
        assert isinstance(wrong.output, BoundaryBundle)
        assert dataclasses.replace(wrong.output, tensors=()) == dataclasses.replace(right.output, tensors=())
        shift = np.abs(residual_of(wrong) - residual_of(right))
        assert shift.min() > 1000 * TOLERANCE
        assert np.isfinite(residual_of(wrong)).all()
    assert send(engine, "decode", (3,), step=1) is wrong
    assert send(engine, "decode", (4,), step=2) == send(clean, "decode", (4,), step=2)


def test_a_crash_fault_kills_the_engine_for_good() -> None:
    engine = loaded()
    send(engine, "prefill", (1,))
    assert engine.inject_fault(Fault("crash", 2)).ok
    engine.release("nobody")
    with pytest.raises(NumpyEngineCrash) as raised:
        send(engine, "decode", (2,), step=1)
    assert "NumpyShardEngine.decode() raised" in "\n".join(raised.value.__notes__)
    with pytest.raises(NumpyEngineCrash):
        engine.health()


def test_a_delay_fault_does_not_change_the_result() -> None:
    engine, clean = loaded(), loaded()
    assert engine.inject_fault(Fault("delay", 0.01)).ok
    assert send(engine, "prefill", (1, 2)) == send(clean, "prefill", (1, 2))


# --- the kit on this engine ---------------------------------------------------------------------


def test_the_static_contract_passes() -> None:
    assert_shard_engine_contract(NumpyShardEngine)


@pytest.mark.parametrize("role", ROLES)
def test_fuzzing_finds_no_failure(role: str) -> None:
    result = fuzz("shardkit.engines.numpy_llama:NumpyShardEngine", seed=1, examples=60, steps=40, role=role)
    assert result.failure is None, result.failure.violation.message
    assert result.coverage[("prefill", "OK")] > 0
    assert result.coverage[("decode", "OK")] > 0


def test_from_gguf_serves_the_weights_in_the_file(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    from shardkit.engines.gguf_io import write_llama_gguf

    path = write_llama_gguf(tmp_path / "tiny.gguf", GQA_WEIGHTS)
    from_file = NumpyShardEngine.from_gguf(path, max_sessions=2)
    assert from_file.capabilities().max_sessions == 2
    assert from_file.load(LoadRequest("tiny", 0, 2, 3)).status.ok
    direct = loaded(0, 2, GQA_WEIGHTS)
    tokens = (1, 30, 7, 7)
    assert send(from_file, "prefill", tokens) == send(direct, "prefill", tokens)


def test_a_saturated_silu_gate_is_exact_and_silent() -> None:
    """A very negative gate makes exp(-gate) overflow; SiLU must still give -0, without a warning."""
    weights = default_weights()
    layer = dataclasses.replace(weights.layers[0], ffn_gate=weights.layers[0].ffn_gate * 1e4)
    strong = dataclasses.replace(weights, layers=(layer, *weights.layers[1:]))
    result = send(loaded(0, 0, strong), "prefill", (1, 2, 3))
    assert np.isfinite(residual_of(result)).all()
