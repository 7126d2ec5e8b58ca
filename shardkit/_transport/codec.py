"""Between the contract §1 dataclasses and the ``shardkit.v1`` protobuf messages.

``*_to_pb`` encodes, ``*_from_pb`` decodes; a round trip gives back an equal value.
Two choices the wire forces, both written down in ``shard_engine.proto``:

- **Ints.** Every int travels as ``sint64`` (the kit sends -1 on purpose). Epochs and
  steps are the exception: the kit also sends ``2**63`` to check contract §2 rule 2, so each
  sits in a oneof with a ``*_decimal`` string member that carries a value outside int64
  exactly. Any other int outside int64 cannot be encoded: ``WireFormatError`` names the
  field (no engine could hold such a count, id or size anyway).
- **Recipes** travel as a JSON object, so their values must be JSON-serialisable (as
  they already must be for a trace file).

Decoding checks what the dataclasses check, plus the wire's own rules (an
``UNSPECIFIED`` enum, a missing required message, a non-decimal ``*_decimal`` or one of more
than ``MAX_DECIMAL_DIGITS`` digits, a ``recipe_json`` nested too deeply to parse), and
raises ``WireFormatError`` naming the message and field: from another process that is
garbage, not an engine's answer.

It also holds the rest of what both ends must agree on, so that each is written once: the
trailing metadata the server sends beside a status, and the exit codes by which a worker
process of ``--isolate`` tells the kit why it ended.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

from shardkit.contract import (
    BoundaryBundle,
    CacheResult,
    DecodeRequest,
    EngineCapabilities,
    EngineTensor,
    Fault,
    HealthResult,
    LoadRequest,
    LoadResult,
    MetricsResult,
    PrefillRequest,
    StatusCode,
    StepResult,
    StructuredStatus,
    TokenOutput,
)
from shardkit.errors import WireFormatError
from shardkit.proto import shard_engine_pb2 as pb

__all__ = [
    "EVICTED_KEY",
    "EXCEPTION_TYPE_KEY",
    "EXIT_ENGINE_RAISED",
    "EXIT_OUT_OF_MEMORY",
    "GRPC_OPTIONS",
    "INT64_MAX",
    "INT64_MIN",
    "MAX_DECIMAL_DIGITS",
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "WireFormatError",
    "bundle_from_pb",
    "bundle_to_pb",
    "capabilities_from_pb",
    "capabilities_to_pb",
    "fault_from_pb",
    "fault_to_pb",
    "get_counter",
    "grpc_options",
    "health_from_pb",
    "health_to_pb",
    "load_request_from_pb",
    "load_request_to_pb",
    "load_result_from_pb",
    "load_result_to_pb",
    "metrics_from_pb",
    "metrics_to_pb",
    "put_counter",
    "status_from_pb",
    "status_to_pb",
    "step_request_from_pb",
    "step_request_to_pb",
    "step_result_from_pb",
    "step_result_to_pb",
    "tensor_from_pb",
    "tensor_to_pb",
    "token_output_from_pb",
    "token_output_to_pb",
]

#: What ``Handshake`` carries; client and server must speak exactly the same one.
PROTOCOL_VERSION = "shardkit.v1/1"
#: The largest message either end sends or accepts (server and client alike). Boundary bundles
#: of real models outgrow gRPC's default of 4 MiB (a prefill of 4 096 rows of hidden 8 192 in
#: float32 is 128 MiB), but a peer must not make the other allocate without bound.
MAX_MESSAGE_BYTES = 256 * 2**20


def grpc_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Channel and server options limiting messages to ``max_message_bytes`` both ways."""
    return [("grpc.max_send_message_length", max_message_bytes), ("grpc.max_receive_message_length", max_message_bytes)]


#: Channel and server options on both ends (``grpc_options()`` at ``MAX_MESSAGE_BYTES``).
GRPC_OPTIONS: tuple[tuple[str, int], ...] = tuple(grpc_options())

#: Trailing metadata naming the type of the exception an engine raised (status ``INTERNAL``).
EXCEPTION_TYPE_KEY = "shardkit-exception-type"
#: Trailing metadata of a call naming an engine the server evicted (its value: the limit).
EVICTED_KEY = "shardkit-engine-evicted"
#: A worker's exit code when its engine raised (EX_SOFTWARE), and when it raised MemoryError.
EXIT_ENGINE_RAISED = 70
EXIT_OUT_OF_MEMORY = 71

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_DECIMAL = re.compile(r"-?[0-9]+")
#: The most digits a ``*_decimal`` may have: Python's default limit on converting text to an
#: int. Any epoch or step outside int64 needs 20; the kit sends 2**63, of 19.
MAX_DECIMAL_DIGITS = 4300

T = TypeVar("T")
StepRequest = PrefillRequest | DecodeRequest


