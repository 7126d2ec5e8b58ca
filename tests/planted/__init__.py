"""The planted-bug engines, for the self-tests: ``tests.planted:Name`` targets.

They live in ``shardkit._planted`` (so ``shardkit bench`` finds them in an installed
package); this module re-exports every one under its old name."""

from __future__ import annotations

from shardkit._planted import PLANTED as PLANTED
from shardkit._planted import AbortedIdStaysInTheTable as AbortedIdStaysInTheTable
from shardkit._planted import AbortOfAFinishedRequestKeepsItsBlocks as AbortOfAFinishedRequestKeepsItsBlocks
from shardkit._planted import CancelAfterTheFinalChunkLeaksAToken as CancelAfterTheFinalChunkLeaksAToken
from shardkit._planted import CancelLeaksKvTokens as CancelLeaksKvTokens
from shardkit._planted import CancelledSessionStillServes as CancelledSessionStillServes
from shardkit._planted import CancelMatchesIdPrefix as CancelMatchesIdPrefix
from shardkit._planted import CrashesOnCancelOfNewerEpoch as CrashesOnCancelOfNewerEpoch
from shardkit._planted import CropToZeroKeepsTheCache as CropToZeroKeepsTheCache
from shardkit._planted import DecodeFastPathCorruptsAfter20 as DecodeFastPathCorruptsAfter20
from shardkit._planted import DecodeOfUnknownSessionServed as DecodeOfUnknownSessionServed
from shardkit._planted import DecodeWindowsTheLast20Tokens as DecodeWindowsTheLast20Tokens
from shardkit._planted import DelayedStepTimesOut as DelayedStepTimesOut
from shardkit._planted import DelegatingEngine as DelegatingEngine
from shardkit._planted import DoubleFreeInflatesTheFreeCount as DoubleFreeInflatesTheFreeCount
from shardkit._planted import EpochStoredIn32Bits as EpochStoredIn32Bits
from shardkit._planted import EvictsLiveSessions as EvictsLiveSessions
from shardkit._planted import FailedCallsNotCounted as FailedCallsNotCounted
from shardkit._planted import FullPromptMatchAnswersStaleLogits as FullPromptMatchAnswersStaleLogits
from shardkit._planted import KvBlockBoundaryMiscounted as KvBlockBoundaryMiscounted
from shardkit._planted import LayerNormVarianceOverflows as LayerNormVarianceOverflows
from shardkit._planted import MemoryPressureIgnored as MemoryPressureIgnored
from shardkit._planted import MiddleDropsSideband as MiddleDropsSideband
from shardkit._planted import OutputDependsOnChunking as OutputDependsOnChunking
from shardkit._planted import PlantedEngine as PlantedEngine
from shardkit._planted import PrefixCacheKeyedOnFirst3Tokens as PrefixCacheKeyedOnFirst3Tokens
from shardkit._planted import PrefixCacheKeyedOnFirstToken as PrefixCacheKeyedOnFirstToken
from shardkit._planted import PrefixCacheRestoresTheLastEntry as PrefixCacheRestoresTheLastEntry
from shardkit._planted import PressureLeaksReleasedTokens as PressureLeaksReleasedTokens
from shardkit._planted import RefusedPrefillLeavesTokens as RefusedPrefillLeavesTokens
from shardkit._planted import RefusedPrefillPoisonsSession as RefusedPrefillPoisonsSession
from shardkit._planted import ReleaseAfterCancelFreesTwice as ReleaseAfterCancelFreesTwice
from shardkit._planted import ReleaseLeaksKvTokens as ReleaseLeaksKvTokens
from shardkit._planted import RequestIdWrapsAt32 as RequestIdWrapsAt32
from shardkit._planted import ResetKeepsTheOldLength as ResetKeepsTheOldLength
from shardkit._planted import RestartKeepsCancelledFlag as RestartKeepsCancelledFlag
from shardkit._planted import RestartKeepsOldEpochCache as RestartKeepsOldEpochCache
from shardkit._planted import RestartReuseDropsAReusedToken as RestartReuseDropsAReusedToken
from shardkit._planted import RetryAppliedTwice as RetryAppliedTwice
from shardkit._planted import ReusedSlotKeepsTheOldConversation as ReusedSlotKeepsTheOldConversation
from shardkit._planted import SessionsKeyedOnIdPrefix as SessionsKeyedOnIdPrefix
from shardkit._planted import SessionStateBleeds as SessionStateBleeds
from shardkit._planted import SessionSurvivesCrash as SessionSurvivesCrash
from shardkit._planted import SharedPrefixFreedWithItsFirstOwner as SharedPrefixFreedWithItsFirstOwner
from shardkit._planted import StaleAbortHitsTheReusedId as StaleAbortHitsTheReusedId
from shardkit._planted import StaleEpochAccepted as StaleEpochAccepted
from shardkit._planted import StepRequest as StepRequest
from shardkit._planted import UnifiedCacheKeyedOnPosition as UnifiedCacheKeyedOnPosition
from shardkit._planted import names_its_property as names_its_property

__all__ = [
    "PLANTED",
    "AbortOfAFinishedRequestKeepsItsBlocks",
    "AbortedIdStaysInTheTable",
    "CancelAfterTheFinalChunkLeaksAToken",
    "CancelLeaksKvTokens",
    "CancelMatchesIdPrefix",
    "CancelledSessionStillServes",
    "CrashesOnCancelOfNewerEpoch",
    "CropToZeroKeepsTheCache",
    "DecodeFastPathCorruptsAfter20",
    "DecodeOfUnknownSessionServed",
    "DecodeWindowsTheLast20Tokens",
    "DelayedStepTimesOut",
    "DelegatingEngine",
    "DoubleFreeInflatesTheFreeCount",
    "EpochStoredIn32Bits",
    "EvictsLiveSessions",
    "FailedCallsNotCounted",
    "FullPromptMatchAnswersStaleLogits",
    "KvBlockBoundaryMiscounted",
    "MemoryPressureIgnored",
    "MiddleDropsSideband",
    "OutputDependsOnChunking",
    "PlantedEngine",
    "PrefixCacheKeyedOnFirst3Tokens",
    "PrefixCacheKeyedOnFirstToken",
    "PrefixCacheRestoresTheLastEntry",
    "PressureLeaksReleasedTokens",
    "RefusedPrefillLeavesTokens",
    "RefusedPrefillPoisonsSession",
    "ReleaseAfterCancelFreesTwice",
    "ReleaseLeaksKvTokens",
    "RequestIdWrapsAt32",
    "ResetKeepsTheOldLength",
    "RestartKeepsCancelledFlag",
    "RestartKeepsOldEpochCache",
    "RestartReuseDropsAReusedToken",
    "RetryAppliedTwice",
    "ReusedSlotKeepsTheOldConversation",
    "SessionStateBleeds",
    "SessionSurvivesCrash",
    "SessionsKeyedOnIdPrefix",
    "SharedPrefixFreedWithItsFirstOwner",
    "StaleAbortHitsTheReusedId",
    "StaleEpochAccepted",
    "StepRequest",
    "UnifiedCacheKeyedOnPosition",
    "names_its_property",
]
