"""Fixtures the method tests share: runs that tests of more than one method compare with.

A fixture here is built once per test worker that asks for it (session scope): with ``--dist loadfile``
the files that use it may run on different workers, each building its own copy.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import FMNIST, train

#: 3 clients of unequal size (Dirichlet 1.0; the sample weighting shows), 2 rounds on 300 samples, homo-cnn4
UNEQUAL_TINY = ["--subsample", "300", "--no-progress", "--batch-size", "32", "--num-clients", "3", "--rounds", "2"]
UNEQUAL_TINY += ["--partition", "dir", "--alpha", "1.0", "--min-samples", "10", "--model-group", "homo-cnn4"]


@pytest.fixture(scope="session")
def unequal_fedavg(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path]:
    """FedAvg on :data:`UNEQUAL_TINY`, trained once: FedProx with mu = 0 and FedBN on a model without
    BatchNorm must give this run exactly. Returns the arguments (to train the other method with) and the run."""
    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    return UNEQUAL_TINY, train(tmp_path_factory.mktemp("unequal-fedavg"), "fedavg", *UNEQUAL_TINY, name="fedavg")
