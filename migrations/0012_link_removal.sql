-- What a link's removal does to its copies (issue 21): `on_remove` is `leave` (the default: the
-- copies stay open, no longer managed) or `close` (the follower's owner closes every copy the
-- link made). A removed link with `close` leaves a row in `removed_links` (by trigger, so a plain
-- DELETE counts too), which the follower's owner reads with its links, acts on, and deletes
-- (fenced) once none of the link's copies is open.
ALTER TABLE copy_links ADD COLUMN on_remove text NOT NULL DEFAULT 'leave'
    CHECK (on_remove IN ('leave', 'close'));

CREATE TABLE removed_links (
    link_id     bigint PRIMARY KEY,
    follower_id bigint NOT NULL REFERENCES trading_accounts (id) ON DELETE CASCADE,
    master_id   bigint NOT NULL,
    magic       bigint NOT NULL,
    removed_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX removed_links_follower_idx ON removed_links (follower_id);

CREATE FUNCTION copier_link_removed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO removed_links (link_id, follower_id, master_id, magic)
    VALUES (OLD.id, OLD.follower_id, OLD.master_id, OLD.magic)
    ON CONFLICT (link_id) DO NOTHING;
    RETURN NULL;
END
$$;

CREATE TRIGGER copy_links_removed
    AFTER DELETE ON copy_links
    FOR EACH ROW WHEN (OLD.on_remove = 'close')
    EXECUTE FUNCTION copier_link_removed();
