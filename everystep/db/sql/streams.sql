-- Durable streams (0023): what a run writes for the outside to read while
-- it goes on. Read by everystep/db/streams.py. Readers LISTEN on
-- 'everystep_stream:<schema>'; every write notifies there at its commit,
-- for each stream written, in one of two forms (see
-- everystep/stream_readers.py, parse_notification):
--   '<run> @<first offset> <last offset> <key length> <key><entries>': the entries
--     themselves, a JSON array of [offset, value as JSON text, step_id,
--     attempt, claim_token] (value null: the close), in several
--     notifications of at most 8000 bytes when they do not fit one, so that
--     a listener hands them to its readers without a look;
--   '<run> <last offset written> <key>' (the key last: it may hold spaces):
--     where the entries do not fit (a large value), so that a reader looks
--     only when it is behind.
-- A run's end notifies '<run>' alone (every stream of the run is closed).


-- name: write_streams
-- Stream entries of several runs of one runner (group commit, see
-- everystep/writer.py), each fenced by its own execution's token like a
-- step row (the FOR SHARE of its run row keeps a requeue and the write
-- from both winning). The entries come as parallel arrays, their offsets
-- given by the execution (it is the run's only writer); an entry there
-- already is this execution's own earlier try, its answer lost. Returns
-- the runs held by the writing executions (a row per notification: the
-- entries of a stream cut in parts of about 6,000 bytes, each notified with
-- its entries, or its last offset where they do not fit a notification).
WITH
    i AS (
        SELECT *
        FROM unnest(%(runs)s::uuid[], %(tokens)s::bigint[], %(keys)s::text[], %(offsets)s::bigint[],
                    %(values)s::text[], %(step_ids)s::text[], %(attempts)s::int[])
            AS i(run, token, key, "offset", value, step_id, attempt)
    ),
    w AS (
        SELECT id, claim_token
        FROM everystep_workflow
        WHERE id = ANY(%(runs)s::uuid[]) AND (status = 'running') IS TRUE AND claimed_by = %(runner)s
        FOR SHARE
    ),
    held AS (
        SELECT DISTINCT w.id
        FROM w
        JOIN i ON i.run = w.id AND i.token = w.claim_token
    ),
    ins AS (
        INSERT INTO everystep_stream (run_id, key, "offset", value, step_id, attempt, claim_token)
        SELECT i.run, i.key, i."offset", i.value::jsonb, i.step_id, i.attempt, i.token
        FROM i
        JOIN held ON held.id = i.run
        ON CONFLICT (run_id, key, "offset") DO NOTHING
    ),
    written AS (
        SELECT i.run, i.key, i."offset",
               json_build_array(i."offset", i.value::jsonb::text, i.step_id, i.attempt, i.token)::text AS entry
        FROM i
        JOIN held ON held.id = i.run
    ),
    part AS (
        SELECT run, key, "offset", entry,
               sum(octet_length(entry) + 1) OVER (PARTITION BY run, key ORDER BY "offset") / 6000 AS part
        FROM written
    ),
    note AS (
        SELECT run, key, part, min("offset") AS first, max("offset") AS last,
               '[' || string_agg(entry, ',' ORDER BY "offset") || ']' AS entries
        FROM part
        GROUP BY run, key, part
    ),
    payload AS (
        SELECT run, key, part,
               run::text || ' @' || first || ' ' || last || ' ' || length(key) || ' ' || key || entries AS inline,
               run::text || ' ' || last || ' ' || key AS header
        FROM note
        ORDER BY run, key, part  -- a stream's notifications in offset order
    )
SELECT run, pg_notify('everystep_stream:' || current_schema(),
                      CASE WHEN octet_length(inline) < 8000 THEN inline ELSE header END)
FROM payload;

-- name: stream_state
-- What an execution needs before it writes to a run's streams: per key,
-- the next offset and whether it is closed; and the entries the body wrote
-- (attempt NULL), by the body call's id, which a replay does not write again.
SELECT key, max("offset") + 1, bool_or(value IS NULL),
       coalesce(array_agg(step_id ORDER BY "offset") FILTER (WHERE attempt IS NULL AND step_id IS NOT NULL), '{}'),
       coalesce(array_agg("offset" ORDER BY "offset") FILTER (WHERE attempt IS NULL AND step_id IS NOT NULL), '{}')
FROM everystep_stream
WHERE run_id = %(run)s
GROUP BY key;

-- name: read_stream
-- A reader's look: the run's status (no row: no such run, hot or in the
-- history) and, in the same snapshot, up to `limit` entries of the stream
-- from `offset` on, their values as JSON text (an SSE response sends it as it is). A run's entries are committed before its end, so a
-- look that sees the run ended sees all of them.
WITH
    run AS (
        SELECT status
        FROM everystep_workflow_all
        WHERE id = %(run)s
    ),
    e AS (
        SELECT "offset", value::text AS value, value IS NULL AS closes, step_id, attempt, claim_token
        FROM everystep_stream_all
        WHERE run_id = %(run)s AND key = %(key)s AND "offset" >= %(offset)s
        ORDER BY "offset"
        LIMIT %(limit)s
    )
SELECT run.status, e."offset", e.value, e.closes, e.step_id, e.attempt, e.claim_token
FROM run
LEFT JOIN e ON true
ORDER BY e."offset";

-- name: run_streams
-- The streams of a run (the UI's run page): each key with its number of
-- entries and whether it is closed (by a close, or by the run's end).
SELECT s.key, count(*) FILTER (WHERE s.value IS NOT NULL), bool_or(s.value IS NULL)
FROM everystep_stream_all s
WHERE s.run_id = %(run)s
GROUP BY s.key
ORDER BY s.key;

-- name: notify_streams
-- Wake the readers of a run's streams (its end closed them).
SELECT pg_notify('everystep_stream:' || current_schema(), %(run)s::text);

-- name: stream_channel
-- The channel the readers of this schema's streams LISTEN on.
SELECT 'everystep_stream:' || current_schema();
