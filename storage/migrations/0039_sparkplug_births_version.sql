-- The version of an edge node's births (its aliases and metric datatypes), moved by every
-- write of either. A gateway holds a node's births between batches and is sent them again
-- only when the version it holds is not the row's (storage/queries/sparkplug.sql,
-- lock_nodes): for a node of many metrics they are tens of kilobytes, read, sent and decoded
-- by every batch before. A trigger moves it, not the writers: a gateway of an earlier version
-- (which writes both columns with every batch) moves it too, so that no gateway goes on
-- trusting a copy another one changed.
ALTER TABLE sparkplug_node ADD COLUMN births_version bigint NOT NULL DEFAULT 0;

CREATE FUNCTION sparkplug_births_moved() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.births_version := OLD.births_version + 1;
    RETURN NEW;
END $$;

-- Fires for every UPDATE that names either column, changed or not.
CREATE TRIGGER sparkplug_births_moved BEFORE UPDATE OF aliases, metrics ON sparkplug_node
    FOR EACH ROW EXECUTE FUNCTION sparkplug_births_moved();
