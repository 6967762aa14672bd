"""The code and the docs state what is true now, not how it came to be (issue 59, item 7).

The source's comments and docstrings say what the code does and why; measured figures live on
the performance page (docs/performance.md) and in benchmarks/results/*.json, dated runs in
benchmarks/archive/. So no comment or docstring in src/ cites the benchmark diary
(``RESULTS.md``), narrates a review or an earlier route, or carries a date; and no page of the
docs, the README or a benchmark script links to ``benchmarks/RESULTS.md``, which is archived.

Reference: the files themselves: Python comments read with :mod:`tokenize` and docstrings (every
bare string statement) with :mod:`ast`; C/C++ and JavaScript/CSS comments with a scanner that
skips string and character literals; HTML comments with a regex."""

import ast
import io
import pathlib
import re
import tokenize

REPO = pathlib.Path(__file__).resolve().parent.parent
SRC = REPO / "src" / "gpt2mha"

#: What a comment must not say: the diary, a narrated review or earlier route, a date.
FORBIDDEN = (
    ("the benchmark diary", re.compile(r"RESULTS\.md")),
    ("a narrated review", re.compile(r"break-it", re.IGNORECASE)),
    ("a narrated earlier route", re.compile(r"before\s+this\s+(route|fix|change)|what\s+was\s+tried|we\s+tried", re.IGNORECASE)),
    ("a date", re.compile(r"\b20\d\d-\d\d-\d\d\b")),
)


def python_comments(text: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every comment and every bare string statement (docstrings, ``#:``-style
    attribute docs written as strings) of a Python source."""
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.append((node.lineno, node.value.value))
    return out


def c_comments(text: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every ``//`` and ``/* */`` comment of C, C++, JavaScript or CSS source,
    skipping string, character and template literals (a ``//`` inside ``"http://..."`` is code)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'`":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append((text.count("\n", 0, i) + 1, text[i:j]))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append((text.count("\n", 0, i) + 1, text[i:j]))
            i = j
        else:
            i += 1
    return out


def html_comments(text: str) -> list[tuple[int, str]]:
    return [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in re.finditer(r"<!--.*?-->", text, re.S)]


READERS = {".py": python_comments, ".cpp": c_comments, ".h": c_comments, ".js": c_comments,
           ".css": c_comments, ".html": html_comments}


def offences(comments: list[tuple[int, str]]) -> list[str]:
    return [f"line {line + body[: m.start()].count(chr(10))}: {what}: {m.group(0)!r}"
            for line, body in comments for what, pattern in FORBIDDEN for m in pattern.finditer(body)]


def test_the_readers_find_comments():
    """The scanners find what they must and skip code: a check that finds nothing is no check."""
    py = 'x = "RESULTS.md"  # 2026-12-03\n"""a docstring, break-it"""\n'
    assert offences(python_comments(py)) == ["line 1: a date: '2026-12-03'", "line 2: a narrated review: 'break-it'"]
    cpp = 'const char *u = "http://a/RESULTS.md"; // ok\n/* one\n * RESULTS.md */ char q = \'"\';\n// 2026-01-02\n'
    assert offences(c_comments(cpp)) == ["line 3: the benchmark diary: 'RESULTS.md'", "line 4: a date: '2026-01-02'"]
    assert offences(html_comments("<p>2026-01-01</p>\n<!-- what was\ntried; before this route -->")) == [
        "line 2: a narrated earlier route: 'what was\\ntried'", "line 3: a narrated earlier route: 'before this route'"]


def test_source_comments_have_no_history():
    """Every comment and docstring under src/gpt2mha: no diary citation, no narrated history, no date."""
    found = []
    for path in sorted(SRC.rglob("*")):
        reader = READERS.get(path.suffix)
        if reader is None or not path.is_file():
            continue
        found += [f"{path.relative_to(REPO)} {o}" for o in offences(reader(path.read_text(encoding="utf-8")))]
    assert not found, "history in the source's comments (say what and why now):\n" + "\n".join(found)


def test_nothing_links_the_archived_diary():
    """The docs, the README, mkdocs.yml, the benchmark scripts and the tests name no ``RESULTS.md``:
    the diary is in benchmarks/archive/ under a dated name, the figures on the performance page."""
    paths = [REPO / "README.md", REPO / "mkdocs.yml", *sorted((REPO / "docs").rglob("*.md")),
             *sorted((REPO / "benchmarks").glob("*.py")), *sorted((REPO / "tests").rglob("*.py"))]
    found = [f"{p.relative_to(REPO)}:{i}: {line.strip()[:120]}"
             for p in paths if p.exists() and p != pathlib.Path(__file__).resolve()
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if "RESULTS.md" in line]
    assert not found, "links to benchmarks/RESULTS.md, which is archived:\n" + "\n".join(found)
    assert not (REPO / "benchmarks" / "RESULTS.md").exists()


def test_the_docs_narrate_no_tries_or_reviews():
    """The documentation's pages say what is, not what was tried on the way or what a review found
    (the dated runs and the routes that did not pay are in benchmarks/archive/)."""
    found = [f"{p.relative_to(REPO)}:{i}: {m.group(0)!r}"
             for p in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             for what, pattern in FORBIDDEN[1:3] for m in pattern.finditer(line)]
    assert not found, "history in the docs:\n" + "\n".join(found)
