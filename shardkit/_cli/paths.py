"""The files and folders a command is told to write, checked before it runs: a run that
finds a failure must never lose it to a typo in ``--out``, ``--report`` or ``--html``.

Every check raises ``UsageError`` with one line that names the command, the option, the
bad path and the fix."""

from __future__ import annotations

import tempfile
from pathlib import Path

from shardkit.errors import UsageError

__all__ = ["check_out_folder", "check_output_file"]


def check_out_folder(command: str, out: Path) -> None:
    """``--out`` must be a folder this process can write in, or one it can create."""
    if out.exists():
        if not out.is_dir():
            message = f"shardkit {command}: --out {out} is a file, not a folder; name a folder for the failure traces"
            raise UsageError(message)
        _check_writable(command, out, f"--out {out}: cannot write in it")
        return
    existing = next((parent for parent in out.parents if parent.exists()), Path("."))
    if not existing.is_dir():
        message = f"shardkit {command}: --out {out} cannot be created: {existing} is a file, not a folder"
        raise UsageError(message)
    _check_writable(command, existing, f"--out {out}: cannot create it in {existing}")


def check_output_file(command: str, option: str, path: Path, example: str) -> None:
    """``path`` must name a file (``example`` is the name suggested for a folder given
    instead) in an existing folder this process can write in."""
    folder = path.parent
    if path.is_dir():
        raise UsageError(f"shardkit {command}: {option} {path} is a folder; name a file, e.g. {path / example}")
    if not folder.exists():
        message = f"shardkit {command}: {option} {path}: the folder {folder} does not exist; create it or name a file in an existing folder"
        raise UsageError(message)
    if not folder.is_dir():
        raise UsageError(f"shardkit {command}: {option} {path}: {folder} is a file, not a folder")
    _check_writable(command, folder, f"{option} {path}: cannot write in {folder}")


def _check_writable(command: str, folder: Path, problem: str) -> None:
    """Create (and remove) a file in ``folder``: the only test of permissions that mounts,
    ACLs and root agree on."""
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".shardkit-write-check-"):
            pass
    except OSError as error:
        message = f"shardkit {command}: {problem} ({error.strerror or error}); choose a folder you can write in"
        raise UsageError(message) from None
