"""The shared parts of ringpipe's benchmark scripts: statistics, block timing, machine report, models.

Every entry script in ``benchmarks/`` puts its own folder on ``sys.path`` and imports from here:

- :mod:`lib.stats`: median, percentiles, spread, ratios of paired samples, "apart or not";
- :mod:`lib.timing`: variants timed in alternating blocks after a warm-up, the order rotated so
  that drift of a shared machine falls on every variant alike;
- :mod:`lib.machine`: what the run ran on (CPU model, cores, load average, Python, torch,
  ringpipe, git commit), printed the same way by every script;
- :mod:`lib.report`: the report format every script prints: a ``# bench: NAME`` header with the
  command and the machine, Markdown tables, and ``ratio`` rows for RESULTS.md's headline table;
- :mod:`lib.sizes`: message sizes in (``4K``, ``64M``) and out (``4 KiB``);
- :mod:`lib.models`: the data-parallel models (small MLP, 10.5M MLP, ResNet-18, transformer,
  Horovod's MNIST CNN, a tiny MLP for ``--quick``);
- :mod:`lib.procs`: starting workers (``ringpipe`` on this interpreter, a child's output, its JSON rows);
- :mod:`lib.testhelpers`: the test suite's helpers some benchmarks reuse (namespace hosts, rank scripts);
- :mod:`lib.elastic_program`: the elastic program ``elastic_recovery.py`` runs under the elastic driver;
- :mod:`lib.horovod_program`: the Horovod program ``dp_vs_horovod.py`` runs under both implementations;
- :mod:`lib.pipeline`: the pipeline benchmark's model, split, meters, runners and schedule theory.

Scripts import modules, not this package's names: ``from lib import stats``.
"""

__all__: list[str] = []
