"""The commands that run the model: ``generate``, ``perplexity``, ``train``."""

from __future__ import annotations

import dataclasses
import json
import re
import sys

from .checks import (check_compile, check_perplexity_args, check_sampling, check_train_args, param_flag,
                     sampling_params_of, token_id_list)
from .common import (batch_invariant_arg, DTYPES, DefaultsHelpFormatter, check_quantize_args, load_model, model_arg, quantize_args, quantized,
                     quiet_arg, read_text)


def check_generate_args(args) -> None:
    """What ``generate``'s command line alone decides (raises ValueError naming the flags); run
    before torch is imported and before any process group is joined, so under torchrun it is
    reported once, by rank 0. Every sampling flag goes with every other (one scheduler runs
    them all); only flags that contradict each other are refused."""
    check_sampling(args)
    if args.prompt_file is not None:
        if args.prompt:
            raise ValueError(f"--prompt-file {args.prompt_file} is the prompt; drop the PROMPT ({args.prompt[0]!r}) "
                             f"or the flag")
        args.prompt = [read_prompt_file(args.prompt_file)]
    prompts = args.prompt
    if args.unconditional and prompts:
        raise ValueError(f"--unconditional starts from <|endoftext|> alone; drop the PROMPT ({prompts[0]!r}) or "
                         f"the flag")
    if not args.unconditional and not prompts:
        raise ValueError("give a PROMPT to continue (or --unconditional to sample from <|endoftext|>)")
    if "" in prompts:
        which = f"PROMPT {prompts.index('') + 1}" if len(prompts) > 1 else \
            f"--prompt-file {args.prompt_file}" if args.prompt_file is not None else "PROMPT"
        raise ValueError(f"{which} is empty; give at least one character to continue")
    if args.ignore_eos and args.stop_at_eos:
        raise ValueError("--ignore-eos and --stop-at-eos contradict each other; drop one of them")
    if args.quantize and args.tp > 1:
        raise ValueError(f"--quantize {args.quantize} with --tp {args.tp}: tensor parallelism shards float weights; "
                         f"quantized models run in one process")
    check_quantize_args(args)
    check_compile(args)


def cmd_generate(args) -> int:
    """``gpt2mha generate``: the prompts run to completion on the scheduler ``gpt2mha serve`` runs
    (:func:`~gpt2mha.inference.generate.generate_sequences`), every flag a field of one
    :class:`~gpt2mha.inference.params.SamplingParams`; one sequence (one PROMPT, one sample) is
    streamed as it is sampled, several are printed labelled once all are done."""
    from ..inference import parallel
    from ..inference.generate import check_fits
    from ..inference.params import FIELDS
    from ..io.tokenizer import tokenizer_for
    from .. import distributed

    prompts = args.prompt
    di = parallel.check_world(args.tp)                # --tp N needs N ranks (torchrun)
    model = load_model(args.model, args.dtype)
    weights = distributed.weights_fingerprint(model) if di.world_size > 1 else None
    model = parallel.tensor_parallel(model, args.tp)
    tok = tokenizer_for(model.config)
    params = sampling_params_of(args)
    try:
        params.check_vocab(min(tok.n_vocab, model.config.n_vocab))
    except ValueError as e:
        raise ValueError(f"--logit-bias: {e}") from None
    if args.stop_at_eos and tok.eot_token is None:
        raise ValueError(f"--stop-at-eos: the {tok.name!r} tokenizer of this model has no <|endoftext|> token")
    if args.unconditional and tok.eot_token is None:
        raise ValueError(f"--unconditional starts from <|endoftext|>, which the {tok.name!r} tokenizer of this model "
                         f"does not have; give a PROMPT instead")
    try:
        encoded = [[tok.eot_token]] if args.unconditional else [tok.encode(p) for p in prompts]
    except UnicodeError:
        raise ValueError("PROMPT is not valid UTF-8 text") from None
    check_fits(max(map(len, encoded)), args.max_new_tokens, model.config.n_ctx, args.sliding_window)
    model = quantized(model, args)                    # after the checks: GPTQ takes seconds to minutes
    # tensor-parallel ranks must sample the same tokens from their equal logits: same inputs, one seed
    distributed.agree({"the prompts' token ids": encoded, "the weights (checksum)": weights, "--dtype": args.dtype,
                       **{param_flag(name): getattr(params, name) for name in FIELDS if name != "seed"},
                       **{f"--{k.replace('_', '-')}": getattr(args, k) for k in ("stop_at_eos", "unconditional")}})
    params = dataclasses.replace(params, seed=distributed.shared_seed(args.seed))
    return run_and_print(args, model, tok, encoded, params)


