import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# The real benchmark files live beside the project, never inside it.
SHARED_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end tests (still run in CI by `make test`)")


@pytest.fixture(scope="session")
def shared_data():
    if not os.path.isdir(SHARED_DATA):
        pytest.skip(f"{SHARED_DATA} is absent (the benchmark files are not part of the project)")
    return SHARED_DATA
