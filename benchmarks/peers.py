"""gpt2mha against the engines people pick for CPU inference (llama.cpp, CTranslate2, ONNX Runtime, OpenVINO):
``python benchmarks/peers.py [--quick] [--threads 2] [--engines NAMES] [--workdir DIR] [--optimum-cli PATH] [--json FILE]``.

One random GPT-2 124M checkpoint (transformers' ``save_pretrained``, fixed seed, through
``bench.random_checkpoint``) is converted for every engine that is installed, and the
built-in byte-level model ``shakespeare-byte`` likewise; an engine whose package is missing is
skipped and named. Install them with ``pip install 'gpt2mha[peers]'`` (llama-cpp-python
compiles llama.cpp from source: about 15 minutes on 2 cores).

The contenders:

* gpt2mha float32, int8 and int4 (``GPT2.quantize(scheme, method="rtn")``: round to nearest, as
  every engine below rounds; no calibration text), and int8 with ``generate(compile=True)``
  ("int8 compiled": the decode step compiled by inductor, its products on gpt2mha's int8 GEMV
  kernel with float32 activations, or inductor's bf16-activation template where the kernel does
  not build; compiled before the timed rounds, on the shapes they use; its prefill is int8's,
  and its quality columns score the same products eagerly, ``compiled.decode_view``);
  int8 with ``activations="per_row"`` (W7A8: each activation row rounded to 8 bits with its
  own scale and zero point over 7-bit weights), eager and compiled ("int8 per_row compiled":
  the same W7A8 products inside the compiled step); int8 with ``activations="auto"`` (the
  exact products for decode, W7A8 for prompts of 64+ tokens; compiled, its decode step is
  int8 compiled's); int4 compiled (the block products on gpt2mha's int4 GEMV kernel, float32
  activations; the int8 head on the int8 one); int4 with ``activations="per_block"`` (every
  product W4A8: activations rounded to 8 bits per group of 32, as llama.cpp's q8_0), eager and compiled;
  the same with ``head="int4"`` ("int4 per_block head4": the LM head int4 in groups of 32 too, 24 MB
  a step against the int8 head's 38.6, W4A8 like the blocks), quantized with GPTQ on the packaged
  text (round to nearest put an int4 head below q4_0's agreement), saved once and reused; and
  that in groups of 64 ("int4 per_block head4 g64": 69.5 MB a step against q4_0's 80).
  "Eager" per_row and per_block run on gpt2mha's forward in one C++ call
  (``gpt2mha.inference.native``: their prompts and steps), which
  ``generate`` uses for them without ``compile``;
* transformers float32 (``GPT2LMHeadModel``, sdpa): the reference every ratio divides by;
* llama.cpp (through llama-cpp-python): GGUF f32 written with the ``gguf`` package (llama.cpp's
  own Python library: its ``GGUFWriter`` and its GPT-2 tensor-name map, the steps of its
  ``convert_hf_to_gguf.py`` for GPT-2, which neither package installs; ``--gguf-converter PATH``
  runs that script instead when you have it), then q8_0 and q4_0 by llama.cpp's own quantizer
  (``llama_model_quantize``, its default recipe: q4_0 keeps the tied embedding/head in q6_K);
* CTranslate2: its transformers converter, float32 and int8 weights (int8 on a CPU computes as
  ``int8_float32``: the same thing, so it is not run twice);
* gpt2mha bf16 (``model.to(torch.bfloat16)``: its native forward's bf16 route, vdpbf16ps where the
  CPU has AVX-512 BF16) and fp16 (``model.to(torch.float16)``: float32 sums of the fp16 weights,
  converted by F16C, each product's output rounded to fp16), against llama.cpp f16 (the f32 GGUF
  through ``llama_model_quantize`` to F16);
* OpenVINO (``benchmarks/peers_openvino.py``): GenAI's ``LLMPipeline`` on IRs exported by
  optimum-intel (fp32, and int8 and int4 by NNCF's weight compression), prefix caching off, the
  batch as one ``[B, T]`` input; "openvino f32" with ``INFERENCE_PRECISION_HINT`` forced to f32,
  "openvino bf16" (the fp32 IR), int8 and int4 with the CPU plugin's default hint (bf16 on CPUs with
  AVX-512 BF16), each contender's hint printed beside its name;
* ONNX Runtime: a float32 ONNX graph of GPT-2 with its KV cache as inputs and outputs (one past
  key and value per layer, the layout of Optimum's decoder-with-past export; :class:`OnnxGPT2`,
  checked against transformers by ``tests/test_peers_bench.py``) and that graph after
  ``onnxruntime.quantization.quantize_dynamic`` (int8 weights, per output channel).

What is printed, every speed as a ratio to transformers float32 timed in the same rounds
(contenders take turns, a, b, c, a, b, c, ...; the median of the rounds, after a short warm-up
call of each shape; a pause of ``--settle`` seconds before each timed call lets the previous
engine's OpenMP threads stop spinning on the 2 cores; a contender whose first call of a figure
takes over ``--slow`` seconds is timed by that call and sits out the later speed figures):

* decode tokens/s, batch 1 and 8: a 4-token random prompt, 96 new greedy tokens, the prefill
  included (batch × new tokens / seconds of the whole call);
* prefill (time to first token) at 128 and 512 tokens, batch 1;
* checkpoint bytes on disk (all files the engine loads);
* greedy tokens equal to transformers float32's over the decode run (the first n steps where
  every row agrees, as ``gpt2mha bench`` counts);
* quality on held-out text (the last 10% of ``data/tinyshakespeare.txt``, as the bench's
  ``real_text_tokens(..., tail=True)``): top-1 agreement with transformers float32, teacher
  forced, windows of n_ctx (the bench's ``top1_agreement``), on the random 124M (GPT-2 BPE of
  the text) and on ``shakespeare-byte`` (its bytes), with bits per byte there (mean next-byte
  cross-entropy in bits over the same windows; a window's first byte is not scored);
* bytes of weights a batch-1 decode step reads (each block matrix and the LM head as stored,
  with biases; the embedding rows a step gathers are left out) and the GB/s that the batch-1
  tokens/s implies, against the machine's memory bandwidth (``bench.memory_bandwidth``).

Every engine gets ``--threads`` threads (default 2). The machine (CPU model, cores, versions)
and the load average at start and end are printed with the table.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import types
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# gpt2mha: its public API and the bench helpers this benchmark uses, all imported here.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))     # benchmarks/bench.py, also when imported by path
from bench import hf_greedy, memory_bandwidth, random_checkpoint, real_text_tokens, step_bytes, top1_agreement  # noqa: E402
from gpt2mha import GPT2, DEFAULT_MODEL, GPT2Config  # noqa: E402
from gpt2mha.io.tokenizer import bpe_data_files
import peers_openvino  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "..", "data", "tinyshakespeare.txt")
ENGINES = ("gpt2mha", "llama.cpp", "ctranslate2", "onnxruntime", "openvino")
REFERENCE = "transformers float32"
#: Every contender besides the reference and gpt2mha float32 (``--skip`` takes these names; the
#: reference always runs, gpt2mha float32 whenever the gpt2mha engine does).
VARIANTS = ("gpt2mha int8", "gpt2mha int8 compiled", "gpt2mha int8 per_row", "gpt2mha int8 per_row compiled",
            "gpt2mha int8 auto", "gpt2mha int8 auto compiled", "gpt2mha int4", "gpt2mha int4 compiled",
            "gpt2mha int4 per_block", "gpt2mha int4 per_block compiled", "gpt2mha int4 per_block head4",
            "gpt2mha int4 per_block head4 compiled", "gpt2mha int4 per_block head4 g64",
            "gpt2mha int4 per_block head4 g64 compiled", "llama.cpp f32",
            "llama.cpp q8_0", "llama.cpp q4_0", "ctranslate2 float32", "ctranslate2 int8", "onnxruntime float32",
            "onnxruntime int8", "gpt2mha bf16", "gpt2mha fp16", "llama.cpp f16", "openvino f32", "openvino bf16", "openvino int8", "openvino int4")


@dataclass
class Sizes:
    """What the figures run on (``QUICK`` scales it down)."""

    prompt: int = 4
    new_tokens: int = 96
    batches: tuple[int, ...] = (1, 8)
    prefill: tuple[int, ...] = (128, 512)
    repeats: int = 3
    agree_tokens: int = 512           # random 124M: GPT-2 BPE tokens of held-out text
    byte_tokens: int = 32 * 256       # shakespeare-byte: held-out bytes (as the bench's built-in agreement)
    slow: float = 10.0                # s: a first call longer than this and SLOW_FACTOR x the reference's is
                                      # timed alone, then the contender sits out the later speed figures
    skip: tuple[str, ...] = ()        # contenders left out


FULL = Sizes()
QUICK = Sizes(new_tokens=16, prefill=(128,), repeats=1, agree_tokens=256, byte_tokens=8 * 256, slow=4.0,
              skip=("llama.cpp f32", "llama.cpp f16", "ctranslate2 float32", "onnxruntime float32"))


# ============================================================================ conversions
def gpt2_vocab() -> tuple[list[str], list[str]]:
    """GPT-2's 50257 token strings (by id) and its 50000 merges, from OpenAI's ``encoder.json``
    and ``vocab.bpe`` (the files gpt2mha's tokenizer reads, identical to transformers'
    ``vocab.json`` / ``merges.txt``)."""
    encoder_json, vocab_bpe = bpe_data_files()
    with open(encoder_json, encoding="utf-8") as f:
        encoder = json.load(f)
    tokens = [t for t, _ in sorted(encoder.items(), key=lambda kv: kv[1])]
    with open(vocab_bpe, encoding="utf-8") as f:
        merges = [line.rstrip("\n") for line in f if line.strip() and not line.startswith("#version")]
    return tokens, merges


def byte_vocab() -> list[str]:
    """The 256 single-byte tokens of byte-level BPE, by byte value (GPT-2's printable mapping)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    return [b2u[b] for b in range(256)]


def write_tokenizer_files(directory: str, tokens: list[str], merges: list[str]) -> None:
    """``vocab.json`` + ``merges.txt`` (+ ``tokenizer_config.json``) beside a transformers
    checkpoint, so that ``AutoTokenizer`` (CTranslate2's and llama.cpp's converters call it) loads
    a byte-level BPE tokenizer of exactly ``len(tokens)`` ids. Without ``<|endoftext|>`` in the
    vocabulary (the byte model), the special tokens are byte 0, which the text never holds."""
    with open(os.path.join(directory, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump({t: i for i, t in enumerate(tokens)}, f, ensure_ascii=False)
    with open(os.path.join(directory, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(m + "\n" for m in merges))
    special = "<|endoftext|>" if "<|endoftext|>" in tokens else tokens[0]
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "GPT2Tokenizer", "model_max_length": 1 << 20, "bos_token": special,
                   "eos_token": special, "unk_token": special, "add_bos_token": False}, f, ensure_ascii=False)


#: transformers GPT-2's Conv1D weights, stored ``[in, out]``; GGUF wants ``[out, in]`` as in nn.Linear.
CONV1D_WEIGHTS = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


def gguf_tensors(state: dict, n_layer: int) -> dict:
    """GPT-2 transformers tensors → GGUF names and float32 arrays, as llama.cpp's
    ``convert_hf_to_gguf.py`` maps them for ``GPT2LMHeadModel``: names through the ``gguf``
    package's tensor-name map for ``MODEL_ARCH.GPT2``, the four Conv1D weights transposed to
    ``[out, in]``, the causal-mask buffers dropped, and no ``output.weight`` (the head is tied:
    llama.cpp reads ``token_embd`` for it).

    Args:
        state: ``GPT2LMHeadModel.state_dict()`` (keys ``transformer.…`` and ``lm_head.weight``).
        n_layer: number of blocks.

    Raises:
        ValueError: a tensor the map does not know (not a GPT-2 checkpoint).
    """
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT2, n_layer)
    out = {}
    for key, value in state.items():
        if key.endswith((".attn.bias", ".attn.masked_bias")) or key == "lm_head.weight":
            continue
        array = value.detach().float().numpy()
        if key.endswith(CONV1D_WEIGHTS):
            array = array.T
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"tensor {key!r} has no GGUF name for GPT-2; expected a GPT2LMHeadModel state dict")
        out[name] = np.ascontiguousarray(array)
    return out


