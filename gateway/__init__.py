"""The MQTT alarm & command gateway's daemon: one node of a cluster sharing one PostgreSQL.

Owns everything that runs in a node, one package per concept, in layers (docs/architecture.md):
``cli`` (the command) over ``demo`` over ``runtime``, which wires; ``api``, ``mqtt`` and
``embedded`` (the zero-setup servers) are the edges; ``ingest``; the services ``outbox``,
``commands``, ``ai``, ``notify`` and ``maintenance``; ``alarms``; ``config``; ``support``; the
pure ``domain``. Entry points: the ``gateway`` command (``gateway.cli.entry:main``, also
``python -m gateway``). May import ``storage`` and ``protocol``; each package only those below
it (import-linter contracts in pyproject.toml).
"""
