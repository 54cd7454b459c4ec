"""What every layer above the domain shares: the node's shared parts (``node``), the metrics
registry and its collectors (``metrics``; each feature's metrics live beside it), backoff,
periodic loops, the broker link state, publish refusals, log limits, the version.

Entry points: ``Node``, ``Metrics``, ``MetricSet``, ``Backoff``. May import ``domain``,
``storage`` and ``protocol``; nothing above it.
"""
