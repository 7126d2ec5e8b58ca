"""Concrete steps: what the kit sends, in a form that prints, serialises and replays.

An ``Action`` holds plain values only (ids, epochs, steps, token ids, the name
of a malformation). The request it stands for is rebuilt from those values and
the engine's capabilities by ``build_request``: inputs for middle and tail
shards are bundles whose rows the kit synthesises from token ids, so the kit
knows every history, and a trace never needs to store tensor bytes.

A row is named by a **row code**: a token id (>= 0) names the token's ordinary row, and a
negative code (``row_code``) names the same token's row of one of the ``ROW_KINDS`` at the
edges of the dtype's finite range (near its largest value, subnormal, signed zeros, or all of
them side by side). A step's ``tokens`` and a history hold row codes; the bundle's sideband
holds the token ids alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import numpy as np

from shardkit._core.model import SessionState, StepRequest
from shardkit._dtypes import float_info, numpy_dtype
from shardkit._public import settle
from shardkit.contract import (
    EPOCH_STEP_LIMIT,
    OUTPUT_BOUNDARY_POINT,
    RESIDUAL_TENSOR,
    BoundaryBundle,
    DecodeRequest,
    EngineCapabilities,
    EngineTensor,
    PrefillRequest,
)

__all__ = [
    "BEFORE_LOAD_CALLS",
    "BUNDLE_MALFORMATIONS",
    "COMMON_MALFORMATIONS",
    "PARALLEL_OP",
    "ROW_KINDS",
    "TOKEN_MALFORMATIONS",
    "Action",
    "build_request",
    "malformations_for",
    "phase_action",
    "row_code",
    "row_codes_of",
    "row_kinds_text",
    "split_row_code",
    "step_note",
    "synthetic_bundle",
    "synthetic_rows",
]

#: The calls a step may make on an engine that was never loaded (each must answer UNAVAILABLE).
BEFORE_LOAD_CALLS = ("prefill", "decode", "cancel", "release", "health")

STEP_OPS = ("prefill", "decode")
#: The operation of a parallel phase held as one step (``phase_action``).
PARALLEL_OP = "parallel"
SHOWN_TOKENS = 8
#: Values that make a residual non-finite; indexable by a small integer.
NON_FINITE_VALUES = (float("nan"), float("inf"), float("-inf"))


@dataclass(frozen=True)
class Action:
    """One step as sent: an operation and its JSON-able arguments."""

    op: str
    args: Mapping[str, Any] = field(default_factory=dict)
    note: str = ""

    def describe(self) -> str:
        if self.op == PARALLEL_OP:
            lanes = " | ".join(
                f"L{lane}: {'; '.join(action.describe() for action in actions)}"
                for lane, actions in enumerate(self.args["lanes"])
            )
            return f"{PARALLEL_OP}({lanes})"
        shown = ", ".join(f"{key}={_show(value)}" for key, value in _shown_args(self.args).items() if value is not None)
        note = f"  # {self.note}" if self.note else ""
        return f"{self.op}({shown}){note}"

    def to_json(self) -> dict[str, Any]:
        if self.op == PARALLEL_OP:
            lanes = [[action.to_json() for action in actions] for actions in self.args["lanes"]]
            return {"op": self.op, "args": {"lanes": lanes}, "note": self.note}
        args = {key: list(value) if isinstance(value, tuple) else value for key, value in self.args.items()}
        return {"op": self.op, "args": args, "note": self.note}


def phase_action(lanes: Sequence[Sequence[Action]]) -> Action:
    """A parallel phase as one step: its lanes, each a list of steps sent one after another,
    the lanes at the same time (``shardkit._parallel.phase`` runs it)."""
    return Action(PARALLEL_OP, {"lanes": tuple(tuple(lane) for lane in lanes)})


def _shown_args(args: Mapping[str, Any]) -> Mapping[str, Any]:
    """The arguments as a step prints them: row codes as their token ids, and what the rows
    hold beside them (``rows='huge'``) when some are not ordinary."""
    tokens = args.get("tokens")
    if not isinstance(tokens, tuple) or not tokens or min(tokens) >= 0:
        return args
    split = [split_row_code(code) for code in tokens]
    kinds = [ROW_KINDS[kind] for _, kind in split]
    rows: object = kinds[0] if len(set(kinds)) == 1 else tuple(kinds)
    shown: dict[str, Any] = {}
    for key, value in args.items():
        if key == "tokens":
            shown.update(tokens=tuple(token for token, _ in split), rows=rows)
        else:
            shown[key] = value
    return shown


def _show(value: object) -> str:
    if isinstance(value, tuple):
        shown = ", ".join(str(item) for item in value[:SHOWN_TOKENS])
        more = f", … {len(value)} in all" if len(value) > SHOWN_TOKENS else ""
        return f"[{shown}{more}]"
    return repr(value)


def step_action(
    op: str,
    session: str,
    epoch: int,
    step: int,
    tokens: tuple[int, ...],
    malformed: str | None = None,
    note: str = "",
) -> Action:
    args = {"session": session, "epoch": epoch, "step": step, "tokens": tokens, "malformed": malformed}
    return Action(op, args, note)


def step_note(action: Action, session: SessionState | None) -> str:
    """What is unusual about ``action`` for the session it meets ("stale epoch", "resent", …),
    or "" for an ordinary step. Derived as the step runs, never when it was drawn, so a
    shrunk or hand-edited sequence never carries the note of a situation that is gone.
    Operations it does not know (faults, probes, a backend's own) keep their note."""
    args = action.args
    if action.op == "cancel":
        epoch = int(args["epoch"])
        if args["session"] == "":
            return "empty session id"
        if session is None:
            return "unknown session"
        return "stale epoch" if epoch < session.epoch else "epoch ahead" if epoch > session.epoch else ""
    if action.op not in STEP_OPS:
        return action.note
    if args.get("malformed") is not None:
        return ""  # the malformation is shown among the arguments
    epoch, step = int(args["epoch"]), int(args["step"])
    opens = action.op == "prefill" and step == 0
    if session is None:
        return ("opens at a higher epoch" if epoch > 0 else "") if opens else "unknown session"
    if epoch < session.epoch:
        return "stale epoch"
    if epoch > session.epoch:
        return "epoch bump" if opens else "epoch ahead"
    if session.cancelled:
        return "cancelled session"
    if step == session.next_step:
        return ""
    last = session.last_request
    if step == session.next_step - 1 and last is not None and _same_input(action, last):
        return "resent"
    return "out of order"


def _same_input(action: Action, last: StepRequest) -> bool:
    """Whether ``action`` repeats ``last`` (a bundle's rows are those of the action's row codes)."""
    if (action.op == "prefill") != isinstance(last, PrefillRequest):
        return False
    codes = tuple(action.args["tokens"])
    if last.token_ids is not None:
        return last.token_ids == codes
    if last.bundle is None or len(last.bundle.tensors) != 1:
        return False
    tensor = last.bundle.tensors[0]
    if len(tensor.shape) != 2 or tensor.shape[0] != len(codes):
        return False
    return tensor.data == _rows_data(tensor.shape[1], tensor.dtype, codes)


#: What the rows of a middle's or tail's input hold, by kind. Kind 0 is the ordinary row
#: (values in [-1, 1]); the others sit at the edges of the dtype's finite range, every value
#: finite and representable in the dtype, so a bundle of them is legal input (contract §2
#: rule 2 refuses non-finite values only) and the engine must serve it.
ROW_KINDS = ("ordinary", "huge", "subnormal", "zero", "mixed")
_EXTREME_KINDS = len(ROW_KINDS) - 1
#: A "huge" value's magnitude, as a fraction of the dtype's largest finite value: float32's
#: ±2.9e38 to ±3.0e38. Below the largest, so that a layer that adds a bounded update to the
#: residual stream (every pre-norm transformer) still has a representable answer.
HUGE_FRACTIONS = (0.85, 0.88)


def row_code(token: int, kind: int) -> int:
    """The row code of ``token``'s row of kind ``ROW_KINDS[kind]``: the token id itself for
    the ordinary row, a negative number for the others (``split_row_code`` inverts it)."""
    if not 0 <= kind <= _EXTREME_KINDS:
        message = f"row kind {kind} is not one of 0..{_EXTREME_KINDS} ({', '.join(ROW_KINDS)})"
        raise ValueError(message)
    return token if kind == 0 or token < 0 else -(token * _EXTREME_KINDS + kind)


def split_row_code(code: int) -> tuple[int, int]:
    """(token id, kind) of a row code."""
    if code >= 0:
        return code, 0
    rest = -code - 1
    return rest // _EXTREME_KINDS, rest % _EXTREME_KINDS + 1


def row_kinds_text(codes: Sequence[int], dtype: str = "float32") -> str:
    """What the extreme rows among ``codes`` hold, in words ("" when every row is ordinary):
    ``row 1 of 1 holds values of ±2.9e38 to ±3.0e38 (the largest finite float32 is 3.4e38)``."""
    kinds = [split_row_code(code)[1] for code in codes]
    extreme = [index for index, kind in enumerate(kinds) if kind]
    if not extreme:
        return ""
    first, last = extreme[0] + 1, extreme[-1] + 1
    where = f"row {first} of {len(codes)} holds" if first == last else f"rows {first}-{last} of {len(codes)} hold"
    what = " and ".join(dict.fromkeys(_KIND_TEXT[kinds[index]](dtype) for index in extreme))
    return f"{where} {what}"


def _huge_text(dtype: str) -> str:
    info = float_info(dtype)
    if info is None:
        return "values near the dtype's largest"
    low, high = (float(info.max) * fraction for fraction in HUGE_FRACTIONS)
    return f"values of ±{_number(low)} to ±{_number(high)} (the largest finite {dtype} is {_number(float(info.max))})"


def _subnormal_text(dtype: str) -> str:
    info = float_info(dtype)
    if info is None:
        return "subnormal values"
    return f"subnormal values (±{_number(float(info.smallest_subnormal))} up to below ±{_number(float(info.tiny))})"


def _number(value: float, digits: int = 2) -> str:
    """``3e+38`` as ``3.0e38``: how the messages write a magnitude."""
    mantissa, _, exponent = f"{value:.{digits - 1}e}".partition("e")
    return f"{mantissa}e{int(exponent)}"


_KIND_TEXT: Mapping[int, Callable[[str], str]] = MappingProxyType(
    {
        1: _huge_text,
        2: _subnormal_text,
        3: lambda dtype: "only ±0.0 (-0.0 included)",
        4: lambda dtype: f"{_huge_text(dtype)}, {_subnormal_text(dtype)}, ±0.0 and ordinary values side by side",
    }
)


def synthetic_rows(caps: EngineCapabilities, tokens: tuple[int, ...]) -> np.ndarray[Any, Any]:
    """Rows a head could have produced for ``tokens`` (row codes): finite, one per code, a
    function of the code alone, in the engine's dtype and hidden size."""
    return _synthetic_rows(caps.hidden_size, caps.dtype, tokens)


def _synthetic_rows(hidden_size: int, dtype: str, tokens: tuple[int, ...]) -> np.ndarray[Any, Any]:
    columns = np.arange(1, hidden_size + 1, dtype=np.float64)
    if not tokens or min(tokens) >= 0:
        # All rows in one call (a long chunk cost one numpy call per token); the same values.
        scales = 0.618 + 0.137 * np.asarray(tokens, dtype=np.float64)
        return np.sin(np.multiply.outer(scales, columns)).astype(numpy_dtype(dtype)).reshape(len(tokens), hidden_size)
    split = [split_row_code(code) for code in tokens]
    scales = 0.618 + 0.137 * np.asarray([token for token, _ in split], dtype=np.float64)
    base = np.sin(np.multiply.outer(scales, columns)).reshape(len(tokens), hidden_size)
    rows = base.copy()
    info = float_info(dtype)
    if info is not None:  # a dtype with no finite range to reach the edges of keeps its ordinary rows
        for index, (_, kind) in enumerate(split):
            if kind:
                rows[index] = _extreme_row(kind, base[index], info)
    return rows.astype(numpy_dtype(dtype))


def _extreme_row(kind: int, base: np.ndarray[Any, Any], info: Any) -> np.ndarray[Any, Any]:
    """The row of ``kind`` made from an ordinary row ``base`` (float64, values in [-1, 1]):
    its signs, and magnitudes that vary with it, so that rows of different tokens differ."""
    sign = np.where(base < 0, -1.0, 1.0)
    magnitude = np.abs(base)
    if kind == 1:  # huge: ±(0.85 to 0.88) × the largest finite value
        low, high = HUGE_FRACTIONS
        huge: np.ndarray[Any, Any] = sign * float(info.max) * (low + (high - low) * magnitude)
        return huge
    if kind == 2:  # subnormal: ±2**k × the smallest subnormal, k < nmant; the first is the smallest
        exponents = np.minimum(np.floor(magnitude * info.nmant), info.nmant - 1)
        exponents[0] = 0
        subnormal: np.ndarray[Any, Any] = sign * float(info.smallest_subnormal) * np.exp2(exponents)
        return subnormal
    if kind == 3:  # zero: ±0.0, the first -0.0
        zeros = np.copysign(0.0, sign)
        zeros[0] = -0.0
        return zeros
    # mixed: huge, subnormal, zero and ordinary values in turn
    row = base.copy()
    for offset, part in enumerate((1, 2, 3)):
        row[offset::4] = _extreme_row(part, base, info)[offset::4]
    return row


@functools.lru_cache(maxsize=1 << 14)
def _synthetic_row(hidden_size: int, dtype: str, token: int) -> bytes:
    """One row code's row of ``synthetic_rows``, as ``EngineTensor`` data: the kit sends the same
    tokens' rows many times (to the engine under test and each twin, one history growing by
    a token a step), and a row is a function of its code alone."""
    return EngineTensor.from_array(RESIDUAL_TENSOR, _synthetic_rows(hidden_size, dtype, (token,))).data


def _rows_data(hidden_size: int, dtype: str, tokens: Sequence[int]) -> bytes:
    return b"".join(_synthetic_row(hidden_size, dtype, token) for token in tokens)


def synthetic_bundle(
    caps: EngineCapabilities,
    session: str,
    epoch: int,
    step: int,
    tokens: tuple[int, ...],
    rows_dtype: str | None = None,
) -> BoundaryBundle:
    """The post-head bundle the kit sends a middle or tail for ``tokens`` (row codes; rows from
    ``synthetic_rows``). Its sideband holds the token ids. ``rows_dtype``: make the rows in
    that dtype (the engine under test's, for a reference engine in another), then cast them
    to the engine's own, so that both compute from the same values."""
    tensor, sideband = _synthetic_input(caps.hidden_size, caps.dtype, tokens, rows_dtype or caps.dtype)
    return BoundaryBundle(
        session_id=session,
        epoch=epoch,
        step=step,
        boundary_point=OUTPUT_BOUNDARY_POINT["head"],
        architecture=caps.architecture,
        tensors=(tensor,),
        token_id_sideband=sideband,
    )


@functools.lru_cache(maxsize=1 << 12)
def _synthetic_input(
    hidden_size: int, dtype: str, tokens: tuple[int, ...], rows_dtype: str
) -> tuple[EngineTensor, tuple[int, ...]]:
    """The rows tensor and the sideband of ``synthetic_bundle``: the same history's are sent
    to the engine under test and to each twin (a tensor is immutable, so it is shared)."""
    rows = _rows_data(hidden_size, dtype, tokens)
    if rows_dtype != dtype:
        made = np.frombuffer(_rows_data(hidden_size, rows_dtype, tokens), numpy_dtype(rows_dtype).newbyteorder("<"))
        rows = made.astype(numpy_dtype(dtype).newbyteorder("<")).tobytes()
    tensor = EngineTensor(RESIDUAL_TENSOR, numpy_dtype(dtype).name, (len(tokens), hidden_size), rows)
    sideband = tokens if not tokens or min(tokens) >= 0 else tuple(split_row_code(code)[0] for code in tokens)
    return tensor, sideband


def row_codes_of(caps: EngineCapabilities, data: bytes, sideband: tuple[int, ...]) -> tuple[int, ...]:
    """The row codes of a bundle the kit built (its rows' bytes and its sideband): the rows
    name the history, not the sideband alone, which is the same for a token's ordinary and
    extreme rows. A row the kit did not make counts as its token's."""
    return _row_codes(caps.hidden_size, caps.dtype, data, sideband)


@functools.lru_cache(maxsize=1 << 11)
def _row_codes(hidden_size: int, dtype: str, data: bytes, sideband: tuple[int, ...]) -> tuple[int, ...]:
    # Cached by the bytes the session's history holds (their hash is kept by the bytes object),
    # so that the history of every step costs a look-up per chunk, not a comparison.
    if not sideband or data == _rows_data(hidden_size, dtype, sideband):
        return sideband
    width = len(data) // len(sideband)
    codes: list[int] = []
    for index, token in enumerate(sideband):
        row = data[index * width : (index + 1) * width]
        kinds = range(len(ROW_KINDS)) if token >= 0 else range(1)
        found = (
            row_code(token, kind) for kind in kinds if _synthetic_row(hidden_size, dtype, row_code(token, kind)) == row
        )
        codes.append(next(found, token))
    return tuple(codes)


def build_request(action: Action, caps: EngineCapabilities, rows_dtype: str | None = None) -> StepRequest:
    """The request a prefill/decode ``action`` stands for on an engine with ``caps`` (a
    middle's or tail's rows made in ``rows_dtype``: see ``synthetic_bundle``)."""
    args = action.args
    session, epoch, step = str(args["session"]), int(args["epoch"]), int(args["step"])
    tokens = tuple(int(token) for token in args["tokens"])
    malformed = args.get("malformed")
    request_type: type[PrefillRequest] | type[DecodeRequest] = (
        PrefillRequest if action.op == "prefill" else DecodeRequest
    )
    if caps.role in ("head", "full"):
        request: StepRequest = request_type(session, epoch, step, token_ids=tokens)
    else:
        bundle = synthetic_bundle(caps, session, epoch, step, tokens, rows_dtype)
        request = request_type(session, epoch, step, bundle=bundle)
    if malformed is None:
        return request
    if malformed not in _MALFORMATIONS:
        message = f"unknown malformation {malformed!r}; known: {sorted(_MALFORMATIONS)}"
        raise ValueError(message)
    return _MALFORMATIONS[malformed](request, caps)


# --- malformations: each breaks exactly one clause of contract §2 rule 2 ---------------------

Malformation = Callable[[StepRequest, EngineCapabilities], StepRequest]


def _with_ids(request: StepRequest, **changes: Any) -> StepRequest:
    """Change session/epoch/step in the request and in its bundle alike, so the
    echo stays consistent and only the intended clause is broken."""
    if request.bundle is not None:
        changes_for_bundle = {key: value for key, value in changes.items()}
        changes = {**changes, "bundle": replace(request.bundle, **changes_for_bundle)}
    return replace(request, **changes)


def _with_tensor(request: StepRequest, tensor: EngineTensor, **bundle_changes: Any) -> StepRequest:
    assert request.bundle is not None
    return replace(request, bundle=replace(request.bundle, tensors=(tensor,), **bundle_changes))


def _rows(request: StepRequest) -> np.ndarray[Any, Any]:
    assert request.bundle is not None
    return request.bundle.tensors[0].to_array()


def _empty_input(request: StepRequest, caps: EngineCapabilities) -> StepRequest:
    if request.token_ids is not None:
        return replace(request, token_ids=())
    empty = EngineTensor.from_array(RESIDUAL_TENSOR, np.zeros((0, caps.hidden_size), numpy_dtype(caps.dtype)))
    return _with_tensor(request, empty, token_id_sideband=())


def _two_token_decode(request: StepRequest, caps: EngineCapabilities) -> StepRequest:
    tokens = (request.token_ids or (0,))[:1] * 2
    if request.bundle is None:
        return DecodeRequest(request.session_id, request.epoch, request.step, token_ids=tokens)
    bundle = synthetic_bundle(caps, request.session_id, request.epoch, request.step, tokens)
    return DecodeRequest(request.session_id, request.epoch, request.step, bundle=bundle)


def _wrong_input_kind(request: StepRequest, caps: EngineCapabilities) -> StepRequest:
    if request.token_ids is not None:
        bundle = synthetic_bundle(caps, request.session_id, request.epoch, request.step, request.token_ids)
        return replace(request, token_ids=None, bundle=bundle)
    assert request.bundle is not None
    return replace(request, bundle=None, token_ids=request.bundle.token_id_sideband or (0,))


def _non_finite(request: StepRequest, caps: EngineCapabilities) -> StepRequest:
    rows = _rows(request).copy()
    rows.flat[-1] = NON_FINITE_VALUES[request.step % len(NON_FINITE_VALUES)]
    return _with_tensor(request, EngineTensor.from_array(RESIDUAL_TENSOR, rows))


def _wrong_dtype(request: StepRequest, caps: EngineCapabilities) -> StepRequest:
    other = "float64" if caps.dtype != "float64" else "float32"
    return _with_tensor(request, EngineTensor.from_array(RESIDUAL_TENSOR, _rows(request).astype(other)))


def _truncated(request: StepRequest, caps: EngineCapabilities) -> StepRequest:
    assert request.bundle is not None
    tensor = request.bundle.tensors[0]
    return _with_tensor(request, replace(tensor, data=tensor.data[:-1]))


def _non_upstream(request: StepRequest, caps: EngineCapabilities) -> StepRequest:
    point = "post_middle_residual" if caps.role == "middle" else "post_tail_residual"
    assert request.bundle is not None
    return replace(request, bundle=replace(request.bundle, boundary_point=point))


def _bundle_change(**changes: Any) -> Malformation:
    def apply(request: StepRequest, caps: EngineCapabilities) -> StepRequest:
        assert request.bundle is not None
        values = {key: value(request, caps) if callable(value) else value for key, value in changes.items()}
        return replace(request, bundle=replace(request.bundle, **values))

    return apply


def _tensor_from(
    build: Callable[[np.ndarray[Any, Any], EngineCapabilities], np.ndarray[Any, Any]], name: str = RESIDUAL_TENSOR
) -> Malformation:
    def apply(request: StepRequest, caps: EngineCapabilities) -> StepRequest:
        return _with_tensor(request, EngineTensor.from_array(name, build(_rows(request), caps)))

    return apply


def _extra_tensor(request: StepRequest, caps: EngineCapabilities) -> StepRequest:
    assert request.bundle is not None
    tensors = (*request.bundle.tensors, EngineTensor.from_array("extra", _rows(request)))
    return replace(request, bundle=replace(request.bundle, tensors=tensors))


def _token_swap(value: Callable[[EngineCapabilities], int]) -> Malformation:
    def apply(request: StepRequest, caps: EngineCapabilities) -> StepRequest:
        assert request.token_ids is not None
        return replace(request, token_ids=(*request.token_ids[:-1], value(caps)))

    return apply


COMMON_MALFORMATIONS: Mapping[str, Malformation] = MappingProxyType(
    {
        "empty_session_id": lambda request, caps: _with_ids(request, session_id=""),
        "epoch_out_of_range": lambda request, caps: _with_ids(request, epoch=EPOCH_STEP_LIMIT),
        "negative_step": lambda request, caps: _with_ids(request, step=-1),
        "empty_input": _empty_input,
        "two_token_decode": _two_token_decode,
        "wrong_input_kind": _wrong_input_kind,
    }
)
TOKEN_MALFORMATIONS: Mapping[str, Malformation] = MappingProxyType(
    {
        "token_out_of_vocab": _token_swap(lambda caps: caps.vocab_size),
        "negative_token": _token_swap(lambda caps: -1),
    }
)
BUNDLE_MALFORMATIONS: Mapping[str, Malformation] = MappingProxyType(
    {
        "non_finite_value": _non_finite,
        "wrong_architecture": _bundle_change(architecture=lambda request, caps: caps.architecture + "-other"),
        "wrong_hidden_size": _tensor_from(lambda rows, caps: np.pad(rows, ((0, 0), (0, 1)))),
        "wrong_dtype": _wrong_dtype,
        "truncated_data": _truncated,
        "two_tensors": _extra_tensor,
        "wrong_tensor_name": _tensor_from(lambda rows, caps: rows, name="hidden"),
        "rank_3_tensor": _tensor_from(lambda rows, caps: rows[None, :, :]),
        "non_upstream_boundary": _non_upstream,
        "sideband_length": _bundle_change(
            token_id_sideband=lambda request, caps: (*request.bundle.token_id_sideband, 0)
        ),
        "echo_mismatch": _bundle_change(step=lambda request, caps: request.step + 1),
    }
)
_MALFORMATIONS: Mapping[str, Malformation] = MappingProxyType(
    {**COMMON_MALFORMATIONS, **TOKEN_MALFORMATIONS, **BUNDLE_MALFORMATIONS}
)


def known_malformations() -> frozenset[str]:
    return frozenset(_MALFORMATIONS)


def malformations_for(caps: EngineCapabilities) -> tuple[str, ...]:
    """The malformation names that apply to the input kind of ``caps.role``, in a fixed order."""
    specific = TOKEN_MALFORMATIONS if caps.role in ("head", "full") else BUNDLE_MALFORMATIONS
    return (*specific, *COMMON_MALFORMATIONS)


settle(__name__, globals())
