-- Which token a stream ticket was issued to (docs/api.md, "The live stream").
--
-- A ticket kept only its token's name and role: a reload that rotated the token (same name
-- and role, a new secret: what an operator does when a token leaked) left the tickets the old
-- secret got valid on every node until they expired. token_check binds the ticket to the
-- token itself: SHA-256 over a label, the ticket and the token's digest, so neither the token
-- nor its digest can be read or guessed from the row without the ticket (never stored). A
-- node redeems a ticket only for a configured token of its name and role whose check matches;
-- NULL (a ticket issued before this migration, at most a minute old) is refused: its client
-- asks for a new one.
ALTER TABLE stream_ticket ADD COLUMN token_check bytea
    CHECK (token_check IS NULL OR octet_length(token_check) = 32);
