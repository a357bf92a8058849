"""The offline trace viewer: one HTML file with a merged trace embedded.

``viewer.html`` (package data next to this module) is a self-contained page, vanilla
JavaScript and inline CSS, no network: it draws a Trace Event Format trace with one lane
per rank (``pid``), complete events as bars, the last arrival of every collective marked.
The trace comes from its ``<script id="trace-data" type="application/json">`` element,
which :func:`render_viewer` fills; the page's file picker opens any other trace file.
``netdist trace merge DIR --html OUT.html`` writes the page.
"""

from __future__ import annotations

import importlib.resources
import json
from collections.abc import Mapping
from typing import Any

__all__ = ["TEMPLATE", "DATA_ELEMENT", "viewer_template", "embed_json", "render_viewer"]

TEMPLATE = "viewer.html"
"""The page's file name in the ``netdist.trace`` package."""

_OPEN = '<script id="trace-data" type="application/json">'
DATA_ELEMENT = f"{_OPEN}null</script>"
"""The empty data element of the template (``null``: nothing embedded)."""


def viewer_template() -> str:
    """The viewer page as shipped, with no trace embedded."""
    return (importlib.resources.files("netdist.trace") / TEMPLATE).read_text(encoding="utf-8")


def embed_json(obj: Any) -> str:
    """``obj`` as JSON that is safe as the text of an HTML ``<script>`` element.

    The HTML parser ends a script element at the first ``</script`` and treats ``<!--``
    specially, whatever JavaScript or JSON says; both can only occur inside JSON strings,
    where ``<\\/`` and ``\\u003c!--`` are the same string to ``JSON.parse``. Non-ASCII
    characters are escaped too, so the page's encoding cannot garble them.
    """
    text = json.dumps(obj, separators=(",", ":"), allow_nan=False)
    return text.replace("</", "<\\/").replace("<!--", "\\u003c!--")


def render_viewer(merged: Mapping[str, Any]) -> str:
    """The viewer page with ``merged`` (a Trace Event Format object, e.g.
    :func:`netdist.trace.analysis.merge`'s) embedded: one file to open in any browser."""
    template = viewer_template()
    if template.count(DATA_ELEMENT) != 1:  # pragma: no cover - the shipped file has one
        raise RuntimeError(f"{TEMPLATE} lacks its data element {DATA_ELEMENT!r}")
    return template.replace(DATA_ELEMENT, f"{_OPEN}{embed_json(merged)}</script>")
