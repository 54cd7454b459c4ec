"""The ``gateway`` command: parsing, the sub-commands, and the process's entry point.

Owns: ``entry`` (the console script: imports nothing until a command is chosen, holds an early
SIGHUP of ``gateway run``), ``commands`` (argument parsing, ``run``, ``check-config``,
``migrate``, ``rules replay``, ``install-systemd``, ``demo`` and the other sub-commands, exit
codes). It sits above every other package: it may import ``runtime`` and ``demo``, and
nothing imports it.
"""
