"""The schema's migrations, one numbered ``.sql`` file each, applied in order by
``storage.migrate``. Data only: no Python imports.
"""
