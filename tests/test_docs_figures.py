"""Every speed figure of the documentation (docs/, README.md) is a benchmark's JSON, read again.

- A **speed figure** is a number with ``×`` or ``x`` right after it (``9.34×``, ``1.3–1.7x``); a
  product of dimensions (``12 × 64``) has spaces and is not one.
- It may stand only where a marker ``<!-- figures: NAME.json, ... -->`` names the JSON it comes
  from (from the marker to the next marker or heading; ``NAME.json`` is in
  ``benchmarks/results/``, ``archive/NAME.json`` in ``benchmarks/archive/``), and it must be, as
  printed (to its decimals), the ratio of two numbers of one named JSON that differ in one
  respect: two engines at one figure, one engine at two figures, two routes or two kernels of
  one product (a list of rounds counts as its best, worst and median as well; a range's ends
  each are such ratios). A figure no marker covers, or that no named JSON gives, fails. Where a
  marker stands, a percentage with decimals (a top-1 agreement: ``97.42%``) is a number of its JSON.
- That rule is a coarse net (a JSON holds hundreds of ratios; it catches a figure from another
  run or none). The exact checks: the performance page's tables and the quality tables, cell by
  cell (every number, not only the ratios; the README's table: tests/test_readme.py), and the
  README's and the performance page's sentences of ratios, each figure computed from its JSON.

Reference: the JSON files in benchmarks/results/ and benchmarks/archive/ (written by the
benchmarks, or transcribed, each naming its source).
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import pathlib
import re
import statistics
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BENCH = ROOT / "benchmarks"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]

FIGURE = re.compile(r"(?<![\w.])(?P<low>\d+(?:\.\d+)?)(?:\s*[–-]\s*(?P<high>\d+(?:\.\d+)?))?[×x](?!\w)")
PERCENT = re.compile(r"(?<![\w.])(\d+\.\d+)%")
MARKER = re.compile(r"^<!-- figures: (?P<names>[^>]*?) -->$", re.M)
HEADING = re.compile(r"^#{1,6} ", re.M)


# ------------------------------------------------------------------------------- reading
def load(name: str) -> dict:
    """A marker's name: ``NAME.json`` in benchmarks/results/, ``archive/NAME.json`` in benchmarks/archive/."""
    path = BENCH / name if name.startswith("archive/") else BENCH / "results" / name
    assert path.is_file(), f"a figures marker names {name}, which is not {path.relative_to(ROOT)}"
    return json.loads(path.read_text(encoding="utf-8"))


def product_totals(data: dict) -> dict:
    """product_ceilings: each dtype and row count's step, all products and the blocks alone (no
    ``lm_head``): the sums of ``ms × count``, ours and torch's, and the range of each rate."""
    totals: dict = {}
    for r in data.get("rows", []):
        for part in ("all", "blocks"):
            if part == "blocks" and r["product"] == "lm_head":
                continue
            t = totals.setdefault(r["dtype"], {}).setdefault(str(r["M"]), {}).setdefault(
                part, {"ours_ms": 0.0, "torch_ms": 0.0})
            t["ours_ms"] += r["ours_ms"] * r["count"]
            t["torch_ms"] += r["torch_ms"] * r["count"]
    return totals


