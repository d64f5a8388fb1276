-- Pending orders (issue 21): masters publish their resting limit and stop orders beside their
-- positions, followers copy them as pending orders under the same marker (`mc<masterTicket>`).

-- A master's pending orders after its last event: a JSON array of {ticket, symbol, side, kind,
-- price, volume, sl, tp, expiry_ms, expiry_utc_ms, magic, first_seen_ms, contract_size}.
-- `expiry_ms` is on the master server's clock, `expiry_utc_ms` the same instant in UTC (the
-- master session measures its server's offset from the node's clock); `first_seen_ms` is the
-- database's clock, as for positions. Written by the same fenced publish as `positions`.
ALTER TABLE master_state ADD COLUMN orders jsonb NOT NULL DEFAULT '[]'
    CHECK (jsonb_typeof(orders) = 'array');

-- Per link: `copy` places a pending copy of every pending master order (its fill then is the
-- copy); `fill_only` copies only the fill, as a market order.
ALTER TABLE copy_links ADD COLUMN pending_orders text NOT NULL DEFAULT 'copy'
    CHECK (pending_orders IN ('copy', 'fill_only'));

-- One row per pending copy a follower placed (or was found holding by its marker): written by the
-- follower's owner, fenced by its node and epoch, BEFORE the place is sent (as the FIX ledger
-- records an order before it leaves), so a crash between the two cannot make a later owner place
-- it again. It is what "ever placed" reads: a pending copy is placed at most once per link and
-- master order, across restarts and owners. `ended` says how it left the book when the follower
-- knows it left without a fill (its cancel confirmed, the broker's `order_gone`, a refusal): only
-- then is the master order's fill copied at market; a pending copy whose end is unknown (a place
-- whose reply was lost and that no read shows yet) may still rest or fill.
CREATE TABLE order_copies (
    follower_id     bigint NOT NULL REFERENCES trading_accounts (id) ON DELETE CASCADE,
    server          text   NOT NULL,
    login           text   NOT NULL,
    link_id         bigint NOT NULL,
    master_id       bigint NOT NULL,
    -- The master's broker account when recorded (a master row moved to another account has
    -- other orders, whose tickets may repeat).
    master_server   text   NOT NULL,
    master_login    text   NOT NULL,
    master_ticket   bigint NOT NULL,
    follower_ticket bigint,            -- the pending copy's ticket, once known
    -- cancelled, expired (the broker said so), refused (never on the book), vanished (on the book
    -- once, then in none of an ordered read of orders, positions and history)
    ended           text CHECK (ended IN ('cancelled', 'expired', 'refused', 'vanished')),
    node_id         text   NOT NULL,
    owner_epoch     bigint NOT NULL,
    recorded_at     timestamptz NOT NULL DEFAULT now(),
    ended_at        timestamptz,
    PRIMARY KEY (follower_id, server, login, link_id, master_server, master_login, master_ticket)
);
