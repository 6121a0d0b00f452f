"""The language-model job on Ray: FSDP2 across both nodes' workers, a worker killed mid-run, the
run resumed from its sharded checkpoint, what it publishes (ONNX, save_pretrained, both equal to
the last checkpoint loaded whole), what a rank held (about half of a replica), and the finished run
resumed on one worker: its two-rank checkpoint resharded, the loss going on from where it was."""

import json
import re

import numpy as np
from conftest import ray_noise, read_manifest
from test_fault_tolerance import Running, check_recovered, kill, ray_train_workers, wait_registered


def epoch_losses(output: str) -> dict[int, float]:
    """Each epoch's training loss, from its line (`epoch 3/6: loss 4.1234 ...`)."""
    return {int(m[1]): float(m[2]) for m in re.finditer(r"epoch (\d+)/\d+: loss (\S+) ", output)}


def checkpoint_of(runs, epoch: int):
    """The run's checkpoint of `epoch` (a folder the kill cut short, with one worker's part and no
    meta.json, may lie beside it: never registered)."""
    (found,) = [p for p in runs.glob("checkpoint_*") if (p / "meta.json").is_file()
                and json.loads((p / "meta.json").read_text())["epoch"] == epoch]
    return found


def test_fsdp_across_two_workers_resumes_after_a_kill_and_on_one_worker_after_it_finished(cluster, tmp_path):
    epochs = 5
    args = ["--limit", "60000", "--batch-size", "8", "--name", "lm", "--storage-path", str(tmp_path / "runs"),
            "--output", str(tmp_path / "model")]
    running = Running(cluster, "finetune_lm", *args, "--epochs", str(epochs), "--num-workers", "2")
    running.wait_for(f"epoch 2/{epochs}: ")  # epoch 1's checkpoint is reported
    wait_registered(tmp_path / "runs")
    workers = ray_train_workers(cluster)
    assert workers, "no Ray Train worker process found"
    killed_at = kill(workers[-1:])
    output = running.finish()
    m = check_recovered(tmp_path / "model", killed_at, last_epoch=epochs)
    assert ray_noise(output) == []
    assert "FSDP2: 2 blocks and the root sharded over 2 workers" in output
    # each epoch: loss and perplexity, training and validation
    for line in (x for x in output.splitlines() if f"/{epochs}: loss " in x):
        assert " perplexity " in line and " val_perplexity " in line, line
    assert m["world_size"] == 2 and m["sharded"] is True and len(set(m["shard_digests"])) == 2
    assert m["strategy"] == "fsdp" and m["launcher"] == "ray" and len(m["samples"]) == 3
    # the checkpoint Ray kept: both workers' parts and DCP's metadata in one folder, where every
    # matrix of the model is split between the two ranks (two pieces, one a rank, each of its rows)
    last = checkpoint_of(tmp_path / "runs" / "lm", epochs)
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json"} <= {p.name for p in last.iterdir()}
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    tensors = dcp.FileSystemReader(str(last)).read_metadata().state_dict_metadata
    matrices = {k: v for k, v in tensors.items()
                if k.startswith("model.") and len(getattr(v, "size", ())) == 2}
    assert len(matrices) >= 2 * 7 + 2, sorted(tensors)[:20]  # 7 a block, the embedding and the head
    for key, meta in matrices.items():
        rows = sorted((c.offsets[0], c.sizes[0]) for c in meta.chunks)
        assert len(rows) == 2 and rows[0][0] == 0 and rows[0][1] + rows[1][1] == meta.size[0] \
            and rows[1][0] == rows[0][1] and min(r[1] for r in rows) >= meta.size[0] // 2, (key, rows)
    # the published save_pretrained folder is that checkpoint loaded whole, and the ONNX model is it
    import onnxruntime as ort

    from trainkit import sharding

    tuned = AutoModelForCausalLM.from_pretrained(tmp_path / "model" / "pretrained")
    whole = AutoModelForCausalLM.from_config(tuned.config)
    sharding.load_alone(last, whole)
    mine, theirs = tuned.state_dict(), whole.state_dict()
    assert mine.keys() == theirs.keys()
    unequal = [k for k in mine if not torch.equal(mine[k], theirs[k])]
    assert unequal == [], unequal[:5]
    text = b"Licensed under the Apache License, Version 2.0"
    ids = np.frombuffer(text, dtype=np.uint8)[None].astype(np.int64)
    with torch.no_grad():
        want = tuned(input_ids=torch.from_numpy(ids)).logits.numpy()
    got = ort.InferenceSession(str(tmp_path / "model" / "model.onnx")).run(None, {"input_ids": ids})[0]
    assert np.abs(got - want).max() <= 1e-4
    # what a rank held for training: about half of what a replica holds (DDP: every parameter, its
    # gradient and AdamW's two moments, 16 bytes a float32 parameter), each rank measured; make
    # bench compares the two runs side by side (docs/benchmark.md; its table and plot from recorded
    # results in the unit tier)
    replica_mib = sum(p.numel() for p in tuned.parameters()) * 16 / 2**20
    held = m["metrics"]["held_mib_per_rank"]
    assert 0.4 < held / replica_mib < 0.7, (held, replica_mib)

    # the finished run, one epoch more on one worker: its two-rank checkpoint resharded onto one rank
    again = Running(cluster, "finetune_lm", *args, "--epochs", str(epochs + 1), "--num-workers", "1")
    resumed = again.finish()
    assert f"resuming after epoch {epochs} from {last}" in resumed, resumed[-3000:]
    assert "FSDP2: 2 blocks and the root sharded over 1 workers" in resumed
    assert f"epoch 1/{epochs + 1}" not in resumed
    m1 = read_manifest(tmp_path / "model")
    assert m1["world_size"] == 1 and m1["metrics"]["epoch"] == epochs + 1 and m1["sharded"] is True
    assert m1["run"]["epochs_trained"] == epochs + 1
    held1 = m1["metrics"]["held_mib_per_rank"]
    assert 0.85 < held1 / replica_mib < 1.15, (held1, replica_mib)  # one rank holds the whole of it
    # the loss went on from where the two ranks left it, far below a first epoch's
    before, after = epoch_losses(output), epoch_losses(resumed)
    first, left, went_on = before[1], before[epochs], after[epochs + 1]
    assert went_on < first and abs(went_on - left) < 0.25 * (first - left), (first, left, went_on)