def leaves(data, path=()):
    """``(path, value)`` of every number of ``data``; a list of numbers adds its max, min and median."""
    if isinstance(data, bool) or data is None:
        return
    if isinstance(data, (int, float)):
        if math.isfinite(data):
            yield path, float(data)
        return
    if isinstance(data, dict):
        for key, value in data.items():
            yield from leaves(value, (*path, str(key)))
        return
    if isinstance(data, list):
        for i, value in enumerate(data):
            yield from leaves(value, (*path, i))
        numbers = [v for v in data if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if len(numbers) > 1:
            for name, value in (("max", max(numbers)), ("min", min(numbers)), ("median", statistics.median(numbers))):
                yield (*path, name), float(value)


def ratios(data: dict) -> list[float]:
    """Every ratio of two numbers of ``data`` whose paths differ in one place (sorted)."""
    found = list(leaves(data))
    if data.get("benchmark") == "product_ceilings":
        found += list(leaves(product_totals(data), ("totals",)))
    groups: dict = {}
    for path, value in found:
        for i in range(len(path)):
            groups.setdefault((len(path), i, path[:i], path[i + 1:]), []).append(value)
    out = {a / b for values in groups.values() for a, b in itertools.permutations(values, 2) if b}
    return sorted(out)


def decimals(text: str) -> int:
    return len(text.split(".")[1]) if "." in text else 0


def shown(value: float, text: str) -> bool:
    """``value`` printed to ``text``'s decimals is ``text`` (half away from zero, as people round)."""
    d = decimals(text)
    return math.isclose(math.floor(value * 10 ** d + 0.5) / 10 ** d, float(text), abs_tol=1e-9) or \
        f"{value:.{d}f}" == text


def backed(text: str, candidates: list[float]) -> bool:
    target, half = float(text), 0.5 * 10 ** -decimals(text)
    i = bisect.bisect_left(candidates, target - half - 1e-9)
    return any(shown(c, text) for c in candidates[i:bisect.bisect_right(candidates, target + half + 1e-9)])


def scopes(text: str):
    """``[(start, end, [names])]``: each marker's reach, to the next marker or heading."""
    stops = sorted({m.start() for m in MARKER.finditer(text)} | {m.start() for m in HEADING.finditer(text)} | {len(text)})
    out = []
    for m in MARKER.finditer(text):
        end = next(s for s in stops if s > m.start())
        out.append((m.end(), end, [n.strip() for n in m["names"].split(",") if n.strip()]))
    return out


def unbacked(page: pathlib.Path) -> list[str]:
    """Every speed figure of ``page`` that no marker covers or that its JSON does not give."""
    text = page.read_text(encoding="utf-8")
    cache: dict = {}
    covered = scopes(text)
    problems = []
    for m in FIGURE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        where = f"{page.relative_to(ROOT)}:{line}: {m.group(0)!r}"
        names = next((names for start, end, names in covered if start <= m.start() < end), None)
        if names is None:
            problems.append(f"{where}: no <!-- figures: NAME.json --> marker names where it comes from")
            continue
        candidates = sorted(itertools.chain.from_iterable(
            cache.setdefault(n, ratios(load(n))) for n in names))
        for end in ("low", "high"):
            if m[end] and not backed(m[end], candidates):
                problems.append(f"{where}: {m[end]} is no ratio of {', '.join(names)}")
    for start, end, names in covered:
        values = sorted(v for n in names for _, v in leaves(load(n)))
        for m in PERCENT.finditer(text, start, end):
            if not backed(m[1], values):
                line = text.count("\n", 0, m.start()) + 1
                problems.append(f"{page.relative_to(ROOT)}:{line}: {m.group(0)!r}: no number of {', '.join(names)}")
    return problems


# ------------------------------------------------------------------------------- the rule
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_speed_figure_is_a_ratio_of_the_json_it_names(page):
    problems = unbacked(page)
    assert not problems, "\n".join(problems)


def test_the_rule_finds_figures_and_rejects_a_wrong_one(tmp_path, monkeypatch):
    """The scan sees both spellings and ranges, not dimension products; a marker's JSON backs
    its own ratios only, to the printed decimals; a figure without a marker fails."""
    run = {"engines": {"a": {"b1": 10.0, "p512": 400.0}, "b": {"b1": 73.0, "p512": 60.0}}}
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "run.json").write_text(json.dumps(run), encoding="utf-8")
    monkeypatch.setattr(sys.modules[__name__], "BENCH", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    page = tmp_path / "page.md"
    page.write_text("A 12 × 64 matrix, 2.0× before any marker.\n\n<!-- figures: run.json -->\n\n"
                    "b: 7.3× a at batch 1, 6.67x in prefill, 6.7–7.30× in all; 7.2× is wrong.\n"
                    "## Next\n\n9.8× after the heading.\n", encoding="utf-8")
    problems = unbacked(page)
    assert [p.split(": ", 2)[1] for p in problems] == ["'2.0×'", "'7.2×'", "'9.8×'"], problems
    assert "no <!-- figures" in problems[0] and "no ratio of run.json" in problems[1]


# ------------------------------------------------------------------------------- quality tables
def table(text: str, header: str) -> list[list[str]]:
    """The rows (cells without bold or spaces) of the Markdown table whose header line starts with ``header``."""
    start = text.index(header)
    lines = text[start:].split("\n\n", 1)[0].splitlines()
    return [[c.strip().replace("**", "") for c in line.strip().strip("|").split("|")] for line in lines[2:]]


def quality() -> dict[str, dict]:
    return {s["name"]: s for s in load("quality.json")["schemes"]}


def percents(cell: str) -> list[str]:
    return re.findall(r"(\d+(?:\.\d+)?)%", cell)


def test_the_quality_table_is_quality_json():
    """explanation/quantization.md's table: one row per scheme of quality.json, in its order, with
    its CLI, top-1 (2 decimals), bits/byte (4 decimals, — where none) and MB per step."""
    rows = table((DOCS / "explanation" / "quantization.md").read_text(encoding="utf-8"), "| format | CLI |")
    schemes = load("quality.json")["schemes"]
    assert [r[0] for r in rows] == [s["name"] for s in schemes]
    for row, s in zip(rows, schemes):
        _, cli, top1, bpb, mb = row
        if s["engine"] == "gpt2mha":
            assert cli.strip("`") == (s["cli"] or "(none)"), (s["name"], cli)
        assert top1 == f"{s['top1']:.2f}%", (s["name"], top1)
        assert bpb == ("—" if s["bits_per_byte"] is None else f"{s['bits_per_byte']:.4f}"), (s["name"], bpb)
        assert mb == ("—" if s["mb_per_step"] is None else f"{s['mb_per_step']:g}"), (s["name"], mb)


#: choose-configuration.md's goals and the quality.json schemes each row quotes, in its order
CHOICES = {"exact": ["float32"], "best quality, quantized": ["int8 (GPTQ)"],
           "batch throughput and long prompts": ["int8 per_row (RTN)", "int8 per_row (GPTQ)"],
           "exact decode, fast long prompts": ["int8 (GPTQ)", "int8 per_row (RTN)"],
           "fewer bytes, near int8 per_row's quality": ["int4 g32 (GPTQ)"],
           "batch-1 latency, fewest bytes": ["int4 g64, int4 head (GPTQ)"],
           "half the memory, near exact": ["bfloat16", "float16"]}


def test_the_configuration_table_quotes_quality_json():
    """Each goal's pick is its scheme's CLI (GPTQ: RTN adds ``--quantize-method rtn``) and its top-1,
    bits/byte and MB per step are its schemes', to the decimals printed."""
    schemes = quality()
    rows = table((DOCS / "how-to" / "choose-configuration.md").read_text(encoding="utf-8"), "| goal |")
    assert [r[0].split(":")[0] for r in rows] == list(CHOICES)
    for goal, pick, top1, bpb, mb, _ in rows:
        names = CHOICES[goal.split(":")[0]]
        chosen = [schemes[n] for n in names]
        if "auto" not in pick:
            flags = next(iter(re.findall(r"`([^`]*)`", pick)), "")
            assert flags in [s["cli"] for s in chosen], f"{goal}: the pick {flags!r}, quality.json {names}"
        shown_top1 = percents(top1)
        assert len(shown_top1) == len(chosen), (goal, top1)
        for text, s in zip(shown_top1, chosen):
            assert shown(s["top1"], text), f"{goal}: top-1 {text}%, quality.json {s['name']} {s['top1']}%"
        shown_bpb = re.findall(r"\d\.\d{4}", bpb)
        assert shown_bpb == [f"{s['bits_per_byte']:.4f}" for s in chosen if s["bits_per_byte"] is not None][:len(shown_bpb)]
        assert mb == f"{chosen[0]['mb_per_step']:g}", (goal, mb)


#: the engines of the speed tables (performance page, README) and their quality.json scheme
TOP1 = {"transformers float32": "float32", "gpt2mha int8 per_row": "int8 per_row (RTN)",
        "gpt2mha int4 per_block": "int4 g32 (GPTQ)", "gpt2mha int4 per_block (GPTQ)": "int4 g32 (GPTQ)",
        "gpt2mha int4 per_block, int4 head, g64": "int4 g64, int4 head (GPTQ)",
        "gpt2mha int4 per_block, int4 head, g64 (GPTQ)": "int4 g64, int4 head (GPTQ)",
        "llama.cpp q8_0": "llama.cpp q8_0", "llama.cpp q4_0": "llama.cpp q4_0 (q6_K head)",
        "CTranslate2 int8": "CTranslate2 int8", "ONNX Runtime int8": "ONNX Runtime int8"}


@pytest.mark.parametrize("page, header", [("docs/performance.md", "| engine | decode batch 1 |"),
                                          ("README.md", "| engine | decode, batch 1 |")])
def test_the_speed_tables_top1_column_is_quality_json(page, header):
    schemes = quality()
    rows = table((ROOT / page).read_text(encoding="utf-8"), header)
    assert len(rows) >= 7
    for row in rows:
        (text,) = percents(row[-1])
        s = schemes[TOP1[row[0]]]
        assert shown(s["top1"], text), f"{page}: {row[0]} top-1 {text}%, quality.json {s['name']} {s['top1']}%"


# ------------------------------------------------------------------------------- the performance page's tables
PERFORMANCE = DOCS / "performance.md"


def number(cell: str) -> str:
    """The first number of a cell (``"28.3 tok/s (1.00×)"`` -> ``"28.3"``)."""
    return re.search(r"\d+(?:\.\d+)?", cell).group(0)


def bracketed(cell: str) -> str | None:
    found = re.search(r"\((\d+(?:\.\d+)?)", cell.replace("**", ""))
    return found[1] if found else None


def speed_ratio(run: dict, engine: str, metric: str, against: str) -> float:
    """``engine``'s speed over ``against``'s at ``metric`` (tok/s divide; ms divide the other way)."""
    a, b = run["engines"][engine][metric], run["engines"][against][metric]
    return b / a if run["units"][metric] == "ms" else a / b


#: the engines' names on the page and in peers_isolated's JSON
ENGINES = {"transformers float32": "transformers float32", "gpt2mha int8 per_row": "gpt2mha int8 per_row",
           "gpt2mha int4 per_block": "gpt2mha int4 per_block",
           "gpt2mha int4 per_block, int4 head, g64": "gpt2mha int4 per_block head4 g64",
           "llama.cpp q8_0": "llama.cpp q8_0", "llama.cpp q4_0": "llama.cpp q4_0", "CTranslate2 int8": "ctranslate2 int8",
           "ONNX Runtime int8": "onnxruntime int8"}
METRICS = ("b1", "b8", "p128", "p512")


def test_the_cpu_engines_table_is_peers_json():
    """Every cell: the engine's figure (tok/s or ms, one decimal) and its ratio to transformers
    float32 (two decimals); every engine of the run has its row."""
    run = load("peers.json")
    rows = table(PERFORMANCE.read_text(encoding="utf-8"), "| engine | decode batch 1 |")
    assert sorted(ENGINES[r[0]] for r in rows) == sorted(run["engines"])
    for row in rows:
        engine = ENGINES[row[0]]
        for cell, metric in zip(row[1:5], METRICS):
            value = run["engines"][engine][metric]
            ratio = speed_ratio(run, engine, metric, run["reference"])
            assert number(cell) == f"{value:.1f}", f"{row[0]} {metric}: page {cell}, peers.json {value:.1f}"
            assert bracketed(cell) == f"{ratio:.2f}", f"{row[0]} {metric}: page {cell}, peers.json {ratio:.2f}×"


#: the precision table's rows: (precision, engine on the page) -> (JSON, engine in it)
PRECISIONS = {("float32", "gpt2mha"): ("peers-float.json", "gpt2mha float32"),
              ("float32", "OpenVINO (f32 forced)"): ("peers-float.json", "openvino f32"),
              ("float32", "CTranslate2"): ("peers-float.json", "ctranslate2 float32"),
              ("float32", "llama.cpp f32 (the 12-03 run)"): ("peers-precisions.json", "llama.cpp f32"),
              ("bf16", "gpt2mha"): ("peers-float.json", "gpt2mha bf16"),
              ("bf16", "OpenVINO (its default hint here)"): ("peers-float.json", "openvino bf16"),
              ("fp16", "gpt2mha"): ("peers-fp16.json", "gpt2mha fp16"),
              ("fp16", "llama.cpp f16"): ("peers-fp16.json", "llama.cpp f16"),
              ("int8", "gpt2mha per_row"): ("peers-precisions.json", "gpt2mha int8 per_row"),
              ("int8", "OpenVINO int8"): ("peers-precisions.json", "openvino int8"),
              ("int8", "llama.cpp q8_0"): ("peers-precisions.json", "llama.cpp q8_0"),
              ("int4", "gpt2mha per_block, int4 head, g64"): ("peers-precisions.json", "gpt2mha int4 per_block head4 g64"),
              ("int4", "OpenVINO int4"): ("peers-precisions.json", "openvino int4"),
              ("int4", "llama.cpp q4_0"): ("peers-precisions.json", "llama.cpp q4_0")}


def precision_rows(header: str) -> list[tuple[str, str, list[str]]]:
    """``[(precision, engine, raw cells)]`` of a precision table (a blank precision is the row above's)."""
    text = PERFORMANCE.read_text(encoding="utf-8")
    start = text.index(header)
    lines = text[start:].split("\n\n", 1)[0].splitlines()[2:]
    out, precision = [], None
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        precision = cells[0] or precision
        out.append((precision, cells[1], cells[2:]))
    return out


def test_the_precision_table_is_its_json_and_bolds_the_leaders():
    """Each cell is its run's figure (one decimal), and a gpt2mha cell is bold exactly where it is
    at or ahead of every engine of its precision (the page's legend)."""
    rows = precision_rows("| precision | engine | decode batch 1 |")
    assert {(p, e) for p, e, _ in rows} == set(PRECISIONS)
    for precision, engine, cells in rows:
        name, key = PRECISIONS[(precision, engine)]
        run = load(name)
        others = [PRECISIONS[(p, e)] for p, e, _ in rows if p == precision and e != engine]
        for cell, metric in zip(cells, ("b1", "b8", "p512")):
            value = run["engines"][key][metric]
            assert number(cell.replace("**", "")) == f"{value:.1f}", f"{precision} {engine} {metric}: {cell}, {name} {value:.1f}"
            if engine.startswith("gpt2mha"):
                faster = [value / load(n)["engines"][k][metric] for n, k in others]
                leads = all((f <= 1) if metric == "p512" else (f >= 1) for f in faster)
                assert cell.startswith("**") == leads, f"{precision} {engine} {metric}: bold {cell.startswith('**')}, leads {leads}"


#: the Zen 4 table's engines: page name -> JSON name (the run's JSON, and the bracketed run's)
ZEN4 = {"gpt2mha": "gpt2mha {p}", "OpenVINO, f32 forced": "openvino f32", "OpenVINO, its default hint": "openvino bf16",
        "llama.cpp f32": "llama.cpp f32", "llama.cpp f16": "llama.cpp f16", "CTranslate2": "ctranslate2 float32",
        "gpt2mha per_row": "gpt2mha int8 per_row", "OpenVINO int8": "openvino int8", "llama.cpp q8_0": "llama.cpp q8_0",
        "gpt2mha per_block, int4 head, g64": "gpt2mha int4 per_block head4 g64", "OpenVINO int4": "openvino int4",
        "llama.cpp q4_0": "llama.cpp q4_0"}
ZEN4_RUNS = {"float": ("peers-float-zen4.json", "archive/peers-float-zen4-2026-12-05-0619.json"),
             "int": ("peers-int-zen4.json", "archive/peers-int-zen4-2026-12-05-0358.json")}


def zen4_key(precision: str, engine: str, run: dict) -> str:
    """``"OpenVINO, f32 forced (f16, its default)"`` -> the run's ``"openvino f32 kv-f16"``."""
    name, cache = re.fullmatch(r"(.*) \((\w+)(?:, its default)?\)", engine).groups()
    base = ZEN4[name].format(p=precision)
    for key in (base, f"{base} kv-{cache}"):
        if key in run["engines"] and run["engines"][key].get("kv_cache") == cache:
            return key
    raise AssertionError(f"{engine}: no engine of the run is {base} with a {cache} cache")


def test_the_zen4_table_is_its_two_runs():
    """Each cell: this run's figure and, in brackets, the run before's (one decimal); each engine's
    KV cache is the one its JSON records."""
    rows = precision_rows("| precision | engine (KV cache) |")
    assert len(rows) == 16
    for precision, engine, cells in rows:
        now, before = (load(n) for n in ZEN4_RUNS["int" if precision.startswith("int") else "float"])
        key = zen4_key(precision, engine, now)
        for cell, metric in zip(cells, ("b1", "b8", "p512")):
            plain = cell.replace("**", "")
            assert number(plain) == f"{now['engines'][key][metric]:.1f}", f"{precision} {engine} {metric}: {cell}"
            assert bracketed(plain) == f"{before['engines'][key][metric]:.1f}", f"{precision} {engine} {metric}: {cell}"


def test_the_product_ceilings_table_is_its_json():
    """Each row: a step's products (``ms × count`` summed; 512 rows: the blocks alone) on gpt2mha and
    torch, their ratio, and the rate ranges the last column names (per product, gpt2mha)."""
    rows = table(PERFORMANCE.read_text(encoding="utf-8"), "| dtype | rows | gpt2mha ms |")
    assert len(rows) == 9
    dtypes = {"float32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    for dtype, m, ours, torch_, ratio, bound in rows:
        data = load("product_ceilings-fp16.json" if dtype == "fp16" else "product_ceilings.json")
        rows_m = number(m)
        part = "blocks" if "blocks only" in m else "all"
        t = product_totals(data)[dtypes[dtype]][rows_m][part]
        assert shown(t["ours_ms"], ours) and shown(t["torch_ms"], torch_), (dtype, m, ours, torch_, t)
        assert shown(t["torch_ms"] / t["ours_ms"], ratio.rstrip("×")), (dtype, m, ratio)
        products = [r for r in data["rows"] if r["dtype"] == dtypes[dtype] and str(r["M"]) == rows_m
                    and (part == "all" or r["product"] != "lm_head")]
        for low, high, unit in re.findall(r"(\d+)–(\d+) (GB/s|GFLOP/s)", bound):
            rates = [r["ours_gbs" if unit == "GB/s" else "ours_gflops"] for r in products]
            assert (low, high) == (f"{min(rates):.0f}", f"{max(rates):.0f}"), (dtype, m, bound, min(rates), max(rates))


def test_the_transformers_table_is_bench_json():
    """Each row's figures and ratio are bench.json's row of that figure."""
    rows = {r["figure"]: r for r in load("bench.json")["rows"]}
    pick = {"decode, batch 1": ["decode tok/s, batch 1, prompt 4"], "decode, batch 8": ["decode tok/s, batch 8, prompt 4"],
            "prefill, 1024": ["prefill T=1024 time: transformers sdpa"],
            "attention sublayer": ["attention sublayer B=8, T=1024, 12x64: transformers GPT2Attention sdpa",
                                   "attention sublayer B=8, T=1024, 12x64: transformers GPT2Attention eager"]}
    page = table(PERFORMANCE.read_text(encoding="utf-8"), "| figure | gpt2mha | transformers | ratio |")
    assert len(page) == len(pick)
    for (figure, ours, theirs, ratio), (start, prefixes) in zip(page, pick.items()):
        assert figure.startswith(start), (figure, start)
        chosen = [next(r for name, r in rows.items() if name.startswith(p)) for p in prefixes]
        ours_value = chosen[0]["vs"] if chosen[0]["unit"] == "ms" else chosen[0]["value"]
        theirs_values = [r["value"] if r["unit"] == "ms" else r["vs"] for r in chosen]
        assert number(ours) == f"{ours_value:g}", (figure, ours, ours_value)
        assert re.findall(r"\d+(?:\.\d+)?", theirs) == [f"{v:g}" for v in theirs_values], (figure, theirs)
        assert re.findall(r"\d+\.\d+", ratio) == [f"{r['ratio']:.2f}" for r in chosen], (figure, ratio)


def test_the_served_table_is_serve_json():
    """Each row: tokens/s, its ratio to one client, and the latency percentiles of serve.json."""
    models = load("serve.json")["models"]
    page = table(PERFORMANCE.read_text(encoding="utf-8"), "| model | clients | tokens/s |")
    assert len(page) == sum(len(v) for v in models.values())
    for model, clients, tok_s, ratio, ttft, per_token in page:
        levels = {str(r["clients"]): r for r in models[model]}
        r = levels[clients]
        assert number(tok_s) == f"{r['tok_s']:g}" and shown(r["tok_s"] / levels["1"]["tok_s"], ratio.rstrip("×"))
        for cell, values in ((ttft, r["ttft_ms"]), (per_token, r["per_token_ms"])):
            texts = re.findall(r"\d+(?:\.\d+)?", cell)
            assert len(texts) == 2 and all(shown(v, t) for v, t in zip(values, texts)), (model, clients, cell, values)


def test_the_llama_server_table_is_its_json():
    """Each row: gpt2mha's output tokens/s over llama-server's at that many clients, and their
    time to the first token at p99, as the run's JSON has them."""
    run = load("serve_peers-2026-12-03-2155.json")["rows"]
    page = table(PERFORMANCE.read_text(encoding="utf-8"), "| clients | int4 / q4_0 |")
    assert [r[0] for r in page] == ["1", "4", "16"]
    for clients, int4, ttft4, int8, ttft8 in page:
        for cell, ttft, ours, theirs in ((int4, ttft4, "gpt2mha int4", "llama.cpp q4_0"),
                                         (int8, ttft8, "gpt2mha int8", "llama.cpp q8_0")):
            a, b = run[f"{ours}|{clients}"], run[f"{theirs}|{clients}"]
            assert number(cell) == f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}", (clients, ours, cell)
            assert ttft == f"{a['ttft_p99'] / b['ttft_p99']:.2f}", (clients, ours, ttft)
            rounds = re.search(r"rounds ([\d., ]+)\)", cell)
            if rounds:
                per_round = [x / y for x, y in zip(a["rounds"], b["rounds"])]
                assert rounds[1].split(", ") == [f"{v:.2f}" for v in per_round], (clients, ours, cell, per_round)


# ------------------------------------------------------------------------------- the summaries in prose
def best_of(run: dict, ours: str, others: list[str]) -> list[float]:
    """``ours``'s speed over the fastest of ``others`` at batch 1, batch 8 and a 512-token prefill."""
    return [min(speed_ratio(run, ours, m, o) for o in others) for m in ("b1", "b8", "p512")]


def zen4() -> dict[str, list[float]]:
    """Each precision's gpt2mha engine against the best engine of its precision (the float ones
    with a cache of their own precision), on the Zen 4 runs."""
    f, i = load("peers-float-zen4.json"), load("peers-int-zen4.json")
    return {"float32": best_of(f, "gpt2mha float32", ["openvino f32", "llama.cpp f32", "ctranslate2 float32"]),
            "bf16": best_of(f, "gpt2mha bf16", ["openvino bf16"]),
            "fp16": best_of(f, "gpt2mha fp16", ["llama.cpp f16"]),
            "int8": best_of(i, "gpt2mha int8 per_row", ["openvino int8", "llama.cpp q8_0"]),
            "int4": best_of(i, "gpt2mha int4 per_block head4 g64", ["openvino int4", "llama.cpp q4_0"])}


def claims():
    """``(page, pattern, values)``: each pattern's groups, in order, are the values as printed."""
    z = zen4()
    peers, precisions, int_zen4 = load("peers.json"), load("peers-precisions.json"), load("peers-int-zen4.json")
    int8, onnx = "gpt2mha int8 per_row", "onnxruntime int8"
    head4, q4 = "gpt2mha int4 per_block head4 g64", "llama.cpp q4_0"
    return [
        ("README.md", r"int8 (\S+)× / (\S+)× / (\S+)× and int4 (\S+)× / (\S+)× / (\S+)× the best of them; "
                      r"float32 (\S+)× / (\S+)× / (\S+)× the best float32 engine \(OpenVINO f32\); "
                      r"bf16 (\S+)× / (\S+)× / (\S+)× OpenVINO bf16; fp16 (\S+)× / (\S+)× / (\S+)× llama.cpp f16",
         z["int8"] + z["int4"] + z["float32"] + z["bf16"] + z["fp16"]),
        ("README.md", r"trade places between runs on this shared machine \((\S+)× here",
         [speed_ratio(peers, head4, "b1", q4)]),
        ("docs/performance.md", r"this run: float32 (\S+)× / (\S+)× / (\S+)× the best float32 engine; "
                                r"bf16 (\S+)× / (\S+)× / (\S+)× OpenVINO bf16;",
         z["float32"] + z["bf16"]),
        *[("docs/performance.md", r"int8 (\S+)× at all three against the best of OpenVINO int8 and q8_0", [v])
          for v in z["int8"]],
        ("docs/performance.md", r"int4 (\S+)× q4_0 at batch 1 and (\S+)× / (\S+)× OpenVINO int4 at batch 8 and in "
                                r"prefill .*?; fp16 (\S+)× / (\S+)× / (\S+)× llama.cpp f16",
         [speed_ratio(int_zen4, head4, "b1", q4), speed_ratio(int_zen4, head4, "b8", "openvino int4"),
          speed_ratio(int_zen4, head4, "p512", "openvino int4")] + z["fp16"]),
        ("docs/performance.md", r"leads every engine measured: (\S+)× ONNX Runtime int8 at batch 8 and (\S+)× at a "
                                r"512-token prompt, level with it at 128 tokens",
         [speed_ratio(peers, int8, "b8", onnx), speed_ratio(peers, int8, "p512", onnx)]),
        ("docs/performance.md", r"machines: (\S+)× in this run, (\S+)× in the precision table's run below and (\S+)× "
                                r"on the Zen 4",
         [speed_ratio(run, head4, "b1", q4) for run in (peers, precisions, int_zen4)]),
        *history(),
    ]


def history() -> list:
    """The performance page's sentences on the runs before and on the other benchmarks."""
    precisions, floats, later = load("peers-precisions.json"), load("peers-float.json"), \
        load("archive/peers-fp16-2026-12-04-0501.json")
    routes = load("float_routes.json")["figures"]
    bench = load("bench.json")["rows"]
    w4a8 = load("w4a8_products.json")["results"]

    def ratios_of(run, ours, theirs):
        return [speed_ratio(run, ours, m, theirs) for m in ("b1", "b8", "p512")]

    def bench_ratio(start):
        return next(r["ratio"] for r in bench if r["figure"].startswith(start))

    def route(metric):
        native, view = routes[f"fp16|native|{metric}"], routes[f"fp16|view|{metric}"]
        return min(view) / min(native) if metric.endswith("ms") else max(native) / max(view)

    def w4a8_range(rows, ours, theirs):
        found = [r["ms"][theirs] / r["ms"][ours] for r in w4a8 if r["rows"] in rows and theirs in r["ms"]]
        return [min(found), max(found)]

    def served(name, figure="served_e2e", against="offline_e2e"):
        offline = load(name)["offline"]
        return [offline[e][figure] / offline[e][against] for e in ("gpt2mha int4", "gpt2mha int8")]

    page = "docs/performance.md"
    return [
        (page, r"bf16 against OpenVINO's bf16 went from (\S+)× / (\S+)× / (\S+)× \(12-03, .*? to (\S+)× / (\S+)× / (\S+)×\.",
         ratios_of(precisions, "gpt2mha bf16", "openvino bf16") + ratios_of(floats, "gpt2mha bf16", "openvino bf16")),
        (page, r": (\S+)× llama.cpp f32 at batch 1, (\S+)× and (\S+)× OpenVINO\) and trails OpenVINO on 12-04 "
               r"\((\S+)×, (\S+)×, (\S+)×\)",
         [speed_ratio(precisions, "gpt2mha float32", "b1", "llama.cpp f32")]
         + ratios_of(precisions, "gpt2mha float32", "openvino f32")[1:] + ratios_of(floats, "gpt2mha float32", "openvino f32")),
        (page, r"against OpenVINO f32's [\d. /]+ \((\S+)×, (\S+)×, (\S+)×\)", ratios_of(later, "gpt2mha float32", "openvino f32")),
        (page, r"against its decode view before, (\S+)× at batch 1, (\S+)× at batch 8, (\S+)× in prefill",
         [route("decode b1 tok/s"), route("decode b8 tok/s"), route("prefill 512 ms")]),
        (page, r"\): (\d+)–(\d+) GMAC/s at 64 and 512 rows, (\S+)–(\S+)× `conv1d_f32` over float32 weights and (\S+)× torch's int4 kernel there, "
               r"but (\S+)–(\S+)× int8 per_row's W7A8 .*? at one row (\S+)–(\S+)× float32",
         [f(r["w4a8_gmac_s"] for r in w4a8 if r["rows"] in (64, 512)) for f in (min, max)]
         + w4a8_range((64, 512), "w4a8", "f32") + [statistics.median(w4a8_range((64, 512), "w4a8", "torch_int4"))]
         + w4a8_range((64, 512), "w4a8", "w7a8") + w4a8_range((1,), "w4a8", "f32")),
        (page, r"the static KV cache decodes (\S+)× faster than recomputing the sequence; a step at position ~900 costs "
               r"(\S+)× one at ~100; the fused prefill needs (\S+)× the explicit path's peak memory; .*? \((\S+)×\) and "
               r"runs (\S+)× faster than the book's .*? would allow (\S+)× transformers",
         [bench_ratio(s) for s in ("decode tok/s, batch 1, 200 new: static", "decode step time", "prefill T=1024 peak",
                                   "attention sublayer B=8, T=1024, 12x64: gpt2mha / bare",
                                   "attention sublayer B=8, T=1024, 12x64: book", "decode tok/s ceiling, batch 1, gpt2mha float32")]),
        (page, r"end to end\): int4 (\S+)×, int8 (\S+)× in that run", served("serve_peers-2026-12-03-2155.json")),
        (page, r"serve_offline-2026-12-04-0255.json`\): int4 (\S+)×, int8 (\S+)×",
         served("archive/serve_offline-2026-12-04-0255.json")),
        (page, r"serve_offline-2026-12-04-0603.json`\) (\S+)× and (\S+)×", served("archive/serve_offline-2026-12-04-0603.json")),
        (page, r"serve_offline-2026-12-04-1303.json`\) (\S+)× and (\S+)×", served("archive/serve_offline-2026-12-04-1303.json")),
        (page, r"streamed int4 (\S+)×, int8 (\S+)× of offline `generate` end to end \(decode (\S+)×, (\S+)×; against "
               r"offline run in a thread of its own, as the server runs the model, (\S+)× both\), and whole answers .*? "
               r"(\S+)× and (\S+)×",
         served("serve_offline.json") + served("serve_offline.json", "served_decode", "offline_decode")
         + [statistics.mean(served("serve_offline.json", "served_e2e", "thread_e2e"))]
         + served("serve_offline.json", "whole_e2e")),
    ]


def test_the_summaries_in_prose_are_their_json():
    """The README's and the performance page's one-line summaries of the runs (gpt2mha against the
    best engine of its precision, int8 against ONNX Runtime, the int4 head against q4_0 run to run)
    are the ratios computed from the JSON, to the decimals printed."""
    texts = {}
    for page, pattern, values in claims():
        text = texts.setdefault(page, " ".join((ROOT / page).read_text(encoding="utf-8").replace("**", "").split()))
        found = re.search(pattern, text)
        assert found, f"{page}: no sentence matches {pattern!r}"
        assert len(found.groups()) == len(values), pattern
        for printed, value in zip(found.groups(), values):
            assert shown(value, printed), f"{page}: {printed}× where the JSON gives {value:.4f} ({pattern[:40]}...)"
