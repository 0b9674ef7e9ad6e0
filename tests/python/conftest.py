import os
from pathlib import Path

# Which product (torch's GEMM or Octavo's kernel) runs at which row count must not depend on the
# machine the tests run on: the engine keeps layers/linear.py's built-in table instead of
# measuring this CPU (test_crossover.py tests the measurement itself).
os.environ.setdefault("OCTAVO_LINEAR_CROSSOVER", "builtin")

import pytest  # noqa: E402
from hypothesis import settings
from hypothesis.database import DirectoryBasedExampleDatabase

from octavo import _C

# Keep hypothesis' example database in build/ rather than wherever pytest was started.
settings.register_profile(
    "octavo", database=DirectoryBasedExampleDatabase(Path(__file__).resolve().parents[2] / "build" / ".hypothesis")
)
settings.load_profile("octavo")


@pytest.fixture(params=_C.supported_cpu_isas())
def isa(request):
    """Runs the test once per CPU kernel level this machine supports, restoring the active one."""
    previous = _C.cpu_isa()
    _C.set_cpu_isa(request.param)
    yield request.param
    _C.set_cpu_isa(previous)


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    """A tiny random Llama with a real byte-level BPE tokenizer, shared by the tests that start engines."""
    from test_detokenizer import _byte_level_bpe
    from test_models import tiny_checkpoint

    path = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = _byte_level_bpe()
    tokenizer.save_pretrained(path)
    tiny_checkpoint("llama", path, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    return path


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
