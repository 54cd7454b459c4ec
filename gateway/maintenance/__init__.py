"""Retention: one maintenance loop keeps the disk bounded (telemetry day partitions made ahead
and dropped, the other tables pruned in batches) and samples the tables' sizes.

Entry points: ``Maintenance`` (``runner``), ``MaintenanceMetrics``. May import ``alarms``,
``config``, ``support``, ``domain``, ``storage`` and ``protocol``; not ``outbox``, ``commands``,
``ai`` or ``notify`` (its own layer), nor anything above.
"""
