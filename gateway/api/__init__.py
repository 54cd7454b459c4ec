"""The operator HTTP API (behaviour §9): typed routes on Litestar, served by uvicorn in the daemon.

``app`` builds the Litestar app, ``server`` runs it inside the daemon's event loop; ``auth``
(bearer tokens, the role guard), ``errors`` (the kinds of error and the one handler),
``routes`` (declaring a route; the input boundary), ``schemas`` (every body as a Struct),
``alarms``, ``commands`` and ``health`` (the handlers).
"""
