"""The broker edge: the session loop (``session``: connect, subscribe, read into the pipeline,
reconnect), the MQTT 5 and 3.1.1 connections that acknowledge QoS 1 only when told
(``v5_connection``, and ``v311_connection``: the same machinery on a 3.1.1 codec; the older
aiomqtt-based ``v311_client`` keeps ``ConnectionSettings``), what the broker can do
(``capabilities``), the subscriptions remembered per broker (``memory``); the embedded broker
of the zero-setup path is in ``gateway.embedded``.

Entry points: ``MqttSession``, ``SessionPublisher``. May import ``ingest`` and everything below it,
``storage`` and ``protocol``; not ``api`` (its own layer) or ``runtime``.
"""
