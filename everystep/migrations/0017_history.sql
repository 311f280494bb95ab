-- History that leaves the hot path: finished runs, with their steps,
-- messages and events, move from the hot tables (what the claim and the
-- fenced writes touch) to four history tables, range-partitioned by the
-- run's id in weeks (a UUIDv7 is time-ordered: its first 48 bits are Unix
-- milliseconds). The maintenance child moves them in batches
-- (everystep/maintenance.py, history.sql), creates the coming weeks'
-- partitions ahead of time, and applies the retention by end status by
-- dropping whole partitions whose runs are all expired (batches otherwise).
--
-- In place and quick: this migration creates empty tables, views and
-- functions and drops three foreign keys; the runs that finished before it
-- move afterwards, in the maintenance child's batches.
--
-- The history tables have the columns of their hot tables, in the same
-- order (LIKE): the move is `INSERT INTO <history> SELECT * FROM (DELETE
-- FROM <hot> ... RETURNING *)`. A migration that adds a column to a hot
-- table adds the same column to its history table (and recreates its _all
-- view if the column is to be read across both).

-- A run that moves to the history must not take its children's link to it,
-- its schedule's last run, or its schedule's record of the firing with it
-- (ON DELETE SET NULL / CASCADE would). Retention deletes the records of
-- the runs it removes; a dangling last_run_id reads as "no run" (LEFT JOIN).
ALTER TABLE everystep_workflow DROP CONSTRAINT everystep_workflow_parent_id_fkey;
ALTER TABLE everystep_schedule DROP CONSTRAINT everystep_schedule_last_run_id_fkey;
ALTER TABLE everystep_schedule_run DROP CONSTRAINT everystep_schedule_run_run_id_fkey;

CREATE TABLE everystep_workflow_history (LIKE everystep_workflow) PARTITION BY RANGE (id);
ALTER TABLE everystep_workflow_history ADD PRIMARY KEY (id);
CREATE INDEX everystep_workflow_history_status ON everystep_workflow_history (status, created_at);
CREATE INDEX everystep_workflow_history_created_at ON everystep_workflow_history (created_at);
CREATE INDEX everystep_workflow_history_name_created ON everystep_workflow_history (name, created_at);
CREATE INDEX everystep_workflow_history_key ON everystep_workflow_history (idempotency_key, name)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX everystep_workflow_history_parent ON everystep_workflow_history (parent_id)
    WHERE parent_id IS NOT NULL;
CREATE INDEX everystep_workflow_history_ended ON everystep_workflow_history (status, completed_at);
-- The re-runs of a moved run (as everystep_workflow_rerun_of, 0015_console.sql).
CREATE INDEX everystep_workflow_history_rerun_of ON everystep_workflow_history (rerun_of)
    WHERE rerun_of IS NOT NULL;

CREATE TABLE everystep_step_history (LIKE everystep_step) PARTITION BY RANGE (workflow_id);
ALTER TABLE everystep_step_history ADD PRIMARY KEY (workflow_id, step_id);

CREATE TABLE everystep_message_history (LIKE everystep_message) PARTITION BY RANGE (run_id);
CREATE INDEX everystep_message_history_run ON everystep_message_history (run_id, id);

CREATE TABLE everystep_event_history (LIKE everystep_event) PARTITION BY RANGE (run_id);
ALTER TABLE everystep_event_history ADD PRIMARY KEY (run_id, key);

