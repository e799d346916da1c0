"""run.sh, the script that sets ringpipe up and launches its default job: a first install is never silent."""

import re
from pathlib import Path

RUN_SH = Path(__file__).resolve().parents[3] / "run.sh"


def test_every_install_shows_progress_and_says_what_it_installs():
    lines = RUN_SH.read_text().splitlines()
    installs = [i for i, line in enumerate(lines) if re.search(r"pip install", line)]
    assert installs, "run.sh installs nothing?"
    for i in installs:
        assert not re.search(r"\s-q\b|--quiet", lines[i]), lines[i]
        assert "--progress-bar on" in lines[i], lines[i]
        assert lines[i - 1].strip().startswith('echo "run.sh: installing'), lines[i - 1]
