-- Stops and sizes per link (the copy rules of the leading copiers):
--   copy_sl, copy_tp   copy the stop loss / take profit separately (both need copy_sl_tp)
--   max_sl_distance    the farthest a copy's stop loss may be from the master's open price
--   use_min_lot        a copy that rounds below the broker's minimum opens at the minimum
--   min_master_lot     master positions smaller than this are not copied
--   max_open_copies    the link opens no copy while it holds this many
ALTER TABLE copy_links ADD COLUMN copy_sl boolean NOT NULL DEFAULT true;
ALTER TABLE copy_links ADD COLUMN copy_tp boolean NOT NULL DEFAULT true;
ALTER TABLE copy_links ADD COLUMN max_sl_distance double precision CHECK (max_sl_distance > 0);
ALTER TABLE copy_links ADD COLUMN use_min_lot boolean NOT NULL DEFAULT false;
ALTER TABLE copy_links ADD COLUMN min_master_lot double precision CHECK (min_master_lot > 0);
ALTER TABLE copy_links ADD COLUMN max_open_copies integer CHECK (max_open_copies >= 1);
