"""PipelineTrainer's asynchronous stream: batch after batch through a pipeline that never flushes.

With ``async_1f1b``, :meth:`~TrainerStream.train_stream` runs a stream of known length in one
pass, and :meth:`~TrainerStream.stream_step` feeds one batch at a time into a stream left open
between calls (micro-batches of one batch are still in flight when the next arrives, the
PipeDream steady state); :meth:`~TrainerStream.drain` finishes it, e.g. at the end of an epoch
or before a checkpoint. Synchronous schedules run ``train_stream`` as one ``train_step`` per
batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

from ringpipe.pipeline.executor import PipelineExecutor, RunResult
from ringpipe.pipeline.microbatches import _run_lengths, split_microbatches
from ringpipe.pipeline.schedules import Action, async_1f1b_window, async_staleness

__all__ = ["TrainerStream"]


class TrainerStream:
    """The stream methods of :class:`~ringpipe.pipeline.trainer.PipelineTrainer` (which sets the attributes)."""

    is_async: bool
    is_first: bool
    is_last: bool
    schedule: str
    microbatches: int
    step_every: int
    num_stages: int
    stage: int
    executor: Any
    runtimes: list[Any]
    _streamed: int  # micro-batches fed into the open stream (0: no stream open)

    def train_step(self, inputs: Any = None, targets: Any = None) -> float | None:  # the trainer's
        raise NotImplementedError

    def actions(self, num_microbatches: int) -> list[Action]:  # the trainer's
        raise NotImplementedError

    def _split(self, inputs: Any, targets: Any) -> tuple[list[Any] | None, list[Any] | None]:  # the trainer's
        raise NotImplementedError

    def _weights_async(self, num_microbatches: int) -> Callable[[int], float]:  # the trainer's
        raise NotImplementedError

    def _finish(self, result: RunResult) -> float | None:  # the trainer's
        raise NotImplementedError

    def train_stream(self, batches: Iterable[tuple[Any, Any]], num_batches: int) -> float | None:
        """Train on ``num_batches`` batches in one run; returns the mean loss as in :meth:`train_step`.

        ``batches`` yields ``(inputs_or_None, targets_or_None)`` on every rank. With
        ``async_1f1b`` the pipeline stays full from the first batch to the last (the PipeDream
        steady state: this is where the asynchronous schedule gains its throughput); the
        synchronous schedules simply run :meth:`train_step` per batch.
        """
        if not self.is_async:
            losses = [self.train_step(x, y) for x, y in itertools.islice(batches, num_batches)]
            vals = [v for v in losses if v is not None]
            return sum(vals) / len(vals) if vals else None
        self.drain()
        m = self.microbatches
        it = iter(batches)
        cache: dict[str, Any] = {"index": -1, "x": None, "y": None, "runs": None}

        def load(mb: int) -> None:
            b = mb // m
            while cache["index"] < b:
                x, y = next(it)
                cache["index"] += 1
                cache["x"] = split_microbatches(x, m) if self.is_first else None
                cache["y"] = split_microbatches(y, m) if self.is_last else None
                cache["runs"] = _run_lengths(cache["x"]) if cache["x"] is not None else None

        def inputs(mb: int) -> Any:
            load(mb)
            return cache["x"][mb % m]

        def targets(mb: int) -> Any:
            load(mb)
            return cache["y"][mb % m]

        def run_length(mb: int) -> int:
            load(mb)
            return cache["runs"][mb % m]

        total = num_batches * m
        result = self.executor.run(
            self.actions(total),
            inputs=inputs if self.is_first else None,
            targets=targets if self.is_last else None,
            weights=self._weights_async(total),
            run_length=run_length if self.is_first else None,
        )
        return self._finish(result)

    @property
    def streaming(self) -> bool:
        """Whether a stream fed by :meth:`stream_step` is open (micro-batches may be in flight)."""
        return self._streamed > 0

    @property
    def in_flight(self) -> int:
        """Micro-batches this stage forwarded and has not yet backwarded."""
        return sum(rt.in_flight for rt in self.runtimes)

    def stream_step(self, inputs: Any = None, targets: Any = None) -> float | None:
        """Feed one batch into the asynchronous pipeline without draining it (``async_1f1b`` only).

        Arguments and return value as in :meth:`train_step`. The stage runs its window of the
        1F1B stream (:func:`~ringpipe.pipeline.schedules.async_1f1b_window`): the forwards of
        this batch's micro-batches and the backwards and steps between them; its last
        ``stages - stage - 1`` micro-batches stay in flight into the next call, so no batch
        boundary flushes the pipeline and every stage but the last trains on stale weights,
        as in one :meth:`train_stream` over all the batches fed. Call :meth:`drain` (on every
        rank) to finish them before a checkpoint or whenever the weights must be final.
        ``step_every`` must divide ``microbatches``: the stream's length is not known in
        advance, so no optimizer step may straddle a batch boundary.
        """
        if not self.is_async:
            raise ValueError(
                f"stream_step needs schedule 'async_1f1b'; schedule {self.schedule!r} flushes every batch: "
                "use train_step"
            )
        m, k = self.microbatches, self.step_every
        if m % k:
            raise ValueError(
                f"stream_step needs step_every={k} to divide microbatches={m}, so that every optimizer step "
                "ends with a batch; change one of them, or use train_stream for a stream of known length"
            )
        x_chunks, y_chunks = self._split(inputs, targets)
        start, stop = self._streamed, self._streamed + m
        runs = _run_lengths(x_chunks) if x_chunks is not None else None
        assert isinstance(self.executor, PipelineExecutor)  # the asynchronous schedule runs one chunk
        result = self.executor.run(
            async_1f1b_window(self.num_stages, self.stage, start, stop, k),
            inputs=(lambda i: x_chunks[i - start]) if x_chunks is not None else None,
            targets=(lambda i: y_chunks[i - start]) if y_chunks is not None else None,
            weights=lambda i: 1.0 / k,
            run_length=(lambda i: runs[i - start]) if runs is not None else None,
            staleness={mb: async_staleness(self.num_stages, self.stage, mb, k) for mb in range(start, stop)},
            keep_open=True,
        )
        self._streamed = stop
        return self._finish(result)

    def drain(self) -> None:
        """Finish the stream fed by :meth:`stream_step`: the backwards in flight and their steps.

        Every rank calls it at the same point (it exchanges gradients with the neighbour
        stages); without an open stream it does nothing.
        """
        total, self._streamed = self._streamed, 0
        if total:
            assert isinstance(self.executor, PipelineExecutor)
            self.executor.run(
                async_1f1b_window(self.num_stages, self.stage, total, total, self.step_every, total=total),
                staleness={},
            )
