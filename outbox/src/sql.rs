//! The outbox's SQL, rendered for a schema: every object's name and its
//! `CREATE` statement, defined here once ([`Part`]); [`sql`] renders them
//! all as one idempotent script.
//!
//! The design, for the relay that reads it:
//!
//! - `shardline_outbox`: one row per event appended, `id` a `bigserial`
//!   (its primary key's b-tree serves the relay's `ORDER BY id` reads),
//!   `event_id` a fresh uuid, `(order_id, seq)` unique. A polling relay reads
//!   every row visible to it in `id` order, publishes, and deletes the rows
//!   the broker confirmed; the table holds only what is not published yet.
//! - `shardline_outbox_counter`: the last seq given per order. The append's
//!   `INSERT … ON CONFLICT DO UPDATE … RETURNING` takes the next seq and
//!   row-locks the order's counter until the caller's transaction ends, so
//!   one order's writers serialise: seq order is commit order (and `id`
//!   order), a rollback gives its seq back, and two first appends of a new
//!   order do not abort each other (the second waits, then updates).
//! - `shardline_outbox_append`, `shardline_outbox_seed`: the only doors for
//!   applications; `shardline_outbox_meta`: the installed version.

use std::fmt;

use shardline_contract::order_id::MAX_FIELD_BYTES;

use crate::schema::{Schema, quote_literal};

/// The version of the objects below; a later version migrates from it.
pub const VERSION: i32 = 1;

/// The table of events not yet published.
pub const TABLE: &str = "shardline_outbox";
/// Each order's last seq given.
pub const COUNTER: &str = "shardline_outbox_counter";
/// The installed version, one row per component.
pub const META: &str = "shardline_outbox_meta";
/// `shardline_outbox_append(order_id, event, data, traceparent)`.
pub const APPEND: &str = "shardline_outbox_append";
/// `shardline_outbox_seed(order_id, next_seq)`.
pub const SEED: &str = "shardline_outbox_seed";
/// The `NOTIFY` channel the append signals on (at commit); the payload is
/// the schema's name.
pub const CHANNEL: &str = "shardline_outbox";
/// The component name of the outbox's row in [`META`].
const COMPONENT: &str = "outbox";

/// An object of the outbox, in the order they are created.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Part {
    Schema,
    Table,
    Counter,
    Meta,
    Append,
    Seed,
}

impl Part {
    /// Every part, in creation order.
    pub const ALL: [Self; 6] = [
        Self::Schema,
        Self::Table,
        Self::Counter,
        Self::Meta,
        Self::Append,
        Self::Seed,
    ];

    /// How `to_regnamespace`, `to_regclass` or `to_regprocedure` finds the
    /// part in `schema` (the function's signature for a function).
    pub(crate) fn lookup(self, schema: &Schema) -> String {
        match self {
            Self::Schema => schema.quoted(),
            Self::Table => schema.qualify(TABLE),
            Self::Counter => schema.qualify(COUNTER),
            Self::Meta => schema.qualify(META),
            Self::Append => schema.qualify(&format!("{APPEND}(text, text, jsonb, text)")),
            Self::Seed => schema.qualify(&format!("{SEED}(text, bigint)")),
        }
    }

    /// The catalog function that finds it by [`Part::lookup`].
    pub(crate) fn finder(self) -> &'static str {
        match self {
            Self::Schema => "to_regnamespace",
            Self::Table | Self::Counter | Self::Meta => "to_regclass",
            Self::Append | Self::Seed => "to_regprocedure",
        }
    }

    /// The statements that create the part in `schema`, each idempotent.
    pub fn create(self, schema: &Schema) -> String {
        match self {
            Self::Schema => format!("CREATE SCHEMA IF NOT EXISTS {};\n", schema.quoted()),
            Self::Table => table(schema),
            Self::Counter => counter(schema),
            Self::Meta => meta(schema),
            Self::Append => append(schema),
            Self::Seed => seed(schema),
        }
    }
}

impl fmt::Display for Part {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Schema => f.write_str("schema"),
            Self::Table => write!(f, "table {TABLE}"),
            Self::Counter => write!(f, "table {COUNTER}"),
            Self::Meta => write!(f, "table {META}"),
            Self::Append => write!(f, "function {APPEND}"),
            Self::Seed => write!(f, "function {SEED}"),
        }
    }
}

