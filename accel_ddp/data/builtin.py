"""The built-in datasets: digits, MNIST, FashionMNIST, CIFAR-10, image folders, synthetic; and the registry.

Every builder returns a :class:`~accel_ddp.data.bundle.DatasetBundle`: train and eval datasets
of ``(input, label)`` pairs plus what a model needs to know about them. Sources that fit in
memory are decoded once into an :class:`~accel_ddp.data.in_memory.InMemoryDataset` (uint8 where
the source is uint8), which the device loader serves.

Your own dataset: ``--dataset my_pkg.my_data:build`` where

    def build(data_dir: str, download: bool) -> DatasetBundle: ...

(a plain ``(train, eval, num_classes, input_shape)`` tuple works too). Return an
``InMemoryDataset`` or a ``TensorDataset`` to get the device loader; any map-style Dataset works on
the DataLoader path.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import os
import pickle
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from accel_ddp.data.bundle import DataError, DatasetBundle
from accel_ddp.data.hf import HFSource, build_hf
from accel_ddp.data.hf_stream import build_stream
from accel_ddp.data.in_memory import InMemoryDataset
from accel_ddp.util.messages import first_line
from accel_ddp.util.registry import resolve
from accel_ddp.util.validation import ConfigError

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
FASHION_MNIST_MEAN, FASHION_MNIST_STD = 0.2860, 0.3530
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def build_digits(data_dir: str, download: bool) -> DatasetBundle:
    """scikit-learn's bundled 8x8 digits (1,797 images): no download, 80/20 split fixed by seed 0."""
    images, labels = read_digits()
    images = torch.tensor(images, dtype=torch.uint8).unsqueeze(1)  # pixel range 0..16
    labels = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    n_train = int(0.8 * len(labels))
    train_idx, eval_idx = order[:n_train], order[n_train:]
    pixels = {"scale": 16.0, "mean": (0.5,), "std": (0.5,)}
    return DatasetBundle(
        InMemoryDataset(images[train_idx], labels[train_idx], **pixels),
        InMemoryDataset(images[eval_idx], labels[eval_idx], **pixels),
        num_classes=10,
        input_shape=(1, 8, 8),
    )


