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
