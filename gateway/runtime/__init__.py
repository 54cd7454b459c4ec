"""The daemon's wiring: the CLI (``cli``, ``entry``), the daemon (``daemon``), its components
built from the configuration (``components``), logging, sd_notify and supervision, expected
failures said the operator's way (``failures``), ``install-systemd``, the zero-setup admin
token, the demo and its screenshots.

Entry points: ``gateway.runtime.entry:main`` (the ``gateway`` command), ``Daemon``. The top
layer: may import every package of ``gateway``, ``storage``, ``protocol`` and ``sim`` (the
demo's simulated devices); nothing imports it but ``gateway.__main__``.
"""
