"""Tier 1: the README and ``docs/`` pages. Every link between them (and to files of the
repository) resolves, anchors included; every Python block runs on tiny models (in the
page's order, sharing one namespace, in a temporary directory), unless the comment above
it marks it ``<!-- docs-test: cluster ... -->`` (it needs GPUs, a real checkpoint or
data of one's own: only compiled) or ``<!-- docs-test: ray -->`` (it fits on a local Ray
cluster: run by ``tests/ray/test_docs.py``)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
BLOCK = re.compile(r"(?:<!-- docs-test: (\w+)[^>]*-->\n)?```python\n(.*?)```", re.S)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces to ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def python_blocks(page: Path) -> list[tuple[str, str]]:
    """``(marker, code)`` of every Python block of ``page`` (marker ``"run"`` if none)."""
    return [(m or "run", code) for m, code in BLOCK.findall(page.read_text())]


def test_every_link_resolves():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_every_page_is_linked_and_every_block_is_marked():
    readme = (ROOT / "README.md").read_text()
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in readme, f"{page.name} is not linked from the README"
    markers = {m for page in PAGES for m, _ in python_blocks(page)}
    assert markers <= {"run", "cluster", "ray"}, markers
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs__"}
    for i, (marker, code) in enumerate(python_blocks(page)):
        compiled = compile(code, f"{page.name}[block {i}]", "exec")
        if marker == "run":  # (no run of them writes to /tmp/ray_disagg_runs)
            exec(compiled, namespace)  # noqa: S102 - the documentation's own examples
    assert os.getcwd() == str(tmp_path)
