"""Where each property the kit checks is explained: its section of docs/contract.md.

Failure messages name a property by its label ("§2 rule 4", "§3 determinism"); the
label's section numbers are those of docs/contract.md, and each label has an anchor
there, which ``tests/test_docs.py`` checks exists."""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType

from shardkit.contract import FAULT_KINDS

__all__ = ["CONTRACT_DOC", "LABEL_ANCHORS", "read_more"]

#: The contract's documentation, as a user finds it in shardkit's repository.
CONTRACT_DOC = "docs/contract.md"

#: Every property label the kit reports, and its anchor in docs/contract.md.
LABEL_ANCHORS: Mapping[str, str] = MappingProxyType({
    "§1 return type": "return-type",
    "unexplained exception": "return-type",
    **{f"§2 rule {number}": f"rule-{number}" for number in range(1, 9)},
    "§2 cancel": "cancel",
    "§2 release": "release",
    "§2 metrics": "metrics",
    "§2 health": "health",
    "§2 linearizability": "linearizability",
    "§3 shape and range": "shape-and-range",
    "§3 determinism": "determinism",
    "§3 twin oracle": "twin-oracle",
    "§3 composition": "composition",
    **{f"§4 {kind}": "fault-" + kind.replace("_", "-") for kind in FAULT_KINDS},
})

_LABEL = re.compile("(?:" + "|".join(re.escape(label) for label in sorted(LABEL_ANCHORS, key=len, reverse=True)) + r")(?!\d)")


def read_more(text: str) -> str | None:
    """``docs/contract.md#rule-4`` (and so on) for each property label ``text`` cites, in
    the order cited; None when it cites none."""
    anchors = list(dict.fromkeys(LABEL_ANCHORS[found] for found in _LABEL.findall(text)))
    if not anchors:
        return None
    return ", ".join(f"{CONTRACT_DOC}#{anchor}" for anchor in anchors)
