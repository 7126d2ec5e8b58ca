"""Building a machine for an engine: ``build_machine`` and what it checks.

It turns a typed target and the machine's options (``MachineOptions``, checked when they
were made) into a subclass of ``ShardMachine``, and defers what needs the engine to first
use (``_Setup``): resolving the target, reading its capabilities, finding the
roles it loads and the faults it takes. The state machine itself is
``shardkit._machine.state_machine``, which this module imports and which never imports it.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from shardkit._core.fault_steps import usable_faults
from shardkit._core.targets import PythonTarget, ResolvedTarget, Target
from shardkit._machine.parallel_rules import parallel_rules
from shardkit._machine.spec import MachineOptions
from shardkit._machine.state_machine import ShardMachine, extreme_values, inject_fault, layer_range
from shardkit._machine.suite_case import FailureSink, SuiteRunner
from shardkit._transport.isolation import EnginePlan, engine_plan
from shardkit._transport.resolve import resolve_target
from shardkit.contract import ROLES, EngineCapabilities, EngineError, LoadRequest, Role
from shardkit.errors import ShardkitError

__all__ = ["build_machine", "loadable_roles", "roles_for"]


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


def build_machine(
    target: Target | ResolvedTarget,
    options: MachineOptions | None = None,
    *,
    name: str | None = None,
    suite_runner: SuiteRunner | None = None,
    fuzzer_failures: FailureSink | None = None,
) -> type[ShardMachine]:
    """A ``RuleBasedStateMachine`` fuzzing the engine against the reference model.

    ``target`` comes typed from the entry point that read it (``engine_target``) and
    ``options`` checked (``MachineOptions``); here the two meet, so how they combine is
    checked here (``engine_plan``: isolation, deadlines, worker memory), and what needs the
    engine on first use (``_Setup``). ``suite_runner`` is what the machine's
    pytest ``TestCase`` runs and ``fuzzer_failures`` what its failures become when a fuzzer
    such as HypoFuzz drives it directly (``machine_for`` sets both; see ``ShardMachine``).
    """
    options = options if options is not None else MachineOptions()
    base = options.base
    plan = engine_plan(
        target, isolate=options.isolate, step_timeout=options.step_timeout, worker_memory_mb=options.worker_memory_mb
    )
    setup = _Setup(plan, options)
    sends_bundles = options.role in (None, "middle", "tail")
    namespace: dict[str, Any] = {
        "_options": options,
        "_setup": setup,
        "_role": options.role,
        "_use_twins": options.twins,
        "model_factory": staticmethod(options.model_factory),
        **{name: _Prepared(name) for name in _Setup.PREPARED},
        **({"_suite_runner": staticmethod(suite_runner)} if suite_runner is not None else {}),
        **({"_fuzzer_failures": staticmethod(fuzzer_failures)} if fuzzer_failures is not None else {}),
        **({"inject_fault": inject_fault} if options.wanted_faults else {}),
        # Only where bundles are sent: a head's or full shard's draws stay as they were.
        **({"extreme_values": extreme_values} if options.extreme_values and sends_bundles else {}),
        **(parallel_rules(options.concurrency, base) if options.concurrency > 1 else {}),
        "_concurrency": options.concurrency,
    }
    engine_name = re.sub(r"\W+", "_", _class_label(target)).strip("_")
    class_name = name or f"ShardMachine_{engine_name}_{options.role or 'any'}"
    return type(class_name, (base,), namespace)


def _class_label(target: Target | ResolvedTarget) -> str:
    """The engine's part of the machine class's name: a factory's ``__qualname__``, else the target's label."""
    typed = target.target if isinstance(target, ResolvedTarget) else target
    if isinstance(typed, PythonTarget) and not isinstance(typed.code, str):
        return str(getattr(typed.code, "__qualname__", type(typed.code).__qualname__))
    return typed.label


class _Setup:
    """What a machine knows only once it has met its engine: the resolved target (an isolated
    one starts its workers), the engine's capabilities, the roles it loads and the faults it
    takes. Made on first use, so building a machine (importing a test module) builds no
    engine and starts no process; an option the engine cannot honour is reported then."""

    PREPARED = ("_target", "_reference", "_total_layers", "_roles", "_fault_kinds", "_skipped_faults")

    def __init__(self, plan: EnginePlan, options: MachineOptions) -> None:
        self.plan, self.options = plan, options
        self._lock = threading.Lock()
        self._values: Mapping[str, Any] | None = None

    def values(self) -> Mapping[str, Any]:
        with self._lock:
            if self._values is None:
                self._values = self._prepare()
            return self._values

    def _prepare(self) -> Mapping[str, Any]:
        options = self.options
        target = self.plan.start()
        try:
            caps, loadable, fault_kinds, skipped = _checked_options(target, options)
            if options.concurrency > 1 and not caps.concurrent_calls:
                message = (
                    f"{target.name} does not declare concurrent_calls in its capabilities, so the kit will not "
                    f"call it from {options.concurrency} threads at once; declare EngineCapabilities(concurrent_calls=True) "
                    "once its calls are safe from several threads (docs/contract.md#linearizability), or drop concurrency"
                )
                raise ShardkitError(message)
            reference = resolve_target(options.reference) if options.reference is not None else None
        except BaseException:
            if target.isolation is not None and target is not self.plan.target:
                target.isolation.close()  # this call started its workers: do not leave them running
            raise
        return MappingProxyType(
            {
                "_target": target,
                "_reference": reference,
                "_total_layers": caps.total_layers,
                "_roles": loadable,
                "_fault_kinds": fault_kinds,
                "_skipped_faults": skipped,
            }
        )


class _Prepared:
    """A machine attribute ``_Setup`` provides on first use."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, instance: object, owner: type[ShardMachine]) -> Any:
        return owner._setup.values()[self.name]


def _checked_options(
    target: ResolvedTarget, options: MachineOptions
) -> tuple[EngineCapabilities, tuple[Role, ...], frozenset[str], Mapping[str, str]]:
    """The engine's capabilities, the roles it loads, the fault kinds to inject and those of
    every kind (``--faults all``) left out, each with why; ``ShardkitError`` for options this
    engine cannot honour."""
    probe = target()
    caps = target.guarded("capabilities()", probe.capabilities)
    loadable = loadable_roles(target, caps.total_layers)
    role = options.role
    if role is not None and role not in loadable:
        message = f"{target.name} cannot serve a {role} shard (it serves: {', '.join(loadable) or 'nothing'})"
        raise ShardkitError(message)
    if not loadable:
        message = f"{target.name} refused to load even its whole range of {caps.total_layers} layers"
        raise ShardkitError(message)
    wanted = options.wanted_faults
    everything = options.all_faults
    native, boundary = usable_faults(caps, probe, wanted)
    unusable = wanted - native - boundary
    if unusable and not everything:
        message = (
            f"{target.name} cannot take the fault(s) {sorted(unusable)}: not in its supported_faults "
            f"{sorted(caps.supported_faults)} and not injectable at its boundary"
        )
        raise ShardkitError(message)
    skipped = {kind: "not in the engine's supported_faults and not injectable at its boundary" for kind in unusable}
    if everything and not options.twins:
        skipped["malformed_output"] = "an injected wrong output is detected by the twin oracle, off (--no-twins)"
    return caps, loadable, native | boundary, MappingProxyType(skipped)
