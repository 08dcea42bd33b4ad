"""Test setup: run Triton kernels through the interpreter on CPU, register the `gpu` / `slow` markers, and share the
cores between pytest-xdist's workers.
TRITON_INTERPRET must be set before triton (or any kernel module) is imported, hence at the very top."""
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# inductor's on-disk graph cache does not notice a custom op's fake changing: a graph cached before such a change
# would fail the compile tests with the old sizes
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # flat repo: import model, ...
workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if workers > 1:  # pytest -n: the workers share the cores, and more torch threads than that would oversubscribe them
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it")
    config.addinivalue_line("markers", "slow: long CPU test (runs by default; deselect with -m 'not slow')")
    config.addinivalue_line("markers", "xdist_group(name): with pytest -n --dist loadgroup, one worker runs the group")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():  # with pytest -n, the GPU tests run one at a time in one worker (--dist loadgroup)
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.xdist_group("gpu"))
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def one_thread():
    """Decode runs hundreds of tiny ops per step: one thread is several times faster than two on a busy CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