/// The whole outbox for `schema` as one SQL script: every part's statements
/// and the version row, each idempotent (what [`crate::install`] runs,
/// without its lock and its report), for a reader or a migration tool.
pub fn sql(schema: &Schema) -> String {
    let mut script = format!(
        "-- shardline outbox, version {VERSION}, in schema {schema}\n\
         -- (`shardline outbox install` runs this in one transaction, under an advisory lock)\n\n"
    );
    for part in Part::ALL {
        script.push_str(&part.create(schema));
        script.push('\n');
    }
    script.push_str(&version_row(schema));
    script
}

/// Records [`VERSION`] in the meta table, unless a version is there.
pub(crate) fn version_row(schema: &Schema) -> String {
    format!(
        "INSERT INTO {meta} (component, version) VALUES ({component}, {VERSION})\n    \
         ON CONFLICT (component) DO NOTHING;\n",
        meta = schema.qualify(META),
        component = quote_literal(COMPONENT),
    )
}

/// Reads the installed version (`$1`-free; no row: none recorded).
pub(crate) fn version_query(schema: &Schema) -> String {
    format!(
        "SELECT version FROM {} WHERE component = {}",
        schema.qualify(META),
        quote_literal(COMPONENT)
    )
}

fn table(schema: &Schema) -> String {
    let table = schema.qualify(TABLE);
    // A queue table: rows are inserted, then deleted once published. Vacuum
    // it after every thousand dead rows, not after a fifth of the table, so
    // that the relay's `ORDER BY id` reads do not step over dead index
    // entries for long.
    format!(
        "CREATE TABLE IF NOT EXISTS {table} (
    id          bigserial PRIMARY KEY,
    event_id    uuid NOT NULL DEFAULT gen_random_uuid(),
    order_id    text NOT NULL CHECK (order_id <> ''),
    event       text NOT NULL CHECK (event <> ''),
    seq         bigint NOT NULL CHECK (seq >= 1),
    data        jsonb NOT NULL DEFAULT '{{}}',
    traceparent text NULL,
    written_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT {TABLE}_order_seq UNIQUE (order_id, seq)
) WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);
COMMENT ON TABLE {table} IS {comment};
",
        comment = quote_literal(&format!(
            "shardline transactional outbox, version {VERSION}: events not published yet, \
             written only through {APPEND}(); the relay publishes them in id order and \
             deletes them once the broker confirmed"
        )),
    )
}

fn counter(schema: &Schema) -> String {
    let counter = schema.qualify(COUNTER);
    format!(
        "CREATE TABLE IF NOT EXISTS {counter} (
    order_id text PRIMARY KEY,
    seq      bigint NOT NULL CHECK (seq >= 0)
);
COMMENT ON TABLE {counter} IS {comment};
",
        comment = quote_literal(
            "shardline outbox: the last seq given per order (the next append gets seq + 1); \
             keep every row for as long as the order may get events: a deleted row restarts \
             its order at seq 1"
        ),
    )
}

fn meta(schema: &Schema) -> String {
    let meta = schema.qualify(META);
    format!(
        "CREATE TABLE IF NOT EXISTS {meta} (
    component    text PRIMARY KEY,
    version      integer NOT NULL,
    installed_at timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE {meta} IS {comment};
",
        comment = quote_literal("shardline outbox: the version of the installed objects"),
    )
}

/// The checks the envelope makes of `order_id` and `event`
/// (`shardline_contract::OrderId`), raised at the append rather than as the
/// worker's dead letter (`invalid`) later: not empty, at most
/// [`MAX_FIELD_BYTES`] bytes, no control character (Unicode `Cc`, as Rust's
/// `char::is_control`; PostgreSQL text holds no NUL).
fn field_checks(function: &str, fields: &[&str]) -> String {
    let mut checks = String::new();
    for field in fields {
        let value = format!("{function}.{field}");
        checks.push_str(&format!(
            "    IF {value} IS NULL OR {value} = '' THEN
        RAISE EXCEPTION '{function}: {field} is empty'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF octet_length({value}) > {MAX_FIELD_BYTES} THEN
        RAISE EXCEPTION '{function}: {field} is % bytes, over the {MAX_FIELD_BYTES}-byte limit',
            octet_length({value})
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF {value} ~ E'[\\\\u0001-\\\\u001f\\\\u007f-\\\\u009f]' THEN
        RAISE EXCEPTION '{function}: {field} contains a control character'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
"
        ));
    }
    checks
}

