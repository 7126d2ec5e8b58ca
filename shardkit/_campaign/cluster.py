"""A campaign on a Ray cluster (``shardkit campaign --cluster ADDRESS``): the same rounds from
the same seeds as on one machine, each run as a Ray task on whichever node Ray places it.

What differs from ``run`` is only who runs a round and how its files come home:

- ``--workers N`` is N *slots*: slot k runs its rounds one after another, round r from
  ``round_seed(seed, k, r)``, exactly as worker k does on one machine; Ray places each round
  (a task asking for one CPU) on any node with one free.
- The driver's current folder is shipped to every node as Ray's ``working_dir`` (version
  control, virtual environments and the kit's own output left out; ``.gitignore`` is
  honoured), and a round runs in its copy: a file target given relative to that folder has
  the same name on every node, so trace names, database keys and rerun commands are those of
  a run on the laptop.
- A round writes its trace and regression test into a temporary folder on its node and
  sends them back as text; the driver writes them under ``--out`` and points the report at
  them there.
- A round whose node or worker process died is retried by Ray (``ROUND_RETRIES`` times),
  from the same seed, so a retry is the same round; one that still cannot finish is
  reported as lost, with its seed, and its slot goes on with its next round.
- Ctrl-C cancels the rounds in flight (Ray raises ``KeyboardInterrupt`` in each, which a
  round takes as the campaign's interrupt: a failure it had found comes back, unminimised).

Ray is imported only here, and only when ``--cluster`` is given.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import json
import logging
import os
import shlex
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardkit._campaign.merge import CampaignResult
from shardkit._campaign.rounds import (
    Event,
    RoundFinished,
    RoundOutcome,
    WorkerFailed,
    WorkerReady,
    WorkerStopped,
    outcome_of,
)
from shardkit._campaign.seeds import round_seed
from shardkit._run.options import FuzzOptions
from shardkit._run.trace import write_atomically
from shardkit._version import __version__
from shardkit.errors import UsageError

__all__ = ["CLUSTER_EXCLUDES", "ROUND_RETRIES", "check_cluster", "missing_on_node", "run_on_cluster"]

#: Times Ray reruns a round whose worker process or node died, before the round is reported lost.
ROUND_RETRIES = 2
#: Seconds between two looks at the rounds in flight (the live display's clock ticks at this rate).
POLL_INTERVAL_S = 0.2
#: Seconds the rounds get to hand back what they found after Ctrl-C.
INTERRUPT_GRACE_S = 30.0
#: Seconds to wait for the cluster's head to accept a connection.
CONNECT_TIMEOUT_S = 10.0
#: What of the driver's folder is not shipped to the nodes (besides what ``.gitignore`` names).
CLUSTER_EXCLUDES = (".git", ".venv", "venv", ".tox", ".shardkit", "__pycache__", "*.pyc", "node_modules", ".mypy_cache", ".ruff_cache", ".pytest_cache")


@dataclass(frozen=True)
class _NodeRound:
    """What a round sends back from its node: its outcome and files, or why it has none."""

    node: str
    outcome: RoundOutcome | None = None
    #: The folder it wrote its files in and the copy of the driver's folder it ran in, on its
    #: node, and each file's name and text.
    folder: str = ""
    working_dir: str = ""
    files: tuple[tuple[str, str], ...] = ()
    error: WorkerFailed | None = None
    #: Ctrl-C reached it before it had found anything.
    interrupted: bool = False


def run_on_cluster(
    plan: Any, address: str, result: CampaignResult, on_event: Callable[[Event | None], None] | None = None
) -> None:
    """Run ``plan`` (a ``CampaignPlan``) on the Ray cluster at ``address``, filling ``result``."""
    ray = _import_ray()
    _connect(ray, address)
    try:
        _Rounds(ray, plan, result, on_event).run()
    finally:
        with contextlib.suppress(Exception):  # a cluster already gone has nothing to shut down
            ray.shutdown()


#: What a campaign says when ``--cluster`` finds no Ray here.
RAY_MISSING = "shardkit campaign: --cluster needs Ray, which cannot be imported here ({}); install it with pip install 'shardkit[ray]'"


def _import_ray() -> Any:
    try:
        return importlib.import_module("ray")
    except ImportError as error:
        raise UsageError(RAY_MISSING.format(error)) from None


def _connect(ray: Any, address: str) -> None:
    runtime_env = {"working_dir": os.getcwd(), "excludes": list(CLUSTER_EXCLUDES)}
    try:
        ray.init(
            address=address,
            runtime_env=runtime_env,
            namespace="shardkit",
            logging_level=logging.ERROR,
            log_to_driver=False,
            configure_logging=True,
        )
    except (ConnectionError, RuntimeError, ValueError) as error:
        message = f"shardkit campaign: --cluster {address}: no Ray cluster could be joined there ({_line_of(error)}); start one with ray start --head, or name its address (HOST:PORT, ray://HOST:10001 or auto)"
        raise UsageError(message) from None


def check_cluster(address: str) -> None:
    """Whether a campaign can join the cluster at ``address``, said before it starts: Ray is
    installed, and a ``HOST:PORT`` answers (Ray itself would retry for ever)."""
    if importlib.util.find_spec("ray") is None:
        raise UsageError(RAY_MISSING.format("it is not installed"))
    if address == "auto" or "://" in address:
        return  # Ray finds the local cluster, or its client connects with a timeout of its own
    host, colon, port_text = address.rpartition(":")
    if not colon or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        message = f"shardkit campaign: --cluster {address!r} is no Ray address; give the head node's HOST:PORT (as ray start --head printed it), ray://HOST:10001 or auto"
        raise UsageError(message)
    try:
        socket.create_connection((host.strip("[]"), int(port_text)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as error:
        message = f"shardkit campaign: --cluster {address}: nothing answers there ({error.strerror or error}); start the cluster's head with ray start --head --port {port_text}, or name its address"
        raise UsageError(message) from None


class _Rounds:
    """The driver's loop: keeps one round in flight per slot, gathers each as it ends."""

    def __init__(self, ray: Any, plan: Any, result: CampaignResult, on_event: Callable[[Event | None], None] | None) -> None:
        self.ray = ray
        self.plan = plan
        self.result = result
        self.on_event = on_event
        self.in_flight: dict[Any, tuple[int, int]] = {}
        self.stopping = False
        self.remote_round = ray.remote(num_cpus=1, max_retries=ROUND_RETRIES, retry_exceptions=False)(_round_on_node)
        self.deadline = time.monotonic() + plan.minutes * 60 if plan.minutes is not None else None

    def run(self) -> None:
        for worker in range(1, self.plan.workers + 1):
            self._submit(worker, 1)
            self._tell(WorkerReady(worker))
        try:
            while self.in_flight:
                ready, _ = self.ray.wait(list(self.in_flight), num_returns=1, timeout=POLL_INTERVAL_S)
                if not ready:
                    self._tell(None)
                    continue
                self._gather(ready[0])
        except KeyboardInterrupt:
            self.result.interrupted = True
            self.stopping = True
            for reference in list(self.in_flight):
                with contextlib.suppress(Exception):
                    self.ray.cancel(reference)
            with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C: stop waiting, report what arrived
                until = time.monotonic() + INTERRUPT_GRACE_S
                while self.in_flight and time.monotonic() < until:
                    ready, _ = self.ray.wait(list(self.in_flight), num_returns=1, timeout=POLL_INTERVAL_S)
                    if ready:
                        self._gather(ready[0])
        self.result.outcomes.sort(key=lambda outcome: (outcome.worker, outcome.round))

    def _submit(self, worker: int, round_number: int) -> None:
        plan = self.plan
        reference = self.remote_round.remote(plan.target, plan.options, plan.seed, worker, round_number, __version__)
        self.in_flight[reference] = (worker, round_number)

    def _gather(self, reference: Any) -> None:
        worker, round_number = self.in_flight.pop(reference)
        seed = round_seed(self.plan.seed, worker, round_number)
        try:
            sent: _NodeRound = self.ray.get(reference)
        except self.ray.exceptions.TaskCancelledError:
            self._tell(WorkerStopped(worker, interrupted=True))
            return
        except self.ray.exceptions.RayTaskError as error:
            # The round never ran: its node could not load it (no shardkit there, say). Every round would fail alike.
            cause = error.cause if isinstance(getattr(error, "cause", None), BaseException) else error
            reason = _line_of(cause, last=True)
            failed = WorkerFailed(worker, round_number, seed, f"a node could not start the round: {type(cause).__name__}: {reason}; install shardkit {__version__} on every node")
            self.result.errors.append(failed)
            self.stopping = True
            self._tell(failed)
            return
        except self.ray.exceptions.RayError as error:
            self._lost(worker, round_number, seed, error)
            return
        if sent.error is not None:
            self.result.errors.append(sent.error)
            self.stopping = True  # an engine that cannot be built fails in every round alike
            self._tell(sent.error)
            return
        if sent.outcome is None:
            self._tell(WorkerStopped(worker, interrupted=sent.interrupted))
            return
        outcome = _bring_home(sent, self.plan.out)
        self.result.outcomes.append(outcome)
        self._tell(RoundFinished(outcome))
        self._next(worker, round_number, stop=outcome.interrupted)

    def _lost(self, worker: int, round_number: int, seed: int, error: Exception) -> None:
        reason = _line_of(error)
        rerun = self.plan.options.command(_target_of(self.plan), seed, None, None)
        message = f"round lost after {ROUND_RETRIES} retries ({type(error).__name__}: {reason}); rerun it alone with: {rerun}"
        lost = WorkerFailed(worker, round_number, seed, message)
        self.result.errors.append(lost)
        self._tell(lost)
        self._next(worker, round_number, stop=False)

    def _next(self, worker: int, done: int, *, stop: bool) -> None:
        plan = self.plan
        out_of_rounds = plan.rounds_per_worker is not None and done >= plan.rounds_per_worker
        past_deadline = self.deadline is not None and time.monotonic() >= self.deadline
        if stop or self.stopping or out_of_rounds or past_deadline:
            self._tell(WorkerStopped(worker, interrupted=self.result.interrupted))
            return
        self._submit(worker, done + 1)

    def _tell(self, event: Event | None) -> None:
        if self.on_event is not None:
            self.on_event(event)


