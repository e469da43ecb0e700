import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA devices")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "multi_gpu" in item.keywords and torch.cuda.device_count() < 2:
            item.add_marker(skip_multi)


@pytest.fixture(scope="session")
def kiln_cache_dir():
    """One cache dir for the whole session (converted weights, compiled artifacts)."""
    from kiln.config import default_cache_dir

    return default_cache_dir()
