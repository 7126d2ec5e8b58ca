"""Replaying a trace file without Hypothesis.

A trace is data; running code is the user's decision. Three modules share the work,
each importing only the ones below it: ``shardkit._run.trace_reader`` reads the file
as untrusted data and validates it against the schema, importing nothing;
``shardkit._run.trust`` decides which of the code it names may be built (its
docstring states the rule); this module builds what was admitted, or what the
caller names, and runs the steps.

* **Say what will be built, then build it.** Replay prints what it is about to build
  (``replaying against TARGET (recorded in the trace)``, and the reference, the
  machine and the model when there are any) before importing or calling any of it.
* **``--engine`` replaces the target and the reference.** Replaying against an engine
  the user names builds the twins from that engine: the recorded reference is not
  built unless ``reference=`` is passed too. A recorded machine is still needed for
  its custom operations and follows the trust rule.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from shardkit._core.driver import CustomOp, Driver, StepRecord, Violation
from shardkit._core.model import ReferenceModel
from shardkit._core.targets import (
    EngineFactory,
    IsolationOptions,
    ResolvedTarget,
    display_name,
    is_remote_address,
    worker_command_of,
)
from shardkit._parallel.runs import replay_runs
from shardkit._run.trace_reader import Trace, check_custom_steps, read_trace
from shardkit._run.trust import Admitted, admit, build_recorded_machine, resolve_admitted
from shardkit._transport.isolation import target_with_options
from shardkit._transport.resolve import resolve_target
from shardkit.errors import InvalidTarget, TraceFormatError, UntrustedTarget

__all__ = [
    "DEFAULT_REPLAY_RUNS",
    "RECORDED",
    "PreparedReplay",
    "ReplayResult",
    "load_trace",
    "prepare_replay",
    "replay",
]


class _Recorded(enum.Enum):
    RECORDED = "recorded"


#: ``replay(reference=RECORDED)``: the reference the trace records, unless ``target`` is given.
RECORDED = _Recorded.RECORDED


#: Runs of a trace that holds a parallel phase: its race may show on some runs only.
DEFAULT_REPLAY_RUNS = 20


@dataclass(frozen=True)
class ReplayResult:
    """What a replay found: the steps of one run and the violation they ended in (the first
    run that violated the recorded property, else the first that violated another, else
    the first run), with how many runs there were and how many reproduced."""

    trace: Trace
    records: tuple[StepRecord, ...]
    failure: Violation | None
    #: Times the steps ran: once, or ``runs`` times for a trace that holds a parallel phase.
    runs: int = 1
    #: The runs that violated the recorded property.
    reproductions: int = 0

    @property
    def reproduced(self) -> bool:
        """The replay ended in a violation of the same property the trace recorded."""
        return self.failure is not None and self.failure.property == self.trace.failure.property


def load_trace(path: str | Path, custom_ops: Mapping[str, CustomOp] | None = None, *, trust: bool = False) -> Trace:
    """Read and validate a trace; ``TraceFormatError`` names the first problem.

    A trace that records an extended ``machine`` has its custom steps checked against that
    machine's ``custom_ops``, which imports it: it follows the trust rule of ``shardkit._run.trust``
    (``UntrustedTarget`` unless it is inside the current project or ``trust`` is true).
    Pass ``custom_ops`` to check them against yours instead. ``read_trace`` imports nothing.
    """
    trace = read_trace(path, custom_ops)
    if custom_ops is None and trace.machine is not None:
        admitted = admit(trace, "machine", trace.machine, trust)
        check_custom_steps(trace, build_recorded_machine(trace, admitted).custom_ops)
    return trace


@dataclass
class PreparedReplay:
    """A trace whose engine is built and loaded, ready to run its steps; close it when done.

    Everything that can fail before the first step — a damaged trace, a target that is not
    trusted, cannot be imported, or refuses the recorded load request — has failed by now,
    so a failure of ``run`` is the engine's."""

    trace: Trace
    driver: Driver
    engine: ResolvedTarget
    #: What was built, one line (``replaying against TARGET (recorded in the trace)``).
    description: str
    owns_engine: bool = True

    def run(self, runs: int = DEFAULT_REPLAY_RUNS) -> ReplayResult:
        """Run the steps once, or ``runs`` times (each on a fresh engine) if they hold a
        parallel phase, counting the runs that reproduced the recorded property."""
        recorded = self.trace.failure.property
        shown: tuple[int, tuple[StepRecord, ...], Violation | None] = (-1, (), None)
        ran = reproductions = 0
        for driver, failed in replay_runs(self.driver, self.trace.actions, runs):
            ran += 1
            violation = failed.violation if failed is not None else None
            # Shown: the first run that reproduced, else the first with another failure.
            rank = 0 if violation is None else 2 if violation.property == recorded else 1
            reproductions += rank == 2
            if rank > shown[0]:
                shown = (rank, tuple(driver.records), violation)
        return ReplayResult(self.trace, shown[1], shown[2], ran, reproductions)

    def close(self) -> None:
        if self.engine.isolation is not None and self.owns_engine:
            self.engine.isolation.close()

    def __enter__(self) -> PreparedReplay:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def replay(
    trace_path: str | Path,
    target: str | EngineFactory | None = None,
    *,
    reference: str | EngineFactory | _Recorded | None = RECORDED,
    model: Callable[[], ReferenceModel] | None = None,
    custom_ops: Mapping[str, CustomOp] | None = None,
    isolate: bool | IsolationOptions | None = None,
    trust: bool = False,
    announce: Callable[[str], object] | None = None,
    runs: int = DEFAULT_REPLAY_RUNS,
) -> ReplayResult:
    """Re-run a trace's steps without Hypothesis, against its recorded target or ``target``.

    Code the trace names is built only under the trust rule of ``shardkit._run.trust``:
    bundled with shardkit, inside the current project, named by you (``target``), or ``trust=True``.
    ``target`` replaces the recorded reference too (the twins come from ``target``) unless
    ``reference`` is given. A trace of an extended machine rebuilds that machine's custom
    operations and model unless ``custom_ops`` and ``model`` are given. ``announce`` is
    called with one line saying what will be built, before anything is.

    The engine runs as it ran when the failure was found: in a worker process if the
    trace records ``isolate``. ``isolate`` overrides that: False runs it in-process,
    True or ``IsolationOptions`` in a worker; the worker ends with the replay.

    Raises ``TraceFormatError`` for a file that is not a valid trace, ``UntrustedTarget``
    for recorded code the rule does not let it build, and ``InvalidTarget`` for a target
    that cannot be built or refuses the recorded load request.

    A trace that holds a parallel phase runs ``runs`` times, each on a fresh engine (its
    race may show on some runs only); the result counts the runs that reproduced.
    """
    if runs < 1:
        message = f"runs must be 1 or more, got {runs}"
        raise ValueError(message)
    with prepare_replay(
        trace_path,
        target,
        reference=reference,
        model=model,
        custom_ops=custom_ops,
        isolate=isolate,
        trust=trust,
        announce=announce,
    ) as prepared:
        return prepared.run(runs)


