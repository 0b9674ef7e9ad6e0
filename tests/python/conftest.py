from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis.database import DirectoryBasedExampleDatabase

# Keep hypothesis' example database in build/ rather than wherever pytest was started.
settings.register_profile(
    "octavo", database=DirectoryBasedExampleDatabase(Path(__file__).resolve().parents[2] / "build" / ".hypothesis")
)
settings.load_profile("octavo")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; skipped when none is available")


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device available")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
