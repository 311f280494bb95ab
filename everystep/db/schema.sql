-- everystep's schema as the migrations leave it: every table, column,
-- index, constraint, sequence and function, for reading.
--
-- The engine never applies this file: a database gets its schema from the
-- numbered migrations of everystep/migrations/ (`everystep migrate`, or the
-- supervisor at start), recorded in everystep_migration.
-- tests/test_schema.py migrates one fresh schema, loads this file into
-- another and compares their catalogs, so this file is current: a change to
-- the migrations comes with the same change here.
--
-- Table names are unqualified: a deployment may live in its own schema (its
-- URL's search_path). Columns are in the order the migrations added them,
-- as \d shows them; the migration that added a column is noted where it is
-- not the table's first.
--
-- The status columns hold the engine's own literals (everystep/schema.py
-- names them; the statements of everystep/db/sql/ write them) and have no
-- CHECK constraint: PostgreSQL parses and plans a CHECK expression again for
-- every statement that writes the table, about 10% of the database's CPU
-- for a claimed, executed and ended run.


-- ---------------------------------------------------------------- the clock

-- 0012: the engine's clock, the "now" of every statement of
-- everystep/db/sql/ and of every default below (but the migration
-- ledger's). In a deployment it is the server's now(), inlined by the
-- planner; tests move it with everystep_set_clock (everystep.testing).
CREATE FUNCTION everystep_now() RETURNS timestamptz LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT pg_catalog.now() $$;

-- 0012: set the clock to `at`, from which it runs on (or stands still, when
-- `frozen`; NULL: as it did), by writing everystep_now() again with the
-- offset (or the moment) in its body; wakes the workers. The owner's only.
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


-- ---------------------------------------------------------------- runs

-- One row per run of a workflow: what to run, where it is in its life, who
-- holds it, and how it ended.
CREATE TABLE everystep_workflow (
    id                  uuid PRIMARY KEY,               -- UUIDv7, time-ordered
    name                varchar(300) NOT NULL,          -- the workflow's module.qualname
    args                jsonb NOT NULL,
    idempotency_key     varchar(255),
    status              varchar(16) NOT NULL,           -- scheduled waiting running completed failed stopped
                                                        -- blocked cancelled
    claimed_by          varchar(255),                   -- the runner holding it (status running)
    result              jsonb,
    error               jsonb,
    created_at          timestamptz NOT NULL DEFAULT everystep_now(),
    completed_at        timestamptz,
    -- 0003: the execution token of the claim holding it, from
    -- everystep_claim_token; every write about a held run matches it
    claim_token         bigint,
    -- 0006: the trace context of the code that scheduled it, and how many
    -- executions were traced; NULL when scheduled with tracing off
    trace_context       jsonb,
    -- 0007: when it becomes claimable, by the engine's clock (its now, unless
    -- delayed, or parked by a sleep, a retry's back-off or a wait)
    due_at              timestamptz NOT NULL DEFAULT everystep_now(),
    -- 0007: a durable cancel request, honoured at the next step boundary
    cancel_requested_at timestamptz,
    cancel_reason       text,
    -- 0009: the slot of its workflow's concurrency limit it was claimed into
    slot                integer,
    -- 0009: what a parked wait waits for ('message:<topic>', 'child:<id>')
    waiting_on          varchar(300),
    -- 0009: +1 by every message sent to it and every child that ended: a
    -- wait parks only if the count is still the one it saw
    wakes               bigint NOT NULL DEFAULT 0,
    -- 0009: the run that started it (a child workflow); no foreign key since
    -- 0017: the parent may have moved to the history
    parent_id           uuid,
    -- 0011: its workflow had a concurrency limit when it became claimable:
    -- the lane it is claimed from
    limited             boolean NOT NULL DEFAULT false,
    -- 0013: when it must be finished by (engine's clock), else it is
    -- cancelled with the reason 'deadline'; NULL: no deadline
    deadline_at         timestamptz,
    -- 0014: -100..100, higher first among due runs
    priority            smallint NOT NULL DEFAULT 0
        CONSTRAINT everystep_workflow_priority CHECK (priority BETWEEN -100 AND 100),
    -- 0014: the key of a fair queue (a tenant), as scheduled
    concurrency_key     varchar(255),
    -- 0014: claimed through its key's row (its workflow has a per-key limit);
    -- limited too, so out of the unlimited lane
    keyed               boolean NOT NULL DEFAULT false,
    -- 0015: the run this one re-runs from a step (everystep.rerun); no
    -- foreign key: a re-run outlives its pruned original
    rerun_of            uuid,
    -- 0022: its searchable attributes, a flat object of scalars
    -- (schedule(attributes=), everystep.set_attributes); NULL: none
    attributes          jsonb,
    -- 0031: a run that waits or waited for dependencies (NULL: never):
    -- 1 while its graph is not sealed, else 0 (0033; what else it waits
    -- for is its edges not met). While it waits the run is `waiting`, due
    -- 9999-12-31 (or at its deadline), waiting_on 'dependencies'
    awaiting            integer,
    -- 0031: other runs depend on it: its end calls everystep_settle
    dependents          boolean NOT NULL DEFAULT false
) WITH (fillfactor = 50);                               -- 0032: room for HOT updates

-- What makes schedule()'s idempotency key safe under concurrency.
CREATE UNIQUE INDEX everystep_workflow_idempotency
    ON everystep_workflow (name, idempotency_key) WHERE idempotency_key IS NOT NULL;
-- Newest-first listings and pruning by age.
CREATE INDEX everystep_workflow_created_at ON everystep_workflow (created_at);
-- The UI's workflow filter, and the list of workflow names (a loose index scan).
CREATE INDEX everystep_workflow_name_created ON everystep_workflow (name, created_at);
-- Search by idempotency key alone; only keyed runs are in it.
CREATE INDEX everystep_workflow_key ON everystep_workflow (idempotency_key) WHERE idempotency_key IS NOT NULL;
-- A run's children.
CREATE INDEX everystep_workflow_parent ON everystep_workflow (parent_id) WHERE parent_id IS NOT NULL;

-- The re-runs of a run (0015); only re-runs are in it.
CREATE INDEX everystep_workflow_rerun_of ON everystep_workflow (rerun_of) WHERE rerun_of IS NOT NULL;

-- Search by attributes (0022): `attributes @> '{"k": "v"}'`; only runs with
-- attributes are in it.
CREATE INDEX everystep_workflow_attributes ON everystep_workflow USING gin (attributes jsonb_path_ops)
    WHERE attributes IS NOT NULL;

-- Execution tokens: every claim of a run (first claim, catchup, successor
-- claim, reclaim after a lost answer) takes a new one.
CREATE SEQUENCE everystep_claim_token AS bigint;


-- ---------------------------------------------------------------- steps

-- One row per executed step of a run (and per sleep, wait, child start and
-- set_event), unique on (run, step id): the insert is the claim on the step.
CREATE TABLE everystep_step (
    id          bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    workflow_id uuid NOT NULL REFERENCES everystep_workflow (id) ON DELETE CASCADE,
    step_id     varchar(300) NOT NULL,                  -- the dotpath identity
    name        varchar(300) NOT NULL,                  -- the step function's module.qualname
    args        jsonb NOT NULL,
    kwargs      jsonb NOT NULL,
    status      varchar(16) NOT NULL,                   -- done failed started retrying
    result      jsonb,
    error       jsonb,
    -- 0003: the execution that wrote it (NULL on rows written before 0003)
    claim_token bigint,
    -- 0003: when the step's execution started and ended, by the worker's
    -- clock (finished_at NULL while `started`)
    started_at  timestamptz,
    finished_at timestamptz,
    -- 0007: the failed attempts before the last, of a retried step:
    -- [{"attempt": 1, "error": {...}, "at": <epoch>, "retry_at": <epoch>}, ...]
    attempts    jsonb,
    CONSTRAINT everystep_step_once UNIQUE (workflow_id, step_id)
);


-- The formatted traceback of each failed step attempt (its last 16 kB), for
-- the console (0021); deleted with its run.
CREATE TABLE everystep_step_traceback (
    workflow_id uuid NOT NULL REFERENCES everystep_workflow (id) ON DELETE CASCADE,
    step_id     varchar(300) NOT NULL,
    attempt     integer NOT NULL,                        -- 1, 2, ... as in the step's attempts
    claim_token bigint NOT NULL,                         -- the execution it failed in
    traceback   text NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (workflow_id, step_id, attempt)
);


-- ---------------------------------------------------------------- the queue

-- Poison-run accounting: one row per run that has ever lost its worker
-- mid-claim, counting the claims in a row that died with no new step.
CREATE TABLE everystep_crash (
    workflow_id uuid PRIMARY KEY REFERENCES everystep_workflow (id) ON DELETE CASCADE,
    crashes     integer NOT NULL,
    steps_seen  integer NOT NULL                        -- step rows when last counted
);

-- 0015: the executions of a run that ended other than by the run ending or
-- parking, written only by the rare statements that end them, in the same
-- statement: a drain's requeue, the dead-claimer sweep, an operator's
-- requeue, a runner's catchup after its crash, a claim whose answer was
-- lost, a shutdown. The current or last execution is the run row's
-- (claimed_by, claim_token); those that parked the run are its step rows'
-- claim_token. The claim path writes nothing here.
CREATE TABLE everystep_execution (
    id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id   uuid NOT NULL,                              -- no foreign key: kept when the run moves to the history
    token    bigint,                                     -- the execution token of the claim that ended
    claimer  varchar(255),                               -- the runner that held it
    ended_at timestamptz NOT NULL DEFAULT everystep_now(),
    outcome  varchar(16) NOT NULL                        -- drained swept requeued crashed lost shutdown
);
CREATE INDEX everystep_execution_run ON everystep_execution (run_id, id);

-- 0015: the charts' figures per minute and workflow, kept by the
-- maintenance child: the runs that ended in the minute by status, and at the
-- minute's end the runs due and not claimed (the backlog), how long the
-- oldest of them had waited (the pickup latency), and the runs blocked. A
-- chart reads at most (minutes x workflows) rows, whatever the size of the
-- runs' history; rows older than two days are deleted by the same child.
CREATE TABLE everystep_minute (
    minute          timestamptz NOT NULL,
    workflow        varchar(300) NOT NULL,
    completed       integer NOT NULL DEFAULT 0,
    failed          integer NOT NULL DEFAULT 0,
    cancelled       integer NOT NULL DEFAULT 0,
    stopped         integer NOT NULL DEFAULT 0,
    blocked         integer,                             -- sampled: the runs blocked at the minute's end
    due             integer,                             -- sampled: the runs due and not claimed
    oldest_due_s    double precision,                    -- sampled: the wait of the oldest of them, seconds
    PRIMARY KEY (workflow, minute)                       -- workflow '*': every workflow's
);

-- The workers waiting for runs (a free slot, waiting on their LISTEN): only
-- then does a scheduling transaction notify (everystep_wake).
CREATE TABLE everystep_waiting (
    runner varchar(255) PRIMARY KEY,
    since  timestamptz NOT NULL DEFAULT everystep_now()
);

-- Concurrency limits, fleet-wide: at most `concurrency` runs of a workflow
-- running at once across every worker sharing the schema.
CREATE TABLE everystep_limit (
    name        varchar(300) PRIMARY KEY,               -- the workflow's module.qualname
    concurrency integer NOT NULL CHECK (concurrency >= 1),
    updated_at  timestamptz NOT NULL DEFAULT everystep_now()
);

-- One row per unit of a limit. A claim of a limited run takes a free slot in
-- the same statement and writes its run and token on it; a slot is free
-- again once its run is no longer running in it.
CREATE TABLE everystep_slot (
    name   varchar(300) NOT NULL REFERENCES everystep_limit (name) ON DELETE CASCADE,
    slot   integer NOT NULL,                            -- 1 .. concurrency
    run_id uuid,                                        -- the run that took it last (no FK: runs are pruned)
    token  bigint,                                      -- the execution token of that claim
    PRIMARY KEY (name, slot)
);

-- The default priority of a workflow (decorator, else config), written by
-- the workers as they write the limits; a run scheduled without priority=
-- takes it.
CREATE TABLE everystep_priority (
    name       varchar(300) PRIMARY KEY,
    priority   smallint NOT NULL CHECK (priority BETWEEN -100 AND 100),
    updated_at timestamptz NOT NULL DEFAULT everystep_now()
);

-- Per-key concurrency: at most per_key runs of the workflow per key at once.
CREATE TABLE everystep_key_limit (
    name       varchar(300) PRIMARY KEY,
    per_key    integer NOT NULL CHECK (per_key >= 1),
    updated_at timestamptz NOT NULL DEFAULT everystep_now()
);

-- One row per key of a workflow with a per-key limit, made when a keyed run
-- is scheduled. The claim locks the rows of keys with room (SKIP LOCKED),
-- least recently claimed first (round robin), and writes the claim's run,
-- token and time on them: a claim that committed after a claimer's snapshot
-- shows as a token newer than its run, and the key is busy for that claimer.
CREATE TABLE everystep_key (
    name       varchar(300) NOT NULL REFERENCES everystep_key_limit (name) ON DELETE CASCADE,
    key        varchar(255) NOT NULL,
    run_id     uuid,                                    -- a run the last claim through it took
    token      bigint,                                  -- that claim's execution token
    claimed_at timestamptz,                             -- when; NULL: never
    -- false: the key had no claimable nor running run at the last sweep, and
    -- the claims do not read it; the next keyed run scheduled makes it true
    ready      boolean NOT NULL DEFAULT true,
    PRIMARY KEY (name, key),
    held       integer NOT NULL DEFAULT 0               -- 0032: its runs admitted (ready) or running
);

-- Where a scheduled or waiting run waits (0032): a timer until it is due,
-- then ready (the claim reads only this) or blocked for room.
CREATE TABLE everystep_ready (
    run_id   uuid PRIMARY KEY,
    name     varchar(300) NOT NULL,
    priority smallint NOT NULL,
    ready_at timestamptz NOT NULL,                      -- its place in line: when it became due
    slot     integer                                    -- the slot it holds (0: a key's room only); NULL: none
);
CREATE INDEX everystep_ready_order ON everystep_ready (priority DESC, ready_at, run_id);

CREATE TABLE everystep_claimed (
    run_id     uuid PRIMARY KEY,
    name       varchar(300) NOT NULL,
    claimed_by varchar(255)
);
CREATE INDEX everystep_claimed_by ON everystep_claimed (claimed_by);

CREATE TABLE everystep_timer (
    run_id uuid PRIMARY KEY,
    due_at timestamptz NOT NULL
);
CREATE INDEX everystep_timer_due ON everystep_timer (due_at);

CREATE TABLE everystep_blocked (
    run_id   uuid PRIMARY KEY,
    name     varchar(300) NOT NULL,
    ckey     varchar(255),                              -- its concurrency key, when its workflow has a per-key limit
    priority smallint NOT NULL,
    due_at   timestamptz NOT NULL
);
CREATE INDEX everystep_blocked_order ON everystep_blocked (name, ckey, priority DESC, due_at, run_id);
CREATE INDEX everystep_blocked_by_name ON everystep_blocked (name, priority DESC, due_at, run_id);

-- The runs due and not held, by workflow, with the moment each became due
-- (a timer past its time counts before a claim admits it): what the
-- backlog gauges, the minute samples and the unserved check count.
CREATE VIEW everystep_pending AS
SELECT r.name, r.ready_at AS since FROM everystep_ready r
UNION ALL
SELECT b.name, b.due_at FROM everystep_blocked b
UNION ALL
SELECT w.name, t.due_at FROM everystep_timer t JOIN everystep_workflow w ON w.id = t.run_id
WHERE t.due_at <= everystep_now();
-- (The queue tables of 0032 end here.)

-- The keys in turn: the ready ones, least recently claimed first.
CREATE INDEX everystep_key_round ON everystep_key (claimed_at NULLS FIRST, name, key) WHERE ready;

-- Rate limits: a token bucket per name, `rate` tokens every `per` seconds,
-- at most `burst` saved up, and never more than `burst` taken in any `per`
-- seconds (the times of the last `burst` takes). A step takes a token in one
-- statement, or learns when the next is due.
CREATE TABLE everystep_rate_limit (
    name        varchar(255) PRIMARY KEY,
    rate        double precision NOT NULL CHECK (rate > 0),
    per         double precision NOT NULL CHECK (per > 0),
    burst       integer NOT NULL CHECK (burst >= 1),
    tokens      double precision NOT NULL,              -- as of refilled_at
    refilled_at timestamptz NOT NULL DEFAULT everystep_now(),
    takes       timestamptz[] NOT NULL DEFAULT '{}',    -- the last `burst` takes, oldest first
    updated_at  timestamptz NOT NULL DEFAULT everystep_now(),
    -- 0030: the latest moment a step that found no token was told to come
    -- back at; the next one is told one token's interval later at least
    promised_at timestamptz
);

-- Routing: the workflows each worker runs (LIKE patterns; NULL: every
-- workflow), as it said when it took its lock. Rows of workers whose lock
-- nobody holds are stale and ignored.
CREATE TABLE everystep_route (
    runner     varchar(255) PRIMARY KEY,
    patterns   text[],
    updated_at timestamptz NOT NULL DEFAULT everystep_now(),
    unknown    text[] NOT NULL DEFAULT '{}'             -- 0019: workflows it cannot import (not claimed there)
);


-- ---------------------------------------------------------------- messages and events

-- Messages into a running workflow (everystep.send / wait_for), each
-- consumed by exactly one wait, which writes its step id in consumed_by.
CREATE TABLE everystep_message (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,  -- the order of delivery
    run_id          uuid NOT NULL REFERENCES everystep_workflow (id) ON DELETE CASCADE,
    topic           varchar(255) NOT NULL,
    payload         jsonb NOT NULL,
    idempotency_key varchar(255),
    created_at      timestamptz NOT NULL DEFAULT everystep_now(),
    consumed_by     varchar(300),                       -- the step id of the wait that took it
    consumed_at     timestamptz
);
-- What makes send()'s idempotency key safe under concurrency: one message per (run, key).
CREATE UNIQUE INDEX everystep_message_idempotency ON everystep_message (run_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
-- A wait's question: the oldest message on its topic not consumed yet.
CREATE INDEX everystep_message_waiting ON everystep_message (run_id, topic, id) WHERE consumed_by IS NULL;

-- What a run published (everystep.set_event), the last value per key.
CREATE TABLE everystep_event (
    run_id     uuid NOT NULL REFERENCES everystep_workflow (id) ON DELETE CASCADE,
    key        varchar(255) NOT NULL,
    value      jsonb NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT everystep_now(),
    PRIMARY KEY (run_id, key)
);


-- ---------------------------------------------------------------- streams (0023)

-- What a run writes for the outside to read while it goes on
-- (everystep.write_stream / read_stream): one row per entry, offsets dense
-- per (run, key) from 0; the entry with a NULL value closes its stream (a
-- JSON null is the jsonb 'null', never SQL NULL).
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

-- ---------------------------------------------------------------- the history (0017)

-- Finished runs, with their steps, messages and events, moved out of the hot
-- tables in batches by the maintenance child (history.sql): the same columns
-- in the same order as their hot tables (LIKE), range-partitioned by the
-- run's id (UUIDv7: time-ordered) in weeks, partitions named
-- <table>_<yyyymmdd> (the Monday, UTC) made by everystep_history_partition.
-- A column added to a hot table is added to its history table too.
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
-- 0017: the re-runs of a moved run
CREATE INDEX everystep_workflow_history_rerun_of ON everystep_workflow_history (rerun_of)
    WHERE rerun_of IS NOT NULL;
-- Search by attributes (0022), as everystep_workflow_attributes.
CREATE INDEX everystep_workflow_history_attributes ON everystep_workflow_history
    USING gin (attributes jsonb_path_ops) WHERE attributes IS NOT NULL;

CREATE TABLE everystep_step_history (LIKE everystep_step) PARTITION BY RANGE (workflow_id);
ALTER TABLE everystep_step_history ADD PRIMARY KEY (workflow_id, step_id);

CREATE TABLE everystep_message_history (LIKE everystep_message) PARTITION BY RANGE (run_id);
CREATE INDEX everystep_message_history_run ON everystep_message_history (run_id, id);

CREATE TABLE everystep_event_history (LIKE everystep_event) PARTITION BY RANGE (run_id);
ALTER TABLE everystep_event_history ADD PRIMARY KEY (run_id, key);

-- 0023
CREATE TABLE everystep_stream_history (LIKE everystep_stream) PARTITION BY RANGE (run_id);
ALTER TABLE everystep_stream_history ADD PRIMARY KEY (run_id, key, "offset");

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

-- 0023
CREATE VIEW everystep_stream_all AS
SELECT * FROM everystep_stream
UNION ALL
SELECT * FROM everystep_stream_history;

-- The smallest UUIDv7 of the millisecond `at` is in: the bound of a
-- partition of the runs created from `at` on.
CREATE FUNCTION everystep_uuid_at(at timestamptz) RETURNS uuid LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT (lpad(to_hex(floor(extract(epoch FROM at) * 1000)::bigint), 12, '0') || '00000000000000000000')::uuid $$;

-- The week (from Monday 00:00 UTC) a UUIDv7 was made in: its partition.
CREATE FUNCTION everystep_history_week(id uuid) RETURNS date LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT date_trunc('week', to_timestamp(('x' || substr(replace(id::text, '-', ''), 1, 12))::bit(48)::bigint
                                                / 1000.0) AT TIME ZONE 'UTC')::date $$;

-- The partitions of `week` (a Monday) of the history tables (five since 0023), each
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

-- The partitions of `week` of the five history tables (0023: streams), dropped (each an
-- ACCESS EXCLUSIVE lock on its parent for an instant: the caller bounds
-- the wait with lock_timeout). Returns how many it dropped.
CREATE FUNCTION everystep_history_drop(week date) RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
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


-- ---------------------------------------------------------------- recurring schedules

-- The schedules: their definitions (from the manifest's `schedules:`, or the
-- application's everystep.schedules), and the state the scheduler advances
-- as it fires them. Rows are retired, never deleted.
CREATE TABLE everystep_schedule (
    key                  varchar(200) PRIMARY KEY,
    -- the definition
    workflow             varchar(300) NOT NULL,         -- module.qualname
    args                 jsonb NOT NULL,
    cron                 text NOT NULL,
    timezone             text NOT NULL,                 -- the IANA name the cron is read in
    catchup              varchar(16) NOT NULL CHECK (catchup IN ('skip', 'fire_once', 'fire_all')),
    max_catchup          integer NOT NULL CHECK (max_catchup >= 1),
    overlap              varchar(16) NOT NULL CHECK (overlap IN ('allow', 'forbid')),
    max_lateness_seconds double precision NOT NULL CHECK (max_lateness_seconds > 0),
    paused               boolean NOT NULL,
    version              integer NOT NULL DEFAULT 1,    -- +1 on every change
    -- the state, advanced by the scheduler in the transaction that fires
    next_fire_at         timestamptz NOT NULL,          -- the earliest fire time not yet decided
    last_fire_at         timestamptz,                   -- the fire time of the latest run it made
    last_run_id          uuid,                          -- no foreign key since 0017: the run may be in the history
    last_error           text,                          -- why a due time did not fire; cleared when it does
    created_at           timestamptz NOT NULL DEFAULT everystep_now(),
    updated_at           timestamptz NOT NULL DEFAULT everystep_now(),
    retired_at           timestamptz,                   -- retired schedules never fire
    -- 0004: who owns the key (the manifest's `source:`, or the application
    -- API's); only its owner changes or retires it
    source               varchar(100) NOT NULL DEFAULT 'deployment',
    -- 0004: pause after this many failed runs in a row; NULL: never
    auto_pause_after     integer CHECK (auto_pause_after >= 1),
    -- 0004: why the schedule paused itself; cleared by the next write of its definition
    paused_reason        text
);

-- The scheduler's question every few seconds: which live schedules are due.
CREATE INDEX everystep_schedule_due ON everystep_schedule (next_fire_at) WHERE retired_at IS NULL AND NOT paused;

-- The runs a schedule made, by fire time: what auto-pause counts. The
-- retention that removes a run deletes its row (no foreign key since 0017:
-- the run may be in the history).
CREATE TABLE everystep_schedule_run (
    schedule_key varchar(200) NOT NULL,
    fire_at      timestamptz NOT NULL,
    run_id       uuid NOT NULL,
    fired_at     timestamptz NOT NULL DEFAULT everystep_now(),  -- the engine's time of the firing
    PRIMARY KEY (schedule_key, fire_at)
);
-- Pruning a run finds its row here.
CREATE INDEX everystep_schedule_run_run ON everystep_schedule_run (run_id);


-- ---------------------------------------------------------------- graphs (0031)

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
-- An edge is deleted once met (0034; 0033 marked it `met`, which the
-- statements still skip).
CREATE TABLE everystep_dependency (
    depends_on uuid NOT NULL,
    run_id     uuid NOT NULL,
    met        boolean NOT NULL DEFAULT false,
    PRIMARY KEY (depends_on, run_id)
);
CREATE INDEX everystep_dependency_run ON everystep_dependency (run_id);
CREATE INDEX everystep_dependency_open ON everystep_dependency (run_id, depends_on) WHERE NOT met;

-- The end of runs with dependents (ids, with the statuses they ended with):
-- the edges out of a completed one are met, and a dependent whose edges are
-- all met (and whose graph is sealed) is due at once: its release. The
-- dependents of a failed, stopped or cancelled one are cancelled, and
-- theirs, transitively, each with the reason 'dependency <key> <status>'
-- (<key>: the member key of its dependency, else that run's id). A blocked
-- one holds its dependents. Returns how many runs it released.
--
-- Exactly one end releases a dependent, however its dependencies' ends
-- interleave. After deleting the edges it meets, an end looks for an edge of the
-- dependent not met and not being met by another transaction in flight
-- (SKIP LOCKED), and locks the one it finds FOR SHARE: that edge's own end
-- then waits for this commit, and sees it. Finding none, the end may be the
-- last: it locks the dependent's row (in id order) and counts the edges not
-- met in a snapshot taken after the lock. Two such ends in flight at once
-- queue on that lock, and the second counts after the first committed.
CREATE FUNCTION everystep_settle(ids uuid[], statuses text[]) RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    released integer := 0;
    touched uuid[];
    maybe_last uuid[];
BEGIN
    IF ids IS NULL OR cardinality(ids) = 0 THEN
        RETURN 0;
    END IF;
    WITH met AS (
        -- A join with the ended runs, not `= ANY(...)`: a probe of the primary
        -- key per completed run under any cached plan (see 0035).
        DELETE FROM everystep_dependency d
        USING unnest(ids, statuses) AS e(id, status)
        WHERE d.depends_on = e.id AND e.status = 'completed' AND NOT d.met
        RETURNING d.run_id
    )
    SELECT array_agg(DISTINCT run_id) INTO touched FROM met;
    IF touched IS NOT NULL THEN
        SELECT array_agg(t.id ORDER BY t.id) INTO maybe_last
        FROM unnest(touched) AS t(id)
        LEFT JOIN LATERAL (
            SELECT true AS open
            FROM everystep_dependency d
            WHERE d.run_id = t.id AND NOT d.met
            ORDER BY d.depends_on DESC
            LIMIT 1
            FOR SHARE SKIP LOCKED
        ) o ON true
        WHERE o.open IS NULL;
    END IF;
    IF maybe_last IS NOT NULL THEN
        -- `= ANY(maybe_last)` and `(status = 'waiting') IS TRUE`: a probe of the
        -- primary key per dependent, whatever plan is cached for the function.
        PERFORM 1 FROM everystep_workflow w
        WHERE w.id = ANY(maybe_last)
        ORDER BY w.id
        FOR UPDATE;
        WITH freed AS (
            UPDATE everystep_workflow w
            SET due_at = everystep_now(), waiting_on = NULL
            WHERE w.id = ANY(maybe_last) AND (w.status = 'waiting') IS TRUE
              AND w.waiting_on = 'dependencies' AND w.awaiting = 0
              AND NOT EXISTS (SELECT FROM everystep_dependency d WHERE d.run_id = w.id AND NOT d.met)
            RETURNING 1
        )
        SELECT count(*) INTO released FROM freed;
    END IF;
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
          AND (w.status = 'waiting') IS TRUE AND w.waiting_on = 'dependencies';
    END IF;
    IF released > 0 THEN
        PERFORM pg_notify('everystep:' || current_schema(), '');
    END IF;
    RETURN released;
END $$;


-- ---------------------------------------------------------------- operators

-- The audit trail of every action taken from the UI or the CLI.
CREATE TABLE everystep_audit (
    id        bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    at        timestamptz NOT NULL DEFAULT everystep_now(),
    actor     varchar(255) NOT NULL,                 -- who: "operator" (UI token), a Django user, a Unix user@host
    source    varchar(16) NOT NULL,                  -- ui, cli
    action    varchar(64) NOT NULL,                  -- resolve-step, requeue, schedule, prune, ...
    run_id    uuid,                                  -- no foreign key: the record outlives a pruned run
    step_id   varchar(300),
    target    varchar(300),                          -- a schedule key, a workflow, a filter
    details   jsonb NOT NULL DEFAULT '{}'::jsonb     -- the values given, and what came of them
);
CREATE INDEX everystep_audit_at ON everystep_audit (at);
CREATE INDEX everystep_audit_run ON everystep_audit (run_id) WHERE run_id IS NOT NULL;
-- The audit page's filter by person.
CREATE INDEX everystep_audit_actor ON everystep_audit (actor, id);

-- 0022: the bulk actions on the runs a filter finds (everystep.operations.bulk):
-- their progress, advanced in the transaction of each chunk's actions, so an
-- action interrupted halfway is resumed where it stopped, nothing twice.
CREATE TABLE everystep_bulk (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key         text NOT NULL,                           -- the action, its arguments and its filter, as JSON
    action      varchar(32) NOT NULL,                    -- cancel requeue rerun resolve-step
    filter      jsonb NOT NULL,
    actor       varchar(255) NOT NULL,                   -- who started it
    source      varchar(16) NOT NULL,                    -- cli, ui, api
    total       bigint NOT NULL,                         -- the runs the filter found at the start
    upto        uuid,                                    -- the newest of them: runs made later are left alone
    cursor      uuid,                                    -- the oldest run acted on so far (runs go newest first)
    done        bigint NOT NULL DEFAULT 0,
    refused     bigint NOT NULL DEFAULT 0,
    started_at  timestamptz NOT NULL DEFAULT everystep_now(),
    finished_at timestamptz
);
-- One unfinished action per key: what a repeated command resumes.
CREATE UNIQUE INDEX everystep_bulk_open ON everystep_bulk (key) WHERE finished_at IS NULL;

-- Which environment the database is (staging, production, ...): at most one
-- row, written by `everystep migrate --environment NAME`.
CREATE TABLE everystep_environment (
    one         boolean PRIMARY KEY DEFAULT true CHECK (one),
    name        varchar(64) NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT everystep_now(),
    recorded_by varchar(255) NOT NULL
);

-- The ledger of applied migrations, written by the applier
-- (everystep/db/migrations.py), not by a migration.
CREATE TABLE everystep_migration (
    name       text PRIMARY KEY,                     -- 0001_initial, ...
    applied_at timestamptz NOT NULL DEFAULT now()
);


-- ---------------------------------------------------------------- functions

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

-- Room for a run of workflow `wf` with key `ckey` (NULL: none): -1 when it
-- needs none (no limit applies), the slot it took (0: only its key's room),
-- or NULL when there is none (nothing taken).
CREATE FUNCTION everystep_take_room(run uuid, wf varchar, ckey varchar) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    per_key integer := CASE WHEN ckey IS NOT NULL
                            THEN (SELECT kl.per_key FROM everystep_key_limit kl WHERE kl.name = wf) END;
    limited boolean := EXISTS (SELECT FROM everystep_limit l WHERE l.name = wf);
    got integer;
BEGIN
    IF per_key IS NULL AND NOT limited THEN
        RETURN -1;
    END IF;
    IF per_key IS NOT NULL THEN
        INSERT INTO everystep_key AS k (name, key, held, claimed_at) VALUES (wf, ckey, 1, everystep_now())
        ON CONFLICT (name, key) DO UPDATE SET held = k.held + 1, claimed_at = everystep_now()
        WHERE k.held < per_key
        RETURNING 0 INTO got;
        IF got IS NULL THEN
            RETURN NULL;
        END IF;
    END IF;
    IF limited THEN
        got := NULL;
        UPDATE everystep_slot s SET run_id = run, token = NULL
        WHERE (s.name, s.slot) = (SELECT f.name, f.slot FROM everystep_slot f
                                  WHERE f.name = wf AND f.run_id IS NULL
                                  ORDER BY f.slot LIMIT 1 FOR UPDATE SKIP LOCKED)
        RETURNING s.slot INTO got;
        IF got IS NULL AND per_key IS NOT NULL THEN  -- no slot: the key's room goes back
            UPDATE everystep_key k SET held = k.held - 1 WHERE k.name = wf AND k.key = ckey;
        END IF;
        RETURN got;
    END IF;
    RETURN 0;
END $$;

-- Where a scheduled or waiting run waits (its run row locked by the caller):
-- a timer until it is due; then ready, with the room it needs, or blocked.
-- Its place in line: since its due time; a scheduled one since it was
-- created (or its due time, if earlier). True when it is ready.
CREATE FUNCTION everystep_admit(run everystep_workflow) RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    due timestamptz := CASE WHEN run.status = 'scheduled' THEN least(run.due_at, run.created_at) ELSE run.due_at END;
    got integer;
BEGIN
    IF run.due_at > everystep_now() THEN
        INSERT INTO everystep_timer (run_id, due_at) VALUES (run.id, run.due_at);
        RETURN false;
    END IF;
    got := everystep_take_room(run.id, run.name, run.concurrency_key);
    IF got IS NULL THEN
        INSERT INTO everystep_blocked (run_id, name, ckey, priority, due_at)
        VALUES (run.id, run.name,
                CASE WHEN EXISTS (SELECT FROM everystep_key_limit kl WHERE kl.name = run.name)
                     THEN run.concurrency_key END,
                run.priority, due);
        RETURN false;
    END IF;
    INSERT INTO everystep_ready (run_id, name, priority, ready_at, slot)
    VALUES (run.id, run.name, run.priority, due, nullif(got, -1));
    PERFORM everystep_wake();
    RETURN true;
END $$;

-- Admit blocked runs of workflow `wf` while it has room: first those of the
-- key `freed` (the one whose room a run gave back; NULL: none), then, a key
-- at a time least recently served first (the fair queues' round robin), or
-- by priority and time for a workflow without a per-key limit. Returns how
-- many it admitted. Blocked runs whose run row someone else holds (being
-- cancelled, say) are left for the next pump.
CREATE FUNCTION everystep_pump(wf varchar, freed varchar) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    keyed boolean := EXISTS (SELECT FROM everystep_key_limit kl WHERE kl.name = wf);
    limited boolean := EXISTS (SELECT FROM everystep_limit l WHERE l.name = wf);
    admitted integer := 0;
    b record;
    got integer;
BEGIN
    LOOP
        b := NULL;
        IF freed IS NOT NULL AND keyed THEN
            SELECT x.run_id, x.ckey, x.priority, x.due_at INTO b
            FROM everystep_blocked x JOIN everystep_workflow w ON w.id = x.run_id
            WHERE x.name = wf AND x.ckey = freed
            ORDER BY x.priority DESC, x.due_at, x.run_id
            LIMIT 1 FOR UPDATE SKIP LOCKED;
            IF b.run_id IS NULL THEN
                -- That key has none waiting. Without a workflow limit no
                -- other key's room changed: done; else on to the others.
                EXIT WHEN NOT limited;
                freed := NULL;
                CONTINUE;
            END IF;
        ELSIF keyed THEN
            SELECT x.run_id, x.ckey, x.priority, x.due_at INTO b
            FROM everystep_key k
            CROSS JOIN LATERAL (SELECT x.run_id, x.ckey, x.priority, x.due_at
                                FROM everystep_blocked x JOIN everystep_workflow w ON w.id = x.run_id
                                WHERE x.name = k.name AND x.ckey = k.key
                                ORDER BY x.priority DESC, x.due_at, x.run_id
                                LIMIT 1 FOR UPDATE SKIP LOCKED) x
            WHERE k.name = wf AND k.held < (SELECT kl.per_key FROM everystep_key_limit kl WHERE kl.name = wf)
            ORDER BY k.claimed_at NULLS FIRST, k.key
            LIMIT 1;
            IF b.run_id IS NULL THEN  -- no key with room has a run waiting: runs with no key, if any
                SELECT x.run_id, x.ckey, x.priority, x.due_at INTO b
                FROM everystep_blocked x JOIN everystep_workflow w ON w.id = x.run_id
                WHERE x.name = wf AND x.ckey IS NULL
                ORDER BY x.priority DESC, x.due_at, x.run_id
                LIMIT 1 FOR UPDATE SKIP LOCKED;
            END IF;
        ELSE
            SELECT x.run_id, x.ckey, x.priority, x.due_at INTO b
            FROM everystep_blocked x JOIN everystep_workflow w ON w.id = x.run_id
            WHERE x.name = wf
            ORDER BY x.priority DESC, x.due_at, x.run_id
            LIMIT 1 FOR UPDATE SKIP LOCKED;
        END IF;
        EXIT WHEN b.run_id IS NULL;
        got := everystep_take_room(b.run_id, wf, b.ckey);
        IF got IS NULL THEN
            EXIT WHEN NOT keyed OR limited;  -- no slot left
            freed := NULL;
            CONTINUE;  -- (a race on the key's room) another key
        END IF;
        DELETE FROM everystep_blocked WHERE run_id = b.run_id;
        -- A limited workflow's run keeps its place in time; a key's next run
        -- goes to the back of the line (the keys take turns).
        INSERT INTO everystep_ready (run_id, name, priority, ready_at, slot)
        VALUES (b.run_id, wf, b.priority, CASE WHEN keyed THEN everystep_now() ELSE b.due_at END, nullif(got, -1));
        admitted := admitted + 1;
    END LOOP;
    IF admitted > 0 THEN  -- the claimers learn of them at once, waiting or not (a freed slot)
        PERFORM pg_notify('everystep:' || current_schema(), '');
    END IF;
    RETURN admitted;
END $$;

-- Run `run` (of `wf`, key `ckey`) gives back the slot (or the key's room)
-- it held, and the next blocked runs are admitted.
CREATE FUNCTION everystep_release(run uuid, wf varchar, ckey varchar, held_slot integer) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF held_slot > 0 THEN
        UPDATE everystep_slot SET run_id = NULL WHERE name = wf AND slot = held_slot AND run_id = run;
    END IF;
    IF ckey IS NOT NULL THEN
        UPDATE everystep_key k SET held = greatest(k.held - 1, 0) WHERE k.name = wf AND k.key = ckey;
    END IF;
    PERFORM everystep_pump(wf, ckey);
END $$;

-- Run `run` leaves the queue (it is cancelled, or due at another time): its
-- queue row goes, with the room a ready one held.
CREATE FUNCTION everystep_unqueue(run uuid) RETURNS void LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r record;
BEGIN
    DELETE FROM everystep_ready x WHERE x.run_id = run RETURNING x.name, x.slot INTO r;
    IF r.slot IS NOT NULL THEN
        PERFORM everystep_release(run, r.name,
                                  (SELECT w.concurrency_key FROM everystep_workflow w WHERE w.id = run), r.slot);
        RETURN;
    END IF;
    IF r.name IS NULL THEN
        DELETE FROM everystep_timer WHERE run_id = run;
        DELETE FROM everystep_blocked WHERE run_id = run;
    END IF;
END $$;

-- The runs whose time has come (up to `lim`, earliest first) are admitted.
CREATE FUNCTION everystep_promote(lim integer) RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    n integer;
BEGIN
    WITH due AS (
        SELECT t.ctid AS tid, t.run_id FROM everystep_timer t
        WHERE t.due_at <= everystep_now()
        ORDER BY t.due_at
        LIMIT lim
        FOR UPDATE SKIP LOCKED
    ), runs AS (
        SELECT w FROM everystep_workflow w
        WHERE w.id IN (SELECT run_id FROM due)
        ORDER BY w.due_at, w.id
        FOR UPDATE SKIP LOCKED
    ), gone AS (
        DELETE FROM everystep_timer t USING due, runs WHERE t.ctid = due.tid AND due.run_id = (runs.w).id
    )
    SELECT count(everystep_admit(runs.w)) INTO n FROM runs;
    RETURN n;
END $$;

-- The claim: up to `lim` ready runs for `runner`, of the workflows matching
-- `routes` (LIKE patterns; NULL: all) but not `skipped`, highest priority
-- first, then in the order they became ready. Due timers are admitted first.
-- The queue rows it takes (ready, and due timers) are deleted by the
-- physical address it locked them at (ctid): a TID probe each, cheaper
-- than any walk of an index under any statistics (0036).
CREATE FUNCTION everystep_claim(runner varchar, lim integer, routes text[], skipped text[])
RETURNS TABLE (id uuid, name varchar, args jsonb, steps json, claim_token bigint, cancelling boolean,
               now float8, slot integer, parent_id uuid)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    IF lim <= 0 THEN
        RETURN;
    END IF;
    -- The timers whose time came are admitted first; a probe of the
    -- timers' index tells whether there is one (most claims: none). It
    -- locks what it finds, as the admission does: a queue table is never
    -- only read by the queue (a reader stops its rewrite, 0037).
    IF EXISTS (SELECT FROM everystep_timer t WHERE t.due_at <= everystep_now() FOR UPDATE SKIP LOCKED) THEN
        PERFORM everystep_promote(500);
    END IF;
    -- It moves the queue rows itself; the trigger knows its update of the
    -- run rows by the new execution tokens and leaves them alone.
    RETURN QUERY
    WITH candidate AS (
        SELECT r.ctid AS tid, r.run_id FROM everystep_ready r
        WHERE (routes IS NULL OR r.name LIKE ANY(routes)) AND r.name <> ALL(skipped)
        ORDER BY r.priority DESC, r.ready_at, r.run_id
        LIMIT lim
        FOR UPDATE SKIP LOCKED
    ), held AS (
        SELECT w.id FROM everystep_workflow w
        WHERE w.id IN (SELECT run_id FROM candidate) AND w.status IN ('scheduled', 'waiting')
        FOR UPDATE SKIP LOCKED
    ), taken AS (
        DELETE FROM everystep_ready r USING candidate c, held h WHERE r.ctid = c.tid AND h.id = c.run_id
        RETURNING r.run_id, r.name, r.slot
    ), holder AS (
        INSERT INTO everystep_claimed (run_id, name, claimed_by)
        SELECT t.run_id, t.name, runner FROM taken t
    )
    UPDATE everystep_workflow w
    SET status = 'running', claimed_by = runner, claim_token = nextval('everystep_claim_token'), slot = t.slot
    FROM taken t
    WHERE w.id = t.run_id
    RETURNING w.id, w.name, w.args,
        to_json(ARRAY(SELECT json_build_array(s.step_id, s.name, s.status, s.result, s.error, s.attempts)
                      FROM everystep_step s WHERE s.workflow_id = w.id)),
        w.claim_token, (w.cancel_requested_at IS NOT NULL OR w.deadline_at <= everystep_now()) IS TRUE,
        extract(epoch FROM everystep_now())::float8, w.slot, w.parent_id;
END $$;

-- Every workflow with blocked runs admits what its room allows: the
-- catch-up of a release and an admission that ran at once (each skipped
-- the other's uncommitted row), run by a claim that found nothing ready and
-- by the maintenance sweep. The workflows are read by a loose scan of the
-- blocked runs' index (one probe each).
CREATE FUNCTION everystep_unblock() RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    wf varchar;
    admitted integer := 0;
BEGIN
    FOR wf IN
        WITH RECURSIVE names(name) AS (
            (SELECT b.name FROM everystep_blocked b ORDER BY b.name LIMIT 1)
          UNION ALL
            SELECT (SELECT b.name FROM everystep_blocked b WHERE b.name > n.name ORDER BY b.name LIMIT 1)
            FROM names n WHERE n.name IS NOT NULL
        )
        SELECT name FROM names WHERE name IS NOT NULL
    LOOP
        admitted := admitted + everystep_pump(wf, NULL);
    END LOOP;
    RETURN admitted;
END $$;

-- The ready runs that hold no room but whose workflow has a limit now (set
-- after they were admitted) are admitted again: they take a slot or wait
-- for one. Run where the limits are written, and by the maintenance sweep;
-- with no limit at all it returns at once (0041), else it reads the ready
-- rows of the limited workflows alone, and only their records (0042).
CREATE FUNCTION everystep_readmit() RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r everystep_workflow;
    n integer := 0;
    candidates uuid[];
BEGIN
    IF NOT EXISTS (SELECT FROM everystep_limit) AND NOT EXISTS (SELECT FROM everystep_key_limit) THEN
        RETURN 0;
    END IF;
    -- (A scan of the ready rows whatever the plan: the names are an array.)
    candidates := ARRAY(SELECT y.run_id FROM everystep_ready y
                        WHERE y.slot IS NULL
                          AND y.name = ANY(ARRAY(SELECT l.name FROM everystep_limit l
                                                 UNION ALL SELECT kl.name FROM everystep_key_limit kl)));
    IF cardinality(candidates) = 0 THEN
        RETURN 0;  -- (nearly always: no record is read)
    END IF;
    FOR r IN
        SELECT w.*
        FROM everystep_ready x JOIN everystep_workflow w ON w.id = x.run_id
        WHERE x.run_id = ANY(candidates) AND x.slot IS NULL
          AND (EXISTS (SELECT FROM everystep_limit l WHERE l.name = x.name) OR w.concurrency_key IS NOT NULL)
        ORDER BY x.ready_at, x.run_id
        FOR UPDATE SKIP LOCKED
    LOOP
        DELETE FROM everystep_ready WHERE run_id = r.id;
        PERFORM everystep_admit(r);
        n := n + 1;
    END LOOP;
    RETURN n;
END $$;

-- A run made running by a worker of a version before 0032 with its own
-- claim (a rolling upgrade) is not seen by the status trigger (0039): the
-- maintenance sweep removes its queue row and holds it by its claimed_by.
-- `head`: only the first `head` runs of the ready order and the `head`
-- earliest due timers are looked at, where the claims meet a stray (the
-- sweep's look between its looks at the whole queue, 0042); NULL: the whole
-- queue, blocked runs included. everystep_hold_stray: one of them.
CREATE FUNCTION everystep_hold_stray(run uuid, wf varchar, run_status varchar, claimer varchar) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM everystep_unqueue(run);
    IF run_status = 'running' THEN
        INSERT INTO everystep_claimed (run_id, name, claimed_by) VALUES (run, wf, claimer)
        ON CONFLICT (run_id) DO NOTHING;
    END IF;
    RETURN 1;
END $$;

CREATE FUNCTION everystep_hold_strays(head integer) RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r record;
    n integer := 0;
    head_runs uuid[];
    seqscan text := current_setting('enable_seqscan');
BEGIN
    IF head IS NULL THEN
        FOR r IN
            SELECT w.id, w.name, w.status, w.claimed_by FROM everystep_workflow w
            WHERE w.id IN (SELECT x.run_id FROM everystep_ready x
                           UNION ALL SELECT b.run_id FROM everystep_blocked b
                           UNION ALL SELECT t.run_id FROM everystep_timer t WHERE t.due_at <= everystep_now())
              AND w.status NOT IN ('scheduled', 'waiting')
            FOR UPDATE SKIP LOCKED
        LOOP
            n := n + everystep_hold_stray(r.id, r.name, r.status, r.claimed_by);
        END LOOP;
        RETURN n;
    END IF;
    -- The head in the queue's orders and its records by key, whatever the
    -- statistics say of the tables (a plan made while they were small would
    -- read them all).
    PERFORM set_config('enable_seqscan', 'off', true);
    head_runs := ARRAY((SELECT x.run_id FROM everystep_ready x ORDER BY x.priority DESC, x.ready_at, x.run_id
                        LIMIT head)
                       UNION ALL (SELECT t.run_id FROM everystep_timer t WHERE t.due_at <= everystep_now()
                                  ORDER BY t.due_at LIMIT head));
    FOR r IN
        SELECT w.id, w.name, w.status, w.claimed_by FROM everystep_workflow w
        WHERE w.id = ANY(head_runs) AND w.status NOT IN ('scheduled', 'waiting')
        FOR UPDATE SKIP LOCKED
    LOOP
        n := n + everystep_hold_stray(r.id, r.name, r.status, r.claimed_by);
    END LOOP;
    PERFORM set_config('enable_seqscan', seqscan, true);
    RETURN n;
END $$;

-- The whole queue (what the maintenance sweep of a version before 0042 calls).
CREATE FUNCTION everystep_hold_strays() RETURNS integer LANGUAGE sql VOLATILE AS $$
    SELECT everystep_hold_strays(NULL::integer);
$$;

-- A queue table whose dead rows a vacuum cannot remove is rewritten with
-- only its live rows (0037_compact_queue.sql says when and why).
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

-- The trigger: admission and release at the changes of a run's row. A run
-- made `running` other than by everystep_claim by hand is held by its
-- claimed_by (by a worker of a version before 0032: everystep_hold_strays).
CREATE FUNCTION everystep_queue() RETURNS trigger LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND OLD.status IN ('scheduled', 'waiting') THEN
        PERFORM everystep_unqueue(OLD.id);
    ELSIF TG_OP = 'UPDATE' AND OLD.status = 'running' AND NEW.status <> 'running' THEN
        DELETE FROM everystep_claimed WHERE run_id = OLD.id;
    END IF;
    IF NEW.status IN ('scheduled', 'waiting') THEN
        PERFORM everystep_admit(NEW);
    ELSIF NEW.status = 'running' AND (TG_OP = 'INSERT' OR OLD.status <> 'running') THEN
        INSERT INTO everystep_claimed (run_id, name, claimed_by) VALUES (NEW.id, NEW.name, NEW.claimed_by)
        ON CONFLICT (run_id) DO NOTHING;
    END IF;
    IF TG_OP = 'UPDATE' AND OLD.status = 'running' AND NEW.status <> 'running' AND OLD.slot IS NOT NULL THEN
        PERFORM everystep_release(OLD.id, OLD.name, OLD.concurrency_key, OLD.slot);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER everystep_queue_insert AFTER INSERT ON everystep_workflow
FOR EACH ROW WHEN (NEW.status IN ('scheduled', 'waiting', 'running'))
EXECUTE FUNCTION everystep_queue();

-- A change of status, but not a claim's (everystep_claim moves the queue
-- rows itself, and only a claim gives a run a new execution token as it
-- makes it running): a run made running by hand is held by its claimed_by.
-- Each statement that updates these columns prepares the WHEN clauses
-- anew, so the claim's and the end's (status) is a short one.
CREATE TRIGGER everystep_queue_status AFTER UPDATE OF status ON everystep_workflow
FOR EACH ROW WHEN (NEW.status <> OLD.status
                   AND (NEW.status <> 'running' OR NEW.claim_token IS NOT DISTINCT FROM OLD.claim_token))
EXECUTE FUNCTION everystep_queue();

-- A waiting run's due time or priority changed, its status not (else the
-- trigger above fired).
CREATE TRIGGER everystep_queue_place AFTER UPDATE OF due_at, priority ON everystep_workflow
FOR EACH ROW WHEN (NEW.status = OLD.status AND NEW.status IN ('scheduled', 'waiting')
                   AND (NEW.due_at <> OLD.due_at OR NEW.priority <> OLD.priority))
EXECUTE FUNCTION everystep_queue();
