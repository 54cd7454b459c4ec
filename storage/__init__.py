"""PostgreSQL and nothing else: migrations (``migrations/``), named SQL blocks (``queries/``,
read by ``sql``), the repositories that run conditional writes on the caller's connection, the
pool. (The embedded server of the zero-setup path is ``gateway.embedded.postgres``.)

Entry points: its repository modules (``storage.alarms``, ``storage.commands``, ...),
``storage.migrate``, ``storage.pool``, ``storage.console`` (the console's read model). May
import ``protocol`` only: never ``gateway`` or ``sim`` (import-linter).
"""
