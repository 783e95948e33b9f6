"""The docs state only what is true of the files a user has.

Every relative link in README.md and docs/*.md resolves to a file of this repository (not to a
team checkout next to it), and no page refers to work in progress (a branch, a trial merge, a patch
file that is not there) or to a `KVCache` method that does not exist.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import vattention

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
IDS = [str(p.relative_to(ROOT)) for p in PAGES]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_relative_links_resolve_inside_the_repository(page):
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path = (page.parent / target).resolve()
        assert path.is_relative_to(ROOT), f"{page.name} links outside the repository: {target}"
        assert path.exists(), f"{page.name} links to a missing file: {target}"


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_no_work_in_progress_or_missing_files(page):
    text = page.read_text()
    for phrase in ("this branch", "trial merge", "../shared", "docs/patches/"):
        assert phrase not in text, f"{page.name} mentions {phrase!r}"


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_cache_methods_named_in_code_spans_exist(page):
    for name in re.findall(r"`(?:cache|KVCache)\.([a-z_]+)\(", page.read_text()):
        assert hasattr(vattention.KVCache, name), f"{page.name} names KVCache.{name}()"
    assert "`check_invariants()`" not in page.read_text(), (
        f"{page.name} presents check_invariants() as a KVCache method"
    )
