-- The copy engine: what masters publish, and what followers decided not to copy.

-- A master's published state: its open positions after the last event, and that event's
-- (epoch, seq). Written only by the master's owner, in one statement that locks the master's
-- account row and matches its owner and epoch (a fenced write); the NOTIFY that announces the
-- event is issued from that statement's result, so an event is announced only if it was stored.
-- `positions` is a JSON array of {ticket, symbol, side, volume, open_volume, open_price, sl, tp,
-- first_seen_ms}: `first_seen_ms` is when a master session first recorded the position, on the
-- database's clock (it decides which links copy it), `open_volume` its volume then.
CREATE TABLE master_state (
    master_id  bigint PRIMARY KEY REFERENCES trading_accounts (id) ON DELETE CASCADE,
    epoch      bigint NOT NULL,        -- the master's ownership generation that published
    seq        bigint NOT NULL,        -- rises by one per event within an epoch
    positions  jsonb  NOT NULL CHECK (jsonb_typeof(positions) = 'array'),
    updated_at timestamptz NOT NULL
);

-- Why a master position was not copied to a follower (one row per link and master ticket, the
-- latest reason): operators query it; written by the follower's owner, fenced like every write.
CREATE TABLE copy_skips (
    link_id       bigint NOT NULL REFERENCES copy_links (id) ON DELETE CASCADE,
    master_ticket bigint NOT NULL,
    follower_id   bigint NOT NULL,
    reason        text   NOT NULL,
    decided_at    timestamptz NOT NULL,
    PRIMARY KEY (link_id, master_ticket)
);
-- Serves: "why was nothing copied to follower X" queries.
CREATE INDEX copy_skips_follower_idx ON copy_skips (follower_id, decided_at);

-- The master volume a late copy was sized for: a copy opened after its master had already closed
-- part of the position. Later partial closes scale the copy against this instead of the master's
-- open volume. Copies opened at the master's full volume need no row. Written by the follower's
-- owner, fenced.
CREATE TABLE copy_bases (
    follower_id   bigint NOT NULL REFERENCES trading_accounts (id) ON DELETE CASCADE,
    copy_ticket   bigint NOT NULL,
    link_id       bigint NOT NULL,
    master_ticket bigint NOT NULL,
    master_volume double precision NOT NULL,
    PRIMARY KEY (follower_id, copy_ticket)
);
