"""Datasets (standard on-disk formats, train + test merged) and client partitions."""

from privfl.data.datasets import DATASETS, ImageDataset, load_dataset, read_idx, restricted_pickle_load
from privfl.data.partition import (
    PARTITIONS,
    ClientSplit,
    default_min_samples,
    longtail_class_sizes,
    partition_indices,
    plot_partition,
    split_train_test,
)

__all__ = [
    "DATASETS",
    "PARTITIONS",
    "ClientSplit",
    "ImageDataset",
    "default_min_samples",
    "load_dataset",
    "longtail_class_sizes",
    "partition_indices",
    "plot_partition",
    "read_idx",
    "restricted_pickle_load",
    "split_train_test",
]
