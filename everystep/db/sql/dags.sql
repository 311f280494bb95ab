-- Graphs of runs (everystep.dags) and follow-ups: runs that wait for other
-- runs to complete (0031_dags.sql). Read by everystep/db/dags.py. The
-- release of a waiting run is everystep_settle's, called by the statements
-- that end runs (queue.sql, runs.sql) in their transaction.


-- name: create_dag
-- A graph under its key, unless one has it already (then nothing: the
-- caller reads that one; a concurrent insert of the same key waits for the
-- first to commit).
INSERT INTO everystep_dag (key, workflows, created_by)
VALUES (%(key)s, %(workflows)s, %(actor)s)
ON CONFLICT (key) DO NOTHING;

-- name: dag
SELECT key, workflows, created_at, created_by, sealed_at, sealed_by, cancelled_at, cancel_reason, members
FROM everystep_dag
WHERE key = %(key)s;

-- name: take_member_position
-- The next member's position in an open graph, taking the graph's row lock
-- to the commit (adds and the seal of one graph queue on it); no row: the
-- graph is sealed or cancelled, or not there.
UPDATE everystep_dag
SET members = members + 1
WHERE key = %(key)s AND sealed_at IS NULL AND cancelled_at IS NULL
RETURNING members;

-- name: named_members
-- The members of a graph named by key or by run id (a dependency given by
-- handle or key), and whether `new_key` is taken already.
SELECT key, run_id
FROM everystep_dag_member
WHERE dag = %(dag)s AND (key = ANY(%(keys)s::varchar[]) OR run_id = ANY(%(runs)s::uuid[]) OR key = %(new_key)s);

-- name: add_member
INSERT INTO everystep_dag_member (dag, key, position, run_id, depends_on)
VALUES (%(dag)s, %(key)s, %(position)s, %(run)s, %(depends_on)s::varchar[]);

-- name: runs_exist
-- Which of these runs exist (hot or in the history).
SELECT id
FROM everystep_workflow_all
WHERE id = ANY(%(runs)s::uuid[]);

-- name: hold_for_dependencies
-- A run just inserted in this transaction waits for these runs (and for
-- the seal of its graph when `seal` is 1): each is marked as having
-- dependents (a row lock to the commit: an end in flight writes first, or
-- after this commits and then sees the edge), the edges to those not
-- completed are written, and the run waits for them (none: it stays as
-- it was). A dependency that ended failed, stopped or cancelled cancels it
-- at once. Returns what it waits for (the seal and the edges not met) and
-- its cancel reason, if cancelled.
WITH marked AS (
    UPDATE everystep_workflow d
    SET dependents = true
    WHERE d.id = ANY(%(depends_on)s::uuid[])
    RETURNING d.id, d.status
), deps AS (
    -- An ended one (hot or in the history) has its status for good: this
    -- statement's snapshot tells it.
    SELECT id, status FROM marked
    UNION ALL
    SELECT a.id, a.status FROM everystep_workflow_all a
    WHERE a.id = ANY(%(depends_on)s::uuid[]) AND a.id NOT IN (SELECT id FROM marked)
), edges AS (
    INSERT INTO everystep_dependency (depends_on, run_id)
    SELECT DISTINCT id, %(run)s::uuid FROM deps
    WHERE status <> 'completed'
    ON CONFLICT DO NOTHING
), broken AS (
    SELECT 'dependency ' || coalesce(m.key, deps.id::text) || ' ' || deps.status AS reason
    FROM deps LEFT JOIN everystep_dag_member m ON m.run_id = deps.id
    WHERE deps.status IN ('failed', 'stopped', 'cancelled')
    ORDER BY deps.id
    LIMIT 1
), waits AS (
    SELECT %(seal)s::integer + (SELECT count(DISTINCT id) FROM deps WHERE status <> 'completed') AS n
)
UPDATE everystep_workflow w
SET status = CASE WHEN EXISTS (SELECT FROM broken) THEN 'cancelled'
                  WHEN waits.n = 0 THEN w.status
                  ELSE 'waiting' END,
    completed_at = CASE WHEN EXISTS (SELECT FROM broken) THEN everystep_now() END,
    cancel_requested_at = CASE WHEN EXISTS (SELECT FROM broken) THEN everystep_now() END,
    cancel_reason = (SELECT reason FROM broken),
    due_at = CASE WHEN EXISTS (SELECT FROM broken) OR waits.n = 0 THEN w.due_at
                  ELSE coalesce(w.deadline_at, '9999-12-31 00:00:00+00') END,
    waiting_on = CASE WHEN EXISTS (SELECT FROM broken) OR waits.n = 0 THEN NULL ELSE 'dependencies' END,
    awaiting = %(seal)s::integer
