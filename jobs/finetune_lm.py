"""Fine-tune a causal language model (Hugging Face Transformers) with FSDP2, sharded checkpoints.

Each transformer block and the root are sharded across the workers (`fully_shard`: parameters,
gradients and optimizer state split N ways); every epoch is a torch.distributed.checkpoint folder
each worker writes its part of, which a run restarted on fewer (or more) workers resumes from.
The result is the model in `save_pretrained` layout (what serving stacks load) beside a verified
ONNX export of its forward pass (token ids -> logits). The same file trains on the cluster, under
torchrun and in one process:

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python jobs/finetune_lm.py
    torchrun --nproc_per_node 2 jobs/finetune_lm.py --epochs 1 --limit 20000
    python jobs/finetune_lm.py --model /shared/weights/my-model --data /shared/corpus

With no --model, a small model built from a config trains from scratch on bytes (no weights, no
tokenizer files); with no --data, on the installed packages' licence texts.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from trainkit import data, flags, sharding, text
from trainkit.contract import Exported
from trainkit.errors import UserError
from trainkit.job import run_from_command_line
from trainkit.torch_loop import TorchJob

# models built from a config (no --model): a Llama-style decoder (RMSNorm, rotary positions,
# SwiGLU), small enough for a CPU
SIZES = {
    "tiny": {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4},
    "small": {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8},
}
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
           "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class LMConfig:
    model_dir: str | None  # a save_pretrained folder, or None: built from SIZES[size]
    size: str
    model_config: dict  # the model's config.json as a dict (what a checkpoint must match)
    tokenizer: str  # "bytes" or the model folder
    corpus: text.Corpus
    train: list[int]  # block indices
    val: list[int]
    strategy: str  # "fsdp" | "ddp"
    precision: str  # "auto" | "bf16" | "fp32"
    activation_checkpointing: bool
    accumulate: int
    samples: int


class Blocks(Dataset):
    def __init__(self, blocks: np.ndarray, indices: list[int]):
        self.blocks, self.indices = blocks, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.blocks[self.indices[i]].astype(np.int64))


class Logits(nn.Module):
    """The exported forward pass: token ids -> next-token logits, no cache."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits


def model_shape(model_config: dict) -> dict:
    """Blocks, width and positions of any Transformers architecture, read through its config class's
    own attribute names (GPT-2's config holds n_layer, n_embd and n_positions where Llama's holds
    num_hidden_layers, hidden_size and max_position_embeddings; the class maps one to the other)."""
    from transformers import AutoConfig

    c = dict(model_config)
    config = AutoConfig.for_model(c.pop("model_type"), **c)
    return {"layers": getattr(config, "num_hidden_layers", None),
            "hidden_size": getattr(config, "hidden_size", None),
            "positions": getattr(config, "max_position_embeddings", None)}


def check_model_dir(folder: Path) -> None:
    """A save_pretrained folder: its config and its weights, or one line naming what is missing."""
    if not folder.is_dir():
        raise UserError(f"--model {folder}: no such folder; give a folder written by save_pretrained "
                        "(config.json and model.safetensors), or leave --model out to train from scratch")
    if not (folder / "config.json").is_file():
        raise UserError(f"--model {folder}: no config.json in it; give the whole save_pretrained folder")
    if not any((folder / w).is_file() for w in WEIGHTS):
        raise UserError(f"--model {folder}: no weights in it ({', '.join(WEIGHTS[::2])}); copy the "
                        "whole save_pretrained folder, or leave --model out to train from scratch")


