-- Priorities, fair queues (per-key concurrency) and rate limits, all decided
-- fleet-wide in the claim (or in the one statement that takes a token), with
-- no coordinator. A run that uses none of them is claimed from the same
-- index range as before.

-- Priorities: -100..100, higher first. Runs of the default priority 0 stay
-- in the unlimited lane's index (due_at, id); the others go to a lane of
-- their own, (priority DESC, due_at, id), which the claim reads before
-- (priority > 0) and after (priority < 0) the plain lane.
ALTER TABLE everystep_workflow ADD COLUMN priority smallint NOT NULL DEFAULT 0
    CONSTRAINT everystep_workflow_priority CHECK (priority BETWEEN -100 AND 100);
-- Fair queues: the key a run was scheduled with (a tenant, say); with a
-- per-key limit on its workflow (everystep_key_limit) the run is `keyed`:
-- it waits in the keyed lane and is claimed through its key's row.
ALTER TABLE everystep_workflow ADD COLUMN concurrency_key varchar(255);
ALTER TABLE everystep_workflow ADD COLUMN keyed boolean NOT NULL DEFAULT false;

DROP INDEX everystep_workflow_ready_unlimited;
CREATE INDEX everystep_workflow_ready_unlimited ON everystep_workflow (due_at, id)
    WHERE status IN ('scheduled', 'waiting') AND NOT limited AND priority = 0;
CREATE INDEX everystep_workflow_ready_priority ON everystep_workflow (priority DESC, due_at, id)
    WHERE status IN ('scheduled', 'waiting') AND NOT limited AND priority <> 0;
DROP INDEX everystep_workflow_ready_limited;
CREATE INDEX everystep_workflow_ready_limited ON everystep_workflow (name, due_at, id)
    WHERE status IN ('scheduled', 'waiting') AND limited AND NOT keyed AND priority = 0;
CREATE INDEX everystep_workflow_ready_limited_priority ON everystep_workflow (name, priority DESC, due_at, id)
    WHERE status IN ('scheduled', 'waiting') AND limited AND NOT keyed AND priority <> 0;
CREATE INDEX everystep_workflow_ready_keyed ON everystep_workflow (name, concurrency_key, due_at, id)
    WHERE status IN ('scheduled', 'waiting') AND keyed;
-- The running runs of a key: what its limit counts.
CREATE INDEX everystep_workflow_running_keyed ON everystep_workflow (name, concurrency_key)
    WHERE status = 'running' AND concurrency_key IS NOT NULL;

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
    PRIMARY KEY (name, key)
);
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
    updated_at  timestamptz NOT NULL DEFAULT everystep_now()
);