FROM waits
WHERE w.id = %(run)s
RETURNING waits.n, w.cancel_reason;

-- name: lock_dag
-- The graph's row, locked to the commit (the seal queues behind the adds).
SELECT sealed_at, cancelled_at, members
FROM everystep_dag
WHERE key = %(key)s
FOR UPDATE;

-- name: seal_dag
-- Seal an open graph (locked by lock_dag in this transaction, so this
-- statement's snapshot has every member): no member waits for the seal any
-- more, and those that wait for no edge either (no member of the graph can
-- have run yet) are due at once. Returns how many it released.
WITH dag AS (
    UPDATE everystep_dag
    SET sealed_at = everystep_now(), sealed_by = %(actor)s
    WHERE key = %(key)s AND sealed_at IS NULL
    RETURNING key
), sealed AS (
    UPDATE everystep_workflow w
    SET awaiting = 0,
        due_at = CASE WHEN o.open THEN w.due_at ELSE everystep_now() END,
        waiting_on = CASE WHEN o.open THEN w.waiting_on END
    FROM everystep_dag_member m
    JOIN dag ON m.dag = dag.key
    CROSS JOIN LATERAL (SELECT EXISTS (SELECT FROM everystep_dependency d
                                       WHERE d.run_id = m.run_id AND NOT d.met) AS open) o
    WHERE w.id = m.run_id AND w.status = 'waiting' AND w.awaiting > 0
    RETURNING o.open
)
SELECT count(*) FILTER (WHERE NOT open),
       CASE WHEN count(*) FILTER (WHERE NOT open) > 0
            THEN pg_notify('everystep:' || current_schema(), '')::text END
FROM sealed;

-- name: dag_members
-- A graph's members in the order they were added, each with its run's
-- status (hot or in the history) and cancel reason.
SELECT m.key, m.run_id, r.status, m.depends_on, r.cancel_reason
FROM everystep_dag_member m
LEFT JOIN LATERAL (SELECT w.status, w.cancel_reason FROM everystep_workflow_all w WHERE w.id = m.run_id) r ON true
WHERE m.dag = %(key)s
ORDER BY m.position;

-- name: list_dags
-- Graphs, newest first, each with its status: cancelled (everystep.dags.
-- cancel, or every member ended and one was cancelled, none failed), open
-- (not sealed), failed (a member failed or stopped), completed (every member
-- completed), else running; `status` filters (NULL: all).
SELECT key, status, members, completed, created_at, sealed_at
FROM (
    SELECT d.key, d.created_at, d.sealed_at, d.members, c.completed,
           CASE WHEN d.cancelled_at IS NOT NULL THEN 'cancelled'
                WHEN d.sealed_at IS NULL THEN 'open'
                WHEN c.failed > 0 THEN 'failed'
                WHEN c.completed = d.members THEN 'completed'
                WHEN c.ended = d.members THEN 'cancelled'
                ELSE 'running' END AS status
    FROM everystep_dag d
    CROSS JOIN LATERAL (
        SELECT count(*) FILTER (WHERE r.status = 'completed') AS completed,
               count(*) FILTER (WHERE r.status IN ('failed', 'stopped')) AS failed,
               count(*) FILTER (WHERE r.status IN ('completed', 'failed', 'stopped', 'cancelled')) AS ended
        FROM everystep_dag_member m
        LEFT JOIN LATERAL (SELECT w.status FROM everystep_workflow_all w WHERE w.id = m.run_id) r ON true
        WHERE m.dag = d.key
    ) c
) g
WHERE %(status)s::text IS NULL OR g.status = %(status)s::text
ORDER BY created_at DESC, key
LIMIT %(limit)s;

-- name: cancel_dag
-- Cancel a graph: every member not ended yet is cancelled (at once when it
-- does not run, by a request honoured at its next step when it runs).
-- Returns the members cancelled at once that others depend on (the caller
-- settles them), and the graph's key if there is one.
WITH dag AS (
    UPDATE everystep_dag
    SET cancelled_at = coalesce(cancelled_at, everystep_now()),
        cancel_reason = coalesce(cancel_reason, %(reason)s)
    WHERE key = %(key)s
    RETURNING key
), hit AS (
    UPDATE everystep_workflow w
    SET status = CASE WHEN w.status = 'running' THEN w.status ELSE 'cancelled' END,
        completed_at = CASE WHEN w.status = 'running' THEN w.completed_at ELSE everystep_now() END,
        cancel_requested_at = coalesce(w.cancel_requested_at, everystep_now()),
        cancel_reason = coalesce(%(reason)s, w.cancel_reason, 'graph cancelled'),
        waiting_on = CASE WHEN w.status = 'running' THEN w.waiting_on END
    FROM everystep_dag_member m
    JOIN dag ON m.dag = dag.key
    WHERE w.id = m.run_id
      AND (w.status IN ('scheduled', 'waiting', 'blocked') OR w.status = 'running' AND w.cancel_requested_at IS NULL)
    RETURNING w.id, w.status, w.dependents
)
SELECT (SELECT key FROM dag), id, status
FROM (SELECT NULL::uuid AS id, NULL::varchar AS status
      UNION ALL
      SELECT id, status FROM hit WHERE dependents AND status = 'cancelled') s;

-- name: settle_runs
-- The dependents of runs that ended (ids with their statuses) released or
-- cancelled: everystep_settle (0031_dags.sql). Returns how many it released.
SELECT everystep_settle(%(runs)s::uuid[], %(statuses)s::text[]);

-- name: member_run
-- A member's run and its status, locking the member's row to the commit.
SELECT m.run_id, r.status
FROM everystep_dag_member m
LEFT JOIN LATERAL (SELECT w.status FROM everystep_workflow_all w WHERE w.id = m.run_id) r ON true
WHERE m.dag = %(dag)s AND m.key = %(key)s
FOR UPDATE OF m;

-- name: replace_member_run
-- A member's re-run takes its place: its edges move to the new run, and
-- the members cancelled because of the old one (transitively, never
-- started: cancel_reason 'dependency ...') wait again for what they depend
-- on. Returns how many were revived.
WITH RECURSIVE member AS (
    UPDATE everystep_dag_member
    SET run_id = %(new)s
    WHERE dag = %(dag)s AND key = %(key)s
    RETURNING run_id
), edges_out AS (
    UPDATE everystep_dependency SET depends_on = %(new)s WHERE depends_on = %(old)s
    RETURNING run_id
), edges_in AS (
    UPDATE everystep_dependency SET run_id = %(new)s WHERE run_id = %(old)s
), marked AS (
    UPDATE everystep_workflow SET dependents = true
    WHERE id = %(new)s AND EXISTS (SELECT FROM everystep_dependency d WHERE d.depends_on = %(old)s)
), down(id) AS (
    SELECT d.run_id FROM everystep_dependency d
    JOIN everystep_workflow w ON w.id = d.run_id
    WHERE d.depends_on = %(old)s AND w.status = 'cancelled' AND w.cancel_reason LIKE 'dependency %%'
  UNION
    SELECT d.run_id FROM down
    JOIN everystep_dependency d ON d.depends_on = down.id
    JOIN everystep_workflow w ON w.id = d.run_id
    WHERE w.status = 'cancelled' AND w.cancel_reason LIKE 'dependency %%'
), revived AS (
    UPDATE everystep_workflow w
    SET status = 'waiting', completed_at = NULL, cancel_requested_at = NULL, cancel_reason = NULL,
        waiting_on = 'dependencies', due_at = coalesce(w.deadline_at, '9999-12-31 00:00:00+00'),
        awaiting = 0  -- its graph is sealed (and the edge from the re-run, at least, is not met)
    FROM (SELECT DISTINCT id FROM down) v
    WHERE w.id = v.id
    RETURNING w.id
)
SELECT (SELECT count(*) FROM member), (SELECT count(*) FROM revived);

-- name: upstream_result
-- The status and result of the member `key` of the graph of the member run
-- `run`, and whether `run` depends on it.
SELECT r.status, r.result, dep.key = ANY(me.depends_on)
FROM everystep_dag_member me
JOIN everystep_dag_member dep ON dep.dag = me.dag AND dep.key = %(key)s
LEFT JOIN LATERAL (SELECT w.status, w.result FROM everystep_workflow_all w WHERE w.id = dep.run_id) r ON true
WHERE me.run_id = %(run)s;

-- name: dag_of_run
-- The graph and member key of a run, if it is a member.
SELECT dag, key
FROM everystep_dag_member
WHERE run_id = %(run)s;