# Typed Any: the generated stubs type enum fields by their own wrapper class.
_STATUS_TO_PB: Mapping[StatusCode, Any] = MappingProxyType(
    {code: pb.StatusCode.Value(f"STATUS_CODE_{code.name}") for code in StatusCode}
)
_STATUS_FROM_PB: Mapping[int, StatusCode] = MappingProxyType({number: code for code, number in _STATUS_TO_PB.items()})
_CACHE_TO_PB: Mapping[CacheResult, Any] = MappingProxyType(
    {cache: pb.CacheResult.Value(f"CACHE_RESULT_{cache.name}") for cache in CacheResult}
)
_CACHE_FROM_PB: Mapping[int, CacheResult] = MappingProxyType({number: cache for cache, number in _CACHE_TO_PB.items()})


def _decoded(owner: str, build: Callable[[], T]) -> T:
    """Build a dataclass from decoded fields; its own checks become a ``WireFormatError``."""
    try:
        return build()
    except (TypeError, ValueError) as error:
        if isinstance(error, WireFormatError):
            raise
        message = f"a {owner} message does not make a valid {owner}: {error}"
        raise WireFormatError(message) from error


def _int64(owner: str, name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not INT64_MIN <= value <= INT64_MAX:
        message = f"cannot encode {owner}.{name}={value!r}: the wire carries ints in [-2**63, 2**63) only"
        raise WireFormatError(message)
    return value


def _int64s(owner: str, name: str, values: tuple[int, ...]) -> list[int]:
    for index, value in enumerate(values):
        # Checked inline: naming the element (an f-string) per token cost more than the check.
        if not isinstance(value, int) or isinstance(value, bool) or not INT64_MIN <= value <= INT64_MAX:
            _int64(owner, f"{name}[{index}]", value)  # raises, naming the element
    return list(values)


def put_counter(message: Any, name: str, value: int) -> None:
    """Set an epoch or step: ``name`` if it fits in sint64, else ``name_decimal``."""
    if not isinstance(value, int) or isinstance(value, bool):
        text = f"cannot encode {type(message).__name__}.{name}={value!r}: not an int"
        raise WireFormatError(text)
    if INT64_MIN <= value <= INT64_MAX:
        setattr(message, name, value)
    else:
        setattr(message, f"{name}_decimal", str(value))


def get_counter(message: Any, name: str) -> int:
    """An epoch or step from its oneof ``name_value``; absent means 0."""
    which = message.WhichOneof(f"{name}_value")
    if which is None:
        return 0
    if which == name:
        return int(getattr(message, name))
    text = getattr(message, f"{name}_decimal")
    digits = len(text.removeprefix("-"))
    if digits > MAX_DECIMAL_DIGITS:
        problem = (
            f"{type(message).__name__}.{name}_decimal has {digits} digits; it may have at most "
            f"{MAX_DECIMAL_DIGITS} (a value outside int64 needs 20)"
        )
        raise WireFormatError(problem)
    if not _DECIMAL.fullmatch(text):
        problem = f"{type(message).__name__}.{name}_decimal={text!r} is not a decimal integer"
        raise WireFormatError(problem)
    try:
        return int(text)
    except ValueError as error:  # a lower limit set with sys.set_int_max_str_digits
        owner = type(message).__name__
        problem = f"{owner}.{name}_decimal has {digits} digits, more than this process converts: {error}"
        raise WireFormatError(problem) from None


def _required(message: Any, owner: str, name: str) -> Any:
    if not message.HasField(name):
        problem = f"a {owner} message lacks its {name!r} field"
        raise WireFormatError(problem)
    return getattr(message, name)


# --- statuses ---------------------------------------------------------------------------------


def status_to_pb(status: StructuredStatus) -> pb.StructuredStatus:
    return pb.StructuredStatus(code=_STATUS_TO_PB[status.code], message=status.message, retryable=status.retryable)


def status_from_pb(message: pb.StructuredStatus) -> StructuredStatus:
    code = _STATUS_FROM_PB.get(message.code)
    if code is None:
        problem = f"StructuredStatus.code={message.code} is not a status code (UNSPECIFIED, or unknown to this client)"
        raise WireFormatError(problem)
    return StructuredStatus(code, message.message, message.retryable)


# --- loading and capabilities -----------------------------------------------------------------


def load_request_to_pb(request: LoadRequest) -> pb.LoadRequest:
    try:
        recipe = json.dumps(dict(request.recipe), ensure_ascii=False, allow_nan=False) if request.recipe else ""
    except (TypeError, ValueError) as error:
        message = f"cannot encode LoadRequest.recipe={dict(request.recipe)!r}: it must be JSON-serialisable ({error})"
        raise WireFormatError(message) from error
    return pb.LoadRequest(
        model_id=request.model_id,
        shard_start=_int64("LoadRequest", "shard_start", request.shard_start),
        shard_end=_int64("LoadRequest", "shard_end", request.shard_end),
        total_layers=_int64("LoadRequest", "total_layers", request.total_layers),
        recipe_json=recipe,
    )


def load_request_from_pb(message: pb.LoadRequest) -> LoadRequest:
    recipe: object = {}
    if message.recipe_json:
        try:
            recipe = json.loads(message.recipe_json)
        except ValueError as error:
            problem = f"LoadRequest.recipe_json is not JSON: {error}"
            raise WireFormatError(problem) from error
        except RecursionError:
            problem = (
                f"LoadRequest.recipe_json ({len(message.recipe_json)} characters) nests its arrays or objects "
                "too deep to decode; a recipe is a JSON object of settings, a few levels deep"
            )
            raise WireFormatError(problem) from None
    if not isinstance(recipe, Mapping):
        problem = f"LoadRequest.recipe_json must hold a JSON object, got {message.recipe_json!r}"
        raise WireFormatError(problem)
    return _decoded(
        "LoadRequest",
        lambda: LoadRequest(message.model_id, message.shard_start, message.shard_end, message.total_layers, recipe),
    )


def load_result_to_pb(result: LoadResult) -> pb.LoadResult:
    return pb.LoadResult(status=status_to_pb(result.status), architecture=result.architecture)


def load_result_from_pb(message: pb.LoadResult) -> LoadResult:
    status = status_from_pb(_required(message, "LoadResult", "status"))
    return _decoded("LoadResult", lambda: LoadResult(status, message.architecture))


_CAPABILITY_INTS = (
    "total_layers",
    "shard_start",
    "shard_end",
    "hidden_size",
    "vocab_size",
    "max_sessions",
    "max_kv_tokens",
)


def capabilities_to_pb(caps: EngineCapabilities) -> pb.EngineCapabilities:
    ints = {name: _int64("EngineCapabilities", name, getattr(caps, name)) for name in _CAPABILITY_INTS}
    return pb.EngineCapabilities(
        architecture=caps.architecture,
        evidence_class=caps.evidence_class,
        dtype=caps.dtype,
        supported_faults=sorted(caps.supported_faults),
        tolerance=caps.tolerance,
        concurrent_calls=caps.concurrent_calls,
        relative_tolerance=caps.relative_tolerance,
        margin_tolerance=caps.margin_tolerance,
        **ints,
    )


def capabilities_from_pb(message: pb.EngineCapabilities) -> EngineCapabilities:
    ints = {name: int(getattr(message, name)) for name in _CAPABILITY_INTS}
    return _decoded(
        "EngineCapabilities",
        lambda: EngineCapabilities(
            architecture=message.architecture,
            evidence_class=message.evidence_class,  # type: ignore[arg-type]  # checked by the dataclass
            dtype=message.dtype,
            supported_faults=frozenset(message.supported_faults),
            tolerance=message.tolerance,
            concurrent_calls=message.concurrent_calls,
            # Unset by a worker written before the fields: the dtype's default, and the tolerance.
            relative_tolerance=message.relative_tolerance if message.HasField("relative_tolerance") else None,
            margin_tolerance=message.margin_tolerance if message.HasField("margin_tolerance") else None,
            **ints,
        ),
    )


# --- tensors, bundles and step inputs/outputs --------------------------------------------------


def tensor_to_pb(tensor: EngineTensor) -> pb.EngineTensor:
    for index, extent in enumerate(tensor.shape):
        if extent > 2**64 - 1:
            message = f"cannot encode EngineTensor.shape[{index}]={extent}: the wire carries extents below 2**64"
            raise WireFormatError(message)
    return pb.EngineTensor(name=tensor.name, dtype=tensor.dtype, shape=list(tensor.shape), data=tensor.data)


def tensor_from_pb(message: pb.EngineTensor) -> EngineTensor:
    return _decoded(
        "EngineTensor", lambda: EngineTensor(message.name, message.dtype, tuple(message.shape), message.data)
    )


def bundle_to_pb(bundle: BoundaryBundle) -> pb.BoundaryBundle:
    message = pb.BoundaryBundle(
        session_id=bundle.session_id,
        boundary_point=bundle.boundary_point,
        architecture=bundle.architecture,
        tensors=[tensor_to_pb(tensor) for tensor in bundle.tensors],
    )
    put_counter(message, "epoch", bundle.epoch)
    put_counter(message, "step", bundle.step)
    if bundle.token_id_sideband is not None:
        ids = _int64s("BoundaryBundle", "token_id_sideband", bundle.token_id_sideband)
        message.token_id_sideband.CopyFrom(pb.TokenIds(ids=ids))
    return message


def bundle_from_pb(message: pb.BoundaryBundle) -> BoundaryBundle:
    sideband = tuple(message.token_id_sideband.ids) if message.HasField("token_id_sideband") else None
    epoch, step = get_counter(message, "epoch"), get_counter(message, "step")
    tensors = tuple(tensor_from_pb(tensor) for tensor in message.tensors)
    return _decoded(
        "BoundaryBundle",
        lambda: BoundaryBundle(
            message.session_id, epoch, step, message.boundary_point, message.architecture, tensors, sideband
        ),
    )


def token_output_to_pb(output: TokenOutput) -> pb.TokenOutput:
    message = pb.TokenOutput(token_id=_int64("TokenOutput", "token_id", output.token_id))
    if output.margin is not None:
        message.margin = output.margin
    return message


def token_output_from_pb(message: pb.TokenOutput) -> TokenOutput:
    margin = message.margin if message.HasField("margin") else None
    return _decoded("TokenOutput", lambda: TokenOutput(message.token_id, margin))


def step_request_to_pb(request: StepRequest) -> pb.StepRequest:
    """A prefill or a decode request: the RPC it is sent with says which."""
    owner = type(request).__name__
    message = pb.StepRequest(session_id=request.session_id)
    put_counter(message, "epoch", request.epoch)
    put_counter(message, "step", request.step)
    if request.token_ids is not None:
        message.token_ids.CopyFrom(pb.TokenIds(ids=_int64s(owner, "token_ids", request.token_ids)))
    else:
        assert request.bundle is not None  # the dataclass holds exactly one of the two
        message.bundle.CopyFrom(bundle_to_pb(request.bundle))
    return message


def step_request_from_pb(message: pb.StepRequest, kind: type[T]) -> T:
    """``kind`` is ``PrefillRequest`` or ``DecodeRequest``."""
    owner = kind.__name__
    epoch, step = get_counter(message, "epoch"), get_counter(message, "step")
    which = message.WhichOneof("input")
    if which is None:
        problem = f"a {owner} message holds neither token_ids nor a bundle; it needs exactly one"
        raise WireFormatError(problem)
    token_ids = tuple(message.token_ids.ids) if which == "token_ids" else None
    bundle = bundle_from_pb(message.bundle) if which == "bundle" else None
    return _decoded(owner, lambda: kind(message.session_id, epoch, step, token_ids=token_ids, bundle=bundle))  # type: ignore[call-arg]


def step_result_to_pb(result: StepResult) -> pb.StepResult:
    message = pb.StepResult(status=status_to_pb(result.status), cache=_CACHE_TO_PB[result.cache])
    if isinstance(result.output, BoundaryBundle):
        message.bundle.CopyFrom(bundle_to_pb(result.output))
    elif isinstance(result.output, TokenOutput):
        message.token.CopyFrom(token_output_to_pb(result.output))
    return message


def step_result_from_pb(message: pb.StepResult) -> StepResult:
    status = status_from_pb(_required(message, "StepResult", "status"))
    cache = _CACHE_FROM_PB.get(message.cache)
    if cache is None:
        problem = f"StepResult.cache={message.cache} is not HIT or MISS (UNSPECIFIED, or unknown to this client)"
        raise WireFormatError(problem)
    which = message.WhichOneof("output")
    output: BoundaryBundle | TokenOutput | None = None
    if which == "bundle":
        output = bundle_from_pb(message.bundle)
    elif which == "token":
        output = token_output_from_pb(message.token)
    return _decoded("StepResult", lambda: StepResult(status, cache, output))


# --- health, metrics and faults ------------------------------------------------------------------


def health_to_pb(result: HealthResult) -> pb.HealthResult:
    return pb.HealthResult(status=status_to_pb(result.status), serving=result.serving)


def health_from_pb(message: pb.HealthResult) -> HealthResult:
    status = status_from_pb(_required(message, "HealthResult", "status"))
    return _decoded("HealthResult", lambda: HealthResult(status, message.serving))


#: ``MetricsResult``'s counters, in its order: the dataclass is their one list.
_METRICS = tuple(field.name for field in dataclasses.fields(MetricsResult))


def metrics_to_pb(result: MetricsResult) -> pb.MetricsResult:
    return pb.MetricsResult(**{name: _int64("MetricsResult", name, getattr(result, name)) for name in _METRICS})


def metrics_from_pb(message: pb.MetricsResult) -> MetricsResult:
    return _decoded("MetricsResult", lambda: MetricsResult(*(int(getattr(message, name)) for name in _METRICS)))


def fault_to_pb(fault: Fault) -> pb.Fault:
    return pb.Fault(kind=fault.kind, value=fault.value)


def fault_from_pb(message: pb.Fault) -> Fault:
    return _decoded("Fault", lambda: Fault(message.kind, message.value))  # type: ignore[arg-type]  # checked by Fault
