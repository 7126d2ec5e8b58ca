"""Native thread pools (``shardkit/_core/native_threads.py``): the policy read from the
environment, the variables an isolated worker gets (and that its numpy obeys), the pin a run
holds in this process and undoes after, and the claim the pin rests on: the numpy engine's
answers are the same bits with one BLAS thread as with several.

Note: tests/conftest.py sets ``OPENBLAS_NUM_THREADS`` and friends for the whole session, so
every test here that reads the real environment clears them first (``clean_environment``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import ClassVar

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from shardkit import FakeShardEngine, NumpyShardEngine
from shardkit._core.native_threads import (
    ENVIRONMENT,
    THREAD_VARIABLES,
    NativeThreads,
    native_thread_policy,
    pinned_native_threads,
    worker_environment,
)
from shardkit._run.runner import fuzz
from shardkit.contract import BoundaryBundle, LoadRequest, PrefillRequest, StepResult
from shardkit.errors import UsageError

#: The cores this process may run on: OpenBLAS starts one thread for each.
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _pool_sizes() -> list[int]:
    return [pool["num_threads"] for pool in threadpool_info()]


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """os.environ with none of the pool variables nor SHARDKIT_NATIVE_THREADS (conftest sets some)."""
    for name in (*THREAD_VARIABLES, ENVIRONMENT):
        monkeypatch.delenv(name, raising=False)


# --- the policy ---------------------------------------------------------------------------


def test_nobody_chose_so_the_kit_pins_to_one_thread() -> None:
    assert native_thread_policy({}) == NativeThreads(1, "shardkit's default")
    # An empty variable is no choice.
    assert native_thread_policy({ENVIRONMENT: "", "OMP_NUM_THREADS": " "}).threads == 1


def test_a_pool_variable_the_user_set_means_the_kit_leaves_every_pool_alone() -> None:
    policy = native_thread_policy({"OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "2"})
    assert policy.threads is None
    assert policy.reason == "OMP_NUM_THREADS, MKL_NUM_THREADS set in the environment"


def test_shardkit_native_threads_chooses_a_number_or_leaves_the_pools_alone() -> None:
    assert native_thread_policy({ENVIRONMENT: " 3 "}) == NativeThreads(3, f"{ENVIRONMENT}=3", chosen=True)
    assert native_thread_policy({ENVIRONMENT: "default"}) == NativeThreads(None, f"{ENVIRONMENT}=default", chosen=True)
    # The kit's own variable is the more particular choice: it wins over a pool's.
    assert native_thread_policy({ENVIRONMENT: "2", "OPENBLAS_NUM_THREADS": "8"}).threads == 2


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", "Default", "off"])
def test_a_value_that_is_no_number_of_threads_is_an_error_not_ignored(value: str) -> None:
    with pytest.raises(UsageError, match=rf"^{ENVIRONMENT}={value!r} is not a number of threads: give 1 or more"):
        native_thread_policy({ENVIRONMENT: value})


# --- isolated workers: the environment ----------------------------------------------------


def test_a_worker_gets_every_pool_variable_set_to_one_by_default() -> None:
    child = worker_environment({"PATH": "/bin"})
    assert child == {"PATH": "/bin", **dict.fromkeys(THREAD_VARIABLES, "1")}


def test_a_worker_keeps_the_users_pool_variable_and_gets_none_added() -> None:
    parent = {"PATH": "/bin", "OMP_NUM_THREADS": "3"}
    assert worker_environment(parent) == parent


def test_a_worker_gets_the_number_shardkit_native_threads_names_or_nothing_with_default() -> None:
    chosen = {ENVIRONMENT: "2", "OPENBLAS_NUM_THREADS": "8"}
    assert worker_environment(chosen) == {ENVIRONMENT: "2", **dict.fromkeys(THREAD_VARIABLES, "2")}
    assert worker_environment({ENVIRONMENT: "default"}) == {ENVIRONMENT: "default"}
    with pytest.raises(UsageError):
        worker_environment({ENVIRONMENT: "many"})


def test_the_worker_pool_starts_its_workers_with_the_pin(
    clean_environment: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``WorkerPool._environment`` is what the zygote and every fresh worker start with."""
    pytest.importorskip("grpc")
    from shardkit._core.targets import IsolationOptions
    from shardkit._transport.worker import WorkerPool

    pool = WorkerPool("shardkit:FakeShardEngine", IsolationOptions())
    try:
        environment = pool._environment()
        assert {name: environment[name] for name in THREAD_VARIABLES} == dict.fromkeys(THREAD_VARIABLES, "1")
        assert "PYTHONPATH" in environment
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        environment = pool._environment()
        assert environment["OMP_NUM_THREADS"] == "3"
        assert [name for name in THREAD_VARIABLES if name in environment] == ["OMP_NUM_THREADS"]
    finally:
        pool.close()


