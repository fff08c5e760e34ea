"""Where and how torch computes: the device (``device = auto``, deterministic CUDA) and the thread count."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch threads (``simulation.threads``; 0 keeps torch's setting). On a
    shared machine one thread is often several times faster than torch's default of one per core."""
    if n <= 0:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` picks CUDA when present, else CPU; ``cpu``/``cuda``/``cuda:N`` are taken as given.

    A CUDA device is put in deterministic, full-precision mode (:func:`deterministic_cuda`) before it is
    returned, so a seed gives the same numbers on a GPU as it does on a CPU: run to run, bit for bit."""
    if device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available on this machine; use 'auto' or 'cpu'")
    if dev.type == "cuda":
        deterministic_cuda()
    return dev


def deterministic_cuda() -> None:
    """Same seed, same metrics on a GPU (the project's determinism rule), and float32 as on a CPU.

    By default cuDNN picks convolution algorithms by timing them and several CUDA kernels (convolution
    and scatter backward passes) add with atomics, so two runs of one seed differ in the last bits and
    then everywhere; TF32 tensor cores round float32 products to 10 mantissa bits, which is enough to
    cap a gradient-inversion attack's PSNR. This turns all of that off, for the whole process: cuDNN's
    deterministic algorithms, no autotuning, torch's deterministic implementations (with a warning for
    an op that has none) and cuBLAS's fixed workspace, and no TF32. Idempotent; costs speed, not results.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS first starts
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
