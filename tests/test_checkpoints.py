"""Checkpoint loading/saving: key spellings, legacy buffers, hub path, strict checks, safe files."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import hf_random_gpt2
from gpt2mha import GPT2, GPT2Config
from gpt2mha.io.checkpoints import CheckpointError, load_pretrained


def logits_of(model, idx):
    with torch.no_grad():
        return model(idx).logits


def test_both_key_spellings_and_legacy_buffers(hf_checkpoint, tmp_path):
    hf, path = hf_checkpoint
    idx = torch.randint(0, 300, (1, 9))
    ref = logits_of(hf, idx)
    sd = load_file(os.path.join(path, "model.safetensors"))
    # OpenAI-converted spelling: no "transformer." prefix, plus the legacy attention buffers
    plain = {k.removeprefix("transformer."): v for k, v in sd.items()}
    for i in range(2):
        plain[f"h.{i}.attn.bias"] = torch.ones(1, 1, 64, 64).tril()
        plain[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    d = tmp_path / "plain"
    d.mkdir()
    shutil.copy(os.path.join(path, "config.json"), d)
    save_file(plain, str(d / "model.safetensors"))
    torch.testing.assert_close(logits_of(GPT2.from_pretrained(str(d)), idx), ref, atol=1e-4, rtol=1e-4)


def test_pytorch_model_bin_loads_with_weights_only(hf_checkpoint, tmp_path):
    hf, path = hf_checkpoint
    d = tmp_path / "bin"
    d.mkdir()
    shutil.copy(os.path.join(path, "config.json"), d)
    torch.save(hf.state_dict(), d / "pytorch_model.bin")
    idx = torch.randint(0, 300, (2, 5))
    torch.testing.assert_close(logits_of(GPT2.from_pretrained(str(d)), idx), logits_of(hf, idx), atol=1e-4, rtol=1e-4)


class Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/gpt2mha-pwned",))


def test_pickle_with_payload_is_refused(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint
    d = tmp_path / "evil"
    d.mkdir()
    shutil.copy(os.path.join(path, "config.json"), d)
    torch.save({"wte.weight": torch.zeros(3), "x": Payload()}, d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="refused"):
        GPT2.from_pretrained(str(d))
    assert not os.path.exists("/tmp/gpt2mha-pwned")


def test_mismatches_name_every_tensor_and_both_shapes(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint
    sd = load_file(os.path.join(path, "model.safetensors"))
    sd["transformer.h.0.attn.c_attn.weight"] = torch.zeros(48, 100)
    del sd["transformer.ln_f.bias"]
    sd["transformer.h.9.mlp.c_fc.weight"] = torch.zeros(2, 2)
    sd["transformer.wpe.weight"][3, 4] = float("nan")
    save_file(sd, os.path.join(path, "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        GPT2.from_pretrained(path)
    msg = str(e.value)
    assert "h.0.attn.c_attn.weight: checkpoint shape [48, 100] != model shape [48, 144]" in msg
    assert "missing tensor ln_f.bias" in msg and "unexpected tensor h.9.mlp.c_fc.weight" in msg
    assert "wpe.weight: contains NaN" in msg


def test_truncated_safetensors_names_the_file(hf_checkpoint):
    _, path = hf_checkpoint
    f = os.path.join(path, "model.safetensors")
    data = open(f, "rb").read()
    with open(f, "wb") as out:
        out.write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors: not a valid safetensors file"):
        GPT2.from_pretrained(path)


def test_directory_without_config_and_bad_configs(tmp_path, hf_checkpoint):
    with pytest.raises(CheckpointError, match="no config.json"):
        GPT2.from_pretrained(str(tmp_path))
    with pytest.raises(CheckpointError, match="not a directory"):
        GPT2.from_pretrained(str(tmp_path / "nope"))
    _, path = hf_checkpoint
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    for change, needle in [({"n_head": 0}, "n_head=0"), ({"n_head": 5}, "not divisible by n_head=5"),
                           ({"n_layer": -1}, "n_layer=-1"), ({"model_type": "llama"}, "model_type")]:
        json.dump({**cfg, **change}, open(cfg_path, "w"))
        with pytest.raises(CheckpointError, match=needle):
            GPT2.from_pretrained(path)


def test_hub_id_uses_huggingface_cache_offline(hf_checkpoint, tmp_path, monkeypatch):
    """A hub id resolves through huggingface_hub's real cache layout (offline mode, no network)."""
    hf, path = hf_checkpoint
    snap = tmp_path / "hub" / "models--someone--tiny-gpt2" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(path, name), snap)
    (tmp_path / "hub" / "models--someone--tiny-gpt2" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--tiny-gpt2" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    idx = torch.randint(0, 300, (1, 6))
    model = load_pretrained("someone/tiny-gpt2")
    torch.testing.assert_close(logits_of(model, idx), logits_of(hf, idx), atol=1e-4, rtol=1e-4)
    with pytest.raises(CheckpointError, match="HF_HUB_OFFLINE is set and it is not in the local cache"):
        load_pretrained("someone/not-cached")


def test_no_network_reads_only_the_cache_at_once(hf_checkpoint, tmp_path, monkeypatch):
    """Without HF_HUB_OFFLINE and without a network, huggingface_hub would retry for ~25 s;
    one failed TCP probe sends every download to the local cache at once (local_files_only)."""
    import socket

    import huggingface_hub
    import huggingface_hub.constants as c

    def no_network(*args, **kwargs):
        raise OSError("network is unreachable (test)")

    asked = []
    real = huggingface_hub.hf_hub_download

    def recording(repo_id, filename, **kwargs):
        asked.append(kwargs.get("local_files_only"))
        return real(repo_id, filename, **kwargs)

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", recording)
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(CheckpointError, match=r"cannot be reached and it is not in the local cache.*HF_HUB_OFFLINE=1"):
        load_pretrained("someone/not-cached")
    assert asked == [True]


def test_save_refuses_foreign_nonempty_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    m = GPT2(GPT2Config.from_preset("tiny"))
    with pytest.raises(FileExistsError, match="not a gpt2mha checkpoint"):
        m.save_pretrained(str(tmp_path))
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_wrong_dtype_and_inf_are_named(hf_checkpoint):
    _, path = hf_checkpoint
    f = os.path.join(path, "model.safetensors")
    sd = load_file(f)
    sd["transformer.h.1.ln_2.bias"] = torch.zeros(48, dtype=torch.int32)
    sd["transformer.h.0.mlp.c_proj.weight"][0, 0] = float("inf")
    save_file(sd, f)
    with pytest.raises(CheckpointError) as e:
        GPT2.from_pretrained(path)
    assert "h.1.ln_2.bias: dtype torch.int32 is not a floating-point type" in str(e.value)
    assert "h.0.mlp.c_proj.weight: contains NaN or inf" in str(e.value)


def test_duplicate_spellings_odd_configs_and_overflow(hf_checkpoint, tmp_path):
    hf, path = hf_checkpoint
    f = os.path.join(path, "model.safetensors")
    sd = load_file(f)
    dup = dict(sd, **{"ln_f.bias": sd["transformer.ln_f.bias"] + 1})
    save_file(dup, f)
    with pytest.raises(CheckpointError, match="ln_f.bias appears twice"):
        GPT2.from_pretrained(path)
    save_file(sd, f)
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    for change, needle in [({"layer_norm_epsilon": "1e-5"}, "layer_norm_epsilon='1e-5' must be a number"),
                           ({"attn_pdrop": None}, "attn_pdrop=None"), ({"gpt2mha": "x"}, "'gpt2mha' must be an object")]:
        json.dump({**cfg, **change}, open(cfg_path, "w"))
        with pytest.raises(CheckpointError, match=needle):
            GPT2.from_pretrained(path)
    old = {k: v for k, v in cfg.items() if k != "n_positions"}       # older configs say n_ctx
    json.dump({**old, "n_ctx": cfg["n_positions"]}, open(cfg_path, "w"))
    assert GPT2.from_pretrained(path).config.n_ctx == cfg["n_positions"]
    sd["transformer.h.0.ln_1.bias"][0] = 1e6                         # finite in fp32, inf in fp16
    save_file(sd, f)
    with pytest.raises(CheckpointError, match="h.0.ln_1.bias overflow torch.float16"):
        load_pretrained(path, dtype=torch.float16)


def test_a_user_config_that_only_mentions_gpt2mha_is_not_ours(tmp_path):
    (tmp_path / "config.json").write_text('"this is not gpt2mha\'s"')
    (tmp_path / "model.safetensors").write_bytes(b"user data")
    with pytest.raises(FileExistsError):
        GPT2(GPT2Config.from_preset("tiny")).save_pretrained(str(tmp_path))
    assert (tmp_path / "model.safetensors").read_bytes() == b"user data"


def test_local_directory_wins_over_a_builtin_name(tmp_path, monkeypatch, hf_checkpoint):
    import gpt2mha.io.checkpoints as ck

    hf, path = hf_checkpoint
    builtin = tmp_path / "models" / "same-name"
    builtin.mkdir(parents=True)
    GPT2(GPT2Config.from_preset("tiny")).save_pretrained(str(builtin))
    monkeypatch.setattr(ck, "MODELS_DIR", str(tmp_path / "models"))
    assert GPT2.from_pretrained("same-name").config.n_vocab == 256         # the built-in one
    monkeypatch.chdir(tmp_path)
    shutil.copytree(path, tmp_path / "same-name")
    assert GPT2.from_pretrained("same-name").config.n_vocab == 300         # ./same-name wins


def test_a_typo_of_a_builtin_name_is_named_without_asking_the_hub(monkeypatch):
    """`--model shakespeare` (a near miss of a built-in name) fails at once and suggests the
    built-in name, instead of retrying the hub offline for ~26 s and failing with no hint."""
    import gpt2mha.io.checkpoints as ck

    def no_hub(repo_id):
        raise AssertionError(f"the hub was asked for {repo_id!r}")

    monkeypatch.setattr(ck, "download", no_hub)
    for typo in ("shakespeare", "shakespeare-bytes", "Shakespeare-byte"):
        with pytest.raises(CheckpointError, match="did you mean 'shakespeare-byte'"):
            load_pretrained(typo)
    with pytest.raises(AssertionError, match="the hub was asked for 'gpt2'"):
        load_pretrained("gpt2")                                 # a real hub id still goes to the hub


# ---------------------------------------------------------------------- the LM head, fp16 saves
def test_untied_lm_head_in_a_tied_config_loads_as_transformers_does(hf_checkpoint, tmp_path):
    # transformers keeps an lm_head.weight that differs from wte.weight (it unties them, with a
    # warning); dropping it gave logits ~11 away. Reference: GPT2LMHeadModel on the same file.
    from transformers import GPT2LMHeadModel
    _, path = hf_checkpoint
    sd = load_file(os.path.join(path, "model.safetensors"))
    sd["lm_head.weight"] = torch.randn(300, 48, generator=torch.Generator().manual_seed(3))
    save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    idx = torch.randint(0, 300, (2, 7))
    ref = logits_of(GPT2LMHeadModel.from_pretrained(path).eval(), idx)
    with pytest.warns(UserWarning, match="lm_head.weight differs from wte.weight"):
        model = GPT2.from_pretrained(path)
    assert model.config.tie_word_embeddings is False
    torch.testing.assert_close(logits_of(model, idx), ref, atol=1e-4, rtol=1e-4)
    # and it round-trips: saved with tie_word_embeddings false and lm_head.weight, loaded by both
    model.save_pretrained(str(tmp_path / "untied"))
    assert json.load(open(tmp_path / "untied" / "config.json"))["tie_word_embeddings"] is False
    assert "lm_head.weight" in load_file(str(tmp_path / "untied" / "model.safetensors"))
    torch.testing.assert_close(logits_of(GPT2.from_pretrained(str(tmp_path / "untied")), idx), ref, atol=1e-4, rtol=1e-4)
    hf2 = GPT2LMHeadModel.from_pretrained(str(tmp_path / "untied")).eval()
    torch.testing.assert_close(logits_of(hf2, idx), ref, atol=1e-4, rtol=1e-4)


def test_untied_config_without_lm_head_is_a_named_error(hf_checkpoint):
    _, path = hf_checkpoint
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["tie_word_embeddings"] = False
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(CheckpointError, match=r"missing tensor lm_head.weight"):
        GPT2.from_pretrained(path)


def test_tied_weight_stored_only_as_lm_head_loads(hf_checkpoint, tmp_path):
    # safetensors.torch.save_model keeps one name per shared tensor (here lm_head.weight);
    # transformers loads such a file (checked here as the reference).
    from safetensors.torch import save_model
    from transformers import GPT2LMHeadModel
    hf, path = hf_checkpoint
    save_model(hf, os.path.join(path, "model.safetensors"))
    keys = load_file(os.path.join(path, "model.safetensors")).keys()
    assert "lm_head.weight" in keys and "transformer.wte.weight" not in keys
    idx = torch.randint(0, 300, (1, 6))
    ref = logits_of(GPT2LMHeadModel.from_pretrained(path).eval(), idx)
    torch.testing.assert_close(logits_of(hf, idx), ref)
    model = GPT2.from_pretrained(path)
    assert model.config.tie_word_embeddings is True
    torch.testing.assert_close(logits_of(model, idx), ref, atol=1e-4, rtol=1e-4)


def test_float16_save_of_a_weight_beyond_its_range_writes_nothing(tmp_path):
    model = GPT2(GPT2Config.from_preset("tiny"))
    with torch.no_grad():
        model.h[0].mlp.c_fc.weight[0, 0] = 1e5                 # > float16's max 65504
    d = tmp_path / "fp16"
    with pytest.raises(ValueError, match=r"h.0.mlp.c_fc.weight.*inf"):
        model.save_pretrained(str(d), dtype=torch.float16)
    assert not d.exists()
    model.save_pretrained(str(d), dtype=torch.bfloat16)          # bf16 holds it: saves and loads
    assert GPT2.from_pretrained(str(d)).h[0].mlp.c_fc.weight[0, 0].item() == torch.tensor(1e5).bfloat16().item()


# ------------------------------------------------------------------------------ sharded
def _shards(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith("model-") and n.endswith(".safetensors"))


def test_transformers_sharded_checkpoint_loads_with_the_same_logits(hf_checkpoint, tmp_path):
    """What transformers writes for large models (save_pretrained(max_shard_size=...)): an index
    and shards, read like one file."""
    hf, _ = hf_checkpoint
    d = str(tmp_path / "sharded")
    hf.save_pretrained(d, max_shard_size="100KB")
    assert os.path.isfile(os.path.join(d, "model.safetensors.index.json")) and len(_shards(d)) >= 3
    assert not os.path.exists(os.path.join(d, "model.safetensors"))
    idx = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits_of(GPT2.from_pretrained(d), idx), logits_of(hf, idx), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("max_shard_size", ["100KB", 120_000])
def test_save_pretrained_shards_that_transformers_loads(hf_checkpoint, tmp_path, max_shard_size):
    from transformers import GPT2LMHeadModel

    hf, path = hf_checkpoint
    d = str(tmp_path / "ours")
    GPT2.from_pretrained(path).save_pretrained(d, max_shard_size=max_shard_size)
    shards = _shards(d)
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    limit = 100_000 if max_shard_size == "100KB" else max_shard_size
    for name in shards:                                   # each at most the limit unless one tensor is larger
        tensors = load_file(os.path.join(d, name))
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= limit or len(tensors) == 1
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    assert set(index["weight_map"].values()) == set(shards) and index["metadata"]["total_size"] > 0
    idx = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(1))
    theirs = GPT2LMHeadModel.from_pretrained(d).eval()
    torch.testing.assert_close(logits_of(theirs, idx), logits_of(hf, idx), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits_of(GPT2.from_pretrained(d), idx), logits_of(hf, idx), atol=1e-4, rtol=1e-4)
    # saving again into the same directory replaces the earlier save's weight files, whichever form
    GPT2.from_pretrained(path).save_pretrained(d)
    assert _shards(d) == [] and not os.path.exists(os.path.join(d, "model.safetensors.index.json"))
    GPT2.from_pretrained(path).save_pretrained(d, max_shard_size=max_shard_size)
    assert _shards(d) == shards and not os.path.exists(os.path.join(d, "model.safetensors"))
    # everything fits in one shard: one model.safetensors, as transformers writes it
    e = str(tmp_path / "one")
    GPT2.from_pretrained(path).save_pretrained(e, max_shard_size="10MB")
    assert sorted(os.listdir(e)) == ["config.json", "generation_config.json", "model.safetensors"]