class FinetuneLM(TorchJob[LMConfig]):
    name = "finetune_lm"
    description = __doc__.split("\n\n")[0]
    packages = ("transformers", "onnxscript")
    batch_size, epochs, lr = 16, 1, 3e-4
    worker_help = "workers (one process each), sharing the model's parameters (FSDP2) or replicas (DDP)"
    distributed_checkpoint = True

    def add_flags(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", default=None,
                       help="a save_pretrained folder (config.json, model.safetensors, its tokenizer "
                            "files if any) to fine-tune, on storage every node sees; default: a model "
                            "built from --size, trained from scratch on bytes")
        p.add_argument("--size", choices=sorted(SIZES), default="tiny",
                       help="the model built when no --model is given")
        p.add_argument("--data", default=None,
                       help="a folder of .txt files and .jsonl files (one {\"text\": ...} per line); "
                            "default: the installed packages' licence texts")
        p.add_argument("--block-size", type=flags.positive_int, default=128,
                       help="tokens per training sequence")
        p.add_argument("--limit", type=flags.positive_int, default=None,
                       help="use only the first N tokens of the corpus")
        p.add_argument("--val-fraction", type=flags.fraction, default=0.05,
                       help="share of the blocks held out for validation and the ONNX check")
        p.add_argument("--strategy", choices=("fsdp", "ddp"), default="fsdp",
                       help="fsdp: parameters, gradients and optimizer state sharded (FSDP2); ddp: "
                            "a whole replica per worker (for comparison)")
        p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                       help="auto: bfloat16 compute on GPUs that support it, float32 elsewhere")
        p.add_argument("--activation-checkpointing", action="store_true",
                       help="recompute each block's activations in the backward pass (less memory, "
                            "more compute)")
        p.add_argument("--accumulate", type=flags.positive_int, default=1,
                       help="batches whose gradients add up before each optimizer step")
        p.add_argument("--samples", type=int, default=3,
                       help="lines of text the trained model writes at the end (log and manifest)")

    def prepare(self, args) -> LMConfig:
        from transformers import AutoConfig, LlamaConfig

        model_dir = Path(args.model).expanduser().resolve() if args.model else None
        if model_dir is not None:
            check_model_dir(model_dir)
        tokenizer = text.tokenizer_for(model_dir)
        if model_dir is not None:
            model_config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True).to_dict()
        else:
            model_config = LlamaConfig(vocab_size=tokenizer.vocab_size, use_cache=False,
                                       max_position_embeddings=args.block_size, **SIZES[args.size]).to_dict()
        vocab = model_config.get("vocab_size") or 0
        if vocab < tokenizer.vocab_size:
            raise UserError(f"--model {model_dir}: its vocabulary ({vocab}) is smaller than its "
                            f"tokenizer's ({tokenizer.name}: {tokenizer.vocab_size}); save the model's "
                            "own tokenizer beside it (save_pretrained)")
        positions = model_shape(model_config)["positions"]
        if positions and args.block_size > positions:
            raise UserError(f"--block-size {args.block_size} is longer than the model's "
                            f"{positions} positions; use --block-size <= {positions}")
        corpus = text.corpus(args.data, tokenizer, args.block_size, args.limit)
        train, val = data.split_indices(len(corpus.blocks), args.val_fraction)
        return LMConfig(str(model_dir) if model_dir else None, args.size, model_config, tokenizer.name,
                        corpus, train, val, args.strategy, args.precision, args.activation_checkpointing,
                        args.accumulate, max(0, args.samples))

    def describe(self, config: LMConfig) -> str:
        c, shape = config.model_config, model_shape(config.model_config)
        model = config.model_dir or f"a {config.size} {c.get('model_type')} built from its config"
        return (f"{model} ({shape['layers']} blocks, width {shape['hidden_size']}), "
                f"{config.strategy}; {config.corpus.describe()}, tokenizer {config.tokenizer}")

    def train_size(self, config: LMConfig) -> int:
        return len(config.train)

    def signature(self, config: LMConfig) -> dict:
        c, shape = config.model_config, model_shape(config.model_config)
        return {"model": config.model_dir or config.size, "model_type": c.get("model_type"),
                "vocab_size": c.get("vocab_size"), "hidden_size": shape["hidden_size"],
                "layers": shape["layers"], "block_size": int(config.corpus.blocks.shape[1])}

    def model(self, config: LMConfig) -> nn.Module:
        from transformers import AutoConfig, AutoModelForCausalLM

        if config.model_dir:
            model = AutoModelForCausalLM.from_pretrained(config.model_dir, local_files_only=True,
                                                         dtype=torch.float32)
        else:
            c = dict(config.model_config)
            with torch.random.fork_rng():  # the same start on every rank, whatever its seed
                torch.manual_seed(0)
                model = AutoModelForCausalLM.from_config(AutoConfig.for_model(c.pop("model_type"), **c))
        model.config.use_cache = False
        return model

    def shard(self, model: nn.Module, world, config: LMConfig) -> bool:
        self.bf16 = config.precision == "bf16" or (
            config.precision == "auto" and world.use_gpu and torch.cuda.is_bf16_supported())
        if config.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if world.rank == 0 and model.is_gradient_checkpointing:
                self.say("activation checkpointing: each block's activations recomputed in the backward pass")
        if config.strategy != "fsdp" or not world.grouped:  # one process: nothing to shard over
            if world.rank == 0 and self.bf16:
                who = config.strategy if world.grouped else "one process"
                self.say(f"{who}: bfloat16 compute (autocast)")
            return False
        blocks = sharding.shard(model, sharding.blocks(model, model_shape(config.model_config)["layers"]),
                                self.bf16)
        if world.rank == 0:
            self.say(f"FSDP2: {blocks} blocks and the root sharded over {world.size} workers"
                     + (", bfloat16 compute" if self.bf16 else ""))
        return True

    def accumulation(self, config: LMConfig) -> int:
        return config.accumulate

    def optimizer(self, model: nn.Module, lr: float, world_size: int):
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)

    def datasets(self, config: LMConfig):
        return Blocks(config.corpus.blocks, config.train), Blocks(config.corpus.blocks, config.val)

    def step(self, model, batch):
        # bfloat16 for a replica (DDP) as FSDP2's policy does it for shards
        with torch.autocast(batch.device.type, dtype=torch.bfloat16,
                            enabled=getattr(self, "bf16", False) and not sharding.is_sharded(model)):
            loss = model(input_ids=batch, labels=batch).loss
        return loss, {"loss": loss * len(batch)}

    def finish_metrics(self, metrics: dict) -> None:
        for key in ("loss", "val_loss"):
            if key in metrics:
                metrics[key.replace("loss", "perplexity")] = math.exp(min(metrics[key], 50.0))

    def before_step(self, model, optimizer) -> None:
        # the most this rank held: after the first step its optimizer state exists, gradients too
        self.held = max(getattr(self, "held", 0), sharding.held_bytes(model, optimizer))

    def rank_metrics(self, model, optimizer, world) -> dict:
        """What one rank held for training (parameters, gradients, optimizer state), measured on
        each rank: the largest of them, in MiB (FSDP: about 1/N of a replica's)."""
        return {"held_mib_per_rank": max(world.gather(getattr(self, "held", 0))) / 2**20}

    def held_out(self, config: LMConfig) -> np.ndarray:
        return config.corpus.blocks[config.val[:4]].astype(np.int64)

    def manifest(self, config: LMConfig, run) -> dict:
        return {"strategy": config.strategy, "model_source": config.model_dir or f"config:{config.size}",
                "tokenizer": config.tokenizer}

    def export(self, folder: Path, config: LMConfig, inputs: np.ndarray, output: Path) -> Exported:
        import os
        import socket

        from transformers.utils import logging as hf_logging

        from trainkit.onnx_export import export_torch

        hf_logging.disable_progress_bar()  # save_pretrained's bar: the harness's log says it

        model = self.model(config)
        self.load_weights(folder, model)
        model.eval()
        forward = Logits(model).eval()
        x = torch.from_numpy(inputs)
        with torch.no_grad():
            reference = forward(x).numpy()
        staged = export_torch(forward, x, output, input_name="input_ids", output_name="logits",
                              sequence=(2, int(config.corpus.blocks.shape[1])))
        pretrained = output / f".pretrained.{socket.gethostname()}.{os.getpid()}.new"
        model.save_pretrained(str(pretrained))
        tokenizer = text.tokenizer_for(Path(config.model_dir) if config.model_dir else None)
        if isinstance(tokenizer, text.FolderTokenizer):
            tokenizer.tokenizer.save_pretrained(str(pretrained))
        samples = self.write_samples(model, tokenizer, config)
        return Exported(staged, reference, beside={"pretrained": pretrained}, manifest={"samples": samples})

    def write_samples(self, model, tokenizer, config: LMConfig) -> list[dict]:
        """A few lines the trained model writes on from the start of held-out blocks (sampled,
        seeded): in the log and the manifest."""
        out = []
        with torch.random.fork_rng(), torch.no_grad():
            torch.manual_seed(0)
            for i in config.val[: config.samples]:
                prompt = torch.from_numpy(config.corpus.blocks[i][:24].astype(np.int64))[None]
                ids = model.generate(prompt, max_new_tokens=48, do_sample=True, top_k=20, use_cache=False,
                                     pad_token_id=tokenizer.eos)[0, prompt.shape[1]:]
                sample = {"prompt": tokenizer.decode(prompt[0]), "text": tokenizer.decode(ids)}
                self.say(f"sample: {sample['prompt']!r} -> {sample['text']!r}")
                out.append(sample)
        return out


if __name__ == "__main__":
    run_from_command_line(FinetuneLM())
