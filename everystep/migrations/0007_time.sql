-- Time and control: delayed starts, durable sleep, cancellation, step retries.
--
-- `due_at`: when the run becomes claimable, by the database's clock. A run
-- scheduled without a delay is due at once (its insert's now()); a delayed
-- run, and a run parked by a durable sleep or a retry's back-off, is
-- `waiting` until its due time. (A constant default: existing rows are due
-- at the time of this migration, i.e. at once.)
ALTER TABLE everystep_workflow ADD COLUMN due_at timestamptz NOT NULL DEFAULT now();

-- A durable cancel request on a running run: its execution learns it from
-- the answer of its next step write (or from its claim) and raises
-- `Cancelled` at the body's next step call; the run ends `cancelled`.
ALTER TABLE everystep_workflow ADD COLUMN cancel_requested_at timestamptz;
ALTER TABLE everystep_workflow ADD COLUMN cancel_reason text;

-- The one index every claim uses, for ready and waiting runs alike: the
-- claim is `status IN ('scheduled', 'waiting') AND due_at <= now() ORDER BY
-- due_at`, a range scan that never reads a run not due yet. It replaces the
-- index of the `scheduled` rows alone.
CREATE INDEX everystep_workflow_due ON everystep_workflow (due_at) WHERE status IN ('scheduled', 'waiting');
DROP INDEX everystep_workflow_claimable;

-- A step's failed attempts before the last, when it is retried:
-- [{"attempt": 1, "error": {...}, "at": <epoch>, "retry_at": <epoch>}, ...].
-- A step waiting for its next attempt has the status `retrying`.
ALTER TABLE everystep_step ADD COLUMN attempts jsonb;
