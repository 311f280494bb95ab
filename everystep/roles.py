"""Three least-privilege PostgreSQL roles for everystep, as SQL
(`everystep roles` prints it, `--apply` runs it):

    producer  may only schedule: insert runs (as `scheduled`) and read back
              what an idempotency key needs; no update, no delete
    worker    runs workflows: claims, step rows, ends, requeues, crash counts,
              the recurring schedules' state; cannot touch a run that is
              blocked, finished or not its to hold, so cannot resolve a step
    operator  the CLI's and the UI's actions: everything on the rows, the
              audit trail, and pg_read_all_stats for the UI's workers page

They are group roles (NOLOGIN): grant them to the login roles your programs
use. Migrations stay with the tables' owner. Row-level security is turned on
for the run and step tables; the owner is exempt (it bypasses it), and every
other role needs one of these three (or its own policy) to see any row.
"""

from __future__ import annotations

ROLES = ("producer", "worker", "operator")


def role_names(prefix: str) -> list[str]:
    return [f"{prefix}{role}" for role in ROLES]


def sql_text(prefix: str = "everystep_", schema: str | None = None) -> str:
    """The SQL, idempotent (safe to apply again). `prefix` and `schema` must
    be plain identifiers (the CLI checks them)."""
    s = schema or "public"
    producer, worker, operator = role_names(prefix)
    workflow, step = f"{s}.everystep_workflow", f"{s}.everystep_step"
    create = "\n".join(
        f"  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{name}') THEN CREATE ROLE {name} NOLOGIN; END IF;"
        for name in (producer, worker, operator)
    )

    def policy(name: str, table: str, command: str, role: str, using: str | None, check: str | None) -> str:
        clauses = (f" USING ({using})" if using else "") + (f" WITH CHECK ({check})" if check else "")
        return (f"DROP POLICY IF EXISTS {name} ON {table};\n"
                f"CREATE POLICY {name} ON {table} FOR {command} TO {role}{clauses};")

    return f"""-- everystep least-privilege roles (schema {s}). Grant them to login roles:
--   GRANT {worker} TO my_worker_login;
BEGIN;
DO $$ BEGIN
{create}
END $$;
GRANT USAGE ON SCHEMA {s} TO {producer}, {worker}, {operator};

-- producer: schedule() only. It inserts runs (only as scheduled, or waiting
-- for a delayed start, see the policy below) and reads back the columns an
-- idempotency key needs. Cancelling (everystep.cancel) is the operator's.
GRANT INSERT (id, name, args, idempotency_key, status, due_at, trace_context, limited, deadline_at, priority,
              concurrency_key, keyed, attributes) ON {workflow} TO {producer};
GRANT SELECT (id, name, idempotency_key, keyed) ON {workflow} TO {producer};  -- keyed: whose key gets a row
GRANT INSERT ON {s}.everystep_audit TO {producer};
GRANT SELECT ON {s}.everystep_waiting TO {producer};  -- scheduling notifies only when a worker waits
GRANT SELECT ON {s}.everystep_limit TO {producer};  -- a run's lane: its workflow's limit (0011_lanes.sql)
-- A run's default priority, its lane by key, and its key's row (0014_priorities.sql).
GRANT SELECT ON {s}.everystep_priority, {s}.everystep_key_limit TO {producer};
GRANT SELECT, INSERT ON {s}.everystep_key TO {producer};
GRANT UPDATE (ready) ON {s}.everystep_key TO {producer};  -- a key idle since the last sweep is ready again
-- send(): a message, counted on its run (which a wait parked on it wakes
-- from); get_event(): what a run published.
GRANT INSERT ON {s}.everystep_message TO {producer};
-- ON CONFLICT on the idempotency key reads the arbiter's columns.
GRANT SELECT (run_id, idempotency_key) ON {s}.everystep_message TO {producer};
GRANT SELECT (status, wakes, waiting_on, due_at) ON {workflow} TO {producer};
GRANT UPDATE (wakes, due_at) ON {workflow} TO {producer};
GRANT SELECT ON {s}.everystep_event TO {producer};
-- The history (0017_history.sql): idempotency keys, send() and get_event()
-- on runs that have moved there.
GRANT SELECT (id, name, idempotency_key, status) ON {s}.everystep_workflow_all TO {producer};
GRANT SELECT (name, idempotency_key) ON {s}.everystep_workflow_history TO {producer};
GRANT SELECT ON {s}.everystep_event_all TO {producer};
-- read_stream() (0023): a run's streams, hot or in the history.
GRANT SELECT ON {s}.everystep_stream_all, {s}.everystep_stream, {s}.everystep_stream_history TO {producer};

-- worker: claim, record steps, end, requeue, count crashes, fire schedules.
GRANT SELECT, INSERT, UPDATE ON {workflow}, {step}, {s}.everystep_crash TO {worker};
GRANT SELECT, UPDATE ON {s}.everystep_schedule TO {worker};
GRANT USAGE ON SEQUENCE {s}.everystep_claim_token TO {worker};  -- every claim takes a new execution token
-- flow: messages consumed, events published, concurrency limits and slots,
-- the workflows each worker routes.
GRANT SELECT, UPDATE ON {s}.everystep_message TO {worker};
GRANT SELECT, INSERT, UPDATE ON {s}.everystep_event, {s}.everystep_slot, {s}.everystep_route TO {worker};
GRANT SELECT, INSERT, UPDATE, DELETE ON {s}.everystep_limit TO {worker};
GRANT DELETE ON {s}.everystep_slot TO {worker};
-- priorities, per-key limits and their keys, rate limits (0014_priorities.sql).
GRANT SELECT, INSERT, UPDATE, DELETE ON {s}.everystep_priority, {s}.everystep_key_limit, {s}.everystep_key,
    {s}.everystep_rate_limit TO {worker};
GRANT SELECT, INSERT, DELETE ON {s}.everystep_waiting TO {worker};  -- registers while a slot is free
-- the console (0015): the executions a requeue or a reclaim ends, and the
-- charts' per-minute figures the maintenance child keeps.
GRANT INSERT ON {s}.everystep_execution TO {worker};
GRANT SELECT, INSERT, UPDATE, DELETE ON {s}.everystep_minute TO {worker};
-- streams (0023): the entries the runs write.
GRANT SELECT, INSERT ON {s}.everystep_stream TO {worker};
-- The tracebacks of failed step attempts (0021): written (or written again) by
-- the execution that holds the run.
GRANT SELECT, INSERT, UPDATE ON {s}.everystep_step_traceback TO {worker};
-- The history: a wait for a child that has moved there, schedules' last runs.
GRANT SELECT ON {s}.everystep_workflow_all, {s}.everystep_step_all, {s}.everystep_message_all,
    {s}.everystep_event_all, {s}.everystep_workflow_history TO {worker};
-- The migrations applied: a worker refuses a schema a newer everystep migrated.
GRANT SELECT ON {s}.everystep_migration TO {worker};

-- operator: the CLI's and the UI's actions, and reading everything.
GRANT SELECT, INSERT, UPDATE, DELETE ON {workflow}, {step}, {s}.everystep_crash, {s}.everystep_schedule
    TO {operator};
GRANT SELECT, INSERT ON {s}.everystep_audit TO {operator};
GRANT SELECT, INSERT, UPDATE, DELETE ON {s}.everystep_message, {s}.everystep_event, {s}.everystep_limit,
    {s}.everystep_slot, {s}.everystep_route, {s}.everystep_priority, {s}.everystep_key_limit, {s}.everystep_key,
    {s}.everystep_rate_limit TO {operator};
GRANT SELECT ON {s}.everystep_migration TO {operator};
GRANT SELECT, DELETE ON {s}.everystep_waiting TO {operator};
GRANT SELECT, INSERT ON {s}.everystep_execution TO {operator};
GRANT SELECT ON {s}.everystep_minute, {s}.everystep_schedule_run TO {operator};
GRANT SELECT ON {s}.everystep_step_traceback TO {operator};  -- the run page's tracebacks
GRANT pg_read_all_stats TO {operator};
-- Graphs and follow-ups (0031_dags.sql): a worker's end of a run with
-- dependents reads the member keys and meets its edges (everystep_settle); writing a
-- graph or a follow-up changes runs not yet ended (their dependents flag,
-- the seal's release), which is the operator's, not the producer's.
GRANT SELECT ON {s}.everystep_dag, {s}.everystep_dag_member, {s}.everystep_dependency TO {worker};
-- The end of a dependency deletes the edges it meets (0034), and locks one
-- edge of each dependent FOR SHARE, which takes an UPDATE privilege.
GRANT UPDATE (met), DELETE ON {s}.everystep_dependency TO {worker};
GRANT SELECT, INSERT, UPDATE, DELETE ON {s}.everystep_dag, {s}.everystep_dag_member, {s}.everystep_dependency
    TO {operator};
-- Where runs wait (0032_ready.sql): every change of a run's status reaches
-- the queue tables through the trigger, in the role that made it: a producer
-- admits what it schedules (and a message or a cancel moves a run), a worker
-- claims, ends and requeues, an operator cancels and requeues.
GRANT SELECT, INSERT, UPDATE, DELETE ON {s}.everystep_ready, {s}.everystep_timer, {s}.everystep_blocked,
    {s}.everystep_claimed TO {producer}, {worker}, {operator};
GRANT SELECT ON {s}.everystep_pending TO {worker}, {operator};
GRANT SELECT, UPDATE ON {s}.everystep_slot TO {producer};
GRANT UPDATE (held, claimed_at) ON {s}.everystep_key TO {producer};
-- Every role may read which environment the database is (0016_environment.sql):
-- the CLI checks it before it acts; `migrate --environment` (the owner) writes it.
GRANT SELECT ON {s}.everystep_environment TO {producer}, {worker}, {operator};
-- The history: reading it, and `everystep prune` (dropping its partitions
-- and moving runs there takes the tables' owner, as the maintenance child
-- runs as).
GRANT SELECT ON {s}.everystep_workflow_all, {s}.everystep_step_all, {s}.everystep_message_all,
    {s}.everystep_event_all TO {operator};
GRANT SELECT, INSERT, DELETE ON {s}.everystep_workflow_history, {s}.everystep_step_history,
    {s}.everystep_message_history, {s}.everystep_event_history, {s}.everystep_schedule_run TO {operator};
GRANT SELECT, INSERT, DELETE ON {s}.everystep_stream, {s}.everystep_stream_history TO {operator};
GRANT SELECT ON {s}.everystep_stream_all TO {operator};

-- Rows: a worker changes only runs that are scheduled, waiting or running
-- (never a blocked or finished one: resolving is the operator's), and step
-- rows only of a running run; a producer inserts only scheduled (or waiting) runs.
ALTER TABLE {workflow} ENABLE ROW LEVEL SECURITY;
ALTER TABLE {step} ENABLE ROW LEVEL SECURITY;
{policy(f"{producer}_insert", workflow, "INSERT", producer, None, "status IN ('scheduled', 'waiting')")}
{policy(f"{producer}_select", workflow, "SELECT", producer, "true", None)}
{policy(f"{worker}_select", workflow, "SELECT", worker, "true", None)}
{policy(f"{worker}_insert", workflow, "INSERT", worker, None, "status = 'scheduled'")}
{policy(f"{worker}_update", workflow, "UPDATE", worker, "status IN ('scheduled', 'running', 'waiting')", "true")}
{policy(f"{producer}_update", workflow, "UPDATE", producer,
        "status NOT IN ('completed', 'failed', 'stopped', 'cancelled')", "true")}
{policy(f"{worker}_step_select", step, "SELECT", worker, "true", None)}
{policy(f"{worker}_step_insert", step, "INSERT", worker, None, "true")}
{policy(f"{worker}_step_update", step, "UPDATE", worker,
        f"EXISTS (SELECT 1 FROM {workflow} w WHERE w.id = workflow_id AND w.status = 'running')", "true")}
{policy(f"{operator}_all", workflow, "ALL", operator, "true", "true")}
{policy(f"{operator}_step_all", step, "ALL", operator, "true", "true")}
COMMIT;
"""
