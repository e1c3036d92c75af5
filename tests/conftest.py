"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matmuls: on a shared, loaded machine one torch thread is far faster than two (threads
    only add synchronisation). Modules opt in with `pytestmark`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
