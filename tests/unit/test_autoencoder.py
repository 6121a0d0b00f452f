"""The tutorial's autoencoder and its ONNX export, without a cluster."""

import datetime
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ddp_autoencoder import AutoEncoder, DDPAutoencoder

from trainkit import flags
from trainkit.errors import UserError
from trainkit.job import parse_flags
from trainkit.onnx_export import (
    MANIFEST_FILE,
    MODEL_FILE,
    ParityError,
    check_parity,
    current,
    export_torch,
    verify_and_publish,
)
from trainkit.onnx_export import published as published_model


@pytest.mark.parametrize("shape", [(1, 3, 120, 160), (4, 3, 40, 60), (2, 3, 200, 100)])
def test_maps_images_onto_themselves(shape):
    out = AutoEncoder()(torch.rand(shape))
    assert out.shape == shape
    assert (out >= 0).all()  # the last layer is a ReLU


def test_layers_are_the_tutorials():
    m = AutoEncoder()
    convs = [(type(c).__name__, c.in_channels, c.out_channels, c.kernel_size, c.stride)
             for c in m.modules() if isinstance(c, torch.nn.Conv2d | torch.nn.ConvTranspose2d)]
    assert convs == [
        ("Conv2d", 3, 8, (5, 5), (1, 1)), ("Conv2d", 8, 16, (5, 5), (1, 1)),
        ("ConvTranspose2d", 16, 8, (5, 5), (5, 5)), ("ConvTranspose2d", 8, 3, (5, 5), (4, 4)),
    ]
    pools = [p.kernel_size for p in m.modules() if isinstance(p, torch.nn.MaxPool2d)]
    assert pools == [4, 5]


def _export(tmp_path, model=None):
    torch.manual_seed(0)
    model = (model or AutoEncoder()).eval()
    x = torch.rand(6, 3, 120, 160)
    with torch.no_grad():
        ref = model(x).numpy()
    return export_torch(model, x, tmp_path), x.numpy(), ref


def test_onnx_matches_torch_at_any_batch_size(tmp_path):
    staged, x, ref = _export(tmp_path)
    parity = check_parity(staged, x, ref)
    assert parity["max_abs_diff"] < 1e-5
    assert parity["samples"] == 6
    for n in (1, 3):  # the exported batch dimension is dynamic, not fixed at the traced 6
        parity = check_parity(staged, x[:n], ref[:n])
        assert parity["samples"] == n and parity["max_abs_diff"] < 1e-5


def test_parity_check_catches_a_wrong_model(tmp_path):
    staged, x, ref = _export(tmp_path)
    with pytest.raises(ParityError, match="differs from the framework"):
        check_parity(staged, x, ref + 1e-3)


def test_publish_writes_model_and_manifest(tmp_path):
    staged, x, ref = _export(tmp_path)
    published = verify_and_publish(
        staged, tmp_path, job="t", framework="torch", inputs=x, reference=ref,
        metrics={"loss": 0.5}, world_size=2, record_dir=tmp_path / "run")
    model_path, manifest_path, manifest = published.model, published.manifest_path, published.manifest
    assert published_model(tmp_path / "run") == published  # the run's record finds it again
    assert model_path.parent.parent == tmp_path / "publications" and not staged.exists()
    assert (tmp_path / MODEL_FILE).resolve() == model_path.resolve()  # the links go through current
    assert (tmp_path / MANIFEST_FILE).resolve() == manifest_path.resolve()
    on_disk = json.loads(manifest_path.read_text())
    assert on_disk == json.loads(json.dumps(manifest))
    assert on_disk["inputs"][0]["shape"] == ["batch", 3, 120, 160]
    assert on_disk["outputs"][0]["shape"][0] == "batch"
    assert on_disk["versions"]["torch"] == torch.__version__.split("+")[0]
    assert on_disk["opset"]["ai.onnx"] >= 17
    assert on_disk["world_size"] == 2 and on_disk["metrics"] == {"loss": 0.5}
    assert on_disk["parity"]["max_abs_diff"] <= on_disk["parity"]["tolerance"] == 1e-4
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert on_disk["git_commit"].startswith(head), (on_disk["git_commit"], head)  # + "-dirty"
    assert on_disk["model_sha256"] == hashlib.sha256(model_path.read_bytes()).hexdigest()


