-- Copy protections per link (SPEC section 3a). Every column is optional or has a default that
-- keeps the link's earlier behaviour; each one only ever stops or shrinks a new copy, never
-- touches a copy that is already open (closes, partial closes and stop changes always follow the
-- master). Every "not copied" decision is recorded in copy_skips with its reason.
--
-- symbols       copy only master positions on these master symbols (NULL: every symbol)
-- magics        copy only master positions with these magic numbers (NULL: every magic)
-- sides         copy only the master's buys or sells ('both', 'buy', 'sell'), before `reverse`
-- close_only    copy nothing new; open copies still follow the master until they close
-- max_lot       cap on a copy's volume (rounded down to the follower symbol's step)
-- max_delay_ms  do not open a copy more than this long after the master's session first
--               recorded the position (database clock): no late copies after a follower outage
-- max_slippage  worst price a copy may fill at, as a distance from the master's open price (in
--               price units of the follower's symbol); sent with the order as its price limit
-- equity_stop   no new copies while the follower's equity is at or below this
-- lot_mode 'risk_percent': the copy risks lot_value percent of the follower's equity between its
-- open price and its stop loss (copies of positions without a stop loss are skipped).
ALTER TABLE copy_links ADD COLUMN symbols text[];
ALTER TABLE copy_links ADD COLUMN magics bigint[];
ALTER TABLE copy_links ADD COLUMN sides text NOT NULL DEFAULT 'both'
    CHECK (sides IN ('both', 'buy', 'sell'));
ALTER TABLE copy_links ADD COLUMN close_only boolean NOT NULL DEFAULT false;
ALTER TABLE copy_links ADD COLUMN max_lot double precision CHECK (max_lot > 0);
ALTER TABLE copy_links ADD COLUMN max_delay_ms bigint CHECK (max_delay_ms >= 0);
ALTER TABLE copy_links ADD COLUMN max_slippage double precision CHECK (max_slippage >= 0);
ALTER TABLE copy_links ADD COLUMN equity_stop double precision CHECK (equity_stop >= 0);
ALTER TABLE copy_links DROP CONSTRAINT copy_links_lot_mode_check;
ALTER TABLE copy_links ADD CONSTRAINT copy_links_lot_mode_check
    CHECK (lot_mode IN ('fixed', 'multiplier', 'balance_ratio', 'equity_ratio', 'risk_percent'));
