-- Sizing across currencies, stops in points, and a limit per follower (issue 19):
--   trading_accounts.currency         the account's currency as its broker reports it (written by
--                                     the owning node, fenced, beside balance and equity)
--   trading_accounts.max_open_copies  the follower opens no copy while it holds this many,
--                                     whatever link they came from
--   copy_links.sl_points, tp_points   a fixed stop loss / take profit this many points from the
--                                     copy's open price, instead of the master's
--   copy_ledger.slippage_points       slippage in the follower symbol's points
ALTER TABLE trading_accounts ADD COLUMN currency text CHECK (currency ~ '^[A-Z]{3}$');
ALTER TABLE trading_accounts ADD COLUMN max_open_copies integer CHECK (max_open_copies >= 1);
ALTER TABLE copy_links ADD COLUMN sl_points double precision CHECK (sl_points > 0);
ALTER TABLE copy_links ADD COLUMN tp_points double precision CHECK (tp_points > 0);
ALTER TABLE copy_ledger ADD COLUMN slippage_points double precision;
