"""Notifications (behaviour §6): the consumer that turns outbox events into deliveries, the
delivery workers that send them to webhook and e-mail receivers, and the silences."""
