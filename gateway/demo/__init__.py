"""``gateway demo``: the whole product on this machine in one command (``run``: an embedded
database and broker, a daemon, a simulated fleet, the console), and the console's photographs
and live timing (``screenshots``: playwright on Debian's chromium, imported only when asked).

Entry points: ``run_demo``, ``run_screenshots``, ``run_measure_live`` (called by
``gateway.cli.commands``). Above ``runtime``, which it drives: may import ``gateway.runtime``
(the daemon, its metrics, logging), everything below it, ``protocol`` and ``sim`` (the
simulated devices).
"""
