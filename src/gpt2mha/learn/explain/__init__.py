"""``gpt2mha explain``: an interactive page that shows every step of GPT-2's multi-head
attention with the model's real numbers.

Parts: :mod:`.tensors` (the numbers, from the capture points), :mod:`.heads_view` (small
multiples and head roles), :mod:`.kv_steps` (sampling filters and KV-cache steps),
:mod:`.session` (one model and one sequence, answering the page), :mod:`.security` (the
per-launch token, Host and Origin checks), :mod:`.checker` (a learner's module checked in a
limited subprocess, under :mod:`.reaper`: no process it starts outlives the check),
:mod:`.app` (the FastAPI app and its server), :mod:`.export` (the page with one prompt's
numbers written to a folder that opens from disk). The page itself is
``static/`` (HTML, CSS and plain JavaScript; no build step, no network).
"""
