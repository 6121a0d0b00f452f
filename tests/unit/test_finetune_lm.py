"""The language-model job's own parts: sharded checkpoints across world sizes, fine-tuning from a
save_pretrained folder, and its bad input (the job alone, published and resumed: test_harness)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_harness import REPO, job

TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def torchrun(n: int, *args: str) -> str:
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node", str(n),
                           "tests/unit/reshard_check.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
                                                       "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("world ")]
    return line


def test_a_sharded_checkpoint_of_two_ranks_loads_whole_on_one_and_on_three(tmp_path):
    saved = torchrun(2, "save", str(tmp_path / "ckpt"))
    parts = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert parts == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # each rank wrote its own part
    want = saved.split(" ", 2)[2]  # the whole model and optimizer state, as rank 0 gathered it
    for n in (1, 3):
        assert torchrun(n, "load", str(tmp_path / "ckpt")) == f"world {n} {want}"


def test_the_blocks_to_shard_are_found_in_any_architecture():
    """The class the architecture names (Llama's, GPT-2's), else its list of layers (BioGPT and CTRL
    name none); a model with neither has none, and sharding it is one line."""
    from transformers import AutoModelForCausalLM, BioGptConfig, CTRLConfig, GPT2Config, LlamaConfig

    from trainkit import sharding
    from trainkit.errors import UserError

    small = {"vocab_size": 64}
    for config, layers, name in [
        (LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                     **small), 3, "LlamaDecoderLayer"),
        (GPT2Config(n_layer=2, n_embd=16, n_head=2, **small), 2, "GPT2Block"),
        (BioGptConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      **small), 2, "BioGptDecoderLayer"),
        (CTRLConfig(n_layer=2, n_embd=16, n_head=2, dff=32, **small), 2, "EncoderLayer"),
    ]:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        found = sharding.blocks(model, layers)
        assert [type(b).__name__ for b in found] == [name] * layers, (type(model).__name__, found)
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert sharding.blocks(plain, 2) == []
    with pytest.raises(UserError, match=r"the model \(Sequential\) names no transformer blocks"):
        sharding.shard(plain, [], bf16=False)


def test_ddp_replicas_of_the_small_model_under_torchrun(tmp_path):
    """--strategy ddp (a whole replica per process, the replicas checked equal after the epoch),
    --size small and --val-fraction, under torchrun's two processes."""
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node", "2", "jobs/finetune_lm.py",
                           "--strategy", "ddp", "--size", "small", "--val-fraction", "0.25",
                           "--limit", "8192", "--batch-size", "8", "--epochs", "1", "--samples", "0",
                           "--name", "ddp", "--tracking", "off"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path),
                               "DLC_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    described = "a small llama built from its config (4 blocks, width 256), ddp;"
    assert described in proc.stdout, proc.stdout[-2000:]
    assert "64 blocks of 128" in proc.stdout and "FSDP2" not in proc.stdout
    m = json.loads((tmp_path / "models" / "ddp" / "manifest.json").read_text())
    assert m["strategy"] == "ddp" and m["launcher"] == "torchrun" and m["world_size"] == 2
    assert m["replicas_in_sync"] is True and "sharded" not in m and m["parity"]["max_abs_diff"] <= 1e-4
    # 48 of the 64 blocks train (a quarter held out): 24 a process, three batches of 8
    assert m["metrics"]["train_iters"] == 3 and m["metrics"]["world_size"] == 2


def tiny_folder(folder: Path, vocab: int = 260) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=64, use_cache=False))
    model.save_pretrained(folder)
    return folder


TEXTS = ["The quick brown fox jumps over the lazy dog. " * 40,
         "Pack my box with five dozen liquor jugs. How vexingly quick daft zebras jump! " * 20]


