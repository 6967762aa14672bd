"""The contenders of ``benchmarks/peers.py``, one class per engine behind one interface
(:class:`Contender`: ``greedy``, ``first_token``, ``logits``, ``close``): transformers and gpt2mha in
this process (:class:`Torch`), llama.cpp through llama-cpp-python (:class:`LlamaCpp`), CTranslate2
(:class:`CT2`), ONNX Runtime (:class:`ORT`), OpenVINO (``peers_openvino.py``); the bytes of weights a
decode step of each reads; and :func:`build_contenders`, which converts one checkpoint for every
installed engine (``peers_convert.py``) and loads them all. peers.py re-exports the names other
files import from it (peers_isolated.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import subprocess
import sys
import time
import warnings

import numpy as np
import torch

import peers_openvino
from bench import hf_greedy, step_bytes
from gpt2mha import GPT2, GPT2Config
from peers_convert import export_onnx, llama_quantize, write_gguf

#: The contender every ratio divides by (the first that :func:`build_contenders` returns).
REFERENCE = "transformers float32"


# ============================================================================ contenders
class Contender:
    """One engine + weights. Subclasses implement ``greedy``, ``first_token`` and ``logits``.

    ``checkpoint_bytes``: the files the engine loads; ``read_bytes``: weights a batch-1 decode
    step reads (None: unknown)."""

    engine = ""
    version = ""
    kv_cache = ""            # the precision its KV cache holds keys and values in: f32, bf16, f16 (KV_NAMES)


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


#: a torch dtype's name -> the short name every contender's ``kv_cache`` uses (llama.cpp's and OpenVINO's)
KV_NAMES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


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
        p = model.transformer.wte.weight if hf else model.wte.weight        # gpt2mha's cache: wte's dtype
        self.kv_cache = KV_NAMES[str(p.dtype).replace("torch.", "")]

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
    batch 1, prefill and scoring; B sequences of 256 positions each for batch B. ``kv_cache``: the
    cache's type, "f16" (llama.cpp's default whatever the weights) or "f32" (:data:`LLAMA_KV_CACHE`)."""

    engine = "llama.cpp"
    _log_callback = None
    SEQ = 256                                                     # positions per sequence at batch > 1

    def __init__(self, name, path, n_ctx, threads, read_bytes, kv_cache: str = "f16"):
        import llama_cpp as L

        super().__init__(name, dir_bytes(path), read_bytes)
        if kv_cache not in ("f16", "f32"):
            raise ValueError(f"kv_cache={kv_cache!r}; expected 'f16' or 'f32'")
        self.L, self.n_ctx, self.threads, self.kv_cache = L, n_ctx, threads, kv_cache
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
            cp.type_k = cp.type_v = L.GGML_TYPE_F32 if self.kv_cache == "f32" else L.GGML_TYPE_F16
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


#: a GGUF's kind -> its KV cache's type where not llama.cpp's f16: an f32 model keeps float32 keys and
#: values, as gpt2mha float32, CTranslate2 float32 and "openvino f32" do (the same precision end to end)
LLAMA_KV_CACHE = {"f32": "f32"}


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
        self.kv_cache = "f32"               # its activations' type: float32 for both compute types here

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
        self.kv_cache = "f32"                                         # the graph's past and present (float32)
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
            for name, kv in ((f"llama.cpp {kind}", LLAMA_KV_CACHE.get(kind, "f16")),
                             *([(f"llama.cpp {kind} kv-f16", "f16")] if kind in LLAMA_KV_CACHE else [])):
                if want(name):
                    try:
                        c = LlamaCpp(name, path, cfg.n_ctx, threads, gguf_read_bytes(path), kv)
                        c.types = gguf_types(path)
                        out.append(c)
                    except Exception as e:
                        notes[name] = f"cannot run: {type(e).__name__}: {e}"

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
        for name, (fmt, hint, kv) in peers_openvino.VARIANTS.items():
            if not want(name):
                continue
            path = os.path.join(work, f"ov-{fmt}")
            try:
                with timed(log, f"OpenVINO export ({fmt})") if not os.path.isdir(path) else contextlib.nullcontext():
                    peers_openvino.export(hf_dir, path, fmt, optimum_cli, log)
                out.append(peers_openvino.OpenVINO(name, path, hint, threads, dir_bytes(path),
                                                   peers_openvino.ir_read_bytes(path, cfg), kv))
            except Exception as e:
                lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]    # a table cell: one line
                notes[name] = f"cannot run: {type(e).__name__}: {' / '.join(lines[:3])[:300]}"
    return out, notes
