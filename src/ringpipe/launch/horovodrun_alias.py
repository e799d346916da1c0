"""The opt-in ``horovodrun`` command: ringpipe's horovodrun under Horovod's own name.

ringpipe installs its horovodrun as ``ringpipe-horovodrun`` only, so that it never shadows a real
Horovod's ``horovodrun`` in the same environment (pip cannot tie a console script to an extra).
``ringpipe-horovodrun --install-alias`` writes a ``horovodrun`` script beside the interpreter's
other scripts; it refuses when a ``horovodrun`` that ringpipe did not write is already there
(``--force`` replaces it), and ``--remove-alias`` takes ringpipe's away again.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["install_alias", "remove_alias", "AliasError", "MARK"]

#: The line that tells ringpipe's script from another package's.
MARK = "# horovodrun of ringpipe (ringpipe-horovodrun --install-alias)"


class AliasError(RuntimeError):
    """The alias cannot be written or removed as asked; the message says why and what to do."""


def _target(bin_dir: str | os.PathLike[str] | None) -> Path:
    return Path(bin_dir if bin_dir is not None else Path(sys.executable).parent) / "horovodrun"


def _ours(path: Path) -> bool:
    try:
        return MARK in path.read_text(errors="replace")[:4096]
    except OSError:
        return False


def install_alias(bin_dir: str | os.PathLike[str] | None = None, force: bool = False) -> Path:
    """Write ``horovodrun`` into ``bin_dir`` (default: the interpreter's directory); return its path."""
    path = _target(bin_dir)
    if path.exists() and not _ours(path) and not force:
        raise AliasError(
            f"{path} exists and was not written by ringpipe (a real Horovod's horovodrun?); it was left "
            "alone. Run ringpipe's as ringpipe-horovodrun, or pass --force to replace it"
        )
    text = (
        f"#!{sys.executable}\n{MARK}\nimport sys\n\n"
        "from ringpipe.launch.horovodrun import main\n\nsys.exit(main())\n"
    )
    try:
        path.write_text(text)
        path.chmod(0o755)
    except OSError as exc:
        raise AliasError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


def remove_alias(bin_dir: str | os.PathLike[str] | None = None) -> Path:
    """Remove the ``horovodrun`` that :func:`install_alias` wrote; refuse to remove anyone else's."""
    path = _target(bin_dir)
    if not path.exists():
        raise AliasError(f"{path} does not exist: there is no alias to remove")
    if not _ours(path):
        raise AliasError(f"{path} was not written by ringpipe; it was left alone")
    path.unlink()
    return path
