"""mqtt."""
