"""The documentation site (docs/, mkdocs.yml) cannot rot: its code runs, its CLI reference covers
the parser, its links and pictures exist.

- Every fenced ``python`` / ``bash`` block of the tutorials and how-to guides carries a marker
  on the line before it: ``<!-- test: run -->`` (run here), ``<!-- test: write FILE -->`` (the
  block is a file the next blocks use), or ``<!-- test: skip REASON -->`` (a server to keep
  running, torchrun, a download, minutes of work: said why). A page's marked blocks run in
  order, offline, on the built-in model, in a fresh directory holding a link to ``data/``:
  Python blocks in one namespace (as a notebook), bash lines one by one (``gpt2mha ...`` lines
  in this process through ``gpt2mha.cli.main``, which must return 0: no torch import per line;
  anything else through ``bash``). ``<!-- test: server -->`` marks the bash block that starts the
  page's server: its lines run, but its ``gpt2mha serve ARGS`` line starts that server (the
  model, name and limits ``gpt2mha serve ARGS`` serves) in this process on a free port, for the
  rest of the page. ``<!-- test: run server -->`` runs a block against it (its
  ``http://127.0.0.1:8000`` replaced by the test server's address); every ``curl`` request of
  such a block must answer a 2xx status. ``... needs MODULE`` skips the block without MODULE.
- The CLI reference page (docs_hooks/cli_reference.py, an MkDocs hook) names every subcommand and
  every flag ``gpt2mha.cli.build_parser()`` has.
- The hooks live outside docs/, so the built site holds none of their code, and the docs extra
  pins a theme that prints no end-of-life banner on a plain ``mkdocs build``.
- Every relative link and image of docs/ points at a file that exists (``mkdocs build --strict``
  in CI checks the rest: anchors, the API reference's objects).

Reference: the pages themselves; MkDocs' hook API (``on_page_markdown``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RUNNABLE_DIRS = ("tutorials", "how-to")
FENCE = re.compile(r"(?:^<!-- test: (?P<marker>[^>]*?) -->\n)?^```(?P<lang>[\w-]*)[^\n]*\n(?P<code>.*?)^```[ \t]*$",
                   re.M | re.S)
SERVER_URL = "http://127.0.0.1:8000"


def blocks(page: pathlib.Path):
    """``[(language, marker or None, code, line)]`` of every fenced block of ``page``."""
    text = page.read_text(encoding="utf-8")
    return [(m["lang"], m["marker"], m["code"], text.count("\n", 0, m.start("code")) + 1)
            for m in FENCE.finditer(text)]


def runnable_pages():
    return sorted(p for d in RUNNABLE_DIRS for p in (DOCS / d).glob("*.md"))


def load_hook():
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "docs_hooks" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------- markers
@pytest.mark.parametrize("page", runnable_pages(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_code_block_of_the_guides_is_marked(page):
    """A python or bash block without a marker would be neither run nor said to be skipped."""
    for lang, marker, _, line in blocks(page):
        if lang in ("python", "bash", "sh"):
            assert marker, f"{page.relative_to(ROOT)}:{line}: a ```{lang} block without <!-- test: ... -->"
            kind = marker.split()[0]
            assert kind in ("run", "skip", "write", "server"), \
                f"{page.relative_to(ROOT)}:{line}: unknown marker {marker!r}"
            if kind == "skip":
                assert len(marker.split()) > 1, f"{page.relative_to(ROOT)}:{line}: say why the block is skipped"


def test_the_guides_have_runnable_blocks():
    """The collector finds what it should (a broken pattern would pass every page vacuously)."""
    ran = {p.name: sum(1 for _, m, _, _ in blocks(p) if m and m.split()[0] == "run") for p in runnable_pages()}
    assert ran["build-attention.md"] >= 5 and ran["look-inside.md"] >= 2 and ran["quantize.md"] >= 1
    assert sum(ran.values()) >= 25
    serve = blocks(DOCS / "how-to" / "serve.md")
    starts = [code for _, m, code, _ in serve if m == "server"]
    assert len(starts) == 1 and [w[:2] for _, w in bash_commands(starts[0])][-1] == ["gpt2mha", "serve"]
    requests = [line for lang, m, code, _ in serve if m == "run server" and lang == "bash"
                for line, words in bash_commands(code) if words[0] == "curl"]
    assert len(requests) >= 4, requests


# ------------------------------------------------------------------------------- running
def bash_commands(code: str):
    """The commands of a bash block: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            yield line, words