-- What reads runs reads both parts; within one statement a run is in
-- exactly one (one snapshot sees the move's delete and insert together).
CREATE VIEW everystep_workflow_all AS
SELECT * FROM everystep_workflow
UNION ALL
SELECT * FROM everystep_workflow_history;

CREATE VIEW everystep_step_all AS
SELECT * FROM everystep_step
UNION ALL
SELECT * FROM everystep_step_history;

CREATE VIEW everystep_message_all AS
SELECT * FROM everystep_message
UNION ALL
SELECT * FROM everystep_message_history;

CREATE VIEW everystep_event_all AS
SELECT * FROM everystep_event
UNION ALL
SELECT * FROM everystep_event_history;

-- The smallest UUIDv7 of the millisecond `at` is in: the bound of a
-- partition of the runs created from `at` on.
CREATE FUNCTION everystep_uuid_at(at timestamptz) RETURNS uuid LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT (lpad(to_hex(floor(extract(epoch FROM at) * 1000)::bigint), 12, '0') || '00000000000000000000')::uuid $$;

-- The week (from Monday 00:00 UTC) a UUIDv7 was made in: its partition.
CREATE FUNCTION everystep_history_week(id uuid) RETURNS date LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT date_trunc('week', to_timestamp(('x' || substr(replace(id::text, '-', ''), 1, 12))::bit(48)::bigint
                                                / 1000.0) AT TIME ZONE 'UTC')::date $$;

-- The partitions of `week` (a Monday) of the four history tables, each
-- named <table>_<yyyymmdd>, created where missing: made on their own, then
-- attached (SHARE UPDATE EXCLUSIVE on the parent, which readers and the
-- move do not wait for). Returns how many it created.
CREATE FUNCTION everystep_history_partition(week date) RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    parent text;
    part text;
    made integer := 0;
BEGIN
    FOREACH parent IN ARRAY ARRAY['everystep_workflow_history', 'everystep_step_history',
                                  'everystep_message_history', 'everystep_event_history'] LOOP
        part := parent || '_' || to_char(week, 'YYYYMMDD');
        IF to_regclass(format('%I.%I', current_schema(), part)) IS NULL THEN
            EXECUTE format('CREATE TABLE %I.%I (LIKE %I.%I)', current_schema(), part, current_schema(), parent);
            EXECUTE format('ALTER TABLE %I.%I ATTACH PARTITION %I.%I FOR VALUES FROM (%L) TO (%L)',
                           current_schema(), parent, current_schema(), part,
                           everystep_uuid_at(week::timestamp AT TIME ZONE 'UTC'),
                           everystep_uuid_at((week + 7)::timestamp AT TIME ZONE 'UTC'));
            made := made + 1;
        END IF;
    END LOOP;
    RETURN made;
END $$;

-- The partitions of `week` of the four history tables, dropped (each an
-- ACCESS EXCLUSIVE lock on its parent for an instant: the caller bounds
-- the wait with lock_timeout). Returns how many it dropped.
CREATE FUNCTION everystep_history_drop(week date) RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    parent text;
    part text;
    dropped integer := 0;
BEGIN
    FOREACH parent IN ARRAY ARRAY['everystep_workflow_history', 'everystep_step_history',
                                  'everystep_message_history', 'everystep_event_history'] LOOP
        part := parent || '_' || to_char(week, 'YYYYMMDD');
        IF to_regclass(format('%I.%I', current_schema(), part)) IS NOT NULL THEN
            EXECUTE format('DROP TABLE %I.%I', current_schema(), part);
            dropped := dropped + 1;
        END IF;
    END LOOP;
    RETURN dropped;
END $$;

-- Whether a run of `name` with idempotency key `key` has moved to the
-- history: what keeps a key unique across the move. A keyed insert calls
-- it before its ON CONFLICT on the hot table; it first takes the keys lock
-- shared, which a move of keyed runs holds exclusive to its commit: so
-- either the move waits for the insert's transaction (and the insert's
-- ON CONFLICT met the run in the hot table), or the insert waits for the
-- move and then sees the run in the history (a VOLATILE function's query
-- sees what committed after its statement started, in READ COMMITTED).
CREATE FUNCTION everystep_key_archived(name varchar, key varchar) RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtextextended('everystep:keys:' || current_schema(), 0));
    RETURN EXISTS (SELECT FROM everystep_workflow_history h
                   WHERE h.idempotency_key = everystep_key_archived.key AND h.name = everystep_key_archived.name);
END $$;
