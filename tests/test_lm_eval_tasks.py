"""The local lm-evaluation-harness tasks in tests/data/lm_eval, run offline by lm_eval itself
(its ``hf`` model: transformers on a directory `gpt2mha convert shakespeare-byte` wrote).

Reference: gpt2mha's own model on the same weights, computed here from first principles: the
log-probability of each choice's bytes after the context (summed log-softmax), whether each of
them is the argmax, and the greedy continuation cut at the first stop string. lm_eval's recorded
per-sample results (``--log_samples``) and its aggregated metrics must agree with them.
"""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import greedy_margin
from gpt2mha import GPT2
from gpt2mha.io.formats import convert

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join("tests", "data", "lm_eval")        # data_files in the YAMLs are relative to the repo root


def lm_eval_command(model_dir: str, output: str) -> list[str]:
    """The command line the README's lm-eval section gives (run from the repository root)."""
    return [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={model_dir}",
            "--include_path", TASKS, "--tasks", "gpt2mha_shakespeare_mc,gpt2mha_shakespeare_gen",
            "--device", "cpu", "--batch_size", "1", "--output_path", output, "--log_samples"]


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def choice_logprob(model, context: str, continuation: str) -> tuple[float, bool, float]:
    """(sum of log p(continuation bytes | context), every byte the argmax, smallest top-2 gap)."""
    ctx, cont = list(context.encode("utf-8")), list(continuation.encode("utf-8"))
    with torch.no_grad():
        logp = model(torch.tensor([ctx + cont])).logits.double().log_softmax(-1)[0, len(ctx) - 1:-1]
    target = torch.tensor(cont)
    top2 = logp.topk(2, dim=-1).values
    return (float(logp[torch.arange(len(cont)), target].sum()), bool((logp.argmax(-1) == target).all()),
            float((top2[:, 0] - top2[:, 1]).min()))


def greedy_until(model, prompt: str, max_new: int, until: list[str]) -> str:
    """gpt2mha's greedy continuation (``max_new`` bytes) cut before the first stop string; the
    bytes up to that point are clear argmaxes (no near-tie that rounding could flip)."""
    ids = list(prompt.encode("utf-8"))
    out = model.generate(torch.tensor([ids]), max_new, temperature=0)[0].tolist()
    text = bytes(out[len(ids):]).decode("utf-8", errors="replace")
    cut = min([text.index(s) + len(s) for s in until if s in text], default=len(text))
    assert greedy_margin(model, out[:len(ids) + len(text[:cut].encode("utf-8"))], len(ids)) > 1e-3
    return text[:min([text.index(s) for s in until if s in text], default=len(text))]


def lm_eval_env(tmp_path) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def check_mc(model, output: str, results: dict, tol: float) -> None:
    """lm_eval's multiple-choice samples and acc agree with gpt2mha's own scores: each choice's
    loglikelihood (to ``tol``), is_greedy (where no near-tie), acc."""
    docs = read_jsonl(os.path.join(REPO, TASKS, "shakespeare_mc.jsonl"))
    (mc_path,) = glob.glob(os.path.join(output, "*", "samples_gpt2mha_shakespeare_mc_*.jsonl"))
    samples = sorted(read_jsonl(mc_path), key=lambda s: s["doc_id"])
    assert len(samples) == len(docs) == 8
    correct = []
    for doc, sample in zip(docs, samples):
        ours = [choice_logprob(model, doc["context"], " " + c) for c in doc["choices"]]   # target_delimiter " "
        theirs = [(float(ll), greedy == "True") for ll, greedy in sample["filtered_resps"]]
        for (ll, greedy, margin), (their_ll, their_greedy) in zip(ours, theirs):
            assert their_ll == pytest.approx(ll, abs=tol)
            if margin > 1e-3:
                assert their_greedy == greedy
        lls = sorted((o[0] for o in ours), reverse=True)
        assert lls[0] - lls[1] > 1e-2                                 # a clear winner on any CPU
        correct.append(float(max(range(4), key=lambda i: ours[i][0]) == doc["label"]))
        assert sample["acc"] == correct[-1]
    assert results["gpt2mha_shakespeare_mc"]["acc,none"] == pytest.approx(sum(correct) / len(correct))


