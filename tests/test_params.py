"""SamplingParams: every field checked once, in one place, and every entry point accepts every field.

References: OpenAI's documented ranges (completions API), and the fields of the dataclass itself
(the enumeration test fails when a field is added without its CLI flag or server field).
"""

import pytest

from gpt2mha.inference.params import FIELDS, ParamError, SamplingParams


@pytest.mark.parametrize("kwargs,param,match", [
    (dict(max_tokens=-1), "max_tokens", "max_tokens=-1 must be an integer >= 0"),
    (dict(max_tokens=2.0), "max_tokens", "max_tokens=2.0 must be an integer >= 0; got float"),
    (dict(temperature=-1.0), "temperature", "temperature=-1.0 must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature", "temperature=nan"),
    (dict(temperature="1"), "temperature", "temperature='1'"),
    (dict(top_k=1.5), "top_k", "top_k=1.5 must be an integer"),
    (dict(top_p=0.0), "top_p", r"top_p=0.0 must be a number in \(0, 1\]"),
    (dict(min_p=2), "min_p", r"min_p=2 must be a number in \[0, 1\]"),
    (dict(seed=2**63), "seed", r"seed=9223372036854775808 must be an integer in \[0, 9223372036854775807\]"),
    (dict(seed=-1), "seed", "seed=-1"),
    (dict(stop=("x", "")), "stop", "must be a non-empty string or a list of them"),
    (dict(stop=3), "stop", "stop=3"),
    (dict(n=0), "n", r"n=0 must be an integer in \[1, 128\]"),
    (dict(n=3, best_of=2), "best_of", "best_of=2 must be greater than or equal to n=3"),
    (dict(best_of=21), "best_of", r"best_of=21 must be an integer in \[1, 20\]"),
    (dict(logprobs=21), "logprobs", r"logprobs=21 must be an integer in \[0, 20\]"),
    (dict(echo=1), "echo", "echo=1 must be true or false"),
    (dict(presence_penalty=2.1), "presence_penalty", r"presence_penalty=2.1 must be a number in \[-2, 2\]"),
    (dict(frequency_penalty=float("inf")), "frequency_penalty", "frequency_penalty=inf"),
    (dict(logit_bias={"x": 1}), "logit_bias", "logit_bias key 'x' is not a token id"),
    (dict(logit_bias={"１": 1}), "logit_bias", "logit_bias key '１' is not a token id"),      # a non-ASCII digit
    (dict(logit_bias={"9" * 5000: 1}), "logit_bias", r"key .99999.*\(5002 characters\) is not a token id"),  # int()'s limit
    (dict(logit_bias={5: -101.0}), "logit_bias", r"logit_bias\[5\]=-101.0 must be a number in \[-100, 100\]"),
    (dict(logit_bias=[3]), "logit_bias", "logit_bias must be an object mapping token ids to biases"),
    (dict(logit_bias={"65": 1, "065": 2}), "logit_bias", "logit_bias names token 65 twice"),
    (dict(temperature=10**400), "temperature", r"temperature=10000000000000000000….*\(401 characters\)"),  # no OverflowError
    (dict(top_p=10**5000), "top_p", "top_p=an integer of 16610 bits"),           # past int's printing limit
])
def test_every_field_out_of_range_is_a_param_error_naming_it(kwargs, param, match):
    with pytest.raises(ParamError, match=match) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and isinstance(info.value, ValueError)


def test_values_are_normalised_and_the_vocabulary_is_checked_separately():
    """Ids given as decimal strings (JSON keys) become ints, a stop string a tuple; an id past a
    vocabulary is refused by check_vocab, which names it."""
    import numpy as np

    assert SamplingParams(logit_bias={np.int64(5): 1}).logit_bias == ((5, 1.0),)     # integer kinds, as elsewhere
    p = SamplingParams(logit_bias={"007": 2, 3: -1.5}, stop="\n\n", seed=5, temperature=0)
    assert p.logit_bias == ((3, -1.5), (7, 2.0)) and p.stop == ("\n\n",) and p.greedy and p.adjusted
    p.check_vocab(8)
    with pytest.raises(ParamError, match=r"logit_bias key 7 is not a token id of this model's tokenizer \(ids 0 … 6\)"):
        p.check_vocab(7)
    assert SamplingParams(best_of=3, n=2).per_prompt == 3 and SamplingParams(best_of=3, n=2).ranked


# ----------------------------------------------------------------- every entry point, every field
#: A value other than the default for each field (what a client might send).
NON_DEFAULT = dict(max_tokens=7, temperature=0.5, top_k=3, top_p=0.9, min_p=0.05, presence_penalty=0.25,
                   frequency_penalty=-0.5, logit_bias={"5": 1.5}, repetition_penalty=1.3, no_repeat_ngram_size=3,
                   min_tokens=2, seed=11, stop=["\n\n", "END"], ignore_eos=True, stop_token_ids=[10, 46],
                   include_stop_str_in_output=True, logprobs=2, echo=True, n=2, best_of=3,
                   structured_outputs={"regex": "[a-z]+"}, sliding_window=True)


