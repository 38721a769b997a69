//! Connecting to RabbitMQ. Every error names the URL with its password redacted.

use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::LongString;
use lapin::{Connection, ConnectionProperties, ErrorKind};

#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error("cannot connect to RabbitMQ at {url} (TCP connect, then AMQP handshake): {cause}")]
    Connect { url: String, cause: String },
}

/// Opens a connection named `name` (shown as `connection_name` by `rabbitmqctl
/// list_connections` and the management UI). `amqps://` URLs use TLS.
pub async fn connect(url: &str, name: &str) -> Result<Connection, BrokerError> {
    let props = ConnectionProperties::default()
        .with_connection_name(LongString::from(name.as_bytes().to_vec()));
    Connection::connect(url, props)
        .await
        .map_err(|e| BrokerError::Connect {
            url: redact_url(url),
            cause: scrub(&e.to_string(), url),
        })
}

/// `url` with its password replaced by `***`.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let Some((userinfo, host)) = authority.rsplit_once('@') else {
        return url.to_owned();
    };
    match userinfo.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***@{host}{tail}"),
        None => url.to_owned(),
    }
}

/// `text` with any password of `url` blanked out, in case a library echoed it.
pub fn scrub(text: &str, url: &str) -> String {
    let password = url
        .split_once("://")
        .and_then(|(_, rest)| rest.split(['/', '?', '#']).next())
        .and_then(|authority| authority.rsplit_once('@'))
        .and_then(|(userinfo, _)| userinfo.split_once(':'))
        .map(|(_, password)| password)
        .filter(|p| !p.is_empty());
    match password {
        Some(p) => text.replace(p, "***"),
        None => text.to_owned(),
    }
}

/// The broker's reply text when `error` is a channel or connection error of `kind`.
pub fn soft_error(error: &lapin::Error, kind: AMQPSoftError) -> Option<String> {
    match error.kind() {
        ErrorKind::ProtocolError(e) if *e.kind() == AMQPErrorKind::Soft(kind) => {
            Some(e.get_message().to_string())
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords_only() {
        assert_eq!(
            redact_url("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            redact_url("rediss://:s3cr@t@redis.example:6380/0"),
            "rediss://:***@redis.example:6380/0"
        );
        assert_eq!(redact_url("amqp://127.0.0.1:5672"), "amqp://127.0.0.1:5672");
        assert_eq!(redact_url("amqp://user@host/vh"), "amqp://user@host/vh");
        assert_eq!(redact_url("not a url"), "not a url");
    }

    #[test]
    fn scrubs_an_echoed_password() {
        assert_eq!(
            scrub("auth failed for hunter2", "amqp://u:hunter2@h/"),
            "auth failed for ***"
        );
        assert_eq!(scrub("fine", "amqp://h/"), "fine");
    }
}
