"""Datasets and partitioners.

Images are float tensors in [0, 1] with shape (N, C, H, W): attacks and image metrics work in that
space (PSNR with data range 1). Tabular data is standardised with training statistics.
"""
from fedsim.data.partition import PARTITIONERS, partition
from fedsim.data.registry import DATASETS, Dataset, DatasetUnavailable, dataset_status, load_dataset

__all__ = ["DATASETS", "Dataset", "DatasetUnavailable", "PARTITIONERS", "dataset_status",
           "load_dataset", "partition"]
