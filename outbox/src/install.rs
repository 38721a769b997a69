//! [`install`]: the outbox's objects created in a schema, in one transaction
//! under an advisory lock, so that running it twice, or twice at once,
//! creates each object once; [`Installed`] says what it created and what was
//! there.

use std::fmt;

use tokio_postgres::{Client, Transaction};

use crate::error::{OutboxError, describe};
use crate::schema::{Schema, validate_schema};
use crate::sql::{self, Part, VERSION};

/// The oldest server the outbox runs on (`gen_random_uuid()` is built in
/// from 13), as `server_version_num`.
const MIN_SERVER_VERSION: i32 = 130_000;

/// What [`install`] found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Installed {
    pub schema: Schema,
    /// The version now recorded in the schema.
    pub version: i32,
    /// The parts this run created, in creation order.
    pub created: Vec<Part>,
    /// The parts that were there already.
    pub present: Vec<Part>,
}

impl Installed {
    /// Whether every part was there already: the run changed nothing.
    pub fn already_installed(&self) -> bool {
        self.created.is_empty()
    }
}

/// One line: `outbox installed in schema "public" (table shardline_outbox,
/// functions shardline_outbox_append, shardline_outbox_seed)`, or `outbox
/// already installed …`, or what a partial install added.
impl fmt::Display for Installed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = format!(
            "table {}, functions {}, {}",
            sql::TABLE,
            sql::APPEND,
            sql::SEED
        );
        let schema = &self.schema;
        if self.already_installed() {
            return write!(f, "outbox already installed in schema {schema} ({what})");
        }
        if self.present.iter().all(|part| *part == Part::Schema) {
            return write!(f, "outbox installed in schema {schema} ({what})");
        }
        let created: Vec<String> = self.created.iter().map(Part::to_string).collect();
        write!(
            f,
            "outbox completed in schema {schema} ({what}): created {}",
            created.join(", ")
        )
    }
}

/// Creates the outbox in `schema` (`public` unless the application keeps
/// it elsewhere): the schema if missing, the tables, the functions, and the
/// version row, each only if missing.
///
/// One transaction holding a transaction-level advisory lock of its own per
/// schema: a second install at the same moment waits for the first to
/// commit, then finds everything there. A schema holding a newer outbox is
/// left untouched ([`OutboxError::Newer`]).
pub async fn install(client: &mut Client, schema: &str) -> Result<Installed, OutboxError> {
    let schema = validate_schema(schema)?;
    let db = |what| failed(what, &schema);
    let server: String = client
        .query_one("SELECT current_setting('server_version_num')", &[])
        .await
        .map_err(db("reading the server's version"))?
        .get(0);
    if server.parse::<i32>().is_ok_and(|v| v < MIN_SERVER_VERSION) {
        return Err(OutboxError::Unsupported { found: server });
    }
    let tx = client
        .transaction()
        .await
        .map_err(db("starting a transaction"))?;
    let (created, present) = match install_in(&tx, &schema).await {
        Ok(parts) => parts,
        Err(e) => {
            // At once, not when the connection next runs: the locks taken
            // would otherwise outlive the error.
            if let Err(r) = tx.rollback().await {
                tracing::debug!(error = %r, "rolling the install back");
            }
            return Err(e);
        }
    };
    tx.commit().await.map_err(db("committing"))?;
    tracing::debug!(%schema, ?created, "outbox installed");
    Ok(Installed {
        schema,
        version: VERSION,
        created,
        present,
    })
}

/// In `tx`: the install lock, the missing parts, the version row; returns
/// the parts created and those found.
async fn install_in(
    tx: &Transaction<'_>,
    schema: &Schema,
) -> Result<(Vec<Part>, Vec<Part>), OutboxError> {
    let db = |what| failed(what, schema);
    tx.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
        &[&format!("shardline outbox install {}", schema.as_str())],
    )
    .await
    .map_err(db("taking the install lock"))?;
    let parts = create_missing(tx, schema).await?;
    tx.batch_execute(&sql::version_row(schema))
        .await
        .map_err(db("recording the version"))?;
    Ok(parts)
}

/// Creates each part `tx` does not find, after checking that the schema
/// holds no newer version; returns the parts created and those found.
async fn create_missing(
    tx: &Transaction<'_>,
    schema: &Schema,
) -> Result<(Vec<Part>, Vec<Part>), OutboxError> {
    let db = |what| failed(what, schema);
    let mut created = Vec::new();
    let mut present = Vec::new();
    for part in Part::ALL {
        let found: bool = tx
            .query_one(
                &format!("SELECT {}($1) IS NOT NULL", part.finder()),
                &[&part.lookup(schema)],
            )
            .await
            .map_err(db("looking for the outbox's objects"))?
            .get(0);
        if found && part == Part::Meta {
            let installed = tx
                .query_opt(&sql::version_query(schema), &[])
                .await
                .map_err(db("reading the installed version"))?;
            if let Some(found) = installed.map(|row| row.get::<_, i32>(0))
                && found > VERSION
            {
                return Err(OutboxError::Newer {
                    schema: schema.to_string(),
                    found,
                    supported: VERSION,
                });
            }
        }
        if found {
            present.push(part);
        } else {
            tx.batch_execute(&part.create(schema))
                .await
                .map_err(db("creating the outbox"))?;
            created.push(part);
        }
    }
    Ok((created, present))
}

/// A statement's error as [`OutboxError::Database`]: `what` failed in `schema`.
fn failed(
    what: &'static str,
    schema: &Schema,
) -> impl FnOnce(tokio_postgres::Error) -> OutboxError {
    let schema = schema.to_string();
    move |e| OutboxError::Database {
        what,
        schema,
        cause: describe(&e),
    }
}
