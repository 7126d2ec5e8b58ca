"""The public surface: ``shardkit.__all__`` is exactly the documented names, nothing private leaks."""

from __future__ import annotations

import re
from pathlib import Path

import shardkit

# SPEC §1, plus the names the foundation and state-machine issues add (README "Public API").
SPEC_VOCABULARY = {
    "StatusCode",
    "CacheResult",
    "StructuredStatus",
    "EngineError",
    "LoadRequest",
    "LoadResult",
    "EngineCapabilities",
    "EngineTensor",
    "BoundaryBundle",
    "TokenOutput",
    "PrefillRequest",
    "DecodeRequest",
    "StepResult",
    "HealthResult",
    "MetricsResult",
    "ShardEngine",
    "Fault",
    "FaultInjectable",
}
KIT = {
    "prepare_replay",
    "PreparedReplay",
    "FakeShardEngine",
    "FakeShardEngineConfig",
    "ReferenceModel",
    "Prediction",
    "assert_shard_engine_contract",
    "ShardkitError",
    "InvalidTarget",
    "ContractViolation",
    "ShardMachine",
    "machine_for",
    "Action",
    "NumpyShardEngine",
    "PipelineEngine",
    "replay",
    "TraceFormatError",
}
#: The extension API, documented in docs/extending.md: writing engines, and extending the rules.
EXTENSION = {
    "SessionEngine",
    "EngineSpec",
    "StepInput",
    "Produced",
    "DelegatingEngine",
    "RecordingEngine",
    "AcceptedSteps",
    "SessionState",
    "CustomOp",
    "step_rule",
    "fuzz",
    "FuzzResult",
    "FuzzOptions",
    "yield_point",
}
DOCUMENTED = SPEC_VOCABULARY | KIT | EXTENSION
EXTENDING = Path(__file__).resolve().parent.parent / "docs" / "extending.md"


def test_all_is_exactly_the_documented_public_names() -> None:
    assert set(shardkit.__all__) == DOCUMENTED
    assert len(shardkit.__all__) == len(set(shardkit.__all__)), "a name is listed twice"


def test_the_extension_api_is_documented_in_extending_md() -> None:
    text = EXTENDING.read_text(encoding="utf-8")
    missing = sorted(name for name in EXTENSION if not re.search(rf"`@?{name}\b", text))
    assert not missing, f"{EXTENDING.name} never names {missing}"


def test_every_listed_name_exists() -> None:
    for name in shardkit.__all__:
        assert getattr(shardkit, name) is not None


def test_nothing_private_is_exported() -> None:
    assert not [name for name in shardkit.__all__ if name.startswith("_")]


def test_the_package_has_a_version_and_ships_types() -> None:
    from importlib.resources import files

    assert shardkit.__version__
    assert files("shardkit").joinpath("py.typed").is_file()


def test_every_public_name_is_its_object_even_after_every_submodule_is_imported() -> None:
    """Public names are imported on first use; a submodule of the same name must not shadow one."""
    import importlib
    import pkgutil
    import types

    for module in pkgutil.walk_packages(shardkit.__path__, "shardkit."):
        if module.name.startswith(("shardkit.proto", "shardkit.remote", "shardkit._transport", "shardkit.engines.llama_cpp")):
            continue  # optional extras
        if module.name == "shardkit.__main__":
            continue  # runs the command
        importlib.import_module(module.name)
    for name in shardkit.__all__:
        assert not isinstance(getattr(shardkit, name), types.ModuleType), name
    assert sorted(shardkit.__all__) == sorted(name for name in dir(shardkit) if name in shardkit.__all__)


def test_a_worker_process_does_not_import_hypothesis() -> None:
    """`shardkit serve --worker` starts once per crash under --isolate: it stays light."""
    import subprocess
    import sys

    probe = "import sys, shardkit._cli.main, shardkit._transport.server; print('hypothesis' in sys.modules)"
    imported = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert imported.strip() == "False"


def test_every_public_name_reports_the_public_module_however_it_was_imported() -> None:
    """``shardkit.X.__module__ == "shardkit"``, also when ``X`` was first imported from where it is
    defined (a fresh process, each home module imported before ``shardkit.X`` is read), so that
    tracebacks and reprs show the path to import it from. ``Produced`` is a type alias
    (``bytes | NDArray | TokenOutput``), which belongs to no module."""
    import subprocess
    import sys

    probe = """
import importlib, shardkit
from shardkit._public import PUBLIC_HOMES
homes = {name: importlib.import_module(home) for name, home in PUBLIC_HOMES.items()}
found = {name: getattr(homes[name], name) for name in PUBLIC_HOMES}
print(sorted(f"{name}:{value.__module__}" for name, value in found.items() if value.__module__ != "shardkit"))
print(sorted(name for name in PUBLIC_HOMES if getattr(shardkit, name) is not found[name]))
"""
    lines = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.splitlines()
    assert lines == ["['Produced:types']", "[]"]


def test_the_public_names_are_listed_once_in_the_type_checking_block(tmp_path: Path) -> None:
    """``__all__`` and where each name is imported from are read from the block type checkers
    read; a line of another form there is refused, naming the line."""
    import pytest

    from shardkit._public import _read_public_homes

    init = Path(shardkit.__file__)
    text = init.read_text(encoding="utf-8")
    assert sorted(shardkit.__all__) == sorted(re.findall(r"^    from shardkit[\w.]* import (\w+) as \1$", text, re.M))
    assert "__all__ = [\n" not in text
    broken = tmp_path / "__init__.py"
    broken.write_text("if TYPE_CHECKING:\n    from shardkit.contract import ShardEngine\n", encoding="utf-8")
    with pytest.raises(ImportError, match="line 2: write 'import ShardEngine as ShardEngine'"):
        _read_public_homes(broken)


def test_the_identity_of_a_default_run_names_the_kit_s_machine_and_model_as_before() -> None:
    """Trace names, database keys and derandomized seeds derive from it: they must not change
    because the kit's classes now report ``shardkit`` as their module."""
    from shardkit import machine_for
    from shardkit._run.artefacts import machine_identity

    identity = machine_identity(machine_for("shardkit:FakeShardEngine", role="full", faults="none"))
    assert identity.splitlines()[-2:] == [
        "machine=shardkit._machine.state_machine:ShardMachine",
        "model=shardkit._core.model:ReferenceModel",
    ]
