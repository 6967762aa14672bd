"""The conversions of ``benchmarks/peers.py``: GPT-2's tokenizer files beside a transformers
checkpoint (the converters of CTranslate2 and llama.cpp read them), a float32 GGUF written with the
``gguf`` package as llama.cpp's ``convert_hf_to_gguf.py`` writes GPT-2, llama.cpp's own quantizer
on it (``llama_model_quantize``), and GPT-2 as one ONNX graph with its KV cache as inputs and outputs
(:class:`OnnxGPT2`). peers.py re-exports the names other files import from it (serve_peers.py,
tests/test_peers_bench.py).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import sys
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from gpt2mha.io.tokenizer import bpe_data_files


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

