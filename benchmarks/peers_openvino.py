"""OpenVINO as a contender of ``benchmarks/peers.py`` (issue 43): GenAI's ``LLMPipeline`` on IRs
that optimum-intel exports.

* The IRs: ``optimum-cli export openvino --task text-generation-with-past --weight-format
  {fp32,fp16,int8,int4}`` of the same transformers checkpoint the other engines convert (int8 and int4:
  NNCF's weight compression, its defaults: int8 per output channel; int4 asymmetric in groups of
  128 with the embedding and the head left in int8; groups of 64 where 128 does not divide n_embd:
  GPT-2 1558M's 1600). The export needs optimum-intel and NNCF, whose
  transformers pins may not be the project's: ``--optimum-cli PATH`` (peers.py) names an
  ``optimum-cli`` from another environment; the run needs only ``openvino`` and
  ``openvino-genai`` (and ``openvino-tokenizers``, which the export uses to write the tokenizer IRs
  ``LLMPipeline`` loads).
* Generation: ``LLMPipeline(path, "CPU")`` with its scheduler's prefix caching turned off (on by
  default: a prompt timed twice would find its keys cached and skip its prefill), greedy, exactly
  ``new`` tokens (``ignore_eos``), the batch passed as one ``[B, T]`` ``TokenizedInputs``.
* The precision: OpenVINO's CPU plugin computes in bf16 by default on CPUs with AVX-512 BF16 or AMX
  (``INFERENCE_PRECISION_HINT``), f32 elsewhere; "openvino f32" forces ``f32`` on the fp32 IR, "openvino
  bf16" leaves the default (named after what the plugin reports), int8 and int4 the default too;
  "openvino fp16" is the fp16 IR (weights stored in f16, half the bytes a step reads) under the
  default hint: OpenVINO's 16-bit model where the CPU has no bf16 instructions. Each
  contender's ``compute_type`` records the hint the compiled model reports.
* The KV cache: the CPU plugin keeps keys and values in f16 for the fp32 IR whatever the hint, and in
  u8 for the int8 and int4 IRs (``KV_CACHE_PRECISION``), so "openvino f32" forces ``f32`` there (a
  float32 model end to end, as gpt2mha float32 and CTranslate2 float32 are; f16 halves the cache a
  batch-8 step reads; "openvino f32 kv-f16" is f32 with the default cache, beside it); the others keep
  the default (f16 for "openvino bf16", 16 bits as a bf16 model's own cache; u8 for int8 and int4).
  ``kv_cache`` records what the compiled model reports.
* Quality: teacher-forced logits from the same IR through OpenVINO's runtime (the exported stateful
  model, one call over the window, its state reset first) under the same hint.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np

#: contender name -> (IR weight format, precision hint, KV cache precision; None: the plugin's default)
VARIANTS = {"openvino f32": ("fp32", "f32", "f32"), "openvino f32 kv-f16": ("fp32", "f32", None),
            "openvino bf16": ("fp32", None, None), "openvino fp16": ("fp16", None, None),
            "openvino int8": ("int8", None, None), "openvino int4": ("int4", None, None)}
MODULES = ("openvino", "openvino_genai")


def export(hf_dir: str, out: str, weight_format: str, optimum_cli: str | None = None, log=print) -> None:
    """``optimum-cli export openvino`` of ``hf_dir`` into ``out`` (skipped when ``out`` holds an IR).

    Raises:
        FileNotFoundError: no ``optimum-cli`` (pip install 'optimum-intel[openvino]' nncf, or pass its path).
        RuntimeError: the export failed (its last output lines).
    """
    if os.path.isfile(os.path.join(out, "openvino_model.xml")):
        return
    cli = optimum_cli or shutil.which("optimum-cli")
    if not cli or not os.path.exists(cli):
        raise FileNotFoundError("no optimum-cli to export the OpenVINO IRs: pip install 'optimum-intel[openvino]' nncf "
                                "(in this environment or another one, then --optimum-cli PATH)")
    cmd = [cli, "export", "openvino", "--model", hf_dir, "--task", "text-generation-with-past",
           "--weight-format", weight_format, out]
    with open(os.path.join(hf_dir, "config.json")) as f:
        n_embd = json.load(f)["n_embd"]
    if weight_format == "int4" and n_embd % 128:     # NNCF's groups of 128 must divide every input width:
        cmd[-1:-1] = ["--group-size", "64"]          # 1558M's 1600 takes groups of 64 (llama.cpp's q4_0: 32)
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0 or not os.path.isfile(os.path.join(out, "openvino_model.xml")):
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    log(f"  exported OpenVINO IR ({weight_format}) to {out}")


class OpenVINO:
    """One IR under GenAI's ``LLMPipeline`` (see the module's docstring); peers_engines.py's Contender
    interface: ``greedy``, ``first_token``, ``logits``, ``close``."""

    engine = "openvino"

    def __init__(self, name: str, path: str, hint: str | None, threads: int, checkpoint_bytes: int,
                 read_bytes: int | None, kv_cache: str | None = None):
        import openvino as ov
        import openvino_genai as og

        self.name, self.checkpoint_bytes, self.read_bytes = name, checkpoint_bytes, read_bytes
        self.version = og.__version__
        self.config = {"INFERENCE_NUM_THREADS": threads, **({"INFERENCE_PRECISION_HINT": hint} if hint else {}),
                       **({"KV_CACHE_PRECISION": kv_cache} if kv_cache else {})}
        scheduler = og.SchedulerConfig()
        scheduler.enable_prefix_caching = False
        self.pipe = og.LLMPipeline(path, "CPU", scheduler_config=scheduler, **self.config)
        self.core = ov.Core()
        self.compiled = self.core.compile_model(os.path.join(path, "openvino_model.xml"), "CPU", self.config)
        def prop(key):
            v = self.compiled.get_property(key)
            return v.get_type_name() if hasattr(v, "get_type_name") else str(v)

        self.compute_type = f"hint {prop('INFERENCE_PRECISION_HINT')}" + ("" if hint else ", the plugin's default")
        self.kv_cache = prop("KV_CACHE_PRECISION")
        self.og, self.ov = og, ov

    def _config(self, new: int):
        c = self.og.GenerationConfig()
        c.max_new_tokens, c.min_new_tokens, c.do_sample, c.ignore_eos = new, new, False, True
        return c

    def greedy(self, prompt: np.ndarray, new: int) -> np.ndarray:
        ids = self.ov.Tensor(np.ascontiguousarray(prompt, dtype=np.int64))
        mask = self.ov.Tensor(np.ones(prompt.shape, dtype=np.int64))
        res = self.pipe.generate(self.og.TokenizedInputs(ids, mask), self._config(new))
        return np.array([list(t)[-new:] for t in res.tokens], dtype=np.int64)

    def first_token(self, prompt: np.ndarray) -> int:
        return int(self.greedy(prompt, 1)[0, 0])

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        req = self.compiled.create_infer_request()
        req.reset_state()
        T = len(tokens)
        feed = {"input_ids": tokens[None].astype(np.int64), "attention_mask": np.ones((1, T), np.int64),
                "position_ids": np.arange(T, dtype=np.int64)[None], "beam_idx": np.zeros(1, np.int32)}
        names = {p.get_any_name() for p in self.compiled.inputs}
        req.infer({k: v for k, v in feed.items() if k in names})
        return np.array(req.get_tensor("logits").data[0], dtype=np.float32)

    def close(self) -> None:
        del self.pipe, self.compiled


def ir_read_bytes(path: str, config) -> int:
    """Bytes of an IR's weights a batch-1 step reads: its ``openvino_model.bin`` less the position
    table (n_ctx rows, float32 in an fp32 IR, f16 in an fp16 one, 8-bit where NNCF compressed the
    embeddings)."""
    size = os.path.getsize(os.path.join(path, "openvino_model.bin"))
    itemsize = {"fp32": 4, "fp16": 2}.get(os.path.basename(path).rsplit("-", 1)[-1], 1)
    return size - config.n_ctx * config.n_embd * itemsize
