"""The pages the package draws: the live dashboard of ``serve`` and ``sim --report``.

Both are single HTML documents with everything inline (styles, scripts, the chart library,
and for a report its data), so they work offline and a report is one file to keep or send.
The chart library is uPlot (MIT, vendored from the npm package ``uplot``; its licence is
``uPlot.LICENSE`` here and its banner stays at the top of the inlined script): a small
(50 KB), dependency-free library made for streaming time series, so the dashboard appends a
sample and redraws without a framework, and the same file draws a report's CDFs.

Rule 1: no page loads anything from the network: every script and style is inlined by
        :func:`page`, and pages contact only their own server (the dashboard's event
        stream).
Rule 2: a page's inline scripts and styles are listed by hash in its
        ``Content-Security-Policy`` (:attr:`Page.csp`), so a served page runs nothing else.
Rule 3: data embedded in a page is JSON in a ``<script type="application/json">`` element,
        with ``<``, ``>`` and ``&`` escaped, so no value can end the element.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from functools import cache
from importlib import resources
from typing import Any

import attrs

__all__ = ["UPLOT_VERSION", "Page", "asset", "embed_json", "page"]

#: The vendored uPlot release (``npm pack uplot@1.6.32``).
UPLOT_VERSION = "1.6.32"


_PLACEHOLDER = re.compile(r"\{\{(title|csp|styles|body|data|scripts)\}\}")


@cache
def asset(name: str) -> str:
    """The text of one file of this package (a template, a script, a stylesheet)."""
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")


def embed_json(value: Any) -> str:
    """``value`` as JSON that is safe inside a ``<script>`` element (Rule 3)."""
    text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


@attrs.frozen
class Page:
    """One rendered page: its HTML and the ``Content-Security-Policy`` that allows
    exactly its inline scripts and styles (Rule 2)."""

    html: str
    csp: str


def page(
    template: str,
    *,
    scripts: tuple[str, ...],
    styles: tuple[str, ...],
    title: str,
    body: str = "",
    data: Any = None,
) -> Page:
    """Fill ``template`` (a file of this package) with ``title``, the inlined ``styles``
    and ``scripts`` (files of this package, uPlot's first), ``body`` (HTML made by the
    caller, already escaped) and ``data`` (embedded as JSON in ``#page-data``)."""
    style_text = [asset(name) for name in styles]
    script_text = [asset(name) for name in scripts]
    policy = (
        "default-src 'none'; "
        f"script-src {' '.join(_sha256(s) for s in script_text)}; "
        f"style-src {' '.join(_sha256(s) for s in style_text)}; "
        "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'"
    )
    parts = {
        "title": _escape(title),
        # (a <meta> policy may not name frame-ancestors: the served header adds it)
        "csp": _escape(policy),
        "styles": "".join(f"<style>{s}</style>" for s in style_text),
        "body": body,
        "data": f'<script type="application/json" id="page-data">{embed_json(data)}</script>',
        "scripts": "".join(f"<script>{s}</script>" for s in script_text),
    }
    # One pass, so that no filled-in text is searched for placeholders again.
    html = _PLACEHOLDER.sub(lambda m: parts[m.group(1)], asset(template))
    csp = policy + "; frame-ancestors 'none'"
    return Page(html=html, csp=csp)


def _escape(text: str) -> str:
    return (
        text.replace("&", "&amp;")
        .replace("<", "&lt;")
        .replace(">", "&gt;")
        .replace('"', "&quot;")
        .replace("'", "&#39;")
    )
