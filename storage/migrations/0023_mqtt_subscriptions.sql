-- The topic filters each MQTT client id has subscribed to on each broker (issue 28): the
-- gateway's session is persistent, so a filter of an earlier configuration (another
-- topic_prefix, shared_group turned on or off) lives on in the broker until it is removed.
-- At every connect the node unsubscribes what is remembered here and no longer configured.

CREATE TABLE mqtt_subscription (
    client_id text NOT NULL,
    broker text NOT NULL,
    topic_filter text NOT NULL,
    subscribed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (client_id, broker, topic_filter)
);
