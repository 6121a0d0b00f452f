"""docs/jobs.md's "Bring your own model": the example job file there trains, publishes a verified
ONNX model, resumes, and refuses bad input in one line, as a job of the project's own does."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "docs/examples/tabular_regression.py"


def own_job(checkout: Path, home: Path, *args: str) -> subprocess.CompletedProcess:
    """As the page says: the file copied into jobs/, run as `python jobs/<file> ...` (one process)."""
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(home), "DLC_HOME": str(home)}
    return subprocess.run([sys.executable, "jobs/tabular_regression.py", *args], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=300)


def checkout_with_the_example(tmp_path: Path) -> Path:
    checkout = tmp_path / "checkout"
    (checkout / "jobs").mkdir(parents=True)
    shutil.copy(EXAMPLE, checkout / "jobs/tabular_regression.py")
    return checkout


def test_the_example_job_trains_publishes_and_resumes(tmp_path):
    checkout = checkout_with_the_example(tmp_path)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 3)).astype(np.float32)
    y = x @ np.array([1.5, -2.0, 0.5], np.float32) + 0.1 * rng.normal(size=200).astype(np.float32)
    csv = tmp_path / "prices.csv"
    np.savetxt(csv, np.column_stack([x, y]), delimiter=",")
    home = tmp_path / "home"

    first = own_job(checkout, home, "--csv", str(csv), "--epochs", "2", "--name", "t")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    assert "200 rows of 3 feature(s)" in first.stdout and "epoch 2/2" in first.stdout
    m = json.loads((home / "models/t/manifest.json").read_text())
    assert m["job"] == "tabular_regression" and m["framework"] == "torch" and m["launcher"] == "local"
    assert m["parity"]["max_abs_diff"] <= 1e-4 and m["metrics"]["epoch"] == 2
    out = ort.InferenceSession(str(home / "models/t/model.onnx")).run(None, {"input": x[:5]})[0]
    assert out.shape == (5, 1)

    again = own_job(checkout, home, "--csv", str(csv), "--epochs", "3", "--name", "t")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming after epoch 2" in again.stdout and "epoch 3/3" in again.stdout
    assert json.loads((home / "models/t/manifest.json").read_text())["metrics"]["epoch"] == 3


def test_the_example_job_refuses_a_missing_csv_in_one_line(tmp_path):
    checkout = checkout_with_the_example(tmp_path)
    proc = own_job(checkout, tmp_path / "home", "--csv", str(tmp_path / "none.csv"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--csv: no file" in lines[0] and "shared storage" in lines[0], proc.stderr
    assert not (tmp_path / "home" / "models").exists()
