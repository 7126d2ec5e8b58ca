"""Fuzz the numpy llama engine in every role, and a pipeline of numpy shards differentially
against a single full numpy engine, under the shardkit-ci profile."""

from __future__ import annotations

from hypothesis import settings

from shardkit import NumpyShardEngine, PipelineEngine, machine_for

# 40 examples, not the profile's 200: sessions grow to the engine's 256 tokens and every new
# history is recomputed in one prefill, so a numpy example is long (the five suites took 34 to
# 54 s each at 40 examples, with one BLAS thread); tests/test_control.py fuzzes the same
# engine over 10 seeds.
CI_SETTINGS = settings(settings.get_profile("shardkit-ci"), database=None, max_examples=40)


def _suite(target: object, role: str, name: str, **options: object) -> type:
    machine = machine_for(target, role=role, name=name, **options)  # type: ignore[arg-type]
    machine.TestCase.settings = CI_SETTINGS
    return machine.TestCase


TestNumpyFull = _suite(NumpyShardEngine, "full", "Numpy_full")
TestNumpyHead = _suite(NumpyShardEngine, "head", "Numpy_head")
TestNumpyMiddle = _suite(NumpyShardEngine, "middle", "Numpy_middle")
TestNumpyTail = _suite(NumpyShardEngine, "tail", "Numpy_tail")
# The coordinator against the engine it coordinates: same statuses, same tokens.
TestNumpyPipelineAgainstFullEngine = _suite(
    PipelineEngine.factory(NumpyShardEngine, (1, 2)), "full", "NumpyPipeline", reference=NumpyShardEngine
)
