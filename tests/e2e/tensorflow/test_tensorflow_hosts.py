"""``is_homogeneous`` on ranks placed on several hosts: True only when every host runs as many ranks.

Network-namespace hosts on this machine (``tests/netns.py``, each with its own hostname), one
``ringpipe launch --nnodes`` on each; the ranks answer from the torch face and the TensorFlow
face. Horovod's definition, written here: every node has the same number of ranks. Needs root
(namespaces) and TensorFlow.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

import netns  # noqa: E402

SCRIPT = str(Path(__file__).resolve().parents[2] / "scripts" / "tf_features_hosts.py")
REASON = netns.can_create()
pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(REASON is not None, reason=REASON or "")]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "RINGPIPE_BACKEND")}
    return {**env, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3", "TF_NUM_INTRAOP_THREADS": "1",
            "TF_NUM_INTEROP_THREADS": "2", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}


@pytest.mark.parametrize("per_host, port", [((2, 1), 29671), ((1, 1), 29672)], ids=["2+1", "1+1"])
def test_is_homogeneous_across_namespace_hosts(tmp_path, per_host, port):
    with netns.two_hosts() as hosts:
        done = netns.launch_across(hosts, per_host, [SCRIPT, str(tmp_path)], port, _env(), timeout=500)
    for p in done:
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    size = sum(per_host)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(size)]
    homogeneous = len(set(per_host)) == 1  # Horovod: every node has the same number of ranks
    for r, t in enumerate(ranks):
        node = 0 if r < per_host[0] else 1  # ranks fill host a first
        assert t["host"] == hosts[node].hostname
        assert (t["tf"], t["api"]) == (homogeneous, homogeneous)
        assert (t["local_size"], t["cross_size"], t["size"]) == (per_host[node], 2, size)


def test_the_tensorflow_face_answers_with_the_torch_faces_function():
    import ringpipe
    import ringpipe.tensorflow as hvd

    assert hvd.is_homogeneous is ringpipe.is_homogeneous
    assert sys.modules["ringpipe.core.basics"].is_homogeneous is ringpipe.is_homogeneous
