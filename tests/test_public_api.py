"""The extension API: what an engine author or a backend's rule author uses, from ``shardkit`` alone.

- the stateful suites (``stateful/``, the worked examples users copy) import nothing private;
- ``SessionEngine`` and ``DelegatingEngine`` behave as docs/extending.md says, and the
  engines that document shows pass the contract and a short fuzz run;
- ``Prediction`` reads well by keyword and refuses swapped arguments;
- ``ShardMachine.capabilities`` and ``ShardMachine.sessions`` are what rules read.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
import types
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import pytest

import shardkit
from shardkit import (
    CacheResult,
    ContractViolation,
    DecodeRequest,
    DelegatingEngine,
    EngineCapabilities,
    EngineSpec,
    FakeShardEngine,
    FaultInjectable,
    HealthResult,
    LoadRequest,
    LoadResult,
    MetricsResult,
    Prediction,
    PrefillRequest,
    ReferenceModel,
    SessionEngine,
    SessionState,
    ShardEngine,
    StatusCode,
    StepInput,
    StepResult,
    StructuredStatus,
    TokenOutput,
    assert_shard_engine_contract,
    fuzz,
    machine_for,
)
from shardkit._core.sensitivity import history_sensitivity

REPO_ROOT = Path(__file__).resolve().parent.parent
STATEFUL = REPO_ROOT / "stateful"
EXTENDING = REPO_ROOT / "docs" / "extending.md"

# --- no private imports in the stateful suites ---------------------------------------------------


def private_imports(source: str) -> Iterator[str]:
    """Each import in ``source`` of a private module (a dotted path with a component that
    starts with ``_``, e.g. ``shardkit._core.driver``) or of a private name from a module,
    wherever it is (module level, a function, ``if TYPE_CHECKING:``). ``__future__`` is
    Python's, not a private module."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
            names: list[str] = []
        elif isinstance(node, ast.ImportFrom):
            modules = ["." * node.level + (node.module or "")]
            names = [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            if module == "__future__":
                continue
            if any(part.startswith("_") for part in module.lstrip(".").split(".") if part):
                yield f"line {node.lineno}: {module}"
            for name in names:
                if name.startswith("_"):
                    yield f"line {node.lineno}: {name} from {module}"


def test_the_finder_sees_every_form_of_a_private_import() -> None:
    source = """
from __future__ import annotations
import shardkit._core.driver
from shardkit._run.runner import fuzz
from shardkit.engines._checks import refusal
from shardkit import _HOMES
import shardkit.contract, shardkit._machine as machine
def later():
    from shardkit._core import model
if TYPE_CHECKING:
    from shardkit._core.model import SessionState
from shardkit import fuzz, machine_for
from shardkit.engines.base import SessionEngine
import hypothesis.strategies
"""
    assert sorted(private_imports(source)) == [
        "line 11: shardkit._core.model",
        "line 3: shardkit._core.driver",
        "line 4: shardkit._run.runner",
        "line 5: shardkit.engines._checks",
        "line 6: _HOMES from shardkit",
        "line 7: shardkit._machine",
        "line 9: shardkit._core",
    ]


def stateful_files() -> list[Path]:
    files = sorted(STATEFUL.glob("*.py"))
    assert files, f"no Python files under {STATEFUL}"
    return files


@pytest.mark.parametrize("path", stateful_files(), ids=lambda path: path.name)
def test_the_stateful_suites_import_only_public_names(path: Path) -> None:
    """The worked examples are what users copy: a private import there would teach one."""
    found = list(private_imports(path.read_text(encoding="utf-8")))
    assert not found, f"{path.relative_to(REPO_ROOT)} imports private names (use `from shardkit import …`): {found}"


# --- the engines docs/extending.md shows --------------------------------------------------------


def documented_module(name: str, tmp_path: Path) -> types.ModuleType:
    """The ```python block of docs/extending.md that starts with ``# <name>``, imported as a module."""
    blocks = re.findall(r"^```python\n(.*?)^```", EXTENDING.read_text(encoding="utf-8"), flags=re.DOTALL | re.MULTILINE)
    (source,) = [block for block in blocks if block.startswith(f"# {name}\n")]
    path = tmp_path / name
    path.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(f"documented_{path.stem}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(module)
    return module


def test_the_documented_session_engine_passes_the_contract_and_a_short_fuzz(tmp_path: Path) -> None:
    module = documented_module("sum_engine.py", tmp_path)
    engine_class = module.SumEngine
    skipped = assert_shard_engine_contract(engine_class)
    assert all("needs" in reason for reason in skipped), skipped  # only the roles one layer cannot serve
    assert history_sensitivity(engine_class).summary() in EXTENDING.read_text(encoding="utf-8")  # as shown there
    result = fuzz(engine_class, seed=1, examples=30, steps=50)
    assert result.failure is None, result.failure.violation.message if result.failure else ""
    assert result.faults == frozenset({"delay", "memory_pressure", "malformed_output", "crash"})
    assert engine_class().capabilities().supported_faults == result.faults  # every fault native
    assert engine_class.ENGINE_NAME == "SumEngine"  # the default: the class name

    class ChunkySumEngine(engine_class):  # type: ignore[misc, valid-type]
        pass

    class NamedSumEngine(engine_class):  # type: ignore[misc, valid-type]
        ENGINE_NAME = "Named"

    class NamedChild(NamedSumEngine):
        pass

    # A subclass is another engine: its messages name it, not its parent.
    assert ChunkySumEngine.ENGINE_NAME == "ChunkySumEngine"
    assert NamedSumEngine.ENGINE_NAME == "Named"
    assert NamedChild.ENGINE_NAME == "NamedChild"


def test_the_documented_engine_of_several_layers_serves_every_role_and_passes(tmp_path: Path) -> None:
    module = documented_module("crc_engine.py", tmp_path)
    assert assert_shard_engine_contract(module.CrcEngine) == []  # no check skipped: every role served
    assert history_sensitivity(module.CrcEngine).summary() in EXTENDING.read_text(encoding="utf-8")
    result = fuzz(module.CrcEngine, seed=1, examples=60, steps=50)  # role "any": a role per example
    assert result.failure is None, result.failure.violation.message if result.failure else ""


def test_the_documented_wrapper_is_found_and_shrunk(tmp_path: Path) -> None:
    module = documented_module("leaky.py", tmp_path)
    result = fuzz(module.LeakyRelease, seed=1, examples=100, steps=50)
    assert result.failure is not None
    assert result.failure.violation.property == "§2 metrics"
    assert [record.action.op for record in result.failure.records] == ["prefill", "release"]
    assert "memory_pressure" not in result.faults  # not FaultInjectable: boundary faults only


# --- SessionEngine ----------------------------------------------------------------------------


class _Echo(SessionEngine[tuple[int, ...]]):
    """A one-layer engine answering the last token."""

    EVIDENCE_CLASS: ClassVar[Any] = "fixture"
    TOLERANCE: ClassVar[Any] = 0.0

    def __init__(self, spec: EngineSpec | None = None) -> None:
        super().__init__(spec or EngineSpec("echo", 1, 2, 8, "float32", 2, 8))

    def load_layers(self, request: LoadRequest, layers: range, role: str) -> None:
        pass

    def fresh_cache(self) -> tuple[int, ...]:
        return ()

    def forward(self, cache: tuple[int, ...], step: StepInput) -> tuple[tuple[int, ...], TokenOutput]:
        assert step.token_ids is not None
        return cache + step.token_ids, TokenOutput(step.token_ids[-1])


def test_a_session_engine_subclass_writes_hooks_only_and_gets_the_lifecycle() -> None:
    engine = _Echo()
    assert engine.load(LoadRequest("m", 0, 0, 1)).status.ok
    first = engine.prefill(PrefillRequest("a", 0, 0, token_ids=(3, 5)))
    assert (first.status.code, first.cache, first.output) == (StatusCode.OK, CacheResult.MISS, TokenOutput(5))
    assert engine.prefill(PrefillRequest("a", 0, 0, token_ids=(3, 5))) == first  # rule 6: a retry
    stale = engine.decode(DecodeRequest("b", 0, 0, token_ids=(1,)))
    assert stale.status.code is StatusCode.NOT_FOUND  # rule 3
    too_many = engine.prefill(PrefillRequest("a", 0, 1, token_ids=tuple(range(7))))
    assert (too_many.status.code, too_many.status.retryable) == (StatusCode.RESOURCE_EXHAUSTED, True)  # rule 7
    assert engine.metrics() == MetricsResult(prefill_calls=3, decode_calls=1, active_sessions=1, kv_tokens=2)
    assert isinstance(engine, FaultInjectable)
    assert engine.spec == EngineSpec("echo", 1, 2, 8, "float32", 2, 8)
    assert engine.ENGINE_NAME == "_Echo"


def test_a_simulated_crash_raises_a_runtime_error_naming_the_engine_by_default() -> None:
    engine = _Echo()
    engine.load(LoadRequest("m", 0, 0, 1))
    assert engine.inject_fault(shardkit.Fault("crash", 1.0)).ok
    with pytest.raises(RuntimeError, match=r"_Echo process died \(simulated crash\)") as raised:
        engine.prefill(PrefillRequest("a", 0, 0, token_ids=(1,)))
    assert any("_Echo.prefill() raised" in note for note in raised.value.__notes__)


@pytest.mark.parametrize(
    ("attribute", "value", "expected"),
    [
        ("EVIDENCE_CLASS", "synthetic", r"_Broken.EVIDENCE_CLASS must be 'fixture' .* or 'real' .*, got 'synthetic'"),
        ("TOLERANCE", -1.0, r"_Broken.TOLERANCE must be a finite float >= 0 .*, got -1.0"),
        ("TOLERANCE", float("nan"), r"_Broken.TOLERANCE must be a finite float >= 0 .*, got nan"),
    ],
)
def test_a_session_engine_with_a_bad_class_variable_says_which_and_how_to_fix_it(
    attribute: str, value: object, expected: str
) -> None:
    broken = type("_Broken", (_Echo,), {attribute: value})
    with pytest.raises(TypeError, match=expected):
        broken()


def test_a_session_engine_without_evidence_class_or_tolerance_says_to_set_them() -> None:
    class _Bare(SessionEngine[int]):
        def load_layers(self, request: LoadRequest, layers: range, role: str) -> None:
            pass

        def fresh_cache(self) -> int:
            return 0

        def forward(self, cache: int, step: StepInput) -> tuple[int, TokenOutput]:
            return cache, TokenOutput(0)

    with pytest.raises(TypeError, match=r"_Bare.EVIDENCE_CLASS must be .*got None; set it as a class variable"):
        _Bare(EngineSpec("bare", 1, 2, 8, "float32", 2, 8))


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("total_layers", 0, "EngineSpec.total_layers must be an int >= 1, got 0"),
        ("vocab_size", True, "EngineSpec.vocab_size must be an int >= 1, got True"),
        ("max_kv_tokens", -1, "EngineSpec.max_kv_tokens must be an int >= 0, got -1"),
        ("dtype", "float-ish", "EngineSpec.dtype must be a dtype name such as 'float32', 'bfloat16' or 'float16', got 'float-ish'"),
        ("architecture", "", "EngineSpec.architecture must be a non-empty str, got ''"),
    ],
)
def test_an_engine_spec_names_the_bad_value(field: str, value: object, expected: str) -> None:
    good = EngineSpec("echo", 1, 2, 8, "float32", 2, 8)
    with pytest.raises(ValueError, match=re.escape(expected)):
        replace(good, **{field: value})


