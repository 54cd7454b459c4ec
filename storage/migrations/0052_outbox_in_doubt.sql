-- How many times the broker connection ended while this event was the largest publish awaiting
-- its PUBACK (docs/behaviour.md §6). A broker that closes the connection on a packet over its
-- limit says nothing of why on MQTT 3.1.1 (mosquitto's `max_packet_size`): such an event was
-- released, due again at once, and dropped the connection of every node that took it, in a
-- loop. Counted here, across nodes, it becomes DEAD at the third time. A node of the previous
-- release leaves it as it is (0), and releases such an event as before.
ALTER TABLE outbox_event ADD COLUMN in_doubt_count integer NOT NULL DEFAULT 0;
