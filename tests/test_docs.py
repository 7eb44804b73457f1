"""The README and the documentation site (mkdocs.yml, docs/): the README stays short, every link from a page to
another file resolves, every page is in the site's navigation, every command has its page, and prose is wrapped.
(``mkdocs build --strict``, run by .ci/run, checks the site's own links and anchors too; these need no mkdocs.)"""

import re
from pathlib import Path

import pytest

from bnprobe.core.commands import COMMANDS as REGISTRY
from tests.test_readme import COMMANDS, PAGES, README, ROOT

DOCS = ROOT / "docs"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose(path: Path) -> list[tuple[int, str]]:
    """The page's lines outside fenced blocks, numbered from 1."""
    out, inside = [], False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            inside = not inside
            continue
        if not inside:
            out.append((n, line))
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """Links to other files (no web address, no anchor on the same page), as written."""
    found = []
    for n, line in prose(path):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target) and not target.startswith("#"):
                found.append((n, target))
    return found


def test_the_readme_is_short():
    assert len(README.read_text().splitlines()) <= 250


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_to_another_file_resolves(page):
    broken = [f"{page.relative_to(ROOT)}:{n}: {target}" for n, target in links(page)
              if not (page.parent / target.partition("#")[0]).exists()]
    assert not broken, "\n".join(broken)


def test_the_readme_links_to_the_site():
    targets = {target.partition("#")[0] for _, target in links(README)}
    assert "docs/index.md" in targets
    assert {f"docs/commands/{command}.md" for command in COMMANDS} <= targets


def test_every_page_is_in_the_navigation_and_every_entry_is_a_page():
    nav = set(re.findall(r"([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.glob("**/*.md")}
    assert nav == pages, (nav - pages, pages - nav)


def test_every_command_has_its_page():
    from bnprobe.cli import app

    commands = {c.name or c.callback.__name__ for c in app.registered_commands}
    assert commands == set(COMMANDS)
    assert all((DOCS / "commands" / f"{command}.md").is_file() for command in COMMANDS)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_prose_is_wrapped(page):
    """Prose lines are at most 120 characters; transcripts (fenced) stay as the program prints them, and a table's
    row cannot be wrapped."""
    long = [f"{page.relative_to(ROOT)}:{n}: {len(line)} characters" for n, line in prose(page)
            if len(line) > 120 and not line.lstrip().startswith("|")]
    assert not long, "\n".join(long)


def test_the_command_tables_are_the_registrys():
    """README's table and the commands page list the registry's commands (bnprobe.core.commands), each with its
    purpose, in its order."""
    want = [(c.name, c.purpose) for c in REGISTRY]
    assert re.findall(r"^\| `bnprobe ([a-z-]+)` \| (.+?) \| \[", README.read_text(), re.M) == want
    index = (DOCS / "commands" / "index.md").read_text()
    assert re.findall(r"^\| \[([a-z-]+)\]\([a-z-]+\.md\) \| (.+?) \|$", index, re.M) == want