def write_gguf(hf_model, path: str, tokens: list[str], merges: list[str] | None) -> None:
    """An all-float32 GGUF of a transformers GPT-2 (``GGUFWriter`` of the ``gguf`` package).

    The hyperparameters are those ``convert_hf_to_gguf.py`` writes for GPT-2. ``merges``: GPT-2's
    BPE (tokenizer model ``gpt2``, pre-tokenizer ``gpt-2``); None: token ids only (tokenizer model
    ``none`` with ``len(tokens)`` ids), for a vocabulary llama.cpp's BPE cannot describe.
    """
    import gguf

    c = hf_model.config
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_name("gpt2mha-peers")
    w.add_block_count(c.n_layer)
    w.add_context_length(c.n_positions)
    w.add_embedding_length(c.n_embd)
    w.add_feed_forward_length(4 * c.n_embd)
    w.add_head_count(c.n_head)
    w.add_layer_norm_eps(c.layer_norm_epsilon)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if merges is None:
        w.add_tokenizer_model("none")
        w.add_vocab_size(len(tokens))
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(tokens)
        w.add_token_types([gguf.TokenType.CONTROL if t == "<|endoftext|>" else gguf.TokenType.NORMAL for t in tokens])
        w.add_token_merges(merges)
        w.add_add_bos_token(False)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, array in gguf_tensors(hf_model.state_dict(), c.n_layer).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class OnnxGPT2(torch.nn.Module):
    """GPT-2 (transformers' weights) as one ONNX-exportable decoder step with an explicit cache.

    ``forward(input_ids [B, T] int64, keep [N] int64, *past)`` with ``past`` = 2·n_layer tensors
    ``[B, n_head, P, head_dim]`` (key, value of block 0, then block 1, ...; P >= 0 cached
    positions) returns ``(logits [B, N, n_vocab] float32, *present)``, present = past with the T
    new positions appended, and logits only at the positions ``keep`` of the T new ones (the last
    for decoding, all for scoring). Positions are P … P+T-1; each attends to the keys at or before
    it. The computation is transformers' ``GPT2LMHeadModel`` (pre-LayerNorm blocks, ``gelu_new``,
    tied head): the tests compare the two.
    """

    def __init__(self, hf_model):
        super().__init__()
        c = hf_model.config
        self.n_layer, self.n_head, self.eps = c.n_layer, c.n_head, c.layer_norm_epsilon
        t = hf_model.transformer
        p = (lambda x: torch.nn.Parameter(x.detach().clone(), requires_grad=False))   # initializers in the graph
        self.wte, self.wpe = p(t.wte.weight), p(t.wpe.weight)
        self.head = p(t.wte.weight.t().contiguous())                       # [n_embd, n_vocab]: a MatMul weight
        self.blocks = torch.nn.ModuleList()
        for b in t.h:
            block = torch.nn.Module()
            for k, v in b.state_dict().items():
                if k not in ("attn.bias", "attn.masked_bias"):
                    block.register_parameter(k.replace(".", "_"), p(v))
            self.blocks.append(block)
        self.ln_f_weight, self.ln_f_bias = p(t.ln_f.weight), p(t.ln_f.bias)

    def forward(self, input_ids, keep, *past):
        B, T = input_ids.shape
        P = past[0].shape[2]
        C = self.wte.shape[1]
        hd = C // self.n_head
        pos = torch.arange(T) + P                                          # [T] absolute positions
        x = self.wte[input_ids] + self.wpe[pos]                            # [B, T, C]
        allowed = torch.arange(T + P)[None, :] <= pos[:, None]             # [T, P+T]
        bias = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
        present = []
        for i, b in enumerate(self.blocks):
            h = F.layer_norm(x, (C,), b.ln_1_weight, b.ln_1_bias, self.eps)
            qkv = h @ b.attn_c_attn_weight + b.attn_c_attn_bias             # [B, T, 3C]
            q, k, v = qkv.view(B, T, 3, self.n_head, hd).permute(2, 0, 3, 1, 4)
            k = torch.cat([past[2 * i], k], dim=2)                         # [B, h, P+T, hd]
            v = torch.cat([past[2 * i + 1], v], dim=2)
            present += [k, v]
            att = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(hd)) + bias
            y = (att.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)
            x = x + (y @ b.attn_c_proj_weight + b.attn_c_proj_bias)
            h = F.layer_norm(x, (C,), b.ln_2_weight, b.ln_2_bias, self.eps)
            h = F.gelu(h @ b.mlp_c_fc_weight + b.mlp_c_fc_bias, approximate="tanh")
            x = x + (h @ b.mlp_c_proj_weight + b.mlp_c_proj_bias)
        x = F.layer_norm(x.index_select(1, keep), (C,), self.ln_f_weight, self.ln_f_bias, self.eps)
        return (x @ self.head, *present)


