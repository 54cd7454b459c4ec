-- node_rule_set: the rule keys each node runs, with its heartbeat. Nodes may run different
-- rule sets for a while (a rolling reload, a node started with another file): a node drops
-- the rule state of a rule it does not run only when no live node runs it either, "live"
-- meaning a heartbeat within a bound (gateway.alarms.engine.NODE_LIVE_S). A node that stops
-- or dies leaves its row behind; once the heartbeat is too old it no longer counts.
CREATE TABLE node_rule_set (
    node_id       text PRIMARY KEY,
    -- Event and threshold rules (inactivity rules keep no rule state).
    rule_keys     text[] NOT NULL,
    registered_at timestamptz NOT NULL DEFAULT now(),
    heartbeat_at  timestamptz NOT NULL DEFAULT now()
);
