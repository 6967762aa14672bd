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
