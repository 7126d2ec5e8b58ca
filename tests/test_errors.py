"""One errors module: every exception class a user can meet is defined in ``shardkit/errors.py``
(or, for the engines' contract vocabulary, ``shardkit/contract.py``), subclasses
``ShardkitError`` and the builtin it resembles, and says when it is raised.

The classes are found in the source with ``ast`` (nothing else is imported to find them); the
finder has a self-test on a small package written to ``tmp_path``.
"""

from __future__ import annotations

import ast
import builtins
import inspect
from pathlib import Path

import pytest

import shardkit.errors as errors
from shardkit.errors import ShardkitError

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "shardkit"
ERRORS = PACKAGE_ROOT / "errors.py"
CONTRACT = PACKAGE_ROOT / "contract.py"

#: Public exception classes defined outside errors.py and contract.py on purpose, and why.
ELSEWHERE = {
    "StepFailed": "shardkit/_core/outcomes.py: control flow; the driver's finding about one step, carrying its "
    "Violation and StepRecord, caught by the machine, the runner, the minimiser and replay, which report it",
    "Fail": "shardkit/_core/outcomes.py: control flow; one check disagreed inside a step, which the driver "
    "turns into a StepFailed",
    "OracleFailure": "shardkit/_core/twins.py: control flow; the twin oracle's disagreement, which the driver "
    "turns into a finding (or an InvalidTarget naming a broken reference engine)",
    "ShrinkBudgetSpent": "shardkit/_machine/hypothesis_adapter.py: control flow; a BaseException raised through "
    "Hypothesis to stop its shrinker on a count, caught by the runner",
    "OptionValueError": "shardkit/_machine/spec.py: control flow; an option's declared check refused a value, "
    "which the options or the command line turn into a UsageError naming the option",
    "ForkUnavailable": "shardkit/_transport/forkserver.py: control flow; the process that forks --isolate's "
    "workers cannot give one, caught by the worker pool, which starts a fresh interpreter instead",
    "FakeEngineCrash": "shardkit/engines/fake.py: the bundled engine's own simulated process death, raised as "
    "any engine under test's exception would be (a server reports it by its module-qualified name)",
    "NumpyEngineCrash": "shardkit/engines/numpy_llama.py: the bundled engine's own simulated process death",
    "LlamaCppEngineCrash": "shardkit/engines/llama_cpp.py: the bundled engine's own simulated process death",
    "TransformersEngineCrash": "shardkit/engines/transformers_llama.py: the bundled engine's own simulated process death",
    "SchedulerClosed": "shardkit/engines/transformers_batching.py: the bundled batching engine's answer to a step "
    "on a closed scheduler, raised as any engine under test's exception would be",
}

#: Classes of errors.py that are not ``ShardkitError``s, and why.
NOT_SHARDKIT_ERRORS = {
    "EngineLost": "a BaseException on purpose: it must pass through Hypothesis and the driver's guards "
    "(which catch Exception) and end the run at once",
}

#: Each error and the builtin it also is, so ``except ValueError`` (…) around a call keeps working.
RESEMBLES = {
    "InvalidTarget": ValueError,
    "TraceFormatError": ValueError,
    "UsageError": ValueError,
    "UntrustedTarget": ValueError,
    "WireFormatError": ValueError,
    "GgufFormatError": ValueError,
    "GgufUnavailableError": ImportError,
    "ContractViolation": AssertionError,
    "SuiteFailure": AssertionError,
    "KitBug": RuntimeError,
    "InjectedCrash": RuntimeError,
    "RemoteEngineError": RuntimeError,
}


# --- finding exception classes in the source ---------------------------------------------------


def _base_name(base: ast.expr) -> str:
    if isinstance(base, ast.Name):
        return base.id
    if isinstance(base, ast.Attribute):
        return base.attr
    if isinstance(base, ast.Subscript):  # Generic[T] and the like
        return _base_name(base.value)
    return ""


def _is_builtin_exception(name: str) -> bool:
    value = getattr(builtins, name, None)
    return isinstance(value, type) and issubclass(value, BaseException)


def exception_classes(root: Path) -> list[tuple[Path, str]]:
    """(file, class name) of every class under ``root`` that derives from an exception: a builtin
    one, one defined under ``root`` (by name, to a fixed point), or another package's whose name
    ends in Error or Exception."""
    classes: list[tuple[Path, str, list[str]]] = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.append((path, node.name, [_base_name(base) for base in node.bases]))
    exceptional: set[str] = set()
    found: dict[tuple[Path, str], None] = {}
    changed = True
    while changed:
        changed = False
        for path, name, bases in classes:
            if (path, name) in found:
                continue
            if any(
                _is_builtin_exception(base) or base in exceptional or base.endswith(("Error", "Exception"))
                for base in bases
            ):
                found[(path, name)] = None
                exceptional.add(name)
                changed = True
    return sorted(found)


