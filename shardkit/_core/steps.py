"""Concrete steps: what the kit sends, in a form that prints, serialises and replays.

An ``Action`` holds plain values only (ids, epochs, steps, token ids, the name
of a malformation). The request it stands for is rebuilt from those values and
the engine's capabilities by ``build_request``: inputs for middle and tail
shards are bundles whose rows the kit synthesises from token ids, so the kit
knows every history, and a trace never needs to store tensor bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import numpy as np

from shardkit._core.model import SessionState, StepRequest
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
    "TOKEN_MALFORMATIONS",
    "Action",
    "build_request",
    "malformations_for",
    "phase_action",
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
        shown = ", ".join(f"{key}={_show(value)}" for key, value in self.args.items() if value is not None)
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
    """Whether ``action`` repeats ``last`` (the kit builds a bundle's rows from its sideband)."""
    if (action.op == "prefill") != isinstance(last, PrefillRequest):
        return False
    sent = last.token_ids if last.token_ids is not None else last.bundle.token_id_sideband if last.bundle else None
    return sent == tuple(action.args["tokens"])


def synthetic_rows(caps: EngineCapabilities, tokens: tuple[int, ...]) -> np.ndarray[Any, Any]:
    """Rows a head could have produced for ``tokens``: finite, one per token, a
    function of the token id alone, in the engine's dtype and hidden size."""
    return _synthetic_rows(caps.hidden_size, caps.dtype, tokens)


def _synthetic_rows(hidden_size: int, dtype: str, tokens: tuple[int, ...]) -> np.ndarray[Any, Any]:
    columns = np.arange(1, hidden_size + 1, dtype=np.float64)
    # All rows in one call (a long chunk cost one numpy call per token); the same values.
    scales = 0.618 + 0.137 * np.asarray(tokens, dtype=np.float64)
    return np.sin(np.multiply.outer(scales, columns)).astype(dtype).reshape(len(tokens), hidden_size)


@functools.lru_cache(maxsize=1 << 14)
def _synthetic_row(hidden_size: int, dtype: str, token: int) -> bytes:
    """One token's row of ``synthetic_rows``, as ``EngineTensor`` data: the kit sends the same
    tokens' rows many times (to the engine under test and each twin, one history growing by
    a token a step), and a row is a function of the token alone."""
    return EngineTensor.from_array(RESIDUAL_TENSOR, _synthetic_rows(hidden_size, dtype, (token,))).data


def synthetic_bundle(
    caps: EngineCapabilities, session: str, epoch: int, step: int, tokens: tuple[int, ...]
) -> BoundaryBundle:
    """The post-head bundle the kit sends a middle or tail for ``tokens`` (rows from ``synthetic_rows``)."""
    rows = b"".join(_synthetic_row(caps.hidden_size, caps.dtype, token) for token in tokens)
    tensor = EngineTensor(RESIDUAL_TENSOR, np.dtype(caps.dtype).name, (len(tokens), caps.hidden_size), rows)
    return BoundaryBundle(
        session_id=session,
        epoch=epoch,
        step=step,
        boundary_point=OUTPUT_BOUNDARY_POINT["head"],
        architecture=caps.architecture,
        tensors=(tensor,),
        token_id_sideband=tokens,
    )


def build_request(action: Action, caps: EngineCapabilities) -> StepRequest:
    """The request a prefill/decode ``action`` stands for on an engine with ``caps``."""
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
        request = request_type(session, epoch, step, bundle=synthetic_bundle(caps, session, epoch, step, tokens))
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
    empty = EngineTensor.from_array(RESIDUAL_TENSOR, np.zeros((0, caps.hidden_size), caps.dtype))
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
