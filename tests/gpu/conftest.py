"""The GPU tier: the jobs on CUDA for real (NCCL, Horovod's NCCL build, the GPU's memory, the
data pipeline's efficiency). Without a CUDA device every test here is skipped with the reason;
nothing is mocked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def no_cuda() -> str | None:
    """Why this machine cannot run the tier, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda})"
    return None


def pytest_collection_modifyitems(config, items):
    why = no_cuda()
    if why is None:
        return
    skip = pytest.mark.skip(reason=f"{why}: the GPU tier runs on a GPU machine (make test-gpu there; "
                                   "make stage-gpu, then scripts/gpu_tier.sh on a bare offline one)")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpus() -> int:
    import torch

    return torch.cuda.device_count()


def run(home: Path, *cmd: str, timeout: int = 1800) -> subprocess.CompletedProcess:
    """A command in the checkout with its own DLC_HOME; its output is printed (the tier's log)."""
    # never into a run history that happens to be up here (make demo's, through the current record)
    env = {**os.environ, "DLC_HOME": str(home), "PYTHONUNBUFFERED": "1", "DLC_TRACKING_URL": "off"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(list(cmd), cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    print(proc.stdout[-8000:])
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc


def job(home: Path, name: str, *args: str) -> list[str]:
    return [sys.executable, f"jobs/{name}.py", *args]


def manifest(home: Path, run_name: str) -> dict:
    return json.loads((home / "models" / run_name / "manifest.json").read_text())
