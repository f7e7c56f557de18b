import pytest
import torch


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    # Metric tests use tiny tensors; with pytest-xdist workers sharing two cores, OpenMP's
    # spinning threads would otherwise slow them down several times over.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
