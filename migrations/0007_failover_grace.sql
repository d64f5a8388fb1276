-- PostgreSQL failing over (issue 16). A promoted standby may lack the last commits the old
-- primary acknowledged: claims, releases, renewals and the epoch sequence's own progress. Every
-- lease cycle reads the server's WAL timeline and system identifier and compares them with what
-- the cluster last recorded here; the first cycle that sees them change
--
-- * starts a grace: `claims_after = now() + the longest lease + 1 s`. Until then no cycle claims a
--   row it does not hold continuously (no free row, no dead node's row, not its own lapsed row),
--   so every gate the old primary may have opened has closed before anyone is granted anything;
-- * moves the epoch sequence into a new era (epochs from `era << 40` on), so an epoch handed out
--   on the lost tail is never handed out again: the era is at least the timeline plus
--   `era_offset`, above the era recorded here, and above the sequence's own. A timeline only grows
--   within one cluster's history; on a different cluster (a dump restored, timeline 1 again)
--   `era_offset` grows so the era still does.
--
-- The server's WAL timeline, or NULL where a client may not read it (some managed services) or
-- on a standby. The exception block keeps an unreadable timeline from failing the cycle.
CREATE FUNCTION copier_timeline() RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::integer;
EXCEPTION WHEN others THEN
    RETURN NULL;
END
$$;

-- The server's system identifier (new with every initdb), or NULL where it cannot be read.
CREATE FUNCTION copier_system_id() RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN (SELECT system_identifier FROM pg_control_system());
EXCEPTION WHEN others THEN
    RETURN NULL;
END
$$;

-- One row. The cycle updates it only when something changed, so renewals never touch it; a lost
-- update is simply detected again by the next cycle on the new primary.
CREATE TABLE copier_database (
    singleton      boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    timeline       integer,      -- the WAL timeline the last change was seen on
    system_id      bigint,       -- pg_control_system().system_identifier, likewise
    era_offset     integer NOT NULL DEFAULT 0,
    claims_after   timestamptz,  -- no claims before this (the grace after a failover)
    failed_over_at timestamptz,  -- when a cycle last saw the timeline or the system change
    max_lease_ms   bigint        -- the longest lease any node ever ran with (the grace covers it)
);
-- The baseline is this server as the migration finds it, so a failover right after the
-- migration (before any cycle) is still seen.
INSERT INTO copier_database (singleton, timeline, system_id)
VALUES (true, copier_timeline(), copier_system_id());
-- One row, and the planner should know it from the start (the cycle joins it).
ANALYZE copier_database;

-- The grace, enforced below every statement: during it no row of trading_accounts takes a new
-- epoch (every claim and re-claim does; renewals and releases keep theirs). The cycle of this
-- release claims nothing then anyway; this stops what does not know the grace (a binary from
-- before this migration during a rolling upgrade, a hand-written UPDATE): the row is left as it
-- was, so the claimer does not get it. Renewals never run the function (the WHEN clause).
CREATE FUNCTION copier_no_claims_in_grace() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT FROM copier_database WHERE claims_after > now()) THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER trading_accounts_no_claims_in_grace
    BEFORE UPDATE ON trading_accounts
    FOR EACH ROW WHEN (OLD.owner_epoch IS DISTINCT FROM NEW.owner_epoch)
    EXECUTE FUNCTION copier_no_claims_in_grace();

-- The timeline each master snapshot was written on. A snapshot from an older timeline (or from
-- before `failed_over_at`) may lack the master's last changes: a follower reconciling against it
-- would close copies of positions the master still holds. Followers wait for the owner to
-- publish again instead. NULL (written by an older binary) is judged by `failed_over_at` alone.
ALTER TABLE master_state ADD COLUMN timeline integer;
