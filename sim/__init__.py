"""Simulated devices, the reference consumer, the benchmark and the field simulation, seen from
outside: over MQTT, over HTTP, and as ``gateway run`` processes with a TOML file each.

Entry point: the ``gateway-sim`` command (``sim.cli:main``, also ``python -m sim``). May import
``protocol`` only: never ``gateway`` or ``storage`` (import-linter), so a figure it reports is a
figure of the product, not of internals.
"""
