"""What a run leaves behind, keyed by the engine it ran: trace files, regression tests
and the example database.

While Hypothesis runs, the shortest failure seen so far is kept on disk as
``…-in-progress.json``, so even a killed run leaves a trace; at the end the reported
failure's trace and regression test replace it. File names and the example database's
keys both derive from ``machine_identity``, so two engines or two configurations never
share a file or replay each other's saved examples. Kept apart from
``shardkit._run.runner``, which decides *what* failed and how short it gets: this module
decides only where that lands on disk and under which name.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hypothesis import settings
from hypothesis.database import ExampleDatabase

from shardkit._core.model import ReferenceModel
from shardkit._machine.observer import FailureReport
from shardkit._machine.profiles import time_independent
from shardkit._machine.spec import options_of
from shardkit._machine.state_machine import ShardMachine
from shardkit._run.regression import regression_test_source
from shardkit._run.trace import importable_name, trace_document, write_atomically, write_new
from shardkit._run.trust import CODE_KEYS

__all__ = ["Artefacts", "machine_identity", "run_settings_for"]


def machine_identity(machine: type[ShardMachine]) -> str:
    """What makes two runs' failures comparable: the engine (a file target by its path
    from the folder the run starts in, or its absolute path if it lies outside), the
    machine and model classes, and the options that change what is generated. Trace names,
    the example database's keys and a derandomized suite's seed derive from it, so two
    engines never share a file or replay each other's saved examples, while two checkouts
    of one project (a CI runner's and a laptop's) share them."""
    target = _from_project(machine._target.name)
    options = options_of(machine)
    base, model = options.base, options.model_factory
    reference = machine._reference.name if machine._reference is not None else None
    parts = [
        target,
        f"role={machine._role or 'any'}",
        f"faults={','.join(sorted(machine._fault_kinds))}",
        f"twins={machine._use_twins}",
        f"reference={reference}",
        f"machine={_identity_name(base)}",
        f"model={_identity_name(model)}",
    ]
    if machine._concurrency > 1:  # only then, so a sequential run keeps the names it always had
        parts.append(f"concurrency={machine._concurrency}")
    if not options.extreme_values:
        parts.append("extreme_values=False")
    return "\n".join(parts)


def _identity_name(value: object) -> str:
    """``module:QualName`` of a machine or model class in a run's identity. The kit's own two are
    named where they are defined, as they were before their ``__module__`` became ``shardkit``,
    so that trace names, database keys and derandomized seeds stay what they were."""
    if value is ShardMachine:
        return "shardkit._machine.state_machine:ShardMachine"
    if value is ReferenceModel:
        return "shardkit._core.model:ReferenceModel"
    # A class from a file target is named by its file (``importable_name``), taken from the
    # run's folder as the engine's file is: the same in every process and checkout.
    named = importable_name(value)
    if named is not None:
        return _from_project(named)
    return f"{getattr(value, '__module__', '?')}:{getattr(value, '__qualname__', value)}"


def _from_project(name: str) -> str:
    """A ``file.py:attr`` name with its file's path from the run's folder (``_project_path``);
    a ``module:attr`` name as it is."""
    file, colon, attr = name.rpartition(":")
    return f"{_project_path(Path(file))}:{attr}" if colon and file.endswith(".py") else name


def _digest(text: str, length: int = 8) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:length]


class Artefacts:
    """Writes the trace and the regression test of the best failure seen so far.

    File names carry the engine, the role asked for, the seed and a digest of the
    machine's identity, so two engines or two configurations never share a name; a
    file that already holds a *different* failure is never overwritten (a suffix is
    added). A write that fails is remembered, not raised: the failure is still reported.

    Several processes may write into one folder at once (pytest-xdist workers, HypoFuzz
    processes, the same seed run twice): a trace's name is claimed atomically
    (``write_new``), and the in-progress file carries the process id, so no two processes
    ever write one file.
    """

    def __init__(self, machine: type[ShardMachine], out: Path | None, seed: int | None) -> None:
        self.machine = machine
        self.out = out
        self.seed = seed
        self.shortest: int | None = None  # steps of the in-progress trace on disk
        self.write_error: str | None = None
        self._label = self._make_label()
        #: The failure ``keep_shortest`` keeps: its steps and property, its trace, and whether
        #: this process created that file (one another process created is not ours to replace).
        self._kept: tuple[int, str, Path, bool] | None = None

    def _make_label(self) -> str:
        engine = _slug(self.machine._target.target.label) or "engine"
        run = f"seed-{self.seed}" if self.seed is not None else _slug(self.machine.__name__)
        return f"{engine}-{self.machine._role or 'any'}-{run}-{_digest(machine_identity(self.machine))}"

    @property
    def label(self) -> str:
        return self._label

    def in_progress(self) -> Path:
        assert self.out is not None
        # The process id keeps it private: two processes running the same machine and seed
        # (two xdist workers, two terminals) would otherwise replace each other's file.
        return self.out / f"{self.label}-pid{os.getpid()}-in-progress.json"

    def offer(self, failure: FailureReport) -> None:
        """Keep the shortest failure seen so far on disk while the run goes on."""
        if self.out is None or (self.shortest is not None and self.shortest <= len(failure.records)):
            return
        try:
            write_atomically(self.in_progress(), self._document(failure))
        except OSError as error:
            self.write_error = f"could not write {self.in_progress()}: {error.strerror or error}"
            return
        self.shortest = len(failure.records)

    def final(self, failure: FailureReport) -> tuple[Path, Path] | None:
        """Write the reported failure's trace and regression test; drop the in-progress file
        once they are safely on disk. None when there is no folder or the write failed."""
        if self.out is None:
            return None
        document = self._document(failure)
        stem = f"{self.label}-{failure.load_request.role}-{_slug(failure.violation.property)}"
        try:
            trace_path, _ = self._claim(stem, document)
            test_path = self._write_regression_test(trace_path, failure, document)
        except OSError as error:
            where = error.filename or self.out
            unwritten = f"could not write the trace under {where}: {error.strerror or error}"
            self.write_error = unwritten + self._in_progress_kept(len(failure.records))
            return None
        self.in_progress().unlink(missing_ok=True)
        # An in-progress trace that could not be written while shrinking is made good by this one.
        self.write_error = None
        return trace_path, test_path

    def _in_progress_kept(self, steps: int) -> str:
        """What a final trace that could not be written leaves: the in-progress trace on disk,
        if any, named with how to replay it (a full disk lets the small in-progress file stay)."""
        path = self.in_progress()
        if self.shortest is None or not path.is_file():
            return "; no in-progress trace was kept either"
        shorter = "" if self.shortest == steps else f", the shortest kept before the end (the one reported has {steps})"
        replay = shlex.join(["shardkit", "replay", str(path)])
        return f"; the in-progress trace {path} holds the failure in {self.shortest} step{'' if self.shortest == 1 else 's'}{shorter}: {replay}"

    def keep_shortest(self, failure: FailureReport) -> Path | None:
        """Keep the shortest failure seen so far as a finished trace and regression test, for a
        machine Hypothesis drives directly (HypoFuzz): no run ends, at which ``final`` would
        write it. Like a run of the kit, it keeps one failure: HypoFuzz shrinks a bug through
        failures of other properties on the way, and each would otherwise leave a file. A
        shorter failure replaces the files this process wrote before; another process's
        files are never replaced."""
        if self.out is None:
            return None
        if self._kept is not None and self._kept[0] <= len(failure.records):
            return self._kept[2]
        document = self._document(failure)
        stem = f"{self.label}-{failure.load_request.role}-{_slug(failure.violation.property)}"
        earlier = self._kept
        try:
            if earlier is not None and earlier[1] == failure.violation.property and earlier[3]:
                trace_path, ours = write_atomically(earlier[2], document), True
            else:
                trace_path, ours = self._claim(stem, document)
            self._write_regression_test(trace_path, failure, document)
        except OSError as error:
            where = error.filename or self.out
            self.write_error = f"could not write the trace under {where}: {error.strerror or error}"
            return None
        if earlier is not None and earlier[3] and earlier[2] != trace_path:
            earlier[2].unlink(missing_ok=True)
            _regression_test_path(earlier[2]).unlink(missing_ok=True)
        self._kept = (len(failure.records), failure.violation.property, trace_path, ours)
        return trace_path

    def _write_regression_test(self, trace_path: Path, failure: FailureReport, document: dict[str, Any]) -> Path:
        test_path = _regression_test_path(trace_path)
        code = {key: value for key in CODE_KEYS if isinstance(value := document.get(key), str)}
        write_atomically(test_path, regression_test_source(trace_path.name, failure.violation, self.seed, code))
        return test_path

    def _claim(self, stem: str, document: dict[str, Any]) -> tuple[Path, bool]:
        """Write ``document`` as ``stem.json``, unless that file holds another failure: then
        ``stem-2.json``, … Each name is claimed atomically (``write_new``), so two processes
        never both take one. The path, and whether this process created it (rather than
        found the same failure there and rewrote it in place)."""
        assert self.out is not None
        for attempt in range(1, 10_000):
            path = self.out / (f"{stem}.json" if attempt == 1 else f"{stem}-{attempt}.json")
            if write_new(path, document):
                return path, True
            if _same_failure(path, document):
                return write_atomically(path, document), False
        message = f"{self.out} already holds 10 000 traces named {stem}-N.json; clear it out"
        raise OSError(message)

    def _document(self, failure: FailureReport) -> dict[str, Any]:
        return trace_document(
            target=self.machine._target.target,
            load_request=failure.load_request,
            faults=failure.faults,
            records=failure.records,
            violation=failure.violation,
            seed=self.seed,
            twins=self.machine._use_twins,
            reference=self.machine._reference.target if self.machine._reference is not None else None,
            isolation=isolation.options if (isolation := self.machine._target.isolation) is not None else None,
            machine=self.machine,
        )


def _project_path(file: Path) -> str:
    """``file`` relative to the folder the run starts in, as a POSIX path; its absolute path
    when it lies outside that folder."""
    resolved = file.resolve()
    try:
        return resolved.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return str(resolved)


def _regression_test_path(trace_path: Path) -> Path:
    return trace_path.with_name(f"test_{trace_path.stem.replace('-', '_')}.py")


def _same_failure(path: Path, document: dict[str, Any]) -> bool:
    """Whether the trace at ``path`` records the same steps and failure as ``document``."""
    try:
        existing = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    ours = json.loads(json.dumps(document, ensure_ascii=False))
    keys = ("target", "load_request", "steps", "failure")
    return isinstance(existing, dict) and all(existing.get(key) == ours.get(key) for key in keys)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


class _EngineKeyedDatabase(ExampleDatabase):
    """The user's example database, with every key prefixed by the machine's identity,
    so an example saved while fuzzing one engine is never replayed against another."""

    def __init__(self, inner: ExampleDatabase, identity: str) -> None:
        super().__init__()
        self.inner = inner
        self.prefix = hashlib.sha256(identity.encode("utf-8", "surrogatepass")).digest()[:16]

    def __repr__(self) -> str:
        return f"EngineKeyed({self.inner!r})"

    def save(self, key: bytes, value: bytes) -> None:
        self.inner.save(self.prefix + key, value)

    def fetch(self, key: bytes) -> Iterable[bytes]:
        return self.inner.fetch(self.prefix + key)

    def delete(self, key: bytes, value: bytes) -> None:
        self.inner.delete(self.prefix + key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self.inner.move(self.prefix + src, self.prefix + dest, value)


def run_settings_for(machine: type[ShardMachine], base: settings) -> settings:
    """``base`` made independent of the clock, its database keyed to this machine."""
    run_settings = time_independent(base)
    if run_settings.database is not None and not isinstance(run_settings.database, _EngineKeyedDatabase):
        run_settings = settings(
            run_settings, database=_EngineKeyedDatabase(run_settings.database, machine_identity(machine))
        )
    return run_settings
