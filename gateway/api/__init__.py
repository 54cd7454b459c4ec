"""The operator HTTP API (behaviour §9): typed routes on Litestar, served by uvicorn in the daemon.

``app`` builds the Litestar app, ``server`` runs it inside the daemon's event loop; ``auth``
(bearer tokens, the role guard), ``errors`` (the kinds of error and the one handler),
``routes`` (declaring a route; the input boundary), ``schemas`` (every body as a Struct),
``params`` (the shared parameters and the keyset ``page``), ``services`` (what the guarded
routes call); the route modules ``alarms``, ``campaigns``, ``commands``, ``console_route``,
``dead_letters``, ``devices``, ``health``, ``notify``, ``session`` and ``stream``.

Entry points: ``build_app``, ``ApiServer``, ``StreamHub``. May import ``ingest`` and everything
below it, ``storage`` and ``protocol``; not ``mqtt`` (its own layer) or ``runtime``. Route
modules import ``params``, ``schemas``, ``routes``, ``auth``, ``errors`` and ``services``, never
each other, and no ``storage`` but the console's read model (import-linter contracts).
"""
