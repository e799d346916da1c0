"""The cross-rank check: every rank learns which call every other rank makes before data moves.

One description of a call (:mod:`~ringpipe.check.call`: collective, op, dtype, count, root and a
fingerprint of the rest) travels by one of two transports:

- :mod:`~ringpipe.check.doubling_exchange`: int64 headers along the recursive doubling pattern,
  before (or with) a communicator's collective, for the communicators' own collectives and
  ringpipe's algorithms (:mod:`ringpipe.comm`, :mod:`ringpipe.collectives`);
- :mod:`~ringpipe.check.announcement` with its header :mod:`~ringpipe.check.announcement_header`:
  a float32 header allreduced before each collective of the Horovod-style API on the engine,
  which also tells a joined rank what comes next; an optimizer step's first gradients ride in it.

:mod:`~ringpipe.check.settings` compares a ``DistributedOptimizer``'s settings and parameter
layout once, at construction. Ranks that disagree all raise the same
:class:`~ringpipe.check.call.MismatchError` (or :class:`~ringpipe.check.call.InvalidCallError`)
whichever transport found it.

The modules sit on two layers (``docs/architecture.md``): the call and the doubling exchange
beside :mod:`ringpipe.comm`, whose communicators run them; the announcement and the settings
agreement beside :mod:`ringpipe.core`, whose engine they run on. So this package imports none of
its modules: each importer takes the one it needs.
"""

__all__: list[str] = []
