"""The pieces of the Horovod and TensorFlow jobs that need no cluster."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torchvision
from PIL import Image

from trainkit import data, mnist
from trainkit.errors import UserError


def test_idx_files_are_read_back_by_torchvision(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    images = np.random.default_rng(1).integers(0, 256, (5, 28, 28), dtype=np.uint8)
    labels = np.array([3, 1, 4, 1, 5], dtype=np.uint8)
    for train in (True, False):
        mnist.write_idx(raw / mnist.FILES[train][0], images)
        mnist.write_idx(raw / mnist.FILES[train][1], labels)
    ds = torchvision.datasets.MNIST(str(tmp_path), train=True, download=False)
    assert len(ds) == 5
    img, label = ds[2]
    assert label == 4 and np.array_equal(np.asarray(img), images[2])


def test_builtin_digits_look_like_mnist(tmp_path):
    root = mnist.ensure_builtin(tmp_path)
    train = torchvision.datasets.MNIST(str(root), train=True, download=False)
    test = torchvision.datasets.MNIST(str(root), train=False, download=False)
    assert (len(train), len(test)) == (1500, 297)
    assert set(train.targets.tolist()) == set(range(10))
    assert train.data.shape[1:] == (28, 28) and train.data.max() == 255
    assert train.data[:, :4].max() == 0  # a blank border, as in MNIST
    stamp = (tmp_path / "MNIST/raw" / mnist.FILES[True][0]).stat().st_mtime_ns
    mnist.ensure_builtin(tmp_path)  # written once
    assert (tmp_path / "MNIST/raw" / mnist.FILES[True][0]).stat().st_mtime_ns == stamp


def test_mnist_dir_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist; pass --data-dir"):
        mnist.check_dir(str(tmp_path / "nope"))
    with pytest.raises(UserError, match=r"no MNIST under .*missing .*train-images-idx3-ubyte"):
        mnist.check_dir(str(tmp_path))


def test_horovod_is_built_with_pytorch_and_gloo():
    horovodrun = Path(sys.executable).parent / "horovodrun"
    # the cached environment's own interpreter, not a checkout's .venv link to it: every checkout
    # shares the environment, and one removed left horovodrun pointing nowhere (scripts/build_horovod.sh)
    assert horovodrun.read_text().splitlines()[0] == f"#!{Path(sys.prefix).resolve() / 'bin' / 'python'}"
    out = subprocess.run([str(horovodrun), "--check-build"], capture_output=True, text=True,
                         timeout=120).stdout
    assert "[X] PyTorch" in out and "[X] Gloo" in out


def test_cnn_is_the_tutorials():
    from tf_cnn import build_model

    model = build_model()
    kinds = [type(layer).__name__ for layer in model.layers]
    assert kinds == ["Conv2D", "MaxPooling2D"] * 4 + ["Flatten", "Dropout", "Dense", "Dense"]
    assert [layer.filters for layer in model.layers if hasattr(layer, "filters")] == [32, 64, 128, 128]
    assert model.input_shape == (None, 150, 150, 3) and model.output_shape == (None, 1)
    assert model.layers[-1].activation.__name__ == "sigmoid"
    assert model.layers[-2].units == 512


def test_builtin_two_class_set():
    x, y, names = data.builtin_two_class(10, (150, 150))
    assert x.shape == (20, 150, 150, 3) and sorted(set(y.tolist())) == [0, 1]
    assert names == ["china", "flower"]
    assert abs(x[y == 0].mean() - x[y == 1].mean()) > 1  # two different photographs


def make_class(folder, n):
    folder.mkdir(parents=True)
    for i in range(n):
        Image.fromarray(np.full((20, 30, 3), i * 10, dtype=np.uint8)).save(folder / f"{i}.png")


def test_two_class_folder(tmp_path):
    make_class(tmp_path / "cats", 3)
    make_class(tmp_path / "dogs", 2)
    x, y, names = data.load_two_class_folder(str(tmp_path), (150, 150))
    assert x.shape == (5, 150, 150, 3) and y.tolist() == [0, 0, 0, 1, 1]
    assert names == ["cats", "dogs"]


def test_two_class_folder_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        data.load_two_class_folder(str(tmp_path / "nope"), (150, 150))
    with pytest.raises(UserError, match="no class folders with images"):
        data.load_two_class_folder(str(tmp_path), (150, 150))
    make_class(tmp_path / "only", 3)
    with pytest.raises(UserError, match=r"exactly 2 class folders .* found 1 \(only\)"):
        data.load_two_class_folder(str(tmp_path), (150, 150))
