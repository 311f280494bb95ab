-- A queue table whose dead rows a vacuum cannot remove is rewritten with
-- only its live rows. While a snapshot is held open (a forgotten session
-- idle in a transaction, a long report), no vacuum removes a row deleted
-- after it was taken: every claim deletes a ready row, and the next claims
-- step over each one's index entry at the front of the ready order, the
-- timers' admission over those at the front of the due order. The walk grew
-- with every run until the snapshot went (held_back: 768 buffers read per
-- claim after 30 s, 2.8 ms; throughput 0.6 of the unheld after 60 s). The
-- maintenance sweep calls this for a queue table that still holds dead rows
-- after its vacuum; TRUNCATE drops them whatever the snapshots, and the
-- live rows (a backlog of some thousands at most: the sweep's cap) are put
-- back as they were. It takes the table's ACCESS EXCLUSIVE lock, waiting
-- at most `wait_ms` for it (claims and admissions queue behind it while it
-- waits): false, and nothing changed, when another transaction held the
-- table that long (a producer's transaction that scheduled a run and has
-- not committed yet); the next sweep tries again. A reader whose snapshot
-- is older than the TRUNCATE sees the table empty (TRUNCATE is not
-- MVCC-safe): these tables are the queue's own, read by its statements.
CREATE FUNCTION everystep_compact(queue regclass, wait_ms integer) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    kept text;
    waited text := current_setting('lock_timeout');
BEGIN
    IF queue NOT IN ('everystep_ready'::regclass, 'everystep_timer'::regclass, 'everystep_blocked'::regclass) THEN
        RAISE EXCEPTION 'everystep_compact: % is not a queue table', queue;
    END IF;
    PERFORM set_config('lock_timeout', wait_ms || 'ms', true);
    EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', queue);
    EXECUTE format('SELECT array_agg(q)::text FROM %s q', queue) INTO kept;
    EXECUTE format('TRUNCATE %s', queue);
    EXECUTE format('INSERT INTO %1$s SELECT (unnest($1::%1$s[])).*', queue) USING kept;
    PERFORM set_config('lock_timeout', waited, true);
    RETURN true;
EXCEPTION WHEN lock_not_available THEN
    RETURN false;
END $$;
