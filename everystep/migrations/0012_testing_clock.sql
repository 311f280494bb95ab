-- The engine's clock: everystep_now() is the "now" of every statement of
-- the engine (everystep/db/sql/) and of every default of its tables, so one
-- function decides the time of everything the engine times: delayed starts,
-- durable sleeps, the deadlines of waits, retries' back-offs, the fire times
-- of recurring schedules, cancel requests, the ends of runs, ages and
-- pruning. In a deployment it is the server's now(): its body is that call,
-- which the planner inlines, so a statement's plan (and its cost) is the
-- same as with now() written in it, and `due_at <= everystep_now()` is the
-- index condition `due_at <= now()` was.
--
-- Tests move it (everystep.testing.advance): everystep_set_clock() writes
-- the function again with an offset (or a fixed moment) in its body, in the
-- caller's transaction, and every session of the schema sees the new time
-- at its next statement (PostgreSQL drops the cached plans that inlined the
-- old body). The offset is in the function's body rather than in a table
-- because a function that reads a table is not inlined: it would run once
-- per row wherever it filters rows rather than bounds an index scan.
CREATE FUNCTION everystep_now() RETURNS timestamptz LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT pg_catalog.now() $$;

-- Set the engine's clock of this schema to `at`, from which it runs on (or
-- stands still at `at`, when `frozen`; NULL: as it did); returns `at`. The
-- workers are woken to look at their next due time. Only the owner of
-- everystep_now() (the role that migrated the schema) can; the moments are
-- written as epoch seconds, which read the same whatever the session's
-- DateStyle and TimeZone.
CREATE FUNCTION everystep_set_clock(at timestamptz, frozen boolean DEFAULT NULL) RETURNS timestamptz
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    body text;
BEGIN
    IF frozen IS NULL THEN
        -- A clock that stands still has no now() in its body.
        SELECT p.prosrc NOT LIKE '%now()%' INTO frozen
        FROM pg_proc p
        WHERE p.oid = 'everystep_now()'::regprocedure;
    END IF;
    IF frozen THEN
        body := format(' SELECT to_timestamp(%s) ', extract(epoch FROM at));
    ELSIF at = pg_catalog.now() THEN
        body := ' SELECT pg_catalog.now() ';
    ELSE
        body := format(' SELECT pg_catalog.now() + make_interval(secs => %s) ',
                       extract(epoch FROM at) - extract(epoch FROM pg_catalog.now()));
    END IF;
    EXECUTE format('CREATE OR REPLACE FUNCTION %I.everystep_now() RETURNS timestamptz LANGUAGE sql STABLE '
                   'PARALLEL SAFE AS %L', current_schema(), body);
    PERFORM pg_notify('everystep:' || current_schema(), '');
    RETURN at;
END $$;
REVOKE EXECUTE ON FUNCTION everystep_set_clock(timestamptz, boolean) FROM PUBLIC;

-- The times the tables take by default are the engine's too, so that ages,
-- listings and pruning agree with the due times and ends the statements
-- write. (The migration ledger keeps now(): the applier writes it before
-- any migration has made this function.)
ALTER TABLE everystep_workflow ALTER COLUMN created_at SET DEFAULT everystep_now();
ALTER TABLE everystep_workflow ALTER COLUMN due_at SET DEFAULT everystep_now();
ALTER TABLE everystep_waiting ALTER COLUMN since SET DEFAULT everystep_now();
ALTER TABLE everystep_limit ALTER COLUMN updated_at SET DEFAULT everystep_now();
ALTER TABLE everystep_route ALTER COLUMN updated_at SET DEFAULT everystep_now();
ALTER TABLE everystep_message ALTER COLUMN created_at SET DEFAULT everystep_now();
ALTER TABLE everystep_event ALTER COLUMN updated_at SET DEFAULT everystep_now();
ALTER TABLE everystep_schedule ALTER COLUMN created_at SET DEFAULT everystep_now();
ALTER TABLE everystep_schedule ALTER COLUMN updated_at SET DEFAULT everystep_now();
ALTER TABLE everystep_schedule_run ALTER COLUMN fired_at SET DEFAULT everystep_now();
ALTER TABLE everystep_audit ALTER COLUMN at SET DEFAULT everystep_now();
