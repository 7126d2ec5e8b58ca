"""A bfloat16 bug that only a relative tolerance can see (docs/numerics.md#planted).

Real models carry a few channels of "massive activations": residual values hundreds of
times larger than the rest. ``massive_activation_weights`` gives the numpy engine one such
channel (100 where the others are of order 1). A bfloat16 engine on those weights differs
from a float32 engine by up to ~0.8 on that channel (bfloat16's rounding of a value near
100), so an absolute tolerance alone must be about 1.5 to pass against a float32
reference, and is then blind to any error below that on the ordinary channels. The
allclose tolerance passes it at ``0.1 + 1.6e-2·|reference|`` instead.

``DecodeShipsInt8Residual`` is such an error: its decode steps send the boundary residual
through an int8 buffer scaled by the row's largest value (a transfer compression left on
for an engine that declares bfloat16). Each value moves by up to 1/254 of the row's
largest, ~0.4 on every channel: within 1.5, far outside 0.1 + 1.6e-2·|value| for values of
order 1. These engines are not in ``PLANTED``: they are numpy engines, not fakes, and are
fuzzed with a float32 reference (``MassiveActivationsFloat32Engine``), as
``tests/test_numerics.py`` and docs/numerics.md show.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from shardkit.contract import BoundaryBundle, DecodeRequest, EngineTensor, StepResult
from shardkit.engines.llama_weights import LlamaConfig, LlamaWeights, random_weights
from shardkit.engines.numpy_llama import NumpyBfloat16ShardEngine, NumpyShardEngine

__all__ = [
    "AbsoluteToleranceDecodeShipsInt8Residual",
    "AbsoluteToleranceMassiveActivationsBfloat16Engine",
    "DecodeShipsInt8Residual",
    "MassiveActivationsBfloat16Engine",
    "MassiveActivationsFloat32Engine",
    "massive_activation_weights",
]

#: The channel that carries the massive activation, and its value in every token's embedding.
MASSIVE_CHANNEL = 5
MASSIVE_VALUE = 100.0


@functools.cache
def massive_activation_weights() -> LlamaWeights:
    """``random_weights(LlamaConfig(), seed=0)`` with channel ``MASSIVE_CHANNEL`` of every
    token's embedding set to ``MASSIVE_VALUE``: the residual stream keeps it through the layers."""
    weights = random_weights(LlamaConfig(), seed=0)
    embedding = weights.token_embd.copy()
    embedding[:, MASSIVE_CHANNEL] = MASSIVE_VALUE
    return dataclasses.replace(weights, token_embd=embedding)


class MassiveActivationsFloat32Engine(NumpyShardEngine):
    """The float32 reference on the massive-activation weights."""

    ENGINE_NAME: ClassVar[str] = "MassiveActivationsFloat32Engine"

    def __init__(self) -> None:
        super().__init__(massive_activation_weights())


class MassiveActivationsBfloat16Engine(NumpyBfloat16ShardEngine):
    """A correct bfloat16 engine on the massive-activation weights. Measured as a head on
    500 histories of 2 to 128 tokens: a value differs by at most 0.031 between chunkings
    and 0.77 from the float32 engine's (on the massive channel); beside the default
    relative tolerance 0.016 and 0.042 remain. 0.1 is over twice that."""

    ENGINE_NAME: ClassVar[str] = "MassiveActivationsBfloat16Engine"
    TOLERANCE: ClassVar[float] = 0.1

    def __init__(self) -> None:
        super().__init__(massive_activation_weights())


class AbsoluteToleranceMassiveActivationsBfloat16Engine(MassiveActivationsBfloat16Engine):
    """The same engine with the single absolute tolerance it had to declare before the
    relative one existed: about twice the 0.77 it differs by from float32."""

    ENGINE_NAME: ClassVar[str] = "AbsoluteToleranceMassiveActivationsBfloat16Engine"
    TOLERANCE: ClassVar[float] = 1.5
    RELATIVE_TOLERANCE: ClassVar[float | None] = 0.0


def _through_int8(rows: npt.NDArray[Any], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """Each row quantised to int8 by its largest magnitude, and back."""
    wide = rows.astype(np.float64)
    scale = np.abs(wide).max(axis=1, keepdims=True) / 127.0
    scale[scale == 0] = 1.0
    shipped: npt.NDArray[Any] = (np.round(wide / scale) * scale).astype(dtype)
    return shipped


class DecodeShipsInt8Residual(MassiveActivationsBfloat16Engine):
    """The planted bug: a decode's boundary residual goes through an int8 buffer."""

    ENGINE_NAME: ClassVar[str] = "DecodeShipsInt8Residual"
    BUG: ClassVar[str] = (
        "a decode's boundary residual goes through an int8 buffer scaled by the row's largest value: "
        "every value moves by up to 1/254 of it"
    )
    PROPERTY: ClassVar[str] = "§3 determinism"
    ROLE: ClassVar[str] = "head"

    def decode(self, request: DecodeRequest) -> StepResult:
        result = super().decode(request)
        if not result.status.ok or not isinstance(result.output, BoundaryBundle):
            return result
        tensor = result.output.tensors[0]
        rows = tensor.to_array()
        shipped = EngineTensor.from_array(tensor.name, _through_int8(rows, rows.dtype))
        return dataclasses.replace(result, output=dataclasses.replace(result.output, tensors=(shipped,)))


class AbsoluteToleranceDecodeShipsInt8Residual(DecodeShipsInt8Residual):
    """The planted bug under the single absolute tolerance (1.5), which it stays within."""

    ENGINE_NAME: ClassVar[str] = "AbsoluteToleranceDecodeShipsInt8Residual"
    TOLERANCE: ClassVar[float] = 1.5
    RELATIVE_TOLERANCE: ClassVar[float | None] = 0.0
