"""The daemon's wiring: the daemon (``daemon``), its start-up steps (``startup``: the broker
and the database found or started, the pool migrated), its components built from the
configuration (``components``), logging, sd_notify and supervision, expected
failures said the operator's way (``failures``), ``install-systemd`` and the zero-setup admin
token. (The demo is ``gateway.demo``; the embedded servers, ``gateway.embedded``.)

Entry points: ``Daemon``, ``build`` (the components). Below ``gateway.cli`` and
``gateway.demo``, which drive it: may import every other package of ``gateway``, ``storage``
and ``protocol``; nothing imports it but those two.
"""
