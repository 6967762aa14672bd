"""gpt2mha against Hugging Face transformers on a CUDA device, side by side in one run:
``python benchmarks/cuda_decode.py [--rounds 3] [--new 128] [--json FILE]`` (needs a GPU).

GPT-2 124M with random weights (``init_weights(0)``), the same weights in both libraries (ours
saved with ``save_pretrained`` and read by transformers' ``GPT2LMHeadModel``), float32 (TF32 off)
and bf16. Printed: greedy decode tokens/s at batch 1 and 8 (a 4-token prompt, ``--new`` new tokens,
``model.generate`` against transformers' ``generate`` with its KV cache, ``do_sample=False``),
prefill of 512 tokens (ms, one forward), the best of ``--rounds`` with the libraries taking turns,
and the ratio ours / transformers. Whether both chose the same greedy tokens is printed too.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_decode.py: no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    from transformers import GPT2LMHeadModel

    from gpt2mha import GPT2, GPT2Config

    ours = GPT2(GPT2Config.from_preset("124M")).eval()
    ours.init_weights(0)
    with tempfile.TemporaryDirectory() as d:
        ours.save_pretrained(d)
        hf = GPT2LMHeadModel.from_pretrained(d).eval()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        mo, mh = ours.to("cuda", dtype), hf.to("cuda", dtype)
        for B in (1, 8):
            idx = torch.randint(0, 50257, (B, 4), generator=torch.Generator().manual_seed(B)).cuda()
            n = B * (4 + a.new)
            run_o = lambda: mo.generate(idx, a.new, temperature=0)                       # noqa: E731
            run_h = lambda: mh.generate(idx, max_new_tokens=a.new, min_new_tokens=a.new,  # noqa: E731
                                        do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(idx))
            same = torch.equal(run_o(), run_h())                                          # warm-up too
            t_o = min(timed(run_o) for _ in range(a.rounds))
            t_h = min(timed(run_h) for _ in range(a.rounds))
            rows.append(dict(figure=f"decode b{B}", dtype=str(dtype)[6:], ours=n / t_o, transformers=n / t_h,
                             unit="tok/s", ratio=t_h / t_o, same_tokens=same))
        idx = torch.randint(0, 50257, (1, 512), generator=torch.Generator().manual_seed(5)).cuda()
        with torch.no_grad():
            run_o, run_h = lambda: mo(idx), lambda: mh(idx)                               # noqa: E731
            run_o(), run_h()
            t_o = min(timed(run_o) for _ in range(a.rounds))
            t_h = min(timed(run_h) for _ in range(a.rounds))
        rows.append(dict(figure="prefill 512", dtype=str(dtype)[6:], ours=1e3 * t_o, transformers=1e3 * t_h,
                         unit="ms", ratio=t_h / t_o, same_tokens=None))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for r in rows:
        print(f"{r['figure']:12s} {r['dtype']:9s} ours {r['ours']:9.1f} {r['unit']:5s} transformers "
              f"{r['transformers']:9.1f}  ours/transformers speed {r['ratio']:.2f}x  same tokens {r['same_tokens']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(benchmark="cuda_decode", device=torch.cuda.get_device_name(), torch=torch.__version__,
                           date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           command="python benchmarks/cuda_decode.py --json FILE",
                           source="written by benchmarks/cuda_decode.py --json", rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
