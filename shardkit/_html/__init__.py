"""The HTML report: a run's ``--report`` document drawn as one static, self-contained page.

It reads nothing but the document (so a report made on another machine renders the same),
imports nothing of the machine or the transport, and escapes every string it draws: a
report holds what a trace and an engine said, which is untrusted input.
"""

from __future__ import annotations

from shardkit._html.render import document_problem, render_html, write_html

__all__ = ["document_problem", "render_html", "write_html"]
