-- Concurrency limits, fleet-wide: at most `concurrency` runs of a workflow
-- running at once across every worker sharing the schema. Workers write the
-- limits of the workflows they import (decorator, then config override).
CREATE TABLE everystep_limit (
    name        varchar(300) PRIMARY KEY,               -- the workflow's module.qualname
    concurrency integer NOT NULL CHECK (concurrency >= 1),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- One row per unit of a limit. A claim of a limited run takes a free slot in
-- the same statement (row lock, SKIP LOCKED) and writes its run and token on
-- it. A slot is free again once its run is no longer running in it: nothing
-- has to release it, whichever way the run left `running`.
CREATE TABLE everystep_slot (
    name   varchar(300) NOT NULL REFERENCES everystep_limit (name) ON DELETE CASCADE,
    slot   integer NOT NULL,                            -- 1 .. concurrency
    run_id uuid,                                        -- the run that took it last (no FK: runs are pruned)
    token  bigint,                                      -- the execution token of that claim
    PRIMARY KEY (name, slot)
);

-- The slot a limited run was claimed into (NULL for unlimited workflows).
ALTER TABLE everystep_workflow ADD COLUMN slot integer;

-- The claim of a limited workflow's earliest due runs, by name (runs
-- scheduled in one transaction are due at once: the UUIDv7 id orders them).
CREATE INDEX everystep_workflow_due_by_name ON everystep_workflow (name, due_at, id)
    WHERE status IN ('scheduled', 'waiting');

-- Routing: the workflows each worker runs, as it said when it took its lock
-- (LIKE patterns; NULL: every workflow). Rows of workers whose lock nobody
-- holds are stale and ignored; a worker rewrites its row at every start.
CREATE TABLE everystep_route (
    runner     varchar(255) PRIMARY KEY,
    patterns   text[],
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- Messages into a running workflow (everystep.send / everystep.wait_for).
-- A message is inserted in the sender's transaction; the wait that takes it
-- writes its step id in `consumed_by`, in the statement that records the wait's
-- outcome, so each message is consumed by exactly one wait.
CREATE TABLE everystep_message (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,  -- the order of delivery
    run_id          uuid NOT NULL REFERENCES everystep_workflow (id) ON DELETE CASCADE,
    topic           varchar(255) NOT NULL,
    payload         jsonb NOT NULL,
    idempotency_key varchar(255),
    created_at      timestamptz NOT NULL DEFAULT now(),
    consumed_by     varchar(300),                       -- the step id of the wait that took it
    consumed_at     timestamptz
);
-- What makes send()'s idempotency key safe under concurrency: one message per (run, key).
CREATE UNIQUE INDEX everystep_message_idempotency ON everystep_message (run_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
-- A wait's question: the oldest message on its topic not consumed yet.
CREATE INDEX everystep_message_waiting ON everystep_message (run_id, topic, id) WHERE consumed_by IS NULL;

-- A run parked in a wait (`waiting`): what it waits for ('message:<topic>'),
-- so a send on that topic makes it due at once; NULL otherwise.
ALTER TABLE everystep_workflow ADD COLUMN waiting_on varchar(300);
-- +1 by every message sent to the run: a wait parks only if no message came
-- since it looked (the park matches the count it saw), so none is missed.
ALTER TABLE everystep_workflow ADD COLUMN wakes bigint NOT NULL DEFAULT 0;

-- What a run published (everystep.set_event), read from outside with
-- everystep.get_event: the last value per key.
CREATE TABLE everystep_event (
    run_id     uuid NOT NULL REFERENCES everystep_workflow (id) ON DELETE CASCADE,
    key        varchar(255) NOT NULL,
    value      jsonb NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, key)
);

-- Child workflows (everystep.start / call): the run that started a run, and
-- its children by parent. A parent parked on a child's result waits on
-- 'child:<child id>' (waiting_on); the statement that ends the child counts a
-- wake on the parent and makes it due at once.
ALTER TABLE everystep_workflow ADD COLUMN parent_id uuid REFERENCES everystep_workflow (id) ON DELETE SET NULL;
CREATE INDEX everystep_workflow_parent ON everystep_workflow (parent_id) WHERE parent_id IS NOT NULL;
