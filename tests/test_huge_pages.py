"""gpt2mha.inference.huge_pages: the weights' memory collapsed into 2 MB pages changes no value, no
address and no result; only where the kernel can (Linux 6.1+, THP not off) is the memory then in
huge pages, read back from the kernel's own account (/proc/self/smaps' AnonHugePages)."""

import mmap

import pytest
import torch

from gpt2mha import GPT2, GPT2Config
from gpt2mha.core.kv_cache import KVCache
from gpt2mha.inference import huge_pages
from gpt2mha.inference.quant import gemv

MB = 1 << 20


def test_collapse_keeps_every_value_and_address_and_counts_what_the_kernel_mapped(monkeypatch):
    monkeypatch.delenv("GPT2MHA_HUGE_PAGES", raising=False)
    # x: 20 MB on 2 MiB boundaries in a mapping of its own, so every block collapse asks for lies
    # whole inside one mapping (torch's allocator gives no such promise: a block that reaches past a
    # mapping's end is skipped by the kernel, and madvise still says yes)
    hp = huge_pages.HUGE_PAGE
    mm = mmap.mmap(-1, 12 * hp, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -torch.frombuffer(mm, dtype=torch.uint8, count=1).data_ptr() % hp
    x = torch.frombuffer(mm, dtype=torch.float32, count=10 * hp // 4, offset=start)   # its storage: these 20 MB
    x.copy_(torch.randn(x.numel(), generator=torch.Generator().manual_seed(0)))
    assert huge_pages.blocks([x], min_bytes=0) == [x.data_ptr() // hp + i for i in range(10)]
    want, ptr = x.clone(), x.data_ptr()
    done = huge_pages.collapse([x], min_bytes=0)
    assert x.data_ptr() == ptr and torch.equal(x, want)
    assert done % hp == 0 and done <= 10 * hp             # at most x's 10 blocks
    if huge_pages.why_not():
        assert done == 0
        return
    assert huge_pages.huge_bytes(x) >= done                 # the kernel's own count of what it mapped
    assert huge_pages.collapse([x], min_bytes=0) == 0       # asked once: not again
    x.add_(1)                                               # still ordinary writable memory
    assert torch.equal(x, want + 1)
    del x, want


def test_small_tensors_and_the_switch_off_are_left_alone(monkeypatch):
    small = torch.randn(1000)
    assert huge_pages.blocks([small]) == [] and huge_pages.collapse([small]) == 0
    assert huge_pages.collapse_in_background([small]) is None
    monkeypatch.setenv("GPT2MHA_HUGE_PAGES", "0")
    big = torch.randn(2 * MB)
    assert huge_pages.why_not() == "GPT2MHA_HUGE_PAGES=0"
    assert huge_pages.collapse([big]) == 0 and huge_pages.collapse_in_background([big]) is None


def test_blocks_cover_each_storage_from_its_first_to_its_last_byte():
    x = torch.empty(3 * MB, dtype=torch.uint8)
    lo, hi = x.data_ptr(), x.data_ptr() + x.numel() - 1
    got = huge_pages.blocks([x[5:7]])                     # a view: its whole storage
    assert got == list(range(lo // huge_pages.HUGE_PAGE, hi // huge_pages.HUGE_PAGE + 1))
    assert huge_pages.blocks([x], min_bytes=4 * MB) == []


@pytest.mark.skipif(not gemv.available(), reason="the C++ kernels are not built")
def test_native_step_collapses_its_weights_beside_the_decode_and_the_logits_stay_the_same(monkeypatch):
    monkeypatch.delenv("GPT2MHA_HUGE_PAGES", raising=False)
    from gpt2mha.inference.native import NativeStep, native_step
    torch.manual_seed(0)
    cfg = GPT2Config(n_vocab=20000, n_ctx=64, n_embd=128, n_layer=2, n_head=4)   # wte: 10 MB
    model = GPT2(cfg).eval()
    tokens = torch.randint(0, cfg.n_vocab, (2, 9), generator=torch.Generator().manual_seed(1))

    def logits(step):
        cache = KVCache(cfg.n_layer, 2, cfg.n_head, 16, cfg.n_embd // cfg.n_head)
        out = [step(tokens[:, :7], cache)]
        out += [step(tokens[:, t:t + 1], cache) for t in (7, 8)]
        return torch.stack(out)

    with torch.inference_mode():
        plain = logits(NativeStep(model))                 # NativeStep itself collapses nothing
    step = native_step(model)
    if huge_pages.why_not() or step.huge_pages is None:
        assert step.huge_pages is None
        pytest.skip(f"no huge pages here: {huge_pages.why_not() or 'blocks asked for before'}")
    step.huge_pages.join(60)
    assert not step.huge_pages.is_alive() and step.huge_pages.bytes is not None
    assert set(huge_pages.blocks([model.wte.weight])) <= huge_pages._done     # wte's memory was asked for
    with torch.inference_mode():
        assert torch.equal(logits(step), plain)           # the same memory, the same bits
    assert native_step(model) is step                     # kept, and not collapsed again


def test_a_child_forked_while_a_thread_holds_the_lock_does_not_wait_for_it():
    # found by a break-it review: fork() copies a held lock, held for ever in the child
    import os
    import signal
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    with huge_pages._lock:
        pid = os.fork()
        if pid == 0:                                      # the child: must not block on the copied lock
            signal.alarm(30)                              # a hang ends as SIGALRM: a failure, not a stuck run
            try:
                huge_pages.why_not()
                huge_pages.collapse([torch.randn(1000)], min_bytes=0)
            finally:
                os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_tensors_without_a_storage_are_skipped_not_refused():
    sparse = torch.eye(2000).to_sparse()
    assert huge_pages.blocks([sparse], min_bytes=0) == [] and huge_pages.collapse([sparse]) == 0
