"""The HTML report (``shardkit report``, ``shardkit fuzz --html``): real planted failures
drawn and opened in headless Chromium, whose rendered DOM and screenshot are checked; and
the page's escaping, its other shapes (no failure, several) and the command's errors.

Chromium is Debian's ``chromium``; without it the browser tests skip, unless
SHARDKIT_REQUIRE_CHROMIUM=1 (CI sets it) turns the skip into a failure."""

from __future__ import annotations

import copy
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import hypothesis
import pytest

from shardkit import __version__
from shardkit._cli.main import main
from shardkit._html import render_html, write_html
from shardkit._html.render import OPERATIONS, OUTCOMES
from shardkit._run.options import Budgets, FuzzOptions
from shardkit._run.report import report_document
from shardkit._run.runner import fuzz

#: A planted bug whose minimal failure holds a fault step: found at seed 1 within 10 examples.
PLANTED_TARGET = "shardkit._planted:MemoryPressureIgnored"
#: A planted race, found with two lanes; the race shows on some runs only, so seeds 1-3 are tried.
RACY_TARGET = "shardkit._planted.racy:DecodeCounterLostUpdate"
#: Finding the race is what counts here, not how short it gets: little shrinking.
FINDING_ONLY = Budgets(shrink_steps=3_000, shrink_examples=300)
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
HOSTILE = """<script>alert("lane")</script><img src=x onerror=alert(1)>&amp;'"""


# --- reading a page -------------------------------------------------------------------------------


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    children: list[Element] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def text(self) -> str:
        return "".join(self.parts) + "".join(child.text() for child in self.children)

    def walk(self) -> Iterator[Element]:
        yield self
        for child in self.children:
            yield from child.walk()

    def find_all(self, tag: str | None = None, *, cls: str | None = None, **attrs: str) -> list[Element]:
        """Elements below (and including) this one with the tag, class and attribute values given
        (``data_step="2"`` matches ``data-step``)."""
        wanted = {name.replace("_", "-"): value for name, value in attrs.items()}
        return [
            element
            for element in self.walk()
            if (tag is None or element.tag == tag)
            and (cls is None or cls in element.classes)
            and all(element.attrs.get(name) == value for name, value in wanted.items())
        ]

    def one(self, tag: str | None = None, *, cls: str | None = None, **attrs: str) -> Element:
        found = self.find_all(tag, cls=cls, **attrs)
        assert len(found) == 1, f"{len(found)} elements match {tag} .{cls} {attrs}"
        return found[0]