def check_gen(model, output: str, results: dict, task: str, until: list[str]) -> None:
    """lm_eval's generate_until samples are gpt2mha's greedy text cut at the first of ``until``
    (the task's strings; lm_eval's EOS string as well, which these short greedy texts never
    reach), and exact_match follows."""
    docs = read_jsonl(os.path.join(REPO, TASKS, "shakespeare_gen.jsonl"))
    (gen_path,) = glob.glob(os.path.join(output, "*", f"samples_{task}_*.jsonl"))
    samples = sorted(read_jsonl(gen_path), key=lambda s: s["doc_id"])
    assert len(samples) == len(docs) == 8
    hits = []
    for doc, sample in zip(docs, samples):
        assert sample["arguments"]["gen_args_0"]["arg_1"]["until"] == until
        want = greedy_until(model, doc["prompt"], 16, until)
        assert sample["filtered_resps"] == [want], doc
        hits.append(float(want == doc["answer"]))
        assert sample["exact_match"] == hits[-1]
    assert 0 < sum(hits) < len(hits)                                  # the task tells models apart
    assert results[task]["exact_match,none"] == pytest.approx(sum(hits) / len(hits))


def read_results(output: str) -> dict:
    (results_path,) = glob.glob(os.path.join(output, "*", "results_*.json"))
    with open(results_path) as f:
        return json.load(f)["results"]


@pytest.mark.slow
def test_local_tasks_run_offline_in_lm_eval_and_agree_with_gpt2mha(tmp_path):
    model_dir, output = str(tmp_path / "shakespeare-byte"), str(tmp_path / "out")
    convert("shakespeare-byte", model_dir)
    run = subprocess.run(lm_eval_command(model_dir, output), cwd=REPO, env=lm_eval_env(tmp_path), capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results, model = read_results(output), GPT2.from_pretrained(model_dir)
    check_mc(model, output, results, tol=1e-3)
    check_gen(model, output, results, "gpt2mha_shakespeare_gen", [" ", "\n", ".", ",", ";", ":", "!", "?"])


def server_lm_eval_command(base_url: str, model_dir: str, output: str) -> list[str]:
    """The command line the README's "Serving" section gives for lm_eval against ``gpt2mha serve
    --model DIR`` (served as DIR; its tokenizer files are lm_eval's tokenizer; prompts sent as
    text, the task with three stop strings so that lm_eval's EOS makes four)."""
    args = (f"model={model_dir},base_url={base_url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={model_dir},tokenized_requests=False,max_length=256")
    return [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
            "--include_path", TASKS, "--tasks", "gpt2mha_shakespeare_mc,gpt2mha_shakespeare_gen_api",
            "--output_path", output, "--log_samples"]


@pytest.mark.slow
def test_local_tasks_run_in_lm_eval_against_a_live_server_and_agree_with_gpt2mha(tmp_path):
    """lm_eval's ``local-completions`` model against ``gpt2mha serve`` (a subprocess on a free
    port of 127.0.0.1, stopped with SIGTERM): loglikelihoods come from ``echo`` + ``logprobs``,
    generations from greedy completions with stop strings. Exit 0, and every per-item
    loglikelihood equals gpt2mha's offline score (to 1e-4), every generation its greedy text."""
    from conftest import load_benchmark

    model_dir, output = str(tmp_path / "shakespeare-byte"), str(tmp_path / "out")
    convert("shakespeare-byte", model_dir)
    server = load_benchmark("serve_load").Server(model_dir, max_batch=4, log_path=str(tmp_path / "serve.log"),
                                                 threads=1)
    try:
        run = subprocess.run(server_lm_eval_command(server.url, model_dir, output), cwd=REPO,
                             env=lm_eval_env(tmp_path), capture_output=True, text=True, timeout=600)
    finally:
        rc = server.stop()
    assert run.returncode == 0, run.stderr[-3000:] + (tmp_path / "serve.log").read_text()[-3000:]
    assert rc == 0
    results, model = read_results(output), GPT2.from_pretrained(model_dir)
    check_mc(model, output, results, tol=1e-4)
    check_gen(model, output, results, "gpt2mha_shakespeare_gen_api", [" ", "\n", "."])
