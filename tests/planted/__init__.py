"""The planted-bug engines, for the self-tests: ``tests.planted:Name`` targets.

They live in ``shardkit._planted`` (so ``shardkit bench`` finds them in an installed
package); this module re-exports every one under its old name."""

from __future__ import annotations

from shardkit._planted import PLANTED as PLANTED
from shardkit._planted import CancelLeaksKvTokens as CancelLeaksKvTokens
from shardkit._planted import CancelledSessionStillServes as CancelledSessionStillServes
from shardkit._planted import CrashesOnCancelOfNewerEpoch as CrashesOnCancelOfNewerEpoch
from shardkit._planted import DecodeOfUnknownSessionServed as DecodeOfUnknownSessionServed
from shardkit._planted import DelayedStepTimesOut as DelayedStepTimesOut
from shardkit._planted import DelegatingEngine as DelegatingEngine
from shardkit._planted import EvictsLiveSessions as EvictsLiveSessions
from shardkit._planted import FailedCallsNotCounted as FailedCallsNotCounted
from shardkit._planted import MemoryPressureIgnored as MemoryPressureIgnored
from shardkit._planted import MiddleDropsSideband as MiddleDropsSideband
from shardkit._planted import OutputDependsOnChunking as OutputDependsOnChunking
from shardkit._planted import PlantedEngine as PlantedEngine
from shardkit._planted import PrefixCacheKeyedOnFirstToken as PrefixCacheKeyedOnFirstToken
from shardkit._planted import RefusedPrefillLeavesTokens as RefusedPrefillLeavesTokens
from shardkit._planted import RefusedPrefillPoisonsSession as RefusedPrefillPoisonsSession
from shardkit._planted import ReleaseLeaksKvTokens as ReleaseLeaksKvTokens
from shardkit._planted import RequestIdWrapsAt32 as RequestIdWrapsAt32
from shardkit._planted import RestartKeepsOldEpochCache as RestartKeepsOldEpochCache
from shardkit._planted import RetryAppliedTwice as RetryAppliedTwice
from shardkit._planted import SessionStateBleeds as SessionStateBleeds
from shardkit._planted import StaleEpochAccepted as StaleEpochAccepted
from shardkit._planted import StepRequest as StepRequest
from shardkit._planted import names_its_property as names_its_property

__all__ = [
    "PLANTED",
    "CancelLeaksKvTokens",
    "CancelledSessionStillServes",
    "CrashesOnCancelOfNewerEpoch",
    "DecodeOfUnknownSessionServed",
    "DelayedStepTimesOut",
    "DelegatingEngine",
    "EvictsLiveSessions",
    "FailedCallsNotCounted",
    "MemoryPressureIgnored",
    "MiddleDropsSideband",
    "OutputDependsOnChunking",
    "PlantedEngine",
    "PrefixCacheKeyedOnFirstToken",
    "RefusedPrefillLeavesTokens",
    "RefusedPrefillPoisonsSession",
    "ReleaseLeaksKvTokens",
    "RequestIdWrapsAt32",
    "RestartKeepsOldEpochCache",
    "RetryAppliedTwice",
    "SessionStateBleeds",
    "StaleEpochAccepted",
    "StepRequest",
    "names_its_property",
]
