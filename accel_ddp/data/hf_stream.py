"""``--streaming`` for a Hugging Face image dataset: the stream to train on, read once at start-up for its layout.

    bundle = build_stream("data/my_images", HFSource(streaming=True), image_size=None)

The first ``STATS_SAMPLE`` training rows (the same on every rank) give the image layout and the
normalisation statistics, the eval split is read into memory, and the labels are checked against
the classes known then. How the stream is then split over the ranks and kept in step:
:mod:`accel_ddp.data.streaming`. Here, not in :mod:`accel_ddp.data.hf`, so that neither of those two
imports the other (``builtin`` chooses between them).
"""

from __future__ import annotations

from accel_ddp.data.bundle import DataError, DatasetBundle
from accel_ddp.data.hf import STATS_SAMPLE, LabelValues, class_ids, uint8_stats
from accel_ddp.data.hf_source import empty_split, input_column_of, label_column_of, load_splits
from accel_ddp.data.mapped import ImageRows, MappedDataset, image_mode, open_image
from accel_ddp.data.streaming import StreamSource, read_failure
from accel_ddp.util.validation import ConfigError


def build_stream(data_dir: str, source, image_size: int | None) -> DatasetBundle:
    """The ``--streaming`` bundle: a :class:`StreamSource` to train on and the eval split read into memory."""
    import datasets

    train, eval_stream = load_splits(data_dir, source, streaming=True)
    if train.features is None:
        raise ConfigError("--streaming: the stream does not declare its columns; save it with its features")
    label_col = label_column_of(train, source.label_column)
    input_col = input_column_of(train, source.image_column, label_col)
    if input_col is None or not isinstance(train.features[input_col], datasets.Image):
        raise ConfigError("--streaming reads image datasets for now (an Image column); drop --streaming for others")
    train = train.cast_column(input_col, datasets.Image(decode=False))
    files = None if source.name else data_dir
    try:
        head = [row for _, row in zip(range(STATS_SAMPLE), train, strict=False)]  # the same rows on every rank
        raw_eval = None if eval_stream is None else eval_stream.cast_column(input_col, datasets.Image(decode=False))
        eval_rows = [] if raw_eval is None else list(raw_eval)
    except Exception as err:  # a damaged file among the first ones: named before training
        raise ConfigError(read_failure(err, files)) from None
    where = source.name or data_dir
    if not head:
        raise ConfigError(empty_split(source.train_split, where, "--hf_train_split"))
    if eval_stream is not None and not eval_rows:  # the other paths refuse an empty eval split too
        raise ConfigError(empty_split(str(eval_stream.split or source.eval_split or "eval"), where, "--hf_eval_split"))
    label_ids, num_classes = _stream_labels(train.features[label_col], head + eval_rows, label_col)
    first = open_image(head[0][input_col])
    mode, size = image_mode(first), (image_size, image_size) if image_size else first.size
    layout = dict(image_column=input_col, label_column=label_col, mode=mode, size=size,
                  resize=image_size is not None, label_ids=label_ids)
    sample = ImageRows(**layout, mean=(0.0,), std=(1.0,), split="train").pixels(
        [row[input_col] for row in head], [f"example {i}" for i in range(len(head))])
    mean, std = uint8_stats(sample)
    decode = _CheckedLabels(ImageRows(**layout, mean=mean, std=std, split="train"), num_classes, label_col)
    eval_set = None
    if eval_rows:
        table = datasets.Dataset.from_list(eval_rows, features=train.features)
        eval_set = MappedDataset(table, ImageRows(**layout, mean=mean, std=std, split="eval"))
    channels = 1 if mode == "L" else 3
    origin = f"{source.name} ({source.config or 'default'})" if source.name else None
    return DatasetBundle(StreamSource(train, decode, source.shuffle_buffer, files, head[:2], origin), eval_set,
                         num_classes, (channels, size[1], size[0]))


def _stream_labels(feature, rows: list[dict], column: str) -> tuple[dict[str, int] | None, int]:
    """``class_ids`` from the labels of the eval split and the first training rows (a stream is not read whole)."""
    values = [row[column] for row in rows]
    return class_ids(feature, column, LabelValues(
        all(isinstance(v, int) for v in values), lambda: (min(values), max(values), True),
        lambda high: "among the first training rows and the eval split", lambda: sorted({str(v) for v in values})))


class _CheckedLabels:
    """A decoder that refuses labels beyond the classes known at start-up (a stream's are not all seen)."""

    def __init__(self, decode, num_classes: int, column: str):
        self.decode, self.num_classes, self.column = decode, num_classes, column

    def __call__(self, columns: dict[str, list], where: list[str]) -> list:
        label_ids = self.decode.label_ids
        for value, place in zip(columns[self.column], where, strict=True):
            if (label_ids is not None and str(value) not in label_ids) or \
                    (label_ids is None and not 0 <= int(value) < self.num_classes):
                raise DataError(f"streaming: {place} has label {value!r} in {self.column!r}, not among the "
                                f"{self.num_classes} classes of the eval split and the first training rows; "
                                "store the labels as a ClassLabel column (it names every class)")
        return self.decode(columns, where)
