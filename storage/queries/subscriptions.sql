-- name: remember_subscriptions
-- $1 client id, $2 broker (host:port), $3 topic filters about to be subscribed; returns every
-- filter remembered for the client id on that broker, these included.
WITH added AS (
    INSERT INTO mqtt_subscription (client_id, broker, topic_filter)
    SELECT $1, $2, f FROM unnest($3::text[]) AS f
    ON CONFLICT (client_id, broker, topic_filter) DO NOTHING
)
SELECT topic_filter FROM mqtt_subscription WHERE client_id = $1 AND broker = $2
UNION
SELECT f FROM unnest($3::text[]) AS f;

-- name: forget_subscriptions
-- $1 client id, $2 broker (host:port), $3 topic filters unsubscribed.
DELETE FROM mqtt_subscription
WHERE client_id = $1 AND broker = $2 AND topic_filter = ANY($3::text[]);
