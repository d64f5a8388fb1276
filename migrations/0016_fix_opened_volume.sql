-- A FIX position's volume when it opened (issue 39), written once and never updated: the volume
-- its own opening fill gave (the filled quantity of the order that opened it, in lots), or for a
-- position first seen by a read (opened by someone else, or before this column existed) the
-- volume of that first sighting. `volume` is the volume when last seen open and falls with every
-- partial close; a copy's trim scales its *opening* volume like the master's, so deriving that
-- opening volume from the current one (as before) re-applied the master's ratio at every rebuild
-- of the follower's copies. The adapter's history reports `opened_volume - volume` as the
-- position's partial closes.
ALTER TABLE fix_positions ADD COLUMN opened_volume double precision CHECK (opened_volume > 0);
