"""A report document (``shardkit._run.report.report_document``, or a campaign's merge of
several) as one HTML page: each failure as session swimlanes, the coverage heatmap, the
histogram of session lengths and the facts of the run.

Every value is read defensively (a key may be missing or of another type in a report
written by another version or edited by hand) and every string is escaped where it is
drawn. The page carries a policy that forbids every fetch and every script, so even a
string that escaped escaping could load or run nothing.
"""

from __future__ import annotations

import html
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from shardkit._core.properties import read_more
from shardkit._html.style import STYLE

__all__ = ["OPERATIONS", "OUTCOMES", "document_problem", "render_html", "write_html"]

#: The operations of contract v1, in the order the heatmap lists them; others a report holds
#: (an extension's) follow in name order.
OPERATIONS = ("prefill", "decode", "cancel", "release", "health", "fault")
#: The outcomes a step of contract v1 can have: each status code the reference model predicts,
#: an injected crash, and the failing step. A pair no step reached is drawn as a gap.
OUTCOMES = (
    "OK",
    "INVALID_ARGUMENT",
    "NOT_FOUND",
    "FAILED_PRECONDITION",
    "ABORTED",
    "CANCELLED",
    "RESOURCE_EXHAUSTED",
    "UNAVAILABLE",
    "CRASH",
    "FAILED",
)
#: The keys every ``--report`` document has: what tells one apart from any other JSON.
REQUIRED_KEYS = ("shardkit_version", "target", "coverage", "longest_session", "failures")
HEAT_LEVELS = 5
#: Seconds between two reloads of a campaign's page while the campaign rewrites it.
LIVE_REFRESH_S = 10
#: Tokens shown of a step's list (the rest counted), as the printed failure shows them.
SHOWN_TOKENS = 8
#: Longest timeline of a parallel phase drawn tick by tick; a longer one is drawn as lists.
MAX_TIMELINE_TICKS = 120
#: Forbids every fetch and every script: the page is whole as it is.
CONTENT_POLICY = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


def document_problem(document: object) -> str | None:
    """What keeps ``document`` from being drawn as a shardkit report, or None."""
    if not isinstance(document, Mapping):
        return f"it holds a JSON {_json_type(document)}, where a shardkit report is an object"
    missing = [key for key in REQUIRED_KEYS if key not in document]
    if missing:
        keys = "key" if len(missing) == 1 else "keys"
        return f"it has no {', '.join(repr(key) for key in missing)} {keys}"
    kinds = {"coverage": Mapping, "longest_session": Mapping, "failures": list}
    for key, kind in kinds.items():
        if not isinstance(document[key], kind):
            wanted = "an object" if kind is Mapping else "a list"
            return f"its {key!r} is a JSON {_json_type(document[key])}, where a shardkit report has {wanted}"
    return None


def render_html(document: Mapping[str, Any]) -> str:
    """The page for ``document``; ``ValueError`` (saying why) for one that is not a report."""
    problem = document_problem(document)
    if problem is not None:
        raise ValueError(f"cannot draw this report: {problem}")
    failures = [failure for failure in document["failures"] if isinstance(failure, Mapping)]
    target = _text(document.get("target"))
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CONTENT_POLICY}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f'<meta name="generator" content="shardkit {_e(document.get("shardkit_version"))}">',
        *_refresh(document),
        f"<title>shardkit report: {_e(target)}</title>",
        f"<style>{STYLE}</style>",
        "</head>",
        "<body>",
        _summary(document, failures),
    ]
    campaign = document.get("campaign")
    if isinstance(campaign, Mapping):
        parts.append(_campaign(campaign))
    parts += [_failure(failure, number, len(failures)) for number, failure in enumerate(failures, start=1)]
    parts += [
        '<div class="charts">',
        _heatmap(_mapping(document.get("coverage"))),
        _histogram(_mapping(document.get("longest_session")), document.get("examples")),
        "</div>",
        _run_facts(document, failures),
        "</body>",
        "</html>",
    ]
    return "\n".join(parts) + "\n"


