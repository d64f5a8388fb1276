-- Pending orders over FIX (issue 21): a follower on FIX places its pending copies as entry
-- orders (NewOrderSingle, OrdType limit or stop, no PosMaintRptID), amends them by
-- OrderCancelReplaceRequest and cancels them by OrderCancelRequest. They are rows of the FIX
-- ledger like every order the adapter sends: written (fenced) before they leave.

-- `entry`: a resting order that opens a position when it fills. `replaced`: the ClOrdID of an
-- entry order a cancel/replace superseded (the row of the new ClOrdID names it in `replaces`);
-- `expired`: an entry order the venue ended at its ExpireTime.
ALTER TABLE fix_orders DROP CONSTRAINT fix_orders_kind_check,
    ADD CONSTRAINT fix_orders_kind_check
        CHECK (kind IN ('open', 'close', 'sl', 'tp', 'entry'));
ALTER TABLE fix_orders DROP CONSTRAINT fix_orders_state_check,
    ADD CONSTRAINT fix_orders_state_check
        CHECK (state IN ('sent', 'filled', 'rejected', 'working', 'canceled', 'replaced',
                         'expired'));

-- An entry order's terms: limit or stop (at `price`), the stops its position gets once it fills
-- (FIX entry orders carry none: the adapter protects the position with resting orders, as for
-- every copy), when it expires (Unix ms, UTC: a FIX venue's clock), the ticket the copy engine
-- knows it by (2^52 + the venue's OrderID, which a cancel/replace keeps), and the ClOrdID it
-- replaces.
ALTER TABLE fix_orders
    ADD COLUMN order_type text CHECK (order_type IN ('limit', 'stop')),
    ADD COLUMN sl         double precision,
    ADD COLUMN tp         double precision,
    ADD COLUMN expiry_ms  bigint,
    ADD COLUMN ticket     bigint,
    ADD COLUMN replaces   text;

-- Entry orders placed by others (a master's trader, another platform) are rows too, once a read
-- of the venue's orders (OrderMassStatusRequest) or its report of them showed them: recorded
-- `working`, without a marker, so that how they end is asked of the venue like ours.

-- The ticket the copy engine knows a position by, when it is not its PosMaintRptID: a position an
-- entry order opened carries the order's ticket (as MT4/MT5 positions keep their order's), so a
-- pending order and its fill are one ticket to masters and followers alike, across owners.
ALTER TABLE fix_positions ADD COLUMN ticket bigint;

-- The entry orders in force or without an outcome, read with every read of the account's orders.
CREATE INDEX fix_orders_entries ON fix_orders (account_id)
    WHERE kind = 'entry' AND state IN ('sent', 'working');