def test_publishing_switches_whole_pairs(tmp_path):
    staged, x, ref = _export(tmp_path)
    first = verify_and_publish(staged, tmp_path, job="t", framework="torch", inputs=x,
                               reference=ref, metrics={"n": 1}, world_size=1)
    staged, x, ref = _export(tmp_path)
    second = verify_and_publish(staged, tmp_path, job="t", framework="torch", inputs=x,
                                reference=ref, metrics={"n": 2}, world_size=1)
    now = current(tmp_path)
    assert now.manifest["metrics"] == {"n": 2} and now.model == second.model
    assert json.loads((tmp_path / MANIFEST_FILE).read_text())["metrics"] == {"n": 2}
    # the earlier pair is still whole in its own folder
    assert json.loads(first.manifest_path.read_text())["metrics"] == {"n": 1}
    assert first.manifest["model_sha256"] == hashlib.sha256(first.model.read_bytes()).hexdigest()
    for _ in range(4):
        staged, x, ref = _export(tmp_path)
        verify_and_publish(staged, tmp_path, job="t", framework="torch", inputs=x, reference=ref,
                           metrics={}, world_size=1)
    assert len(list((tmp_path / "publications").iterdir())) == 3  # the newest three stay


def test_publications_are_ordered_by_sequence_not_by_the_clock(tmp_path, monkeypatch):
    """A clock stepped back (years, here) cannot make a new publication sort older than the last
    one, so pruning never takes what was just published; a folder of the older layout (a bare
    time stamp, even one far in the future) goes first."""
    from trainkit import onnx_export
    staged, x, ref = _export(tmp_path)
    verify_and_publish(staged, tmp_path, job="t", framework="torch", inputs=x, reference=ref,
                       metrics={"n": 1}, world_size=1)
    (tmp_path / "publications/29991231-235959-000000").mkdir()  # the older layout's name

    class SteppedBack(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.datetime(2001, 1, 1, tzinfo=tz)
    monkeypatch.setattr(onnx_export._dt, "datetime", SteppedBack)
    for n in (2, 3, 4):
        staged, x, ref = _export(tmp_path)
        last = verify_and_publish(staged, tmp_path, job="t", framework="torch", inputs=x,
                                  reference=ref, metrics={"n": n}, world_size=1)
    assert current(tmp_path).manifest["metrics"] == {"n": 4} and current(tmp_path).model == last.model
    names = sorted(p.name for p in (tmp_path / "publications").iterdir())
    assert names == ["000002-20010101-000000", "000003-20010101-000000", "000004-20010101-000000"]


def test_each_process_stages_its_own_file(tmp_path):
    code = "import sys; from pathlib import Path; from trainkit.onnx_export import staging_path; " \
           "print(staging_path(Path(sys.argv[1])))"
    names = {subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                            check=True, cwd=Path(__file__).resolve().parents[2]).stdout.strip()
             for _ in range(2)}
    assert len(names) == 2 and all(Path(n).parent == tmp_path for n in names), names


FULL_DISK = """
import resource, signal, sys
sys.path[:0] = [{tests!r}, "jobs"]
from test_autoencoder import _export
from pathlib import Path
from trainkit.errors import UserError
from trainkit.onnx_export import verify_and_publish
out = Path({out!r})
staged, x, ref = _export(out)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (200, 200))  # the manifest no longer fits
try:
    verify_and_publish(staged, out, job="t", framework="torch", inputs=x, reference=ref,
                       metrics={{"n": 2}}, world_size=1)
except UserError as e:
    print(e)
    sys.exit(2)
"""


