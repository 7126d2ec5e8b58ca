"""Every command of the README's ```bash blocks runs as written, from a fresh copy of the
repository (issue 12 §8): a README command that breaks fails this test.

Commands are taken block by block (a ``\\`` continues a line, ``&&`` chains are split into
their parts), so the README may change freely. A part is skipped only when it matches an
entry of ``SKIPPED`` below, which says why; everything else runs in a copy of the
repository (without ``.git``, ``.venv`` or earlier failures, so nothing lands in the real
one), with this environment's ``shardkit``, ``python3`` and ``pytest`` first on ``PATH``
and no ``PYTHONPATH``, as after ``pip install -e .`` in a fresh clone. A part must exit 0,
or the code its comment states ("# exit 1: ...").
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
README = REPO_ROOT / "README.md"
VENV_BIN = Path(sys.executable).parent
SECONDS_PER_COMMAND = 600

#: (substring of a command, why it is not run here); the first match wins.
SKIPPED: tuple[tuple[str, str], ...] = (
    ("python3 -m venv", "creates the virtual environment this test already runs in"),
    ("pip install", "installs packages: this test runs in the environment they were installed into"),
    ("ruff check", "CI runs it as a step of its own (.ci/run)"),
    ("mypy --strict", "CI runs it as a step of its own (.ci/run)"),
    ("llama_cpp", "compiles or runs llama.cpp (the llama extra): minutes; tests/test_llama_cpp.py covers the engine"),
    ("grpc://127.0.0.1:7000", "talks to the `shardkit serve … &` started in the background by the line before"),
    ("my_pkg", "a placeholder for the reader's own engine"),
    ("path/to/", "a placeholder for the reader's own engine file"),
    ("myengine", "a placeholder for a trace of the reader's own engine"),
)


@dataclass(frozen=True)
class Command:
    block: int
    text: str

    @property
    def expected_exit(self) -> int:
        stated = re.search(r"#.*?\bexit (\d+)", self.text)
        return int(stated.group(1)) if stated else 0


def bash_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", markdown, flags=re.DOTALL | re.MULTILINE)


def commands(markdown: str) -> list[Command]:
    """Each command of each bash block, continuations joined and ``&&`` chains split."""
    found = []
    for number, block in enumerate(bash_blocks(markdown), start=1):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            code, hash_mark, comment = line.partition(" #")
            for part in code.split("&&"):
                found.append(Command(number, part.strip() + (f"  #{comment}" if hash_mark else "")))
    return found


def skip_reason(command: Command) -> str | None:
    if command.text.split("#")[0].rstrip().endswith("&"):
        return "starts a server in the background"
    for fragment, reason in SKIPPED:
        if fragment in command.text:
            return reason
    bare = command.text.split("#")[0].split()
    if bare and Path(bare[-1]).name == "pytest" and len(bare) <= 2:
        return "the whole test suite: it includes this test"
    return None


ALL = commands(README.read_text(encoding="utf-8"))


def test_the_readme_has_commands_and_some_of_them_run() -> None:
    """Extraction found the blocks, and the skip table did not swallow everything."""
    assert len(bash_blocks(README.read_text(encoding="utf-8"))) >= 3
    assert [command for command in ALL if skip_reason(command) is None]


@pytest.fixture(scope="module")
def fresh_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository as a fresh clone has it, with this environment as its .venv."""
    copy = tmp_path_factory.mktemp("clone") / "shardkit"
    ignored = shutil.ignore_patterns(".git", ".venv", ".shardkit", "__pycache__", "*.egg-info", "build", "dist")
    shutil.copytree(REPO_ROOT, copy, ignore=ignored)
    (copy / ".venv").mkdir()
    (copy / ".venv" / "bin").symlink_to(VENV_BIN)
    return copy


@pytest.mark.parametrize("command", ALL, ids=[f"block {c.block}: {c.text.split('#')[0].strip()}" for c in ALL])
def test_a_readme_command_runs_as_written(command: Command, fresh_copy: Path) -> None:
    reason = skip_reason(command)
    if reason is not None:
        pytest.skip(reason)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    run = subprocess.run(
        ["bash", "-c", command.text],
        cwd=fresh_copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=SECONDS_PER_COMMAND,
        check=False,
    )
    assert run.returncode == command.expected_exit, f"{command.text}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert "Traceback" not in run.stdout + run.stderr, run.stdout + run.stderr
