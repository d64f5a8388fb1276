-- Admission: how many of a node's sessions are still starting (claimed, not yet logged in and
-- reconciled), as of its last cycle. Peers hand no account to a node still starting its own:
-- fair share waits until the receivers are ready. Not indexed: membership renewals stay HOT.
ALTER TABLE nodes ADD COLUMN starting integer NOT NULL DEFAULT 0 CHECK (starting >= 0);
