"""The pipeline doctor names the one slow link of a 3-stage pipeline on three namespace hosts, and no link on a fair network.

Three hosts (network namespaces joined by a bridge, ``tests/netns.py``), one 1F1B stage each under
``ringpipe launch --nnodes 3``: an MLP whose activations and gradients are 128 KiB per micro-batch
(``tests/scripts/pipeline_link.py``). In the first run only the path between hosts b and c
(stages 1 and 2) is shaped to 20 Mbit/s with ``tc tbf`` both ways (about 50 ms per message, against
passes of a few ms): ``ringpipe doctor EVENTS`` names the link between stage 1 (rp-host-b) and
stage 2 (rp-host-c) and no other, and its JSON marks that link slow among both links' figures. The second
run, on the same hosts unshaped, gets no link finding.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import netns

REASON = netns.can_create()
#: one worker for every job on namespace hosts timed by the doctor (this file and its twin in tests/e2e/{observe,pipeline}):
#: two at once on the 2 cores would slow each other's messages, and the doctor reads message waits
pytestmark = pytest.mark.xdist_group("doctor_on_namespace_hosts")
SCRIPT = str(Path(__file__).resolve().parents[2] / "scripts" / "pipeline_link.py")



def _doctor(events: Path, pair_rates: dict[tuple[int, int], str] | None, port: int) -> dict:
    with netns.bridged_hosts(3, pair_rates=pair_rates) as hosts:
        outs = netns.launch_across(hosts, (1, 1, 1), [SCRIPT, str(events), "--steps", "8"], port, netns.job_env(),
                                   timeout=200)
    for o in outs:
        assert o.returncode == 0, o.stdout[-2000:] + o.stderr[-3000:]
    out = subprocess.run([sys.executable, "-m", "ringpipe.cli", "doctor", "--json", str(events)],
                         capture_output=True, text=True, env=netns.job_env(), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _links(report: dict) -> list[dict]:
    return [f for f in report["findings"] if f["what"].startswith("the link between")]


@pytest.mark.netns
@pytest.mark.timeout(600)
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_the_shaped_link_between_stages_1_and_2_is_named_and_an_unshaped_network_gets_no_link_finding(tmp_path):
    shaped = _doctor(tmp_path / "shaped.json", {(1, 2): "20mbit"}, 29671)
    assert shaped["hosts"] == ["rp-host-a", "rp-host-b", "rp-host-c"]
    named = _links(shaped)
    assert [(f["severity"], f["hosts"]) for f in named] == [("problem", ["rp-host-b", "rp-host-c"])], named
    assert named[0]["what"].startswith("the link between stage 1 (host rp-host-b) and stage 2 (host rp-host-c) "
                                       "is slow: ")
    assert "x the other links" in named[0]["what"]
    # the figures behind it, in the JSON: every link, the named one marked slow
    links = shaped["pipeline"]["links"]
    assert [(x["up"], x["down"], x["down_host"], x["slow"]) for x in links] == \
        [(0, 1, "rp-host-b", False), (1, 2, "rp-host-c", True)], links
    assert links[1]["message_s"] >= 3 * links[0]["message_s"]

    fair = _doctor(tmp_path / "fair.json", None, 29673)
    assert _links(fair) == [], _links(fair)
    # the figures are in the breakdown either way
    info = next(f for f in fair["findings"] if f["what"].startswith("pipeline stages idle"))
    assert "waits on the links between stages per step: stage 0 (host rp-host-a) and stage 1 (host rp-host-b)" \
        in info["evidence"]
    assert [x["slow"] for x in fair["pipeline"]["links"]] == [False, False]
