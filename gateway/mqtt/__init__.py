"""The broker edge: the session loop (``session``: connect, subscribe, read into the pipeline,
reconnect), the MQTT 3.1.1 and 5 clients that acknowledge QoS 1 only when told
(``v311_client``, ``v5_connection``), what the broker can do (``capabilities``), the
subscriptions remembered per broker (``memory``); the embedded broker of the zero-setup path
is in ``gateway.embedded``.

Entry points: ``MqttSession``, ``SessionPublisher``. May import ``ingest`` and everything below it,
``storage`` and ``protocol``; not ``api`` (its own layer) or ``runtime``.
"""
