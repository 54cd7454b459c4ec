"""Notifications (behaviour §6): the consumer that turns outbox events into deliveries, the
delivery workers that send them to webhook and e-mail receivers, and the silences.

Entry points: ``NotifyConsumer``, ``DeliveryWorker``, ``NotifyService``, ``NotifyMetrics``. May
import ``alarms``, ``config``, ``support``, ``domain``, ``storage`` and ``protocol``; not
``outbox``, ``commands``, ``ai`` or ``maintenance`` (its own layer), nor anything above.
"""
