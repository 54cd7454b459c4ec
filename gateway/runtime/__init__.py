"""The daemon's wiring: the CLI (``cli``, ``entry``), the daemon (``daemon``), its components
built from the configuration (``components``), logging, sd_notify and supervision, expected
failures said the operator's way (``failures``), ``install-systemd`` and the zero-setup admin
token. (The demo is ``gateway.demo``; the embedded servers, ``gateway.embedded``.)

Entry points: ``gateway.runtime.entry:main`` (the ``gateway`` command), ``Daemon``. The top
layer: may import every package of ``gateway``, ``storage`` and ``protocol``; nothing imports
it but ``gateway.__main__`` and ``gateway.demo`` (which it calls in turn, lazily).
"""
