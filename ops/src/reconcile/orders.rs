//! The order database side of reconcile: the orders query's columns, its
//! rows as snapshots, and its URL and errors with the password blanked out.

use std::time::SystemTime;

use tokio_postgres::types::{FromSql, Type};

use crate::Error;

/// Where the three columns are in the query's rows, and how to read them.
pub(super) struct Columns {
    order_id: (usize, IdType),
    status: usize,
    updated_at: usize,
}

/// SQL types an `order_id` may have.
#[derive(Debug, Clone, Copy)]
enum IdType {
    Text,
    Int2,
    Int4,
    Int8,
}

/// One usable row of the orders query.
pub(super) struct Snapshot {
    pub order_id: String,
    pub status: String,
    pub updated_at: SystemTime,
}

fn query_error(message: String) -> Error {
    Error::target(&["orders_query"], message)
}

impl Columns {
    pub(super) fn of(statement: &tokio_postgres::Statement) -> Result<Self, Error> {
        let params = statement.params();
        if params.len() != 1 {
            return Err(query_error(format!(
                "orders_query must take exactly one parameter, $1 (the lower bound of updated_at); it takes {}",
                params.len()
            )));
        }
        let find = |name: &str| -> Result<(usize, &Type), Error> {
            statement
                .columns()
                .iter()
                .enumerate()
                .find(|(_, c)| c.name() == name)
                .map(|(i, c)| (i, c.type_()))
                .ok_or_else(|| {
                    query_error(format!("orders_query returns no column `{name}` (it must return order_id, status, updated_at)"))
                })
        };
        let (id_at, id_type) = find("order_id")?;
        let id_type = if <String as FromSql>::accepts(id_type) {
            IdType::Text
        } else if *id_type == Type::INT2 {
            IdType::Int2
        } else if *id_type == Type::INT4 {
            IdType::Int4
        } else if *id_type == Type::INT8 {
            IdType::Int8
        } else {
            return Err(query_error(format!(
                "orders_query: column order_id is of type {id_type}; select it as text (order_id::text)"
            )));
        };
        let (status, status_type) = find("status")?;
        if !<String as FromSql>::accepts(status_type) {
            return Err(query_error(format!(
                "orders_query: column status is of type {status_type}; select it as text (status::text)"
            )));
        }
        let (updated_at, updated_type) = find("updated_at")?;
        if !<SystemTime as FromSql>::accepts(updated_type) {
            return Err(query_error(format!(
                "orders_query: column updated_at is of type {updated_type}; it must be a timestamptz or timestamp"
            )));
        }
        Ok(Self {
            order_id: (id_at, id_type),
            status,
            updated_at,
        })
    }

    /// The row's snapshot; `None` when it has no order id or no `updated_at`.
    pub(super) fn read(
        &self,
        row: &tokio_postgres::Row,
    ) -> Result<Option<Snapshot>, tokio_postgres::Error> {
        let (at, ty) = self.order_id;
        let order_id = match ty {
            IdType::Text => row.try_get::<_, Option<String>>(at)?,
            IdType::Int2 => row.try_get::<_, Option<i16>>(at)?.map(|n| n.to_string()),
            IdType::Int4 => row.try_get::<_, Option<i32>>(at)?.map(|n| n.to_string()),
            IdType::Int8 => row.try_get::<_, Option<i64>>(at)?.map(|n| n.to_string()),
        };
        // A NULL status implies nothing, like any status without an expectation.
        let status = row
            .try_get::<_, Option<String>>(self.status)?
            .map(|s| s.trim_end().to_owned())
            .unwrap_or_default();
        let updated_at = row.try_get::<_, Option<SystemTime>>(self.updated_at)?;
        Ok(match (order_id, updated_at) {
            (Some(order_id), Some(updated_at)) if !order_id.is_empty() => Some(Snapshot {
                order_id,
                status,
                updated_at,
            }),
            _ => None,
        })
    }
}

/// `text` on one line.
pub(super) fn one_line(text: &str) -> String {
    text.split(['\n', '\r'])
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}