def test_the_finder_finds_exception_classes_however_they_derive(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "errors.py").write_text(
        "import grpc\n"
        "class Root(Exception): pass\n"
        "class Usage(Root, ValueError): pass\n"
        "class Lost(BaseException): pass\n"
        "class Rpc(grpc.RpcError): pass\n"
        "class Plain: pass\n"
        "class Mixin(object): pass\n"
    )
    (package / "sub" / "deep.py").write_text(
        "from pkg.errors import Usage\n"
        "class Deeper(Usage): pass\n"
        "class _Private(Exception): pass\n"
        "def f():\n"
        "    class Local(KeyError): pass\n"
        "class NotOne(dict): pass\n"
    )
    names = sorted(name for _, name in exception_classes(package))
    assert names == ["Deeper", "Local", "Lost", "Root", "Rpc", "Usage", "_Private"]


def test_the_finder_sees_the_kits_exceptions_wherever_they_are() -> None:
    """Not vacuous on the package itself: errors.py's, the contract's, and the ones allowed elsewhere."""
    names = {name for _, name in exception_classes(PACKAGE_ROOT)}
    assert {"ShardkitError", "UsageError", "EngineLost", "EngineError", "Fail"} <= names
    assert set(ELSEWHERE) <= names


# --- where they live ---------------------------------------------------------------------------


def test_every_exception_class_is_in_errors_py_or_contract_py_or_private_or_listed() -> None:
    stray = [
        f"{path.relative_to(PACKAGE_ROOT.parent)}: {name}"
        for path, name in exception_classes(PACKAGE_ROOT)
        if path not in (ERRORS, CONTRACT) and not name.startswith("_") and name not in ELSEWHERE
    ]
    assert not stray, f"move these to shardkit/errors.py, or list them in ELSEWHERE with the reason: {stray}"


def test_each_class_listed_elsewhere_is_defined_where_the_list_says() -> None:
    where = {name: path.relative_to(PACKAGE_ROOT.parent).as_posix() for path, name in exception_classes(PACKAGE_ROOT)}
    for name, reason in ELSEWHERE.items():
        assert reason.startswith(f"{where[name]}: "), (name, where[name])


def test_errors_py_names_every_exception_that_lives_elsewhere_and_where() -> None:
    """Its docstring is the map: the control-flow exceptions and the engines' own, and their modules."""
    doc = errors.__doc__ or ""
    for path, name in exception_classes(PACKAGE_ROOT):
        if path in (ERRORS, CONTRACT):
            continue
        module = ".".join(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
        assert f"``{name}``" in doc, f"shardkit/errors.py's docstring does not name {name}"
        assert f"``{module}``" in doc, f"shardkit/errors.py's docstring does not name {module}, home of {name}"


# --- what errors.py holds -------------------------------------------------------------------------


def _classes_of_errors_py() -> dict[str, type]:
    return {
        name: value
        for name, value in vars(errors).items()
        # A public one reports the module to import it from, shardkit.
        if inspect.isclass(value) and value.__module__ in (errors.__name__, "shardkit")
    }


def test_errors_py_exports_exactly_the_classes_it_defines() -> None:
    defined = {name for path, name in exception_classes(PACKAGE_ROOT) if path == ERRORS}
    assert set(_classes_of_errors_py()) == defined
    assert sorted(errors.__all__) == sorted(defined)


@pytest.mark.parametrize("name", sorted(_classes_of_errors_py()))
def test_every_error_is_a_shardkit_error_and_says_when_it_is_raised(name: str) -> None:
    error = _classes_of_errors_py()[name]
    doc = error.__dict__.get("__doc__") or ""
    assert doc.strip(), f"{name} has no docstring"
    assert "\n" not in doc.strip().split("\n\n")[0].strip(), f"{name}'s docstring does not open with one line"
    if name in NOT_SHARDKIT_ERRORS:
        assert issubclass(error, BaseException)
        assert not issubclass(error, Exception), f"{name} is listed as a BaseException on purpose"
    else:
        assert issubclass(error, ShardkitError), name


@pytest.mark.parametrize(("name", "builtin"), sorted(RESEMBLES.items()))
def test_errors_subclass_the_builtin_they_resemble(name: str, builtin: type[BaseException]) -> None:
    assert issubclass(getattr(errors, name), builtin)


def test_moved_errors_are_still_importable_from_their_public_module() -> None:
    from shardkit.engines import gguf_io

    assert gguf_io.GgufFormatError is errors.GgufFormatError
    assert gguf_io.GgufUnavailableError is errors.GgufUnavailableError
