//! The management HTTP API (`--management-url`), for what AMQP cannot show:
//! the policies in effect on the shard queues and the DLQ (a policy can set
//! a delivery limit, a length limit or a TTL that the queue's arguments do
//! not show), and the version when the server properties cannot be read.

use std::fmt;

use serde_json::{Map, Value};

/// How long one management request may take.
const TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// A management API base URL, `http(s)://user:password@host:port[/prefix]`.
#[derive(Clone, PartialEq, Eq)]
pub struct ManagementTarget {
    base: reqwest::Url,
    user: String,
    password: String,
}

/// The management API could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("management API {url}: {cause}")]
pub struct ManagementError {
    /// Password redacted.
    pub url: String,
    pub cause: String,
}

impl ManagementTarget {
    /// `text` as a management URL; the credentials go into basic auth.
    pub fn parse(text: &str) -> Result<Self, ManagementError> {
        let fail = |cause: &str| ManagementError {
            url: crate::redact(text),
            cause: cause.to_owned(),
        };
        let mut base = reqwest::Url::parse(text)
            .map_err(|e| fail(&format!("{e}; {}", crate::redact::PERCENT_ENCODE)))?;
        if !matches!(base.scheme(), "http" | "https") {
            return Err(fail("must start with http:// or https://"));
        }
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8_lossy()
                .into_owned()
        };
        let user = match base.username() {
            "" => "guest".to_owned(),
            u => decode(u),
        };
        let password = base.password().map_or_else(|| "guest".to_owned(), decode);
        base.set_username("")
            .and_then(|()| base.set_password(None))
            .map_err(|()| fail("cannot take the credentials out of the URL"))?;
        if !base.path().ends_with('/') {
            let path = format!("{}/", base.path());
            base.set_path(&path);
        }
        Ok(Self {
            base,
            user,
            password,
        })
    }

    fn error(&self, cause: impl fmt::Display) -> ManagementError {
        ManagementError {
            url: self.to_string(),
            cause: cause.to_string().replace(&self.password, "***"),
        }
    }

    async fn get(&self, client: &reqwest::Client, path: &str) -> Result<Value, ManagementError> {
        let url = self.base.join(path).map_err(|e| self.error(e))?;
        let response = client
            .get(url)
            .basic_auth(&self.user, Some(&self.password))
            .timeout(TIMEOUT)
            .send()
            .await
            .map_err(|e| self.error(e))?;
        let status = response.status();
        let body = response.bytes().await.map_err(|e| self.error(e))?;
        if !status.is_success() {
            let text = String::from_utf8_lossy(&body);
            return Err(self.error(format!("GET {path}: HTTP {status}: {}", text.trim())));
        }
        serde_json::from_slice(&body).map_err(|e| self.error(format!("GET {path}: {e}")))
    }

    /// The broker's overview and the queues named `queues` of `vhost`, with
    /// their arguments and the policy in effect.
    pub async fn read(
        &self,
        vhost: &str,
        queues: &[String],
    ) -> Result<ManagementFacts, ManagementError> {
        let client = reqwest::Client::new();
        let overview = self.get(&client, "api/overview").await?;
        let text = |v: &Value, key: &str| v.get(key).and_then(Value::as_str).map(str::to_owned);
        let version_text = text(&overview, "rabbitmq_version").unwrap_or_default();
        let vhost_path: String =
            percent_encoding::utf8_percent_encode(vhost, percent_encoding::NON_ALPHANUMERIC)
                .collect();
        let listed = self
            .get(
                &client,
                &format!(
                    "api/queues/{vhost_path}?disable_stats=true&columns=name,type,arguments,policy,operator_policy,effective_policy_definition"
                ),
            )
            .await?;
        // 3.10 lists a queue's policy by name only (no
        // `effective_policy_definition`): the definitions come from the
        // vhost's policies and operator policies.
        let policies = self
            .get(&client, &format!("api/policies/{vhost_path}"))
            .await?;
        let operator_policies = self
            .get(&client, &format!("api/operator-policies/{vhost_path}"))
            .await?;
        let definition = |list: &Value, name: Option<&str>| -> Map<String, Value> {
            let Some(name) = name else {
                return Map::new();
            };
            list.as_array()
                .map(Vec::as_slice)
                .unwrap_or_default()
                .iter()
                .find(|p| p.get("name").and_then(Value::as_str) == Some(name))
                .and_then(|p| p.get("definition"))
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default()
        };
        let object = |v: Option<&Value>| v.and_then(Value::as_object).cloned().unwrap_or_default();
        let found = listed
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default()
            .iter()
            .filter_map(|q| {
                let name = text(q, "name")?;
                let policy = text(q, "policy");
                let operator = text(q, "operator_policy");
                let effective = match q.get("effective_policy_definition") {
                    Some(Value::Object(e)) if !e.is_empty() => e.clone(),
                    _ => merge(
                        definition(&policies, policy.as_deref()),
                        &definition(&operator_policies, operator.as_deref()),
                    ),
                };
                queues.contains(&name).then(|| QueueFacts {
                    kind: text(q, "type").unwrap_or_default(),
                    arguments: object(q.get("arguments")),
                    policy: match (policy, operator) {
                        (Some(p), Some(o)) => Some(format!("{p}, operator policy {o}")),
                        (None, Some(o)) => Some(format!("operator policy {o}")),
                        (p, None) => p,
                    },
                    effective,
                    name,
                })
            })
            .collect();
        Ok(ManagementFacts {
            address: self.to_string(),
            version: shardline_contract::rabbitmq::Version::parse(&version_text),
            version_text,
            cluster_name: text(&overview, "cluster_name"),
            queues: found,
        })
    }
}

