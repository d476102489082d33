"""The Python blocks of the README and of the documentation site's pages (docs/), and what each says about how it runs.

How a block runs is said by an HTML comment on the line before its fence (invisible on GitHub and on the site):

    <!-- readme-test: transformers, vllm -->      run it on both engines (or name one)
    <!-- readme-test: server -->                  run it against a running `streamscope serve` server, with `url`
                                                  and `api_key` naming it (tests/vllm/test_serve.py does)
    <!-- readme-test: skip: the reason -->        do not run it, and say why

tests/test_readme.py runs the engine blocks and checks that every block says how it runs; tests/vllm/test_serve.py
runs the server blocks against the server it starts. The pages come in the order a reader meets them: the README,
then the site's pages in its navigation's order (mkdocs.yml), then any page the navigation does not list.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
ENGINES = ("transformers", "vllm")
#: The directive of blocks that need a running server: tests/vllm/test_serve.py runs them.
SERVER = "server"
_DIRECTIVE = re.compile(r"^<!--\s*readme-test:\s*(.*?)\s*-->\s*$")
_HEADING = re.compile(r"^(#+)\s+(.*?)\s*$")


@dataclass
class Block:
    page: Path
    line: int  # the fence's line, 1-based
    headings: list[str]
    code: str
    engines: tuple[str, ...] = ()
    skip: Optional[str] = None
    directive: Optional[str] = None
    problems: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def server(self) -> bool:
        return self.engines == (SERVER,)


def _nav_pages(entries: Any) -> list[str]:
    """The pages of a mkdocs nav (a list of pages, {title: page} and {title: [section]} entries), in order."""
    found: list[str] = []
    for entry in entries:
        if isinstance(entry, str):
            found.append(entry)
        elif isinstance(entry, dict):
            for value in entry.values():
                found += _nav_pages(value) if isinstance(value, list) else [value]
    return found


def site_pages() -> list[Path]:
    """The pages of docs/ in the site's navigation order, then those the navigation leaves out (sorted)."""
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    listed = [DOCS / page for page in _nav_pages(nav) if page.endswith(".md")]
    rest = [page for page in sorted(DOCS.rglob("*.md")) if page not in listed]
    return [page for page in listed if page.exists()] + rest


def pages() -> list[Path]:
    return [ROOT / "README.md", *site_pages()]


def blocks(page: Path) -> list[Block]:
    """The page's Python blocks, with their headings and what their directive says."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    headings: list[tuple[int, str]] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("```"):
            fence = line[3:].strip()
            start, body = index, []
            index += 1
            while index < len(lines) and not lines[index].startswith("```"):
                body.append(lines[index])
                index += 1
            if fence == "python":
                found.append(_block(page, start, [text for _, text in headings], "\n".join(body),
                                    lines[start - 1] if start else ""))
        else:
            heading = _HEADING.match(line)
            if heading:
                level = len(heading.group(1))
                headings = [(lvl, text) for lvl, text in headings if lvl < level] + [(level, heading.group(2))]
        index += 1
    return found


def _block(page: Path, start: int, headings: list[str], code: str, before: str) -> Block:
    block = Block(page, start + 1, headings, code)
    match = _DIRECTIVE.match(before.strip())
    if match is None:
        return block
    block.directive = match.group(1)
    if block.directive.startswith("skip:"):
        block.skip = block.directive[len("skip:"):].strip()
        if not block.skip:
            block.problems.append("a skip must say why")
        return block
    block.engines = tuple(word.strip() for word in block.directive.split(","))
    if block.server:
        return block
    unknown = [engine for engine in block.engines if engine not in ENGINES]
    if unknown or not block.engines:
        block.problems.append(f"unknown engines {unknown}: name {', '.join(ENGINES)}, or {SERVER!r} alone")
    return block


def all_blocks() -> list[Block]:
    return [block for page in pages() for block in blocks(page)]


def server_blocks() -> list[Block]:
    """The blocks that run against a running server, in the pages' order."""
    return [block for block in all_blocks() if block.server]
