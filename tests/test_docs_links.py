"""Every relative Markdown link in README.md and docs/*.md points at a file that exists, and every
test they cite by name (`tests/test_x.py::test_y`) exists.

    python -m pytest -q tests/test_docs_links.py

Links inside fenced code blocks are not links. http(s) and mailto links are not checked; for
`path#anchor` only the file part is. A citation names a test function (or class) defined in that
file, at its top level or in a class; a parametrised test is cited without its `[...]`.
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = ("http://", "https://", "mailto:")
CITATION = re.compile(r"\b((?:tests/)?(?:gpu/)?test_\w+)(?:\.py)?::(\w+)")


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


def defined_tests(path: Path) -> set[str]:
    """The names of the test functions and classes a test file defines (a class's methods too), read
    line by line: CPython 3.11.7's ast.parse fails now and then in a long pytest process
    ("AST constructor recursion depth mismatch", seen once in a whole suite)."""
    return set(re.findall(r"^(?:    )?(?:def|class) (\w+)", path.read_text(encoding="utf-8"), re.MULTILINE))


def missing_citations(text: str, tests_dir: Path) -> list[str]:
    """`file::name` citations whose file or test does not exist."""
    missing = []
    for module, name in CITATION.findall(text):
        path = tests_dir / f"{module.removeprefix('tests/')}.py"
        if not path.is_file() or name not in defined_tests(path):
            missing.append(f"{module}::{name}")
    return missing


def test_every_cited_test_exists():
    missing = [f"{path.relative_to(ROOT)}: {m}" for path in doc_files()
               for m in missing_citations(path.read_text(encoding="utf-8"), ROOT / "tests")]
    assert not missing, "docs cite tests that do not exist:\n" + "\n".join(missing)


def test_a_renamed_test_is_found(tmp_path):
    (tmp_path / "test_a.py").write_text("def test_one():\n    pass\n\nclass TestB:\n    def test_two(self):\n        pass\n")
    text = ("`tests/test_a.py::test_one`, test_a::TestB, `tests/test_a.py::test_two`; renamed: "
            "`tests/test_a.py::test_uno`; gone: `tests/test_gone.py::test_one`")
    assert missing_citations(text, tmp_path) == ["tests/test_a::test_uno", "tests/test_gone::test_one"]