def prepare_replay(
    trace_path: str | Path,
    target: str | EngineFactory | None = None,
    *,
    reference: str | EngineFactory | _Recorded | None = RECORDED,
    model: Callable[[], ReferenceModel] | None = None,
    custom_ops: Mapping[str, CustomOp] | None = None,
    isolate: bool | IsolationOptions | None = None,
    trust: bool = False,
    announce: Callable[[str], object] | None = None,
) -> PreparedReplay:
    """``replay`` up to its first step: the trace read, the engine built and loaded.

    A generated regression test builds it in a fixture, so that an engine that cannot
    be built is a setup error, never the bug reproducing."""
    trace = read_trace(trace_path, custom_ops)
    if trace.needs_python is not None and custom_ops is None and model is None:
        message = f"{trace.path} cannot be replayed by name: {trace.needs_python}"
        raise TraceFormatError(message)
    # Decide everything that will be built, and say so, before building any of it.
    engine_admitted = admit(trace, "target", trace.target, trust) if target is None else None
    reference_admitted = None
    if reference is RECORDED:
        reference = None
        if target is None and trace.reference is not None:
            reference_admitted = admit(trace, "reference", trace.reference, trust)
    want_machine = custom_ops is None or (model is None and trace.model is None)
    machine_admitted = admit(trace, "machine", trace.machine, trust) if want_machine and trace.machine else None
    model_admitted = admit(trace, "model", trace.model, trust) if model is None and trace.model else None
    # An engine server is another process already: nothing runs in a worker of the kit's.
    remote = _remote(target if target is not None else trace.target)
    isolation = None if remote else trace.isolation if isolate is None else isolate
    description = _describe(
        trace, target, engine_admitted, reference, reference_admitted, machine_admitted, model_admitted, isolation
    )
    if announce is not None:
        announce(description)

    if machine_admitted is not None:
        machine = build_recorded_machine(trace, machine_admitted)
        if custom_ops is None:
            custom_ops = machine.custom_ops
            check_custom_steps(trace, machine.custom_ops)
        if model is None and model_admitted is None:
            model = machine.model_factory
    if model_admitted is not None:
        built_model = resolve_admitted(trace, model_admitted)
        if not callable(built_model):
            message = f"{trace.path}: the recorded model {trace.model!r} is not callable"
            raise TraceFormatError(message)
        model = built_model
    chosen: str | EngineFactory
    if engine_admitted is not None:
        resolve_admitted(trace, engine_admitted)  # imports it from the checked files; refuses a name reaching out
        chosen = engine_admitted.name
    else:
        assert target is not None
        chosen = target
    reference_target: ResolvedTarget | None = None
    if reference_admitted is not None:
        resolve_admitted(trace, reference_admitted)
        reference_target = resolve_target(reference_admitted.name)
    elif reference is not None:
        reference_target = resolve_target(reference)
    if reference_target is not None:
        _probe_reference(trace, reference_target)
    engine = _engine(trace, chosen, isolate)
    owns_engine = engine is not target
    try:
        driver = Driver(
            engine,
            trace.load_request,
            faults=trace.faults,
            twins=trace.twins,
            reference=reference_target,
            model_factory=model or ReferenceModel,
            custom_ops=custom_ops,
        )
    except BaseException as error:
        if engine.isolation is not None and owns_engine:
            engine.isolation.close()
        if isinstance(error, (InvalidTarget, UntrustedTarget)) or not isinstance(error, Exception):
            raise
        message = (
            f"the engine {engine.name} could not be built and loaded for the replay of {trace.path}: "
            f"{type(error).__name__}: {error}"
        )
        raise InvalidTarget(message) from error
    return PreparedReplay(trace, driver, engine, description, owns_engine)


