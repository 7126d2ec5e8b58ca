"""shardkit: property-based state-machine testing for LLM shard engines.

Import public names from ``shardkit`` itself (``__all__`` lists them); module paths may
move. The public modules are:

- ``shardkit.contract`` — the contract v1 vocabulary (contract §1) and the ``ShardEngine`` ABC;
- ``shardkit.errors`` — ``ShardkitError`` and its subclasses;
- ``shardkit.engines`` — the bundled engines (``FakeShardEngine``, ``NumpyShardEngine``,
  ``pipeline.PipelineEngine``, ``llama_cpp.LlamaCppShardEngine`` with the ``llama`` extra),
  and the two base classes for writing engines: ``base.SessionEngine`` (write the maths,
  inherit the session lifecycle and the faults) and ``delegating.DelegatingEngine`` (wrap
  an engine, override only what changes);
- ``shardkit.remote`` — engines in another process or language, over gRPC (``grpc`` extra);
- ``shardkit.pytest_plugin`` — ``--shardkit-engine`` / ``--shardkit-seed`` for stateful suites.

Extending the kit (docs/extending.md): ``SessionEngine`` and ``DelegatingEngine`` to
write engines, and ``RecordingEngine`` (keeping each session's ``AcceptedSteps``) for a
wrapper that implements an operation by sending steps of its own; ``ReferenceModel`` (with
``Prediction`` and ``SessionState``), ``CustomOp``, ``ShardMachine`` and ``step_rule`` to
add a backend's own operation; ``machine_for`` and ``fuzz`` (returning a ``FuzzResult``) to
run the state machine.

Everything under a module whose name starts with ``_`` is private. Public names are
imported on first use, so that a process needing a few of them (a worker process of
``--isolate``, an engine importing the contract) does not pay for all of them; each reports
``shardkit`` as its ``__module__``, the path to import it from.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shardkit._public import PUBLIC_HOMES as _PUBLIC_HOMES
from shardkit._version import __version__ as __version__

if TYPE_CHECKING:
    from shardkit._core.conformance import assert_shard_engine_contract as assert_shard_engine_contract
    from shardkit._core.driver import CustomOp as CustomOp
    from shardkit._core.lane_context import yield_point as yield_point
    from shardkit._core.model import Prediction as Prediction
    from shardkit._core.model import ReferenceModel as ReferenceModel
    from shardkit._core.model import SessionState as SessionState
    from shardkit._core.steps import Action as Action
    from shardkit._machine.state_machine import ShardMachine as ShardMachine
    from shardkit._machine.state_machine import step_rule as step_rule
    from shardkit._run.options import FuzzOptions as FuzzOptions
    from shardkit._run.replay import PreparedReplay as PreparedReplay
    from shardkit._run.replay import prepare_replay as prepare_replay
    from shardkit._run.replay import replay as replay
    from shardkit._run.result import FuzzResult as FuzzResult
    from shardkit._run.runner import fuzz as fuzz
    from shardkit._run.suite import machine_for as machine_for
    from shardkit.contract import BoundaryBundle as BoundaryBundle
    from shardkit.contract import CacheResult as CacheResult
    from shardkit.contract import DecodeRequest as DecodeRequest
    from shardkit.contract import EngineCapabilities as EngineCapabilities
    from shardkit.contract import EngineError as EngineError
    from shardkit.contract import EngineTensor as EngineTensor
    from shardkit.contract import Fault as Fault
    from shardkit.contract import FaultInjectable as FaultInjectable
    from shardkit.contract import HealthResult as HealthResult
    from shardkit.contract import LoadRequest as LoadRequest
    from shardkit.contract import LoadResult as LoadResult
    from shardkit.contract import MetricsResult as MetricsResult
    from shardkit.contract import PrefillRequest as PrefillRequest
    from shardkit.contract import ShardEngine as ShardEngine
    from shardkit.contract import StatusCode as StatusCode
    from shardkit.contract import StepResult as StepResult
    from shardkit.contract import StructuredStatus as StructuredStatus
    from shardkit.contract import TokenOutput as TokenOutput
    from shardkit.engines import FakeShardEngine as FakeShardEngine
    from shardkit.engines import FakeShardEngineConfig as FakeShardEngineConfig
    from shardkit.engines import NumpyShardEngine as NumpyShardEngine
    from shardkit.engines.base import EngineSpec as EngineSpec
    from shardkit.engines.base import Produced as Produced
    from shardkit.engines.base import SessionEngine as SessionEngine
    from shardkit.engines.base import StepInput as StepInput
    from shardkit.engines.delegating import DelegatingEngine as DelegatingEngine
    from shardkit.engines.pipeline import PipelineEngine as PipelineEngine
    from shardkit.engines.recording import AcceptedSteps as AcceptedSteps
    from shardkit.engines.recording import RecordingEngine as RecordingEngine
    from shardkit.errors import ContractViolation as ContractViolation
    from shardkit.errors import InvalidTarget as InvalidTarget
    from shardkit.errors import ShardkitError as ShardkitError
    from shardkit.errors import TraceFormatError as TraceFormatError

#: The public names, each with the module it is imported from on first use: read from the
#: ``TYPE_CHECKING`` block above, the one place they are listed.
_HOMES = _PUBLIC_HOMES
__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        message = f"module 'shardkit' has no attribute {name!r}"
        raise AttributeError(message)
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
