"""Fixtures of the fault tests: the face an elastic program is written against."""

import pytest


@pytest.fixture(params=["torch", "tensorflow"])
def face(request):
    """The elastic program's face: ``ringpipe`` (PyTorch) or ``ringpipe.tensorflow`` (skipped without TensorFlow)."""
    if request.param == "tensorflow":
        pytest.importorskip("tensorflow")
    return request.param
