"""Retention: one maintenance loop keeps the disk bounded (telemetry day partitions made ahead
and dropped, the other tables pruned in batches) and samples the tables' sizes."""
