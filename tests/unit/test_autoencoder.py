"""The tutorial's autoencoder and its ONNX export, without a cluster."""

import json

import pytest
import torch
from ddp_autoencoder import AutoEncoder, DDPAutoencoder

from trainkit import flags, harness
from trainkit.errors import UserError
from trainkit.onnx_export import (
    MANIFEST_FILE,
    MODEL_FILE,
    ParityError,
    check_parity,
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
    assert model_path == tmp_path / MODEL_FILE and model_path.exists() and not staged.exists()
    on_disk = json.loads(manifest_path.read_text())
    assert on_disk == json.loads(json.dumps(manifest))
    assert on_disk["inputs"][0]["shape"] == ["batch", 3, 120, 160]
    assert on_disk["outputs"][0]["shape"][0] == "batch"
    assert on_disk["versions"]["torch"] == torch.__version__.split("+")[0]
    assert on_disk["opset"]["ai.onnx"] >= 17
    assert on_disk["world_size"] == 2 and on_disk["metrics"] == {"loss": 0.5}
    assert on_disk["parity"]["max_abs_diff"] <= on_disk["parity"]["tolerance"] == 1e-4
    assert on_disk["git_commit"]


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
    return flags.resolve(harness.parse(DDPAutoencoder(), argv), DDPAutoencoder.name)


def test_default_paths_follow_the_run_name(monkeypatch, tmp_path):
    monkeypatch.setenv("DLC_STORAGE_PATH", str(tmp_path / "runs"))
    monkeypatch.setenv("DLC_MODELS", str(tmp_path / "models"))
    a = parse_args(["--name", "r1"])
    assert a.storage_path == str(tmp_path / "runs")
    assert a.output == str(tmp_path / "models" / "r1")
    assert parse_args([]).name.startswith("ddp_autoencoder-")
    # unique even within one second
    assert len({parse_args([]).name for _ in range(20)}) == 20


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in ("--num-workers", "--batch-size", "--epochs", "--use-gpu", "--data", "--launcher",
                 "--storage-path", "--output", "--name", "--placement"):
        assert flag in text