def export_onnx(hf_model, path: str) -> None:
    """:class:`OnnxGPT2` of ``hf_model`` to ``path`` (opset 17, TorchScript exporter; batch,
    new positions, cached positions and kept positions dynamic)."""
    module = OnnxGPT2(hf_model).eval()
    c = hf_model.config
    L, h, hd = c.n_layer, c.n_head, c.n_embd // c.n_head
    past = [torch.zeros(2, h, 3, hd) for _ in range(2 * L)]
    names = [f"past.{i}.{kv}" for i in range(L) for kv in ("key", "value")]
    outs = [f"present.{i}.{kv}" for i in range(L) for kv in ("key", "value")]
    dyn = {"input_ids": {0: "B", 1: "T"}, "keep": {0: "N"}, "logits": {0: "B", 1: "N"}}
    dyn.update({n: {0: "B", 2: "P"} for n in names})
    dyn.update({n: {0: "B", 2: "P+T"} for n in outs})
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.zeros(2, 2, dtype=torch.long), torch.tensor([1]), *past), path,
                          input_names=["input_ids", "keep", *names], output_names=["logits", *outs],
                          dynamic_axes=dyn, opset_version=17, dynamo=False)


# ============================================================================ contenders
class Contender:
    """One engine + weights. Subclasses implement ``greedy``, ``first_token`` and ``logits``.

    ``checkpoint_bytes``: the files the engine loads; ``read_bytes``: weights a batch-1 decode
    step reads (None: unknown)."""

    engine = ""
    version = ""

    def __init__(self, name: str, checkpoint_bytes: int, read_bytes: int | None):
        self.name, self.checkpoint_bytes, self.read_bytes = name, checkpoint_bytes, read_bytes

    def greedy(self, prompt: np.ndarray, new: int) -> np.ndarray:
        """``new`` greedy tokens after ``prompt [B, T]`` (int64): ``[B, new]``."""
        raise NotImplementedError

    def first_token(self, prompt: np.ndarray) -> int:
        """Prefill ``prompt [1, T]`` and return the greedy next token (time to first token)."""
        return int(self.greedy(prompt, 1)[0, 0])

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        """Teacher-forced logits ``[T, n_vocab]`` (float32) for ``tokens [T]`` from position 0."""
        raise NotImplementedError

    def close(self) -> None:
        pass


def dir_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def float_read_bytes(config: GPT2Config, itemsize: int = 4) -> int:
    """Weights a batch-1 float step reads: every block parameter, the final LayerNorm and the
    tied head (all of wte); the position row and the token rows gathered are left out."""
    C, L, V = config.n_embd, config.n_layer, config.n_vocab
    block = 3 * C * C + 3 * C + C * C + C + 4 * C * C + 4 * C + 4 * C * C + C + 4 * C   # matrices, biases, 2 LN
    return itemsize * (L * block + 2 * C + V * C)


class Torch(Contender):
    """transformers float32 or gpt2mha (float32, int8, int4) in this process."""

    def __init__(self, name, model, checkpoint_bytes, read_bytes, hf: bool, compiled: bool = False):
        super().__init__(name, checkpoint_bytes, read_bytes)
        self.model, self.hf, self.compiled = model, hf, compiled
        self.engine = "transformers" if hf else "gpt2mha"

    @torch.inference_mode()
    def greedy(self, prompt, new):
        idx = torch.from_numpy(prompt)
        out = hf_greedy(self.model, idx, new) if self.hf else self.model.generate(idx, new, temperature=0,
                                                                                compile=self.compiled)
        return out[:, idx.shape[1]:].numpy()

    @torch.inference_mode()
    def logits(self, tokens):
        model = self.model
        if self.compiled:                               # the products the compiled step runs, eagerly
            from gpt2mha.inference.compiled import decode_view
            model = decode_view(model)
        return model(torch.from_numpy(tokens)[None]).logits[0].float().numpy()


