"""Every relative Markdown link in README.md and docs/*.md points at a file that exists.

    python -m pytest -q tests/test_docs_links.py

Links inside fenced code blocks are not links. http(s) and mailto links are not checked; for
`path#anchor` only the file part is.
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = ("http://", "https://", "mailto:")


def doc_files():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def relative_links(text):
    """Yield (line number, target) for each link outside fenced code blocks."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if fenced:
            continue
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if not target.startswith(EXTERNAL):
                yield n, target


def broken_links(path):
    broken = []
    for n, target in relative_links(path.read_text(encoding="utf-8")):
        file_part = target.split("#", 1)[0]
        if not file_part:  # a link to an anchor in the same page
            continue
        if not (path.parent / file_part).exists():
            broken.append(f"{path.relative_to(ROOT)}:{n}: {target}")
    return broken


def test_the_docs_exist():
    assert (ROOT / "README.md").is_file()
    assert len(doc_files()) > 1


def test_every_relative_link_resolves():
    broken = [b for path in doc_files() for b in broken_links(path)]
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# there\n")
    page.write_text("[ok](there.md#x) [gone](missing.md) [web](https://example.com)\n"
                    "```\n[in code](nowhere.md)\n```\n[self](#top)\n")
    found = [t for _, t in relative_links(page.read_text())]
    assert found == ["there.md#x", "missing.md", "#top"]
    assert [t for t in found if t.split("#")[0] and not (tmp_path / t.split("#")[0]).exists()] == ["missing.md"]
