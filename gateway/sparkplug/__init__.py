"""The gateway as a Sparkplug B host application (docs/sparkplug.md): the judgement of each
batch's Sparkplug messages against the edge nodes' state (host), the rebirth requests
(rebirth), the host's STATE (state) and their metrics. Below ingest and the services, above
the alarms."""
