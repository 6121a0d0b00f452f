"""Sharded training for PyTorch jobs: FSDP2 (`fully_shard`) and torch.distributed.checkpoint (DCP).

A job whose model does not fit one device shards its parameters, gradients and optimizer state
across the ranks: `shard` wraps each transformer block, then the root, in `fully_shard` (the
layout torchtitan uses). Its checkpoints are DCP folders every rank writes its part of
(`__<rank>_0.distcp`, and `.metadata` from rank 0); `load` reads one back on any number of ranks
(DCP reshards by each tensor's global shape), so a run that lost a node resumes on fewer, and
`load_alone` reads one whole into a plain model in one process, with no group (publishing).
The same two functions save and restore an unsharded model (DDP, or one process): a job that
uses DCP keeps one checkpoint layout whatever its strategy.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .errors import UserError


def blocks(model: nn.Module, layers: int | None) -> list[nn.Module]:
    """A Transformers model's blocks, whatever its architecture: the modules of the classes it names
    as never to be split (`_no_split_modules`, e.g. LlamaDecoderLayer), else the entries of its one
    module list of `layers` modules (the config's number of layers: many architectures, GPT-2's
    ancestors and encoder-decoders' decoders among them, name no such class)."""
    named = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in named]
    if found:
        return found
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and layers and len(m) == layers]
    return list(lists[0]) if len(lists) == 1 else []


def shard(model: nn.Module, units: list[nn.Module], bf16: bool) -> int:
    """FSDP2 over the world's group: each of `units` (a transformer block: `blocks`) is its own
    unit, the root holds the rest (embeddings, head). With `bf16`: parameters cast to bfloat16 for
    compute, gradients reduced in float32. The number of blocks sharded."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    if not units:
        raise UserError(f"the model ({type(model).__name__}) names no transformer blocks and holds no "
                        "list of its layers to shard them by; use --strategy ddp")
    for block in units:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return len(units)


def grouped() -> bool:
    """Whether this process is in a torch.distributed group (else DCP works alone, quietly)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def save(folder: Path, model: nn.Module, optimizer) -> None:
    """Every rank: its part of the model and optimizer state into `folder` (DCP; collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder),
             no_dist=not grouped())


def load(folder: Path, model: nn.Module, optimizer, name: str) -> None:
    """Every rank: the checkpoint in `folder` into this rank's part (DCP; collective; any world
    size); one line when it does not fit the model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    try:
        dcp.load(state, checkpoint_id=str(folder), no_dist=not grouped())
    except (RuntimeError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0][:200]
        raise UserError(f"run {name}'s checkpoint does not fit this model ({first}); resume it with "
                        "its own flags, or use another --name for a new run") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def load_alone(folder: Path, model: nn.Module) -> None:
    """One process, no group (rank 0 publishing, or Ray's driver): the whole model from `folder`."""
    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    model.load_state_dict(state["model"])


def is_sharded(model: nn.Module) -> bool:
    """Whether `shard` wrapped this model (its parameters are DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def held_bytes(model: nn.Module, optimizer) -> int:
    """Bytes of the tensors this rank holds for training, counted from their storages: its
    parameters (its shards under FSDP), their gradients and the optimizer's state."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    total = 0
    tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor)]
    for t in tensors:
        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def local_arrays(model: nn.Module):
    """This rank's own part of each parameter, as arrays (a replica's whole parameters unsharded)."""
    from torch.distributed.tensor import DTensor

    for p in model.state_dict().values():
        local = p.to_local() if isinstance(p, DTensor) else p
        yield local.detach().float().cpu().numpy()
