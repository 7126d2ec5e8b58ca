"""Planted bugs in an engine's arithmetic that only extreme but finite inputs reach (issue 18):
a middle or tail must answer any finite residual row, up to float32's largest value, with a
finite answer. Each wraps the fake like the engines of ``shardkit._planted``, which lists them
in ``PLANTED`` (``EXTREME_PLANTED`` here), and states its BUG, PROPERTY, ROLE and an
executable MINIMAL.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import numpy.typing as npt

from shardkit import BoundaryBundle, DecodeRequest, EngineTensor, PrefillRequest, StepResult
from shardkit._planted.base import PlantedEngine, StepRequest
from shardkit._planted.minimal import prefill
from shardkit.contract import RESIDUAL_TENSOR

__all__ = ["EXTREME_PLANTED", "LayerNormVarianceOverflows"]


def one_pass_layer_norm(rows: npt.NDArray[np.float32], eps: float = 1e-5) -> npt.NDArray[np.float32]:
    """LayerNorm with the textbook one-pass variance, ``E[x²] − E[x]²``, all in float32: the
    bug. On ordinary rows it is merely imprecise; on a row near ±3.4e38 both terms overflow to
    inf, and inf − inf is NaN. (The fix: subtract the mean first, and scale the row by its
    largest magnitude before squaring, or sum the squares in float64.)"""
    with np.errstate(over="ignore", invalid="ignore"):
        mean = rows.mean(axis=-1, keepdims=True, dtype=np.float32)
        variance = np.square(rows).mean(axis=-1, keepdims=True, dtype=np.float32) - np.square(mean)
        normed: npt.NDArray[np.float32] = (rows - mean) / np.sqrt(variance + np.float32(eps))
    return normed


class LayerNormVarianceOverflows(PlantedEngine):
    BUG = (
        "a middle shard normalises each input row with a float32 one-pass variance, E[x²] − E[x]², "
        "which is inf − inf = NaN for a finite row near ±3.4e38, and the NaN reaches its output"
    )
    PROPERTY = "§3 shape and range"
    MINIMAL = (prefill("a", tokens=(0,), rows="huge"),)
    ROLE = "middle"

    def prefill(self, request: PrefillRequest) -> StepResult:
        return self._normalise(request, self.inner.prefill(request))

    def decode(self, request: DecodeRequest) -> StepResult:
        return self._normalise(request, self.inner.decode(request))

    def _normalise(self, request: StepRequest, result: StepResult) -> StepResult:
        """The fake's answer, with the non-finite values of this engine's norm of the input
        where they arise: the rest of its arithmetic is the fake's."""
        output = result.output
        if request.bundle is None or not isinstance(output, BoundaryBundle) or not result.status.ok:
            return result
        normed = one_pass_layer_norm(request.bundle.tensors[0].to_array())
        broken = ~np.isfinite(normed)
        if not broken.any():
            return result
        residual = output.tensors[0].to_array()
        residual[broken] = normed[broken]
        return replace(result, output=replace(output, tensors=(EngineTensor.from_array(RESIDUAL_TENSOR, residual),)))


EXTREME_PLANTED: tuple[type[PlantedEngine], ...] = (LayerNormVarianceOverflows,)
