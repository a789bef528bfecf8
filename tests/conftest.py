"""Shared pytest setup.

- The `gpu` marker skips without CUDA.
- torchvision's CPU import fix is applied first: transformers imports torchvision whenever it
  is installed (see mg_server.launch.compat).
- `prepared_model`: the embedded SmolLM2 checkpoint (prepared once, cached across runs).
"""

from pathlib import Path

import pytest

from mg_server.launch.compat import fix_torchvision

fix_torchvision()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def prepared_model() -> Path:
    from mg_server.model.prepare import prepare_model

    return prepare_model(progress=False)
