-- Sealed workflows (everystep.dags) and follow-ups: runs that start when
-- the runs they depend on have completed.
--
-- A run waiting for its dependencies is `waiting` with due_at 9999-12-31
-- (the end of time that drivers can read, as 'infinity' is not; or its
-- deadline, when it has one) and waiting_on 'dependencies': no claim
-- lane ever reaches it. `awaiting` counts what it still waits for (its
-- dependencies not completed yet, plus one for the seal of a graph not yet
-- sealed); the end of a dependency (everystep_settle, called by the
-- statements that end runs, in their transaction) takes one off, and the one
-- that takes the last makes it due at once: its release. A run with
-- `dependents` is one that others depend on: only its end calls
-- everystep_settle, so the end of a plain run pays nothing.
-- Additive: two columns (NULL and false for every existing run) and three
-- new tables.
ALTER TABLE everystep_workflow ADD COLUMN awaiting integer;
ALTER TABLE everystep_workflow ADD COLUMN dependents boolean NOT NULL DEFAULT false;
ALTER TABLE everystep_workflow_history ADD COLUMN awaiting integer;
ALTER TABLE everystep_workflow_history ADD COLUMN dependents boolean NOT NULL DEFAULT false;
ALTER TABLE everystep_workflow_history ALTER COLUMN dependents DROP DEFAULT;  -- as LIKE makes it

CREATE OR REPLACE VIEW everystep_workflow_all AS
SELECT * FROM everystep_workflow
UNION ALL
SELECT * FROM everystep_workflow_history;

-- The graphs: a durable key, where its members may run, who made and sealed it.
CREATE TABLE everystep_dag (
    key           varchar(255) PRIMARY KEY,
    workflows     text[],                               -- the patterns its members may use; NULL: any
    created_at    timestamptz NOT NULL DEFAULT everystep_now(),
    created_by    varchar(255),
    sealed_at     timestamptz,                          -- NULL: open (members may be added)
    sealed_by     varchar(255),
    cancelled_at  timestamptz,
    cancel_reason text,
    members       integer NOT NULL DEFAULT 0            -- how many were added (the next one's position)
);
CREATE INDEX everystep_dag_created_at ON everystep_dag (created_at);

-- The members of a graph, in the order they were added; run_id is the
-- member's current run (a re-run of the member replaces it).
CREATE TABLE everystep_dag_member (
    dag        varchar(255) NOT NULL REFERENCES everystep_dag (key) ON DELETE CASCADE,
    key        varchar(255) NOT NULL,
    position   integer NOT NULL,
    run_id     uuid NOT NULL,                           -- no foreign key: the run may be in the history
    depends_on varchar(255)[] NOT NULL DEFAULT '{}',    -- the keys of the members it depends on
    PRIMARY KEY (dag, key)
);
CREATE UNIQUE INDEX everystep_dag_member_run ON everystep_dag_member (run_id);

-- The edges between runs: run_id starts once depends_on has completed.
CREATE TABLE everystep_dependency (
    depends_on uuid NOT NULL,
    run_id     uuid NOT NULL,
    PRIMARY KEY (depends_on, run_id)
);
CREATE INDEX everystep_dependency_run ON everystep_dependency (run_id);

-- The end of runs with dependents (ids, with the statuses they ended with):
-- each dependent of a completed one waits for one dependency fewer, and is
-- due at once when it waits for none; the dependents of a failed, stopped or
-- cancelled one are cancelled, and theirs, transitively, each with the reason
-- 'dependency <key> <status>' (<key>: the member key of its dependency, else
-- that run's id). A blocked one holds its dependents. The dependents' rows
-- are locked in id order first: two ends releasing one fan-in serialize on
-- its row, and the second sees what the first left (the release happens
-- once). Returns how many runs it released.
CREATE FUNCTION everystep_settle(ids uuid[], statuses text[]) RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    released integer := 0;
BEGIN
    IF ids IS NULL OR cardinality(ids) = 0 THEN
        RETURN 0;
    END IF;
    -- = ANY(ARRAY(...)), and `(status = 'waiting') IS TRUE` below: a probe
    -- of the primary key per dependent, never a scan of the status index,
    -- whatever the plan cached for the function expects.
    PERFORM 1 FROM everystep_workflow w
    WHERE w.id = ANY(ARRAY(SELECT d.run_id FROM everystep_dependency d WHERE d.depends_on = ANY(ids)))
    ORDER BY w.id
    FOR UPDATE;
    WITH met AS (
        SELECT d.run_id, count(*)::integer AS n
        FROM everystep_dependency d
        WHERE d.depends_on = ANY(ARRAY(SELECT e.id FROM unnest(ids, statuses) AS e(id, status)
                                       WHERE e.status = 'completed'))
        GROUP BY d.run_id
    ), freed AS (
        UPDATE everystep_workflow w
        SET awaiting = w.awaiting - met.n,
            due_at = CASE WHEN w.awaiting - met.n <= 0 THEN everystep_now() ELSE w.due_at END,
            waiting_on = CASE WHEN w.awaiting - met.n <= 0 THEN NULL ELSE w.waiting_on END
        FROM met
        WHERE w.id = ANY(ARRAY(SELECT run_id FROM met)) AND w.id = met.run_id
          AND (w.status = 'waiting') IS TRUE AND w.awaiting > 0
        RETURNING w.awaiting
    )
    SELECT count(*) FILTER (WHERE awaiting <= 0) INTO released FROM freed;
    IF EXISTS (SELECT FROM unnest(statuses) AS s WHERE s IN ('failed', 'stopped', 'cancelled')) THEN
        WITH RECURSIVE down(id, reason) AS (
            SELECT d.run_id, 'dependency ' || coalesce(m.key, e.id::text) || ' ' || e.status
            FROM unnest(ids, statuses) AS e(id, status)
            JOIN everystep_dependency d ON d.depends_on = e.id
            LEFT JOIN everystep_dag_member m ON m.run_id = e.id
            WHERE e.status IN ('failed', 'stopped', 'cancelled')
          UNION
            SELECT d.run_id, 'dependency ' || coalesce(m.key, down.id::text) || ' cancelled'
            FROM down
            JOIN everystep_dependency d ON d.depends_on = down.id
            LEFT JOIN everystep_dag_member m ON m.run_id = down.id
        ), hit AS (
            SELECT DISTINCT ON (id) id, reason FROM down ORDER BY id, reason
        ), locked AS (
            SELECT w.id FROM everystep_workflow w
            WHERE w.id = ANY(ARRAY(SELECT id FROM hit))
            ORDER BY w.id
            FOR UPDATE OF w
        )
        UPDATE everystep_workflow w
        SET status = 'cancelled', completed_at = everystep_now(), cancel_requested_at = everystep_now(),
            cancel_reason = hit.reason, waiting_on = NULL
        FROM hit
        WHERE w.id = ANY(ARRAY(SELECT id FROM locked)) AND w.id = hit.id
          AND (w.status = 'waiting') IS TRUE AND w.awaiting > 0;
    END IF;
    IF released > 0 THEN
        PERFORM pg_notify('everystep:' || current_schema(), '');
    END IF;
    RETURN released;
END $$;
