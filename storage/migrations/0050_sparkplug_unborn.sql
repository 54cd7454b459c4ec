-- The devices an edge node had before its latest NBIRTH that no DBIRTH of the new session has
-- born yet (docs/sparkplug.md, "A rebirth is no death"). Each NBIRTH voids its devices'
-- births, and they used to be set offline at once, until their own DBIRTH set them online
-- again: where the two were committed apart (another batch, another node of a `$share` group),
-- an inactivity pass in between raised "presence offline" for a device that never went away.
-- They are kept here instead, their presence as it was, until the node's births are over: its
-- first message after them that is no DBIRTH, or a grace after the NBIRTH (the rebirth loop);
-- those still here then are offline. Empty: none. A node of the previous release leaves it as
-- it is, and sets the devices offline at the NBIRTH, as before.
ALTER TABLE sparkplug_node ADD COLUMN unborn text[] NOT NULL DEFAULT '{}';