class LlamaCpp(Contender):
    """A GGUF in llama.cpp through llama-cpp-python's bindings of its C API: ``llama_decode`` on
    a batch that holds every sequence, greedy argmax over the logits it returns. One context per
    batch size, as llama.cpp's defaults have it (``kv_unified`` off): one sequence of n_ctx for
    batch 1, prefill and scoring; B sequences of 256 positions each for batch B."""

    engine = "llama.cpp"
    _log_callback = None
    SEQ = 256                                                     # positions per sequence at batch > 1

    def __init__(self, name, path, n_ctx, threads, read_bytes):
        import llama_cpp as L

        super().__init__(name, dir_bytes(path), read_bytes)
        self.L, self.n_ctx, self.threads = L, n_ctx, threads
        self.version = getattr(L, "__version__", "?")
        if LlamaCpp._log_callback is None:                                # silence llama.cpp's load log
            LlamaCpp._log_callback = L.llama_log_callback(lambda level, text, data: None)
            L.llama_log_set(LlamaCpp._log_callback, ctypes.c_void_p(0))
            L.llama_backend_init()
        self.model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.contexts = {}                                            # n_seq → (ctx, batch, n_batch)

    def _context(self, n_seq: int):
        if n_seq not in self.contexts:
            L = self.L
            cp = L.llama_context_default_params()
            cp.n_ctx = self.n_ctx if n_seq == 1 else n_seq * self.SEQ
            cp.n_batch = self.n_ctx if n_seq == 1 else n_seq * self.SEQ
            cp.n_ubatch = min(512, cp.n_batch)
            cp.n_seq_max = n_seq
            cp.n_threads = cp.n_threads_batch = self.threads
            cp.no_perf = True
            ctx = L.llama_init_from_model(self.model, cp)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not make a context of {n_seq} sequence(s)")
            self.contexts[n_seq] = (ctx, L.llama_batch_init(cp.n_batch, 0, n_seq), cp.n_batch)
        return self.contexts[n_seq]

    def _decode(self, n_seq, tokens, positions, seqs, want) -> np.ndarray:
        """One ``llama_decode`` of these entries; returns the logits of the ``want`` ones, in order."""
        L = self.L
        ctx, b, _ = self._context(n_seq)
        n = len(tokens)
        for i in range(n):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = int(tokens[i]), int(positions[i]), 1, int(bool(want[i]))
            b.seq_id[i][0] = int(seqs[i])
        b.n_tokens = n
        rc = L.llama_decode(ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        rows = int(sum(bool(x) for x in want))
        return np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(rows, self.n_vocab)).copy()

    def _clear(self, n_seq):
        self.L.llama_memory_clear(self.L.llama_get_memory(self._context(n_seq)[0]), True)

    def greedy(self, prompt, new):
        B, T = prompt.shape
        if B > 1 and T + new > self.SEQ:
            raise ValueError(f"prompt {T} + new {new} tokens exceed the {self.SEQ} positions of a batched sequence")
        self._clear(B)
        logits = self._decode(B, prompt.reshape(-1), [t for _ in range(B) for t in range(T)],
                              [s for s in range(B) for _ in range(T)], [t == T - 1 for _ in range(B) for t in range(T)])
        out = np.empty((B, new), dtype=np.int64)
        out[:, 0] = logits.argmax(-1)
        for step in range(1, new):
            logits = self._decode(B, out[:, step - 1], [T + step - 1] * B, range(B), [True] * B)
            out[:, step] = logits.argmax(-1)
        return out

    def logits(self, tokens):
        self._clear(1)
        n_batch = self._context(1)[2]
        rows = []
        for start in range(0, len(tokens), n_batch):
            chunk = tokens[start:start + n_batch]
            rows.append(self._decode(1, chunk, range(start, start + len(chunk)), [0] * len(chunk), [True] * len(chunk)))
        return np.concatenate(rows)

    def close(self):
        L = self.L
        for ctx, batch, _ in self.contexts.values():
            L.llama_batch_free(batch)
            L.llama_free(ctx)
        L.llama_model_free(self.model)


class quiet_fds:
    """Send the process's stdout and stderr file descriptors to /dev/null for a while (native
    code that prints past Python, like llama.cpp's quantizer)."""

    def __enter__(self):
        sys.stdout.flush(), sys.stderr.flush()
        self.saved = [os.dup(1), os.dup(2)]
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1), os.dup2(null, 2)
        os.close(null)

    def __exit__(self, *exc):
        for fd, saved in zip((1, 2), self.saved):
            os.dup2(saved, fd)
            os.close(saved)


def llama_quantize(src: str, dst: str, kind: str, threads: int) -> None:
    """llama.cpp's quantizer (``llama_model_quantize``, default parameters) to ``f16``/``q8_0``/``q4_0``."""
    import llama_cpp as L

    params = L.llama_model_quantize_default_params()
    params.ftype = {"f16": L.LLAMA_FTYPE_MOSTLY_F16, "q8_0": L.LLAMA_FTYPE_MOSTLY_Q8_0,
                    "q4_0": L.LLAMA_FTYPE_MOSTLY_Q4_0}[kind]
    params.nthread = threads
    with quiet_fds():
        rc = L.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({kind}) returned {rc}")


def gguf_read_bytes(path: str) -> int:
    """Bytes of the tensors a batch-1 step reads in a GGUF: all but the position embedding and,
    when the file has its own ``output.weight``, the token embedding (then only rows are read)."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    skip = {"position_embd.weight"} | ({"token_embd.weight"} if "output.weight" in tensors else set())
    return sum(n for name, n in tensors.items() if name not in skip)


def gguf_types(path: str) -> str:
    """The tensor types of a GGUF's matrices, e.g. ``q4_0 ×48, q6_K ×1``."""
    import collections

    import gguf

    counts = collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors if len(t.shape) > 1)
    return ", ".join(f"{k} ×{v}" for k, v in counts.most_common())


class CT2(Contender):
    """A CTranslate2 ``Generator``: ``generate_batch`` (greedy, the prompt forwarded at once,
    no end token) and ``forward_batch`` for the logits."""

    engine = "ctranslate2"

    def __init__(self, name, path, compute_type, threads, read_bytes):
        import ctranslate2

        super().__init__(name, dir_bytes(path), read_bytes)
        self.version = ctranslate2.__version__
        self.gen = ctranslate2.Generator(path, device="cpu", compute_type=compute_type, inter_threads=1,
                                         intra_threads=threads)
        with open(os.path.join(path, "vocabulary.json"), encoding="utf-8") as f:
            self.vocab = json.load(f)
        self.compute_type = self.gen.compute_type

    def greedy(self, prompt, new):
        results = self.gen.generate_batch([[self.vocab[i] for i in row] for row in prompt.tolist()], max_length=new,
                                          min_length=new, sampling_topk=1, include_prompt_in_result=False,
                                          end_token=[])
        return np.array([r.sequences_ids[0] for r in results], dtype=np.int64)

    def logits(self, tokens):
        return np.asarray(self.gen.forward_batch([tokens.tolist()]))[0].astype(np.float32)

    def close(self):
        del self.gen


