"""Data: where samples come from and how each rank gets its share of every global batch.

One job per module, arrows pointing one way (``bundle`` and ``sampler`` depend on nothing here):

    bundle.py         DatasetBundle, what every dataset builder returns
    in_memory.py      InMemoryDataset: samples as one tensor, batch-wise augmentation and normalisation
    sampler.py        the global-batch permutation (seed, epoch) and position, shared by every loader
    device_loader.py  DeviceLoader / DeviceEvalLoader: an in-memory set served from the training device
    host_loader.py    HostLoader: a DataLoader over the same order, decoding in workers, batches copied to the device
    workers.py        DataLoader workers: deaf to the job's preemption signals, dead with their rank
    non_finite.py     host batches checked for nan/inf inputs in the worker that collates them
    mapped.py         MappedDataset: Arrow files read memory-mapped, decoded per batch
    streaming.py      StreamingLoader: a datasets.IterableDataset split over ranks, every rank in step
    hf_stream.py      --streaming: a Hugging Face image stream read once at start-up for its layout and classes
    hf_source.py      where Hugging Face datasets come from (Hub names, save_to_disk folders, files) and their columns
    hf.py             Hugging Face datasets held in memory (decoded once) or memory-mapped (decoded per batch)
    text.py           text for the text tasks: tokenized once per machine, packed or padded per batch
    text_cache.py     --text_cache: packed blocks kept on disk, keyed by the data files, tokenizer and packing
    builtin.py        digits, MNIST, FashionMNIST, CIFAR-10, imagefolder, synthetic; the registry
    loaders.py        choosing and building the train and eval loaders
    memory_budget.py  how much decoded data this machine holds per rank (host, cgroup, device)
    resolve.py        resolve_data: the data its options name (DataOptions), built on one process per machine first

May import: util, config, lifecycle.
"""

from accel_ddp.data.builtin import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    DATASETS,
    FASHION_MNIST_MEAN,
    FASHION_MNIST_STD,
    MNIST_MEAN,
    MNIST_STD,
    build_datasets,
    read_idx,
)
from accel_ddp.data.bundle import DataError, DatasetBundle
from accel_ddp.data.device_loader import DeviceEvalLoader, DeviceLoader
from accel_ddp.data.hf_source import HFSource
from accel_ddp.data.host_loader import HostLoader, SeededSamples, default_num_workers, usable_cpus
from accel_ddp.data.in_memory import InMemoryDataset
from accel_ddp.data.loaders import (
    Loaders,
    build_eval_loader,
    build_loaders,
    choose_loader,
)
from accel_ddp.data.mapped import MappedDataset
from accel_ddp.data.sampler import GlobalBatchSampler, PlacedBatch, epoch_order, steps_per_epoch
from accel_ddp.data.streaming import StreamingLoader

__all__ = [
    "CIFAR10_MEAN", "CIFAR10_STD", "DATASETS", "FASHION_MNIST_MEAN", "FASHION_MNIST_STD", "MNIST_MEAN", "MNIST_STD",
    "DataError", "DatasetBundle", "DeviceEvalLoader", "DeviceLoader", "GlobalBatchSampler", "HFSource", "HostLoader",
    "InMemoryDataset", "Loaders", "MappedDataset", "PlacedBatch", "SeededSamples", "StreamingLoader",
    "build_datasets", "build_eval_loader", "build_loaders", "choose_loader",
    "default_num_workers", "epoch_order", "read_idx", "steps_per_epoch", "usable_cpus",
]
