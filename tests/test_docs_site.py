"""The documentation is a MkDocs site that builds with ``--strict`` (issue 17, item 7).

``mkdocs.yml`` turns every check MkDocs has into a warning (a link to a missing page or
anchor, a page left out of the nav, an absolute link) and ``--strict`` turns warnings into
a failed build, so a build that exits 0 and prints no warning has every internal link
resolved. README.md lives outside the site, so its links into ``docs/`` are checked here
by hand, against the files and the anchors MkDocs gives their headings. The layer map and
the exception tree are drawn once, on their own pages, and the README stays a front page.
The pages show the examples by including ``examples/NAME.py`` (``pymdownx.snippets``): the
built pages hold each file's code, and ``examples/README.md``'s links resolve.
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

from markdown.extensions.toc import slugify

REPO_ROOT = Path(__file__).resolve().parents[1]
README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
MKDOCS_YML = REPO_ROOT / "mkdocs.yml"
EXAMPLES_README = REPO_ROOT / "examples" / "README.md"
BUILD_TIMEOUT = 300.0

_FENCE = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)
_LINK = re.compile(r"\[(?:[^\]]|\][^(])*?\]\(([^)\s]+)\)")
_INCLUDE = re.compile(r'^--8<-- "(examples/[\w.-]+)"$', re.M)


def _pages() -> set[str]:
    return {p.name for p in DOCS.glob("*.md")}


def _nav_pages() -> list[str]:
    """The pages named in mkdocs.yml's nav, in order."""
    nav = MKDOCS_YML.read_text(encoding="utf-8").split("\nnav:\n", 1)[1]
    return re.findall(r":\s*([\w./-]+\.md)\s*$", nav, flags=re.M)


def _anchors(path: Path) -> set[str]:
    """The ids MkDocs' toc extension gives the headings of a page (outside code fences)."""
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    titles = re.findall(r"^#{1,6} (.+?)\s*$", text, flags=re.M)
    return {slugify(title.replace("`", ""), "-") for title in titles}


def _prose(path: Path) -> str:
    return _FENCE.sub("", path.read_text(encoding="utf-8"))


def test_site_builds_strict_without_warnings(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # Material's banner, not a build warning
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(MKDOCS_YML),
         "--site-dir", str(site)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "WARNING" not in output, output
    # every page of the nav became a page of the site
    for page in _nav_pages():
        assert _built(site, page).is_file(), (page, sorted(p.name for p in site.iterdir()))
    # every included example is on its page, whole, where the marker was
    included = 0
    for path in sorted(DOCS.glob("*.md")):
        files = _INCLUDE.findall(path.read_text(encoding="utf-8"))
        if not files:
            continue
        page = _built(site, path.name).read_text(encoding="utf-8")
        assert "--8&lt;--" not in page and "--8<--" not in page, path.name
        text = html.unescape(re.sub(r"<[^>]*>", "", page))
        for file in files:
            code = (REPO_ROOT / file).read_text(encoding="utf-8")
            assert code.rstrip("\n") in text, f"{path.name}: {file} is not on the built page"
            included += 1
    assert included >= 17  # every docs example but the README's quickstart (issue 26)


def _built(site: Path, page: str) -> Path:
    return site / ("index.html" if page == "index.md" else f"{page[:-3]}/index.html")


def test_config_is_strict_and_nav_lists_every_page_once() -> None:
    config = MKDOCS_YML.read_text(encoding="utf-8")
    assert re.search(r"(?m)^strict: true$", config)
    assert re.search(r"(?m)^docs_dir: docs$", config)
    for check in ("omitted_files", "not_found", "absolute_links", "unrecognized_links",
                  "anchors"):
        assert re.search(rf"(?m)^  {check}: warn$", config), check
    nav = _nav_pages()
    assert sorted(nav) == sorted(_pages()), (nav, sorted(_pages()))
    assert len(nav) == len(set(nav))
    assert nav[0] == "index.md" and "PROTOCOL.md" in nav


def _check_local_links(page: Path) -> None:
    """Every relative link of a page outside the site (rendered by GitHub) names an existing
    file and, after ``#``, one of its headings."""
    name = page.relative_to(REPO_ROOT).as_posix()
    links = _LINK.findall(_prose(page))
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local, f"{name} links to no page"
    for link in local:
        target, _, anchor = link.partition("#")
        assert not target.startswith("/"), f"{name}: {link} must be a relative path"
        path = (page.parent / target).resolve() if target else page
        assert path.is_file(), f"{name} links to {link}, which does not exist"
        if anchor:
            assert anchor in _anchors(path), f"{name} links to {link}: no such heading"


def test_readme_links_into_docs_resolve() -> None:
    _check_local_links(README)


def test_examples_readme_links_resolve() -> None:
    _check_local_links(EXAMPLES_README)


def test_readme_is_a_front_page_linking_every_page() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move sections to docs/"
    linked = {link.partition("#")[0] for link in _LINK.findall(_prose(README))}
    missing = sorted(f"docs/{page}" for page in _nav_pages() if f"docs/{page}" not in linked)
    assert not missing, f"the README's Documentation list lacks {missing}"


def test_layer_map_and_exception_tree_are_drawn_once() -> None:
    sources = [README, *sorted(DOCS.glob("*.md"))]
    drawings = {
        "layer map": re.compile(r"(?m)^  wire/ +PURE sans-I/O frame codec"),
        "exception tree": re.compile(r"(?m)^├── ConfigError \(ValueError\)"),
    }
    homes = {"layer map": "layer-map.md", "exception tree": "errors.md"}
    for what, pattern in drawings.items():
        found = [p.name for p in sources if pattern.search(p.read_text(encoding="utf-8"))]
        assert found == [homes[what]], f"the {what} is drawn in {found}"
    readme = _prose(README)
    assert "(docs/layer-map.md)" in readme and "(docs/errors.md)" in readme
    layer_map = (DOCS / "layer-map.md").read_text(encoding="utf-8")
    assert ("  optim.py                             PURE optimizer configs (SGDConfig, "
            "AdamConfig) and the\n" in layer_map)
    assert "roles (PURE), server, client, parameter_server (the\n" in layer_map
