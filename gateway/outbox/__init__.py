"""The outbox publisher: outbox events claimed with a lease, published to the broker, marked
PUBLISHED only after the PUBACK; new alarms pushed.

Entry point: ``OutboxPublisher`` (``publisher``). May import ``alarms``, ``config``,
``support``, ``domain``, ``storage`` and ``protocol``; not ``commands``, ``ai``, ``notify`` or
``maintenance`` (its own layer), nor anything above.
"""
