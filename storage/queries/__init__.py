"""Named SQL blocks, one ``.sql`` file per repository, loaded by ``storage.sql.load_queries``.
Data only: no Python imports.
"""
