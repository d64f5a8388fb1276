-- The FIX adapter's ledger. A FIX position carries no magic number and no comment, so the
-- relation between a copy's order (ClOrdID = the intent's client order id), the position it
-- opened (PosMaintRptID) and the master position it copies (the marker `mc<ticket>` and the
-- link's magic) lives here, where any later owner of the account reads it.

-- Every order a node sent over FIX, written (fenced by the sender's node and epoch) before the
-- order leaves, and completed when its ExecutionReport (or an OrderStatusRequest) says how it
-- ended. `kind`: open, close, or a resting order protecting a position (cTrader's way of a
-- stop loss or take profit: `sl` a stop, `tp` a limit, at `price`). `state`: sent (outcome not
-- known yet), filled, rejected, working (a resting order the venue accepted), canceled.
CREATE TABLE fix_orders (
    account_id  bigint      NOT NULL REFERENCES trading_accounts (id) ON DELETE CASCADE,
    cl_ord_id   text        NOT NULL,
    kind        text        NOT NULL CHECK (kind IN ('open', 'close', 'sl', 'tp')),
    symbol      text        NOT NULL,
    side        text        NOT NULL CHECK (side IN ('buy', 'sell')),
    quantity    double precision NOT NULL,   -- units (lots times the contract size)
    price       double precision,            -- a resting order's stop or limit price
    position_id bigint,                      -- the position it opened or reduced
    magic       bigint      NOT NULL DEFAULT 0,
    comment     text        NOT NULL DEFAULT '',
    state       text        NOT NULL DEFAULT 'sent'
                CHECK (state IN ('sent', 'filled', 'rejected', 'working', 'canceled')),
    reason      text,
    node_id     text        NOT NULL,
    owner_epoch bigint      NOT NULL,
    sent_at     timestamptz NOT NULL DEFAULT now(),
    done_at     timestamptz,
    PRIMARY KEY (account_id, cl_ord_id)
);

-- Orders whose outcome is not known yet, resolved by OrderStatusRequest before any new order.
CREATE INDEX fix_orders_unresolved ON fix_orders (account_id) WHERE state = 'sent';
-- Resting orders in force: a position's stop loss and take profit.
CREATE INDEX fix_orders_working ON fix_orders (account_id) WHERE state = 'working';

-- Every position the adapter has seen on a FIX account: its copy marker (from the order that
-- opened it) and, once it is gone, when and at what price. Closed rows are the account's history
-- (what "ever copied" reads for FIX followers; what confirms a master's close).
CREATE TABLE fix_positions (
    account_id   bigint      NOT NULL REFERENCES trading_accounts (id) ON DELETE CASCADE,
    position_id  bigint      NOT NULL,
    symbol       text        NOT NULL,
    side         text        NOT NULL CHECK (side IN ('buy', 'sell')),
    volume       double precision NOT NULL,  -- lots when last seen open
    open_price   double precision NOT NULL,
    magic        bigint      NOT NULL DEFAULT 0,
    comment      text        NOT NULL DEFAULT '',
    opened_at    timestamptz NOT NULL DEFAULT now(),
    closed_at    timestamptz,
    close_price  double precision,
    PRIMARY KEY (account_id, position_id)
);
