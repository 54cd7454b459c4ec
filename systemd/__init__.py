"""The systemd units, built into the wheel as the package ``gateway.units`` (pyproject.toml maps
it) and read with importlib.resources by ``gateway install-systemd``. Data only: no Python.
"""