class ORT(Contender):
    """An :class:`OnnxGPT2` graph in an ONNX Runtime ``InferenceSession`` (CPU provider, all
    graph optimizations); the cache goes in and out as numpy arrays each step."""

    engine = "onnxruntime"

    def __init__(self, name, path, config: GPT2Config, threads, read_bytes):
        import onnxruntime as ort

        super().__init__(name, dir_bytes(path), read_bytes)
        self.version = ort.__version__
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        self.sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        self.L, self.h, self.hd = config.n_layer, config.n_head, config.n_embd // config.n_head
        self.names = [f"past.{i}.{kv}" for i in range(self.L) for kv in ("key", "value")]

    def _run(self, ids, keep, past):
        out = self.sess.run(None, {"input_ids": ids, "keep": keep, **dict(zip(self.names, past))})
        return out[0], out[1:]

    def greedy(self, prompt, new):
        B, T = prompt.shape
        past = [np.zeros((B, self.h, 0, self.hd), np.float32)] * (2 * self.L)
        out = np.empty((B, new), dtype=np.int64)
        logits, past = self._run(prompt.astype(np.int64), np.array([T - 1]), past)
        out[:, 0] = logits[:, -1].argmax(-1)
        one = np.array([0])
        for step in range(1, new):
            logits, past = self._run(out[:, step - 1:step], one, past)
            out[:, step] = logits[:, -1].argmax(-1)
        return out

    def logits(self, tokens):
        past = [np.zeros((1, self.h, 0, self.hd), np.float32)] * (2 * self.L)
        return self._run(tokens[None].astype(np.int64), np.arange(len(tokens)), past)[0][0]

    def close(self):
        del self.sess


