-- A stand-in, on this branch only: version 17 belongs to another change of issue 22 being
-- made in parallel, and the versions must run 1..n without gaps. Merging takes that change's
-- 0017 instead of this file (a database that recorded this one then refuses to start on the
-- checksum, instead of silently skipping the real 0017).
SELECT 1;
