"""The former home of the split-backward stage runtime, kept as an import path.

The split backward (``B`` the input gradient now, ``W`` the weight gradient later) is an option
of the one stage runtime: ``StageRuntime(..., split_backward=True)``
(:mod:`ringpipe.pipeline.stage` describes it). :func:`SplitStageRuntime` builds such a runtime.
"""

from __future__ import annotations

from ringpipe.pipeline.stage import SplitStageRuntime

__all__ = ["SplitStageRuntime"]
