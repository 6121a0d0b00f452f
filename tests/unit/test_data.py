"""Data sources and the one-line errors for bad input."""

import numpy as np
import pytest
from PIL import Image

from trainkit import data
from trainkit.errors import UserError, find_user_error


def test_builtin_frames_are_the_tutorials_count_of_real_photo_crops():
    frames = data.builtin_frames()
    assert frames.shape == (6472, 120, 160, 3) and frames.dtype == np.uint8
    # real photographs: varied content, neighbouring frames overlap like a panning video
    assert frames.std() > 30
    assert len({f.tobytes() for f in frames[::50]}) == len(frames[::50])
    assert np.abs(frames[1].astype(int) - frames[0].astype(int)).mean() < 40


def write_images(folder, n, size=(40, 60)):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        sub = folder / f"d{i % 3}"
        sub.mkdir(exist_ok=True)
        arr = rng.integers(0, 255, (size[0], size[1], 3), dtype=np.uint8)
        Image.fromarray(arr).save(sub / f"{i:03d}.{'png' if i % 2 else 'jpg'}")


def test_folder_is_read_recursively_and_resized(tmp_path):
    write_images(tmp_path / "imgs", 7)
    (tmp_path / "imgs" / "notes.txt").write_text("not an image")
    src = data.inspect_frames(str(tmp_path / "imgs"), (40, 60))
    assert (src.kind, src.count) == ("folder", 7)
    ds = data.FrameDataset(src)
    x = ds[3]
    assert x.shape == (3, 40, 60) and x.dtype == np.uint8  # scaled to [0, 1] on the device
    floats = ds.floats([3])
    assert floats.dtype == np.float32 and 0 <= floats.min() <= floats.max() <= 1
    assert np.array_equal(floats[0], x / np.float32(255))


def test_video_is_split_into_frames(tmp_path):
    import cv2

    path = tmp_path / "clip.avi"
    out = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 10, (64, 48))
    for i in range(12):
        out.write(np.full((48, 64, 3), i * 20, dtype=np.uint8))
    out.release()
    src = data.inspect_frames(str(path), (40, 60))
    assert (src.kind, src.count) == ("video", 12)
    ds = data.FrameDataset(src)
    assert ds[0].shape == (3, 40, 60)
    assert ds[11].mean() > ds[0].mean()


def test_missing_path(tmp_path):
    with pytest.raises(UserError, match=r"does not exist; pass --data .* or leave --data out"):
        data.inspect_frames(str(tmp_path / "nope"), (40, 60))


def test_empty_folder(tmp_path):
    with pytest.raises(UserError, match="no images .* found under"):
        data.inspect_frames(str(tmp_path), (40, 60))


def test_corrupt_image_names_the_file(tmp_path):
    write_images(tmp_path, 3)
    bad = tmp_path / "d0" / "broken.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg")
    with pytest.raises(UserError, match=r"cannot read image .*broken.jpg .*remove or replace"):
        data.inspect_frames(str(tmp_path), (40, 60))


def test_truncated_image_is_caught(tmp_path):
    write_images(tmp_path, 2, size=(200, 200))
    f = next(tmp_path.rglob("*.png"))
    f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
    with pytest.raises(UserError, match=f"cannot read image .*{f.name}"):
        data.inspect_frames(str(tmp_path), (40, 60))


def test_many_images_are_checked_in_parallel_and_the_first_bad_one_is_named(tmp_path):
    """600 JPEGs in 3 folders: checked in chunks on threads; of two truncated JPEGs (one early in
    a late chunk's order, one late) the first in sorted order is the one named, every time."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(600):
        folder = tmp_path / f"part{i % 3}"
        folder.mkdir(exist_ok=True)
        Image.fromarray((rng.random((24, 32, 3)) * 255).astype("uint8")).save(folder / f"{i:04d}.jpg")
    files = data.list_images(tmp_path)
    assert len(files) == 600 and files == sorted(files)
    assert data.inspect_frames(str(tmp_path), (40, 60)).count == 600
    for f in (files[450], files[10]):
        f.write_bytes(f.read_bytes()[:-200])
    for _ in range(3):
        with pytest.raises(UserError, match=f"cannot read image {files[10]} .*truncated"):
            data.check_images(files, chunk=16)


def test_a_file_that_is_not_a_video(tmp_path):
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(UserError, match="is a file but not a video"):
        data.inspect_frames(str(tmp_path / "x.csv"), (40, 60))


def test_image_size_must_fit_the_model():
    assert data.parse_size("120x160", 20) == (120, 160)
    for bad in ("120x150", "abc", "0x20"):
        with pytest.raises(UserError, match="image size"):
            data.parse_size(bad, 20)


def test_split_is_fixed_and_disjoint():
    train, val = data.split_indices(100, 0.1)
    assert (len(train), len(val)) == (90, 10)
    assert not set(train) & set(val) and sorted(train + val) == list(range(100))
    assert data.split_indices(100, 0.1) == (train, val)


def test_user_error_is_found_inside_wrapped_errors():
    inner = UserError("bad thing; do this")
    try:
        try:
            raise inner
        except UserError as e:
            raise RuntimeError("worker died") from e
    except RuntimeError as outer:
        assert find_user_error(outer) is inner
    assert find_user_error(RuntimeError("plain")) is None


def test_a_few_frames_without_building_the_set(tmp_path):
    """frames_at gives exactly the data set's frames, for each kind of source."""
    write_images(tmp_path / "imgs", 7)
    builtin = data.inspect_frames(None, (40, 60), 300)
    for source in (builtin, data.inspect_frames(str(tmp_path / "imgs"), (40, 60))):
        picks = [5, 0, 3]
        assert np.array_equal(data.frames_at(source, picks), data.FrameDataset(source).floats(picks))