def _line_of(error: BaseException, *, last: bool = False) -> str:
    """The first line of a (Ray's: many-lined) error message, or its last (a task's cause ends
    its traceback with it); the error's type when it has no message."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return lines[-1] if last else lines[0]


def _target_of(plan: Any) -> Any:
    from shardkit._core.targets import parse_target

    return parse_target(plan.target)


def _bring_home(sent: _NodeRound, out: Path) -> RoundOutcome:
    """The round's outcome with its files written under ``out`` here and its report pointing
    at them. The files name the engine's code where the node found it, in its copy of this
    folder: they are made to name it here, where they are replayed."""
    outcome = sent.outcome
    assert outcome is not None
    if outcome.failure is None or not sent.files:
        return outcome
    out.mkdir(parents=True, exist_ok=True)
    moved: dict[str, str] = {}
    here = os.getcwd()
    for name, text in sent.files:
        if sent.working_dir:
            if name.endswith(".json"):
                text = text.replace(json.dumps(sent.working_dir)[1:-1], json.dumps(here)[1:-1])
            else:
                text = text.replace(repr(sent.working_dir)[1:-1], repr(here)[1:-1])
        moved[str(Path(sent.folder) / name)] = str(write_atomically(out / name, text))
    entry = dict(outcome.failure.entry)
    for key in ("trace", "regression_test"):
        if isinstance(entry.get(key), str) and entry[key] in moved:
            entry[key] = moved[entry[key]]
    replay = entry.get("replay_command")
    if isinstance(replay, str):
        for there, home in moved.items():
            replay = replay.replace(shlex.quote(there), shlex.quote(home))
        entry["replay_command"] = replay
    failure = dataclasses.replace(outcome.failure, entry=entry)
    return dataclasses.replace(outcome, failure=failure)


def _round_on_node(
    target: str, options: FuzzOptions, campaign_seed: int, worker: int, round_number: int, driver_version: str
) -> _NodeRound:
    """One round, as a Ray task on a node, in its copy of the driver's folder."""
    from shardkit._campaign.worker import failed_round
    from shardkit._run.runner import fuzz

    node = _node_name()
    seed = round_seed(campaign_seed, worker, round_number)
    missing = missing_on_node(options, driver_version)
    if missing is not None:
        return _NodeRound(node, error=WorkerFailed(worker, round_number, seed, f"on node {node}: {missing}"))
    with tempfile.TemporaryDirectory(prefix="shardkit-round-") as folder:
        started_at = time.time()
        try:
            result = fuzz(target, options, seed=seed, out=folder)
        except KeyboardInterrupt:
            return _NodeRound(node, interrupted=True)
        except BaseException as error:  # whatever ends a round is reported, never lost
            failed = failed_round(worker, round_number, seed, error)
            return _NodeRound(node, error=dataclasses.replace(failed, error=f"on node {node}: {failed.error}"))
        outcome = outcome_of(result, worker=worker, round_number=round_number, started_at=started_at, ended_at=time.time())
        files = tuple(
            (path.name, path.read_text(encoding="utf-8"))
            for path in (result.trace_path, result.regression_path)
            if path is not None and path.is_file()
        )
    return _NodeRound(node, outcome=dataclasses.replace(outcome, node=node), folder=folder, working_dir=os.getcwd(), files=files)


def missing_on_node(options: FuzzOptions, driver_version: str) -> str | None:
    """What this node lacks to run the campaign's rounds, said before a round starts."""
    if driver_version != __version__:
        return f"shardkit {__version__} is installed, but the campaign was started with shardkit {driver_version}; install the same version on every node"
    database = options.database_choice
    if database.kind == "redis" and importlib.util.find_spec("redis") is None:
        return f"{database.source} {database.shown} needs the redis package on every node: pip install 'shardkit[ray,redis]' there"
    return None


@functools.cache
def _node_name() -> str:
    """``ADDRESS (node 1a2b3c4d)``, the node's address as the cluster knows it: nodes on one
    host share an address, not an id. Asked of the cluster once per worker process, which
    Ray reuses for many rounds and never moves to another node."""
    ray = importlib.import_module("ray")
    node_id = ray.get_runtime_context().get_node_id()
    addresses = {node["NodeID"]: node.get("NodeManagerAddress") for node in ray.nodes()}
    return f"{addresses.get(node_id) or ray.util.get_node_ip_address()} (node {node_id[:8]})"
