"""Image data for the jobs: a folder of images, a video split into frames, or built-in frames.

Everything is checked before training starts (`inspect_frames`), so bad input fails on the driver
with one line, before any worker starts or any checkpoint is touched.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from .errors import UserError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")
VIDEO_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm", ".mpg", ".mpeg")
BUILTIN_FRAMES = 6472  # the tutorial's data set size
NO_DATA_HINT = "pass --data with a folder of images or a video file, or leave --data out"


def parse_size(text: str, multiple: int = 1) -> tuple[int, int]:
    """'120x160' -> (120, 160): height x width, each a positive multiple of `multiple`."""
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise UserError(f"image size {text!r} is not HEIGHTxWIDTH; use e.g. 120x160") from None
    if h <= 0 or w <= 0 or h % multiple or w % multiple:
        raise UserError(
            f"image size {text} must be positive multiples of {multiple} for this model; "
            f"use e.g. 120x160"
        )
    return h, w


# ---------------------------------------------------------------- built-in frames
def builtin_frames(count: int = BUILTIN_FRAMES, size: tuple[int, int] = (120, 160),
                   indices: list[int] | None = None) -> np.ndarray:
    """`count` frames (N x H x W x 3, uint8) of a slow camera pan over real photographs; with
    `indices`, only those of the `count` frames (the same pixels, without making the rest).

    The photographs are the two that scikit-learn ships (`load_sample_images`: a temple in
    China and a flower), so nothing is downloaded. Like frames of a video, neighbours overlap.
    """
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images
    h, w = size
    per_photo = -(-count // len(photos))
    frames = []
    for photo in photos:
        if photo.shape[0] < h or photo.shape[1] < w:
            big = (max(w, photo.shape[1]), max(h, photo.shape[0]))
            photo = np.asarray(Image.fromarray(photo).resize(big))
        rows = int(np.ceil(np.sqrt(per_photo * (photo.shape[0] - h + 1) / (photo.shape[1] - w + 1))))
        cols = -(-per_photo // rows)
        ys = np.linspace(0, photo.shape[0] - h, rows).round().astype(int)
        xs = np.linspace(0, photo.shape[1] - w, cols).round().astype(int)
        # a raster pan: left to right, then right to left on the next row, like a camera sweep
        path = [(y, x) for i, y in enumerate(ys) for x in (xs if i % 2 == 0 else xs[::-1])]
        frames += [(photo, y, x) for y, x in path[:per_photo]]
    chosen = frames[:count] if indices is None else [frames[:count][i] for i in indices]
    return np.stack([photo[y : y + h, x : x + w] for photo, y, x in chosen])


# ---------------------------------------------------------------- sources on disk
def list_images(folder: Path) -> list[Path]:
    """Every image file under `folder`, sorted (os.scandir: no stat per file, which a folder of
    100 000 frames would pay; symlinked folders are not followed, so no loop)."""
    found, todo = [], [str(folder)]
    while todo:
        with os.scandir(todo.pop()) as entries:
            for e in entries:
                if e.is_dir(follow_symlinks=False):
                    todo.append(e.path)
                elif os.path.splitext(e.name)[1].lower() in IMAGE_SUFFIXES and e.is_file():
                    found.append(Path(e.path))
    return sorted(found)


def read_video(path: Path, size: tuple[int, int], limit: int | None = None) -> np.ndarray:
    """All frames of a video (N x H x W x 3 RGB uint8), resized to `size`."""
    import cv2

    cap = cv2.VideoCapture(str(path))
    frames: list[np.ndarray] = []
    try:
        while limit is None or len(frames) < limit:
            ok, bgr = cap.read()
            if not ok:
                break
            rgb = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
            frames.append(cv2.resize(rgb, (size[1], size[0]), interpolation=cv2.INTER_AREA))
    finally:
        cap.release()
    if not frames:
        raise UserError(f"video {path} has no readable frames (corrupt or unsupported codec); "
                        "convert it to .mp4/.avi or extract its frames to a folder")
    return np.stack(frames)


def load_image(path: Path, size: tuple[int, int]) -> np.ndarray:
    """One image as H x W x 3 RGB uint8, resized; a corrupt file raises a one-line UserError."""
    try:
        with Image.open(path) as im:
            return np.array(im.convert("RGB").resize((size[1], size[0]), Image.Resampling.BILINEAR))
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        reason = str(e).split("\n")[0]
        raise UserError(f"cannot read image {path} ({reason}); remove or replace the file") from None


def check_image(path: Path) -> None:
    """Decode one image file whole (a JPEG at 1/8 scale: every byte of it is still read and
    decoded, at a fraction of the cost); a corrupt or truncated one raises a one-line UserError."""
    try:
        with Image.open(path) as im:
            im.draft("RGB", (1, 1))
            im.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        reason = str(e).split("\n")[0]
        raise UserError(f"cannot read image {path} ({reason}); remove or replace the file") from None


def check_images(files: list[Path], chunk: int = 256) -> None:
    """check_image on every file, in parallel threads (Pillow decodes without the GIL); memory
    stays bounded (one chunk per thread). The first bad file in sorted order is the one named."""
    def first_bad(part: list[Path]) -> UserError | None:
        for f in part:
            try:
                check_image(f)
            except UserError as e:
                return e
        return None

    parts = [files[i : i + chunk] for i in range(0, len(files), chunk)]
    pool = ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1)))
    try:
        for bad in pool.map(first_bad, parts):
            if bad is not None:
                raise bad
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # a bad file: the chunks not begun are dropped


@dataclass(frozen=True)
class FrameSource:
    """Where the frames come from, as the driver found it (picklable, sent to the workers)."""

    kind: str  # "builtin" | "folder" | "video"
    path: str | None
    count: int
    size: tuple[int, int]

    def describe(self) -> str:
        h, w = self.size
        where = "built-in frames (scikit-learn's sample photographs)" if self.kind == "builtin" else self.path
        return f"{self.count} {self.kind} frames at {h}x{w} from {where}"

    def folder(self) -> Path:
        """The folder or video file of a source that is not built in."""
        if self.path is None:
            raise ValueError(f"{self.kind} frames have no path")
        return Path(self.path)


def inspect_frames(data: str | None, size: tuple[int, int], limit: int | None = None) -> FrameSource:
    """Check `--data` on the driver and count its frames; every problem is a one-line UserError."""
    if limit is not None and limit < 1:
        raise UserError(f"--limit {limit} must be at least 1")
    if data is None:
        return FrameSource("builtin", None, min(BUILTIN_FRAMES, limit or BUILTIN_FRAMES), size)
    path = Path(data).expanduser().resolve()
    if not path.exists():
        raise UserError(f"data path {path} does not exist; {NO_DATA_HINT} for the built-in frames")
    if path.is_file():
        if path.suffix.lower() not in VIDEO_SUFFIXES:
            raise UserError(f"data path {path} is a file but not a video ({', '.join(VIDEO_SUFFIXES)}); "
                            f"{NO_DATA_HINT}")
        return FrameSource("video", str(path), len(read_video(path, size, limit)), size)
    files = list_images(path)[:limit]
    if not files:
        raise UserError(f"no images ({', '.join(IMAGE_SUFFIXES)}) found under {path}; {NO_DATA_HINT}")
    check_images(files)
    return FrameSource("folder", str(path), len(files), size)


class FrameDataset:
    """Frames as uint8 arrays 3 x H x W (a map-style data set for torch's DataLoader, whose collate
    makes uint8 batches: 4x less to move than floats; the step scales them on the device).
    Folders are read lazily, one image per item."""

    def __init__(self, source: FrameSource):
        self.source = source
        self.files: list[Path] = []
        self.frames: np.ndarray | None = None
        if source.kind == "builtin":
            self.frames = builtin_frames(source.count, source.size)
        elif source.kind == "video":
            self.frames = read_video(source.folder(), source.size, source.count)
        else:
            self.files = list_images(source.folder())[: source.count]
        if len(self) != source.count:
            raise UserError(f"{source.path} changed while training started: expected {source.count} "
                            f"frames, found {len(self)}; keep the data set fixed during a run")

    def __len__(self) -> int:
        return len(self.files) if self.frames is None else len(self.frames)

    def __getitem__(self, i: int) -> np.ndarray:
        img = self.frames[i] if self.frames is not None else load_image(self.files[i], self.source.size)
        return np.ascontiguousarray(img.transpose(2, 0, 1))

    def floats(self, indices: list[int]) -> np.ndarray:
        """Frames as float32 in [0, 1] (N x 3 x H x W): the model's input."""
        return np.stack([self[i] for i in indices]).astype(np.float32) / 255.0


