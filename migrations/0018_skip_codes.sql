-- Copy decisions' codes as a closed set the schema holds (`copier_node::copier::rules::SkipCode`
-- defines them; a test holds this list to that definition). `unknown` is the code of rows written
-- before migration 6, which recorded none. NOT VALID: the rows already there are not scanned (the
-- table is a history and may be large; every row the node wrote carries one of these codes), and
-- every row written from now on is checked. A new code comes with a migration widening this list,
-- applied before the binaries that write it roll out.
ALTER TABLE copy_skips ADD CONSTRAINT copy_skips_code_check CHECK (code IN (
    'link_disabled', 'close_only', 'filtered', 'opened_before_link', 'too_late', 'equity_stop',
    'risk_limit', 'symbol_not_found', 'below_min_volume', 'invalid_volume', 'below_min_trade',
    'no_stop_loss', 'unknown_point', 'slippage', 'rejected', 'market_closed', 'requote',
    'unavailable', 'waiting', 'unknown'
)) NOT VALID;
