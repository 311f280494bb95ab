-- What everystep.testing reads and writes: the engine's clock of the schema
-- (everystep_now() and everystep_set_clock, 0012_testing_clock.sql), the
-- next moment something is due, and runs by workflow. Read by
-- everystep/db/testing.py. Setting the clock takes the owner of
-- everystep_now(): a test's schema, never a deployment's roles.


-- name: set_clock
-- The clock reads `at` from now on, running on or standing still
-- (`frozen`; NULL: as it did). Returns `at`.
SELECT everystep_set_clock(%(at)s::timestamptz, %(frozen)s::boolean);

-- name: advance_clock
-- The clock moves `seconds` forward, running on or standing still as it
-- did. Returns the time it reads now.
SELECT everystep_set_clock(everystep_now() + make_interval(secs => %(seconds)s::float8));

-- name: clock_frozen
-- Whether the clock stands still: its body has no now() then.
SELECT p.prosrc NOT LIKE '%%now()%%'
FROM pg_proc p
WHERE p.oid = 'everystep_now()'::regprocedure;

-- name: reset_clock
-- Back to the server's clock.
SELECT everystep_set_clock(pg_catalog.now(), false);

-- name: next_due_moment
-- The earliest moment after now (the engine's) and up to `until` when
-- something is due: a waiting run's timer (0032_ready.sql), a live
-- recurring schedule's next fire time. NULL when nothing is due by then
-- (least() ignores the NULLs of what has none).
SELECT least(
    (SELECT min(due_at) FROM everystep_timer
     WHERE due_at > everystep_now() AND due_at <= %(until)s::timestamptz),
    (SELECT min(next_fire_at) FROM everystep_schedule
     WHERE retired_at IS NULL AND NOT paused AND next_fire_at > everystep_now()
       AND next_fire_at <= %(until)s::timestamptz));

-- name: runs_of_workflow
-- The runs of one workflow, oldest first, with what a test asserts on.
SELECT id, name, args, status, result, error, created_at, due_at, completed_at, parent_id, idempotency_key
FROM everystep_workflow_all
WHERE name = %(name)s
ORDER BY created_at, id;

-- name: run_statuses
SELECT id, status
FROM everystep_workflow_all
WHERE id = ANY(%(ids)s::uuid[]);
