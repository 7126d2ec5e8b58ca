"""``DelegatingEngine``: a wrapper around another engine that overrides only what it changes.

It forwards the eight contract v1 operations (``load``, ``capabilities``, ``prefill``,
``decode``, ``cancel``, ``release``, ``health``, ``metrics``) to ``self.inner``, so a
wrapper — a fault injector, a planted bug, an engine that adds an operation — states its
difference and nothing else::

    from dataclasses import replace

    from shardkit import DelegatingEngine, EngineCapabilities, FakeShardEngine

    class NoNativeFaults(DelegatingEngine[FakeShardEngine]):
        \"\"\"The fake, advertising no native fault: the kit injects them at its boundary.\"\"\"

        def __init__(self) -> None:
            super().__init__(FakeShardEngine())

        def capabilities(self) -> EngineCapabilities:
            return replace(self.inner.capabilities(), supported_faults=frozenset())

**Faults are not forwarded.** ``inject_fault`` is not one of the eight operations, and a
``DelegatingEngine`` does not have it, so it is not ``FaultInjectable``: the kit injects
``delay``, ``malformed_output`` and ``crash`` at the wrapper's boundary and does not inject
``memory_pressure`` (which needs the engine's own accounting), whatever the inner engine's
``supported_faults`` say. That is the safe default: a wrapper that makes calls of its own
to the inner engine (replaying steps, probing metrics) would otherwise let those calls
spend a fault the kit armed for its next step. A wrapper whose faults do mean what they
say forwards them itself::

    def inject_fault(self, fault: Fault) -> StructuredStatus:
        return self.inner.inject_fault(fault)

Nor are operations a backend adds beyond contract v1: a wrapper of such a backend defines
them (it knows what they mean for its changes).
"""

from __future__ import annotations

from typing import Generic, TypeVar

from shardkit._public import settle
from shardkit.contract import (
    DecodeRequest,
    EngineCapabilities,
    HealthResult,
    LoadRequest,
    LoadResult,
    MetricsResult,
    PrefillRequest,
    ShardEngine,
    StepResult,
    StructuredStatus,
)

__all__ = ["DelegatingEngine"]

InnerT = TypeVar("InnerT", bound=ShardEngine)


class DelegatingEngine(ShardEngine, Generic[InnerT]):
    """Forwards contract v1 to ``inner`` (and nothing else: no ``inject_fault``); override
    the operations a wrapper changes. ``InnerT`` is the wrapped engine's type, so
    ``DelegatingEngine[FakeShardEngine]`` may call the fake's own methods on ``self.inner``."""

    def __init__(self, inner: InnerT) -> None:
        if not isinstance(inner, ShardEngine):
            message = (
                f"{type(self).__name__} wraps a ShardEngine instance, got {type(inner).__name__}: {inner!r}; "
                "pass an engine (e.g. FakeShardEngine()), not its class or factory"
            )
            raise TypeError(message)
        self.inner: InnerT = inner

    def load(self, request: LoadRequest) -> LoadResult:
        return self.inner.load(request)

    def capabilities(self) -> EngineCapabilities:
        return self.inner.capabilities()

    def prefill(self, request: PrefillRequest) -> StepResult:
        return self.inner.prefill(request)

    def decode(self, request: DecodeRequest) -> StepResult:
        return self.inner.decode(request)

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        return self.inner.cancel(session_id, epoch)

    def release(self, session_id: str) -> StructuredStatus:
        return self.inner.release(session_id)

    def health(self) -> HealthResult:
        return self.inner.health()

    def metrics(self) -> MetricsResult:
        return self.inner.metrics()


settle(__name__, globals())
