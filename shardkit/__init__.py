"""shardkit: property-based state-machine testing for LLM shard engines.

Where things live:

- ``contract``  — the contract v1 vocabulary (SPEC §1) and the ``ShardEngine`` ABC.
- ``model``     — ``ReferenceModel``, the pure model of the session lifecycle (SPEC §2).
- ``checks``    — validation of engine outputs (SPEC §3 shape and range).
- ``conformance`` — ``assert_shard_engine_contract``, the quick static contract.
- ``steps``     — concrete steps (``Action``) and the requests they stand for.
- ``driver``    — runs steps against an engine and the model, with every check.
- ``twins``     — the twin oracle: fresh engines replaying one session's history.
- ``faults``    — fault injection at an engine's boundary (SPEC §4).
- ``machine``   — the Hypothesis state machine and ``machine_for``.
- ``minimize``  — the second-stage minimiser: replay without Hypothesis, 1-minimal results.
- ``runner``, ``report``, ``trace``, ``regression`` — one run, its summary, its trace and test.
- ``replay``    — trace files read back (validated as untrusted input) and re-run.
- ``pytest_plugin`` — ``--shardkit-engine`` / ``--shardkit-seed`` for the stateful suites.
- ``cli``       — the ``shardkit`` command, a thin adapter over the above.
- ``engines/``  — the bundled engines: ``FakeShardEngine`` (the deterministic fixture),
  ``NumpyShardEngine`` (a real llama-style decoder), ``PipelineEngine`` (a coordinator
  chaining shards), ``llama_cpp.LlamaCppShardEngine`` (llama.cpp, extra ``llama``), and
  ``gguf_io`` (GGUF weights, extra ``gguf``).
- ``errors``    — ``ShardkitError`` and its subclasses.

Import public names from ``shardkit`` itself; module paths may move. They are
imported on first use, so that a process needing a few of them (a worker process of
``--isolate``, an engine importing the contract) does not pay for all of them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shardkit._version import __version__ as __version__

if TYPE_CHECKING:
    from shardkit._core.conformance import assert_shard_engine_contract as assert_shard_engine_contract
    from shardkit._core.model import Prediction as Prediction
    from shardkit._core.model import ReferenceModel as ReferenceModel
    from shardkit._core.steps import Action as Action
    from shardkit._machine.state_machine import ShardMachine as ShardMachine
    from shardkit._machine.state_machine import machine_for as machine_for
    from shardkit._run.replay import replay as replay
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
    from shardkit.engines.pipeline import PipelineEngine as PipelineEngine
    from shardkit.errors import ContractViolation as ContractViolation
    from shardkit.errors import InvalidTarget as InvalidTarget
    from shardkit.errors import ShardkitError as ShardkitError
    from shardkit.errors import TraceFormatError as TraceFormatError

__all__ = [
    "Action",
    "BoundaryBundle",
    "CacheResult",
    "ContractViolation",
    "DecodeRequest",
    "EngineCapabilities",
    "EngineError",
    "EngineTensor",
    "FakeShardEngine",
    "FakeShardEngineConfig",
    "Fault",
    "FaultInjectable",
    "HealthResult",
    "InvalidTarget",
    "LoadRequest",
    "LoadResult",
    "MetricsResult",
    "NumpyShardEngine",
    "PipelineEngine",
    "Prediction",
    "PrefillRequest",
    "ReferenceModel",
    "ShardEngine",
    "ShardMachine",
    "ShardkitError",
    "StatusCode",
    "StepResult",
    "StructuredStatus",
    "TokenOutput",
    "TraceFormatError",
    "assert_shard_engine_contract",
    "machine_for",
    "replay",
]

#: Where each public name lives.
_HOMES = {
    "Action": "._core.steps",
    "BoundaryBundle": ".contract",
    "CacheResult": ".contract",
    "ContractViolation": ".errors",
    "DecodeRequest": ".contract",
    "EngineCapabilities": ".contract",
    "EngineError": ".contract",
    "EngineTensor": ".contract",
    "FakeShardEngine": ".engines",
    "FakeShardEngineConfig": ".engines",
    "Fault": ".contract",
    "FaultInjectable": ".contract",
    "HealthResult": ".contract",
    "InvalidTarget": ".errors",
    "LoadRequest": ".contract",
    "LoadResult": ".contract",
    "MetricsResult": ".contract",
    "NumpyShardEngine": ".engines",
    "PipelineEngine": ".engines.pipeline",
    "Prediction": "._core.model",
    "PrefillRequest": ".contract",
    "ReferenceModel": "._core.model",
    "ShardEngine": ".contract",
    "ShardMachine": "._machine.state_machine",
    "ShardkitError": ".errors",
    "StatusCode": ".contract",
    "StepResult": ".contract",
    "StructuredStatus": ".contract",
    "TokenOutput": ".contract",
    "TraceFormatError": ".errors",
    "assert_shard_engine_contract": "._core.conformance",
    "machine_for": "._machine.state_machine",
    "replay": "._run.replay",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        message = f"module 'shardkit' has no attribute {name!r}"
        raise AttributeError(message)
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value  # later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
