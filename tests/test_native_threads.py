"""Native thread pools (``shardkit/_core/native_threads.py``): the policy read from the
environment, the variables an isolated worker gets (and that its numpy obeys), the pin a run
holds in this process and undoes after, and what the kit promises about answers: within the
engine's declared tolerance at any pool size, and the same bits within a run, which computes
every answer it compares at the one size it pins.

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

from shardkit import EngineSpec, FakeShardEngine, NumpyShardEngine, SessionEngine, StepInput, TokenOutput
from shardkit._core.checks import Tolerance, payload_difference
from shardkit._core.native_threads import (
    ENVIRONMENT,
    THREAD_VARIABLES,
    NativeThreads,
    native_thread_policy,
    pinned_native_threads,
    worker_environment,
)
from shardkit._core.targets import PythonTarget
from shardkit._run.runner import fuzz
from shardkit.contract import (
    BoundaryBundle,
    LoadRequest,
    PrefillRequest,
    StepResult,
)
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

    pool = WorkerPool(PythonTarget("shardkit:FakeShardEngine"), IsolationOptions())
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


# --- what the pin changes: the speed, and at most the last bits -----------------------------
#
# A BLAS may sum in another order with another number of threads: OpenBLAS's Haswell kernels
# on an AMD EPYC gave the numpy engine's head prefill other last bits with 1 thread than with 4
# (at most 2.5e-6 apart). So the kit promises no bits across pool sizes; it promises that every
# answer a run compares is computed at the one size the run pins, and the numpy engine declares
# a tolerance that covers any pool size.

#: The pool sizes compared: one, two, and a thread per core (at least four).
POOL_SIZES = sorted({1, 2, max(4, CORES)})


def _head_prefill(tokens: int, *, chunks: int = 1) -> np.ndarray:
    """The residual rows of a head shard's prefill of ``tokens`` tokens, sent in ``chunks`` prefills."""
    engine = NumpyShardEngine()
    total = engine.capabilities().total_layers
    engine.load(LoadRequest("bits", 0, total - 2, total))  # a head shard: its answer is the residual, every row
    history = [(7 * index) % 256 for index in range(tokens)]
    cut = -(-tokens // chunks)
    rows = []
    for step, first in enumerate(range(0, tokens, cut)):
        result = engine.prefill(PrefillRequest("s", 0, step, token_ids=tuple(history[first : first + cut])))
        assert result.status.ok, result.status
        assert isinstance(result.output, BoundaryBundle)
        rows.append(result.output.tensors[0].to_array())
    return np.concatenate(rows)


@pytest.mark.parametrize("tokens", [1, 33, 256])
def test_the_numpy_engine_answers_within_its_declared_tolerance_at_any_pool_size(tokens: int) -> None:
    """Whole and in two chunks (what the chunking twin compares), at every pool size: each
    answer within ``TOLERANCE`` of the one-thread whole prefill. Bits may differ (they do on
    some processors); the kit's comparisons use the tolerance, so a correct engine passes
    whatever the pool size it runs at."""
    tolerance = Tolerance(NumpyShardEngine.TOLERANCE)  # absolute alone: stricter than what it declares
    assert tolerance.absolute > 0
    with threadpool_limits(limits=1):
        reference = _head_prefill(tokens)
    assert reference.shape == (tokens, 64)
    assert np.isfinite(reference).all()
    for size in POOL_SIZES:
        with threadpool_limits(limits=size):
            for chunks in (1, 2):
                answer = _head_prefill(tokens, chunks=chunks)
                assert payload_difference(reference, answer, tolerance) is None, (size, chunks)


class _AnswerFollowsThePool(SessionEngine[tuple[int, ...]]):
    """Declares ``TOLERANCE = 0.0`` (bit-exact), but its answer moves with the size of the
    BLAS pool when it computes: a BLAS whose last bits follow its thread count, made certain.
    Any two answers the kit compares that were computed at different pool sizes differ, and a
    run flags it. Its answer is the sum of the history and the pool's size, modulo 16."""

    EVIDENCE_CLASS = "fixture"
    TOLERANCE = 0.0

    def __init__(self) -> None:
        spec = EngineSpec(
            architecture="pool-sum",
            total_layers=1,
            hidden_size=4,
            vocab_size=16,
            dtype="float32",
            max_sessions=4,
            max_kv_tokens=64,
        )
        super().__init__(spec)

    def load_layers(self, request: LoadRequest, layers: range, role: str) -> None:
        pass

    def fresh_cache(self) -> tuple[int, ...]:
        return ()

    def forward(self, cache: tuple[int, ...], step: StepInput) -> tuple[tuple[int, ...], TokenOutput]:
        assert step.token_ids is not None
        history = cache + step.token_ids
        return history, TokenOutput((sum(history) + max(_pool_sizes())) % 16)


def test_an_engine_whose_answer_follows_the_pool_size_really_changes_with_it() -> None:
    """The premise of the next test: outside a run, two pool sizes give other answers."""
    engine = _AnswerFollowsThePool()
    engine.load(LoadRequest("bits", 0, 0, 1))
    answers = []
    for size in (1, 2):
        with threadpool_limits(limits=size):
            result = engine.prefill(PrefillRequest("s", size, 0, token_ids=(1, 2, 3)))
        assert isinstance(result.output, TokenOutput), result.status
        answers.append(result.output.token_id)
    assert answers[0] != answers[1]


@pytest.mark.parametrize("chosen", [None, "3"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_bit_exact_engine_is_never_flagged_because_its_bits_follow_the_pool_size(
    clean_environment: None, monkeypatch: pytest.MonkeyPatch, seed: int, chosen: str | None
) -> None:
    """The bit-identity the kit promises, on the path it takes: a run pins the pools for its
    whole length, twins, chunking and composition checks included, so an engine that declares
    ``TOLERANCE = 0.0`` is compared with itself at one pool size, whatever size the process
    had before the run (here 2) and whatever size the run pins."""
    if chosen is not None:
        monkeypatch.setenv(ENVIRONMENT, chosen)
    with threadpool_limits(limits=2):
        result = fuzz(_AnswerFollowsThePool, seed=seed, examples=40, steps=30, faults="none", minimize=False)
    assert result.failure is None, result.failure.violation.message if result.failure else ""
    assert result.steps > 0


# --- the bench's section -------------------------------------------------------------------


def test_the_bench_measures_the_pin_under_both_conditions_and_renders_it() -> None:
    from shardkit._bench.native_threads import NATIVE_CONDITIONS
    from shardkit._bench.render import render
    from shardkit._bench.run import run_bench
    from shardkit._bench.settings import QUICK

    figures = run_bench(QUICK, sections=("native_threads",))
    native = figures["native_threads"]
    if CORES < 2:
        assert native == "not measured: one core, so a native pool has one thread pinned or not"
        return
    assert native["prefill_tokens"] == QUICK.native_prefill_tokens == 32
    assert native["tolerance"] == NumpyShardEngine.TOLERANCE
    assert 0.0 <= native["max_difference"] <= native["tolerance"]
    assert native["within_tolerance"] is True
    assert native["pools"], "threadpoolctl found no native pool in numpy"
    assert list(native["conditions"]) == list(NATIVE_CONDITIONS)
    for condition, row in native["conditions"].items():
        assert row["busy_processes"] == (0 if condition == "machine as found" else CORES - 1)
        assert len(row["default_ms_by_round"]) == len(row["pinned_ms_by_round"]) == QUICK.rounds
        assert row["slower_min"] <= row["slower"] <= row["slower_max"]
        # The row is its median round's: its two times and its ratio agree.
        assert row["slower"] == pytest.approx(row["default_ms"] / row["pinned_ms"], rel=0.02)
    lines = render(figures).splitlines()
    header = next(line for line in lines if line.startswith("native threads ("))
    assert "32-token prefill" in header
    assert f"the median of {QUICK.rounds} rounds; outputs " in header
    assert header.endswith(_render_native_threads_outputs(native))
    for condition in NATIVE_CONDITIONS:
        assert any(line.startswith(f"  {condition} ") and "x" in line and "slower unpinned" in line for line in lines)


def _render_native_threads_outputs(native: dict[str, object]) -> str:
    from shardkit._bench.render import _render_native_threads

    return _render_native_threads(native)[0].rsplit("; outputs ", 1)[1]


@pytest.mark.parametrize(
    ("difference", "said"),
    [
        (0.0, "identical):"),
        (2.5e-6, "at most 2.5e-06 apart, within the engine's tolerance 0.0001):"),
        (0.5, "0.5 apart, BEYOND the engine's tolerance 0.0001 (its answers at one thread count would fail"),
    ],
)
def test_the_bench_says_how_far_apart_the_outputs_were_against_the_tolerance(difference: float, said: str) -> None:
    native = {
        "prefill_tokens": 32,
        "layers": "0-2 of 4 (head)",
        "pools": ["openblas 0.3.31 (pthreads)"],
        "default_threads": 2,
        "rounds": 3,
        "max_difference": difference,
        "tolerance": 1e-4,
        "within_tolerance": difference <= 1e-4,
        "conditions": {},
    }
    assert said in _render_native_threads_outputs(native)
