-- A step that finds no token of its rate limit is told when to come back:
-- the later of the next token's time and the last such promise plus one
-- token's interval, so the runs waiting for tokens come back one per token,
-- each at its own moment, parked meanwhile (their slots given back), rather
-- than all at the next token. Additive: a column, NULL (no promise yet) for
-- the existing buckets.
ALTER TABLE everystep_rate_limit ADD COLUMN promised_at timestamptz;