def onnx_read_bytes(path: str) -> int:
    """Bytes of a graph's initializers that a step reads: all but those only ``Gather`` reads
    (the embedding tables, of which a step reads rows)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(path)
    users: dict[str, set] = {}
    for node in model.graph.node:
        for name in node.input:
            users.setdefault(name, set()).add(node.op_type)
    return sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer
               if users.get(t.name, {"Gather"}) - {"Gather"})


# ============================================================================ building them
def engine_versions() -> dict:
    """Installed engine packages → version (absent ones left out)."""
    import importlib.metadata as md

    out = {}
    for dist in ("torch", "transformers", "llama_cpp_python", "gguf", "ctranslate2", "onnxruntime", "onnx", "openvino",
                 "openvino-genai", "optimum-intel", "nncf"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


def missing_engines() -> dict:
    """Engine → why it is skipped (a package it needs is not importable)."""
    need = {"llama.cpp": ("llama_cpp", "gguf"), "ctranslate2": ("ctranslate2",), "onnxruntime": ("onnxruntime", "onnx"),
            "openvino": peers_openvino.MODULES}
    out = {}
    for engine, modules in need.items():
        for m in modules:
            try:
                __import__(m)
            except Exception as e:                                        # ImportError, or a broken native build
                out[engine] = f"{m} not importable ({type(e).__name__}: {e}); pip install 'gpt2mha[peers]'"
                break
    return out


def timed(log, what):
    class _T:
        def __enter__(self):
            self.t0 = time.perf_counter()

        def __exit__(self, *exc):
            if exc[0] is None:
                log(f"  {what}: {time.perf_counter() - self.t0:.1f} s")
    return _T()


def build_contenders(hf_dir: str, work: str, engines, threads: int, tokens, merges, log, gguf_converter=None,
                     skip=(), optimum_cli=None) -> tuple[list[Contender], dict]:
    """Convert ``hf_dir`` for each engine into ``work`` and load every contender; returns them
    (transformers float32 first) and ``{name: note}`` for those that could not run."""
    import transformers

    os.makedirs(work, exist_ok=True)
    cfg = GPT2.from_pretrained(hf_dir).config
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_dir, attn_implementation="sdpa").eval()
    float_bytes = dir_bytes(os.path.join(hf_dir, "model.safetensors"))
    out = [Torch(REFERENCE, hf, float_bytes, float_read_bytes(cfg), hf=True)]
    notes = {}
    want = (lambda name: name not in skip)

    if "gpt2mha" in engines:
        out.append(Torch("gpt2mha float32", GPT2.from_pretrained(hf_dir), float_bytes, float_read_bytes(cfg), hf=False))
        for half, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):   # the native forward's 16-bit routes
            if want(f"gpt2mha {half}"):
                out.append(Torch(f"gpt2mha {half}", GPT2.from_pretrained(hf_dir).to(dtype), float_bytes // 2,
                                 float_read_bytes(cfg, 2), hf=False))
        for scheme, activations, head, group_size in (
                ("int8", "exact", "int8", None), ("int8", "per_row", "int8", None), ("int8", "auto", "int8", None),
                ("int4", "exact", "int8", None), ("int4", "per_block", "int8", None),
                ("int4", "per_block", "int4", None), ("int4", "per_block", "int4", 64)):
            name = f"gpt2mha {scheme}" + (f" {activations}" if activations != "exact" else "") + \
                (" head4" if head == "int4" else "") + (f" g{group_size}" if group_size else "")
            if not want(name):
                continue
            qdir = os.path.join(work, name.replace(" ", "-"))
            # head4: GPTQ (the default method) on the packaged text, as round to nearest puts an int4 head
            # below q4_0's agreement; minutes on 124M, so a saved one is reused
            method = "gptq" if head == "int4" else "rtn"
            if method == "gptq" and os.path.isdir(qdir):
                model = GPT2.from_pretrained(qdir)
            else:
                with warnings.catch_warnings(), timed(log, name) if method == "gptq" else contextlib.nullcontext():
                    warnings.simplefilter("ignore")                         # random weights: outlier warnings
                    model = GPT2.from_pretrained(hf_dir).quantize(scheme, group_size, method=method,
                                                                  activations=activations, head=head)
            if not os.path.isdir(qdir):
                model.save_pretrained(qdir)
            out.append(Torch(name, model, dir_bytes(qdir), step_bytes(model), hf=False))
            if want(name + " compiled"):
                out.append(Torch(name + " compiled", model, dir_bytes(qdir), step_bytes(model), hf=False,
                                 compiled=True))

    if "llama.cpp" in engines:
        f32 = os.path.join(work, "model-f32.gguf")
        if not os.path.isfile(f32):
            with timed(log, "GGUF f32"):
                if gguf_converter:
                    with open(os.path.join(hf_dir, "config.json")) as f:     # the script reads GPT-2's old key n_ctx,
                        config = json.load(f)                                # which transformers 5 no longer writes
                    config.setdefault("n_ctx", config["n_positions"])
                    with open(os.path.join(hf_dir, "config.json"), "w") as f:
                        json.dump(config, f, indent=2)
                    done = subprocess.run([sys.executable, gguf_converter, hf_dir, "--outtype", "f32", "--outfile", f32],
                                          capture_output=True, text=True)
                    if done.returncode != 0:
                        raise RuntimeError(f"--gguf-converter {gguf_converter} failed:\n{done.stderr[-2000:]}")
                else:
                    write_gguf(hf, f32, tokens, merges)
        for kind in ("f32", "f16", "q8_0", "q4_0"):
            path = os.path.join(work, f"model-{kind}.gguf")
            if not os.path.isfile(path):
                with timed(log, f"GGUF {kind} (llama_model_quantize)"):
                    llama_quantize(f32, path, kind, threads)
            if want(f"llama.cpp {kind}"):
                try:
                    c = LlamaCpp(f"llama.cpp {kind}", path, cfg.n_ctx, threads, gguf_read_bytes(path))
                    c.types = gguf_types(path)
                    out.append(c)
                except Exception as e:
                    notes[f"llama.cpp {kind}"] = f"cannot run: {type(e).__name__}: {e}"

    if "ctranslate2" in engines:
        import ctranslate2

        for quant in ("float32", "int8"):
            path = os.path.join(work, f"ct2-{quant}")
            if not os.path.isdir(path):
                with timed(log, f"CTranslate2 {quant} conversion"), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    ctranslate2.converters.TransformersConverter(hf_dir).convert(path, quantization=quant, force=True)
            if want(f"ctranslate2 {quant}"):
                wpe = cfg.n_ctx * cfg.n_embd * 4
                out.append(CT2(f"ctranslate2 {quant}", path, quant, threads, dir_bytes(path) - wpe))

    if "onnxruntime" in engines:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        fp32 = os.path.join(work, "model-fp32.onnx")
        int8 = os.path.join(work, "model-int8.onnx")
        if not os.path.isfile(fp32):
            with timed(log, "ONNX export (float32)"):
                export_onnx(hf, fp32)
        if not os.path.isfile(int8):
            with timed(log, "ONNX Runtime quantize_dynamic (int8)"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                quantize_dynamic(fp32, int8, weight_type=QuantType.QInt8, per_channel=True)
        for name, path in (("onnxruntime float32", fp32), ("onnxruntime int8", int8)):
            if want(name):
                out.append(ORT(name, path, cfg, threads, onnx_read_bytes(path)))

    if "openvino" in engines:
        for name, (fmt, hint) in peers_openvino.VARIANTS.items():
            if not want(name):
                continue
            path = os.path.join(work, f"ov-{fmt}")
            try:
                with timed(log, f"OpenVINO export ({fmt})") if not os.path.isdir(path) else contextlib.nullcontext():
                    peers_openvino.export(hf_dir, path, fmt, optimum_cli, log)
                out.append(peers_openvino.OpenVINO(name, path, hint, threads, dir_bytes(path),
                                                   peers_openvino.ir_read_bytes(path, cfg)))
            except Exception as e:
                lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]    # a table cell: one line
                notes[name] = f"cannot run: {type(e).__name__}: {' / '.join(lines[:3])[:300]}"
    return out, notes


# ============================================================================ measuring
#: A contender is "slow" for a figure when its first call takes over this many times the
#: reference's (and over ``Sizes.slow`` seconds): see :func:`race`.
SLOW_FACTOR = 2.0


def race(fns: dict, repeats: int, settle: float, slow: float) -> tuple[dict, dict]:
    """Median seconds of ``repeats`` calls of each callable, the contenders in turn (a, b, c, a,
    b, c, ...), and the first call's results; the first callable is the reference. ``settle``
    seconds of sleep before each call (not timed) let the previous contender's worker threads
    go idle. The first round counts: the callers have warmed every contender up on the same
    shapes (:func:`measure_speed`). A contender whose first call took over ``SLOW_FACTOR`` times
    the reference's first call and over ``slow`` seconds is not called again: that call's time
    stands as its figure, which keeps the run's length bounded.

    Returns ``({name: seconds, None: names timed once}, {name: first call's result})``."""
    times, outputs = {name: [] for name in fns}, {}
    reference = next(iter(fns))
    too_slow = (lambda name: name != reference and times[name][0] > max(slow, SLOW_FACTOR * times[reference][0]))
    for round_ in range(repeats):
        for name, fn in fns.items():
            if round_ and too_slow(name):
                continue
            time.sleep(settle)
            t0 = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - t0)
            outputs.setdefault(name, out)
    medians = {n: statistics.median(t) for n, t in times.items()}
    medians[None] = {n for n in fns if too_slow(n)}
    return medians, outputs


def equal_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Leading steps at which every row of ``a`` and ``b`` (``[B, n]``) holds the same token."""
    same = (a == b).all(0)
    return int(np.cumprod(same).sum())


class AsModel:
    """A contender seen as a model by :func:`bench.top1_agreement`: ``config.n_ctx`` and
    ``__call__(window [1, T]) → .logits [1, T, V]``; the logits of each window are kept (the
    reference's are asked for once per contender, and bits/byte reads them again)."""

    def __init__(self, contender: Contender, n_ctx: int):
        self.contender, self.config, self.cache = contender, types.SimpleNamespace(n_ctx=n_ctx), {}

    def __call__(self, window: torch.Tensor):
        key = window.numpy().tobytes()
        if key not in self.cache:
            self.cache[key] = torch.from_numpy(self.contender.logits(window[0].numpy().astype(np.int64)))[None]
        return types.SimpleNamespace(logits=self.cache[key])


def bits_per_token(model: AsModel, tokens: torch.Tensor) -> float:
    """Mean next-token cross-entropy (bits) over windows of n_ctx of ``tokens`` (each window's
    first token unscored): bits per byte for a byte-level model."""
    n_ctx, nats, count = model.config.n_ctx, 0.0, 0
    for start in range(0, len(tokens), n_ctx):
        window = tokens[start:start + n_ctx]
        logits = model(window[None]).logits[0, :-1].double()
        nats += float(F.cross_entropy(logits, window[1:], reduction="sum"))
        count += len(window) - 1
    return nats / count / math.log(2)


def measure_speed(contenders, cfg: GPT2Config, sizes: Sizes, settle: float, log) -> dict:
    """Decode tok/s at each batch, prefill seconds at each length, greedy tokens equal to the
    reference's over the warm-up decode; ``{name: {figure: value}}``. ``"once"`` lists the
    figures timed from the warm-up alone (it took over ``sizes.slow`` s, see :func:`race`); the
    contender then sits out the later speed figures (None), so one very slow contender cannot
    stretch the run. The reference always runs."""
    res = {c.name: {"once": []} for c in contenders}
    active = list(contenders)

    def one(figure, fn_of, value_of):
        t, out = race({c.name: fn_of(c) for c in active}, sizes.repeats, settle, sizes.slow)
        for c in contenders:
            res[c.name][figure] = value_of(t[c.name]) if c in active else None
        for c in [c for c in active if c.name in t[None]]:
            res[c.name]["once"].append(figure)
            if c is not contenders[0]:
                active.remove(c)
        log(f"{figure}: " + ", ".join(f"{n} {v[figure]:.3g}" for n, v in res.items() if v[figure] is not None))
        return out

    for c in contenders:                      # first-call work (lazy copies, packing, allocations) out of the way
        for B in sizes.batches:               # (a compiled step: compiled for the very shapes timed)
            t0 = time.perf_counter()
            c.greedy(np.zeros((B, sizes.prompt), dtype=np.int64), sizes.new_tokens if getattr(c, "compiled", False) else 2)
            if getattr(c, "compiled", False):
                log(f"{c.name}: compiled for batch {B} in {time.perf_counter() - t0:.1f} s")
        c.first_token(np.zeros((1, 16), dtype=np.int64))
    for B in sizes.batches:
        prompt = torch.randint(0, cfg.n_vocab, (B, sizes.prompt), generator=torch.Generator().manual_seed(B)).numpy()
        runners = [c for c in active]
        out = one(f"decode b{B}", lambda c: (lambda: c.greedy(prompt, sizes.new_tokens)),
                  lambda sec: B * sizes.new_tokens / sec)
        for c in contenders:
            res[c.name][f"same b{B}"] = equal_prefix(out[REFERENCE], out[c.name]) if c in runners else None
    for T in sizes.prefill:
        T = min(T, cfg.n_ctx)
        prompt = torch.randint(0, cfg.n_vocab, (1, T), generator=torch.Generator().manual_seed(T)).numpy()
        one(f"prefill {T}", lambda c: (lambda: c.first_token(prompt)), lambda sec: sec)
    return res


def measure_quality(contenders, tokens: torch.Tensor, n_ctx: int, bpb: bool, log=print) -> dict:
    """``{name: {"top1": fraction, "bpb": bits/byte}}`` against the first contender, teacher forced."""
    ref = AsModel(contenders[0], n_ctx)
    out = {}
    for c in contenders:
        t0 = time.perf_counter()
        try:
            m = ref if c is contenders[0] else AsModel(c, n_ctx)
            out[c.name] = {"top1": top1_agreement(ref, m, tokens)}
            if bpb:
                out[c.name]["bpb"] = bits_per_token(m, tokens)
        except Exception as e:                                            # an engine that cannot score it
            out[c.name] = {"error": f"{type(e).__name__}: {e}"}
        log(f"  scored {c.name}: {time.perf_counter() - t0:.1f} s")
    return out


def machine(threads: int) -> dict:
    cpu = platform.processor() or platform.machine()
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        cpu = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        fl = next(line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags"))
        flags = " ".join(x for x in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8") if x in fl)
    except (OSError, StopIteration):
        pass
    return dict(cpu=cpu, cores=os.cpu_count(), threads=threads, flags=flags, python=platform.python_version(),
                versions=engine_versions())


# ============================================================================ the run
def run(sizes: Sizes, engines, threads: int, work: str, settle: float = 0.2, log=print, gguf_converter=None,
        optimum_cli=None) -> dict:
    """Build, measure, return everything (``format_report`` prints it)."""
    torch.set_num_threads(threads)
    load_start = os.getloadavg()
    t_start = time.time()
    skipped = missing_engines()
    engines = [e for e in engines if e not in skipped]
    bandwidth = memory_bandwidth()
    log(f"memory bandwidth (torch.sum over 340 MB): {bandwidth / 1e9:.1f} GB/s")
    log(f"load average at start: {load_start}")
    tokens, merges = gpt2_vocab()
    result = dict(machine=machine(threads), sizes=dataclasses.asdict(sizes), skipped=skipped, bandwidth=bandwidth,
                  load_start=load_start, date=time.strftime("%Y-%m-%d %H:%M %Z"))

    # ---- the random 124M: speed, size, greedy agreement, top-1 on held-out text
    cfg = GPT2Config.from_preset("124M")
    rand_dir = os.path.join(work, "random-124M")
    if not os.path.isdir(rand_dir):
        random_checkpoint(rand_dir, cfg, seed=0)
    write_tokenizer_files(rand_dir, tokens, merges)
    contenders, notes = build_contenders(rand_dir, os.path.join(work, "random-124M-engines"), engines, threads,
                                         tokens, merges, log, gguf_converter, sizes.skip, optimum_cli)
    log("contenders: " + ", ".join(c.name for c in contenders))
    log(f"load average: {os.getloadavg()}")
    speed = measure_speed(contenders, cfg, sizes, settle, log)
    held_out = real_text_tokens(cfg, sizes.agree_tokens, TEXT, tail=True)
    quality = measure_quality(contenders, held_out, cfg.n_ctx, bpb=False, log=log)
    log(f"top-1 on the random 124M done; load average {os.getloadavg()}")
    rows = []
    for c in contenders:
        rows.append(dict(name=c.name, engine=c.engine, checkpoint_bytes=c.checkpoint_bytes, read_bytes=c.read_bytes,
                         types=getattr(c, "types", getattr(c, "compute_type", "")), **speed[c.name],
                         top1_random=quality[c.name].get("top1"), error_random=quality[c.name].get("error")))
        c.close()
    del contenders
    gc.collect()

    # ---- shakespeare-byte: top-1 and bits/byte on held-out bytes
    byte_dir = os.path.join(work, DEFAULT_MODEL)
    if not os.path.isdir(byte_dir):
        GPT2.from_pretrained(DEFAULT_MODEL).save_pretrained(byte_dir)
    write_tokenizer_files(byte_dir, byte_vocab(), [])
    byte_notes = {}
    try:
        log(f"{DEFAULT_MODEL}: converting and loading")
        byte_contenders, byte_notes = build_contenders(byte_dir, os.path.join(work, f"{DEFAULT_MODEL}-engines"), engines,
                                                       threads, byte_vocab(), None, log, None, sizes.skip, optimum_cli)
        bcfg = GPT2.from_pretrained(byte_dir).config
        text = real_text_tokens(bcfg, sizes.byte_tokens, TEXT, tail=True)
        bq = measure_quality(byte_contenders, text, bcfg.n_ctx, bpb=True, log=log)
        log(f"{DEFAULT_MODEL} quality done")
        for c in byte_contenders:
            c.close()
    except Exception as e:                                                # keep the 124M figures
        bq = {}
        byte_notes["all"] = f"{type(e).__name__}: {e}"
    for r in rows:
        q = bq.get(r["name"], {})
        r.update(top1_byte=q.get("top1"), bpb_byte=q.get("bpb"),
                 error_byte=q.get("error") or byte_notes.get(r["name"]) or byte_notes.get("all"))
    result.update(rows=rows, notes={**notes, **{f"{k} (shakespeare-byte)": v for k, v in byte_notes.items()}},
                  load_end=os.getloadavg(), seconds=time.time() - t_start, bandwidth_end=memory_bandwidth())
    return result


def _ratio(value, ref, faster_is_larger=True):
    if not value or not ref:
        return "-"
    return f"{(value / ref if faster_is_larger else ref / value):.2f}x"


def format_report(res: dict) -> str:
    """The Markdown report: machine, load, one table, the bandwidth analysis."""
    m, s = res["machine"], res["sizes"]
    v = m["versions"]
    lines = [f"date: {res['date']}; {res['seconds']:.0f} s",
             f"machine: {m['cpu']}, {m['cores']} cores ({m['flags'] or 'no AVX2/AVX-512 flags seen'}), "
             f"{m['threads']} threads for every engine; Python {m['python']}; "
             + ", ".join(f"{k} {x}" for k, x in v.items()),
             f"load average (1, 5, 15 min): start {', '.join(f'{x:.2f}' for x in res['load_start'])}; "
             f"end {', '.join(f'{x:.2f}' for x in res['load_end'])}",
             f"memory bandwidth (bench.memory_bandwidth, torch.sum over 340 MB, {m['threads']} threads): "
             f"{res['bandwidth'] / 1e9:.1f} GB/s at the start, {res['bandwidth_end'] / 1e9:.1f} GB/s at the end",
             ""]
    bandwidth = max(res["bandwidth"], res["bandwidth_end"])
    for engine, why in res["skipped"].items():
        lines.append(f"skipped {engine}: {why}")
    for name, why in res["notes"].items():
        lines.append(f"{name}: {why}")
    ref = next(r for r in res["rows"] if r["name"] == REFERENCE)
    B = s["batches"]
    head = (["contender", "checkpoint MB"] + [f"decode b{b} tok/s (x tf32)" for b in B]
            + [f"prefill {t} ms (x tf32)" for t in s["prefill"]]
            + [f"greedy = tf32 (b{b}, of {s['new_tokens']})" for b in B]
            + [f"top-1 = tf32, random 124M ({s['agree_tokens']} tok)", f"top-1 = tf32, {DEFAULT_MODEL}",
               f"bits/byte, {DEFAULT_MODEL}", "weights read MB/token", "GB/s at b1 (of bandwidth)"])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in res["rows"]:
        cells = [r["name"] + (f" ({r['types']})" if r.get("types") else ""), f"{r['checkpoint_bytes'] / 1e6:.0f}"]
        def speed(fig, value_of, faster_is_larger):
            if r[fig] is None:
                return "dropped"
            star = "*" if fig in r["once"] else ""
            return f"{value_of(r[fig])}{star} ({_ratio(r[fig], ref[fig], faster_is_larger)})"

        cells += [speed(f"decode b{b}", lambda v: f"{v:.1f}", True) for b in B]
        cells += [speed(f"prefill {t}", lambda v: f"{v * 1e3:.0f}", False) for t in (min(t, 1024) for t in s["prefill"])]
        cells += ["-" if r[f"same b{b}"] is None else f"{r[f'same b{b}']}" for b in B]
        cells += [f"{r['top1_random']:.2%}" if r["top1_random"] is not None else f"- ({r['error_random']})"]
        cells += [f"{r['top1_byte']:.2%}" if r["top1_byte"] is not None else f"cannot: {r['error_byte']}",
                  f"{r['bpb_byte']:.4f}" if r["bpb_byte"] is not None else "-"]
        if r["read_bytes"] and r["decode b1"]:
            gbs = r["read_bytes"] * r["decode b1"] / 1e9
            cells += [f"{r['read_bytes'] / 1e6:.0f}", f"{gbs:.1f} ({gbs * 1e9 / bandwidth:.0%})"]
        else:
            cells += ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Sizes: prompt {s['prompt']} random tokens, {s['new_tokens']} new greedy tokens, batches {B}; prefill "
              f"{s['prefill']} tokens at batch 1 (time to the first token); medians of {s['repeats']} rounds, contenders "
              f"in turn, after a short warm-up call of each shape; ratios: contender / transformers float32 for tok/s, transformers / "
              f"contender for times (above 1 = faster). Top-1 and bits/byte: teacher forced over held-out text (the last "
              f"10% of data/tinyshakespeare.txt), windows of n_ctx. Weights read/token: block matrices, biases, norms "
              f"and the LM head as stored (CTranslate2: its model.bin less the position table); GB/s = that x batch-1 tok/s, "
              f"against the larger bandwidth measured. *: the contender's first call of that figure took over "
              f"{SLOW_FACTOR:g}x the reference's and over {s['slow']:.0f} s, and was timed by that call alone; dropped: it sat out the later speed figures after that."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="scaled-down sizes: 16 new tokens, one round, prefill 128 only, fewer scored "
                        "tokens, the engines' float32 variants left out")
    p.add_argument("--threads", type=int, default=2, help="threads for every engine (default 2)")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help=f"comma-separated engines besides transformers float32 (default all: {','.join(ENGINES)})")
    p.add_argument("--workdir", default=None, metavar="DIR",
                   help="keep the checkpoints and conversions here and reuse them next time (default: a temporary "
                        "directory removed at the end)")
    p.add_argument("--gguf-converter", default=None, metavar="convert_hf_to_gguf.py",
                   help="make the random model's f32 GGUF with llama.cpp's own script from its source tree instead of "
                        "the gguf-package writer")
    p.add_argument("--optimum-cli", default=None, metavar="PATH",
                   help="the optimum-cli that exports the OpenVINO IRs (default: the one on PATH; optimum-intel and "
                        "NNCF may pin another transformers than this environment's: install them elsewhere)")
    p.add_argument("--settle", type=float, default=0.2, help="seconds of pause before each timed call (default 0.2)")
    p.add_argument("--slow", type=float, default=None,
                   help="seconds: a contender whose first call of a speed figure takes longer, and over twice the "
                        "reference's, is timed by that call alone and left out of the later speed figures (default "
                        "10, --quick 4; bounds the run)")
    p.add_argument("--skip", default="", metavar="NAMES",
                   help="comma-separated contenders to leave out, e.g. 'gpt2mha int8,llama.cpp f32'")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON to FILE")
    args = p.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        p.error(f"--engines: unknown {bad}; expected some of {list(ENGINES)}")
    if args.threads < 1:
        p.error(f"--threads={args.threads}: expected at least 1")
    if args.json and os.path.exists(args.json):
        p.error(f"--json: {args.json} exists; not overwriting it")
    try:
        import transformers
    except ImportError:
        p.error("transformers float32 is the reference: pip install transformers")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:4.0f} s] {msg}", file=sys.stderr, flush=True)

    sizes = QUICK if args.quick else FULL
    if args.slow is not None:
        sizes = dataclasses.replace(sizes, slow=args.slow)
    skip = tuple(x.strip() for x in args.skip.split(",") if x.strip())
    bad = [x for x in skip if x not in VARIANTS]
    if bad:
        p.error(f"--skip: unknown {bad}; expected some of {list(VARIANTS)} ({REFERENCE!r} always runs, 'gpt2mha "
                f"float32' whenever --engines has gpt2mha)")
    sizes = dataclasses.replace(sizes, skip=sizes.skip + skip)
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
        res = run(sizes, engines, args.threads, args.workdir, args.settle, log, args.gguf_converter, args.optimum_cli)
    else:
        with tempfile.TemporaryDirectory(prefix="gpt2mha-peers-") as work:
            res = run(sizes, engines, args.threads, work, args.settle, log, args.gguf_converter, args.optimum_cli)
    print(format_report(res))
    if args.json:
        meta = {"benchmark": "peers", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
                "command": "python benchmarks/peers.py " + " ".join(sys.argv[1:] if argv is None else argv),
                "source": "written by benchmarks/peers.py --json (every contender in one process, in turns)"}
        with open(args.json, "w") as f:
            json.dump({**meta, **res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
