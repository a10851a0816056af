"""A decompression-bomb image in an ImageFolder is a clear error naming the file, not a traceback or a skip."""

import struct
import warnings
import zlib

import pytest

PIL_Image = pytest.importorskip("PIL.Image")

from spdkfac.train.imagefolder import ImageFolder, ImageFolderError  # noqa: E402


def _png(path, size):
    PIL_Image.new("RGB", (size, size), (10, 20, 30)).save(path)


def _claim_size(path, width, height):
    """Rewrite the PNG header to claim ``width x height`` (the pixel data stays tiny): a decompression bomb's header."""
    data = bytearray(path.read_bytes())
    start = 8 + 8  # signature, then the IHDR chunk's length and type
    data[start : start + 8] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[12 : start + 13]))  # type + the 13 bytes of IHDR data
    data[start + 13 : start + 17] = struct.pack(">I", crc)
    path.write_bytes(bytes(data))


def _folder(tmp_path):
    root = tmp_path / "train"
    (root / "cat").mkdir(parents=True)
    return root, root / "cat" / "0.png"


def test_a_header_claiming_a_huge_image_is_refused_naming_the_file(tmp_path):
    root, image = _folder(tmp_path)
    _png(image, 4)
    _claim_size(image, 40_000, 40_000)  # 1.6 G pixels: over twice Pillow's default limit
    with pytest.raises(ImageFolderError, match=rf"image {image} is too large to decode safely .*MAX_IMAGE_PIXELS"):
        ImageFolder(root, 8)[0]


def test_an_image_just_over_the_limit_is_refused_not_only_warned(tmp_path, monkeypatch):
    root, image = _folder(tmp_path)
    _png(image, 8)  # 64 pixels: over a limit of 40, under twice it (where Pillow only warns)
    monkeypatch.setattr(PIL_Image, "MAX_IMAGE_PIXELS", 40)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no warning escapes
        with pytest.raises(ImageFolderError, match=f"image {image} is too large to decode safely"):
            ImageFolder(root, 8)[0]


def test_an_image_within_the_limit_loads(tmp_path, monkeypatch):
    root, image = _folder(tmp_path)
    _png(image, 8)
    monkeypatch.setattr(PIL_Image, "MAX_IMAGE_PIXELS", 64)
    x, label = ImageFolder(root, 8)[0]
    assert tuple(x.shape) == (3, 8, 8)
    assert label == 0
