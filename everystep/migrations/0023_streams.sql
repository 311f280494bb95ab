-- Durable streams (everystep.write_stream / read_stream): what a run
-- writes for the outside to read while it goes on. One row per entry,
-- offsets dense per (run, key) from 0; the entry with a NULL value closes
-- its stream (a JSON null is the jsonb 'null', never SQL NULL). Written
-- through the group commit, fenced by the claim like a step row; moved to
-- the history with its run, deleted with it.
-- Additive: a new table, its history, its view, and the history's
-- partition functions taught the fifth table (partitions of weeks that
-- exist get theirs now).
CREATE TABLE everystep_stream (
    run_id      uuid NOT NULL REFERENCES everystep_workflow (id) ON DELETE CASCADE,
    key         varchar(300) NOT NULL,
    "offset"    bigint NOT NULL,
    value       jsonb,                                  -- NULL: the entry that closes the stream
    step_id     varchar(300),                           -- the body call's id, or the step's that wrote it
    attempt     integer,                                -- NULL from the body; else the step's try (1, 2, ...)
    claim_token bigint,                                 -- the execution that wrote it
    created_at  timestamptz NOT NULL DEFAULT everystep_now(),
    PRIMARY KEY (run_id, key, "offset")
);

CREATE TABLE everystep_stream_history (LIKE everystep_stream) PARTITION BY RANGE (run_id);
ALTER TABLE everystep_stream_history ADD PRIMARY KEY (run_id, key, "offset");

CREATE VIEW everystep_stream_all AS
SELECT * FROM everystep_stream
UNION ALL
SELECT * FROM everystep_stream_history;

CREATE OR REPLACE FUNCTION everystep_history_partition(week date) RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    parent text;
    part text;
    made integer := 0;
BEGIN
    FOREACH parent IN ARRAY ARRAY['everystep_workflow_history', 'everystep_step_history',
                                  'everystep_message_history', 'everystep_event_history',
                                  'everystep_stream_history'] LOOP
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

CREATE OR REPLACE FUNCTION everystep_history_drop(week date) RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    parent text;
    part text;
    dropped integer := 0;
BEGIN
    FOREACH parent IN ARRAY ARRAY['everystep_workflow_history', 'everystep_step_history',
                                  'everystep_message_history', 'everystep_event_history',
                                  'everystep_stream_history'] LOOP
        part := parent || '_' || to_char(week, 'YYYYMMDD');
        IF to_regclass(format('%I.%I', current_schema(), part)) IS NOT NULL THEN
            EXECUTE format('DROP TABLE %I.%I', current_schema(), part);
            dropped := dropped + 1;
        END IF;
    END LOOP;
    RETURN dropped;
END $$;

SELECT everystep_history_partition(to_date(right(c.relname, 8), 'YYYYMMDD'))
FROM pg_inherits i
JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = 'everystep_workflow_history'::regclass;