def write_html(document: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Render ``document`` and write it to ``path`` whole: through a file beside it, renamed
    into place, so a killed command never leaves half a page. Returns the path."""
    target = Path(path)
    page = render_html(document)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        # Opened by name, the file gets the permissions any new file of the user gets.
        with temporary.open("x", encoding="utf-8") as file:
            file.write(page)
        temporary.replace(target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return target


# --- the top of the page -----------------------------------------------------------------------


def _summary(document: Mapping[str, Any], failures: Sequence[Mapping[str, Any]]) -> str:
    if failures:
        properties = ", ".join(dict.fromkeys(_text(failure.get("property")) for failure in failures))
        count = "1 failure" if len(failures) == 1 else f"{len(failures)} failures"
        verdict = f'<p class="verdict failed">{_e(count)}: {_e(properties)}</p>'
    else:
        verdict = '<p class="verdict passed">no failure found</p>'
    counts = " · ".join(
        part
        for part in (
            f"seed {_text(document.get('seed'))}" if "seed" in document else "",
            _plural(document.get("examples"), "example"),
            _plural(document.get("steps"), "step"),
            _seconds(document.get("elapsed_s")),
        )
        if part
    )
    links = [f'<a href="#failure-{number}">failure {number}</a>' for number in range(1, len(failures) + 1)]
    links += ['<a href="#coverage">coverage</a>', '<a href="#sessions">session lengths</a>', '<a href="#run">run</a>']
    return (
        '<header class="summary">'
        f'<h1>shardkit report <span class="target mono">{_e(document.get("target"))}</span></h1>'
        f"{verdict}"
        f'<p class="counts">{_e(counts)}</p>'
        f'<nav class="contents">{"".join(links)}</nav>'
        "</header>"
    )


def _refresh(document: Mapping[str, Any]) -> list[str]:
    """A campaign's page rewritten while it runs reloads itself, until the last rewrite."""
    campaign = document.get("campaign")
    if isinstance(campaign, Mapping) and campaign.get("in_progress") is True:
        return [f'<meta http-equiv="refresh" content="{LIVE_REFRESH_S}">']
    return []


def _campaign(campaign: Mapping[str, Any]) -> str:
    """The campaign's facts; its rounds' seeds as a table (worker, round, seed, and on a
    cluster the node that ran it), each of which reruns that round alone with ``shardkit fuzz
    --seed``; on a cluster, the rounds each node ran."""
    rows = "".join(
        f"<dt>{_e(key)}</dt><dd>{_e(_text(value))}</dd>"
        for key, value in campaign.items()
        if key not in ("seeds", "rounds_per_node") and not (key == "errors" and not value)
    )
    live = ""
    if campaign.get("in_progress") is True:
        live = f'<p class="live">running: the rounds finished so far; this page reloads every {LIVE_REFRESH_S} s</p>'
    seeds = campaign.get("seeds")
    table = ""
    if isinstance(seeds, list) and seeds:
        entries = [entry for entry in seeds if isinstance(entry, Mapping)]
        on_nodes = any("node" in entry for entry in entries)
        cells = "".join(
            f"<tr><td>{_e(_text(entry.get('worker')))}</td><td>{_e(_text(entry.get('round')))}</td>"
            f'<td class="mono">{_e(_text(entry.get("seed")))}</td>'
            + (f'<td class="mono">{_e(_text(entry.get("node")))}</td>' if on_nodes else "")
            + "</tr>"
            for entry in entries
        )
        node_head = "<th>node</th>" if on_nodes else ""
        table = f'<table class="seeds"><tr><th>worker</th><th>round</th><th>seed</th>{node_head}</tr>{cells}</table>'
    per_node = campaign.get("rounds_per_node")
    if isinstance(per_node, Mapping) and per_node:
        cells = "".join(f'<tr><td class="mono">{_e(node)}</td><td>{_e(_text(count))}</td></tr>' for node, count in per_node.items())
        table += f'<table class="nodes"><tr><th>node</th><th>rounds</th></tr>{cells}</table>'
    return f'<section id="campaign"><h2>Campaign</h2>{live}<dl class="facts">{rows}</dl>{table}</section>'


# --- a failure ---------------------------------------------------------------------------------


def _failure(failure: Mapping[str, Any], number: int, of: int) -> str:
    steps = [step for step in _list(failure.get("steps")) if isinstance(step, Mapping)]
    prop = _text(failure.get("property"))
    violating = _violating_index(failure, steps)
    title = f"Failure {number}" + (f" of {of}" if of > 1 else "")
    length = _plural(len(steps), "step")
    parts = [
        f'<section class="failure" id="failure-{number}" data-property="{_e(prop)}">',
        f'<h2>{_e(title)}: <span class="property">{_e(prop)}</span> in {_e(length)}</h2>',
    ]
    origin = [
        f"{key} {_text(failure[key])}" for key in ("target", "seed") if key in failure and failure[key] is not None
    ]
    if origin:
        parts.append(f'<p class="muted">found fuzzing {_e(", ".join(origin))}</p>')
    parts.append(_violation_box(failure, steps, violating, number))
    parts.append(_swimlanes(steps, violating, number))
    notes = [_text(note) for note in _list(failure.get("notes"))]
    if notes:
        parts.append('<ul class="notes">' + "".join(f"<li>note: {_e(note)}</li>" for note in notes) + "</ul>")
    message = failure.get("message")
    if isinstance(message, str) and message:
        parts.append(
            '<details class="message"><summary>the failure as <code>shardkit</code> prints it</summary>'
            f"<pre>{_e(message)}</pre></details>"
        )
    parts.append(_reproduce(failure))
    parts.append("</section>")
    return "\n".join(parts)


def _violating_index(failure: Mapping[str, Any], steps: Sequence[Mapping[str, Any]]) -> int | None:
    """The position in ``steps`` of the step that broke the property: the one marked so, the
    one ``violating_step`` names, or the last (the failing step always ends the sequence)."""
    for position, step in enumerate(steps):
        if step.get("violating") is True:
            return position
    named = failure.get("violating_step")
    for position, step in enumerate(steps):
        if named is not None and step.get("index") == named:
            return position
    return len(steps) - 1 if steps else None


def _rule_reference(failure: Mapping[str, Any]) -> str | None:
    where = failure.get("read_more")
    if isinstance(where, str) and where:
        return where
    prop = failure.get("property")
    return read_more(prop) if isinstance(prop, str) else None


def _violation_box(
    failure: Mapping[str, Any], steps: Sequence[Mapping[str, Any]], violating: int | None, number: int
) -> str:
    prop = _text(failure.get("property"))
    where = _rule_reference(failure)
    step = steps[violating] if violating is not None else {}
    index = _step_number(step, violating)
    head = f"step {index} breaks" if violating is not None else "the run breaks"
    rule = (
        f' (what it requires: <code class="rule">{_e(where)}</code> in shardkit\'s documentation)'
        if where is not None
        else ""
    )
    expected = _text(step.get("expected")) or "—"
    observed = _text(step.get("observed")) or "—"
    return (
        f'<div class="violation" id="failure-{number}-violation" role="note">'
        f'<p><span class="violation-tag">{_e(head)} {_e(prop)}</span>{rule}</p>'
        '<dl class="expected-observed">'
        f'<dt>expected</dt><dd class="expected">{_e(expected)}</dd>'
        f'<dt>observed</dt><dd class="observed">{_e(observed)}</dd>'
        "</dl></div>"
    )


def _sessions(steps: Iterable[Mapping[str, Any]]) -> list[str]:
    """Every session the steps name, a parallel phase's calls included, in order of appearance."""
    found: dict[str, None] = {}
    for step in steps:
        session = _session(step)
        if session is not None:
            found.setdefault(session)
        for lane in _lanes(step):
            for call in lane:
                lane_session = _session(call)
                if lane_session is not None:
                    found.setdefault(lane_session)
    return list(found)


def _swimlanes(steps: Sequence[Mapping[str, Any]], violating: int | None, number: int) -> str:
    sessions = _sessions(steps)
    heads = (
        "".join(
            f'<th class="lane" scope="col" data-session="{_e(session)}">session <code>{_e(session)}</code></th>'
            for session in sessions
        )
        or '<th class="lane" scope="col">no session</th>'
    )
    span = max(1, len(sessions))
    rows = []
    for position, step in enumerate(steps):
        is_violating = position == violating
        index = _step_number(step, position)
        classes = "step violating" if is_violating else "step"
        row_id = f' id="failure-{number}-step-{_e(index)}"'
        rows.append(
            f'<tr class="{classes}" data-step="{_e(index)}"{row_id}><th class="step-col" scope="row">{_e(index)}</th>'
        )
        session = _session(step)
        op = _text(step.get("op"))
        if op == "parallel" or _lanes(step):
            rows.append(f'<td class="span-cell" colspan="{span}">{_phase(step, is_violating)}</td>')
        elif op == "fault":
            rows.append(f'<td class="span-cell fault" colspan="{span}">{_fault_mark(step)}</td>')
        elif session is None:
            rows.append(f'<td class="span-cell engine" colspan="{span}">{_card(step, is_violating, engine=True)}</td>')
        else:
            for lane in sessions:
                if lane == session:
                    rows.append(f'<td class="lane-cell" data-session="{_e(lane)}">{_card(step, is_violating)}</td>')
                else:
                    rows.append(f'<td class="lane-cell idle" data-session="{_e(lane)}"></td>')
        rows.append("</tr>")
    return (
        '<table class="swimlanes">'
        f'<thead><tr><th class="step-col" scope="col">step</th>{heads}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def _card(step: Mapping[str, Any], violating: bool, *, engine: bool = False) -> str:
    """A step as a card: its call, its note, the status and cache result expected and observed."""
    classes = ["call"]
    if engine:
        classes.append("engine-call")
    observed_status = step.get("observed_status")
    if isinstance(observed_status, str) and observed_status != "OK":
        classes.append("refused")
    if violating:
        classes.append("violating")
    note = _text(step.get("note"))
    parts = [
        f'<div class="{" ".join(classes)}">',
        f'<div class="call-head"><span class="op">{_e(step.get("op"))}</span>'
        f'<span class="args mono">{_e(_arguments(step.get("args")))}</span>'
        + ('<span class="violation-tag">violates</span>' if violating else "")
        + "</div>",
    ]
    if note:
        parts.append(f'<div class="note">{_e(note)}</div>')
    parts.append(_answers(step))
    if not violating:
        parts.append(
            '<details class="why"><summary>expected vs observed</summary>'
            f"<div>expected: {_e(_text(step.get('expected')) or '—')}</div>"
            f"<div>observed: {_e(_text(step.get('observed')) or '—')}</div></details>"
        )
    parts.append("</div>")
    return "".join(parts)


def _answers(step: Mapping[str, Any]) -> str:
    """Expected and observed as status and cache badges; as text where they are no status."""
    expected = _badges(step.get("expected_status"), step.get("expected_cache"))
    observed = _badges(step.get("observed_status"), step.get("observed_cache"))
    differs = bool(expected and observed) and (
        (step.get("expected_status"), step.get("expected_cache"))
        != (step.get("observed_status"), step.get("observed_cache"))
    )
    if not expected:
        expected = f'<span class="text">{_e(_short(_text(step.get("expected")) or "—"))}</span>'
    if not observed:
        observed = f'<span class="text">{_e(_short(_text(step.get("observed")) or "—"))}</span>'
    mark = " differs" if differs else ""
    return (
        '<div class="answers">'
        f'<span class="answer expected{mark}"><span class="label">expected</span>{expected}</span>'
        f'<span class="answer observed{mark}"><span class="label">observed</span>{observed}</span>'
        "</div>"
    )


def _badges(status: object, cache: object) -> str:
    if not isinstance(status, str) or not status:
        return ""
    # The class carries the code only when it is a plain name: a class is an attribute, and
    # a report is untrusted.
    code = f" code-{status}" if status.replace("_", "").isalnum() and status.isascii() else ""
    badges = f'<span class="badge status{code}">{_e(status)}</span>'
    if isinstance(cache, str) and cache:
        badges += f'<span class="badge cache">{_e(cache)}</span>'
    return badges


def _fault_mark(step: Mapping[str, Any]) -> str:
    args = _mapping(step.get("args"))
    kind = _text(args.get("kind")) or "a fault"
    value = args.get("value")
    shown = f" = {_text(value)}" if value is not None else ""
    return (
        '<div class="fault-mark" data-fault="1">'
        f'<span class="op">⚡ fault injected</span> <span class="mono">{_e(kind)}{_e(shown)}</span>'
        f" {_answers(step)}</div>"
    )


def _phase(step: Mapping[str, Any], violating: bool) -> str:
    """A parallel phase: one column per lane of calls sent at the same time, and, when the
    report holds the ticks of the phase's logical clock, one row per tick, each call spanning
    the ticks it ran for."""
    lanes = _lanes(step)
    names = [_lane_name(number) for number in range(len(lanes))]
    heads = "".join(
        f'<th class="concurrency-lane" scope="col" data-lane="{_e(name)}">lane {_e(name)}</th>' for name in names
    )
    timeline = _timeline(lanes)
    if timeline is not None:
        first, last, starts = timeline
        rows = []
        covered: set[tuple[int, int]] = set()
        for tick in range(first, last + 1):
            cells = [f'<td class="tick">{tick}</td>']
            for lane in range(len(lanes)):
                call = starts.get((lane, tick))
                if call is not None:
                    ended = _int(call.get("ended"))
                    assert ended is not None  # _timeline checked every call's ticks
                    covered.update((lane, covering) for covering in range(tick, ended + 1))
                    rows_spanned = ended - tick + 1
                    cells.append(f'<td class="phase-cell" rowspan="{rows_spanned}">{_lane_call(call)}</td>')
                elif (lane, tick) not in covered:
                    cells.append('<td class="phase-cell idle"></td>')
            rows.append(f"<tr>{''.join(cells)}</tr>")
        body = "".join(rows)
        tick_head = '<th class="tick" scope="col">tick</th>'
    else:
        lane_cells = "".join(
            '<td class="phase-cell">' + "".join(_lane_call(call) for call in lane) + "</td>" for lane in lanes
        )
        body = f"<tr>{lane_cells}</tr>"
        tick_head = ""
    what = f"parallel phase: {len(lanes)} lanes of calls sent at the same time"
    clock = " (rows: ticks of one logical clock)" if timeline is not None else ""
    tag = ' <span class="violation-tag">violates</span>' if violating else ""
    classes = "phase violating" if violating else "phase"
    return (
        f'<div class="{classes}"><div class="phase-head">{_e(what)}{_e(clock)}{tag}</div>'
        f'<table class="phase-lanes"><thead><tr>{tick_head}{heads}</tr></thead><tbody>{body}</tbody></table></div>'
    )


def _timeline(
    lanes: Sequence[Sequence[Mapping[str, Any]]],
) -> tuple[int, int, dict[tuple[int, int], Mapping[str, Any]]] | None:
    """(first tick, last tick, the call starting at each (lane, tick)), or None when a call has
    no ticks, a lane's calls overlap, or the phase is too long to draw tick by tick."""
    starts: dict[tuple[int, int], Mapping[str, Any]] = {}
    ticks: list[int] = []
    for number, lane in enumerate(lanes):
        free_from = None
        for call in sorted(lane, key=lambda call: _int(call.get("started")) or 0):
            started, ended = _int(call.get("started")), _int(call.get("ended"))
            if started is None or ended is None or ended < started:
                return None
            if free_from is not None and started < free_from:
                return None  # a lane runs its calls one after another
            free_from = ended + 1
            starts[number, started] = call
            ticks += [started, ended]
    if not ticks or max(ticks) - min(ticks) > MAX_TIMELINE_TICKS:
        return None
    return min(ticks), max(ticks), starts


def _lane_call(call: Mapping[str, Any]) -> str:
    session = _session(call)
    started, ended = _int(call.get("started")), _int(call.get("ended"))
    ticks = f"[{started}-{ended}]" if started is not None and ended is not None else ""
    status, cache = call.get("observed_status"), call.get("observed_cache")
    answer = _badges(status, cache)
    answer_text = _text(call.get("answer"))
    if answer:
        # The badges say the status and cache result already: the text keeps what follows.
        for shown in (f"{status}/{cache}", f"{status}"):
            if answer_text.startswith(shown):
                answer_text = answer_text.removeprefix(shown).strip()
                break
    if answer_text:
        answer += f' <span class="text">{_e(_short(answer_text))}</span>'
    elif not answer:
        answer = '<span class="text">(answer not in the report)</span>'
    on = f" session <code>{_e(session)}</code>" if session is not None else ""
    args = {key: value for key, value in _mapping(call.get("args")).items() if key != "session"}
    refused = " refused" if isinstance(status, str) and status != "OK" else ""
    return (
        f'<div class="call lane-call{refused}" data-call="{_e(call.get("call"))}" data-session="{_e(session or "")}">'
        f'<div class="call-head"><span class="call-name">{_e(call.get("call"))}</span>'
        f'<span class="ticks mono">{_e(ticks)}</span><span class="op">{_e(call.get("op"))}</span>{on}'
        f'<span class="args mono">{_e(_arguments(args))}</span></div>'
        f'<div class="answers"><span class="answer observed"><span class="label">→</span>{answer}</span></div></div>'
    )


def _reproduce(failure: Mapping[str, Any]) -> str:
    rows = []
    # A campaign's failure also names the round that found it (``rerun_command``) and how
    # many rounds did (``found_in_rounds``), as its printed report does.
    for label, key in (
        ("this failure", "replay_command"),
        ("as a test", "regression_test"),
        ("trace", "trace"),
        ("its round", "rerun_command"),
    ):
        value = failure.get(key)
        if isinstance(value, str) and value:
            shown = f"pytest {value}" if key == "regression_test" else value
            rows.append(f'<dt>{_e(label)}</dt><dd><code class="{_e(key)}">{_e(shown)}</code></dd>')
    found_in = failure.get("found_in_rounds")
    if isinstance(found_in, int) and not isinstance(found_in, bool):
        rows.append(f'<dt>found in</dt><dd class="found_in_rounds">{found_in} round{"" if found_in == 1 else "s"}</dd>')
    if not rows:
        return '<p class="muted">no trace was written for this failure</p>'
    return f'<h3>Reproduce</h3><dl class="reproduce">{"".join(rows)}</dl>'


# --- coverage and session lengths ----------------------------------------------------------------


def _heatmap(coverage: Mapping[str, Any]) -> str:
    counts = {
        (str(op), str(outcome)): _count(count)
        for op, outcomes in coverage.items()
        for outcome, count in _mapping(outcomes).items()
    }
    operations = [*OPERATIONS, *sorted({op for op, _ in counts} - set(OPERATIONS))]
    outcomes = [*OUTCOMES, *sorted({outcome for _, outcome in counts} - set(OUTCOMES))]
    highest = max(counts.values(), default=0)
    heads = "".join(f'<th scope="col" data-outcome="{_e(outcome)}">{_e(outcome)}</th>' for outcome in outcomes)
    rows = []
    for op in operations:
        cells = []
        for outcome in outcomes:
            count = counts.get((op, outcome), 0)
            level = _heat_level(count, highest)
            classes = f"cell heat-{level}" if count else "cell gap"
            cells.append(
                f'<td class="{classes}" data-op="{_e(op)}" data-outcome="{_e(outcome)}" '
                f'title="{_e(op)} → {_e(outcome)}: {count}">{count}</td>'
            )
        rows.append(f'<tr data-op="{_e(op)}"><th scope="row">{_e(op)}</th>{"".join(cells)}</tr>')
    reached = sum(1 for count in counts.values() if count)
    return (
        '<section id="coverage"><h2>Coverage: operation × outcome</h2>'
        f'<p class="muted">{reached} of {len(operations) * len(outcomes)} pairs reached. '
        "A hatched cell is a pair no step reached (some cannot be: a fault step answers OK or crashes).</p>"
        f'<table class="heatmap"><thead><tr><th></th>{heads}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
        "</section>"
    )


def _heat_level(count: int, highest: int) -> int:
    """1 to ``HEAT_LEVELS`` on a log scale: counts span orders of magnitude (health against a crash)."""
    if count <= 0 or highest <= 0:
        return 0
    return max(1, math.ceil(HEAT_LEVELS * math.log1p(count) / math.log1p(highest)))


def _histogram(longest: Mapping[str, Any], examples: object) -> str:
    buckets = {str(label): _count(count) for label, count in _mapping(longest.get("decodes_histogram")).items()}
    highest = max(buckets.values(), default=0)
    rows = []
    for label, count in buckets.items():
        width = 100.0 * count / highest if highest else 0.0
        gap = ' class="gap"' if count == 0 else ""
        style = f' style="width: {width:.1f}%"' if count else ""
        rows.append(
            f'<tr data-bucket="{_e(label)}"{gap}><th scope="row">{_e(label)}</th>'
            f'<td class="bar-cell"><div class="bar"{style}></div></td><td class="count">{count}</td></tr>'
        )
    shares = [
        (key.removeprefix("share_with_").removesuffix("_decodes"), value)
        for key, value in longest.items()
        if isinstance(key, str) and key.startswith("share_with_") and isinstance(value, int | float)
    ]
    share = "".join(
        f'<p class="muted">{value:.0%} of the examples reached {_e(decodes)}+ decodes in one session.</p>'
        for decodes, value in shares
    )
    table = (
        f'<table class="histogram"><tbody>{"".join(rows)}</tbody></table>'
        if rows
        else '<p class="muted">the report holds no session lengths</p>'
    )
    return (
        '<section id="sessions"><h2>Session history lengths reached</h2>'
        f'<p class="muted">{_e(_plural(examples, "example"))} by the accepted decodes of their longest '
        "session epoch: a run whose sessions stay short cannot find the bugs of long histories.</p>"
        f"{table}{share}</section>"
    )


# --- the run -----------------------------------------------------------------------------------


def _run_facts(document: Mapping[str, Any], failures: Sequence[Mapping[str, Any]]) -> str:
    run = _mapping(document.get("run"))
    versions = _mapping(run.get("versions"))
    facts: list[tuple[str, str]] = [
        ("target", f"<code>{_e(document.get('target'))}</code>"),
        ("seed", _e(_text(document.get("seed")))),
        ("examples", _e(_text(document.get("examples")))),
        ("steps", _e(_text(document.get("steps")))),
        ("elapsed", _e(_seconds(document.get("elapsed_s")))),
    ]
    options = run.get("options")
    if isinstance(options, Mapping):
        rows = "".join(
            f'<tr><th scope="row">{_e(key)}</th><td class="mono">{_e(_text(value) or "—")}</td></tr>'
            for key, value in options.items()
        )
        facts.append(("options", f'<table class="options">{rows}</table>'))
    else:
        facts.append(("options", '<span class="muted">not recorded in this report (see the rerun command)</span>'))
    shown_versions = {"shardkit": document.get("shardkit_version"), **versions}
    facts.append(
        (
            "versions",
            " · ".join(
                f'{_e(name)} <span class="version mono" data-package="{_e(name)}">{_e(_text(version))}</span>'
                for name, version in shown_versions.items()
                if version is not None
            ),
        )
    )
    rerun = run.get("rerun_command")
    if isinstance(rerun, str) and rerun:
        facts.append(("rerun the whole run", f'<code class="rerun_command">{_e(rerun)}</code>'))
    for number, failure in enumerate(failures, start=1):
        replay = failure.get("replay_command")
        if isinstance(replay, str) and replay:
            facts.append((f"replay failure {number}", f'<code class="replay_command">{_e(replay)}</code>'))
    examples = document.get("examples")
    for check, skipped in _mapping(document.get("not_checked")).items():
        facts.append(("not checked", _e(f"in {_text(skipped)} of {_text(examples)} examples: {check}")))
    rows = "".join(f"<dt>{_e(label)}</dt><dd>{value}</dd>" for label, value in facts)
    return f'<section id="run"><h2>Run</h2><dl class="facts">{rows}</dl></section>'


# --- reading values ------------------------------------------------------------------------------


def _e(value: object) -> str:
    """``value`` as HTML text or attribute value: every string a report holds is untrusted."""
    return html.escape("" if value is None else str(value), quote=True)


def _text(value: object) -> str:
    """A JSON value as a person reads it; ``""`` for null."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return json.dumps(value, ensure_ascii=False, sort_keys=False, default=str)


def _short(text: str, limit: int = 240) -> str:
    return text if len(text) <= limit else f"{text[: limit - 1]}…"


def _arguments(args: object) -> str:
    """A step's arguments as the printed failure shows them, its session left to its lane."""
    shown = []
    for key, value in _mapping(args).items():
        if key == "session" or value is None or key == "lanes":
            continue
        if isinstance(value, list):
            items = ", ".join(_text(item) for item in value[:SHOWN_TOKENS])
            more = f", … {len(value)} in all" if len(value) > SHOWN_TOKENS else ""
            shown.append(f"{key}=[{items}{more}]")
        else:
            shown.append(f"{key}={value!r}" if isinstance(value, str) else f"{key}={_text(value)}")
    return ", ".join(shown)


def _session(step: Mapping[str, Any]) -> str | None:
    session = step.get("session")
    if isinstance(session, str):
        return session
    # A report written before steps carried their session: the argument names it.
    named = _mapping(step.get("args")).get("session")
    return named if isinstance(named, str) else None


def _lanes(step: Mapping[str, Any]) -> list[list[Mapping[str, Any]]]:
    """A parallel phase's calls by lane (the report's ``lanes``, or the step's arguments)."""
    lanes = step.get("lanes")
    if not isinstance(lanes, list):
        lanes = _mapping(step.get("args")).get("lanes") if step.get("op") == "parallel" else None
        if not isinstance(lanes, list):
            return []
        lanes = [
            [{**_mapping(call), "call": f"{_lane_name(number)}{index}"} for index, call in enumerate(_list(lane), 1)]
            for number, lane in enumerate(lanes)
        ]
    return [[call for call in _list(lane) if isinstance(call, Mapping)] for lane in lanes]


def _lane_name(number: int) -> str:
    return chr(ord("A") + number) if number < 26 else str(number)


def _step_number(step: Mapping[str, Any], position: int | None) -> str:
    index = step.get("index")
    if isinstance(index, int) and not isinstance(index, bool):
        return str(index)
    return str(position + 1) if position is not None else "?"


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _count(value: object) -> int:
    number = _int(value)
    return number if number is not None and number > 0 else 0


def _plural(count: object, noun: str) -> str:
    number = _int(count)
    if number is None:
        return ""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def _seconds(value: object) -> str:
    return f"{value:.1f} s" if isinstance(value, int | float) and not isinstance(value, bool) else ""


def _json_type(value: object) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
