"""Shared fixtures and tolerance tables."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib

import pytest
import torch

DATA = pathlib.Path(__file__).parent / "data"
# The tests load the kernel's test build (its failure injection compiled in: backends/native.py,
# csrc/test_hooks.c), set before anything loads the library; the servers the tests start inherit it.
os.environ.setdefault("GQA_KERNEL_TEST_HOOKS", "1")


def pytest_configure(config):
    # The Python client is a distribution of its own (clients/python); the server's CLI and many
    # tests use it. Say how to get it rather than failing each of them on an import.
    if importlib.util.find_spec("gqa_client") is None:
        raise pytest.UsageError(
            "gqa_client is not importable: install the Python client (pip install -e clients/python; "
            "make does) or put clients/python on PYTHONPATH"
        )


# Tolerances are data: (atol, rtol) of an output against the float64 oracle run on the same
# (already rounded) inputs. Half types are bounded by rounding the output to 8 / 11 bits.
TOLERANCES = {
    torch.float32: (2e-5, 1e-4),
    torch.float16: (2e-3, 4e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float64: (1e-12, 1e-10),
}


@pytest.fixture(scope="session")
def seed_examples() -> list[dict]:
    return json.loads((DATA / "examples.json").read_text())


def assert_close_to_oracle(actual: torch.Tensor, expected, dtype: torch.dtype, what: str = "output") -> None:
    atol, rtol = TOLERANCES[dtype]
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.to(torch.float64), expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")
