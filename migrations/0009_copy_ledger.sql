-- The copy ledger: one row per copy a follower holds or held, written by the follower's owner
-- (fenced by its node and epoch) when the broker accepts the copy, or when a reconcile finds a
-- copy by its marker that has no row yet (an order whose reply was lost). It is what "ever
-- copied" reads, so the rule that a copy the follower closed is never reopened (R2) does not
-- depend on how much history a broker keeps; and it carries what operators show their followers:
-- requested and filled price, slippage, and the copy's latency split into legs.
--
-- Clocks: master_fill_ms is the master broker's clock; event_committed_ms the database's (when a
-- master session first recorded the position); decided_ms and accepted_ms the follower node's.
-- A leg across two clocks carries their offset (NTP-synchronised hosts: milliseconds).
CREATE TABLE copy_ledger (
    follower_id        bigint NOT NULL REFERENCES trading_accounts (id) ON DELETE CASCADE,
    follower_ticket    bigint NOT NULL,
    -- The broker account the copy is on: a row whose server or login changes trades another
    -- account, whose copies are its own.
    server             text   NOT NULL,
    login              text   NOT NULL,
    link_id            bigint NOT NULL,
    master_id          bigint NOT NULL,
    -- The master's broker account when the copy was recorded: a master row moved to another
    -- account has other positions, whose ticket numbers may repeat.
    master_server      text   NOT NULL,
    master_login       text   NOT NULL,
    master_ticket      bigint NOT NULL,
    symbol             text   NOT NULL,
    side               text   NOT NULL CHECK (side IN ('buy', 'sell')),
    volume             double precision NOT NULL,
    requested_price    double precision,   -- the master's open price
    filled_price       double precision NOT NULL,
    slippage           double precision,   -- filled - requested, against the copy (price units)
    slippage_bps       double precision,   -- the same in basis points of the requested price
    master_fill_ms     bigint,
    event_committed_ms bigint,
    decided_ms         bigint,
    accepted_ms        bigint,
    found_by_reconcile boolean NOT NULL DEFAULT false,  -- no reply seen: found by its marker
    node_id            text   NOT NULL,
    owner_epoch        bigint NOT NULL,
    recorded_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (follower_id, server, login, follower_ticket)
);

-- Every copy of one master position under one link (R2, `copier-node why`).
CREATE INDEX copy_ledger_master_idx ON copy_ledger (follower_id, link_id, master_ticket);
-- An account's recent copies (`copier-node copies`).
CREATE INDEX copy_ledger_recent_idx ON copy_ledger (follower_id, recorded_at DESC);
