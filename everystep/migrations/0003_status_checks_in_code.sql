-- The status columns keep their type, varchar(16), and their values are the
-- engine's own literals (store.py writes every status). Their CHECK
-- constraints go: PostgreSQL parses and plans a CHECK expression again for
-- every statement that writes the table, about 10% of the database's CPU for
-- a claimed, executed and ended run (see "Performance" in README.md).
ALTER TABLE everystep_workflow DROP CONSTRAINT IF EXISTS everystep_workflow_status_check;
ALTER TABLE everystep_step DROP CONSTRAINT IF EXISTS everystep_step_status_check;
