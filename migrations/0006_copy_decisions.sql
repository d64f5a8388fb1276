-- Copy decisions as a history (issue 13). copy_skips kept one row per (link, master ticket) with
-- the latest reason; a position skipped and later copied kept its skip row, and a session recorded
-- a key once. Now every decision is its own row:
--
-- code        a closed set (symbol_not_found, below_min_volume, filtered, close_only,
--             link_disabled, equity_stop, too_late, slippage, rejected, market_closed, ...);
--             `reason` beside it is for people
-- final       true: the link will never copy this master position (a protection said no, the
--             broker rejected the open definitively, or a retried open ran past max_delay_ms);
--             every node's reconcile reads these and does not open the position.
--             false: a transient refusal (market closed, requote, broker unavailable, an input not
--             known yet) that is being retried; kept as history, never read by a reconcile
-- node_id, owner_epoch
--             who decided (the writer is fenced by them, like every write about an account)
ALTER TABLE copy_skips DROP CONSTRAINT copy_skips_pkey;
ALTER TABLE copy_skips ADD COLUMN id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY;
-- Rows written before this migration were re-evaluated at every reconcile: they stay so (not
-- final), with the code `unknown`.
ALTER TABLE copy_skips ADD COLUMN code text NOT NULL DEFAULT 'unknown';
ALTER TABLE copy_skips ADD COLUMN final boolean NOT NULL DEFAULT false;
ALTER TABLE copy_skips ADD COLUMN node_id text;
ALTER TABLE copy_skips ADD COLUMN owner_epoch bigint;
ALTER TABLE copy_skips ALTER COLUMN code DROP DEFAULT;
ALTER TABLE copy_skips ALTER COLUMN final DROP DEFAULT;
-- Serves: a reconcile's "which master positions did this follower's links decide never to copy"
-- (read per follower at every reconcile).
CREATE INDEX copy_skips_final_idx ON copy_skips (follower_id, link_id, master_ticket) WHERE final;

-- Account changes are announced too (SPEC section 4: changed rows are picked up within a cycle).
-- A session logs in with its row's server, login, credentials and role; a change to any of them,
-- announced on the same channel as link changes with the account's id, makes the owner's session
-- log out and start again from the new row. Only those columns fire it: a lease renewal or a
-- status write updates other columns and costs nothing here.
CREATE FUNCTION copier_account_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('copier_links', NEW.id::text);
    RETURN NULL;
END
$$;

CREATE TRIGGER trading_accounts_changed
    AFTER UPDATE OF server, login, role, credentials ON trading_accounts
    FOR EACH ROW
    WHEN (OLD.server IS DISTINCT FROM NEW.server
          OR OLD.login IS DISTINCT FROM NEW.login
          OR OLD.role IS DISTINCT FROM NEW.role
          OR OLD.credentials IS DISTINCT FROM NEW.credentials)
    EXECUTE FUNCTION copier_account_changed();
