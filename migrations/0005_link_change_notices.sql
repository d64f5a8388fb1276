-- Link changes are announced: every insert, update and delete on copy_links notifies the channel
-- `copier_links` with the follower's id, in the changing transaction (delivered at its commit;
-- identical notices of one transaction are delivered once). The follower's session, wherever it
-- runs, re-reads its links at once instead of finding the change by polling; its periodic
-- re-read stays only as a backstop.
CREATE FUNCTION copier_links_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        PERFORM pg_notify('copier_links', OLD.follower_id::text);
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        PERFORM pg_notify('copier_links', NEW.follower_id::text);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER copy_links_changed
    AFTER INSERT OR UPDATE OR DELETE ON copy_links
    FOR EACH ROW EXECUTE FUNCTION copier_links_changed();