fn append(schema: &Schema) -> String {
    let function = schema.qualify(APPEND);
    let checks = field_checks(APPEND, &["order_id", "event"]);
    format!(
        "CREATE OR REPLACE FUNCTION {function}(
    order_id text,
    event text,
    data jsonb,
    traceparent text DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql
AS $outbox$
#variable_conflict use_column
DECLARE
    given bigint;
BEGIN
{checks}    -- One statement: a new order's first append inserts seq 1; a concurrent
    -- first append waits for it, then takes the update path (no unique
    -- violation, nothing aborted). The row lock lasts until the caller's
    -- transaction ends: one order's writers commit in seq order.
    INSERT INTO {counter} AS c (order_id, seq)
        VALUES ({APPEND}.order_id, 1)
        ON CONFLICT (order_id) DO UPDATE SET seq = c.seq + 1
        RETURNING c.seq INTO given;
    INSERT INTO {table} (order_id, event, seq, data, traceparent)
        VALUES ({APPEND}.order_id, {APPEND}.event, given,
                coalesce({APPEND}.data, '{{}}'::jsonb), nullif({APPEND}.traceparent, ''));
    -- Delivered at commit, once per transaction: the relay's wake-up.
    PERFORM pg_catalog.pg_notify({channel}, {payload});
    RETURN given;
END
$outbox$;
COMMENT ON FUNCTION {function}(text, text, jsonb, text) IS {comment};
",
        counter = schema.qualify(COUNTER),
        table = schema.qualify(TABLE),
        channel = quote_literal(CHANNEL),
        payload = schema.literal(),
        comment = quote_literal(
            "shardline outbox: appends an event of the order in the caller's transaction \
             and returns its seq (1, 2, ... per order, no gaps); a transaction that appends \
             for several orders does so in order_id order"
        ),
    )
}

fn seed(schema: &Schema) -> String {
    let function = schema.qualify(SEED);
    let checks = field_checks(SEED, &["order_id"]);
    format!(
        "CREATE OR REPLACE FUNCTION {function}(
    order_id text,
    next_seq bigint
) RETURNS bigint
LANGUAGE plpgsql
AS $outbox$
#variable_conflict use_column
DECLARE
    last_given bigint;
BEGIN
{checks}    IF {SEED}.next_seq IS NULL OR {SEED}.next_seq < 1 THEN
        RAISE EXCEPTION '{SEED}: next_seq must be 1 or more, not %', {SEED}.next_seq
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Never backwards: a counter beyond the seq asked keeps its value, and
    -- the error below rolls the statement back.
    INSERT INTO {counter} AS c (order_id, seq)
        VALUES ({SEED}.order_id, {SEED}.next_seq - 1)
        ON CONFLICT (order_id) DO UPDATE SET seq = greatest(c.seq, excluded.seq)
        RETURNING c.seq INTO last_given;
    IF last_given > {SEED}.next_seq - 1 THEN
        RAISE EXCEPTION '{SEED}: order % has had seq % given already; its next seq is %, not %',
            {SEED}.order_id, last_given, last_given + 1, {SEED}.next_seq
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'a counter never moves back: the events it gave would be sent again as duplicates or late ones';
    END IF;
    RETURN {SEED}.next_seq;
END
$outbox$;
COMMENT ON FUNCTION {function}(text, bigint) IS {comment};
",
        counter = schema.qualify(COUNTER),
        comment = quote_literal(
            "shardline outbox: for an order with events published before the outbox, sets \
             its counter so that the next append returns next_seq; refuses to move it back"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::validate_schema;

    #[test]
    fn the_script_names_the_schema_quoted_everywhere() {
        let schema = validate_schema("user").unwrap();
        let script = sql(&schema);
        for object in [TABLE, COUNTER, META, APPEND, SEED] {
            assert!(
                script.contains(&format!("\"user\".{object}")),
                "{object}:\n{script}"
            );
        }
        assert!(script.contains("CREATE SCHEMA IF NOT EXISTS \"user\";"));
        assert!(script.contains("pg_notify('shardline_outbox', 'user')"));
        assert!(!script.contains(" user."), "an unquoted name:\n{script}");
    }

    #[test]
    fn every_part_is_created_idempotently() {
        let schema = Schema::default();
        for part in Part::ALL {
            let create = part.create(&schema);
            assert!(
                create.contains("IF NOT EXISTS") || create.contains("CREATE OR REPLACE"),
                "{part}: {create}"
            );
        }
        assert!(version_row(&schema).contains("ON CONFLICT (component) DO NOTHING"));
    }

    #[test]
    fn the_checks_are_the_envelopes() {
        let checks = field_checks(APPEND, &["order_id"]);
        assert!(checks.contains(&format!("octet_length({APPEND}.order_id) > 256")));
        // The SQL text holds `\\u0001` in an E'' literal: `\u0001` to the regex.
        assert!(
            checks.contains(r"E'[\\u0001-\\u001f\\u007f-\\u009f]'"),
            "{checks}"
        );
    }
}
