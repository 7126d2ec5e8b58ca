"""The documentation ships with the kit: every property the kit reports, and every page
and anchor its messages and docs cite, exists in the repository's docs/."""

from __future__ import annotations

import ast
import re
import tempfile
from pathlib import Path

import pytest

from shardkit._core.properties import CONTRACT_DOC, LABEL_ANCHORS, read_more
from shardkit._planted import PLANTED

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TESTS = ROOT / "tests"
SOURCES = sorted((ROOT / "shardkit").rglob("*.py"))
USER_TEXTS = [
    ROOT / "README.md",
    *sorted(DOCS.glob("*.md")),
    *SOURCES,
    *sorted((ROOT / "stateful").glob("*.py")),
    TESTS / "README.md",
]


def anchors_of(page: Path) -> set[str]:
    return set(re.findall(r'<a id="([^"]+)"></a>', page.read_text(encoding="utf-8")))


def labels_the_kit_reports() -> set[str]:
    """Property labels written in the kit's code: string constants such as "§3 determinism",
    "§2 " + each rule the reference model decides by, and the planted engines' properties."""
    labels: set[str] = set()
    for source in SOURCES:
        tree = ast.parse(source.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            text = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ""
            if re.fullmatch(r"§\d [a-z_]+( [a-z_0-9]+)*", text):
                labels.add(text)
    model = (ROOT / "shardkit" / "_core" / "model.py").read_text(encoding="utf-8")
    for call in ast.walk(ast.parse(model)):
        if isinstance(call, ast.Call) and getattr(call.func, "id", None) in ("Prediction", "refuse"):
            rule = call.args[2] if getattr(call.func, "id", None) == "Prediction" else call.args[1]
            if isinstance(rule, ast.Constant) and isinstance(rule.value, str):
                labels.add(f"§2 {rule.value}")
    for engine in PLANTED:
        labels.update((engine.PROPERTY, *getattr(engine, "ALSO", ())))
    return labels


def test_the_scan_finds_the_labels_it_should() -> None:
    """The scan above is not vacuous: it sees rules of every section."""
    labels = labels_the_kit_reports()
    assert {"§2 rule 1", "§2 rule 8", "§2 metrics", "§3 determinism", "§4 crash"} <= labels


@pytest.mark.parametrize("label", sorted(labels_the_kit_reports()))
def test_every_property_the_kit_reports_has_a_section_in_the_contract(label: str) -> None:
    assert label in LABEL_ANCHORS, f"{label!r} has no anchor: add it to shardkit/_core/properties.py and docs/contract.md"
    assert LABEL_ANCHORS[label] in anchors_of(ROOT / CONTRACT_DOC), f"docs/contract.md lacks <a id=\"{LABEL_ANCHORS[label]}\"></a>"


def test_a_failure_names_where_its_rule_is_explained() -> None:
    assert read_more("§2 rule 4") == "docs/contract.md#rule-4"
    assert read_more("§2 rule 1 and §4 crash") == "docs/contract.md#rule-1, docs/contract.md#fault-crash"
    assert read_more("§2 rule 10") is None  # no rule 10: not read as rule 1
    assert read_more("process killed by SIGSEGV") is None


def cited_links(text: Path) -> list[tuple[Path, str]]:
    """(page, anchor) of each docs/ page a file links or names: ``docs/x.md#a`` anywhere, and
    relative links ``(x.md#a)`` inside docs/."""
    found: list[tuple[Path, str]] = []
    content = text.read_text(encoding="utf-8")
    for page, anchor in re.findall(r"docs/([\w-]+\.md)(?:#([\w-]+))?", content):
        found.append((DOCS / page, anchor))
    if text.parent == DOCS:
        for page, anchor in re.findall(r"\]\(([\w-]+\.md)(?:#([\w-]+))?\)", content):
            found.append((DOCS / page, anchor))
        for anchor in re.findall(r"\]\(#([\w-]+)\)", content):
            found.append((text, anchor))
    return found


@pytest.mark.parametrize("text", USER_TEXTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_page_and_anchor_cited_exists(text: Path) -> None:
    missing = [
        f"{page.name}#{anchor}" if anchor else page.name
        for page, anchor in cited_links(text)
        if not page.is_file() or (anchor and anchor not in anchors_of(page))
    ]
    assert not missing, f"{text.relative_to(ROOT)} cites what docs/ does not have: {sorted(set(missing))}"


@pytest.mark.parametrize("text", USER_TEXTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_nothing_a_user_reads_points_outside_the_repository(text: Path) -> None:
    content = text.read_text(encoding="utf-8")
    # The team's design notes (outside the repository), and this checkout's own location: the
    # folder that holds it, unless that is the system's temporary folder, which examples such
    # as ``unix:/tmp/shard.sock`` name on purpose (a clone made by ``mktemp -d`` lives there).
    holder = f"{ROOT.parent}/" if ROOT.parent != Path(tempfile.gettempdir()).resolve() else f"{ROOT}/"
    words = ("../shared", "SPEC.md", "SHRINKING.md", "SPEC §", holder)
    outside = [word for word in words if word in content]
    assert not outside, f"{text.relative_to(ROOT)} points outside the repository: {outside}"


def layout_table() -> list[str]:
    """The paths of the README's layout table."""
    section = (ROOT / "README.md").read_text(encoding="utf-8").split("## Layout", 1)[1]
    return re.findall(r"^\| `([^`]+)` \|", section, flags=re.MULTILINE)


def test_the_readme_layout_table_matches_the_tree() -> None:
    paths = layout_table()
    assert len(paths) >= 10, paths
    missing = [path for path in paths if not (ROOT / path).exists()]
    assert not missing, f"the README's layout names paths that do not exist: {missing}"
    incidental = {"__main__.py", "_version.py", "py.typed", "__pycache__"}
    rooms = [
        f"shardkit/{entry.name}" + ("/" if entry.is_dir() else "")
        for entry in sorted((ROOT / "shardkit").iterdir())
        if entry.name not in incidental
    ]
    unlisted = [room for room in rooms if room not in paths]
    assert not unlisted, f"the README's layout does not say what these hold: {unlisted}"


def listed_in_tests_readme() -> list[str]:
    """The paths of tests/README.md's table (its first column)."""
    return re.findall(r"^\| `([^`]+)` \|", (TESTS / "README.md").read_text(encoding="utf-8"), flags=re.MULTILINE)


def test_the_tests_readme_names_every_file_of_tests_and_cites_no_spec() -> None:
    """tests/README.md says what each file and folder of tests/ holds, and cites the contract
    (docs/contract.md), not the design notes outside the repository."""
    listed = listed_in_tests_readme()
    present = [
        entry.name + ("/" if entry.is_dir() else "")
        for entry in sorted(TESTS.iterdir())
        if entry.name not in {"__pycache__", "__init__.py", "README.md"} and not entry.name.startswith(".")
    ]
    assert len(present) >= 50, present  # the scan sees the suite
    unlisted = [entry for entry in present if entry not in listed]
    assert not unlisted, f"tests/README.md's table does not say what these hold: {unlisted}"
    gone = [path for path in listed if not (TESTS / path).exists()]
    assert not gone, f"tests/README.md's table names paths that do not exist: {gone}"
    assert "SPEC" not in (TESTS / "README.md").read_text(encoding="utf-8"), "cite docs/contract.md, not SPEC"
