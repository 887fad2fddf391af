"""The docs name what exists: every file or folder docs/architecture.md points at is in the repository."""

from __future__ import annotations

import re
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
PATH = re.compile(r"`((?:broker|lua|cli|spark|tests|bench|docs)/[\w./-]*)`")


def paths_named_in(doc: str) -> list[str]:
    return sorted(set(PATH.findall((REPOSITORY / doc).read_text())))


def test_every_path_in_the_architecture_doc_exists() -> None:
    named = paths_named_in("docs/architecture.md")
    assert len(named) > 30, named
    missing = [p for p in named if not (REPOSITORY / p).exists()]
    assert missing == []


def test_the_architecture_table_names_a_lua_include_python_module_and_tests_for_each_guarantee() -> None:
    text = (REPOSITORY / "docs/architecture.md").read_text()
    for guarantee in ("lite", "seek", "mailbox", "shared", "leases"):
        for path in (f"lua/lib/{guarantee}.lua", f"broker/fences/{guarantee}.py"):
            assert f"`{path}`" in text, path
            assert (REPOSITORY / path).exists(), path


def test_the_readme_links_and_names_only_what_the_repository_holds() -> None:
    text = (REPOSITORY / "README.md").read_text()
    linked = re.findall(r"\]\(([^)#\s]+)\)", text)  # markdown links and images
    named = re.findall(r"`(\.\./[^`\s]+|(?:docs|bench|broker|cli|spark|tests|lua)/[\w./-]+)`", text)
    assert linked and named
    outside = [p for p in linked + named if not p.startswith(("http://", "https://"))
               and not (REPOSITORY / p).resolve().is_relative_to(REPOSITORY)]
    assert outside == [], "the README points outside the repository"
    missing = [p for p in linked + named if not p.startswith(("http://", "https://")) and not (REPOSITORY / p).exists()]
    assert missing == []