/// A policy's definition with an operator policy's over it: where both set
/// a number, the lower applies (as RabbitMQ combines them).
fn merge(mut policy: Map<String, Value>, operator: &Map<String, Value>) -> Map<String, Value> {
    for (key, value) in operator {
        let lower = match (policy.get(key).and_then(Value::as_i64), value.as_i64()) {
            (Some(p), Some(o)) => Value::from(p.min(o)),
            _ => value.clone(),
        };
        policy.insert(key.clone(), lower);
    }
    policy
}

/// The URL with its password redacted.
impl fmt::Display for ManagementTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut shown = self.base.clone();
        let _ = shown.set_username(&self.user);
        let _ = shown.set_password(Some("***"));
        f.write_str(shown.as_str())
    }
}

impl fmt::Debug for ManagementTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ManagementTarget({self})")
    }
}

impl std::str::FromStr for ManagementTarget {
    type Err = ManagementError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// What the management API showed.
#[derive(Debug, Clone, PartialEq)]
pub struct ManagementFacts {
    /// The API's URL, password redacted.
    pub address: String,
    pub version_text: String,
    pub version: Option<shardline_contract::rabbitmq::Version>,
    pub cluster_name: Option<String>,
    /// The queues asked for that exist.
    pub queues: Vec<QueueFacts>,
}

/// One queue as the management API shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueFacts {
    pub name: String,
    /// `classic`, `quorum`, `stream`.
    pub kind: String,
    pub arguments: Map<String, Value>,
    /// The policy applied, when one is.
    pub policy: Option<String>,
    /// The policy's definition as it applies to the queue.
    pub effective: Map<String, Value>,
}

impl QueueFacts {
    /// A number the policy sets (`delivery-limit`, `max-length`, …).
    pub fn policy_number(&self, key: &str) -> Option<i64> {
        self.effective.get(key).and_then(Value::as_i64)
    }

    /// The overflow behaviour in effect: the argument's (it wins over a
    /// policy's), else the policy's, else `drop-head` (RabbitMQ's default).
    pub fn overflow(&self) -> &str {
        self.arguments
            .get("x-overflow")
            .or_else(|| self.effective.get("overflow"))
            .and_then(Value::as_str)
            .unwrap_or("drop-head")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn credentials_go_to_basic_auth_and_never_print() {
        let t = ManagementTarget::parse("http://ops:s%40cret@127.0.0.1:15672").unwrap();
        assert_eq!(t.user, "ops");
        assert_eq!(t.password, "s@cret");
        assert_eq!(t.base.as_str(), "http://127.0.0.1:15672/");
        assert_eq!(t.to_string(), "http://ops:***@127.0.0.1:15672/");
        assert!(!format!("{t:?}").contains("cret"));
        let plain = ManagementTarget::parse("https://mq.example/rabbit").unwrap();
        assert_eq!(
            (plain.user.as_str(), plain.base.as_str()),
            ("guest", "https://mq.example/rabbit/")
        );
        let err = ManagementTarget::parse("amqp://guest:pw@h:5672").unwrap_err();
        assert!(err.to_string().contains("http://"), "{err}");
        assert!(!err.to_string().contains("pw"), "{err}");
    }

    #[test]
    fn an_operator_policy_lowers_a_policys_numbers() {
        let policy = json!({"delivery-limit": 20, "overflow": "drop-head"});
        let operator = json!({"delivery-limit": 5, "max-length": 100});
        let merged = merge(
            policy.as_object().cloned().unwrap(),
            operator.as_object().unwrap(),
        );
        assert_eq!(
            Value::Object(merged),
            json!({"delivery-limit": 5, "overflow": "drop-head", "max-length": 100})
        );
    }

    #[test]
    fn overflow_is_the_arguments_then_the_policys_then_drop_head() {
        let facts = |effective: Value, arguments: Value| QueueFacts {
            name: "q".into(),
            kind: "quorum".into(),
            arguments: arguments.as_object().cloned().unwrap(),
            policy: None,
            effective: effective.as_object().cloned().unwrap(),
        };
        assert_eq!(facts(json!({}), json!({})).overflow(), "drop-head");
        assert_eq!(
            facts(json!({}), json!({"x-overflow": "reject-publish"})).overflow(),
            "reject-publish"
        );
        let both = facts(
            json!({"overflow": "drop-head", "max-length": 10}),
            json!({"x-overflow": "reject-publish"}),
        );
        assert_eq!(both.overflow(), "reject-publish");
        assert_eq!(
            facts(json!({"overflow": "reject-publish-dlx"}), json!({})).overflow(),
            "reject-publish-dlx"
        );
        assert_eq!(both.policy_number("max-length"), Some(10));
    }
}
