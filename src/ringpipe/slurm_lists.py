"""Slurm's compressed lists: host lists (``node[01-04,07]``), tasks per node (``2(x3),1``) and a job's port.

What :mod:`ringpipe.env` reads a Slurm job step's layout with, and what the launcher derives a
rendezvous port from; plain text in, plain values out.
"""

from __future__ import annotations

import re

__all__ = ["expand_nodelist", "expand_tasks_per_node", "slurm_port"]

_BRACKET = re.compile(r"\[([^\]]*)\]")



def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise ValueError(f"unbalanced brackets in Slurm node list {text!r}")
    parts.append("".join(cur))
    return [p for p in parts if p]


def _expand_range(spec: str) -> list[str]:
    out: list[str] = []
    for item in spec.split(","):
        if "-" in item:
            lo, hi = item.split("-", 1)
            width = len(lo)
            if int(hi) < int(lo):
                raise ValueError(f"descending range {item!r} in Slurm node list")
            out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
        elif item:
            out.append(item)
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm compressed host list, keeping zero padding.

    ``node[01-04,07]`` -> node01..node04, node07; ``rack[1-2]-n[01-02]`` -> rack1-n01, rack1-n02,
    rack2-n01, rack2-n02; ``a[1-2],b3`` -> a1, a2, b3.
    """
    hosts: list[str] = []
    for part in _split_top_level(nodelist.strip()):
        pieces: list[list[str]] = []
        pos = 0
        for m in _BRACKET.finditer(part):
            pieces.append([part[pos : m.start()]])
            pieces.append(_expand_range(m.group(1)))
            pos = m.end()
        pieces.append([part[pos:]])
        combos = [""]
        for choices in pieces:
            combos = [c + x for c in combos for x in choices]
        hosts.extend(combos)
    return hosts


def expand_tasks_per_node(spec: str) -> list[int]:
    """Expand ``SLURM_TASKS_PER_NODE`` such as ``2(x3),1`` into ``[2, 2, 2, 1]``."""
    out: list[int] = []
    for item in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            raise ValueError(f"cannot parse SLURM_TASKS_PER_NODE item {item!r}")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def slurm_port(job_id: str | int, base: int = 20000, span: int = 20000) -> int:
    """A rendezvous port derived from the job id, the same on every node of the job."""
    digits = re.sub(r"\D", "", str(job_id)) or "0"
    return base + int(digits) % span
