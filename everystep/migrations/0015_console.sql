-- The operators' console, second pass: re-runs from a step, the execution
-- history of a run, and the per-minute figures the charts draw. Additive: a
-- run in flight keeps running, and no statement of the claim, the step
-- writes or the ends of runs changes.

-- A re-run from a step (everystep.rerun) is a new run of the same workflow
-- and args that links back to the run it re-runs. No foreign key: the new
-- run outlives a pruned original, and pruning never looks here.
ALTER TABLE everystep_workflow ADD COLUMN rerun_of uuid;
-- The re-runs of a run (its page links to them); only re-runs are in it.
CREATE INDEX everystep_workflow_rerun_of ON everystep_workflow (rerun_of) WHERE rerun_of IS NOT NULL;

-- The executions of a run that ended other than by the run ending or
-- parking: written only by the rare statements that end them (a drain's
-- requeue, the dead-claimer sweep, an operator's requeue, a runner's
-- catchup after its crash, a claim whose answer was lost, a shutdown), in
-- the same statement. The current or last execution is the run row's
-- (claimed_by, claim_token); the executions that parked the run are those
-- of its step rows' claim_token. The claim path writes nothing here. No
-- foreign key: the rows stay when their run moves to the history
-- (0017_history.sql), and retention removes them with their run.
CREATE TABLE everystep_execution (
    id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id   uuid NOT NULL,
    token    bigint,                                     -- the execution token of the claim that ended
    claimer  varchar(255),                               -- the runner that held it
    ended_at timestamptz NOT NULL DEFAULT everystep_now(),
    outcome  varchar(16) NOT NULL                        -- drained swept requeued crashed lost shutdown
);
CREATE INDEX everystep_execution_run ON everystep_execution (run_id, id);

-- The charts' figures per minute and workflow, kept by the maintenance
-- child (everystep/maintenance.py): the runs that ended in the minute by
-- status, and at the minute's end the runs due and not claimed (the
-- backlog), how long the oldest of them had waited (the pickup latency), and
-- the runs blocked. A chart reads at most (minutes x workflows) rows of it,
-- whatever the size of the runs' history. Rows older than two days are
-- deleted by the same child.
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
