"""``shardkit bench --cluster``: a campaign on Ray clusters the bench starts on this machine,
next to the same campaign in local worker processes.

It measures what a team pays to move a campaign onto Ray:

- Ray's start-up: the seconds from ``ray start --head`` to a live head, from ``ray start
  --address`` to a live worker node, and a driver's first task (joining, shipping a folder,
  a fresh worker process) against a task once warm;
- the campaign's work rate (steps per second, shrinking included) on a cluster of one worker
  node and of two (each one CPU, and a head that runs no rounds), interleaved over the
  rounds with local campaigns of one and two workers, each worker running the same fixed
  rounds (no clock involved), as the scale-out section measures a local campaign.

Each cluster is its own ``ray start --block`` processes, in process groups of their own,
killed at the end: nothing else that runs Ray on this machine is touched.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from shardkit._bench import timing
from shardkit._bench.settings import BenchSettings

__all__ = ["measure_cluster_scaling", "render_cluster_scaling"]

#: Seconds a node may take to join before the bench gives up on it.
JOIN_TIMEOUT_S = 120.0
#: Each node's shared-memory object store: the rounds send back kilobytes, not more.
OBJECT_STORE_BYTES = 100_000_000
ROUNDS_PER_WORKER = 3
NODE_COUNTS = (1, 2)


@dataclass
class _Cluster:
    """A cluster of this machine's: a head that runs no rounds, and worker nodes of one CPU."""

    ray: str
    port: int
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start_head(self) -> float:
        return self._start(["--head", "--port", str(self.port), "--include-dashboard=false", "--num-cpus", "0"])

    def add_node(self) -> float:
        return self._start(["--address", self.address, "--num-cpus", "1"])

    def _start(self, arguments: list[str]) -> float:
        """Seconds from ``ray start`` to the node alive in the cluster, as the cluster's own
        table of nodes says (asked every 50 ms once the head answers)."""
        ray = importlib.import_module("ray")
        alive_before = len(self.processes)
        started = time.perf_counter()
        command = [self.ray, "start", *arguments, "--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats", "--block"]
        self.processes.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        until = started + JOIN_TIMEOUT_S
        try:
            while time.perf_counter() < until:
                if self.processes[-1].poll() is not None:
                    raise RuntimeError(f"ray start {' '.join(arguments)} ended with exit code {self.processes[-1].returncode}")
                if not ray.is_initialized() and _answers(self.port):
                    ray.init(address=self.address, logging_level=logging.ERROR, log_to_driver=False)
                if ray.is_initialized() and sum(node["Alive"] for node in ray.nodes()) > alive_before:
                    return time.perf_counter() - started
                time.sleep(0.05)
        finally:
            ray.shutdown()
        raise RuntimeError(f"ray start {' '.join(arguments)}: no live node after {JOIN_TIMEOUT_S:g} s")

    def stop(self) -> None:
        for process in reversed(self.processes):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def _cluster(nodes: int) -> Iterator[tuple[_Cluster, dict[str, Any]]]:
    """A fresh cluster of ``nodes`` worker nodes, and what its start-up took."""
    ray_bin = Path(sys.executable).with_name("ray")
    if not ray_bin.exists():
        raise RuntimeError(f"no ray command beside {sys.executable}; install the ray extra: pip install 'shardkit[ray]'")
    cluster = _Cluster(str(ray_bin), _free_port())
    try:
        startup = {"head_s": round(cluster.start_head(), 2), "worker_node_s": [round(cluster.add_node(), 2) for _ in range(nodes)]}
        yield cluster, startup
    finally:
        cluster.stop()


def _first_task(address: str) -> dict[str, float]:
    """A driver's join, first task (a fresh worker process, the folder shipped) and a warm task."""
    ray = importlib.import_module("ray")
    with tempfile.TemporaryDirectory(prefix="shardkit-bench-ray-") as folder:
        started = time.perf_counter()
        ray.init(address=address, runtime_env={"working_dir": folder}, logging_level=logging.ERROR, log_to_driver=False)
        joined = time.perf_counter()
        try:
            task = ray.remote(num_cpus=1)(_nothing)
            ray.get(task.remote())
            first = time.perf_counter()
            warm = statistics.median(_timed(lambda: ray.get(task.remote())) for _ in range(20))
        finally:
            ray.shutdown()
    return {"join_s": round(joined - started, 3), "first_task_s": round(first - joined, 3), "warm_task_ms": round(warm * 1000, 2)}


