"""The servers of ``benchmarks/serve_peers.py`` and the files they serve: llama.cpp's
``llama-server`` as a subprocess (:class:`LlamaServer`; ``gpt2mha serve`` runs as
``serve_load.Server``), each contender as an :class:`Engine`, and :func:`prepare`, which writes
the random GPT-2 124M once, gpt2mha's int4 and int8 directories (``gpt2mha convert``) and the GGUF
files (``peers_convert.write_gguf``, then ``llama-quantize``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from serve_load import free_port

EOT = 50256                              # GPT-2's <|endoftext|>
INT4 = ("--quantize", "int4", "--activations", "per_block", "--quantize-head", "int4", "--group-size", "64")
INT8 = ("--quantize", "int8", "--activations", "per_row")


# ============================================================================ the servers
class LlamaServer:
    """``llama-server`` as a subprocess on a free port of 127.0.0.1; ready once /health is 200."""

    def __init__(self, binary: str, gguf_path: str, threads: int, slots: int, ctx_per_slot: int, log_path: str,
                 extra: tuple[str, ...] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [binary, "-m", gguf_path, "--host", "127.0.0.1", "--port", str(self.port),
                    "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * ctx_per_slot),
                    "--override-kv", f"tokenizer.ggml.eos_token_id=int:{EOT}", *extra]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"llama-server did not start (exit {self.proc.poll()}); see {log_path}")
            time.sleep(0.2)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        rc = self.proc.wait()
        self.log.close()
        return rc


class Engine:
    """One contender: its server and how to talk to it."""

    def __init__(self, name: str, server, extra_body: dict | None = None, model_dir: str | None = None):
        self.name, self.server, self.extra, self.model_dir = name, server, extra_body or {}, model_dir
        self.url = server.url


def llama_version(binary: str) -> str:
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
        return (done.stdout + done.stderr).strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return "?"


# ============================================================================ preparing the models
def prepare(work: str, quantize_bin: str | None, threads: int, log) -> dict:
    """The random 124M (Hugging Face dir), gpt2mha's int4/int8 dirs and the GGUF files; reused when present."""
    from bench import random_checkpoint
    from gpt2mha import GPT2Config
    from peers import gpt2_vocab, write_gguf, write_tokenizer_files

    os.makedirs(work, exist_ok=True)
    paths = dict(hf=os.path.join(work, "random-124M"), int4=os.path.join(work, "gpt2mha-int4"),
                 int8=os.path.join(work, "gpt2mha-int8"))
    timings = {}
    tokens, merges = gpt2_vocab()
    if not os.path.isdir(paths["hf"]):
        random_checkpoint(paths["hf"], GPT2Config.from_preset("124M"), seed=0)
    write_tokenizer_files(paths["hf"], tokens, merges)
    for key, flags in (("int4", INT4), ("int8", INT8)):
        if not os.path.isdir(paths[key]):
            t0 = time.perf_counter()
            log(f"gpt2mha convert ... {' '.join(flags)} (GPTQ)")
            subprocess.run([sys.executable, "-m", "gpt2mha", "convert", paths["hf"], paths[key], *flags, "--quiet"],
                           check=True)
            timings[f"convert {key}"] = time.perf_counter() - t0
    if quantize_bin:
        import transformers

        f32 = os.path.join(work, "model-f32.gguf")
        if not os.path.isfile(f32):
            t0 = time.perf_counter()
            hf = transformers.GPT2LMHeadModel.from_pretrained(paths["hf"]).eval()
            write_gguf(hf, f32, tokens, merges)
            timings["gguf f32"] = time.perf_counter() - t0
        for kind in ("q8_0", "q4_0"):
            paths[kind] = os.path.join(work, f"model-{kind}.gguf")
            if not os.path.isfile(paths[kind]):
                t0 = time.perf_counter()
                done = subprocess.run([quantize_bin, "--override-kv", f"tokenizer.ggml.eos_token_id=int:{EOT}",
                                       f32, paths[kind], kind, str(threads)], capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(f"llama-quantize {kind} failed:\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}")
                timings[f"llama-quantize {kind}"] = time.perf_counter() - t0
    return dict(paths=paths, timings=timings)


def dir_mb(path: str) -> float:
    if os.path.isfile(path):
        return os.path.getsize(path) / 1e6
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) / 1e6