def gpt2_folder(folder: Path, layers: int = 3) -> Path:
    """A GPT-2-shaped model of one's own: `layers` blocks, width 64, no dropout (training's loss is
    then the model's own), and a byte-level BPE tokenizer of at most 600 tokens trained on the spot,
    saved together with save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, GPT2Config, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    tokenizer.save_pretrained(folder)
    torch.manual_seed(1)
    eos = tokenizer.eos_token_id
    model = AutoModelForCausalLM.from_config(GPT2Config(
        vocab_size=600, n_layer=layers, n_embd=64, n_head=4, n_positions=128, bos_token_id=eos,
        eos_token_id=eos, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    model.save_pretrained(folder)
    return folder


def test_fine_tuning_a_gpt2_of_ones_own_starts_from_its_weights_and_tokenizer(tmp_path):
    """Another architecture than the built-in Llama, from its save_pretrained folder with its own
    tokenizer; --accumulate 2 over two batches that hold the whole training set, so the epoch's loss
    is the folder's weights' own, before the one optimizer step (a step after the first batch would
    change the second's loss); --activation-checkpointing on. The run describes and signs itself
    with the model's real blocks and width, and a resume with a model of another size is refused."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainkit import data, text

    weights = gpt2_folder(tmp_path / "weights")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(TEXTS[0])
    (corpus / "b.jsonl").write_text(json.dumps({"text": TEXTS[1]}) + "\n")
    tokenizer = text.FolderTokenizer(weights)
    ids = text.tokenize(text.folder_documents(corpus), tokenizer, cache=tmp_path / "cache")
    blocks = ids[: len(ids) // 32 * 32].reshape(-1, 32).astype(np.int64)
    train, _ = data.split_indices(len(blocks), 0.05)
    assert len(train) >= 4, len(train)
    run = job("finetune_lm", "--model", str(weights), "--data", str(corpus), "--block-size", "32",
              "--batch-size", str((len(train) + 1) // 2), "--accumulate", "2", "--activation-checkpointing",
              "--epochs", "1", "--samples", "1", "--name", "ft", "--tracking", "off", home=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    described = f"{weights.resolve()} (3 blocks, width 64), fsdp; text in {corpus}"
    assert described in run.stdout, run.stdout[-3000:]
    assert f"tokenizer folder:{weights.resolve()}" in run.stdout
    assert "[finetune_lm] activation checkpointing: each block's activations recomputed" in run.stdout
    m = json.loads((tmp_path / "models" / "ft" / "manifest.json").read_text())
    with torch.no_grad():
        x = torch.from_numpy(blocks[train])
        own = AutoModelForCausalLM.from_pretrained(weights)(input_ids=x, labels=x).loss.item()
    assert m["metrics"]["loss"] == pytest.approx(own, abs=1e-5), (m["metrics"]["loss"], own)
    assert m["metrics"]["train_iters"] == 2 and m["model_source"] == str(weights.resolve())
    assert m["parity"]["max_abs_diff"] <= 1e-4 and m["inputs"][0]["shape"] == ["batch", "sequence"]
    assert len(m["samples"]) == 1 and re.search(r"\[finetune_lm\] sample: '.+' -> ", run.stdout)
    meta = json.loads((tmp_path / "runs" / "ft" / "checkpoint_000001" / "meta.json").read_text())
    assert meta["signature"] | {"model": None} == {"model": None, "model_type": "gpt2", "vocab_size": 600,
                                                   "hidden_size": 64, "layers": 3, "block_size": 32}
    # the published folder is the fine-tuned model with its tokenizer: its logits are the ONNX model's
    import onnxruntime as ort

    published = tmp_path / "models" / "ft" / "pretrained"
    tuned = AutoModelForCausalLM.from_pretrained(published)
    assert type(tuned).__name__ == "GPT2LMHeadModel"
    assert AutoTokenizer.from_pretrained(published).encode(TEXTS[1][:40]) == tokenizer.encode(TEXTS[1][:40])
    onnx = ort.InferenceSession(str(tmp_path / "models" / "ft" / "model.onnx"))
    with torch.no_grad():
        want = tuned(input_ids=x[:2]).logits.numpy()
    got = onnx.run(None, {"input_ids": x[:2].numpy()})[0]
    assert np.abs(got - want).max() <= 1e-4
    # the same folder, now a GPT-2 of 2 blocks: the run's checkpoint does not fit it, one line
    before = sorted(p.name for p in (tmp_path / "runs" / "ft").iterdir())
    gpt2_folder(weights, layers=2)
    again = job("finetune_lm", "--model", str(weights), "--data", str(corpus), "--block-size", "32",
                "--epochs", "2", "--name", "ft", "--tracking", "off", home=tmp_path)
    assert again.returncode == 2, again.stdout[-2000:] + again.stderr[-3000:]
    assert again.stderr.strip().splitlines()[-1] == (
        "finetune_lm: error: run ft was trained with other shapes than asked (layers 3 -> 2); resume it "
        "with its own flags, or use another --name for a new run")
    assert sorted(p.name for p in (tmp_path / "runs" / "ft").iterdir()) == before


@pytest.mark.parametrize("case", ["missing", "no weights", "empty corpus", "block too long",
                                  "vocabulary too small"])
def test_bad_model_or_corpus_is_one_line_before_training(tmp_path, case):
    weights, corpus = tmp_path / "weights", tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "empty.txt").write_text("" if case == "empty corpus" else "some text " * 100)
    if case in ("no weights", "block too long", "vocabulary too small"):
        # no tokenizer in the folder: bytes, 257 ids, more than a vocabulary of 200 holds
        tiny_folder(weights, vocab=200 if case == "vocabulary too small" else 260)
    if case == "no weights":
        (weights / "model.safetensors").unlink()
    args = ["--model", str(weights)] if case != "empty corpus" else []
    if case == "block too long":
        args += ["--block-size", "100"]  # the model has 64 positions
    run = job("finetune_lm", *args, "--data", str(corpus), "--name", "bad", "--tracking", "off",
              home=tmp_path)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    want = {"missing": f"--model {weights}: no such folder; give a folder written by save_pretrained",
            "no weights": f"--model {weights}: no weights in it (model.safetensors, pytorch_model.bin)",
            "empty corpus": f"--data {corpus}: no text in it",
            "block too long": "--block-size 100 is longer than the model's 64 positions; use "
                              "--block-size <= 64",
            "vocabulary too small": f"--model {weights}: its vocabulary (200) is smaller than its "
                                    "tokenizer's (bytes: 257); save the model's own tokenizer beside "
                                    "it"}[case]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"finetune_lm: error: {want}"), last
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr[-2000:]  # one line, no traceback
    assert "epoch 1" not in run.stdout and not (tmp_path / "runs" / "bad").exists()


def test_the_models_shape_is_read_through_its_architectures_own_names():
    """A GPT-2 config's dict holds n_layer, n_embd and n_positions: the run's description, its
    checkpoint signature and the block-size check read them as a Llama's are read (a differently
    sized GPT-2's checkpoint would otherwise pass the signature and fail later in DCP)."""
    from transformers import GPT2Config, LlamaConfig

    sys.path.insert(0, str(REPO / "jobs"))
    import finetune_lm

    gpt2 = GPT2Config(vocab_size=600, n_layer=3, n_embd=64, n_head=4, n_positions=128).to_dict()
    assert "num_hidden_layers" not in gpt2 and "hidden_size" not in gpt2
    assert finetune_lm.model_shape(gpt2) == {"layers": 3, "hidden_size": 64, "positions": 128}
    llama = LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, max_position_embeddings=64).to_dict()
    assert finetune_lm.model_shape(llama) == {"layers": 2, "hidden_size": 32, "positions": 64}
