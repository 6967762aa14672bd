"""``gpt2mha generate`` with ``--stop``, ``--logprobs``/``--echo`` or ``--best-of``: the request
run in this process on the serving scheduler (:class:`~gpt2mha.inference.scheduler.Scheduler`:
the engine, stop strings, log-probabilities and best-of that ``gpt2mha serve`` answers with),
printed as text. The same prompt, flags and seed give the text a request to ``gpt2mha serve``
gets, and the tokens ``generate()`` gives."""

from __future__ import annotations

import sys


def generate_served(args, model, tok, encoded: list[list[int]], params) -> int:
    """Run ``encoded`` (one token list per PROMPT) with ``params`` to the end; print each choice
    (labelled when there are several) as PROMPT + its text, then, with ``--logprobs``, one line
    per token: its text, its log-probability and the K most likely tokens with theirs (with
    ``--echo`` the prompt's tokens first). Returns 0, or 1 when a sequence failed (its error on
    stderr)."""
    from ..inference.decoders import choose_decoder
    from ..inference.scheduler import Scheduler, pick_choices

    route = choose_decoder(model, compile=args.compile, batch_invariant=args.batch_invariant)
    sched = Scheduler(model, tok, max_batch=len(encoded) * params.per_prompt, max_queue=0,
                      batch_invariant=args.batch_invariant, route=route)
    seqs = sched.submit(encoded, params, lambda *a: None)
    sched.run_until_idle()
    failed = [s for s in seqs if s.finish_reason == "error"]
    if failed:
        print(f"error: {failed[0].error}", file=sys.stderr)
        return 1
    choices = pick_choices(seqs)
    for index, seq in choices:
        if len(choices) > 1:
            label = f"sample {index % params.n + 1} of {params.n}"
            if len(args.prompt) > 1:
                label = f"prompt {seq.prompt_index + 1} of {len(args.prompt)}, " + label
            print(f"{'=' * 20} {label} {'=' * 20}")
        print(args.prompt[seq.prompt_index] + seq.text)
        if params.logprobs is not None:
            print_logprobs(tok, seq, params.echo)
    return 0


def print_logprobs(tok, seq, echo: bool) -> None:
    """The sequence's per-token log-probabilities (``--echo``: the prompt's tokens after its
    first, then the new ones its text holds: not a stop string's, as the server's answer), one
    token a line: ``text  logprob  |  top1 lp1  top2 lp2 …``."""
    rows = []
    if echo and seq.prompt_logprobs:
        rows += list(zip(seq.prompt_ids[1:], seq.prompt_logprobs))
    released = seq.stream.released if seq.stream is not None else len(seq.tokens)   # a stop string's tokens: not
    rows += list(zip(seq.tokens[:released], seq.logprobs[:released]))              # the text's, as the server's
    print(f"-- log-probabilities ({'prompt and ' if echo else ''}new tokens; the model's own distribution) --")
    for token, (logprob, top) in rows:
        alternatives = "  ".join(f"{tok.decode([i])!r} {lp:.4f}" for i, lp in top)
        print(f"{tok.decode([token])!r:>12} {logprob:9.4f}  |  {alternatives}")
