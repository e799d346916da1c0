"""The launcher's name on its own lines: the command the user ran.

``ringpipe launch`` labels what it says itself (a rank that failed, an interruption, the hosts
it starts) ``ringpipe launch:``. Under ``ringpipe-horovodrun`` (or its ``horovodrun`` alias)
the same launcher runs, and labels its lines as horovodrun's own usage lines are labelled,
``horovodrun (ringpipe):``, so that a user reads the name of the command they typed.
"""

from __future__ import annotations

__all__ = ["label", "speak_as", "LAUNCH", "HOROVODRUN"]

#: The label of ``ringpipe launch``'s own lines.
LAUNCH = "ringpipe launch"
#: The label of ringpipe's ``horovodrun`` (its usage lines, and the launcher's under it).
HOROVODRUN = "horovodrun (ringpipe)"

_label = [LAUNCH]


def label() -> str:
    """How the launcher names itself in this process."""
    return _label[0]


def speak_as(name: str) -> None:
    """Name the launcher ``name`` from now on in this process (horovodrun's entry point does)."""
    _label[0] = name
