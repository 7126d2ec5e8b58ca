"""Building a machine for an engine: ``build_machine`` and what it checks.

It turns a target and the run's options (role, faults, twins, reference, isolation) into a
subclass of ``ShardMachine``, checks the options that need no engine at once, and defers the
rest to first use (``_Setup``): resolving the target, reading its capabilities, finding the
roles it loads and the faults it takes. The state machine itself is
``shardkit._machine.state_machine``, which this module imports and which never imports it.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

from shardkit._core.fault_steps import usable_faults
from shardkit._core.model import ReferenceModel
from shardkit._core.targets import IsolationOptions, PythonTarget, ResolvedTarget, Target
from shardkit._machine.parallel_rules import MAX_CONCURRENCY, parallel_rules
from shardkit._machine.state_machine import ShardMachine, extreme_values, inject_fault, layer_range
from shardkit._machine.suite_case import FailureSink, SuiteRunner
from shardkit._transport.isolation import target_with_options
from shardkit._transport.resolve import resolve_target
from shardkit.contract import FAULT_KINDS, ROLES, EngineCapabilities, EngineError, LoadRequest, Role
from shardkit.errors import ShardkitError, UsageError

__all__ = ["build_machine", "loadable_roles", "parse_faults", "roles_for"]


def roles_for(total_layers: int) -> tuple[Role, ...]:
    minimum = {"full": 1, "head": 2, "tail": 2, "middle": 3}
    return tuple(role for role in ROLES if total_layers >= minimum[role])


def loadable_roles(target: ResolvedTarget, total_layers: int) -> tuple[Role, ...]:
    """The roles whose widest layer range a fresh engine from ``target`` agrees to load."""
    roles: list[Role] = []
    for role in roles_for(total_layers):
        start, end = layer_range(role, total_layers, 0)
        request = LoadRequest("shardkit-fuzz", start, end, total_layers)
        engine = target()
        try:
            # An exception other than EngineError (or the worker dying) names the call: exit 2, one line.
            loaded = target.guarded(
                f"load(layers {start}..{end} of {total_layers})", functools.partial(engine.load, request)
            )
        except EngineError:
            continue
        if loaded.status.ok:
            roles.append(role)
    return tuple(roles)


def parse_faults(faults: bool | str | Iterable[str]) -> frozenset[str]:
    """``True``/"all", ``False``/"none", or kinds (a list or "delay,crash")."""
    if faults is True or faults == "all":
        return frozenset(FAULT_KINDS)
    if faults is False or faults == "none":
        return frozenset()
    kinds = [kind.strip() for kind in faults.split(",")] if isinstance(faults, str) else list(faults)
    unknown = [kind for kind in kinds if kind not in FAULT_KINDS]
    if unknown or not kinds:
        message = f"faults must be 'all', 'none' or a comma-separated list of {', '.join(FAULT_KINDS)}; got {faults!r}"
        raise ValueError(message)
    return frozenset(kinds)


def build_machine(
    target: Target | ResolvedTarget,
    *,
    role: Role | str | None = None,
    faults: bool | str | Iterable[str] = True,
    twins: bool = True,
    reference: Target | ResolvedTarget | None = None,
    model: Callable[[], ReferenceModel] | None = None,
    base: type[ShardMachine] = ShardMachine,
    name: str | None = None,
    isolate: bool | IsolationOptions = False,
    step_timeout: float | None = None,
    worker_memory_mb: int | None = None,
    suite_runner: SuiteRunner | None = None,
    concurrency: int = 1,
    fuzzer_failures: FailureSink | None = None,
) -> type[ShardMachine]:
    """A ``RuleBasedStateMachine`` fuzzing the engine against the reference model.

    ``role`` pins the shard role (None or "any" draws one per example); ``faults`` is
    True/"all", False/"none" or a list of kinds; ``twins`` turns the twin oracle on;
    ``reference`` builds the twins from another engine, which fuzzes the target
    differentially against it (same statuses, same outputs). ``base`` is the machine class
    to extend with the fault rules, and ``model`` builds the reference model (None: the
    ``model_factory`` of ``base``; see docs/extending.md). ``isolate`` runs every engine in
    a child process (see ``--isolate`` in docs/remote.md), whose calls get
    ``step_timeout`` seconds each and whose memory ``worker_memory_mb`` limits;
    ``step_timeout`` also applies to a remote target. ``concurrency`` of 2 or 3 adds a
    parallel phase of that many lanes (``shardkit._machine.parallel_rules``), which ends
    each example that draws it. ``suite_runner`` is what the machine's pytest ``TestCase``
    runs and ``fuzzer_failures`` what its failures become when a fuzzer such as HypoFuzz
    drives it directly (``machine_for`` sets both; see ``ShardMachine``).
    ``target`` and ``reference`` come typed from the entry point that read them
    (``shardkit._core.targets.engine_target`` and ``parse_target``).
    """
    if not (isinstance(concurrency, int) and 1 <= concurrency <= MAX_CONCURRENCY):
        message = f"concurrency must be a number of lanes from 1 to {MAX_CONCURRENCY}, got {concurrency!r}"
        raise UsageError(message)
    if role == "any":
        role = None
    if role is not None and role not in ROLES:
        message = f"role must be one of {', '.join(ROLES)} or 'any', got {role!r}"
        raise UsageError(message)
    if model is None:
        model = base.model_factory  # an extended machine may bring its own model
    wanted = _wanted_faults(faults, twins, reference)
    setup = _Setup(target, role, faults, twins, reference, isolate, step_timeout, worker_memory_mb, concurrency)
    namespace: dict[str, Any] = {
        "build_options": {
            "role": role,
            "faults": faults,
            "twins": twins,
            "reference": reference,
            "model": model,
            "base": base,
            "isolate": isolate,
            "step_timeout": step_timeout,
            "worker_memory_mb": worker_memory_mb,
            "concurrency": concurrency,
        },
        "setup": setup,
        "role": role,
        "use_twins": twins,
        "model_factory": staticmethod(model),
        **{name: _Prepared(name) for name in _Setup.PREPARED},
        **({"suite_runner": staticmethod(suite_runner)} if suite_runner is not None else {}),
        **({"fuzzer_failures": staticmethod(fuzzer_failures)} if fuzzer_failures is not None else {}),
        **({"inject_fault": inject_fault} if wanted else {}),
        # Only where bundles are sent: a head's or full shard's draws stay as they were.
        **({"extreme_values": extreme_values} if role in (None, "middle", "tail") else {}),
        **(parallel_rules(concurrency, base) if concurrency > 1 else {}),
        "concurrency": concurrency,
    }
    engine_name = re.sub(r"\W+", "_", _class_label(target)).strip("_")
    class_name = name or f"ShardMachine_{engine_name}_{role or 'any'}"
    return type(class_name, (base,), namespace)


def _class_label(target: Target | ResolvedTarget) -> str:
    """The engine's part of the machine class's name: a factory's ``__qualname__``, else the target's label."""
    typed = target.target if isinstance(target, ResolvedTarget) else target
    if isinstance(typed, PythonTarget) and not isinstance(typed.code, str):
        return str(getattr(typed.code, "__qualname__", type(typed.code).__qualname__))
    return typed.label


def _wanted_faults(faults: bool | str | Iterable[str], twins: bool, reference: object) -> frozenset[str]:
    """The fault kinds asked for that the options allow, checked without the engine."""
    try:
        wanted = parse_faults(faults)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if reference is not None and not twins:
        message = "a reference engine is compared through the twin oracle; drop --no-twins or the reference"
        raise UsageError(message)
    if not twins and "malformed_output" in wanted:
        # Without twins a wrong output of a first-seen history is undetectable, and an
        # undetected injection counts as a failure of the kit.
        if not (faults is True or faults == "all"):
            message = "the malformed_output fault needs the twin oracle to detect it; drop --no-twins or the fault"
            raise UsageError(message)
        wanted -= {"malformed_output"}
    return wanted


class _Setup:
    """What a machine knows only once it has met its engine: the resolved target (an isolated
    one starts its workers), the engine's capabilities, the roles it loads and the faults it
    takes. Made on first use, so building a machine (importing a test module) builds no
    engine and starts no process; an option the engine cannot honour is reported then."""

    PREPARED = ("target", "reference", "total_layers", "roles", "fault_kinds", "skipped_faults")

    def __init__(
        self,
        target: Target | ResolvedTarget,
        role: Role | None,
        faults: bool | str | Iterable[str],
        twins: bool,
        reference: Target | ResolvedTarget | None,
        isolate: bool | IsolationOptions,
        step_timeout: float | None,
        worker_memory_mb: int | None,
        concurrency: int,
    ) -> None:
        self.target, self.role, self.faults, self.twins = target, role, faults, twins
        self.reference, self.isolate = reference, isolate
        self.step_timeout, self.worker_memory_mb = step_timeout, worker_memory_mb
        self.concurrency = concurrency
        self._lock = threading.Lock()
        self._values: Mapping[str, Any] | None = None

    def values(self) -> Mapping[str, Any]:
        with self._lock:
            if self._values is None:
                self._values = self._prepare()
            return self._values

    def _prepare(self) -> Mapping[str, Any]:
        target = target_with_options(
            self.target,
            isolate=self.isolate,
            step_timeout=self.step_timeout,
            worker_memory_mb=self.worker_memory_mb,
        )
        try:
            caps, loadable, fault_kinds, skipped = _checked_options(
                target, self.role, self.faults, self.twins, self.reference
            )
            if self.concurrency > 1 and not caps.concurrent_calls:
                message = (
                    f"{target.name} does not declare concurrent_calls in its capabilities, so the kit will not "
                    f"call it from {self.concurrency} threads at once; declare EngineCapabilities(concurrent_calls=True) "
                    "once its calls are safe from several threads (docs/contract.md#linearizability), or drop concurrency"
                )
                raise ShardkitError(message)
            reference = resolve_target(self.reference) if self.reference is not None else None
        except BaseException:
            if target.isolation is not None and target is not self.target:
                target.isolation.close()  # this call started its workers: do not leave them running
            raise
        return MappingProxyType(
            {
                "target": target,
                "reference": reference,
                "total_layers": caps.total_layers,
                "roles": loadable,
                "fault_kinds": fault_kinds,
                "skipped_faults": skipped,
            }
        )


class _Prepared:
    """A machine attribute ``_Setup`` provides on first use."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, instance: object, owner: type[ShardMachine]) -> Any:
        return owner.setup.values()[self.name]


