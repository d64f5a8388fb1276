-- A live copy's path in microseconds, so its sub-millisecond legs can be read (the `*_ms` columns
-- stay, and keep their meaning): the event committed (`event_committed_us`, the database's clock
-- when the master's session first recorded the position), and on the follower node's clock the
-- master event's notice received (`notice_us`), the decision (`decided_us`), the order handed to
-- the broker connection (`sent_us`) and the broker's reply (`accepted_us`). NULL where it is not
-- known: rows written before this migration or by older binaries, copies found by a reconcile,
-- and legs a copy did not go through (a copy decided by a reconcile received no notice).
ALTER TABLE copy_ledger
    ADD COLUMN event_committed_us bigint,
    ADD COLUMN notice_us bigint,
    ADD COLUMN decided_us bigint,
    ADD COLUMN sent_us bigint,
    ADD COLUMN accepted_us bigint;
