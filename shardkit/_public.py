"""Where each public name lives, read from the one list of them: the ``TYPE_CHECKING``
imports of ``shardkit/__init__.py``, which type checkers read and nothing else repeats.

Each module that defines a public name calls ``settle`` at its end, so that the name reports
``shardkit`` as its module however it was imported (``shardkit.ShardMachine`` or
``shardkit._machine.state_machine.ShardMachine``): a traceback, a repr or a pickle names the
public path, never a private one. Nothing here imports the rest of the kit.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

__all__ = ["PUBLIC_HOMES", "PUBLIC_MODULE", "settle"]

PUBLIC_MODULE = "shardkit"


def _read_public_homes(init_file: Path) -> Mapping[str, str]:
    """Public name → the absolute module it is imported from, for every ``from M import N as N``
    under ``if TYPE_CHECKING:`` at the top level of ``init_file``."""
    tree = ast.parse(init_file.read_text(encoding="utf-8"), filename=str(init_file))
    homes: dict[str, str] = {}
    for node in tree.body:
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
            continue
        for statement in node.body:
            if not isinstance(statement, ast.ImportFrom) or statement.level or statement.module is None:
                message = f"{init_file.name} line {statement.lineno}: the public names are 'from shardkit.X import N as N' lines only"
                raise ImportError(message)
            for alias in statement.names:
                if alias.asname != alias.name:
                    message = f"{init_file.name} line {statement.lineno}: write 'import {alias.name} as {alias.name}' (a re-export)"
                    raise ImportError(message)
                homes[alias.name] = statement.module
    return MappingProxyType(dict(sorted(homes.items())))


#: Public name → the module it is imported from (``shardkit.contract``, ``shardkit._run.runner``).
PUBLIC_HOMES = _read_public_homes(Path(__file__).with_name("__init__.py"))


def settle(module_name: str, namespace: Mapping[str, object]) -> None:
    """Give each public name that ``module_name`` defines (its ``namespace`` holds the object and
    the object's ``__module__`` is ``module_name``, inside the name's listed home) the public
    module as ``__module__``. A type alias, which belongs to no module, is left as it is."""
    for name, home in PUBLIC_HOMES.items():
        if module_name != home and not module_name.startswith(home + "."):
            continue
        value = namespace.get(name)
        if value is not None and getattr(value, "__module__", None) == module_name:
            try:
                value.__module__ = PUBLIC_MODULE
            except (AttributeError, TypeError):  # a type alias (``X | Y``) has no module to set
                continue