def _checked_options(
    target: ResolvedTarget,
    role: str | None,
    faults: bool | str | Iterable[str],
    twins: bool,
    reference: object,
) -> tuple[EngineCapabilities, tuple[Role, ...], frozenset[str], Mapping[str, str]]:
    """The engine's capabilities, the roles it loads, the fault kinds to inject and those of
    every kind (``--faults all``) left out, each with why; ``ShardkitError`` for options this
    engine cannot honour."""
    probe = target()
    caps = target.guarded("capabilities()", probe.capabilities)
    loadable = loadable_roles(target, caps.total_layers)
    if role is not None and role not in loadable:
        message = f"{target.name} cannot serve a {role} shard (it serves: {', '.join(loadable) or 'nothing'})"
        raise ShardkitError(message)
    if not loadable:
        message = f"{target.name} refused to load even its whole range of {caps.total_layers} layers"
        raise ShardkitError(message)
    wanted = _wanted_faults(faults, twins, reference)
    everything = faults is True or faults == "all"
    native, boundary = usable_faults(caps, probe, wanted)
    unusable = wanted - native - boundary
    if unusable and not everything:
        message = (
            f"{target.name} cannot take the fault(s) {sorted(unusable)}: not in its supported_faults "
            f"{sorted(caps.supported_faults)} and not injectable at its boundary"
        )
        raise ShardkitError(message)
    skipped = {kind: "not in the engine's supported_faults and not injectable at its boundary" for kind in unusable}
    if everything and not twins:
        skipped["malformed_output"] = "an injected wrong output is detected by the twin oracle, off (--no-twins)"
    return caps, loadable, native | boundary, MappingProxyType(skipped)
