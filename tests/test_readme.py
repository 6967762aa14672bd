"""What the README promises a new user, checked against the README itself.

Reference: the README's own text (its two set-up commands, what CI runs) and `.ci/run`."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def between(first: str, last: str) -> str:
    """The README's text from ``first`` up to ``last``."""
    start = README.index(first)
    return README[start:README.index(last, start)]


def test_the_test_command_states_no_figure_of_a_dated_run():
    """How long the suite took or how many tests passed on some day is history, not a promise:
    the set-up section states neither (a duration in minutes or seconds, a pass or test count,
    a date)."""
    text = between("Run the tests", "`pip install torch==2.13.0` comes first")
    for pattern in (r"\d+(\.\d+)?\s*(minutes|min\b|seconds|s\b)", r"\d+ (passed|tests|skipped)",
                    r"20\d\d-\d\d-\d\d"):
        found = re.search(pattern, text)
        assert found is None, f"README's set-up section states {found.group(0)!r}"


def test_ci_runs_the_readmes_test_command():
    """`.ci/run` ends in the README's test command (`python -m pytest -q`), after the README's
    install steps (torch pinned first, then the project with its test extras)."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    command = re.search(r"```bash\n(\. \.venv/bin/activate && .*python -m pytest -q)\n```", README)
    assert command, "the README's test command is missing"
    assert "pip install torch==2.13.0" in README and "pip install -q torch==2.13.0" in ci
    assert re.search(r"python -m pytest -q\s*$", ci.strip().splitlines()[-1])


def test_readme_is_a_screen_or_two():
    """The README says what gpt2mha is, how to start, a table of what it does, one performance
    table and where things are; the rest lives in docs/ (issue 44)."""
    assert len(README.splitlines()) <= 200, f"README.md has {len(README.splitlines())} lines; move detail to docs/"


def test_readme_states_no_dated_timing_or_load_figure():
    """No date, clock time, time zone or load average anywhere in the README: dated runs live in
    benchmarks/archive/, the current figures with their date on docs/performance.md."""
    for pattern in (r"20\d\d-\d\d-\d\d", r"\b\d\d:\d\d\b", r"\bUTC\b", r"load average", r"\bload \d"):
        found = re.search(pattern, README)
        assert found is None, f"README states {found.group(0)!r}"


def test_readmes_links_exist():
    """Every relative link of the README (docs pages, their anchors' files) points at a file."""
    for target in re.findall(r"\]\(([^)\s]+)\)", README):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        assert (ROOT / target.split("#")[0]).exists(), f"README links to a missing {target}"


def test_readmes_performance_ratios_are_the_results_json():
    """The README's table is benchmarks/results/peers.json's run: each engine's ratio to
    transformers float32, to one decimal (decode: higher tok/s; prefill: lower ms)."""
    import json

    run = json.loads((ROOT / "benchmarks" / "results" / "peers.json").read_text(encoding="utf-8"))
    ref = run["engines"][run["reference"]]
    names = {"gpt2mha int8 per_row": "gpt2mha int8 per_row", "gpt2mha int4 per_block": "gpt2mha int4 per_block",
             "llama.cpp q4_0": "llama.cpp q4_0", "llama.cpp q8_0": "llama.cpp q8_0",
             "ONNX Runtime int8": "onnxruntime int8", "CTranslate2 int8": "ctranslate2 int8"}
    table = between("## How fast", "Machine:")
    for shown, key in names.items():
        row = next((line for line in table.splitlines() if line.startswith("| ") and shown in line), None)
        assert row, f"the README's performance table has no row for {shown}"
        cells = [c.strip().strip("*") for c in row.strip("|").split("|")][1:5]
        r = run["engines"][key]
        expected = [r["b1"] / ref["b1"], r["b8"] / ref["b8"], ref["p128"] / r["p128"], ref["p512"] / r["p512"]]
        assert cells == [f"{x:.1f}×" for x in expected], f"{shown}: README {cells}, results {expected}"
