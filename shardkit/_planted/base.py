"""What every planted-bug engine is built on: a zero-argument engine that delegates to a
fresh fake, the class attributes that state its bug, and the check that a violation names
the property it breaks. Its own module, so that every module of planted engines imports it
and ``shardkit._planted`` lists them all."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import ClassVar

from shardkit import DecodeRequest, FakeShardEngine, Fault, PrefillRequest, StepResult, StructuredStatus, TokenOutput
from shardkit import DelegatingEngine as PublicDelegatingEngine
from shardkit._planted.minimal import Step

__all__ = ["DelegatingEngine", "PlantedEngine", "StepRequest", "names_its_property", "shift_token"]

StepRequest = PrefillRequest | DecodeRequest


class DelegatingEngine(PublicDelegatingEngine[FakeShardEngine]):
    """Delegates contract v1 to a fresh fake (and nothing else: no ``inject_fault``, which
    ``shardkit.DelegatingEngine`` does not forward), as a zero-argument target."""

    def __init__(self) -> None:
        super().__init__(FakeShardEngine())


class PlantedEngine(DelegatingEngine):
    """Delegates everything, faults included, to a fresh fake; subclasses override one behaviour."""

    BUG: ClassVar[str]
    PROPERTY: ClassVar[str]  # what the kit's violation must name (a prefix of it)
    #: Other properties through which the same bug may surface first, depending on the sequence.
    ALSO: ClassVar[tuple[str, ...]] = ()
    #: The minimal failing sequence, one ``Step`` each; ``len(MINIMAL)`` is the minimum length.
    MINIMAL: ClassVar[tuple[Step, ...]]
    #: The minimum of a property of ALSO through which the bug shows at another length.
    ALSO_MINIMUM: ClassVar[Mapping[str, int]] = MappingProxyType({})
    ROLE: ClassVar[str] = "full"
    #: The faults a run needs to find it (``--faults``); its MINIMAL's trace enables these.
    FAULTS: ClassVar[str] = "all"
    CONTRACT_CHECK: ClassVar[str | None] = None  # the static check that catches it, if any
    #: A bug that needs dozens of steps: the shrunk sequence must come within one step of MINIMAL.
    LATE: ClassVar[bool] = False

    @classmethod
    def minimum_for(cls, property_name: str | None) -> int:
        """The length of the shortest failure that shows the bug through ``property_name``."""
        lengths = (length for name, length in cls.ALSO_MINIMUM.items() if (property_name or "").startswith(name))
        return next(lengths, len(cls.MINIMAL))

    def inject_fault(self, fault: Fault) -> StructuredStatus:
        return self.inner.inject_fault(fault)

    def _shift(self, result: StepResult) -> StepResult:
        """``result`` with the next token id in place of its own: a wrong answer for any
        vocabulary of two or more, whose size is the engine's own (its capabilities)."""
        return shift_token(result, self.inner.capabilities().vocab_size)


def shift_token(result: StepResult, vocab_size: int) -> StepResult:
    if isinstance(result.output, TokenOutput):
        token = (result.output.token_id + 1) % vocab_size
        return replace(result, output=TokenOutput(token, result.output.margin))
    return result


def names_its_property(engine: type[PlantedEngine], property_name: str) -> bool:
    return any(property_name.startswith(expected) for expected in (engine.PROPERTY, *engine.ALSO))
