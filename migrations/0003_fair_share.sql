-- Fair share: what each node tells the others in its membership row, renewed every cycle.
--
-- `trust_until`: now() + (lease - fence) at the node's last renewal, on the database's clock. A
-- node whose trust_until has passed is gated (its own gate closed: it could not renew in time)
-- and does not count as live when the others compute their share.
-- `owned`: how many accounts the node runs sessions for, as of its last cycle. The platform's
-- total is the sum over live members plus the free rows, so no node counts the whole table.
-- Neither column is indexed: membership renewals stay HOT.
ALTER TABLE nodes ADD COLUMN trust_until timestamptz;
ALTER TABLE nodes ADD COLUMN owned integer NOT NULL DEFAULT 0 CHECK (owned >= 0);
