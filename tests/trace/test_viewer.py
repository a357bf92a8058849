"""The offline trace viewer (``netdist/trace/viewer.html``, ``netdist trace merge --html``).

The page is loaded in a real headless browser (Debian's ``chromium-headless-shell``,
``--dump-dom``: the DOM after the page's script ran) and the test reads what it drew:
the status line, one bar per complete event, one lane label per rank, the last arrival of
every collective marked. Without the browser the browser tests skip, and fail in CI
(``.ci/run`` installs it).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from netdist.cli import main as cli_main
from netdist.trace.analysis import load_trace_dir, merge
from netdist.trace.viewer import DATA_ELEMENT, render_viewer, viewer_template
from tests.conftest import require_in_ci
from tests.trace import synth

BROWSER = "chromium-headless-shell"
INSTALL = "apt-get install chromium-headless-shell"
BROWSER_TIMEOUT_S = 60.0
DATA_OPEN = '<script id="trace-data" type="application/json">'
NASTY = "</script><script>document.title='pwned'</script> <!-- <script> </SCRIPT> \u00e9\u2028"


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NETDIST_DEBUG", raising=False)


# --------------------------------------------------------------------------- the DOM

@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    parts: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        """The text content (the element's and its descendants')."""
        return "".join(self.parts)

    @property
    def classes(self) -> list[str]:
        return self.attrs.get("class", "").split()


class Dom(HTMLParser):
    """Every element of an HTML document, in document order, with its text content."""

    VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link",
                      "meta", "source", "track", "wbr"})

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[Element] = []
        self._open: list[Element] = []
        self.feed(html)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = Element(tag, {k: v or "" for k, v in attrs})
        self.elements.append(element)
        if tag not in self.VOID:
            self._open.append(element)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append(Element(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i].tag == tag:
                del self._open[i:]
                return

    def handle_data(self, data: str) -> None:
        for element in self._open:
            element.parts.append(data)

    def by_id(self, name: str) -> Element:
        found = [e for e in self.elements if e.attrs.get("id") == name]
        assert len(found) == 1, f"{len(found)} elements with id {name!r}"
        return found[0]

    def by_class(self, name: str, tag: str | None = None) -> list[Element]:
        return [e for e in self.elements
                if name in e.classes and (tag is None or e.tag == tag)]


def _browser() -> str:
    path = shutil.which(BROWSER)
    if path is None:
        require_in_ci(f"{BROWSER} is not installed: {INSTALL}")
    return path


def dump_dom(page: Path, tmp_path: Path) -> Dom:
    """The DOM of ``page`` after its script ran, from the headless browser."""
    browser = _browser()
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu",
               f"--user-data-dir={tmp_path / 'browser-profile'}",
               "--dump-dom", page.resolve().as_uri()]
    done = subprocess.run(command, capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S,
                          check=False)
    assert done.returncode == 0, f"{BROWSER} exited with {done.returncode}:\n{done.stderr}"
    assert "</html>" in done.stdout, f"no DOM from {BROWSER}:\n{done.stderr}"
    return Dom(done.stdout)


def _status(dom: Dom) -> tuple[str, str]:
    status = dom.by_id("status")
    return status.attrs.get("class", ""), status.text


def _x_events(merged: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in merged["traceEvents"] if e["ph"] == "X"]


# --------------------------------------------------------------------------- the browser

def test_a_merged_4_rank_trace_is_drawn(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    synth.write_trace_dir(tmp_path / "job")
    page = tmp_path / "trace.html"
    assert cli_main.main(["trace", "merge", str(tmp_path / "job"), "--html", str(page)]) == 0
    merged = json.loads((tmp_path / "job" / "merged.trace.json").read_text())
    n = len(merged["traceEvents"])
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"wrote {page}: viewer of {n} events of 4 ranks")

    dom = dump_dom(page, tmp_path)

    assert _status(dom) == ("ok", f"loaded {n} events from 4 ranks")
    bars = dom.by_class("bar", "rect")
    x_events = _x_events(merged)
    assert len(bars) == len(x_events) == 4 * (50 + 2 * 3)
    for rank in range(4):
        assert sum(b.attrs["data-pid"] == str(rank) for b in bars) == \
            sum(e["pid"] == rank for e in x_events)
    assert all(float(b.attrs["width"]) > 0 and float(b.attrs["x"]) >= 0 for b in bars)
    assert len({b.attrs["fill"] for b in bars}) == 6  # 4 collective ops, send, recv
    labels = dom.by_class("lane-label", "text")
    assert [(e.attrs["data-pid"], e.text) for e in labels] == [
        (str(r), f"rank {r} (host{r})") for r in range(4)]
    # rank 2 is 50 ms late at each of the 50 collectives: it is marked last at every one
    marks = dom.by_class("last-mark")
    assert len(marks) == 50
    assert {m.attrs["data-pid"] for m in marks} == {"2"}
    last_bars = dom.by_class("last", "rect")
    assert len(last_bars) == 50 and {b.attrs["data-pid"] for b in last_bars} == {"2"}
    assert "arrived last of 4 ranks, late by 49." in last_bars[0].text
    # the hover title names the event and its arguments
    first = bars[0].text
    assert first.startswith("all_reduce (collective)\nrank 0 (host0), tid 1\nstart ")
    assert f"group: {synth.GROUP}" in first and "seq: 0" in first
    ticks = [e.text for e in dom.by_class("tick-label")]
    assert ticks[0] == "0" and len(ticks) >= 3


def test_missing_ranks_and_script_in_the_args(tmp_path: Path) -> None:
    synth.write_trace_dir(tmp_path / "job", ranks=[0, 1, 3], collectives=4)
    merged = merge(load_trace_dir(tmp_path / "job"))
    merged["traceEvents"][4]["args"]["note"] = NASTY  # rank 0's first collective
    page = tmp_path / "trace.html"
    page.write_text(render_viewer(merged), encoding="utf-8")

    dom = dump_dom(page, tmp_path)

    n = len(merged["traceEvents"])
    assert _status(dom) == ("ok", f"loaded {n} events from 3 ranks; missing ranks 2")
    assert [e.text for e in dom.by_class("lane-label")] == [
        "rank 0 (host0)", "rank 1 (host1)", "rank 2 (no trace)", "rank 3 (host3)"]
    assert len(dom.by_class("bar", "rect")) == len(_x_events(merged))
    assert f"note: {NASTY}" in dom.by_class("bar", "rect")[0].text
    assert [e for e in dom.elements if e.tag == "script"][0].attrs["id"] == "trace-data"
    assert len([e for e in dom.elements if e.tag == "script"]) == 2  # none injected
    assert dom.by_class("last-mark") != []


@pytest.mark.parametrize(("data", "error"), [
    ('{"traceEvents": [{"ph": "M", ', "error: the embedded trace is not valid JSON: "),
    ('{"events": []}', "error: the embedded trace has no traceEvents array: it is not a "
                       "Trace Event Format trace (netdist trace merge DIR writes one)"),
    ('"a string"', "error: the embedded trace is JSON but not a trace object (it is string)"),
    ('{"traceEvents": [{"ph": "X", "name": "send", "pid": 0, "tid": 1, "ts": 5}]}',
     'error: the embedded trace: traceEvents[0] (X "send") has no numeric dur >= 0'),
])
def test_a_malformed_embedded_trace_is_an_error_in_the_status(
        tmp_path: Path, data: str, error: str) -> None:
    page = tmp_path / "bad.html"
    page.write_text(viewer_template().replace(DATA_ELEMENT, f"{DATA_OPEN}{data}</script>"),
                    encoding="utf-8")

    dom = dump_dom(page, tmp_path)

    kind, text = _status(dom)
    assert kind == "error"
    assert text.startswith(error) if error.endswith(": ") else text == error
    assert dom.by_class("bar") == []


def test_the_shipped_page_asks_for_a_file(tmp_path: Path) -> None:
    page = tmp_path / "viewer.html"
    page.write_text(viewer_template(), encoding="utf-8")
    dom = dump_dom(page, tmp_path)
    assert _status(dom) == ("empty", "no trace embedded: open a trace file (netdist trace "
                                     "merge DIR --html OUT.html writes this page with one)")
    assert dom.by_id("file").attrs["type"] == "file"


# --------------------------------------------------------------------------- no browser

def test_render_viewer_keeps_a_script_tag_inside_the_json() -> None:
    merged = {"traceEvents": [{"ph": "X", "name": "push", "cat": "ps", "pid": 0, "tid": 3,
                               "ts": 1.0, "dur": 2.0, "args": {"note": NASTY}}],
              "displayTimeUnit": "ms"}
    html = render_viewer(merged)
    start = html.index(DATA_OPEN) + len(DATA_OPEN)
    end = html.index("</script>", start)  # where the HTML parser ends the element
    payload = html[start:end]
    assert json.loads(payload) == merged
    assert "</" not in payload.lower() and "<!--" not in payload
    assert "<\\/script>" in payload and "<\\/SCRIPT>" in payload
    assert payload.isascii()
    assert html.count(DATA_OPEN) == 1
    assert html.replace(payload, "null") == viewer_template()
    scripts = [e for e in Dom(html).elements if e.tag == "script"]
    assert len(scripts) == 2  # the data and the viewer's code, nothing more
    assert json.loads(scripts[0].text) == merged


def test_the_page_is_self_contained() -> None:
    template = viewer_template()
    assert template.count(DATA_ELEMENT) == 1
    assert re.search(r"\b(src|href)\s*=", template) is None
    assert re.findall(r"https?://[^\s\"')]+", template) == ["http://www.w3.org/2000/svg"] * 2
    for word in ("fetch(", "XMLHttpRequest", "import ", "@import", "url(http"):
        assert word not in template


def test_the_page_is_package_data() -> None:
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '"trace/viewer.html"' in pyproject


def test_merge_html_checks_its_output_before_writing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    synth.write_trace_dir(tmp_path / "job")
    missing = tmp_path / "no" / "t.html"
    assert cli_main.main(["trace", "merge", str(tmp_path / "job"), "--html",
                          str(missing)]) == 2
    assert capsys.readouterr().err == (f"netdist trace: error: output directory "
                                       f"{missing.parent} does not exist\n")
    assert not (tmp_path / "job" / "merged.trace.json").exists()
    assert cli_main.main(["trace", "merge", str(tmp_path / "job"), "-o",
                          str(tmp_path / "m.json"), "--html", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"netdist trace: error: output {tmp_path} is a directory\n"
    page = tmp_path / "t.html"
    assert cli_main.main(["trace", "merge", str(tmp_path / "job"), "-o",
                          str(tmp_path / "m.json"), "--html", str(page)]) == 0
    html = page.read_text(encoding="utf-8")
    start = html.index(DATA_OPEN) + len(DATA_OPEN)
    assert json.loads(html[start:html.index("</script>", start)]) == \
        json.loads((tmp_path / "m.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job", "m.json", "t.html"]
