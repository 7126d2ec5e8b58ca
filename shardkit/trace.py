"""Trace files (SPEC §5): a failure as plain JSON that replays without Hypothesis."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._version import __version__
from .contract import LoadRequest
from .driver import StepRecord, Violation
from .isolation import IsolationOptions

__all__ = ["DEFAULT_OUT", "TRACE_FORMAT", "TRACE_VERSION", "trace_document", "write_atomically"]

#: Where failure traces and regression tests go unless told otherwise.
DEFAULT_OUT = Path(".shardkit/failures")

TRACE_FORMAT = "shardkit-trace"
TRACE_VERSION = 1


def trace_document(
    *,
    target: str,
    load_request: LoadRequest,
    faults: frozenset[str],
    records: list[StepRecord],
    violation: Violation,
    seed: int | None,
    twins: bool = True,
    reference: str | None = None,
    isolation: IsolationOptions | None = None,
) -> dict[str, Any]:
    steps = [
        {**record.action.to_json(), "expected": record.expected, "observed": record.observed} for record in records
    ]
    fault_steps = [
        {"kind": record.action.args["kind"], "value": record.action.args["value"], "step": record.index}
        for record in records
        if record.action.op == "fault"
    ]
    return {
        "format": TRACE_FORMAT,
        "version": TRACE_VERSION,
        "shardkit_version": __version__,
        "target": target,
        "role": load_request.role,
        "load_request": {
            "model_id": load_request.model_id,
            "shard_start": load_request.shard_start,
            "shard_end": load_request.shard_end,
            "total_layers": load_request.total_layers,
            "recipe": dict(load_request.recipe),
        },
        "faults_enabled": sorted(faults),
        "twins": twins,
        "reference": reference,
        # The engine ran in a worker process (--isolate): its failure may be a process death.
        "isolate": isolation.to_json() if isolation is not None else None,
        "fault_steps": fault_steps,
        "seed": seed,
        "steps": steps,
        "failure": {"property": violation.property, "message": violation.message, "step": len(records)},
    }


def write_atomically(path: Path, document: Mapping[str, Any] | str) -> Path:
    """Write to a temporary file beside ``path`` and rename it into place, so a
    killed run never leaves a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = document if isinstance(document, str) else json.dumps(document, indent=2, ensure_ascii=False) + "\n"
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path