def frames_at(source: FrameSource, indices: list[int]) -> np.ndarray:
    """A few frames of a source as the model's input (float32 N x 3 x H x W in [0, 1]), without
    building the whole set (the ONNX check on the driver needs 16, not 6472)."""
    if source.kind == "builtin":
        chosen = builtin_frames(source.count, source.size, indices)
    elif source.kind == "folder":
        files = list_images(source.folder())[: source.count]
        chosen = np.stack([load_image(files[i], source.size) for i in indices])
    else:
        chosen = read_video(source.folder(), source.size, max(indices) + 1)[indices]
    return np.ascontiguousarray(chosen.transpose(0, 3, 1, 2)).astype(np.float32) / 255.0


def split_indices(n: int, val_fraction: float, seed: int = 0) -> tuple[list[int], list[int]]:
    """A fixed shuffle of range(n) cut into (train, validation); validation has at least 1 item."""
    order = np.random.default_rng(seed).permutation(n).tolist()
    n_val = max(1, int(round(n * val_fraction))) if n > 1 else 0
    return order[n_val:], order[:n_val]


# ---------------------------------------------------------------- two-class images (tf_cnn)
def builtin_two_class(per_class: int, size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Two classes of real-photo crops: scikit-learn's temple photograph vs its flower."""
    from sklearn.datasets import load_sample_images

    photos = load_sample_images()
    images, labels = [], []
    for label, photo in enumerate(photos.images):
        crops = builtin_crops(photo, per_class, size)
        images.append(crops)
        labels.append(np.full(len(crops), label, dtype=np.int64))
    names = [Path(f).stem for f in photos.filenames]
    return np.concatenate(images), np.concatenate(labels), names


def builtin_crops(photo: np.ndarray, count: int, size: tuple[int, int]) -> np.ndarray:
    """`count` crops of `size` at fixed pseudo-random places of a photograph (N x H x W x 3)."""
    h, w = size
    rng = np.random.default_rng(count)
    ys = rng.integers(0, photo.shape[0] - h + 1, count)
    xs = rng.integers(0, photo.shape[1] - w + 1, count)
    return np.stack([photo[y : y + h, x : x + w] for y, x in zip(ys, xs, strict=True)])


def load_two_class_folder(data: str, size: tuple[int, int], limit: int | None = None
                          ) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """A folder with one sub-folder of images per class, exactly two classes (binary labels).

    Classes are the sub-folder names in sorted order (label 0 and 1), as Keras'
    image_dataset_from_directory orders them.
    """
    root = Path(data).expanduser().resolve()
    if not root.is_dir():
        raise UserError(f"data folder {root} does not exist; pass --data with one sub-folder of "
                        "images per class, or leave --data out for the built-in two-class set")
    classes = sorted(d for d in root.iterdir() if d.is_dir() and list_images(d))
    if not classes:
        raise UserError(f"no class folders with images under {root}; expected {root}/<class>/*.jpg "
                        "for two classes")
    if len(classes) != 2:
        names = ", ".join(d.name for d in classes)
        raise UserError(f"a binary classifier needs exactly 2 class folders under {root}, found "
                        f"{len(classes)} ({names}); add or remove class folders")
    images, labels = [], []
    for label, folder in enumerate(classes):
        for f in list_images(folder)[:limit]:
            images.append(load_image(f, size))
            labels.append(label)
    return np.stack(images), np.array(labels, dtype=np.int64), [d.name for d in classes]