def _nothing() -> None:
    return None


def _timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def measure_cluster_scaling(config: BenchSettings) -> dict[str, Any]:
    """The figures of ``shardkit bench --cluster`` (see the module's docstring)."""
    from shardkit._campaign.run import measure_campaign_work
    from shardkit._run.options import FuzzOptions

    options = FuzzOptions(examples=config.examples, steps=config.steps)
    by_nodes: dict[str, Any] = {}
    for nodes in NODE_COUNTS:
        with _cluster(nodes) as (cluster, startup), tempfile.TemporaryDirectory(prefix="shardkit-bench-cluster-") as empty:
            first_task = _first_task(cluster.address)
            with contextlib.chdir(empty):  # the folder shipped to the nodes: nothing to ship
                work = partial(measure_campaign_work, options=options, workers=nodes, rounds_per_worker=ROUNDS_PER_WORKER, seed=config.seed)
                measured = timing.interleaved({"local": work, "cluster": partial(work, cluster=cluster.address)}, config.rounds)
        ratios = [there.rate / here.rate if here.rate else 0.0 for here, there in zip(measured["local"], measured["cluster"], strict=True)]
        middle = timing.median_round(ratios, float)
        by_nodes[str(nodes)] = {
            "startup": startup,
            "driver": first_task,
            "local_steps_per_s": round(measured["local"][middle].rate, 1),
            "cluster_steps_per_s": round(measured["cluster"][middle].rate, 1),
            "cluster_over_local": round(ratios[middle], 3),
            "cluster_steps_per_s_by_round": [round(work.rate, 1) for work in measured["cluster"]],
            "local_steps_per_s_by_round": [round(work.rate, 1) for work in measured["local"]],
        }
    one, two = by_nodes["1"], by_nodes["2"]
    return {
        "target": "shardkit:FakeShardEngine",
        "rounds_per_worker": ROUNDS_PER_WORKER,
        "examples_per_round": options.examples,
        "steps_per_example": options.steps,
        "cpu_count": os.cpu_count(),
        "interleaved_rounds": config.rounds,
        "ray_version": importlib.import_module("ray").__version__,
        "by_worker_nodes": by_nodes,
        "cluster_two_over_one": round(two["cluster_steps_per_s"] / one["cluster_steps_per_s"], 3) if one["cluster_steps_per_s"] else None,
        "local_two_over_one": round(two["local_steps_per_s"] / one["local_steps_per_s"], 3) if one["local_steps_per_s"] else None,
    }


def render_cluster_scaling(figures: dict[str, Any]) -> str:
    """The figures as a person reads them."""
    lines = [
        f"campaign on a Ray cluster on this machine (Ray {figures['ray_version']}, {figures['cpu_count']} CPUs): "
        f"the fake, {figures['rounds_per_worker']} rounds of {figures['examples_per_round']} examples × {figures['steps_per_example']} steps a worker, "
        f"median of {figures['interleaved_rounds']} interleaved rounds",
        "worker nodes | head start | node start | driver join | first task | warm task | cluster steps/s | local steps/s (same workers) | cluster ÷ local",
    ]
    for nodes, row in figures["by_worker_nodes"].items():
        node_start = ", ".join(f"{seconds:.1f}" for seconds in row["startup"]["worker_node_s"])
        lines.append(
            f"{nodes} | {row['startup']['head_s']:.1f} s | {node_start} s | {row['driver']['join_s']:.2f} s | {row['driver']['first_task_s']:.2f} s | "
            f"{row['driver']['warm_task_ms']:.1f} ms | {row['cluster_steps_per_s']:,.0f} | {row['local_steps_per_s']:,.0f} | {row['cluster_over_local']:.2f}"
        )
    lines.append(f"two worker nodes ÷ one: ×{figures['cluster_two_over_one']}; local --workers 2 ÷ 1: ×{figures['local_two_over_one']}")
    return "\n".join(lines)
