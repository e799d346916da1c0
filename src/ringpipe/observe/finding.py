"""A finding of the doctor: how bad, what, the evidence in figures, and what to do about it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Finding"]


@dataclass(frozen=True)
class Finding:
    """One diagnosis: how bad (``problem`` or ``info``), what, and what to do about it."""

    severity: str
    what: str
    evidence: str
    fix: str = ""
    rank: int | None = None
    hosts: tuple[str, ...] = ()

    def text(self) -> str:
        out = f"[{self.severity}] {self.what}\n    evidence: {self.evidence}"
        return out + (f"\n    what to do: {self.fix}" if self.fix else "")