def test_step_input_rows_of_token_ids_says_to_read_token_ids() -> None:
    with pytest.raises(ValueError, match=r"this step carries token ids .*; read token_ids"):
        StepInput((1, 2), None).rows()
    assert len(StepInput((1, 2), None)) == 2


# --- DelegatingEngine -------------------------------------------------------------------------


class _Recording(FakeShardEngine):
    """The fake, noting which operations were called."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __getattribute__(self, name: str) -> Any:
        if name in ("load", "capabilities", "prefill", "decode", "cancel", "release", "health", "metrics"):
            object.__getattribute__(self, "calls").append(name)
        return object.__getattribute__(self, name)


def test_a_delegating_engine_forwards_the_eight_operations_and_nothing_else() -> None:
    inner = _Recording()
    wrapper: DelegatingEngine[_Recording] = DelegatingEngine(inner)
    assert isinstance(wrapper.load(LoadRequest("m", 0, 3, 4)), LoadResult)
    assert isinstance(wrapper.capabilities(), EngineCapabilities)
    assert isinstance(wrapper.prefill(PrefillRequest("a", 0, 0, token_ids=(1,))), StepResult)
    assert isinstance(wrapper.decode(DecodeRequest("a", 0, 1, token_ids=(2,))), StepResult)
    assert isinstance(wrapper.cancel("a", 0), StructuredStatus)
    assert isinstance(wrapper.release("a"), StructuredStatus)
    assert isinstance(wrapper.health(), HealthResult)
    assert wrapper.metrics() == inner.metrics()
    calls = [call for call in inner.calls if call != "metrics"]
    assert calls == ["load", "capabilities", "prefill", "decode", "cancel", "release", "health"]
    assert not isinstance(wrapper, FaultInjectable)  # inject_fault is not forwarded
    assert not hasattr(wrapper, "inject_fault")


def test_a_delegating_engine_refuses_what_is_not_an_engine_and_says_what_to_pass() -> None:
    with pytest.raises(TypeError, match=r"wraps a ShardEngine instance, got ABCMeta.*pass an engine"):
        DelegatingEngine(FakeShardEngine)  # type: ignore[type-var]


def test_the_kits_own_wrappers_are_delegating_engines() -> None:
    from shardkit._core.faults import FaultInjectingEngine
    from shardkit._planted import DelegatingEngine as PlantedDelegate
    from shardkit._planted import PlantedEngine

    assert issubclass(FaultInjectingEngine, DelegatingEngine)
    assert issubclass(PlantedDelegate, DelegatingEngine)
    assert not isinstance(PlantedDelegate(), FaultInjectable)  # tests rely on a wrapper without faults
    assert issubclass(PlantedEngine, FaultInjectable)  # planted bugs take every fault natively


# --- Prediction -------------------------------------------------------------------------------


def test_a_prediction_reads_well_by_keyword_and_its_flags_are_keyword_only() -> None:
    by_keyword = Prediction(
        op="fork", code=StatusCode.RESOURCE_EXHAUSTED, rule="fork", because="no slot", retryable=True
    )
    assert by_keyword == Prediction("fork", StatusCode.RESOURCE_EXHAUSTED, "fork", "no slot", retryable=True)
    assert str(by_keyword) == "RESOURCE_EXHAUSTED retryable by §2 fork: no slot"
    with pytest.raises(TypeError):
        Prediction("fork", StatusCode.OK, "fork", "copied", True)  # type: ignore[misc]


def test_a_prediction_with_swapped_arguments_names_the_bad_value() -> None:
    order = re.escape("(the order is op, code, rule, because; or pass them by keyword)")
    with pytest.raises(TypeError, match=r"Prediction\('fork', …\): code must be a StatusCode, got str 'fork' " + order):
        Prediction("fork", "fork", StatusCode.OK, "copied")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"because must be a str, got int 3 " + order):
        Prediction("fork", StatusCode.OK, "fork", 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"cache must be a CacheResult \(HIT or MISS\), got bool True"):
        Prediction("decode", StatusCode.OK, "rule 8", "fine", cache=True)  # type: ignore[arg-type]


def test_set_session_opens_a_session_the_metrics_count() -> None:
    model = ReferenceModel()
    model.load(FakeShardEngine().capabilities())
    model.set_session("b", SessionState(epoch=2, next_step=3, kv_tokens=5))
    assert model.expected_metrics() == MetricsResult(prefill_calls=0, decode_calls=0, active_sessions=1, kv_tokens=5)
    with pytest.raises(TypeError, match=r"set_session\('b', …\) takes a SessionState, got dict"):
        model.set_session("b", {"epoch": 0})  # type: ignore[arg-type]


# --- what rules read --------------------------------------------------------------------------


def test_a_machine_exposes_the_loaded_capabilities_and_a_read_only_view_of_the_sessions() -> None:
    machine_class = machine_for(FakeShardEngine, role="full", faults=False, twins=False)
    machine = machine_class()
    machine.load_engine(layout=0)
    try:
        assert machine.capabilities == machine._driver.caps
        assert (machine.capabilities.shard_start, machine.capabilities.shard_end) == (0, 3)
        assert dict(machine.sessions) == {}
        machine.prefill(session=0, chunk=0)
        (session_id,) = machine.sessions
        state = machine.sessions[session_id]
        assert isinstance(state, SessionState)
        assert (state.epoch, state.next_step, state.kv_tokens) == (0, 1, 1)
        with pytest.raises(TypeError):
            machine.sessions["x"] = state  # type: ignore[index]
    finally:
        machine.teardown()


def test_every_extension_name_is_exported_from_shardkit() -> None:
    for name in ("SessionEngine", "DelegatingEngine", "EngineSpec", "StepInput", "Produced", "CustomOp"):
        assert name in shardkit.__all__, name
    for name in ("SessionState", "step_rule", "fuzz", "FuzzResult", "ShardMachine", "ReferenceModel"):
        assert name in shardkit.__all__, name
    assert issubclass(SessionEngine, ShardEngine)
    assert ContractViolation.__module__ == "shardkit"  # the path to import it from
