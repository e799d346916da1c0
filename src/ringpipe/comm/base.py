"""The Communicator protocol, its operations, and the one instrumented choke point.

Every public operation of a communicator goes through :meth:`Communicator._traced`, which
records an event (op, bytes, peer, start, end, tag) in the process event log, checks the
arguments (device, dtype, ranks) and then calls the backend's ``_op`` method. Before a
collective, every rank's call is compared with every other rank's
(:mod:`ringpipe.check.doubling_exchange`), so that a mismatch or an invalid argument on one rank
raises the same error on all of them instead of aborting, hanging or returning wrong numbers.
Backends (c10d for gloo/NCCL, mpi4py for MPI) implement only the underscored methods.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ringpipe.comm.events import END, START, EventLog, add_blocked, default_log
from ringpipe.comm.work import CommError, ReduceOp, Work, nbytes_of, raise_departure
from ringpipe.env import Topology

__all__ = ["ReduceOp", "Work", "Communicator", "CommError", "nbytes_of"]


class Communicator(ABC):
    """A group of ranks that can exchange tensors. Ranks are numbered inside the group.

    Sub-communicators are created by :meth:`split`; ``global_ranks[i]`` is the world rank of
    member ``i``. Tensors must live where the backend expects them (CPU for gloo and MPI,
    the pinned CUDA device for NCCL) and be contiguous.
    """

    backend: str = "?"

    def __init__(
        self,
        rank: int,
        size: int,
        topology: Topology,
        global_ranks: Sequence[int],
        name: str = "world",
        log: EventLog | None = None,
    ) -> None:
        self.rank = rank
        self.size = size
        self.topology = topology
        self.global_ranks = list(global_ranks)
        self.name = name
        self.log = log or default_log()
        self._node: Communicator | None = None
        self._leaders: Communicator | None | bool = False
        from ringpipe.check.doubling_exchange import checks_enabled

        #: Compare every collective call across ranks before data moves (see ``unchecked``).
        self.check_calls = checks_enabled()
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} backend={self.backend} rank={self.rank}/{self.size}>"

    # ------------------------------------------------------------------ checks

    def _check_tensor(self, tensor: torch.Tensor, what: str) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_contiguous():
            raise CommError(f"{what}: tensor must be contiguous (call .contiguous() first)")
        self._check_device(tensor, what)

    def _check_device(self, tensor: torch.Tensor, what: str) -> None:  # noqa: B027 - optional hook
        """Backends override this to refuse tensors on a device they cannot serve."""

    def _check_peer(self, peer: int, what: str) -> None:
        if not isinstance(peer, int) or not 0 <= peer < self.size:
            raise CommError(f"{what}: peer rank {peer!r} is not in [0, {self.size}) of {self.name}")
        if peer == self.rank:
            raise CommError(f"{what}: rank {self.rank} cannot send to or receive from itself")

    # ------------------------------------------------------------------ cross-rank check

    @contextlib.contextmanager
    def unchecked(self) -> Iterator[None]:
        """Collectives made by this thread inside the block skip the cross-rank check.

        For callers that agreed on their calls another way (an announced collective, buckets
        whose layout was compared once); every rank must then make the same calls.
        """
        before = getattr(self._local, "unchecked", False)
        self._local.unchecked = True
        try:
            yield
        finally:
            self._local.unchecked = before

    def _checking(self) -> bool:
        return self.check_calls and self.size > 1 and not getattr(self._local, "unchecked", False)

    def _agree(self, coll: str, validate: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Validate this rank's call of ``coll`` and agree on it with every rank; return its fields.

        An invalid call still takes part in the check, so every rank raises its error.
        """
        if not self._checking():
            return validate()
        from ringpipe.check.doubling_exchange import check_call

        try:
            fields = validate()
        except (TypeError, ValueError, CommError) as exc:
            check_call(self, coll, None, exc)
            raise AssertionError("the check of an invalid call always raises") from exc  # unreachable
        check_call(self, coll, fields, None)
        return fields

    def _tensor_call(self, what: str, tensor: torch.Tensor, op: ReduceOp | str | None = None,
                     root: int | None = None) -> dict[str, Any]:
        """Check one tensor argument (and op, root); the fields every rank must agree on."""
        self._check_tensor(tensor, what)
        fields: dict[str, Any] = {"dtype": tensor.dtype, "numel": tensor.numel(), "shape": list(tensor.shape)}
        if op is not None:
            fields["op"] = ReduceOp.parse(op)
        if root is not None:
            self._check_root(root, what)
            fields["root"] = root
        return fields

    # ------------------------------------------------------------------ choke point

    def _traced(self, op: str, nbytes: int, peer: int, tag: int, fn: Callable[[], Any]) -> Any:
        ev = self.log.begin(op, nbytes, peer, tag, self.name)
        try:
            return fn()
        except RuntimeError as exc:
            raise_departure(exc, ev)
            raise
        finally:
            EventLog.end(ev)
            add_blocked(ev[END] - ev[START])  # a synchronous operation blocks its caller throughout

    def _checked(self, op: str, nbytes: int, peer: int, validate: Callable[[], dict[str, Any]],
                 run: Callable[[dict[str, Any]], Any]) -> Any:
        """A collective: its event begins, every rank agrees on the call, then ``run(fields)``."""
        return self._traced(op, nbytes, peer, 0, lambda: run(self._agree(op, validate)))

    def _traced_async(self, op: str, nbytes: int, peer: int, tag: int, fn: Callable[[], Work]) -> Work:
        ev = self.log.begin(op, nbytes, peer, tag, self.name)
        try:
            work = fn()
        except BaseException:
            EventLog.end(ev)
            raise
        work._event = ev
        if work._done:
            EventLog.end(ev)
        return work

    # ------------------------------------------------------------------ point to point

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self._check_tensor(tensor, "send")
        self._check_peer(dst, "send")
        self._traced("send", nbytes_of(tensor), dst, tag, lambda: self._send(tensor, dst, tag))

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        self._check_tensor(tensor, "recv")
        self._check_peer(src, "recv")
        self._traced("recv", nbytes_of(tensor), src, tag, lambda: self._recv(tensor, src, tag))
        return tensor

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        self._check_tensor(tensor, "isend")
        self._check_peer(dst, "isend")
        return self._traced_async("isend", nbytes_of(tensor), dst, tag, lambda: self._isend(tensor, dst, tag))

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        self._check_tensor(tensor, "irecv")
        self._check_peer(src, "irecv")
        return self._traced_async("irecv", nbytes_of(tensor), src, tag, lambda: self._irecv(tensor, src, tag))

    # ------------------------------------------------------------------ collectives

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM) -> torch.Tensor:
        """Reduce ``tensor`` in place across ranks; returns it."""
        self._checked("allreduce", _nbytes(tensor), -1, lambda: self._tensor_call("allreduce", tensor, op),
                      lambda f: self._allreduce(tensor, f["op"]))
        return tensor

    def iallreduce(self, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM) -> Work:
        """Asynchronous in-place allreduce; ``wait()`` returns the tensor."""
        return self._traced_async(
            "allreduce", _nbytes(tensor), -1, 0,
            lambda: self._iallreduce(tensor, self._agree("allreduce",
                                                         lambda: self._tensor_call("iallreduce", tensor, op))["op"]),
        )

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Gather every rank's tensor; first dimensions may differ between ranks."""

        def validate() -> dict[str, Any]:
            self._check_tensor(tensor, "allgather")
            # the first dimension may differ between ranks: it is shown, not compared
            return {"dtype": tensor.dtype, "shape": ["*", *tensor.shape[1:]] if tensor.dim() else []}

        def run() -> list[torch.Tensor]:
            if tensor.dim() == 0:
                return self._allgather_equal(tensor)
            sizes = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
            all_sizes = [int(s) for s in torch.cat(self._allgather_equal(sizes))]
            if len(set(all_sizes)) == 1:
                return self._allgather_equal(tensor)
            longest = max(all_sizes)
            padded = tensor.new_zeros((longest, *tensor.shape[1:]))
            padded[: tensor.shape[0]] = tensor
            parts = self._allgather_equal(padded)
            return [p[:n] for p, n in zip(parts, all_sizes, strict=True)]

        return self._checked("allgather", _nbytes(tensor), -1, validate, lambda f: run())

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        self._checked("broadcast", _nbytes(tensor), root, lambda: self._tensor_call("broadcast", tensor, root=root),
                      lambda f: self._broadcast(tensor, root))
        return tensor

    def reduce(self, tensor: torch.Tensor, root: int = 0, op: ReduceOp | str = ReduceOp.SUM) -> torch.Tensor:
        """Reduce into ``tensor`` on ``root`` (other ranks' tensors are left unspecified)."""
        self._checked("reduce", _nbytes(tensor), root, lambda: self._tensor_call("reduce", tensor, op, root),
                      lambda f: self._reduce(tensor, root, f["op"]))
        return tensor

    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM) -> torch.Tensor:
        """Reduce ``tensor`` across ranks and return this rank's block of dim 0.

        ``tensor.shape[0]`` must be divisible by the communicator size.
        """

        def validate() -> dict[str, Any]:
            fields = self._tensor_call("reduce_scatter", tensor, op)
            if tensor.dim() == 0 or tensor.shape[0] % self.size:
                raise CommError(
                    f"reduce_scatter: first dimension {tuple(tensor.shape)[:1]} must be divisible by size {self.size}"
                )
            return fields

        return self._checked("reduce_scatter", _nbytes(tensor), -1, validate,
                             lambda f: self._reduce_scatter(tensor, f["op"]))

    def alltoall(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Send ``tensors[j]`` to rank ``j``; return the list received (``out[j]`` from rank ``j``).

        Received tensors have the shape and dtype of the sent ones (same shapes on every rank).
        """

        def validate() -> dict[str, Any]:
            if len(tensors) != self.size:
                raise CommError(f"alltoall: expected {self.size} tensors (one per rank), got {len(tensors)}")
            for t in tensors:
                self._check_tensor(t, "alltoall")
            return {"numel": sum(t.numel() for t in tensors),
                    "tensors": [f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors]}

        total = sum(_nbytes(t) for t in tensors)
        return self._checked("alltoall", total, -1, validate, lambda f: self._alltoall(list(tensors)))

    def barrier(self) -> None:
        self._checked("barrier", 0, -1, dict, lambda f: self._barrier())

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        def validate() -> dict[str, Any]:
            self._check_root(root, "broadcast_object")
            return {"root": root}

        return self._checked("broadcast_object", 0, root, validate, lambda f: self._broadcast_object(obj, root))

    def allgather_object(self, obj: Any) -> list[Any]:
        return self._checked("allgather_object", 0, -1, dict, lambda f: self._allgather_object(obj))

    def _check_root(self, root: int, what: str) -> None:
        if not isinstance(root, int) or not 0 <= root < self.size:
            raise CommError(f"{what}: root {root!r} is not a rank of {self.name} (size {self.size})")

    # ------------------------------------------------------------------ groups

    def split(self, ranks: Sequence[int], name: str | None = None) -> Communicator | None:
        """A communicator over ``ranks`` (ranks of this communicator; members keep their order).

        Collective: every rank of this communicator calls it with the same list; members get
        the new communicator and the others get ``None``.
        """

        def validate() -> dict[str, Any]:
            members = sorted(int(r) for r in ranks)
            if not members or len(set(members)) != len(members) or any(not 0 <= r < self.size for r in members):
                raise CommError(f"split: ranks {members} must be distinct ranks of {self.name} (size {self.size})")
            return {"ranks": members}

        members: list[int] = self._agree("split", validate)["ranks"]
        return self._split(members, name or f"{self.name}/{'-'.join(map(str, members))}")

    def node_comm(self) -> Communicator:
        """The ranks of this communicator on this node (collective the first time)."""
        if self._node is None:
            hosts = self.allgather_object(self.topology.hostnames[self.global_ranks[self.rank]]
                                          if self.topology.hostnames else _hostname())
            groups: dict[str, list[int]] = {}
            for r, h in enumerate(hosts):
                groups.setdefault(h, []).append(r)
            mine: Communicator | None = None
            for idx, members in enumerate(groups.values()):
                sub = self.split(members, name=f"{self.name}/node{idx}")
                if sub is not None:
                    mine = sub
            assert mine is not None
            self._node = mine
        return self._node

    def leaders_comm(self) -> Communicator | None:
        """The lowest rank of every node; ``None`` on ranks that are not node leaders."""
        if self._leaders is False:
            hosts = self.allgather_object(self.topology.hostnames[self.global_ranks[self.rank]]
                                          if self.topology.hostnames else _hostname())
            first: dict[str, int] = {}
            for r, h in enumerate(hosts):
                first.setdefault(h, r)
            self._leaders = self.split(list(first.values()), name=f"{self.name}/leaders")
        assert self._leaders is not False
        return self._leaders  # type: ignore[return-value]

    # ------------------------------------------------------------------ backend hooks

    @abstractmethod
    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None: ...

    @abstractmethod
    def _recv(self, tensor: torch.Tensor, src: int, tag: int) -> None: ...

    @abstractmethod
    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work: ...

    @abstractmethod
    def _irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Work: ...

    @abstractmethod
    def _allreduce(self, tensor: torch.Tensor, op: ReduceOp) -> None: ...

    @abstractmethod
    def _iallreduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work: ...

    @abstractmethod
    def _allgather_equal(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...

    @abstractmethod
    def _broadcast(self, tensor: torch.Tensor, root: int) -> None: ...

    @abstractmethod
    def _reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp) -> None: ...

    @abstractmethod
    def _reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor: ...

    @abstractmethod
    def _alltoall(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]: ...

    @abstractmethod
    def _barrier(self) -> None: ...

    @abstractmethod
    def _split(self, ranks: list[int], name: str) -> Communicator | None: ...

    def _broadcast_object(self, obj: Any, root: int) -> Any:
        payload = pickle.dumps(obj) if self.rank == root else b""
        n = torch.tensor([len(payload)], dtype=torch.int64, device=self._object_device())
        self._broadcast(n, root)
        buf = torch.empty(int(n.item()), dtype=torch.uint8, device=self._object_device())
        if self.rank == root:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        if buf.numel():
            self._broadcast(buf, root)
        return obj if self.rank == root else pickle.loads(buf.cpu().numpy().tobytes())

    def _allgather_object(self, obj: Any) -> list[Any]:
        payload = pickle.dumps(obj)
        dev = self._object_device()
        n = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
        sizes = [int(s) for s in torch.cat(self._allgather_equal(n))]
        buf = torch.zeros(max(sizes), dtype=torch.uint8, device=dev)
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        parts = self._allgather_equal(buf)
        return [pickle.loads(p[:s].cpu().numpy().tobytes()) for p, s in zip(parts, sizes, strict=True)]

    def _object_device(self) -> torch.device:
        return torch.device("cpu")


def _nbytes(tensor: Any) -> int:
    """The bytes of ``tensor`` for the event log (0 for an argument that is not a tensor)."""
    return nbytes_of(tensor) if isinstance(tensor, torch.Tensor) else 0


def _hostname() -> str:
    import socket

    return socket.gethostname()