def run_bash(code: str, cwd: pathlib.Path, where: str, requests: bool = False) -> None:
    """Run a bash block's commands (see the module's docstring); with ``requests``, every ``curl``
    command must also answer an HTTP status in 200-299 (written by ``-w``, whatever its ``-f``)."""
    from gpt2mha.cli import main

    env = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "HF_HUB_OFFLINE": "1"}
    for line, words in bash_commands(code):
        if words[0] == "gpt2mha" and not re.search(r"[|&;<>]", line.split("#")[0]):
            try:
                code_ = main(words[1:])
            except SystemExit as e:                       # argparse's exit (usage errors, --help)
                code_ = e.code
            assert code_ == 0, f"{where}: `{line.strip()}` exited {code_}"
        else:
            curl = requests and words[0] == "curl" and not re.search(r"[|&;<>]", line.split("#")[0])  # a pipeline runs as written
            command = shlex.join([*words, "-w", "\nHTTP %{http_code}\n"]) if curl else line
            done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                                  timeout=120)
            assert done.returncode == 0, f"{where}: `{line.strip()}` exited {done.returncode}:\n{done.stderr[-2000:]}"
            if curl:
                status = done.stdout.rstrip().rsplit("\n", 1)[-1]
                assert re.fullmatch(r"HTTP 2\d\d", status), f"{where}: `{line.strip()}` answered {status}:\n" \
                                                             f"{done.stdout[-2000:]}"


@contextlib.contextmanager
def page_server(line: str, where: str):
    """The server ``gpt2mha serve ARGS`` (the page's ``line``) starts: its model, served name, chat
    template and limits, as ``gpt2mha serve`` builds them (:func:`gpt2mha.cli.tools.served_model`),
    run in this process on a free port of 127.0.0.1; yields its address."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from gpt2mha.cli import build_parser
    from gpt2mha.cli.tools import served_model
    from gpt2mha.serving.chat import load_chat_template
    from gpt2mha.inference.scheduler import Scheduler
    from gpt2mha.serving.server import serve_in_thread

    words = shlex.split(line, comments=True)
    args = build_parser().parse_args(words[1:])
    assert args.port == 8000 and args.host == "127.0.0.1", f"{where}: the page's server must be the one it calls"
    model, tok, name = served_model(args)
    sched = Scheduler(model, tok, max_batch=args.max_batch, max_queue=args.max_queue,
                      batch_invariant=args.batch_invariant)
    with serve_in_thread(sched, name, max_body_bytes=args.max_body_bytes, max_stop=args.max_stop,
                         chat_template=load_chat_template(args.chat_template),
                         max_tokens_overflow=args.max_tokens_overflow) as url:
        yield url


def start_page_server(code: str, cwd: pathlib.Path, where: str, stack: contextlib.ExitStack) -> str:
    """Run a ``server`` block: its lines, but its ``gpt2mha serve`` line starts
    :func:`page_server` (kept running by ``stack``); returns the server's address."""
    url = None
    for line, words in bash_commands(code):
        if words[:2] == ["gpt2mha", "serve"]:
            url = stack.enter_context(page_server(line, where))
        else:
            run_bash(line, cwd, where)
    assert url is not None, f"{where}: a server block without a `gpt2mha serve` line"
    return url


@contextlib.contextmanager
def in_directory(path: pathlib.Path):
    before = os.getcwd()
    os.chdir(path)
    sys.path.insert(0, str(path))
    try:
        yield
    finally:
        os.chdir(before)
        sys.path.remove(str(path))


