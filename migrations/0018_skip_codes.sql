-- Copy decisions' codes as a closed set the schema holds (`copier_node::copier::rules::SkipCode`
-- defines them; a test holds this list to that definition). Two codes only older rows carry:
-- `unknown`, of rows written before migration 6, which recorded none, and `max_open_copies`,
-- which earlier binaries wrote when a link's max_open_copies refused a copy (it now holds the
-- copy back: `waiting`). NOT VALID: the rows already there are not scanned (the table is a
-- history and may be large), and every row written from now on is checked. A new code comes
-- with a migration widening this list, applied before the binaries that write it roll out.
ALTER TABLE copy_skips ADD CONSTRAINT copy_skips_code_check CHECK (code IN (
    'link_disabled', 'close_only', 'filtered', 'opened_before_link', 'too_late', 'equity_stop',
    'risk_limit', 'symbol_not_found', 'below_min_volume', 'invalid_volume', 'below_min_trade',
    'no_stop_loss', 'unknown_point', 'slippage', 'rejected', 'market_closed', 'requote',
    'unavailable', 'waiting', 'unknown', 'max_open_copies'
)) NOT VALID;
