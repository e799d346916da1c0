"""Point-to-point channels between neighbour stages: activations forward, gradients backward.

Activations are any structure of tensors and constants (:mod:`ringpipe.pipeline.values`) and
carry their own description: a header (dtypes, shapes, which tensors take a gradient back, for
how many micro-batches they hold, and the structure — nesting and constants, as JSON bytes —
inside the header when it fits, in a message of its own when not) goes before the payload of
the first micro-batch and again only when a new run of shapes starts (a new run of the
schedule, a window of the asynchronous stream, a smaller last batch). The number of
micro-batches a header covers comes from the first stage, which knows how it split its batch;
a later stage passes it on, so its receiver knows exactly which message is a header without
asking. Gradients need no header: they have the shapes of the differentiable activations the
stage sent, and only those travel back (masks, ids and tensors that do not require grad go
forward only).

All sends are ``isend`` and complete in the background; receives are posted ahead
(``prefetch``) so a transfer overlaps the computation of the previous micro-batch. A transfer
whose receive is posted before the send starts at once; one whose receive is posted later
waits for a round trip between the two processes' transport threads, which costs milliseconds
when every core is busy computing. So at the start of a run of shapes the receiver posts the
payload's receives together with the header's, speculating that the tensors keep the shapes of
the previous run (the common case: window after window of a stream, batch after batch); when
they do not, the sender knows it (it sent that previous run) and sends a *filler* of the old
shapes first, which the receiver drops before it posts the right receives.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ringpipe.comm.base import Communicator, Work
from ringpipe.pipeline.values import Packed, decode_structure, encode_structure

__all__ = ["Meta", "ActivationSender", "ActivationReceiver", "GradSender", "GradReceiver", "ChannelError"]

HEADER_LEN = 256
TAG_HEADER = 11
TAG_STRUCTURE = 12
TAG_ACT = 100
TAG_GRAD = 300
_MAGIC = 0x5249  # "RI"

_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.complex64, torch.complex128,
]
_CODE = {d: i for i, d in enumerate(_DTYPES)}


class ChannelError(RuntimeError):
    """Neighbour stages disagree on what travels between them."""


@dataclass(frozen=True)
class Meta:
    """Dtypes, shapes, gradient flags and structure of one micro-batch's message."""

    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    grads: tuple[bool, ...] = ()
    structure: Any = None

    @classmethod
    def of(cls, packed: Packed) -> Meta:
        ts = packed.tensors
        return cls(tuple(t.dtype for t in ts), tuple(tuple(t.shape) for t in ts), packed.grads, packed.structure)

    def differentiable(self) -> Meta:
        """The tensors a gradient comes back for."""
        keep = [i for i, g in enumerate(self.grads) if g]
        return Meta(tuple(self.dtypes[i] for i in keep), tuple(self.shapes[i] for i in keep), tuple(True for _ in keep))

    def empty(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        return tuple(torch.empty(s, dtype=d, device=device) for d, s in zip(self.dtypes, self.shapes, strict=True))

    def layout(self) -> tuple[tuple[torch.dtype, ...], tuple[tuple[int, ...], ...]]:
        """What the payload's receive buffers depend on: the tensors' dtypes and shapes."""
        return self.dtypes, self.shapes

    def encode(self, run: int, structure: bytes, filler: bool, device: torch.device) -> tuple[torch.Tensor, bool]:
        """The header of a run of ``run`` micro-batches: ``(header, whether structure fits in it)``.

        ``filler``: a payload of the previous run's shapes follows the header, for the receiver to
        drop (it posted its receives for those shapes).
        """
        vals = [_MAGIC, run, len(self.dtypes), len(structure), int(filler)]
        for d, s, g in zip(self.dtypes, self.shapes, self.grads, strict=True):
            if d not in _CODE:
                raise ChannelError(f"cannot send tensors of dtype {d} between stages; use one of {_DTYPES}")
            vals += [_CODE[d], int(g), len(s), *s]
        if len(vals) > HEADER_LEN:
            raise ChannelError(
                f"stage output description needs {len(vals)} numbers, more than {HEADER_LEN}: "
                "send fewer tensors or tensors of fewer dimensions between stages"
            )
        out = torch.zeros(HEADER_LEN, dtype=torch.int64)
        out[: len(vals)] = torch.tensor(vals, dtype=torch.int64)
        inline = len(structure) <= 8 * (HEADER_LEN - len(vals))
        if inline and structure:
            out.view(torch.uint8)[8 * len(vals) : 8 * len(vals) + len(structure)] = torch.frombuffer(
                bytearray(structure), dtype=torch.uint8)
        return out.to(device), inline

    @classmethod
    def decode(cls, header: torch.Tensor) -> tuple[Meta, int, bytes | int, bool]:
        """``(meta without structure, run, structure, filler)``: the structure's bytes when the
        header holds them, else the length of the message that does."""
        header = header.cpu()
        vals = header.tolist()
        if vals[0] != _MAGIC:
            raise ChannelError(f"expected a shape header from the previous stage, got {vals[:4]}...")
        run, n, structure_len, filler, i = vals[1], vals[2], vals[3], bool(vals[4]), 5
        dtypes, shapes, grads = [], [], []
        for _ in range(n):
            code, g, nd = vals[i], vals[i + 1], vals[i + 2]
            dtypes.append(_DTYPES[code])
            grads.append(bool(g))
            shapes.append(tuple(vals[i + 3 : i + 3 + nd]))
            i += 3 + nd
        meta = cls(tuple(dtypes), tuple(shapes), tuple(grads))
        if structure_len > 8 * (HEADER_LEN - i):
            return meta, run, structure_len, filler
        return meta, run, header.view(torch.uint8)[8 * i : 8 * i + structure_len].numpy().tobytes(), filler


class _Sends:
    """Outstanding isends, kept alive until they complete, oldest first.

    Completed sends are dropped from the front (a backend whose handles report completion,
    MPI's, frees them as it goes). gloo's handles report completion only once waited for, so
    beyond ``limit`` outstanding sends the oldest is waited for: without it a stream that never
    closes its run (the asynchronous pipeline, window after window) would keep every tensor it
    ever sent, and polling the whole list on every send would cost time growing with the
    stream. The oldest of ``limit`` sends has long been received in any schedule whose stages
    hold fewer micro-batches in flight than that, so this wait does not block in practice.
    """

    def __init__(self, limit: int = 64) -> None:
        self.works: deque[Work] = deque()
        self.limit = limit

    def add(self, work: Work) -> None:
        works = self.works
        works.append(work)
        while works and works[0].is_completed():
            works.popleft()
        while len(works) > self.limit:
            works.popleft().wait()

    def wait(self) -> None:
        while self.works:
            self.works.popleft().wait()


class ActivationSender:
    """Sends a stage's outputs to the next stage, with a header at the start of each run of shapes."""

    def __init__(self, comm: Communicator, peer: int, stage: int) -> None:
        self.comm, self.peer, self.stage = comm, peer, stage
        self.remaining = 0
        self.meta: Meta | None = None
        self.sends = _Sends()

    def send(self, packed: Packed, run: int) -> None:
        """Send one micro-batch; ``run`` >= 1 micro-batches from this one have the same input shapes."""
        tensors = [t.contiguous() for t in packed.tensors]
        meta = Meta.of(packed)
        if self.remaining == 0:
            device = tensors[0].device if tensors else torch.device("cpu")
            # the receiver posted a payload of the previous run's shapes: if they changed, it gets a filler
            previous = self.meta
            filler = previous is not None and previous.layout() != meta.layout()
            self.meta, self.remaining = meta, max(1, run)
            structure = encode_structure(packed.structure)
            header, inline = meta.encode(self.remaining, structure, filler, device)
            self.sends.add(self.comm.isend(header, self.peer, TAG_HEADER))
            if not inline:
                data = torch.frombuffer(bytearray(structure), dtype=torch.uint8).to(device)
                self.sends.add(self.comm.isend(data, self.peer, TAG_STRUCTURE))
            if filler:
                assert previous is not None
                for i, t in enumerate(previous.empty(device)):
                    self.sends.add(self.comm.isend(t, self.peer, TAG_ACT + i))
        elif meta != self.meta:
            raise ChannelError(
                f"stage {self.stage} output changed from {self.meta} to {meta} while its input shapes "
                "stayed the same; a stage's output shapes, structure and constants must depend only on its "
                "input shapes"
            )
        self.remaining -= 1
        for i, t in enumerate(tensors):
            self.sends.add(self.comm.isend(t, self.peer, TAG_ACT + i))

    def wait(self) -> None:
        self.sends.wait()

    def reset(self) -> None:
        """Start a new run: the next send carries a header (call on every rank at the same point)."""
        self.remaining = 0


class ActivationReceiver:
    """Receives the previous stage's outputs; ``prefetch`` posts the next receive early (at the
    start of a run of shapes, the header's and, speculatively, the payload's of the last shapes)."""

    def __init__(self, comm: Communicator, peer: int, device: torch.device) -> None:
        self.comm, self.peer, self.device = comm, peer, device
        self.remaining = 0
        self.meta: Meta | None = None
        self._header: tuple[torch.Tensor, Work] | None = None
        self._payload: list[Work] | None = None

    def prefetch(self) -> None:
        if self._payload is not None or self._header is not None:
            return
        if self.remaining == 0:
            buf = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
            self._header = (buf, self.comm.irecv(buf, self.peer, TAG_HEADER))
        if self.meta is not None:
            self._post_payload()

    def _post_payload(self) -> None:
        assert self.meta is not None
        bufs = self.meta.empty(self.device)
        self._payload = [self.comm.irecv(b, self.peer, TAG_ACT + i) for i, b in enumerate(bufs)]

    def get(self, prefetch_next: bool = False) -> tuple[Packed, int]:
        """The next micro-batch's value and the length of the run of shapes from it on."""
        self.prefetch()
        if self._header is not None:
            buf, work = self._header
            work.wait()
            self._header = None
            meta, self.remaining, structure, filler = Meta.decode(buf)
            if isinstance(structure, int):
                data = torch.empty(structure, dtype=torch.uint8, device=self.device)
                self.comm.irecv(data, self.peer, TAG_STRUCTURE).wait()
                structure = bytes(data.cpu().numpy().tobytes())
            speculated = self._payload is not None
            if filler != (speculated and self.meta is not None and self.meta.layout() != meta.layout()):
                raise ChannelError(
                    f"the previous stage {'sent' if filler else 'did not send'} a filler for shapes "
                    f"{self.meta.shapes if self.meta else None}, but this stage expected "
                    f"{'none' if filler else 'one'}; both sides of a channel must start the same runs"
                )
            if filler:  # the speculative receives got the old shapes: drop them
                for w in self._payload or ():
                    w.wait()
                self._payload = None
            self.meta = Meta(meta.dtypes, meta.shapes, meta.grads, decode_structure(structure))
            if self._payload is None:
                self._post_payload()
        assert self._payload is not None and self.meta is not None
        tensors = tuple(w.wait() for w in self._payload)
        self._payload = None
        run = self.remaining
        self.remaining -= 1
        if prefetch_next:
            self.prefetch()
        return Packed(tensors, self.meta.structure, self.meta.grads), run

    def reset(self) -> None:
        if self._header is not None or self._payload is not None:
            raise ChannelError("a receive is still posted; runs must consume every activation they prefetch")
        self.remaining = 0


class GradSender:
    """Sends the gradients of a stage's differentiable inputs to the previous stage."""

    def __init__(self, comm: Communicator, peer: int) -> None:
        self.comm, self.peer = comm, peer
        self.sends = _Sends()

    def send(self, grads: Sequence[torch.Tensor]) -> None:
        for i, g in enumerate(grads):
            self.sends.add(self.comm.isend(g.contiguous(), self.peer, TAG_GRAD + i))

    def wait(self) -> None:
        self.sends.wait()


class GradReceiver:
    """Receives the gradients of the outputs a stage sent, posted ahead when their shapes are known."""

    def __init__(self, comm: Communicator, peer: int, device: torch.device) -> None:
        self.comm, self.peer, self.device = comm, peer, device
        self._posted: tuple[int, list[Work]] | None = None

    def prefetch(self, mb: int, meta: Meta) -> None:
        if self._posted is not None:
            return
        bufs = meta.differentiable().empty(self.device)
        self._posted = (mb, [self.comm.irecv(b, self.peer, TAG_GRAD + i) for i, b in enumerate(bufs)])

    def get(self, mb: int, meta: Meta) -> tuple[torch.Tensor, ...]:
        self.prefetch(mb, meta)
        assert self._posted is not None
        posted_mb, works = self._posted
        if posted_mb != mb:
            raise ChannelError(f"gradient receive posted for micro-batch {posted_mb} but {mb} is needed")
        self._posted = None
        return tuple(w.wait() for w in works)

    @property
    def posted(self) -> bool:
        return self._posted is not None
