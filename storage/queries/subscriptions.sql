-- name: remember_subscriptions
-- $1 client id, $2 broker (host:port), $3 topic filters about to be subscribed; returns every
-- filter remembered for the client id on that broker, these included, each with whether it
-- was proven to deliver there (migration 0038; a filter remembered only now was not).
WITH added AS (
    INSERT INTO mqtt_subscription (client_id, broker, topic_filter)
    SELECT $1, $2, f FROM unnest($3::text[]) AS f
    ON CONFLICT (client_id, broker, topic_filter) DO NOTHING
)
SELECT topic_filter, proven_at IS NOT NULL AS proven
FROM mqtt_subscription WHERE client_id = $1 AND broker = $2
UNION
SELECT f, false FROM unnest($3::text[]) AS f
WHERE NOT EXISTS (
    SELECT FROM mqtt_subscription s
    WHERE s.client_id = $1 AND s.broker = $2 AND s.topic_filter = f
);

-- name: forget_subscriptions
-- $1 client id, $2 broker (host:port), $3 topic filters unsubscribed.
DELETE FROM mqtt_subscription
WHERE client_id = $1 AND broker = $2 AND topic_filter = ANY($3::text[]);

-- name: prove_subscriptions
-- $1 client id, $2 broker (host:port), $3 topic filters whose probe came back now ($4 true),
-- or one of which delivered nothing ($4 false: none of them counts as proven any more).
UPDATE mqtt_subscription
SET proven_at = CASE WHEN $4::boolean THEN now() END
WHERE client_id = $1 AND broker = $2 AND topic_filter = ANY($3::text[]);
