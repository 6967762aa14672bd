"""The errors of a bad sampling field and of a structured-output constraint: raised by
:mod:`.params` and :mod:`.structured` alike (so neither imports the other for them), a
ValueError naming the field, answered by the server as OpenAI's 400 with that ``param``."""


class ParamError(ValueError):
    """A :class:`~gpt2mha.inference.params.SamplingParams` field out of its range; :attr:`param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class GrammarError(ParamError):
    """A :class:`~gpt2mha.inference.params.StructuredOutputs` whose constraint is not one this server can compile (a bad
    JSON schema, regular expression or grammar, an unsupported keyword): :attr:`key` names the
    constraint (``json``, ``regex``, ``choice``, ``grammar``), :attr:`detail` says what is wrong,
    so that a caller can name its own field (a request's ``response_format``)."""

    def __init__(self, key: str, detail: str):
        super().__init__("structured_outputs", f"structured_outputs{'.' + key if key else ''}: {detail}")
        self.key, self.detail = key, detail
