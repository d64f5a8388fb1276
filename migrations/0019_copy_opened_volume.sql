-- The volume a copy opened with, as the node that recorded it knew it: the broker's fill (a FIX
-- venue's fill of a limit order may be less than asked), or, for a copy found by its marker or
-- lineage, what was open plus what its history had closed. A new owner takes it as the floor of
-- the copy's opening volume, so a broker that keeps no history of a partial close cannot make a
-- trimmed copy look opened smaller (and trim it again). NULL where it is not known: rows written
-- before this migration (their `volume` is the volume asked, which a partial fill may exceed),
-- rows of older binaries during a rolling upgrade, and a copy whose reply was a duplicate that
-- did not say what opened.
ALTER TABLE copy_ledger ADD COLUMN opened_volume double precision;
