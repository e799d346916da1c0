"""The pipeline benchmarks' shared parts: one model and split for both systems, their runs, meters and theory.

``model`` (layers, data, the split and its options), ``meters`` (what a run measures, the same way
on both systems), ``ranks`` (two ranks over gloo or MPI), ``ringpipe_run`` and ``torch_run`` (one
timed run of each system), ``variants`` (the named runs and the two-rank worker), ``schedule_sim``
and ``theory`` (what the schedules' action lists imply, no processes) and ``timeline`` (where a
step's time goes per rank, stamped action by action).
"""

__all__: list[str] = []