def test_max_shard_size_values():
    from gpt2mha.io.checkpoints import shard_size_bytes

    # huggingface_hub's units (what transformers' save_pretrained takes): decimal, 1 KB = 1000 bytes
    assert [shard_size_bytes(v) for v in ("10MB", "5GB", "500KB", "1TB", 1234)] == [10**7, 5 * 10**9, 5 * 10**5,
                                                                                     10**12, 1234]
    for bad in ("10 apples", "MB", 0, -5, True, 1.5):
        with pytest.raises(ValueError, match=r"max_shard_size="):
            shard_size_bytes(bad)
    with pytest.raises(ValueError, match="max_shard_size='lots'"):
        GPT2(GPT2Config.from_preset("tiny")).save_pretrained("/nonexistent/never-written", max_shard_size="lots")


def test_sharded_pytorch_model_bin_loads(hf_checkpoint, tmp_path):
    hf, path = hf_checkpoint
    d = tmp_path / "bin"
    d.mkdir()
    shutil.copy(os.path.join(path, "config.json"), d)
    sd = hf.state_dict()
    names = list(sd)
    parts = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
             "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
    for shard, keys in parts.items():
        torch.save({k: sd[k].clone() for k in keys}, d / shard)
    json.dump({"metadata": {}, "weight_map": {k: shard for shard, keys in parts.items() for k in keys}},
              open(d / "pytorch_model.bin.index.json", "w"))
    idx = torch.randint(0, 300, (2, 5))
    torch.testing.assert_close(logits_of(GPT2.from_pretrained(str(d)), idx), logits_of(hf, idx), atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_errors_name_the_shard_and_the_tensor(hf_checkpoint, tmp_path):
    hf, _ = hf_checkpoint
    d = str(tmp_path / "sharded")
    hf.save_pretrained(d, max_shard_size="100KB")
    index_path = os.path.join(d, "model.safetensors.index.json")
    index = json.load(open(index_path))
    shards = _shards(d)
    # a key in two shards
    first, second = (load_file(os.path.join(d, s)) for s in shards[:2])
    key = next(iter(second))
    save_file({**first, key: second[key]}, os.path.join(d, shards[0]), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"tensor {key} is in two shards, {shards[0]} and {shards[1]}"):
        GPT2.from_pretrained(d)
    save_file(first, os.path.join(d, shards[0]), metadata={"format": "pt"})
    GPT2.from_pretrained(d)
    # the index lists a tensor twice, or names a file outside the directory
    text = open(index_path).read()
    with open(index_path, "w") as f:
        f.write(text.replace('"weight_map": {', f'"weight_map": {{\n "{key}": "{shards[0]}",', 1))
    with pytest.raises(CheckpointError, match=f"tensor {key} is listed twice in weight_map"):
        GPT2.from_pretrained(d)
    json.dump({**index, "weight_map": {**index["weight_map"], key: "../elsewhere.safetensors"}}, open(index_path, "w"))
    with pytest.raises(CheckpointError, match="must name shard files in this directory"):
        GPT2.from_pretrained(d)
    json.dump(index, open(index_path, "w"))
    # a missing shard
    os.remove(os.path.join(d, shards[-1]))
    with pytest.raises(CheckpointError, match=f"missing shard {shards[-1]} \\(\\d+ tensors, e.g. "):
        GPT2.from_pretrained(d)


def test_sharded_checkpoint_from_the_hub_cache(hf_checkpoint, tmp_path, monkeypatch):
    """A hub repo holding an index and shards: the index is fetched, then each shard it names
    (here from huggingface_hub's real offline cache layout; no network)."""
    import huggingface_hub
    import huggingface_hub.constants as c

    hf, _ = hf_checkpoint
    src = str(tmp_path / "src")
    hf.save_pretrained(src, max_shard_size="100KB")
    snap = tmp_path / "hub" / "models--someone--sharded-gpt2" / "snapshots" / ("1" * 40)
    snap.mkdir(parents=True)
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), snap)
    (tmp_path / "hub" / "models--someone--sharded-gpt2" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--sharded-gpt2" / "refs" / "main").write_text("1" * 40)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    asked, real = [], huggingface_hub.hf_hub_download

    def recording(repo_id, filename, **kwargs):
        asked.append(filename)
        return real(repo_id, filename, cache_dir=str(tmp_path / "hub"), **kwargs)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", recording)
    idx = torch.randint(0, 300, (1, 6))
    torch.testing.assert_close(logits_of(load_pretrained("someone/sharded-gpt2"), idx), logits_of(hf, idx),
                               atol=1e-4, rtol=1e-4)
    assert asked == ["config.json", "model.safetensors", "model.safetensors.index.json"] + _shards(src)


# ------------------------------------- transformers' pipeline and AutoTokenizer on a saved directory
def random_bpe_model(n_vocab=50257, seed=0):
    """A small random GPT-2 BPE model (untied head, weights large enough for clear greedy choices)."""
    torch.manual_seed(seed)
    model = GPT2(GPT2Config(n_vocab=n_vocab, n_ctx=64, n_embd=32, n_head=4, n_layer=2, tokenizer="gpt2",
                            tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(std=0.3)
            else:
                p.normal_(mean=1.0 if ".ln" in "." + name and name.endswith("weight") else 0.0, std=0.1)
    return model


PROMPT = "To be, or not to be: that is the question"


@pytest.mark.parametrize("n_vocab", [50257, 50304])
def test_transformers_pipeline_generates_what_gpt2mha_generates(tmp_path, n_vocab, one_thread):
    """``pipeline("text-generation", model=DIR)`` on a directory gpt2mha saved gives the greedy
    text of ``gpt2mha generate PROMPT --temperature 0`` (the reference: gpt2mha's own CLI on the
    same directory; transformers runs its own GPT2LMHeadModel and the written tokenizer files).

    The rule for <|endoftext|>: generation_config.json names it eos_token_id (as
    openai-community/gpt2's), so transformers stops after it, as ``gpt2mha generate
    --stop-at-eos`` does; gpt2mha's default runs all --max-new-tokens, which the pipeline does
    with ``eos_token_id=None``. gpt2mha prints the token's text; the pipeline drops it unless
    ``skip_special_tokens=False``. The model is made to emit <|endoftext|> mid-way so both cases
    are seen. With n_vocab 50304 (rows past the 50257 BPE ids), those rows are made the largest
    logits: gpt2mha never samples them, and generation_config's suppress_tokens keeps
    transformers from doing so.
    """
    from transformers import AutoTokenizer, pipeline

    from conftest import cli_continuation, greedy_margin
    from gpt2mha.io.tokenizer import get_tokenizer

    tok, n = get_tokenizer("gpt2"), 12
    model = random_bpe_model(n_vocab)
    prompt_ids = tok.encode(PROMPT)
    with torch.no_grad():
        if n_vocab > 50257:                   # padding rows along ln_f's bias: the largest logits everywhere
            model.ln_f.bias.normal_(std=1.0)
            model.lm_head.weight[50257:] = 10 * model.ln_f.bias
        first = model.generate(torch.tensor([prompt_ids]), n, temperature=0, vocab_size=50257)[0].tolist()
        model.lm_head.weight[50256] = 1.2 * model.lm_head.weight[first[len(prompt_ids) + 4]]
    ids = model.generate(torch.tensor([prompt_ids]), n, temperature=0, vocab_size=50257)[0].tolist()
    new = ids[len(prompt_ids):]
    assert 50256 in new[1:-1], new                               # it stops early with --stop-at-eos
    assert greedy_margin(model, ids, len(prompt_ids), 50257) > 1e-3
    if n_vocab > 50257:
        with torch.no_grad():
            assert int(model(torch.tensor([prompt_ids])).logits[0, -1].argmax()) >= 50257
    d = str(tmp_path / "bpe")
    model.save_pretrained(d)
    assert AutoTokenizer.from_pretrained(d).encode(PROMPT) == prompt_ids
    assert GPT2.from_pretrained(d).config.tokenizer == "gpt2"

    full, stopped = cli_continuation(PROMPT, d, n), cli_continuation(PROMPT, d, n, "--stop-at-eos")
    assert full == tok.decode(new) and stopped == tok.decode(new[:new.index(50256) + 1])
    pipe = pipeline("text-generation", model=d)
    kw = dict(do_sample=False, max_new_tokens=n, return_full_text=False)
    assert pipe(PROMPT, eos_token_id=None, skip_special_tokens=False, **kw)[0]["generated_text"] == full
    assert pipe(PROMPT, skip_special_tokens=False, **kw)[0]["generated_text"] == stopped
    assert pipe(PROMPT, **kw)[0]["generated_text"] == stopped.removesuffix("<|endoftext|>")


def test_save_pretrained_writes_the_tokenizer_of_the_model_and_removes_stale_files(tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    from gpt2mha.io.checkpoints import save_pretrained

    d = str(tmp_path / "m")
    small = dict(n_ctx=32, n_embd=16, n_head=2, n_layer=1)
    written = save_pretrained(GPT2(GPT2Config(n_vocab=50304, tokenizer="gpt2", **small)), d)
    assert [os.path.basename(p) for p in written] == [
        "config.json", "generation_config.json", "merges.txt", "model.safetensors", "special_tokens_map.json",
        "tokenizer.json", "tokenizer_config.json", "vocab.json"]
    assert sorted(os.listdir(d)) == sorted(os.path.basename(p) for p in written)
    gen = GenerationConfig.from_pretrained(d)
    assert gen.eos_token_id == gen.pad_token_id == 50256 and gen.suppress_tokens == list(range(50257, 50304))
    assert AutoTokenizer.from_pretrained(d).model_max_length == 32
    # a byte model saved over it: the BPE-only files go, the byte tokenizer is read
    save_pretrained(GPT2(GPT2Config.from_preset("tiny")), d)
    assert sorted(os.listdir(d)) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                                     "tokenizer_config.json"]
    assert AutoTokenizer.from_pretrained(d).encode("é") == [0xC3, 0xA9]
    assert GenerationConfig.from_pretrained(d).eos_token_id is None
    assert GPT2.from_pretrained(d).config.tokenizer == "bytes"
    # a test model with fewer ids than GPT-2's BPE gets no tokenizer (it could not read its ids)
    save_pretrained(GPT2(GPT2Config(n_vocab=300, tokenizer="gpt2", **small)), d)
    assert sorted(os.listdir(d)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert GPT2.from_pretrained(d).config.tokenizer == "gpt2"


# ----------------------------------------------------------- dtype names and config mismatches
def test_dtype_given_as_text_and_config_size_mismatch_summary(hf_checkpoint):
    _, path = hf_checkpoint
    assert GPT2.from_pretrained(path, dtype="bf16").wte.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"dtype='bf17'; expected a floating torch dtype or one of"):
        GPT2.from_pretrained(path, dtype="bf17")
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    json.dump({**cfg, "n_embd": 64}, open(cfg_path, "w"))
    with pytest.raises(CheckpointError) as e:
        GPT2.from_pretrained(path)
    first = str(e.value).splitlines()[0]
    assert "config.json says n_embd=64 but the weights have n_embd=48 (wte.weight [300, 48])" in first
    assert len(str(e.value).splitlines()) <= 12                    # not 28 shape lines