class _TreeBuilder(HTMLParser):
    VOID = frozenset({"meta", "link", "br", "img", "input", "hr", "col", "source", "wbr", "area", "base"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = Element(tag, {name: value or "" for name, value in attrs})
        self.stack[-1].children.append(element)
        if tag not in self.VOID:
            self.stack.append(element)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.stack[-1].children.append(Element(tag, {name: value or "" for name, value in attrs}))

    def handle_endtag(self, tag: str) -> None:
        for depth in range(len(self.stack) - 1, 0, -1):
            if self.stack[depth].tag == tag:
                del self.stack[depth:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].parts.append(data)


def parse(page: str) -> Element:
    builder = _TreeBuilder()
    builder.feed(page)
    builder.close()
    return builder.root


# --- the browser ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chromium() -> str:
    found = shutil.which("chromium")
    if found is None:
        reason = "headless Chromium is not installed (Debian: apt-get install chromium)"
        if os.environ.get("SHARDKIT_REQUIRE_CHROMIUM") == "1":
            pytest.fail(f"SHARDKIT_REQUIRE_CHROMIUM=1, but {reason}", pytrace=False)
        pytest.skip(reason)
    return found


@dataclass
class Rendered:
    dom: Element
    screenshot: Path


def open_in_chromium(chromium: str, page: Path, work: Path) -> Rendered:
    """The DOM Chromium built from ``page`` and a 1280-pixel-wide screenshot of it, from one run
    of a fresh browser profile (nothing it remembers from another run can change what it draws)."""
    screenshot = work / f"{page.stem}.png"
    command = [
        chromium,
        *CHROMIUM_FLAGS,
        f"--user-data-dir={work / 'profile'}",
        f"--screenshot={screenshot}",
        "--window-size=1280,2000",
        "--dump-dom",
        page.resolve().as_uri(),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "<body" in done.stdout, f"Chromium printed no DOM; its stderr ends with: {done.stderr[-2000:]}"
    return Rendered(parse(done.stdout), screenshot)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE), f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk comes first
    return width, height


# --- real failures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """A planted failure found by ``shardkit fuzz --report --html``: its report and its page."""
    work = tmp_path_factory.mktemp("planted")
    report, page = work / "report.json", work / "report.html"
    argv = ["fuzz", PLANTED_TARGET, "--seed", "1", "--examples", "50", "--out", str(work / "out")]
    code = main([*argv, "--report", str(report), "--html", str(page)])
    assert code == 1, "the planted bug was not found"
    return json.loads(report.read_text(encoding="utf-8")), page


@pytest.fixture(scope="module")
def racy(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """A planted race found with two lanes, its report written from Python and drawn."""
    work = tmp_path_factory.mktemp("racy")
    options = FuzzOptions(examples=100, faults="none", concurrency=2, minimize=False, budgets=FINDING_ONLY)
    for seed in (1, 2, 3):
        result = fuzz(RACY_TARGET, options, seed=seed, out=work / "out")
        if result.failure is not None:
            break
    assert result.failure is not None, f"{RACY_TARGET} was not found at seeds 1-3"
    document = report_document(result, options)
    return document, write_html(document, work / "racy.html")


def sessions_of(steps: list[dict[str, Any]]) -> set[str]:
    sessions = {step["session"] for step in steps if step["session"] is not None}
    for step in steps:
        sessions |= {call["session"] for lane in step["lanes"] or [] for call in lane if call["session"] is not None}
    return sessions


def assert_heatmap_and_histogram(dom: Element, document: Mapping[str, Any]) -> None:
    heatmap = dom.one("table", cls="heatmap")
    operations = [row.attrs["data-op"] for row in heatmap.find_all("tr") if "data-op" in row.attrs]
    outcomes = [head.attrs["data-outcome"] for head in heatmap.find_all("th") if "data-outcome" in head.attrs]
    assert set(OPERATIONS) <= set(operations)
    assert set(OUTCOMES) <= set(outcomes)
    cells = heatmap.find_all("td", cls="cell")
    assert len(cells) == len(operations) * len(outcomes)
    for op in operations:
        for outcome in outcomes:
            cell = heatmap.one("td", cls="cell", data_op=op, data_outcome=outcome)
            count = document["coverage"].get(op, {}).get(outcome, 0)
            assert cell.text() == str(count), (op, outcome)
            assert ("gap" in cell.classes) == (count == 0), (op, outcome, cell.classes)
    assert any("gap" in cell.classes for cell in cells)  # a run never reaches every pair
    histogram = dom.one("table", cls="histogram")
    for bucket, count in document["longest_session"]["decodes_histogram"].items():
        row = histogram.one("tr", data_bucket=bucket)
        assert row.one("td", cls="count").text() == str(count)


def assert_run_facts(dom: Element, document: Mapping[str, Any]) -> None:
    facts = dom.one("section", id="run")
    text = facts.text()
    assert document["target"] in text
    assert str(document["seed"]) in text
    assert facts.one("span", data_package="shardkit").text() == __version__
    assert facts.one("span", data_package="hypothesis").text() == hypothesis.__version__
    assert facts.one("code", cls="rerun_command").text() == document["run"]["rerun_command"]
    replays = [code.text() for code in facts.find_all("code", cls="replay_command")]
    assert replays == [failure["replay_command"] for failure in document["failures"]]
    assert all(replay.startswith("shardkit replay ") for replay in replays)
    options = document["run"]["options"]
    shown = {row.one("th").text(): row.one("td").text() for row in facts.one("table", cls="options").find_all("tr")}
    assert set(shown) == set(options)
    for name in ("examples", "faults", "concurrency"):
        assert shown[name] == str(options[name]), name


def test_a_planted_failure_renders_in_chromium(
    chromium: str, planted: tuple[dict[str, Any], Path], tmp_path: Path
) -> None:
    document, page = planted
    rendered = open_in_chromium(chromium, page, tmp_path)
    dom = rendered.dom
    failure = document["failures"][0]
    section = dom.one("section", cls="failure", id="failure-1")

    # The violating step: highlighted, with expected vs observed and the rule it breaks.
    violating = section.one("tr", cls="violating")
    assert violating.attrs["data-step"] == str(failure["violating_step"]) == str(len(failure["steps"]))
    assert violating.find_all("div", cls="violating"), "the violating step's card is not marked"
    last = failure["steps"][-1]
    # MemoryPressureIgnored serves a prefill that a pressure of 0 tokens leaves no room for.
    assert (last["expected_status"], last["expected_cache"]) == ("RESOURCE_EXHAUSTED", "MISS")
    assert (last["observed_status"], last["observed_cache"]) == ("OK", "MISS")
    assert all("differs" in answer.classes for answer in violating.find_all("span", cls="answer"))
    assert len(section.find_all("tr", cls="step")) == len(failure["steps"])
    box = section.one("div", cls="violation")
    assert failure["property"] in box.text()
    assert box.one("code", cls="rule").text() == failure["read_more"] == "docs/contract.md#rule-7"
    assert box.one("dd", cls="expected").text() == last["expected"]
    assert box.one("dd", cls="observed").text() == last["observed"]

    # One lane per session; the fault marked where it was injected.
    lanes = {head.attrs["data-session"] for head in section.find_all("th", cls="lane")}
    assert lanes == sessions_of(failure["steps"]) != set()
    assert failure["faults"], "the planted failure holds no fault step"
    for fault in failure["faults"]:
        row = section.one("tr", data_step=str(fault["step"]))
        assert fault["kind"] in row.one("div", cls="fault-mark").text()
    # Each step's status and cache result, expected and observed.
    for step in failure["steps"]:
        row = section.one("tr", data_step=str(step["index"]))
        badges = [badge.text() for badge in row.find_all("span", cls="badge")]
        for key in ("expected_status", "expected_cache", "observed_status", "observed_cache"):
            if step[key] is not None:
                assert step[key] in badges, (key, step)

    assert_heatmap_and_histogram(dom, document)
    assert_run_facts(dom, document)
    assert png_size(rendered.screenshot) == (1280, 2000)
    assert rendered.screenshot.stat().st_size > 10_000  # a blank page compresses to far less


def test_a_campaigns_page_is_rewritten_as_its_rounds_end_and_reloads_until_the_last(chromium: str, tmp_path: Path) -> None:
    page = tmp_path / "campaign.html"
    command = [sys.executable, "-m", "shardkit", "campaign", "shardkit._planted:ReleaseLeaksKvTokens", "--workers", "1",
               "--minutes", "0.2", "--seed", "7", "--examples", "10", "--steps", "20", "--out", "out", "--html", str(page)]  # fmt: skip
    running = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    snapshots: list[str] = []
    try:
        while running.poll() is None:  # pytest-timeout bounds this
            text = page.read_text(encoding="utf-8") if page.exists() else ""
            if 'http-equiv="refresh"' in text and text not in snapshots:
                snapshots.append(text)
            time.sleep(0.02)
        out, err = running.communicate(timeout=60)
    finally:
        running.kill()
    assert running.returncode == 1, (out, err)
    assert snapshots, "the page was never rewritten while the campaign ran"
    final = page.read_text(encoding="utf-8")
    assert 'http-equiv="refresh"' not in final, "the last page reloads for ever"

    # The first page a person could have opened, drawn by Chromium: the rounds so far and the failure so far.
    live = tmp_path / "live.html"
    live.write_text(snapshots[0], encoding="utf-8")
    dom = open_in_chromium(chromium, live, tmp_path).dom
    campaign = dom.one("section", id="campaign")
    assert campaign.one("p", cls="live").text().startswith("running: the rounds finished so far")
    facts = dict(zip((dt.text() for dt in campaign.find_all("dt")), (dd.text() for dd in campaign.find_all("dd")), strict=True))
    assert facts["in_progress"] == "true"
    rounds_so_far = int(facts["rounds"])
    assert rounds_so_far >= 1
    assert len(campaign.one("table", cls="seeds").find_all("tr")) == 1 + rounds_so_far
    assert dom.one("p", cls="verdict").text() == "1 failure: §2 metrics"
    final_facts = parse(final).one("section", id="campaign")
    assert "in_progress" in final_facts.text()
    assert "running: the rounds finished so far" not in final_facts.text()


def test_a_race_renders_each_concurrency_lane_in_chromium(
    chromium: str, racy: tuple[dict[str, Any], Path], tmp_path: Path
) -> None:
    document, page = racy
    rendered = open_in_chromium(chromium, page, tmp_path)
    failure = document["failures"][0]
    phase_step = failure["steps"][-1]
    assert phase_step["op"] == "parallel"
    assert phase_step["violating"] is True
    section = rendered.dom.one("section", cls="failure", id="failure-1")
    phase = section.one("tr", cls="violating").one("div", cls="phase")
    assert "violating" in phase.classes
    lanes = [head.attrs["data-lane"] for head in phase.find_all("th", cls="concurrency-lane")]
    assert lanes == ["A", "B"]
    calls = [call for lane in phase_step["lanes"] for call in lane]
    assert {call.attrs["data-call"] for call in phase.find_all("div", cls="lane-call")} == {
        call["call"] for call in calls
    }
    # The phase's clock: each call spans the ticks it ran for, as the failure message shows them.
    for call in calls:
        assert isinstance(call["started"], int), call
        assert isinstance(call["ended"], int), call
        assert call["answer"].startswith(call["observed_status"]), call
        cell = phase.one("div", cls="lane-call", data_call=call["call"])
        assert f"[{call['started']}-{call['ended']}]" in cell.text()
    lanes_drawn = {head.attrs["data-session"] for head in section.find_all("th", cls="lane")}
    assert lanes_drawn == sessions_of(failure["steps"]) != set()
    assert_heatmap_and_histogram(rendered.dom, document)
    assert_run_facts(rendered.dom, document)
    assert png_size(rendered.screenshot)[0] == 1280


# --- the page without a browser --------------------------------------------------------------------


def test_every_string_of_a_hostile_report_is_escaped(planted: tuple[dict[str, Any], Path]) -> None:
    document = copy.deepcopy(planted[0])
    failure = document["failures"][0]
    for step in failure["steps"]:
        if step["session"] is not None:
            step["session"] = step["args"]["session"] = HOSTILE
        step["expected"] = step["observed"] = step["note"] = HOSTILE
        step["observed_status"] = HOSTILE
    failure["property"] = failure["message"] = failure["replay_command"] = HOSTILE
    document["target"] = HOSTILE
    document["coverage"][HOSTILE] = {HOSTILE: 3}
    document["campaign"] = {HOSTILE: HOSTILE}
    page = render_html(document)
    dom = parse(page)
    assert not dom.find_all("script")
    assert not dom.find_all("img")
    handlers = [name for element in dom.walk() for name in element.attrs if name.startswith("on")]
    assert not handlers
    assert HOSTILE not in page
    assert html_text_of(HOSTILE) in page
    # Escaped, the value reads back exactly: in a lane's heading, a cell, a step.
    assert {head.attrs["data-session"] for head in dom.find_all("th", cls="lane")} == {HOSTILE}
    assert dom.one("td", cls="cell", data_op=HOSTILE, data_outcome=HOSTILE).text() == "3"
    assert [code.text() for code in dom.find_all("code", cls="replay_command")] == [HOSTILE, HOSTILE]


def html_text_of(value: str) -> str:
    return (
        value.replace("&", "&amp;")
        .replace("<", "&lt;")
        .replace(">", "&gt;")
        .replace('"', "&quot;")
        .replace("'", "&#x27;")
    )


def test_the_page_fetches_nothing(planted: tuple[dict[str, Any], Path]) -> None:
    page = planted[1].read_text(encoding="utf-8")
    for outside in ("http://", "https://", "src=", "<link", "url(", "@import", "<script"):
        assert outside not in page, outside
    policy = parse(page).one("meta", http_equiv="Content-Security-Policy").attrs["content"]
    assert "default-src 'none'" in policy


def test_a_run_without_a_failure_shows_its_coverage_and_says_so(tmp_path: Path) -> None:
    options = FuzzOptions(examples=3, steps=10)
    result = fuzz("shardkit:FakeShardEngine", options, seed=1, out=tmp_path)
    assert result.failure is None
    document = report_document(result, options)
    assert document["failures"] == []
    assert document["run"]["options"]["examples"] == 3
    dom = parse(render_html(document))
    assert dom.one("p", cls="verdict").text() == "no failure found"
    assert not dom.find_all("section", cls="failure")
    assert_heatmap_and_histogram(dom, document)
    assert not dom.one("section", id="run").find_all("code", cls="replay_command")


def test_several_failures_each_get_their_section(planted: tuple[dict[str, Any], Path]) -> None:
    """What ``shardkit campaign`` draws: the same schema with a ``campaign`` object and a failure per finding."""
    document = copy.deepcopy(planted[0])
    first = document["failures"][0]
    second = {**copy.deepcopy(first), "property": "§2 rule 4", "read_more": "docs/contract.md#rule-4"}
    second["steps"] = second["steps"][-1:]
    second["replay_command"] = "shardkit replay other-trace.json"
    second["rerun_command"] = "shardkit fuzz engine.py:Engine --seed 1234"
    second["found_in_rounds"] = 3
    document["failures"] = [first, second]
    seeds = [{"worker": 1, "round": 1, "seed": 1234}, {"worker": 2, "round": 1, "seed": 5678}]
    document["campaign"] = {"workers": 2, "rounds": 6, "seeds": seeds, "errors": []}
    dom = parse(render_html(document))
    sections = dom.find_all("section", cls="failure")
    assert [section.attrs["id"] for section in sections] == ["failure-1", "failure-2"]
    assert [section.attrs["data-property"] for section in sections] == [first["property"], "§2 rule 4"]
    for section, failure in zip(sections, document["failures"], strict=True):
        assert len(section.find_all("tr", cls="step")) == len(failure["steps"])
        assert len(section.find_all("tr", cls="violating")) == 1
        assert section.one("code", cls="rule").text() == failure["read_more"]
    assert "2 failures" in dom.one("p", cls="verdict").text()
    campaign = dom.one("section", id="campaign")
    assert "workers" in campaign.text()
    seed_rows = campaign.one("table", cls="seeds").find_all("tr")[1:]
    assert [[cell.text() for cell in row.find_all("td")] for row in seed_rows] == [["1", "1", "1234"], ["2", "1", "5678"]]
    assert "errors" not in campaign.text(), "an empty list of errors is no fact worth a row"
    assert sections[1].one("code", cls="rerun_command").text() == second["rerun_command"]
    assert sections[1].one("dd", cls="found_in_rounds").text() == "3 rounds"
    replays = [code.text() for code in dom.one("section", id="run").find_all("code", cls="replay_command")]
    assert replays == [first["replay_command"], "shardkit replay other-trace.json"]


def test_a_report_of_the_first_schema_still_renders(planted: tuple[dict[str, Any], Path]) -> None:
    """A report written before the keys the page adds (a colleague's older shardkit): drawn from
    what it holds, the failing step still the last one."""
    document = copy.deepcopy(planted[0])
    del document["run"]
    failure = document["failures"][0]
    for key in ("violating_step", "read_more", "replay_command", "regression_test"):
        del failure[key]
    failure["steps"] = [{key: step[key] for key in ("op", "args", "expected", "observed")} for step in failure["steps"]]
    dom = parse(render_html(document))
    section = dom.one("section", cls="failure")
    assert section.one("tr", cls="violating").attrs["data-step"] == str(len(failure["steps"]))
    assert section.one("code", cls="rule").text() == "docs/contract.md#rule-7"
    assert {head.attrs["data-session"] for head in section.find_all("th", cls="lane")} == {"a"}


# --- the command line ------------------------------------------------------------------------------


def test_shardkit_report_writes_the_page(
    capsys: pytest.CaptureFixture[str], planted: tuple[dict[str, Any], Path], tmp_path: Path
) -> None:
    source = tmp_path / "run.json"
    source.write_text(json.dumps(planted[0]), encoding="utf-8")
    assert main(["report", str(source), "-o", str(tmp_path / "page.html")]) == 0
    assert main(["report", str(source)]) == 0  # beside it, by default
    out = capsys.readouterr().out
    assert f"html: {tmp_path / 'page.html'}" in out
    assert f"html: {tmp_path / 'run.html'}" in out
    for page in ("page.html", "run.html"):
        assert (tmp_path / page).read_text(encoding="utf-8") == render_html(planted[0])


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("case", "named", "fix"),
    [
        ("missing", "{tmp}/none.json", "name the JSON file"),
        ("folder", "{tmp}", "is a folder"),
        ("not JSON", "{tmp}/broken.json", "is not JSON (line 1 column"),
        ("not UTF-8", "{tmp}/binary.json", "is not UTF-8 text"),
        ("an array", "{tmp}/array.json", "is not a shardkit report: it holds a JSON array"),
        ("another object", "{tmp}/other.json", "is not a shardkit report: it has no 'shardkit_version'"),
        ("a trace", "{tmp}/trace.json", "is a failure trace, not a run report; replay it with `shardkit replay"),
        ("-o a folder", "{tmp}", "-o {tmp} is a folder; name a file"),
        ("-o nowhere", "{tmp}/gone/page.html", "the folder {tmp}/gone does not exist"),
        ("-o itself", "{tmp}/report.json", "-o {tmp}/report.json is the report itself"),
    ],
)
def test_shardkit_report_refuses_a_mistake_in_one_line(
    capsys: pytest.CaptureFixture[str],
    planted: tuple[dict[str, Any], Path],
    tmp_path: Path,
    case: str,
    named: str,
    fix: str,
) -> None:
    report = _write(tmp_path / "report.json", json.dumps(planted[0]))
    _write(tmp_path / "broken.json", '{"target": ')
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00garbage")
    _write(tmp_path / "array.json", "[1, 2]")
    _write(tmp_path / "other.json", '{"name": "x"}')
    _write(tmp_path / "trace.json", '{"format": "shardkit-trace", "version": 1}')
    value = named.format(tmp=tmp_path)
    argv = ["report", str(report), "-o", value] if case.startswith("-o") else ["report", value]
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, (case, captured.out, captured.err)
    assert "Traceback" not in captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("shardkit report: ")
    assert value in lines[0]
    assert fix.format(tmp=tmp_path) in lines[0]


def test_fuzz_checks_its_html_file_before_the_run(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(["fuzz", "--seed", "1", "--out", str(tmp_path / "out"), "--html", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 2
    assert (
        captured.err.strip()
        == f"shardkit fuzz: --html {tmp_path} is a folder; name a file, e.g. {tmp_path / 'report.html'}"
    )
    assert captured.out == ""  # refused before anything ran
    both = tmp_path / "run.json"
    code = main(["fuzz", "--seed", "1", "--out", str(tmp_path / "out"), "--report", str(both), "--html", str(both)])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.startswith(f"shardkit fuzz: --html {both} is the --report file too; name each its own file")
    assert captured.out == ""