def test_the_server_accepts_every_field_and_passes_it_on():
    """A completions request carrying every SamplingParams field at a non-default value becomes
    the SamplingParams of exactly those values (the server's parsing of each field)."""
    pytest.importorskip("fastapi")
    import json

    from gpt2mha.serving.protocol import parse_request, sampling_params

    assert set(NON_DEFAULT) == set(FIELDS), "NON_DEFAULT must hold every field"
    body = parse_request(json.dumps({"prompt": "ROMEO:", **NON_DEFAULT}).encode())
    want = SamplingParams(**NON_DEFAULT)
    assert sampling_params(body) == want


def test_the_cli_accepts_every_field_and_passes_it_on():
    """``gpt2mha generate`` has a flag for every SamplingParams field, and its parsed line
    builds the SamplingParams of exactly those values (no torch needed to parse)."""
    from gpt2mha.cli import build_parser
    from gpt2mha.cli.generation import sampling_params_of

    flags = ["--max-new-tokens", "7", "--temperature", "0.5", "--top-k", "3", "--top-p", "0.9", "--min-p", "0.05",
             "--presence-penalty", "0.25", "--frequency-penalty", "-0.5", "--logit-bias", '{"5": 1.5}',
             "--seed", "11", "--stop", "\n\n", "--stop", "END", "--logprobs", "2", "--echo",
             "--num-samples", "2", "--best-of", "3", "--repetition-penalty", "1.3", "--no-repeat-ngram-size", "3",
             "--min-tokens", "2", "--ignore-eos", "--stop-token-ids", "10", "--stop-token-ids", "46",
             "--include-stop-str-in-output", "--regex", "[a-z]+", "--sliding-window"]
    args = build_parser().parse_args(["generate", "ROMEO:", *flags])
    want = SamplingParams(**NON_DEFAULT)
    assert sampling_params_of(args) == want


def test_a_field_added_to_sampling_params_reaches_every_rows_sampler_offline_and_in_the_cli(monkeypatch, one_thread):
    """A subclass of SamplingParams with one more field stands in for a field added to the class
    (the modules that read the class are pointed at it, nothing else changes): generate() takes
    it as a keyword, generate_with() and the scheduler (the server's loop) carry it to every
    row's sampler, and the CLI's parser, given its flag (the field's help text: the one line a
    new option adds there), builds it and runs it. Reference: the params each RowSampler is made
    with."""
    import dataclasses

    import torch

    import gpt2mha.cli as cli
    import gpt2mha.inference.generate as G
    import gpt2mha.inference.params as P
    from conftest import small_model
    from gpt2mha.inference.sampling import RowSampler
    from gpt2mha.inference.scheduler import Scheduler
    from gpt2mha.io.tokenizer import get_tokenizer

    @dataclasses.dataclass(frozen=True)
    class WithDummy(SamplingParams):
        dummy: int = 0

    seen, real = [], RowSampler.__init__

    def init(self, params, *args, **kwargs):
        seen.append(params)
        real(self, params, *args, **kwargs)
    monkeypatch.setattr(RowSampler, "__init__", init)
    for module in (G, P):
        monkeypatch.setattr(module, "SamplingParams", WithDummy)
    monkeypatch.setattr(P, "FIELDS", tuple(f.name for f in dataclasses.fields(WithDummy)))

    model = small_model(n_vocab=256)
    out = model.generate([[1, 2, 3], [4, 5]], 3, temperature=0, dummy=7)
    assert out.shape == (2, 6) and [type(p) for p in seen] == [WithDummy] * 2 and {p.dummy for p in seen} == {7}
    seen.clear()
    G.generate_with(model, torch.tensor([[1, 2, 3]]), WithDummy(max_tokens=2, n=2, seed=1, dummy=5))
    assert [p.dummy for p in seen] == [5, 5]
    seen.clear()
    sched = Scheduler(model, get_tokenizer("bytes"), max_batch=2, max_queue=0)
    sched.submit([[1, 2]], WithDummy(max_tokens=2, dummy=6), lambda *a: None)
    sched.run_until_idle()
    assert [p.dummy for p in seen] == [6]
    with pytest.raises(TypeError, match="unexpected keyword argument 'dumy'"):
        model.generate([[1, 2, 3]], 3, dumy=7)

    real_parser = cli.build_parser

    def parser():
        p = real_parser()
        sub = next(a for a in p._actions if a.__class__.__name__ == "_SubParsersAction")
        sub.choices["generate"].add_argument("--dummy", type=int, default=0, help="the new field")
        return p
    monkeypatch.setattr(cli, "build_parser", parser)
    seen.clear()
    assert cli.main(["generate", "ROMEO:", "--max-new-tokens", "2", "--dummy", "9", "--temperature", "0"]) == 0
    assert [(type(p), p.dummy) for p in seen] == [(WithDummy, 9)]
