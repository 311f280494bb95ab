-- The formatted traceback of each failed step attempt (its last 16 kB), for
-- the console's run page: the error of a step row says what failed, this
-- says where. One row per (run, step, attempt), written by the execution
-- that holds the run; deleted with its run (a run moved to the history
-- keeps its error, not its tracebacks). Additive: a new table.
CREATE TABLE everystep_step_traceback (
    workflow_id uuid NOT NULL REFERENCES everystep_workflow (id) ON DELETE CASCADE,
    step_id     varchar(300) NOT NULL,
    attempt     integer NOT NULL,                        -- 1, 2, ... as in the step's attempts
    claim_token bigint NOT NULL,                         -- the execution it failed in
    traceback   text NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (workflow_id, step_id, attempt)
);
