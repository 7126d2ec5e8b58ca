"""Fuzz llama.cpp (LlamaCppShardEngine on the tiny generated GGUF) against the reference
model, and differentially against NumpyShardEngine on the same file.

Needs the ``llama`` extra. Outside CI the suites skip with a message naming it; CI sets
SHARDKIT_REQUIRE_LLAMA=1, so a missing or broken build fails instead of skipping.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from shardkit import machine_for

REQUIRED = os.environ.get("SHARDKIT_REQUIRE_LLAMA") == "1"
try:
    import llama_cpp  # noqa: F401
except ImportError:
    if REQUIRED:
        raise
    pytest.skip("llama.cpp is not installed: pip install 'shardkit[llama]'", allow_module_level=True)

# 100 examples, not the profile's 200: sessions grow to 256 tokens and each new history is
# recomputed in one prefill (the differential suite's by the numpy engine: 49 s at 100), and CI
# has 30 minutes in all (tests/test_control.py fuzzes llama.cpp over 10 seeds as well).
CI_SETTINGS = settings(settings.get_profile("shardkit-ci"), database=None, max_examples=100)
TARGET = "shardkit.engines.llama_cpp:LlamaCppShardEngine"

_machine = machine_for(TARGET, role="full", name="LlamaCpp")
_machine.TestCase.settings = CI_SETTINGS
TestLlamaCppAgainstTheModel = _machine.TestCase

_differential = machine_for(
    TARGET, role="full", reference="shardkit.engines.llama_cpp:numpy_reference", name="LlamaCppVsNumpy"
)
_differential.TestCase.settings = CI_SETTINGS
TestLlamaCppAgainstNumpyOnTheSameFile = _differential.TestCase
