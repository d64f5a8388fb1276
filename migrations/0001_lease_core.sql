-- The lease core: accounts owned through two columns, node membership, ownership generations.
--
-- Design constraints (measured in shared/notes/lease-sql-measurements.md):
--   * renewals rewrite `lease_until` on every owned row every cycle, so no index and no index
--     predicate may mention `lease_until`: renewals must stay HOT updates;
--   * the claim must be index-driven at 1M rows: free rows come from a partial index, expired
--     rows are found through their owner's expired membership (a handful of `nodes` rows), never
--     by scanning `trading_accounts`.

-- Ownership generations (fencing tokens). One global sequence, so an epoch never goes backwards
-- even if an account row is deleted and re-added, and an epoch alone names one claim of one row.
CREATE SEQUENCE owner_epoch_seq AS bigint START WITH 1;

-- Membership: one row per node id, renewed in the same statement as the node's leases, so an
-- expired membership means every lease of that node has expired too (both are written with the
-- same `now()`). `instance_id` is fresh per process: a second process with the same node id
-- sees a live membership of another instance and takes nothing (SPEC S4).
CREATE TABLE nodes (
    node_id     text PRIMARY KEY,
    instance_id text        NOT NULL,
    platform    text        NOT NULL,
    capacity    integer     NOT NULL CHECK (capacity >= 1),
    lease_until timestamptz NOT NULL,  -- by the database's clock; never indexed (HOT renewals)
    started_at  timestamptz NOT NULL,  -- when this instance first registered
    renewed_at  timestamptz NOT NULL   -- last successful cycle of this instance
);

CREATE TABLE trading_accounts (
    id          bigint PRIMARY KEY,
    platform    text    NOT NULL CHECK (platform <> ''),
    role        text    NOT NULL CHECK (role IN ('master', 'follower')),
    enabled     boolean NOT NULL DEFAULT true,
    server      text    NOT NULL,           -- broker endpoint, host:port
    login       text    NOT NULL,           -- login on that broker
    credentials text,                       -- broker password; NULL logs in without one
    -- Owner now. The foreign key guarantees every owned row has a membership row, which is how
    -- peers find the rows of a dead node; a membership row cannot be deleted while it owns rows.
    node_id     text REFERENCES nodes (node_id),
    lease_until timestamptz,                -- by the database's clock; never indexed (HOT renewals)
    owner_epoch bigint  NOT NULL DEFAULT 0, -- set from owner_epoch_seq on every claim
    claimed_at  timestamptz,                -- when the current owner claimed it (database clock)
    status      text,                       -- written by the owner only, fenced by epoch
    status_at   timestamptz,
    balance     double precision,
    equity      double precision,
    -- The platform while the row is claimable (enabled, no owner); NULL otherwise. Renewals do
    -- not change its inputs, so the index on it does not cost them their HOT update.
    free_platform text GENERATED ALWAYS AS
                  (CASE WHEN enabled AND node_id IS NULL THEN platform END) STORED,
    CHECK (node_id IS NULL OR lease_until IS NOT NULL)  -- an owned row always has a lease
) WITH (fillfactor = 50);
-- Why 50: a node claims rows in id order, so one node's rows fill whole pages, and one renewal
-- statement writes a new version of every row on such a page at once. A HOT update needs room
-- for the new version on the same page; the old versions of the previous cycle are pruned the
-- next time the page is read. Half of each page free fits one new version of every row on it:
-- measured, fillfactor 90 left 55 % of renewals non-HOT when one node owns whole pages (the
-- test `renewals_are_hot_updates`), fillfactor 50 keeps them HOT. The cost is a table twice
-- the size, about 300 MB per million accounts.

-- Serves: renewal (`WHERE node_id = $me`), the claim of a dead node's rows (join from expired
-- `nodes` rows), releases, fenced status writes, and the foreign-key check when a `nodes` row is
-- deleted. Renewals do not change `node_id`, so this index does not cost them their HOT update.
CREATE INDEX trading_accounts_node_idx ON trading_accounts (node_id);

-- Serves: the claim of free rows (`WHERE free_platform = $p ORDER BY id LIMIT $n FOR UPDATE SKIP
-- LOCKED`). `free_platform` (below) is the platform of a claimable row and NULL otherwise, so the
-- index holds only free rows, and because it is a column ANALYZE knows how rare free rows are: with
-- the predicate spelled out (`enabled AND node_id IS NULL`) the planner multiplies independent
-- selectivities, expects thousands of free rows, and walks the primary key in id order instead,
-- reading the whole table when none is free (measured at 1M rows; the seed's problem). Releases
-- clear `node_id` and `lease_until` together, so a free row is exactly `node_id IS NULL`, and
-- nothing here mentions `lease_until`.
CREATE INDEX trading_accounts_free_idx ON trading_accounts (free_platform, id)
    WHERE free_platform IS NOT NULL;

-- Magic numbers for copy links: unique per link, within MT4's 32-bit signed magic range.
CREATE SEQUENCE copy_links_magic_seq AS bigint START WITH 100001 MAXVALUE 2147483647;

CREATE TABLE copy_links (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    master_id     bigint NOT NULL REFERENCES trading_accounts (id),
    follower_id   bigint NOT NULL REFERENCES trading_accounts (id),
    enabled       boolean NOT NULL DEFAULT true,
    magic         bigint  NOT NULL UNIQUE DEFAULT nextval('copy_links_magic_seq'),
    lot_mode      text    NOT NULL DEFAULT 'multiplier'
                  CHECK (lot_mode IN ('fixed', 'multiplier', 'balance_ratio', 'equity_ratio')),
    lot_value     double precision NOT NULL DEFAULT 1.0 CHECK (lot_value > 0),
    reverse       boolean NOT NULL DEFAULT false,
    copy_sl_tp    boolean NOT NULL DEFAULT true,
    symbol_map    jsonb   NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(symbol_map) = 'object'),
    copy_existing boolean NOT NULL DEFAULT false,
    created_at    timestamptz NOT NULL DEFAULT now(),
    UNIQUE (master_id, follower_id),
    CHECK (master_id <> follower_id)
);
ALTER SEQUENCE copy_links_magic_seq OWNED BY copy_links.magic;

-- Serves: a follower's session loading its links.
CREATE INDEX copy_links_follower_idx ON copy_links (follower_id);