def _engine(trace: Trace, chosen: str | EngineFactory, isolate: bool | IsolationOptions | None) -> ResolvedTarget:
    if isolate is False and worker_command_of(getattr(chosen, "name", chosen)) is not None:
        message = f"{display_name(str(getattr(chosen, 'name', chosen)))} always runs in worker processes; drop --no-isolate (isolate=False)"
        raise InvalidTarget(message)
    if isinstance(chosen, ResolvedTarget) and _remote(chosen):
        return chosen  # connected by the caller, with the deadline the caller chose
    isolation = trace.isolation if isolate is None else isolate
    if isolation is True:
        isolation = trace.isolation or IsolationOptions()
    if isolate is None and isinstance(isolation, IsolationOptions) and _remote(chosen):
        # Already in another process: keep the recorded deadline, there is nothing to isolate.
        return target_with_options(chosen, step_timeout=isolation.step_timeout)
    return target_with_options(chosen, isolate=isolation or False)


def _probe_reference(trace: Trace, reference: ResolvedTarget) -> None:
    """Build and load the reference once, so that a broken one is named as such, not as the engine's failure."""
    try:
        probe = reference()
        loaded = probe.load(trace.load_request)
    except Exception as error:
        message = f"the reference {reference.name} could not be built and loaded for the replay: {type(error).__name__}: {error}"
        raise InvalidTarget(message) from error
    if not loaded.status.ok:
        message = (
            f"the reference {reference.name} refused {trace.load_request}: "
            f"{loaded.status.code.name} {loaded.status.message}"
        )
        raise InvalidTarget(message)


def _describe(
    trace: Trace,
    target: str | EngineFactory | None,
    engine: Admitted | None,
    reference: str | EngineFactory | None,
    reference_admitted: Admitted | None,
    machine: Admitted | None,
    model: Admitted | None,
    isolation: bool | IsolationOptions | None,
) -> str:
    if engine is not None:
        text = f"replaying against {engine.describe()}"
    else:
        name = target if isinstance(target, str) else resolve_target(target).name if target is not None else "?"
        text = f"replaying against {display_name(name)} (named by you)"
    if reference_admitted is not None:
        text += f", twins from the reference {reference_admitted.describe()}"
    elif reference is not None:
        text += f", twins from the reference {resolve_target(reference).name} (named by you)"
    elif trace.reference is not None:
        text += f", twins from the engine itself (the recorded reference {trace.reference} is not built)"
    if machine is not None:
        text += f", machine {machine.describe()}"
    if model is not None:
        text += f", model {model.describe()}"
    if isolation:
        text += ", in a worker process"
    return text


def _remote(target: object) -> bool:
    name = target if isinstance(target, str) else getattr(target, "name", "")
    return isinstance(name, str) and is_remote_address(name)
