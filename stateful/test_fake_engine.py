"""Fuzz the bundled fake engine in every role, with and without faults, under the shardkit-ci profile.

A failure here is either a bug in the fake or in the reference model: they are
written independently, so each checks the other.
"""

from __future__ import annotations

from hypothesis import settings

from shardkit import FakeShardEngine, machine_for

CI_SETTINGS = settings(settings.get_profile("shardkit-ci"), database=None)


def _suite(role: str, faults: str) -> type:
    machine = machine_for(FakeShardEngine, role=role, faults=faults, name=f"Fake_{role}_{faults}")
    machine.TestCase.settings = CI_SETTINGS
    return machine.TestCase


TestFullWithFaults = _suite("full", "all")
TestFullWithoutFaults = _suite("full", "none")
TestHeadWithFaults = _suite("head", "all")
TestHeadWithoutFaults = _suite("head", "none")
TestMiddleWithFaults = _suite("middle", "all")
TestMiddleWithoutFaults = _suite("middle", "none")
TestTailWithFaults = _suite("tail", "all")
TestTailWithoutFaults = _suite("tail", "none")

# The fake again, in a worker process (the grpc extra): an isolated engine must behave
# exactly as in-process, injected crashes included (each really ends the worker).
_isolated = machine_for("shardkit:FakeShardEngine", role="head", isolate=True, name="Fake_head_isolated")
_isolated.TestCase.settings = settings(CI_SETTINGS, max_examples=50, stateful_step_count=30)
TestHeadIsolated = _isolated.TestCase
