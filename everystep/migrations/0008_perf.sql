-- Who needs a notification. PostgreSQL serialises the commits of all
-- notifying transactions of the server on one lock held across the WAL flush,
-- so a NOTIFY in every scheduling transaction stops scheduling clients from
-- sharing flushes (about ten times fewer runs/s from 16 clients here). Only
-- a worker with a free slot waiting on its LISTEN needs to be woken: it
-- registers here before it claims (under the exclusive wake lock, which waits
-- for the schedulers in flight), and leaves when its slots are full.
CREATE TABLE everystep_waiting (
    runner varchar(255) PRIMARY KEY,
    since  timestamptz NOT NULL DEFAULT now()
);

-- Called by every scheduling statement: notify the workers when one of them
-- is waiting, once per transaction. The shared wake lock, held to the
-- commit, makes a worker that registers later wait for this transaction, so
-- its claim after registering sees these runs. A VOLATILE function sees
-- rows committed after the calling statement started (READ COMMITTED); in
-- REPEATABLE READ and SERIALIZABLE the snapshot could miss a registration,
-- so those transactions always notify.
CREATE FUNCTION everystep_wake() RETURNS void LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF current_setting('everystep.woke', true) = 'yes' THEN
        RETURN;  -- this transaction has decided already (the setting ends with it)
    END IF;
    PERFORM set_config('everystep.woke', 'yes', true);
    IF current_setting('transaction_isolation') IN ('read committed', 'read uncommitted') THEN
        PERFORM pg_advisory_xact_lock_shared(hashtextextended('everystep:wake:' || current_schema(), 0));
        IF NOT EXISTS (SELECT 1 FROM everystep_waiting) THEN
            RETURN;
        END IF;
    END IF;
    PERFORM pg_notify('everystep:' || current_schema(), '');
END $$;
