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

from ._version import __version__ as __version__

# Bound now, not on first use: importing the submodule ``shardkit.replay`` (as the CLI
# does) sets the package attribute ``replay`` to that module, hiding a lazy function.
from .replay import replay as replay

if TYPE_CHECKING:
    from .conformance import assert_shard_engine_contract as assert_shard_engine_contract
    from .contract import BoundaryBundle as BoundaryBundle
    from .contract import CacheResult as CacheResult
    from .contract import DecodeRequest as DecodeRequest
    from .contract import EngineCapabilities as EngineCapabilities
    from .contract import EngineError as EngineError
    from .contract import EngineTensor as EngineTensor
    from .contract import Fault as Fault
    from .contract import FaultInjectable as FaultInjectable
    from .contract import HealthResult as HealthResult
    from .contract import LoadRequest as LoadRequest
    from .contract import LoadResult as LoadResult
    from .contract import MetricsResult as MetricsResult
    from .contract import PrefillRequest as PrefillRequest
    from .contract import ShardEngine as ShardEngine
    from .contract import StatusCode as StatusCode
    from .contract import StepResult as StepResult
    from .contract import StructuredStatus as StructuredStatus
    from .contract import TokenOutput as TokenOutput
    from .engines import FakeShardEngine as FakeShardEngine
    from .engines import FakeShardEngineConfig as FakeShardEngineConfig
    from .engines import NumpyShardEngine as NumpyShardEngine
    from .engines.pipeline import PipelineEngine as PipelineEngine
    from .errors import ContractViolation as ContractViolation
    from .errors import InvalidTarget as InvalidTarget
    from .errors import ShardkitError as ShardkitError
    from .errors import TraceFormatError as TraceFormatError
    from .machine import ShardMachine as ShardMachine
    from .machine import machine_for as machine_for
    from .model import Prediction as Prediction
    from .model import ReferenceModel as ReferenceModel
    from .steps import Action as Action

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
    "Action": ".steps",
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
    "Prediction": ".model",
    "PrefillRequest": ".contract",
    "ReferenceModel": ".model",
    "ShardEngine": ".contract",
    "ShardMachine": ".machine",
    "ShardkitError": ".errors",
    "StatusCode": ".contract",
    "StepResult": ".contract",
    "StructuredStatus": ".contract",
    "TokenOutput": ".contract",
    "TraceFormatError": ".errors",
    "assert_shard_engine_contract": ".conformance",
    "machine_for": ".machine",
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
