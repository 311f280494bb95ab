-- The workflows a worker found it cannot import (its runs given back, no
-- more of them claimed there): readiness names them, and a run that no live
-- worker both routes and can import counts as unserved.
-- Additive: a column with a default; a worker of the previous version never
-- writes it and is taken to import everything it routes.
ALTER TABLE everystep_route ADD COLUMN unknown text[] NOT NULL DEFAULT '{}';