def test_a_full_disk_mid_publish_keeps_the_previous_model(tmp_path):
    staged, x, ref = _export(tmp_path)
    verify_and_publish(staged, tmp_path, job="t", framework="torch", inputs=x, reference=ref,
                       metrics={"n": 1}, world_size=1)
    before = (tmp_path / MODEL_FILE).read_bytes(), (tmp_path / MANIFEST_FILE).read_bytes()
    code = FULL_DISK.format(tests=str(Path(__file__).parent), out=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"could not publish the model in {tmp_path} (File too large); "
                                  "the previous publication there (if any) is still current")
    assert ((tmp_path / MODEL_FILE).read_bytes(), (tmp_path / MANIFEST_FILE).read_bytes()) == before
    assert len(list((tmp_path / "publications").iterdir())) == 1  # the broken one is gone


def test_failed_parity_keeps_the_published_model(tmp_path):
    staged, x, ref = _export(tmp_path)
    verify_and_publish(staged, tmp_path, job="t", framework="torch", inputs=x, reference=ref,
                       metrics={}, world_size=1)
    before = (tmp_path / MODEL_FILE).read_bytes(), (tmp_path / MANIFEST_FILE).read_bytes()
    staged, x, ref = _export(tmp_path)
    with pytest.raises(UserError, match="ONNX check failed.*untouched"):
        verify_and_publish(staged, tmp_path, job="t", framework="torch", inputs=x,
                           reference=ref * 2 + 1, metrics={}, world_size=1)
    assert ((tmp_path / MODEL_FILE).read_bytes(), (tmp_path / MANIFEST_FILE).read_bytes()) == before
    assert (tmp_path / "model.rejected.onnx").exists()


def parse_args(argv):
    return flags.RunFlags.of(parse_flags(DDPAutoencoder(), argv)).resolved(DDPAutoencoder.name)


def test_default_paths_follow_the_run_name(monkeypatch, tmp_path):
    monkeypatch.setenv("DLC_STORAGE_PATH", str(tmp_path / "runs"))
    monkeypatch.setenv("DLC_MODELS", str(tmp_path / "models"))
    a = parse_args(["--name", "r1"])
    assert a.storage_path == str(tmp_path / "runs")
    assert a.output == str(tmp_path / "models" / "r1")
    assert parse_args([]).name.startswith("ddp_autoencoder-")
    # unique even within one second
    assert len({parse_args([]).name for _ in range(20)}) == 20


def test_epochs_travel_typed_from_the_command_line_to_the_run():
    """--epochs 3: parsed by the flag RunFlags' field declares, carried as that typed field (no
    Namespace past the parse), into the Run every rank's training loop reads."""
    from dataclasses import fields
    from typing import get_type_hints

    from trainkit.contract import Run

    job = DDPAutoencoder()
    parsed = parse_flags(job, ["--epochs", "3", "--name", "r1", "--limit", "64"])
    settings = flags.RunFlags.of(parsed).resolved(job.name)
    run = Run.from_flags(job, settings, "local", use_gpu=False)
    assert (settings.epochs, run.epochs, run.name, run.batch_size) == (3, 3, "r1", job.batch_size)
    assert get_type_hints(flags.RunFlags)["epochs"] is int and get_type_hints(Run)["epochs"] is int
    # the parser's shared flags are RunFlags' fields, and nothing of the job's own is among them
    shared = {f.name for f in fields(flags.RunFlags)}
    assert shared <= set(vars(parsed)) and "limit" not in shared
    assert flags.own_params(parsed)["limit"] == "64" and "epochs" not in flags.own_params(parsed)


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in ("--num-workers", "--batch-size", "--epochs", "--use-gpu", "--data", "--launcher",
                 "--storage-path", "--output", "--name", "--placement"):
        assert flag in text
