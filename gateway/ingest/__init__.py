"""The ingest pipeline (docs/architecture.md, "One message"): decoding (``decoder``), the batch
writer (``writer``: reader, bounded queue, one transaction per batch, acknowledgements), what a
batch writes (``store``), the crash-loop breaker (``breaker``), dead-letter replay (``replay``),
and the live path both build from the configuration (``live_path``).

Entry points: ``IngestWriter``, ``gateway.ingest.live_path``, ``replay_one``, ``IngestMetrics``.
May import ``outbox``, ``commands``, ``ai``, ``notify``, ``maintenance``, ``alarms``, ``config``,
``support``, ``domain``, ``storage`` and ``protocol``; not ``api``, ``mqtt`` or ``runtime``.
"""
