-- Risk limits over time, per follower (issue 21): drawdown limits on balance or equity, daily,
-- weekly, monthly or lifetime, absolute (money) or relative (percent of the period's starting
-- value), each with an action when hit: `close_only` (no new copies) or `close_all` (close every
-- copy, then close-only). Periods follow the broker's server clock (its trading day).
--
-- The limit's state lives on its row, written by the account's owner fenced by (node, epoch),
-- so it survives a failover: `period_key` names the period `start_value` belongs to, and
-- `hit_at`/`hit_reason` say the limit was reached in it. A new period starts clean; an operator
-- resets a limit early by clearing the state (`copier-node risk reset`).
CREATE TABLE risk_limits (
    id          bigserial PRIMARY KEY,
    account_id  bigint NOT NULL REFERENCES trading_accounts (id) ON DELETE CASCADE,
    period      text NOT NULL CHECK (period IN ('daily', 'weekly', 'monthly', 'lifetime')),
    basis       text NOT NULL CHECK (basis IN ('balance', 'equity')),
    relative    boolean NOT NULL,
    amount      double precision NOT NULL
        CHECK (amount > 0 AND amount < 'Infinity' AND (NOT relative OR amount <= 100)),
    action      text NOT NULL DEFAULT 'close_only' CHECK (action IN ('close_only', 'close_all')),
    period_key  text,
    start_value double precision,
    hit_at      timestamptz,
    hit_reason  text,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (account_id, period, basis)
);

-- A limit added, changed, removed or reset by an operator is announced on the follower's link
-- channel, so its session re-reads at once; the owner's own state writes are not.
CREATE FUNCTION copier_risk_limits_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        PERFORM pg_notify('copier_links', OLD.account_id::text);
    ELSIF TG_OP = 'INSERT'
       OR (NEW.period, NEW.basis, NEW.relative, NEW.amount, NEW.action)
          IS DISTINCT FROM (OLD.period, OLD.basis, OLD.relative, OLD.amount, OLD.action)
       OR (NEW.period_key IS NULL AND OLD.period_key IS NOT NULL) THEN
        PERFORM pg_notify('copier_links', NEW.account_id::text);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER risk_limits_changed
    AFTER INSERT OR UPDATE OR DELETE ON risk_limits
    FOR EACH ROW EXECUTE FUNCTION copier_risk_limits_changed();
