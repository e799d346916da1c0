"""The TensorFlow modules' rank scripts, run in few jobs: one launch per world size, backend and Keras.

``tf_jobs.results(script, n, mpi=..., legacy=...)`` gives what the script wrote on every rank; the
first test that asks for a script of a job (``tests/tf_ranks.py``, ``JOBS``) launches every script of
that job in one run of ``tests/scripts/tf_jobs.py``, the later ones read the results kept for the
session. Each rank then imports TensorFlow and torch once for the job's scripts instead of once
per script.
"""

from __future__ import annotations

import pytest

from tf_ranks import TFJobs


@pytest.fixture(scope="session")
def tf_jobs(tmp_path_factory: pytest.TempPathFactory) -> TFJobs:
    return TFJobs(tmp_path_factory.mktemp("tf_jobs"))
