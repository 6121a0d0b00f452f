"""The language-model job on Ray: FSDP2 across both nodes' workers, a worker killed mid-run, the
run resumed from its sharded checkpoint, what it publishes (ONNX, save_pretrained), and what a
rank held: about half of a replica."""

import json

import numpy as np
from conftest import ray_noise
from test_fault_tolerance import Running, check_recovered, kill, ray_train_workers, wait_registered


def test_fsdp_across_two_workers_resumes_from_its_sharded_checkpoint_after_a_kill(cluster, tmp_path):
    epochs = 6
    running = Running(cluster, "finetune_lm", "--limit", "60000", "--batch-size", "8", "--epochs",
                      str(epochs), "--num-workers", "2", "--name", "lm", "--storage-path",
                      str(tmp_path / "runs"), "--output", str(tmp_path / "model"))
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
    # the checkpoint Ray kept: both workers' parts and DCP's metadata in one folder (a folder the
    # kill cut short, with one worker's part and no meta.json, may lie beside it: never registered)
    (last,) = [p for p in (tmp_path / "runs" / "lm").glob("checkpoint_*") if (p / "meta.json").is_file()
               and json.loads((p / "meta.json").read_text())["epoch"] == epochs]
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json"} <= {p.name for p in last.iterdir()}
    # the published save_pretrained folder loads as the model the ONNX file is
    import onnxruntime as ort
    import torch
    from transformers import AutoModelForCausalLM

    tuned = AutoModelForCausalLM.from_pretrained(tmp_path / "model" / "pretrained")
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