def read_digits() -> tuple[np.ndarray, np.ndarray]:
    """(images (1797, 8, 8) float, labels (1797,) int) of scikit-learn's digits, as ``load_digits()`` returns them.

    Read from the CSV file scikit-learn ships, as ``load_digits`` reads it, without importing
    scikit-learn: that import costs 2-3 s of every rank's start-up (docs/performance.md). If the
    file is not where scikit-learn has always kept it, scikit-learn reads it.
    """
    spec = importlib.util.find_spec("sklearn")
    folders = (spec.submodule_search_locations or []) if spec is not None else []
    path = next((os.path.join(f, "datasets", "data", "digits.csv.gz") for f in folders), "")
    if not os.path.isfile(path):
        from sklearn.datasets import load_digits

        digits = load_digits()
        return digits.images, digits.target
    with gzip.open(path, mode="rt", encoding="utf-8") as fh:
        data = np.loadtxt(fh, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


# ----------------------------------------------------------------------------- MNIST-format (IDX) files


def read_idx(path: str) -> torch.Tensor:
    """A uint8 IDX file (the MNIST format), plain or gzipped, as a tensor of the shape it declares."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as fh:
            raw = fh.read()
    except (EOFError, OSError, zlib.error) as err:  # a cut .gz: EOFError; not gzip: BadGzipFile (an OSError)
        raise ConfigError(f"{path}: cannot be read ({type(err).__name__}: {first_line(err)}); "
                          "re-download it with --download, or copy it again") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ConfigError(f"{path}: not a uint8 IDX file (bad header); re-download it with --download")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    count = int(np.prod(dims))
    offset = 4 + 4 * ndim
    if len(raw) - offset != count:
        raise ConfigError(f"{path}: holds {len(raw) - offset} bytes of data, its header says {count}; re-download it")
    return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8, offset=offset).copy()).view(*dims)


def _find_file(name: str, folders: list[str]) -> str | None:
    for folder in folders:
        for candidate in (name, name + ".gz"):
            path = os.path.join(folder, candidate)
            if os.path.isfile(path):
                return path
    return None


def _download_error(dataset: str, err: Exception, where: str) -> ConfigError:
    return ConfigError(
        f"{dataset}: download failed ({type(err).__name__}: {first_line(err)}); "
        f"check the network, or copy the files into {where} and drop --download"
    )


def _build_idx_dataset(name: str, folder: str, data_dir: str, download: bool, mean: float, std: float) -> DatasetBundle:
    """MNIST or FashionMNIST from IDX files in DATA_DIR/FOLDER/raw (torchvision's layout) or DATA_DIR itself."""
    raw_dir = os.path.join(data_dir, folder, "raw")
    folders = [raw_dir, os.path.join(data_dir, folder), data_dir]
    files = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
    if any(_find_file(f, folders) is None for f in files) and download:
        import torchvision.datasets

        try:
            getattr(torchvision.datasets, folder)(root=data_dir, train=True, download=True)
        except Exception as err:  # urllib, http and checksum errors all mean the same to the user
            raise _download_error(name, err, os.path.abspath(raw_dir)) from None
    paths = [_find_file(f, folders) for f in files]
    missing = [f for f, p in zip(files, paths, strict=True) if p is None]
    if missing:
        raise ConfigError(
            f"{name}: {', '.join(missing)} (or .gz) not found in {os.path.abspath(raw_dir)} or "
            f"{os.path.abspath(data_dir)}; pass --download to fetch them (needs internet), or copy the IDX files there"
        )
    train_x, train_y, eval_x, eval_y = (read_idx(p) for p in paths)
    pixels = {"scale": 255.0, "mean": (mean,), "std": (std,)}
    return DatasetBundle(
        InMemoryDataset(train_x.unsqueeze(1), train_y.long(), **pixels),
        InMemoryDataset(eval_x.unsqueeze(1), eval_y.long(), **pixels),
        num_classes=10,
        input_shape=(1, *train_x.shape[1:]),
    )


def build_mnist(data_dir: str, download: bool) -> DatasetBundle:
    """MNIST (60,000 + 10,000 28x28 digits), decoded once into uint8 tensors."""
    return _build_idx_dataset("mnist", "MNIST", data_dir, download, MNIST_MEAN, MNIST_STD)


def build_fashion_mnist(data_dir: str, download: bool) -> DatasetBundle:
    """Zalando's FashionMNIST (same format and size as MNIST, ten kinds of clothing)."""
    return _build_idx_dataset(
        "fashion_mnist", "FashionMNIST", data_dir, download, FASHION_MNIST_MEAN, FASHION_MNIST_STD
    )


# ----------------------------------------------------------------------------- CIFAR-10 (python pickle batches)


class _ArraysOnlyUnpickler(pickle.Unpickler):
    """CIFAR's batches are pickles; allow the numpy array reconstructors and nothing else that could run code."""

    ALLOWED = {
        ("numpy", "ndarray"), ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        if module.startswith("numpy.core"):  # numpy 2 moved numpy.core to numpy._core
            module = module.replace("numpy.core", "numpy._core", 1)
        return super().find_class(module, name)


def _read_cifar_batch(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    def damaged(why: object) -> ConfigError:
        return ConfigError(f"cifar10: {path} is not a CIFAR-10 python batch ({why}); re-download it")

    try:
        with open(path, "rb") as fh:
            entry = _ArraysOnlyUnpickler(fh, encoding="latin1").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as err:
        raise damaged(first_line(err)) from None
    if not isinstance(entry, dict):
        raise damaged(f"it holds a {type(entry).__name__}, not a dict")
    entry = {k.decode() if isinstance(k, bytes) else k: v for k, v in entry.items()}
    try:
        data, labels = np.asarray(entry["data"], dtype=np.uint8), torch.tensor(entry["labels"], dtype=torch.long)
    except KeyError as err:
        raise damaged(f"no {err} entry") from None
    except (ValueError, TypeError, RuntimeError) as err:
        raise damaged(first_line(err)) from None
    if labels.ndim != 1 or data.size != labels.numel() * 3 * 32 * 32:
        raise damaged(f"{data.size} pixel values for {labels.numel()} labels; each image is 3x32x32")
    return torch.from_numpy(data.copy()).view(-1, 3, 32, 32), labels


def build_cifar10(data_dir: str, download: bool) -> DatasetBundle:
    """CIFAR-10 (50,000 + 10,000 32x32 colour images) from DATA_DIR/cifar-10-batches-py; training reads get
    a random crop (4-pixel zero padding) and horizontal flip."""
    folder = os.path.join(data_dir, "cifar-10-batches-py")
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    if not all(os.path.isfile(os.path.join(folder, n)) for n in names) and download:
        from torchvision.datasets import CIFAR10

        try:  # torchvision checks the archive's md5 before extracting it
            CIFAR10(root=data_dir, train=True, download=True)
        except Exception as err:
            raise _download_error("cifar10", err, os.path.abspath(folder)) from None
    missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
    if missing:
        raise ConfigError(
            f"cifar10: {', '.join(missing)} not found in {os.path.abspath(folder)}; pass --download to fetch "
            "them (needs internet), or extract cifar-10-python.tar.gz into --data_dir"
        )
    batches = [_read_cifar_batch(os.path.join(folder, n)) for n in names]
    train_x = torch.cat([b[0] for b in batches[:5]])
    train_y = torch.cat([b[1] for b in batches[:5]])
    pixels = {"scale": 255.0, "mean": CIFAR10_MEAN, "std": CIFAR10_STD}
    return DatasetBundle(
        InMemoryDataset(train_x, train_y, augment="crop_flip", **pixels),
        InMemoryDataset(*batches[5], **pixels),
        num_classes=10,
        input_shape=(3, 32, 32),
    )


# ----------------------------------------------------------------------------- image folders


def _open_image(path: str, mode: str):
    from PIL import Image

    try:
        with open(path, "rb") as fh:
            return Image.open(fh).convert(mode)
    except Exception as err:  # PIL raises several types (UnidentifiedImageError, OSError, SyntaxError, ...)
        raise DataError(f"imagefolder: {path} does not decode as an image ({type(err).__name__}: {first_line(err)}); "
                        "replace or remove that file") from None


EVAL_FOLDERS = ("val", "validation", "test", "eval")


def build_imagefolder(data_dir: str, download: bool, image_size: int | None = None) -> DatasetBundle:
    """Images in one subfolder per class: DATA_DIR/train/<class>/* and DATA_DIR/val/<class>/* (or test, eval),
    or DATA_DIR/<class>/* with a fixed 10% held out. Decoded per sample on the DataLoader path (workers)."""
    from PIL import Image
    from torchvision import transforms
    from torchvision.datasets import ImageFolder

    train_dir = os.path.join(data_dir, "train")
    root = train_dir if os.path.isdir(train_dir) else data_dir
    eval_dirs = [os.path.join(data_dir, d) for d in EVAL_FOLDERS if os.path.isdir(os.path.join(data_dir, d))]
    try:
        train = ImageFolder(root)
    except (FileNotFoundError, OSError) as err:
        raise ConfigError(
            f"imagefolder: {os.path.abspath(root)}: {err}; expected {data_dir}/<class>/<image> "
            f"or {data_dir}/train/<class>/<image> and {data_dir}/val/<class>/<image>"
        ) from None
    with Image.open(train.samples[0][0]) as first:  # the first image fixes the mode and, by default, the size
        mode = "L" if first.mode in ("1", "L", "I", "I;16", "F") else "RGB"
        width, height = (image_size, image_size) if image_size else first.size
    channels = 1 if mode == "L" else 3
    train.transform = transforms.Compose([
        transforms.Resize((height, width)),  # images of another size would break the batch
        transforms.ToTensor(),
        transforms.Normalize([0.5] * channels, [0.5] * channels),
    ])
    train.loader = functools.partial(_open_image, mode=mode)
    if root == train_dir and eval_dirs:
        eval_ = ImageFolder(eval_dirs[0], transform=train.transform, loader=train.loader, allow_empty=True)
        if not eval_.samples:  # as an empty eval split of --dataset hf: refused, not an evaluation of nothing
            raise ConfigError(f"imagefolder: {eval_dirs[0]} holds no images; put images in its class folders, or "
                              "remove it (a tenth of train is then held out)")
        _use_classes_of(eval_, train)
    elif len(train) < 2:
        raise ConfigError(f"imagefolder: {root} holds {len(train)} image and no eval folder to evaluate on (a tenth "
                          f"is held out when there is none); give it more images, or a {data_dir}/val/<class>/ folder")
    else:  # no separate eval folder: hold out a fixed 10% (seed 0), the same on every rank
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0)).tolist()
        n_eval = max(len(train) // 10, 1)
        train, eval_ = Subset(train, order[n_eval:]), Subset(train, order[:n_eval])
    return DatasetBundle(train, eval_, num_classes=_num_classes(train), input_shape=(channels, height, width))


def _num_classes(dataset: Dataset) -> int:
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    return len(dataset.classes)


def _use_classes_of(eval_folder, train_folder) -> None:
    """Index an eval folder's samples by the training folder's classes (the eval folder may lack some)."""
    extra = sorted(set(eval_folder.classes) - set(train_folder.classes))
    if extra:
        raise ConfigError(f"imagefolder: {eval_folder.root} has classes {extra} that the training folder lacks")
    eval_folder.samples = [(path, train_folder.class_to_idx[eval_folder.classes[t]]) for path, t in eval_folder.samples]
    eval_folder.imgs = eval_folder.samples
    eval_folder.targets = [t for _, t in eval_folder.samples]
    eval_folder.classes, eval_folder.class_to_idx = train_folder.classes, train_folder.class_to_idx


# ----------------------------------------------------------------------------- synthetic


def build_synthetic(
    data_dir: str, download: bool, samples: int = 2048, shape: tuple[int, ...] = (1, 28, 28), classes: int = 10
) -> DatasetBundle:
    """Gaussian inputs labelled by a fixed random linear teacher, so a model can learn them."""
    gen = torch.Generator().manual_seed(1234)
    n_eval = max(samples // 4, 1)
    inputs = torch.randn(samples + n_eval, *shape, generator=gen)
    teacher = torch.randn(inputs[0].numel(), classes, generator=gen)
    labels = (inputs.flatten(1) @ teacher).argmax(dim=1)
    return DatasetBundle(
        TensorDataset(inputs[:samples], labels[:samples]),
        TensorDataset(inputs[samples:], labels[samples:]),
        num_classes=classes,
        input_shape=tuple(shape),
    )


DATASETS: dict[str, Callable[..., DatasetBundle]] = {
    "digits": build_digits,
    "mnist": build_mnist,
    "fashion_mnist": build_fashion_mnist,
    "cifar10": build_cifar10,
    "imagefolder": build_imagefolder,
    "hf": build_hf,
    "synthetic": build_synthetic,
}


def build_datasets(
    name: str,
    data_dir: str,
    download: bool,
    *,
    samples: int = 2048,
    shape: tuple[int, ...] = (1, 28, 28),
    classes: int = 10,
    hf: HFSource | None = None,
    image_size: int | None = None,
) -> DatasetBundle:
    """Build a registered dataset or a user's ``pkg.module:function``.

    ``samples``, ``shape`` and ``classes`` size ``synthetic``; ``hf`` says where ``hf`` loads from;
    ``image_size`` resizes ``imagefolder`` and ``hf`` images. Call it on one process first, the
    others after it (``accel_ddp.data.resolve.local_main_first``, with ``main_first=download``): two
    processes downloading into one ``data_dir`` at once would write the same files.

        >>> bundle = build_datasets("digits", data_dir="data", download=False)
        >>> bundle.num_classes, bundle.input_shape
        (10, (1, 8, 8))
    """
    builder = resolve(name, DATASETS, kind="dataset", call_with=("data_dir", "download"),
                      expected="def build(data_dir: str, download: bool) -> DatasetBundle")
    if builder is build_synthetic:
        return build_synthetic(data_dir, download, samples, shape, classes)
    if builder is build_hf:
        source = hf or HFSource()
        result = (build_stream(data_dir, source, image_size) if source.streaming
                  else build_hf(data_dir, download, source=source, image_size=image_size))
    elif builder is build_imagefolder:
        result = build_imagefolder(data_dir, download, image_size=image_size)
    else:
        result = builder(data_dir=data_dir, download=download)
    if not isinstance(result, tuple) or len(result) != 4:
        raise ConfigError(
            f"--dataset {name} returned {type(result).__name__}; it must return "
            "(train, eval, num_classes, input_shape), e.g. accel_ddp.data.DatasetBundle"
        )
    train, eval_, num_classes, input_shape = result
    try:
        bundle = DatasetBundle(train, eval_, int(num_classes), tuple(int(d) for d in input_shape))
    except (TypeError, ValueError):
        raise ConfigError(f"--dataset {name} returned num_classes {num_classes!r} and input_shape {input_shape!r}; "
                          "expected an int and a tuple of ints, e.g. 10 and (1, 28, 28)") from None
    if bundle.num_classes < 2:  # one class: loss 0 and accuracy 1 from the start; none: nothing to predict
        raise ConfigError(f"--dataset {name} declares num_classes {bundle.num_classes}: a classifier needs 2 or more "
                          "classes (with one, every prediction is right and the loss is 0 from the start); return the "
                          "number of distinct labels")
    return bundle