_CHILD_POOLS = "import json, numpy; from threadpoolctl import threadpool_info; print(json.dumps([p['num_threads'] for p in threadpool_info()]))"


def _child_pool_sizes(environ: dict[str, str]) -> list[int]:
    printed = subprocess.run(
        [sys.executable, "-c", _CHILD_POOLS], env=environ, capture_output=True, text=True, check=True
    )
    sizes: list[int] = json.loads(printed.stdout)
    return sizes


def test_numpy_in_a_process_started_with_the_worker_environment_has_one_thread(clean_environment: None) -> None:
    """The variables really size the pool numpy loads (OpenBLAS reads them as it loads)."""
    pinned = _child_pool_sizes(worker_environment(dict(os.environ)))
    assert pinned, "numpy's BLAS was not found by threadpoolctl: nothing would be pinned"
    assert set(pinned) == {1}
    if CORES > 1:
        left_alone = _child_pool_sizes(worker_environment({**os.environ, ENVIRONMENT: "default"}))
        assert max(left_alone) > 1, left_alone


# --- this process: the pin a run holds -------------------------------------------------------


def test_the_pin_holds_for_the_block_and_is_undone_after() -> None:
    with threadpool_limits(limits=2):
        before = _pool_sizes()
        assert before
        with pinned_native_threads({}) as policy:
            assert policy.threads == 1
            assert set(_pool_sizes()) == {1}
        assert _pool_sizes() == before
        with pinned_native_threads({ENVIRONMENT: "default"}) as policy:
            assert policy.threads is None
            assert _pool_sizes() == before
        with pinned_native_threads({"OPENBLAS_NUM_THREADS": "2"}):
            assert _pool_sizes() == before


def test_the_pin_is_undone_when_the_run_raises() -> None:
    with threadpool_limits(limits=2):
        before = _pool_sizes()
        with pytest.raises(RuntimeError, match="engine died"), pinned_native_threads({}):
            raise RuntimeError("engine died")
        assert _pool_sizes() == before


def test_without_threadpoolctl_the_default_pins_nothing_and_a_chosen_number_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An install that skipped the dependencies (``pip install --no-deps``, as CI's oldest
    Hypothesis run does) still runs; only an explicit choice it cannot honour stops it."""
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)  # importing it raises ImportError
    with pinned_native_threads({}) as policy:
        assert policy.threads is None
        assert policy.reason.startswith("not pinned in this process: threadpoolctl is not installed")
    with pytest.raises(UsageError, match=f"^{ENVIRONMENT}=2 needs the threadpoolctl package"):  # noqa: SIM117
        with pinned_native_threads({ENVIRONMENT: "2"}):
            pass


class _PoolsSeen(FakeShardEngine):
    """The fake, noting the native pools' sizes at each prefill (when the engine computes)."""

    seen: ClassVar[set[int]] = set()

    def prefill(self, request: PrefillRequest) -> StepResult:
        _PoolsSeen.seen.update(_pool_sizes())
        return super().prefill(request)


