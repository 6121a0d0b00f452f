"""Each GPU path of the project, run for real at small size."""

from __future__ import annotations

import ctypes
import json
import math
import shutil
import subprocess
import sys
import time

import pytest
from conftest import HERE, job, manifest, run

AE = ["--use-gpu", "true", "--limit", "4096", "--batch-size", "128", "--epochs", "2"]


def nvml_devices() -> list[tuple[str, int]]:
    """(name, total memory in bytes) of each GPU, asked of NVML itself: the driver's libnvidia-ml,
    through ctypes (what nvidia-ml-py wraps, and nvidia-smi answers from)."""
    lib = ctypes.CDLL("libnvidia-ml.so.1")

    def check(rc: int, call: str) -> None:
        assert rc == 0, f"{call}: NVML error {rc}"  # 0: NVML_SUCCESS

    check(lib.nvmlInit_v2(), "nvmlInit_v2")
    try:
        count = ctypes.c_uint()
        check(lib.nvmlDeviceGetCount_v2(ctypes.byref(count)), "nvmlDeviceGetCount_v2")
        devices = []
        for i in range(count.value):
            handle = ctypes.c_void_p()
            check(lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(i), ctypes.byref(handle)),
                  "nvmlDeviceGetHandleByIndex_v2")
            name = ctypes.create_string_buffer(96)  # NVML_DEVICE_NAME_V2_BUFFER_SIZE
            check(lib.nvmlDeviceGetName(handle, name, ctypes.c_uint(len(name))), "nvmlDeviceGetName")
            memory = (ctypes.c_ulonglong * 3)()  # nvmlMemory_t: total, free, used
            check(lib.nvmlDeviceGetMemoryInfo(handle, memory), "nvmlDeviceGetMemoryInfo")
            devices.append((name.value.decode(), memory[0]))
        return devices
    finally:
        lib.nvmlShutdown()


def test_the_gpu_is_visible_and_nvml_answers(gpus):
    """nvidia-smi, NVML asked directly and torch see the same GPUs: as many, the same names and
    memory sizes, each with memory."""
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=60)
    assert smi.returncode == 0 and len(smi.stdout.strip().splitlines()) == gpus, smi.stdout + smi.stderr
    print(smi.stdout)
    listed = [line.split(", ") for line in smi.stdout.strip().splitlines()]
    nvml = nvml_devices()
    print(nvml)
    assert len(nvml) == gpus
    for (name, total), (smi_name, smi_mib, _driver) in zip(nvml, listed, strict=True):
        assert total > 0 and name == smi_name, (nvml, listed)
        assert abs(total / 2**20 - int(smi_mib)) <= 1, (nvml, listed)  # nvidia-smi shows MiB


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


def test_language_model_under_torchrun_fsdp2_in_bfloat16(tmp_path, gpus):
    """The language model's FSDP2 run on CUDA with NCCL, bfloat16 compute (`--precision auto` on a
    GPU that supports it), published from its sharded checkpoint."""
    pytest.importorskip("transformers", reason="Transformers is not installed on this machine: the "
                                               "test takes the machine's own, as the lent GPU machines' "
                                               "image holds it (make stage-gpu cannot carry its 13 MiB "
                                               "beside Ray's 51 within 60)")
    import torch

    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    run(tmp_path, sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(gpus),
        "jobs/finetune_lm.py", "--use-gpu", "true", "--size", "small", "--limit", "400000",
        "--batch-size", "32", "--epochs", "2", "--tracking", "off", "--name", "lm")
    m = manifest(tmp_path, "lm")
    metrics = m["metrics"]
    assert metrics["device"] == "cuda" and metrics["backend"] == "nccl"
    assert metrics["gpu_memory_peak_mb"] > 0 and m["parity"]["max_abs_diff"] <= 1e-4
    assert m["strategy"] == "fsdp" and metrics["val_perplexity"] > 0


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


FRAMES, BATCH = 4096, 128
TRAIN = FRAMES - round(FRAMES * 0.1)  # the job holds a tenth of its frames out for validation


def test_pipeline_efficiency_is_measured(tmp_path):
    """The benchmark (not a timed test): real input pipeline over synthetic on-device batches. Its
    figures are checked against what they are made of: epoch 2's training frames over its dataflow
    and processing seconds, the synthetic steps' samples over theirs, all inside the run's own wall
    time; and the step fed by the pipeline is no faster than the same step fed from the GPU."""
    out = tmp_path / "pipeline.json"
    started = time.monotonic()
    run(tmp_path, sys.executable, str(HERE / "bench_pipeline.py"), "--frames", str(FRAMES),
        "--batch-size", str(BATCH), "--json", str(out))
    wall = time.monotonic() - started
    r = json.loads(out.read_text())
    split = r["split"]
    print(r)
    assert (r["frames"], r["batch_size"]) == (FRAMES, BATCH)
    assert r["train_iters"] == math.ceil(TRAIN / BATCH), r  # every training frame once
    assert r["synthetic_steps"] == max(20, r["train_iters"]), r
    # each phase took time, the phases are parts of the epoch, the epoch and the synthetic steps
    # parts of the run
    assert min(split["dataflow_s"], split["processing_s"], split["validation_s"], r["synthetic_s"]) > 0, r
    assert split["dataflow_s"] + split["processing_s"] + split["validation_s"] <= split["epoch_s"], split
    assert split["epoch_s"] + r["synthetic_s"] < wall, (r, wall)
    # the throughputs are those samples over those seconds
    real = TRAIN / (split["dataflow_s"] + split["processing_s"])
    synthetic = r["synthetic_steps"] * BATCH / r["synthetic_s"]
    assert r["real_samples_per_s"] == pytest.approx(real, rel=1e-9), (r, real)
    assert r["synthetic_samples_per_s"] == pytest.approx(synthetic, rel=1e-9), (r, synthetic)
    assert r["efficiency"] == pytest.approx(real / synthetic, rel=1e-9), (r, real / synthetic)
    # the same step on the same GPU: fed by the pipeline (a copy to the device and a sync each step
    # more) it is not faster than on batches already there; 25 % for two processes' timing noise
    assert TRAIN / split["processing_s"] <= 1.25 * synthetic, (r, TRAIN / split["processing_s"])
