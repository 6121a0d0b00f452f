"""Each GPU path of the project, run for real at small size."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from conftest import HERE, job, manifest, run

AE = ["--use-gpu", "true", "--limit", "4096", "--batch-size", "128", "--epochs", "2"]


def test_the_gpu_is_visible_and_nvml_answers(gpus):
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=60)
    assert smi.returncode == 0 and len(smi.stdout.strip().splitlines()) == gpus, smi.stdout + smi.stderr
    print(smi.stdout)
    pynvml = pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed")
    pynvml.nvmlInit()
    try:
        assert pynvml.nvmlDeviceGetCount() == gpus
        mem = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
        assert mem.total > 0
    finally:
        pynvml.nvmlShutdown()


def check_cuda_model(m: dict, world: int, backend: str) -> None:
    metrics = m["metrics"]
    assert metrics["device"] == "cuda" and metrics["backend"] == backend, metrics
    assert metrics["world_size"] == world and m["world_size"] == world
    assert metrics["gpu_memory_peak_mb"] > 0  # the GPU's memory was used while training
    assert m["parity"]["max_abs_diff"] <= 1e-4  # CUDA-trained weights, checked in onnxruntime
    assert m["replicas_in_sync"] is True


def test_autoencoder_alone_on_cuda(tmp_path):
    run(tmp_path, *job(tmp_path, "ddp_autoencoder", *AE, "--name", "alone"))
    check_cuda_model(manifest(tmp_path, "alone"), 1, "none")


def test_autoencoder_under_torchrun_with_nccl(tmp_path, gpus):
    run(tmp_path, sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(gpus),
        "jobs/ddp_autoencoder.py", *AE, "--name", "torchrun")
    m = manifest(tmp_path, "torchrun")
    check_cuda_model(m, gpus, "nccl")
    assert m["launcher"] == "torchrun"


def test_autoencoder_on_ray_with_nccl(tmp_path, gpus):
    pytest.importorskip("ray", reason="Ray is not installed (make stage-gpu carries it)")
    run(tmp_path, *job(tmp_path, "ddp_autoencoder", *AE, "--launcher", "ray", "--num-workers",
                       str(gpus), "--name", "ray"))
    m = manifest(tmp_path, "ray")
    check_cuda_model(m, gpus, "nccl")
    assert m["launcher"] == "ray"


def horovod_nccl():
    hvd = pytest.importorskip("horovod.torch",
                              reason="Horovod is not installed (scripts/gpu_tier.sh builds it)")
    if not hvd.nccl_built():
        pytest.skip("this Horovod has no NCCL operations (build it with HOROVOD_GPU=1)")
    return hvd


def test_horovod_with_nccl_under_horovodrun(tmp_path, gpus):
    hvd = horovod_nccl()
    print(f"hvd.nccl_built() = {hvd.nccl_built()}, cuda_built() = {hvd.cuda_built()}")
    horovodrun = shutil.which("horovodrun")
    assert horovodrun, "horovodrun is not on PATH"
    run(tmp_path, horovodrun, "-np", str(gpus), "-H", f"localhost:{gpus}", "--gloo", sys.executable,
        "jobs/horovod_mnist.py", "--use-gpu", "true", "--epochs", "1", "--batch-size", "64",
        "--name", "hvdrun")
    check_cuda_model(manifest(tmp_path, "hvdrun"), gpus, "horovod-nccl")


def test_horovod_with_nccl_on_ray(tmp_path, gpus):
    horovod_nccl()
    pytest.importorskip("ray", reason="Ray is not installed (make stage-gpu carries it)")
    run(tmp_path, *job(tmp_path, "horovod_mnist", "--launcher", "ray", "--use-gpu", "true",
                       "--num-workers", str(gpus), "--epochs", "1", "--batch-size", "64",
                       "--name", "hvdray"))
    check_cuda_model(manifest(tmp_path, "hvdray"), gpus, "horovod-nccl")


def test_pipeline_efficiency_is_measured(tmp_path):
    """The benchmark (not a timed test): real input pipeline over synthetic on-device batches."""
    out = tmp_path / "pipeline.json"
    run(tmp_path, sys.executable, str(HERE / "bench_pipeline.py"), "--frames", "4096",
        "--json", str(out))
    result = json.loads(out.read_text())
    assert result["real_samples_per_s"] > 0 and result["synthetic_samples_per_s"] > 0
    assert 0 < result["efficiency"] == pytest.approx(
        result["real_samples_per_s"] / result["synthetic_samples_per_s"])