@pytest.mark.slow
@pytest.mark.parametrize("page", runnable_pages(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_guides_code_runs(page, tmp_path, one_thread):
    """Every block marked ``run`` runs without error (Python: no exception, its asserts hold;
    bash: exit 0), in order, on the built-in model, offline."""
    todo = [(lang, marker.split(), code, line) for lang, marker, code, line in blocks(page)
            if marker and marker.split()[0] in ("run", "write", "server")]
    if not any(m[0] == "run" for _, m, _, _ in todo):
        pytest.skip("no block of this page is marked runnable")
    (tmp_path / "data").symlink_to(ROOT / "data")
    namespace = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    url = None
    with in_directory(tmp_path), contextlib.ExitStack() as stack:
        for lang, marker, code, line in todo:
            where = f"{page.relative_to(ROOT)}:{line}"
            if marker[0] == "write":
                (tmp_path / marker[1]).write_text(code, encoding="utf-8")
                continue
            if marker[0] == "server":
                url = start_page_server(code, tmp_path, where, stack)
                continue
            if marker[2:3] == ["needs"] and importlib.util.find_spec(marker[3]) is None:
                continue                                  # an optional client this environment lacks
            if marker[1:2] == ["server"]:
                assert url is not None, f"{where}: a `run server` block before the page's `server` block"
                code = code.replace(SERVER_URL, url)
            if lang == "python":
                exec(compile(code, where, "exec", dont_inherit=True), namespace)   # as a script runs it: not
                                                                                    # this file's __future__
            elif lang in ("bash", "sh"):
                run_bash(code, tmp_path, where, requests=marker[1:2] == ["server"])
            else:
                raise AssertionError(f"{where}: cannot run a ```{lang} block")
        for name in [m for m in sys.modules if m in {p.stem for p in tmp_path.glob("*.py")}]:
            del sys.modules[name]                         # a module the page wrote, gone with the directory


# ------------------------------------------------------------------------------- CLI reference
def test_the_cli_reference_names_every_subcommand_and_flag():
    """The page is generated from the parser: every subcommand has its section and every
    argument ``--help`` shows (each of its option strings, each positional) is in it."""
    from gpt2mha.cli import build_parser

    hook = load_hook()
    page = (DOCS / "reference" / "cli.md").read_text(encoding="utf-8")
    assert hook.MARKER in page, "docs/reference/cli.md lost its <!-- cli-reference --> marker"
    assert "docs_hooks/cli_reference.py" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    rendered = hook.on_page_markdown(page)
    parser = build_parser()
    subs = hook.subcommands(parser)
    assert len(subs) >= 15 and {"generate", "serve", "info", "explain"} <= set(subs)
    for name, (sub, _) in subs.items():
        section = rendered.split(f"## gpt2mha {name} {{#{name}}}", 1)
        assert len(section) == 2, f"no section for `gpt2mha {name}`"
        body = section[1].split("\n## ", 1)[0]
        for action in hook.arguments(sub):
            for flag in action.option_strings:
                assert f"`{flag}" in body, f"`gpt2mha {name} {flag}` is missing from the CLI reference"
            if not action.option_strings:
                assert f"`{action.metavar or action.dest}`" in body, f"`gpt2mha {name}`'s {action.dest} is missing"


def test_the_cli_reference_sees_a_new_flag():
    """A flag added to a parser appears on the page (the page is rendered, not copied)."""
    from gpt2mha.cli import build_parser

    hook = load_hook()
    parser = build_parser()
    sub = hook.subcommands(parser)["info"][0]
    sub.add_argument("--a-flag-added-today", help="what it does | with a pipe")
    sub.add_argument("--hidden", help=argparse.SUPPRESS)
    text = hook.render(parser)
    assert "`--a-flag-added-today A_FLAG_ADDED_TODAY` | what it does \\| with a pipe |" in text
    assert "--hidden" not in text


# ------------------------------------------------------------------------------- the site build
#: the first mkdocs-material releases that print a banner on every build (9.7.2: "MkDocs 2.0 ...",
#: 9.7.6 and 9.8: "reaches end of life"), read in each release's material/plugins/__init__.py and
#: material/templates/__init__.py
BANNER_RELEASES = ("9.7.2", "9.7.6", "9.8.0", "9.8.2")


def docs_extra(package: str) -> str:
    """The version specifier pyproject.toml's ``docs`` extra gives ``package``."""
    extra = re.search(r"^docs = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.M)
    assert extra, "pyproject.toml has no docs extra"
    spec = next((r for r in re.findall(r'"([^"]+)"', extra[1]) if re.match(rf"{re.escape(package)}\b", r)), None)
    assert spec, f"the docs extra does not name {package}"
    return spec[len(package):]


def test_the_hooks_live_outside_the_docs_directory():
    """MkDocs copies every file under docs/ into the site: a hook there would be published."""
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    hooks = re.search(r"^hooks:\n((?:  - .*\n)+)", config, re.M)
    assert hooks, "mkdocs.yml lists no hooks"
    for path in re.findall(r"  - (.*)", hooks[1]):
        assert (ROOT / path).is_file(), f"mkdocs.yml names a missing hook {path}"
        assert not (ROOT / path).resolve().is_relative_to(DOCS), f"the hook {path} lies under docs/"
    assert not list(DOCS.rglob("*.py")), "a .py file under docs/ would be copied into the site"


def test_the_docs_extra_pins_a_theme_without_the_banner():
    """A plain ``mkdocs build`` or ``mkdocs serve`` prints no end-of-life banner: the releases that
    print one (silenced only by NO_MKDOCS_2_WARNING=1) are outside the docs extra's pin."""
    from packaging.specifiers import SpecifierSet

    spec = SpecifierSet(docs_extra("mkdocs-material"))
    assert spec.contains("9.7.1"), f"mkdocs-material{spec} excludes 9.7.1, the last release without the banner"
    for release in BANNER_RELEASES:
        assert not spec.contains(release), f"mkdocs-material{spec} admits {release}, which prints a banner"


@pytest.mark.slow
def test_the_built_site_holds_no_python_file(tmp_path):
    """``mkdocs build --strict`` (as CI runs it, about 10 s) succeeds, publishes no .py file (the
    CLI reference hook stays out of the site), and, with the pinned theme, prints no banner."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    from importlib.metadata import version

    from packaging.specifiers import SpecifierSet

    env = {k: v for k, v in os.environ.items() if k not in ("NO_MKDOCS_2_WARNING", "DISABLE_MKDOCS_2_WARNING")}
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (site / "reference" / "cli" / "index.html").exists()
    assert not list(site.rglob("*.py")), f"the site publishes {[str(p.relative_to(site)) for p in site.rglob('*.py')]}"
    if version("mkdocs-material") in SpecifierSet(docs_extra("mkdocs-material")):
        for banner in ("end of life", "MkDocs 2.0", "NO_MKDOCS_2_WARNING"):
            assert banner not in done.stdout + done.stderr, f"mkdocs build printed the theme's banner ({banner!r})"


# ------------------------------------------------------------------------------- the kernels' pages
def kernel_sources() -> tuple[str, ...]:
    """gpt2mha.kernels.build.SOURCES: every file the library is compiled from (standard library only)."""
    from gpt2mha.kernels import build

    return build.SOURCES


def test_the_kernel_pages_name_every_source():
    """The kernels reference and the code layout list the sources the build compiles, by name, so a
    new source file shows up as a missing name rather than as a stale count."""
    sources = kernel_sources()
    assert len([s for s in sources if s.endswith(".cpp")]) >= 8
    for page in (DOCS / "reference" / "kernels.md", DOCS / "reference" / "layout.md"):
        text = page.read_text(encoding="utf-8")
        missing = [name for name in sources if f"`{name}`" not in text]
        assert not missing, f"{page.relative_to(ROOT)} does not name {missing}"


COUNTED = re.compile(r"\b(?:\d+|one|two|three|four|five|six|seven|eight|nine|ten)\s+(?:C\+\+\s+)?(?:files|sources)\b"
                     r"|[\d,]+\s+lines\s+of\s+C\+\+"
                     r"|compile[sd]?\s+(?:here,\s+|the\s+kernels\s+|gpt2mha's\s+C\+\+\s+kernels\s+)once", re.I)


def test_no_page_counts_the_kernel_sources_or_says_they_compile_once():
    """A count of the C++ files or lines goes stale with the next source (the pages name them
    instead), and the kernels compile at every install whose sources changed, not once: the docs
    and setup.py's docstring state neither."""
    import ast

    setup = ast.get_docstring(ast.parse((ROOT / "setup.py").read_text(encoding="utf-8")))
    texts = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in DOCS.rglob("*.md")}
    texts["setup.py's docstring"] = setup
    for where, text in texts.items():
        found = COUNTED.search(text)
        assert found is None, f"{where} states {' '.join(found.group(0).split())!r}"


# ------------------------------------------------------------------------------- links
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", sorted(DOCS.rglob("*.md")), ids=lambda p: str(p.relative_to(DOCS)))
def test_relative_links_and_images_exist(page):
    """A link to another page, a picture, or a file of the repository (``../../benchmarks/…``) resolves."""
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{page.relative_to(ROOT)}: broken link {target}"


def test_the_nav_lists_every_page():
    """Every page is reachable from the site's navigation (mkdocs.yml's nav)."""
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in DOCS.rglob("*.md"):
        rel = str(page.relative_to(DOCS))
        assert rel in nav, f"docs/{rel} is not in mkdocs.yml's nav"


# ------------------------------------------------------------------------------- figures
FIXTURES = {
    "peers.json": {"benchmark": "peers_isolated", "date": "2030-01-01", "host": "a test CPU", "machine": "a test CPU",
                   "command": "python benchmarks/peers_isolated.py --json FILE", "source": "a test fixture",
                   "reference": "transformers float32",
                   "engines": {"transformers float32": {"b1": 10.0, "b8": 40.0, "p128": 100.0, "p512": 400.0},
                               "gpt2mha int8 per_row": {"b1": 70.0, "b8": 300.0, "p128": 15.0, "p512": 60.0},
                               "llama.cpp q4_0": {"b1": 75.0, "b8": 200.0, "p128": 30.0}}},
    "quality.json": {"benchmark": "quality", "date": "2030-01-01", "command": "x", "source": "a test fixture",
                     "schemes": [{"name": "float32", "engine": "gpt2mha", "top1": 100.0, "bits_per_byte": 2.71,
                                  "mb_per_step": 495},
                                 {"name": "int8", "engine": "gpt2mha", "top1": 99.6, "bits_per_byte": 2.7103,
                                  "mb_per_step": 124},
                                 {"name": "q4_0", "engine": "llama.cpp", "top1": 94.0, "bits_per_byte": 2.70,
                                  "mb_per_step": 80},
                                 {"name": "no bytes", "engine": "onnxruntime", "top1": 96.0, "bits_per_byte": None,
                                  "mb_per_step": None}]},
    "serve.json": {"benchmark": "serve_load", "date": "2030-01-01", "host": "a test CPU", "command": "x",
                   "source": "a test fixture",
                   "models": {"m": [{"clients": 1, "tok_s": 10.0}, {"clients": 4, "tok_s": 30.0},
                                    {"clients": 16, "tok_s": 50.0}]}},
}


def test_plots_draws_every_figure_from_small_json(tmp_path):
    """benchmarks/plots.py turns a results directory into the four PNGs, naming the run's host
    and date; a missing JSON skips only its own figures."""
    import json

    from conftest import load_benchmark

    plots = load_benchmark("plots")
    results, out = tmp_path / "results", tmp_path / "images"
    results.mkdir()
    for name, data in FIXTURES.items():
        (results / name).write_text(json.dumps(data), encoding="utf-8")
    assert plots.main(["--results", str(results), "--out", str(out)]) == 0
    for png in plots.FIGURES:
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, png
    assert plots.where(FIXTURES["peers.json"]) == "a test CPU, 2030-01-01"
    (results / "serve.json").unlink()
    (out / "serve.png").unlink()
    assert plots.main(["--results", str(results), "--out", str(out)]) == 0
    assert not (out / "serve.png").exists() and (out / "decode.png").exists()


def test_the_committed_results_say_where_they_come_from_and_their_figures_exist():
    """Every JSON of benchmarks/results names its date, command and source (a transcription says
    which archived section), and every figure the script draws from them is committed."""
    import json

    from conftest import load_benchmark

    plots = load_benchmark("plots")
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):
        data = json.loads(path.read_text(encoding="utf-8"))
        for field in ("benchmark", "date", "command", "source"):
            assert data.get(field), f"{path.name} has no {field!r}"
    for png, (source, _) in plots.FIGURES.items():
        if (ROOT / "benchmarks" / "results" / source).exists():
            assert (DOCS / "images" / png).exists(), f"docs/images/{png} not drawn: python benchmarks/plots.py"


# ------------------------------------------------------------------------------- the server's reference
def reference_table(page: pathlib.Path, heading: str) -> dict[str, str]:
    """``{field: default}`` of the ``| field | default | meaning |`` table under ``heading`` (a
    row naming several fields, `` `a`, `b` ``, gives each one)."""
    text = page.read_text(encoding="utf-8").split(heading, 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| `") else []
        for name in re.findall(r"`([\w.]+)`", cells[0]) if cells else ():
            out[name] = cells[1]
    return out


def test_the_server_reference_lists_the_completions_fields_as_the_schema_takes_them():
    """docs/reference/server.md's table of ``POST /v1/completions`` names only fields the request
    schema has, says ``required`` exactly for the fields the schema requires (``prompt``, not
    ``model``: a request may leave it out), and names every sampling field."""
    pytest.importorskip("fastapi")
    from gpt2mha.inference.params import FIELDS
    from gpt2mha.serving.protocol import CompletionRequest

    table = reference_table(DOCS / "reference" / "server.md", "## `POST /v1/completions`")
    schema = CompletionRequest.model_fields
    assert set(table) <= set(schema) | {"stream_options.include_usage"}, set(table) - set(schema)
    assert {name for name, default in table.items() if default == "required"} == \
        {name for name, field in schema.items() if field.is_required()} == {"prompt"}
    assert set(FIELDS) <= set(table), set(FIELDS) - set(table)


@pytest.mark.slow
def test_the_server_references_requests_work_against_a_default_server(tmp_path, one_thread):
    """Every curl request of docs/reference/server.md answers a 2xx status from the server a
    bare ``gpt2mha serve`` starts (the built-in model)."""
    page = DOCS / "reference" / "server.md"
    requests = [(code, line) for lang, _, code, line in blocks(page)
                if lang == "bash" and any(words[0] == "curl" for _, words in bash_commands(code))]
    assert requests
    with page_server("gpt2mha serve", str(page)) as url:
        for code, line in requests:
            run_bash(code.replace(SERVER_URL, url), tmp_path, f"{page.relative_to(ROOT)}:{line}", requests=True)