@pytest.mark.parametrize(("chosen", "inside"), [(None, {1}), ("3", {3}), ("default", {2})])
def test_a_fuzz_run_computes_under_the_pin_and_undoes_it_after(
    clean_environment: None, monkeypatch: pytest.MonkeyPatch, chosen: str | None, inside: set[int]
) -> None:
    if chosen is not None:
        monkeypatch.setenv(ENVIRONMENT, chosen)
    _PoolsSeen.seen = set()
    with threadpool_limits(limits=2):
        before = _pool_sizes()
        result = fuzz(_PoolsSeen, seed=1, examples=3, steps=5, faults="none", minimize=False)
        assert _pool_sizes() == before
    assert result.steps > 0
    assert _PoolsSeen.seen == inside


def test_a_fuzz_run_with_a_bad_setting_stops_with_a_usage_error(
    clean_environment: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENVIRONMENT, "all")
    with pytest.raises(UsageError, match=f"{ENVIRONMENT}='all' is not a number of threads"):
        fuzz(FakeShardEngine, seed=1, examples=2, steps=2)


# --- what the pin rests on: the same bits ----------------------------------------------------


def _head_prefill(tokens: int) -> bytes:
    engine = NumpyShardEngine()
    total = engine.capabilities().total_layers
    engine.load(LoadRequest("bits", 0, total - 2, total))  # a head shard: its answer is the residual, every row
    result = engine.prefill(PrefillRequest("s", 0, 0, token_ids=tuple((7 * index) % 256 for index in range(tokens))))
    assert result.status.ok, result.status
    assert isinstance(result.output, BoundaryBundle)
    return result.output.tensors[0].data


@pytest.mark.parametrize("tokens", [1, 33, 256])
def test_the_numpy_engine_answers_the_same_bits_with_one_blas_thread_as_with_several(tokens: int) -> None:
    """Pinning changes speed, not answers: OpenBLAS splits a product by output blocks, not
    along the summed axis. If a BLAS ever summed in another order with more threads, a twin
    or chunking comparison could flag a correct engine; this would show it first."""
    with threadpool_limits(limits=1):
        one = _head_prefill(tokens)
    with threadpool_limits(limits=max(4, CORES)):
        several = _head_prefill(tokens)
    assert len(one) == tokens * 64 * 4
    assert one == several
    assert np.isfinite(np.frombuffer(one, dtype=np.float32)).all()


# --- the bench's section -------------------------------------------------------------------


def test_the_bench_measures_the_pin_under_both_conditions_and_renders_it() -> None:
    from shardkit._cli import bench

    figures = bench.run_bench(bench.QUICK, sections=("native_threads",))
    native = figures["native_threads"]
    if CORES < 2:
        assert native == "not measured: one core, so a native pool has one thread pinned or not"
        return
    assert native["prefill_tokens"] == bench.QUICK.native_prefill_tokens == 32
    assert native["identical_outputs"] is True
    assert native["pools"], "threadpoolctl found no native pool in numpy"
    assert list(native["conditions"]) == list(bench.NATIVE_CONDITIONS)
    for condition, row in native["conditions"].items():
        assert row["busy_processes"] == (0 if condition == "machine as found" else CORES - 1)
        assert len(row["default_ms_by_round"]) == len(row["pinned_ms_by_round"]) == bench.QUICK.rounds
        assert row["slower_min"] <= row["slower"] <= row["slower_max"]
        # The row is its median round's: its two times and its ratio agree.
        assert row["slower"] == pytest.approx(row["default_ms"] / row["pinned_ms"], rel=0.02)
    lines = bench.render(figures).splitlines()
    header = next(line for line in lines if line.startswith("native threads ("))
    assert "32-token prefill" in header
    assert header.endswith(f"the median of {bench.QUICK.rounds} rounds; outputs identical):")
    for condition in bench.NATIVE_CONDITIONS:
        assert any(line.startswith(f"  {condition} ") and "x" in line and "slower unpinned" in line for line in lines)