def run_and_print(args, model, tok, encoded: list[list[int]], params) -> int:
    """Run ``encoded`` (one token list per PROMPT, or ``<|endoftext|>`` alone) with ``params`` to
    the end and print each choice: PROMPT + its text (``--unconditional``: the text alone), after a
    label line when there are several (several PROMPTs, ``--num-samples``, ``--unconditional``);
    with ``--stop-at-eos`` a text that ended at ``<|endoftext|>`` shows it. One unlabelled
    sequence is streamed as its text becomes certain (whole characters, no part of a stop
    string). With ``--logprobs``, one line per token after each text (:func:`print_logprobs`)."""
    import torch

    from ..inference import parallel
    from ..inference.generate import generate_sequences
    from ..inference.sequence import pick_choices
    from ..inference.text_stream import STOP
    from .. import distributed

    out = distributed.rank0_stdout()
    eos = tok.eot_token if args.stop_at_eos else None
    labelled = args.unconditional or len(encoded) > 1 or params.n > 1
    streamed = not labelled and params.per_prompt == 1
    started = []

    def on_event(seq, text, done):
        if not started:                               # the prompt is echoed once the arguments have held up
            out.write(args.prompt[0])
            started.append(True)
        out.write(text)
        out.flush()

    try:
        seqs = generate_sequences(model, encoded, params, eos_token_id=eos, on_event=on_event if streamed else None,
                                  vocab_size=tok.n_vocab, batch_invariant=args.batch_invariant, compile=args.compile,
                                  tokenizer=tok)
    except BaseException:                             # (e.g. another rank died): end the streamed line first
        if started:
            out.write("\n")
            out.flush()
        raise
    longest = max(len(s.tokens) for s in seqs)
    parallel.check_same_tokens(torch.tensor([s.tokens + [-1] * (longest - len(s.tokens)) for s in seqs]))

    def ending(seq) -> str:                           # <|endoftext|>'s own text, where --stop-at-eos ended it
        return tok.decode([eos]) if eos is not None and seq.finish_reason == STOP and seq.tokens[-1:] == [eos] else ""

    for index, seq in pick_choices(seqs):
        if streamed:
            out.write(ending(seq) + "\n")
        else:
            if labelled:
                label = f"sample {index % params.n + 1} of {params.n}"
                if len(encoded) > 1:
                    label = f"prompt {seq.prompt_index + 1} of {len(encoded)}, " + label
                print(f"{'=' * 20} {label} {'=' * 20}", file=out)
            prompt = "" if args.unconditional else args.prompt[seq.prompt_index]
            print(prompt + seq.text + ending(seq), file=out)
        if params.logprobs is not None:
            print_logprobs(tok, seq, params.echo, out)
    return 0


def print_logprobs(tok, seq, echo: bool, out=None) -> None:
    """The sequence's per-token log-probabilities (``--echo``: the prompt's tokens after its
    first, then the new ones its text holds: not a stop string's, as the server's answer), one
    token a line: ``text  logprob  |  top1 lp1  top2 lp2 …``, to ``out`` (standard output)."""
    rows = []
    if echo and seq.prompt_logprobs:
        rows += list(zip(seq.prompt_ids[1:], seq.prompt_logprobs))
    released = seq.stream.released if seq.stream is not None else len(seq.tokens)   # a stop string's tokens: not
    rows += list(zip(seq.tokens[:released], seq.logprobs[:released]))              # the text's, as the server's
    print(f"-- log-probabilities ({'prompt and ' if echo else ''}new tokens; the model's own distribution) --",
          file=out)
    for token, (logprob, top) in rows:
        alternatives = "  ".join(f"{tok.decode([i])!r} {lp:.4f}" for i, lp in top)
        print(f"{tok.decode([token])!r:>12} {logprob:9.4f}  |  {alternatives}", file=out)


def read_prompt_file(path: str) -> str:
    """``--prompt-file``: the file's exact text (a trailing newline included), or standard input's
    for ``-``. Raises ValueError naming the file when it cannot be read or is not UTF-8."""
    if path != "-":
        try:
            return read_text(path)
        except ValueError as e:
            raise ValueError(f"--prompt-file: {e}") from None
    try:
        return sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompt-file -: standard input is not UTF-8 text (byte {e.start})") from None


