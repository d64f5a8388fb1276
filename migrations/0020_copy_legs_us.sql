-- A live copy's path in microseconds, so its sub-millisecond legs can be read (the `*_ms` columns
-- stay, and keep their meaning): the event committed (`event_committed_us`, the database's clock
-- when the master's session first recorded the position), and on the follower node's clock the
-- master event's notice received (`notice_us`), the decision (`decided_us`), the order handed to
-- the broker connection (`sent_us`) and the broker's reply (`accepted_us`). NULL where it is not
-- known: rows written before this migration or by older binaries, the event's instant of a master
-- position stamped before `first_seen_us` existed, the node-clock instants of a copy found by a
-- reconcile, and the notice of a copy a reconcile decided (it heard no notice).
ALTER TABLE copy_ledger
    ADD COLUMN event_committed_us bigint,
    ADD COLUMN notice_us bigint,
    ADD COLUMN decided_us bigint,
    ADD COLUMN sent_us bigint,
    ADD COLUMN accepted_us bigint;
