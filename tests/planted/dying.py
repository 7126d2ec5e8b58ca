"""The planted engines that kill their own process (only ever run isolated), for the
self-tests: ``tests.planted.dying:Name`` targets. They live in ``shardkit._planted.dying``."""

from __future__ import annotations

from shardkit._planted.dying import ALLOCATION_CAP_BYTES as ALLOCATION_CAP_BYTES
from shardkit._planted.dying import DYING as DYING
from shardkit._planted.dying import AbortsOnRetriedPrefill as AbortsOnRetriedPrefill
from shardkit._planted.dying import AllocatesWithoutBoundAfterRelease as AllocatesWithoutBoundAfterRelease
from shardkit._planted.dying import DyingEngine as DyingEngine
from shardkit._planted.dying import ExitsOnLoad as ExitsOnLoad
from shardkit._planted.dying import ExitsWhenThirdSessionOpens as ExitsWhenThirdSessionOpens
from shardkit._planted.dying import HangsOnSecondDecode as HangsOnSecondDecode
from shardkit._planted.dying import SegfaultsOnDecodeAfterCancel as SegfaultsOnDecodeAfterCancel

__all__ = [
    "ALLOCATION_CAP_BYTES",
    "DYING",
    "AbortsOnRetriedPrefill",
    "AllocatesWithoutBoundAfterRelease",
    "DyingEngine",
    "ExitsOnLoad",
    "ExitsWhenThirdSessionOpens",
    "HangsOnSecondDecode",
    "SegfaultsOnDecodeAfterCancel",
]
