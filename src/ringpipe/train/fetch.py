"""``ringpipe data fetch``: download MNIST, Fashion-MNIST or CIFAR-10 from their public mirrors, checksummed.

Each file is downloaded to a temporary name beside its destination, its MD5 compared with
the one its publishers give (the same digests torchvision checks), and only then renamed into
place; a file already present with the right digest is not downloaded again. Without network
the command fails with the URLs it tried and the manual steps: download them elsewhere, check
the digest, put the files into the data directory. The layouts written are the ones
``ringpipe train`` reads: the four IDX files (``.gz``) in ``--root``, and CIFAR-10's
``cifar-10-batches-py/`` extracted into ``--root``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tarfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DataFile", "SOURCES", "FetchError", "fetch", "md5_of", "manual_steps", "add_parser"]


@dataclass(frozen=True)
class DataFile:
    """One published file: its name, the mirrors that serve it (base URLs) and its MD5."""

    name: str
    md5: str
    mirrors: tuple[str, ...]
    extract: bool = False  # a tar archive to unpack into the data directory

    def urls(self, mirrors: Sequence[str] | None = None) -> list[str]:
        return [m.rstrip("/") + "/" + self.name for m in (mirrors or self.mirrors)]


_MNIST = ("https://ossci-datasets.s3.amazonaws.com/mnist", "http://yann.lecun.com/exdb/mnist")
_FASHION = ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com",)
_CIFAR = ("https://www.cs.toronto.edu/~kriz",)

#: The files of each dataset (``--config`` data names, with ``fashion-mnist`` also accepted).
SOURCES: dict[str, tuple[DataFile, ...]] = {
    "mnist": (
        DataFile("train-images-idx3-ubyte.gz", "f68b3c2dcbeaaa9fbdd348bbdeb94873", _MNIST),
        DataFile("train-labels-idx1-ubyte.gz", "d53e105ee54ea40749a09fcbcd1e9432", _MNIST),
        DataFile("t10k-images-idx3-ubyte.gz", "9fb629c4189551a2d022fa330f9573f3", _MNIST),
        DataFile("t10k-labels-idx1-ubyte.gz", "ec29112dd5afa0611ce80d1b7f02629c", _MNIST),
    ),
    "fashion_mnist": (
        DataFile("train-images-idx3-ubyte.gz", "8d4fb7e6c68d591d4c3dfef9ec88bf0d", _FASHION),
        DataFile("train-labels-idx1-ubyte.gz", "25c81989df183df01b3e8a0aad5dffbe", _FASHION),
        DataFile("t10k-images-idx3-ubyte.gz", "bef4ecab320f06d8554ea6380940ec79", _FASHION),
        DataFile("t10k-labels-idx1-ubyte.gz", "bb300cfdad3c16e7a12a480ee83cd310", _FASHION),
    ),
    "cifar10": (DataFile("cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a", _CIFAR, extract=True),),
}


class FetchError(RuntimeError):
    """A download failed or did not match its checksum; the message says what to do by hand."""


def dataset_key(name: str) -> str:
    """``fashion-mnist`` -> ``fashion_mnist``; an unknown name lists the valid ones."""
    key = name.lower().replace("-", "_")
    if key not in SOURCES:
        raise FetchError(f"unknown dataset {name!r}; ringpipe data fetch knows: mnist, fashion-mnist, cifar10")
    return key


def md5_of(path: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manual_steps(name: str, root: Path) -> str:
    """What to do without network: each URL, its MD5, where the file goes."""
    files = SOURCES[dataset_key(name)]
    lines = [f"to get {name} by hand, on a machine with network:"]
    for f in files:
        lines.append(f"  download {f.urls()[0]}  (md5 {f.md5})")
    lines.append(f"  check each with `md5sum FILE`, then copy the files into {root}/")
    if any(f.extract for f in files):
        lines.append(f"  and unpack: tar -xzf {root}/{files[0].name} -C {root}  (gives cifar-10-batches-py/)")
    lines.append(f"  (torchvision's download into {root} works too: its layout is recognised)")
    return "\n".join(lines)


def _download(url: str, dest: Path, timeout: float) -> None:
    part = dest.with_name(f".{dest.name}.part")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, part.open("wb") as out:
            shutil.copyfileobj(response, out, 1 << 20)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    os.replace(part, dest)


def _extract(archive: Path, root: Path) -> None:
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")  # no absolute paths, links out of root or devices


def fetch(name: str, root: str | Path, mirrors: Sequence[str] | None = None, timeout: float = 30.0,
          sources: dict[str, tuple[DataFile, ...]] | None = None, log: Any = print) -> Path:
    """Download dataset ``name`` into ``root`` (each file verified by MD5); returns ``root``.

    ``mirrors`` replaces the published base URLs (a local mirror, a ``file://`` folder).
    Raises :class:`FetchError` naming every URL tried and the manual steps.
    """
    key = dataset_key(name)
    files = (sources or SOURCES)[key]
    root = Path(root).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    for f in files:
        dest = root / f.name
        if dest.is_file() and md5_of(dest) == f.md5:
            log(f"{dest}: present, md5 ok")
        else:
            tried = []
            for url in f.urls(mirrors):
                log(f"downloading {url}")
                try:
                    _download(url, dest, timeout)
                except (urllib.error.URLError, OSError, TimeoutError) as exc:
                    reason = getattr(exc, "reason", exc)
                    tried.append(f"{url}: {reason}")
                    continue
                actual = md5_of(dest)
                if actual == f.md5:
                    break
                dest.unlink()
                tried.append(f"{url}: md5 {actual}, expected {f.md5} (a corrupt download or a changed mirror)")
            else:
                raise FetchError(
                    f"could not get {f.name} for {name}:\n  " + "\n  ".join(tried) + "\n" + manual_steps(name, root)
                )
            log(f"{dest}: md5 ok")
        if f.extract:
            _extract(dest, root)
            log(f"unpacked {dest.name} into {root}")
    return root


# ------------------------------------------------------------------------------ command line


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ringpipe data fetch NAME --root DIR``."""
    p = subparsers.add_parser("data", help="get the datasets of the bundled configs (mnist, fashion-mnist, cifar10)",
                              description="Datasets for ringpipe train.")
    sub = p.add_subparsers(dest="data_command", metavar="ACTION")
    f = sub.add_parser("fetch", help="download a dataset from its public mirrors, checking each file's MD5",
                       description=__doc__.split("\n\n")[1] if __doc__ else None)
    f.add_argument("name", metavar="NAME", help="mnist | fashion-mnist | cifar10")
    f.add_argument("--root", metavar="DIR", default=None,
                   help="where the files go (default: data/<name>, as the bundled configs read)")
    f.add_argument("--mirror", action="append", default=None, metavar="URL",
                   help="base URL to download from instead of the published mirrors (repeatable)")
    f.add_argument("--timeout", type=float, default=30.0, help="seconds per connection (default 30)")
    p.set_defaults(func=_run, parser=p)
    return p


def _run(args: argparse.Namespace) -> int:
    if getattr(args, "data_command", None) != "fetch":
        args.parser.print_help()
        return 2
    try:
        key = dataset_key(args.name)
        root = Path(args.root) if args.root else Path("data") / key.replace("_", "-")
        fetch(key, root, args.mirror, args.timeout)
    except FetchError as exc:
        print(f"ringpipe data fetch: {exc}", file=sys.stderr)
        return 1
    print(f"{args.name} is ready in {root}: ringpipe train --set data.name={key} --set data.root={root}")
    return 0