def cmd_perplexity(args) -> int:
    from .. import distributed

    text = read_text(args.file, args.split)
    model = quantized(load_model(args.model, args.dtype), args).to(distributed.info().device)
    from ..train.evaluate import distributed_perplexity
    result = distributed_perplexity(model, text, stride=args.stride,   # windows split over torchrun's ranks
                                    progress=not args.quiet)
    if not distributed.info().is_main:
        return 0
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(f"tokens           {result.tokens}\nbytes            {result.bytes}\n"
              f"loss per token   {result.loss_per_token:.4f} nats\nperplexity       {result.perplexity:.3f}\n"
              f"bits per byte    {result.bits_per_byte:.4f}")
    return 0


#: train's options that set the model (GPT2Config fields), as argparse names them
TRAIN_MODEL_FLAGS = {"n_layer": "--n-layer", "n_head": "--n-head", "n_embd": "--n-embd", "n_ctx": "--n-ctx",
                     "tokenizer": "--tokenizer", "attn_pdrop": "--attn-pdrop", "resid_pdrop": "--resid-pdrop"}


#: train's options that set the optimisation (TrainConfig fields)
TRAIN_SETTINGS = ("iters", "batch_size", "lr", "min_lr", "warmup", "seed", "eval_interval")


def cmd_train(args) -> int:
    """``gpt2mha train``. Every option defaults to None, so the ones given on the command line
    are known: a new run fills the others from the preset and :class:`~gpt2mha.train.TrainConfig`,
    ``--resume`` from the checkpoint (the train function prints each setting given that differs
    from it), ``--init-from`` from the model it loads."""
    from ..train.train import train

    model = {k: getattr(args, k) for k in TRAIN_MODEL_FLAGS if getattr(args, k) is not None}
    if model.get("resid_pdrop") is not None:
        model["embd_pdrop"] = model["resid_pdrop"]                   # --resid-pdrop covers the embeddings too
    if args.init_from is not None or (args.resume and args.preset is None):
        config = model or None                                       # checked against that model by train()
    else:                                                            # a new run; or --resume with the same preset
        from ..core.model import GPT2Config

        preset = args.preset or "tiny"
        if "tokenizer" not in model:
            model["tokenizer"] = "gpt2" if preset in ("124M", "355M", "774M", "1558M") else "bytes"
        config = GPT2Config.from_preset(preset, n_vocab=50257 if model["tokenizer"] == "gpt2" else 256, **model)
    settings = {k: getattr(args, k) for k in TRAIN_SETTINGS if getattr(args, k) is not None}
    try:
        log = train(args.data, args.out, config, settings, resume=args.resume,     # DDP under torchrun
                    init_from=args.init_from, progress=not args.quiet)
    except ValueError as e:                                          # name the flags the fields came from

        flags = {**TRAIN_MODEL_FLAGS, **{k: "--" + k.replace("_", "-") for k in (*TRAIN_SETTINGS, "init_from")}}
        flags = {k: v for k, v in flags.items() if getattr(args, k) is not None}          # the ones given
        message = re.sub(r"\b(%s)=" % "|".join(flags), lambda m: flags[m.group(1)] + "=", str(e)) if flags else str(e)
        raise ValueError(f"--preset {args.preset}: {message}" if args.resume and args.preset else message) from None
    from ..distributed import info
    if not info().is_main:
        return 0
    if log["steps_run"] == 0:                                        # a resumed run already at --iters
        print(f"nothing to do: the checkpoint in {args.out} is at step {log['evals'][-1]['step']} and --iters is "
              f"{log['train_config']['iters']}; pass a larger --iters to train on")
    elif log["evals"]:
        last = log["evals"][-1]
        print(f"done: step {last['step']}, val loss {last['val_loss']:.4f} nats/token, "
              f"{log['seconds']:.0f} s; checkpoint in {args.out}")
    return 0


