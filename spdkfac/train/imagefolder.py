"""ImageNet-style ``root/{train,val}/<class>/<image>`` data on Pillow (no torchvision).

Training images get a random crop of a random scale and a horizontal flip;
validation images are resized and centre-cropped. Each worker reads its own
shard (:class:`torch.utils.data.distributed.DistributedSampler`).
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage

__all__ = ["IMAGE_EXTENSIONS", "ImageFolder", "ImageFolderError", "make_loader", "scan_image_folder"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".webp", ".tif", ".tiff")
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
#: One sample: a normalised ``3 x size x size`` image and its class index.
Sample = tuple[torch.Tensor, int]


class ImageFolderError(ValueError):
    """The data directory is missing or malformed; the message says what and where."""


def scan_image_folder(root: Path, classes: Sequence[str] | None = None) -> tuple[list[tuple[Path, int]], list[str]]:
    """``[(image path, class index)]`` and the sorted class names of ``root/<class>/*``."""
    root = Path(root)
    if not root.is_dir():
        raise ImageFolderError(f"data directory {root} does not exist (expected {root}/<class>/<image files>)")
    found = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not found:
        raise ImageFolderError(f"{root} has no class sub-directories (expected {root}/<class>/<image files>)")
    if classes is not None and list(classes) != found:
        missing, extra = sorted(set(classes) - set(found)), sorted(set(found) - set(classes))
        raise ImageFolderError(f"{root} has different classes than the training set: missing {missing[:5]}, extra {extra[:5]}")
    samples: list[tuple[Path, int]] = []
    empty = []
    for idx, name in enumerate(found):
        files = sorted(p for p in (root / name).rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
        if not files:
            empty.append(name)
        samples += [(f, idx) for f in files]
    if empty:
        raise ImageFolderError(
            f"{root}: class director{'y' if len(empty) == 1 else 'ies'} with no images ({', '.join(IMAGE_EXTENSIONS)}): {empty[:5]}"
        )
    return samples, found


class ImageFolder(Dataset[Sample]):
    """Images of ``root/<class>/`` as normalised ``3 x size x size`` tensors."""

    def __init__(self, root: Path, size: int = 224, train: bool = True, classes: Sequence[str] | None = None) -> None:
        try:
            import PIL.Image  # noqa: F401
        except ImportError as exc:  # pragma: no cover
            raise ImportError("ImageFolder data needs Pillow (pip install pillow)") from exc
        self.samples, self.classes = scan_image_folder(root, classes)
        self.size, self.train = size, train

    def __len__(self) -> int:
        return len(self.samples)

    def _load(self, path: Path) -> PILImage:
        """The image as RGB; an unreadable file or a decompression bomb is an :class:`ImageFolderError` naming it.

        An image larger than Pillow's ``Image.MAX_IMAGE_PIXELS`` is refused, not
        skipped: in a training set it is a damaged or hostile file, decoding it
        would take gigabytes in every loader worker, and skipping it would
        silently change the data (and the equal shards every worker needs).
        Raise that limit before loading if such images are meant.
        """
        from PIL import Image, UnidentifiedImageError

        try:
            with warnings.catch_warnings():  # Pillow only warns between 1x and 2x the limit
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                with Image.open(path) as img:
                    rgb: PILImage = img.convert("RGB")
                    return rgb
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise ImageFolderError(
                f"image {path} is too large to decode safely ({exc}); remove it, or raise PIL.Image.MAX_IMAGE_PIXELS "
                f"(now {Image.MAX_IMAGE_PIXELS}) before loading if it is meant"
            ) from None
        except (UnidentifiedImageError, OSError) as exc:
            raise ImageFolderError(f"cannot read image {path}: {exc}") from None

    def __getitem__(self, index: int) -> Sample:
        from PIL import Image

        path, label = self.samples[index]
        img = self._load(path)
        s = self.size
        if self.train:
            w, h = img.size
            scale = random.uniform(0.35, 1.0)
            cw, ch = max(1, int(w * scale)), max(1, int(h * scale))
            x0, y0 = random.randint(0, w - cw), random.randint(0, h - ch)
            img = img.crop((x0, y0, x0 + cw, y0 + ch)).resize((s, s), Image.Resampling.BILINEAR)
            if random.random() < 0.5:
                img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        else:
            w, h = img.size
            short = int(s / 0.875)
            img = img.resize((max(short, int(w * short / h)), max(short, int(h * short / w))), Image.Resampling.BILINEAR)
            w, h = img.size
            x0, y0 = (w - s) // 2, (h - s) // 2
            img = img.crop((x0, y0, x0 + s, y0 + s))
        t = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).reshape(s, s, 3).permute(2, 0, 1).float().div_(255)
        return (t - torch.tensor(MEAN)[:, None, None]) / torch.tensor(STD)[:, None, None], label


def make_loader(
    dataset: Dataset[Sample], batch_size: int, rank: int, size: int, train: bool, workers: int = 2, seed: int = 0
) -> DataLoader[Sample]:
    """A DataLoader over this worker's shard (equal shard sizes on every worker)."""
    sampler: DistributedSampler[int] = DistributedSampler(dataset, num_replicas=size, rank=rank, shuffle=train, seed=seed, drop_last=train)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers, drop_last=train, persistent_workers=workers > 0)
