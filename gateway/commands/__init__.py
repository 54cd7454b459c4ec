"""Downlink commands and campaigns (docs/commands.md): the command lifecycle on storage
(``lifecycle``), creation for the API (``creator``), the API's service (``service``), dispatch
(``dispatcher``) and reaping (``reaper``) on every node, campaigns (``campaigns``).

Entry points: ``CommandService``, ``Dispatcher``, ``Reaper``, ``CampaignSettler``. May import
``alarms``, ``config``, ``support``, ``domain``, ``storage`` and ``protocol``; not ``outbox``,
``ai``, ``notify`` or ``maintenance`` (its own layer), nor anything above.
"""
