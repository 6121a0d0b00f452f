"""MNIST for the Horovod job, read by torchvision's own MNIST loader.

With no MNIST at hand (no download here or on air-gapped nodes), a built-in set is written once
in MNIST's IDX file format: scikit-learn's 1797 handwritten digits (8x8, 17 grey levels),
scaled to 28x28. torchvision.datasets.MNIST then reads it like the real thing.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from .errors import UserError

FILES = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
BUILTIN_TRAIN = 1500  # of scikit-learn's 1797 digits; the other 297 are the test set


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write a uint8 array in IDX format (magic 0x0000 08 <ndim>, big-endian dims, data)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(header + array.tobytes())
    tmp.replace(path)  # atomic: workers on one host may write the same files at once


def builtin_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as 28x28 uint8 images (0-255) and their labels."""
    from PIL import Image
    from sklearn.datasets import load_digits

    d = load_digits()
    images = np.stack([
        np.asarray(Image.fromarray((img * 255 / 16).astype(np.uint8))
                   .resize((20, 20), Image.Resampling.BILINEAR))
        for img in d.images
    ])
    padded = np.zeros((len(images), 28, 28), dtype=np.uint8)
    padded[:, 4:24, 4:24] = images  # MNIST centres each digit in a 20x20 box of a 28x28 frame
    return padded, d.target.astype(np.uint8)


def ensure_builtin(root: Path) -> Path:
    """Write the built-in set under root/MNIST/raw once; return root (torchvision's `root`)."""
    raw = root / "MNIST" / "raw"
    if all((raw / f).exists() for pair in FILES.values() for f in pair):
        return root
    raw.mkdir(parents=True, exist_ok=True)
    for train, (images, labels) in builtin_split().items():
        write_idx(raw / FILES[train][0], images)
        write_idx(raw / FILES[train][1], labels)
    return root


def builtin_split() -> dict[bool, tuple[np.ndarray, np.ndarray]]:
    """The built-in digits split once, the same way everywhere: {train?: (images, labels)}."""
    images, labels = builtin_digits()
    order = np.random.default_rng(0).permutation(len(images))
    return {train: (images[idx], labels[idx])
            for train, idx in ((True, order[:BUILTIN_TRAIN]), (False, order[BUILTIN_TRAIN:]))}


def check_dir(data_dir: str) -> Path:
    """A user's --data-dir must hold MNIST as torchvision reads it: <dir>/MNIST/raw/<4 files>."""
    root = Path(data_dir).expanduser().resolve()
    if not root.is_dir():
        raise UserError(f"MNIST folder {root} does not exist; pass --data-dir with MNIST in it, "
                        "or leave --data-dir out for the built-in digits")
    raw = root / "MNIST" / "raw"
    missing = [f for pair in FILES.values() for f in pair if not (raw / f).exists()]
    if missing:
        raise UserError(f"no MNIST under {root} (missing {raw / missing[0]}); put the four "
                        "uncompressed MNIST files there, or leave --data-dir out for the built-in digits")
    return root
