"""Datasets and partitioners.

Images are float tensors in [0, 1] with shape (N, C, H, W): attacks and image metrics work in that
space (PSNR with data range 1). Tabular data is standardised with training statistics.
"""
from fedsim.data.partition import PARTITIONERS, partition
from fedsim.data.registry import Dataset, DatasetUnavailable, builtin_datasets, dataset_status, load_dataset

__all__ = ["Dataset", "DatasetUnavailable", "PARTITIONERS", "builtin_datasets", "dataset_status",
           "load_dataset", "partition"]
