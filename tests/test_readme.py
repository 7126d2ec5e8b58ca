"""Every command of the README's ```bash blocks runs as written, from a fresh copy of the
repository: a README command that breaks fails this test. Its ```python blocks run too: a
block whose first line names a file (``# sum_engine.py``) is written to that file in the
copy before any command runs, and must be named by a command that runs (which is how it
runs); any other block runs as a script. Each python block is one test, whichever it is.

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
    (".venv-oldest", "CI runs it with the oldest Hypothesis, in an environment of its own (.ci/run)"),
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


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.DOTALL | re.MULTILINE)


def named_file(block: str) -> str | None:
    """``sum_engine.py`` for a block that starts with ``# sum_engine.py``."""
    first = block.splitlines()[0] if block else ""
    found = re.fullmatch(r"# ([\w./-]+\.py)", first.strip())
    return found.group(1) if found else None


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
    runs_pytest = any(Path(word).name == "pytest" for word in bare)
    names_tests = any(word.endswith(".py") or "::" in word or word.startswith(("tests", "stateful")) for word in bare)
    if runs_pytest and not names_tests:
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
    for block in python_blocks(README.read_text(encoding="utf-8")):
        name = named_file(block)
        if name is not None:
            (copy / name).write_text(block, encoding="utf-8")
    return copy


PYTHON_BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def python_block_id(number: int, block: str) -> str:
    name = named_file(block)
    return f"python block {number}: " + (f"the file {name}" if name else "a script")


def test_the_readme_has_python_blocks_and_the_engine_skeleton_is_one() -> None:
    """The blocks the test below runs were found (so it cannot pass on none), and the engine
    skeleton is among them as a file."""
    assert PYTHON_BLOCKS
    assert "sum_engine.py" in map(named_file, PYTHON_BLOCKS)


def commands_running(name: str) -> list[Command]:
    """The README's commands that name the file ``name`` and are not skipped."""
    return [command for command in ALL if name in command.text and skip_reason(command) is None]


@pytest.mark.parametrize(
    "block", PYTHON_BLOCKS, ids=[python_block_id(n, block) for n, block in enumerate(PYTHON_BLOCKS, start=1)]
)
def test_a_readme_python_block_runs_as_written(block: str, fresh_copy: Path) -> None:
    """A script runs here; a file is written to the copy and runs in the README's commands that
    name it (``test_a_readme_command_runs_as_written``), so at least one of them must run."""
    name = named_file(block)
    if name is not None:
        assert (fresh_copy / name).read_text(encoding="utf-8") == block
        assert commands_running(name), (
            f"the README's {name} is run by none of its commands (each is skipped or none names it): "
            "name it in a command that runs, or drop the file name to run it as a script"
        )
        return
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    run = subprocess.run(
        [sys.executable, "-c", block], cwd=fresh_copy, env=env, capture_output=True, text=True, timeout=SECONDS_PER_COMMAND, check=False
    )
    assert run.returncode == 0, f"{block}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"


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