def add_commands(sub) -> None:
    """The ``generate``, ``perplexity`` and ``train`` subcommands."""
    g = sub.add_parser("generate", help="continue a prompt (streams tokens as they are sampled)",
                       formatter_class=DefaultsHelpFormatter)
    g.add_argument("prompt", metavar="PROMPT", nargs="*",
                   help="text to continue; several PROMPTs are sampled as one batch and printed as labelled samples")
    g.add_argument("--prompt-file", "-f", default=None, metavar="FILE",
                   help="read the prompt from FILE (its exact UTF-8 text, a final newline included), '-' for "
                        "standard input; instead of PROMPT")
    model_arg(g)
    g.add_argument("--unconditional", action="store_true",
                   help="sample from <|endoftext|> alone, as OpenAI's generate_unconditional_samples.py (BPE models)")
    g.add_argument("--num-samples", type=int, default=1, help="samples per PROMPT, printed one after another, labelled")
    g.add_argument("--max-new-tokens", type=int, default=100, help="number of tokens to generate (>= 0)")
    g.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold in (0, 1]")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="keep only tokens at least this fraction as likely as the most likely one, after "
                        "--temperature (transformers' min_p); in [0, 1], 0: off")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="OpenAI's presence_penalty in [-2, 2]: subtracted once from the logit of every token "
                        "already generated (the prompt does not count)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="OpenAI's frequency_penalty in [-2, 2]: subtracted from a token's logit per time it "
                        "was generated")
    g.add_argument("--logit-bias", default=None, metavar="JSON",
                   help="OpenAI's logit_bias: a JSON object of token id to a bias in [-100, 100] added to its "
                        "logit, e.g. '{\"50256\": -100}'")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 0 (1: off): the logit of every token of the prompt or generated so far is divided by it "
                        "where positive, multiplied where negative (transformers' and vLLM's repetition_penalty; "
                        "1.2 is CTRL's)")
    g.add_argument("--no-repeat-ngram-size", type=int, default=0, metavar="N",
                   help="ban a token that would repeat an N-gram of the prompt plus the new tokens (transformers' "
                        "no_repeat_ngram_size; 0: off)")
    g.add_argument("--min-tokens", type=int, default=0, metavar="N",
                   help="ban <|endoftext|> (with --stop-at-eos) and --stop-token-ids until N new tokens are generated; "
                        "no --stop string ends the text before (vLLM's min_tokens)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="<|endoftext|> is an ordinary token (vLLM's ignore_eos): min-tokens does not ban it and a "
                        "grammar does not end on it")
    g.add_argument("--stop-token-ids", type=token_id_list, action="extend", default=[], metavar="IDS",
                   help="token ids, separated by commas, that end the text when sampled (their text left out)")
    g.add_argument("--include-stop-str-in-output", action="store_true",
                   help="keep the --stop string (or stop token's text) that ended the text")
    g.add_argument("--seed", type=int, default=None,
                   help="seed for reproducible sampling (default: a random one; with --tp, rank 0 draws it for all); "
                        "row i of the batch (PROMPT p, sample s: i = p * --num-samples + s) uses "
                        "row_seed(seed, i), as choice i of a served request with the same seed")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="weights' dtype; bfloat16/float16 halve the weights' memory and, on the native "
                        "forward, decode ~1.3-1.9x faster than float32 on the CPU (docs/performance.md); "
                        "logits stay float32")
    g.add_argument("--stop-at-eos", action="store_true", help="stop when <|endoftext|> is sampled")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the text before the first TEXT (repeat for several), as a request to gpt2mha serve with "
                        "this stop (which also ends at <|endoftext|>: add --stop-at-eos for that)")
    g.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="print each new token's log-probability and the K most likely tokens (0-20; the model's own "
                        "distribution, as OpenAI's logprobs)")
    g.add_argument("--echo", action="store_true",
                   help="with --logprobs: the prompt's tokens' log-probabilities too (the prompt is printed anyway)")
    g.add_argument("--best-of", type=int, default=None, metavar="N",
                   help="sample N candidates per PROMPT and print the --num-samples of highest mean "
                        "log-probability (OpenAI's best_of)")
    s = g.add_argument_group("structured outputs (one of them, as a request to gpt2mha serve with structured_outputs: "
                             "the text follows it and ends where it is complete)")
    s.add_argument("--json-schema", default=None, metavar="FILE",
                   help="the text is JSON valid for the JSON schema in FILE (OpenAI's response_format json_schema)")
    s.add_argument("--json-object", action="store_true", help="the text is a JSON object (response_format json_object)")
    s.add_argument("--regex", default=None, metavar="R",
                   help="the whole text matches the regular expression R (Rust regex syntax, as llguidance reads it)")
    s.add_argument("--choice", action="append", default=None, metavar="A,B",
                   help="the text is one of these strings, separated by commas (the flag may be repeated: its "
                        "strings are added)")
    s.add_argument("--grammar", default=None, metavar="FILE",
                   help="the text follows the Lark (llguidance's) or GBNF (llama.cpp's) grammar in FILE")
    g.add_argument("--sliding-window", action="store_true",
                   help="allow prompt + new tokens beyond n_ctx: once the context is full, each token is chosen from "
                        "the last n_ctx tokens alone, positions restarting at 0 (slower: no cache); the request field "
                        "sliding_window")
    batch_invariant_arg(g)
    g.add_argument("--compile", action="store_true",
                   help="compile the decode step (torch.compile; CPU): 10-70 s to compile, then exact int8 and "
                        "int4 models decode faster still (small ops fused around the same products: float32 "
                        "activations on gpt2mha's GEMV kernel, bf16 ones where it does not build); not for "
                        "--activations per_row or per_block, which decode faster without it (one C++ call a "
                        "forward: docs/explanation/routes.md); no batch-invariance guarantee for prompts of "
                        "different lengths (docs/explanation/routes.md)")
    g.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size: split the heads over this many processes "
                        "(torchrun --nproc-per-node N -m gpt2mha generate ... --tp N; docs/how-to/scale-out.md)")
    quiet_arg(g)
    quantize_args(g)
    g.set_defaults(func=cmd_generate, check=check_generate_args)

    p = sub.add_parser("perplexity", help="loss, perplexity and bits per byte of a text file",
                       formatter_class=DefaultsHelpFormatter)
    p.add_argument("file", metavar="FILE")
    model_arg(p)
    p.add_argument("--stride", type=int, default=None, help="window step in tokens (default n_ctx // 2)")
    p.add_argument("--split", choices=["all", "train", "val"], default="all",
                   help="score the whole file, or the trainer's split of it (train: first 90%% of the bytes, "
                        "val: last 10%%)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="weights' dtype, as for generate (the logits and the loss stay float32)")
    quiet_arg(p)
    quantize_args(p)
    p.set_defaults(func=cmd_perplexity, check=check_perplexity_args)

    t = sub.add_parser("train", help="train a GPT-2 on a text file (first 90%% train, last 10%% validation)")
    t.add_argument("--data", required=True, metavar="FILE", help="UTF-8 text file")
    t.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory (new, or ours with --resume)")
    t.add_argument("--preset", default=None,
                   help="size preset of a new run (tiny, shakespeare, 124M, ...; default tiny); the flags below "
                        "override it")
    for flag in ("--n-layer", "--n-head", "--n-embd", "--n-ctx"):
        t.add_argument(flag, type=int, default=None)
    t.add_argument("--tokenizer", choices=["bytes", "gpt2"], default=None,
                   help="of a new run (default: gpt2 for the GPT-2 presets, else bytes)")
    t.add_argument("--iters", type=int, default=None, help="optimizer steps in all (default 2000)")
    t.add_argument("--batch-size", type=int, default=None, help="windows per step, the global batch (default 32)")
    t.add_argument("--lr", type=float, default=None, help="peak learning rate (default 2e-3)")
    t.add_argument("--min-lr", type=float, default=None, help="the cosine's floor (default 2e-4)")
    t.add_argument("--warmup", type=int, default=None, help="linear warmup steps (default 100)")
    t.add_argument("--eval-interval", type=int, default=None,
                   help="validate and checkpoint every this many steps (default 250)")
    t.add_argument("--attn-pdrop", type=float, default=None, help="dropout on attention weights (default 0)")
    t.add_argument("--resid-pdrop", type=float, default=None,
                   help="dropout on residual branches and embeddings (default 0)")
    t.add_argument("--seed", type=int, default=None, help="initialisation and batch sampler (default 1337)")
    t.add_argument("--resume", action="store_true",
                   help="continue the checkpoint in --out with its settings, optimizer and random states; the "
                        "options above given here override its settings (one line each says so); the model's "
                        "sizes and the seed cannot change")
    t.add_argument("--init-from", default=None, metavar="MODEL",
                   help="fine-tune: start a new run at step 0, with its own optimizer, from MODEL's weights (any "
                        "--model value: built-in name, directory, hub id, nanoGPT ckpt.pt, ...); the data is read "
                        "with MODEL's tokenizer; only dropout may differ from MODEL's config")
    quiet_arg(t)
    t.set_defaults(func=cmd_train, check=check_train_args)
