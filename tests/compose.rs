#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The container files agree with the binary and with each other.
//!
//! `docker-compose.yml`, `Dockerfile` and `.dockerignore` are parsed (no Docker engine
//! needed); every command they give shardline is then run through the real CLI with
//! `--help` appended, which parses each flag and value and connects to nothing.

#[path = "support/manifests.rs"]
mod manifests;

use std::collections::{BTreeMap, BTreeSet};

use manifests::{ENTRYPOINT, SUBCOMMANDS, cli_accepts, flag_value, read, repo_file, setting};
use serde::Deserialize;
use serde_yaml::Value;

/// The binary's default shard count (`--shards` / `SHARDLINE_SHARDS`).
const DEFAULT_SHARDS: u32 = 16;

// ---------------------------------------------------------------- docker-compose.yml

#[derive(Debug, Deserialize)]
struct Compose {
    services: BTreeMap<String, Service>,
}

#[derive(Debug, Deserialize)]
struct Service {
    image: Option<String>,
    build: Option<Build>,
    entrypoint: Option<Words>,
    command: Option<Words>,
    environment: Option<Value>,
    depends_on: Option<Value>,
    healthcheck: Option<Healthcheck>,
    volumes: Option<Vec<String>>,
    ports: Option<Vec<Value>>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Build {
    Context(String),
    Full { context: String },
}

/// Compose accepts a command as a list or as one string.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum Words {
    List(Vec<String>),
    Line(String),
}

impl Words {
    fn to_vec(&self) -> Vec<String> {
        match self {
            Words::List(words) => words.clone(),
            Words::Line(line) => line.split_whitespace().map(str::to_owned).collect(),
        }
    }
}

#[derive(Debug, Deserialize)]
struct Healthcheck {
    test: Words,
}

impl Service {
    fn is_shardline(&self) -> bool {
        self.build.is_some() || self.image.as_deref() == Some("shardline:local")
    }

    fn command(&self) -> Vec<String> {
        self.command.as_ref().map(Words::to_vec).unwrap_or_default()
    }

    /// `environment:` as a map or as a list of `KEY=VALUE`.
    fn env(&self) -> BTreeMap<String, String> {
        let scalar = |v: &Value| match v {
            Value::String(s) => s.clone(),
            Value::Number(n) => n.to_string(),
            Value::Bool(b) => b.to_string(),
            Value::Null => String::new(),
            other => panic!("environment value {other:?} is not a scalar"),
        };
        match &self.environment {
            None => BTreeMap::new(),
            Some(Value::Mapping(map)) => map.iter().map(|(k, v)| (scalar(k), scalar(v))).collect(),
            Some(Value::Sequence(items)) => items
                .iter()
                .map(|item| {
                    let item = scalar(item);
                    let (k, v) = item.split_once('=').unwrap_or((&item, ""));
                    (k.to_owned(), v.to_owned())
                })
                .collect(),
            Some(other) => panic!("environment {other:?} is neither a map nor a list"),
        }
    }

    /// `depends_on:` as service → condition (the list form means `service_started`).
    fn depends_on(&self) -> BTreeMap<String, String> {
        match &self.depends_on {
            None => BTreeMap::new(),
            Some(Value::Sequence(names)) => names
                .iter()
                .map(|n| (n.as_str().unwrap().to_owned(), "service_started".to_owned()))
                .collect(),
            Some(Value::Mapping(map)) => map
                .iter()
                .map(|(k, v)| {
                    let condition = v
                        .get("condition")
                        .and_then(Value::as_str)
                        .unwrap_or("service_started");
                    (k.as_str().unwrap().to_owned(), condition.to_owned())
                })
                .collect(),
            Some(other) => panic!("depends_on {other:?} is neither a map nor a list"),
        }
    }

    fn shards(&self) -> u32 {
        setting(&self.command(), &self.env(), "--shards")
            .map_or(DEFAULT_SHARDS, |n| n.parse().expect("shard count"))
    }
}

fn compose() -> Compose {
    let mut value: Value = serde_yaml::from_str(&read("docker-compose.yml")).unwrap();
    // Compose resolves YAML merge keys (`<<: *anchor`); serde_yaml does so on request,
    // at every depth: a service's `environment: { <<: *env, ... }` is merged here too.
    value.apply_merge().unwrap();
    assert!(
        value.get("version").is_none(),
        "the compose spec has no `version:` key"
    );
    serde_yaml::from_value(value).unwrap()
}

fn service<'a>(compose: &'a Compose, name: &str) -> &'a Service {
    compose
        .services
        .get(name)
        .unwrap_or_else(|| panic!("docker-compose.yml has no service `{name}`"))
}

#[test]
fn compose_has_the_fleet() {
    let compose = compose();
    for name in [
        "rabbitmq",
        "redis",
        "topology",
        "worker-a",
        "worker-b",
        "publisher",
        "prometheus",
        "grafana",
    ] {
        service(&compose, name);
    }
}

#[test]
fn workers_join_the_elastic_fleet_with_distinct_member_ids() {
    let compose = compose();
    let shards = service(&compose, "topology").shards();
    for (name, s) in compose.services.iter().filter(|(_, s)| s.is_shardline()) {
        assert_eq!(s.shards(), shards, "{name} must agree on the shard count");
    }
    let workers = worker_services(&compose);
    assert!(workers.len() >= 2, "a fleet of one: {workers:?}");
    let mut members = BTreeMap::new();
    for (name, worker) in workers {
        let (command, env) = (worker.command(), worker.env());
        assert_eq!(
            setting(&command, &env, "--assign").as_deref(),
            Some("auto"),
            "{name}: {command:?}"
        );
        // Restarting keeps the id, so the member keeps its lease and its shards.
        let member = setting(&command, &env, "--member-id")
            .filter(|id| !id.trim().is_empty())
            .unwrap_or_else(|| panic!("{name} has no --member-id: {command:?}"));
        if let Some(other) = members.insert(member.clone(), name) {
            panic!("{other} and {name} are one member, {member}");
        }
    }
}

#[test]
fn shardline_services_run_a_real_subcommand_of_one_image() {
    let compose = compose();
    let shardline: Vec<_> = compose
        .services
        .iter()
        .filter(|(_, s)| s.is_shardline())
        .collect();
    assert!(shardline.len() >= 4, "{:?}", compose.services.keys());
    for (name, s) in shardline {
        match &s.build {
            Some(Build::Context(c) | Build::Full { context: c }) => {
                assert!(c == "." || c == "./", "{name}: build context {c}");
            }
            None => panic!("{name}: no `build: .`"),
        }
        assert_eq!(s.image.as_deref(), Some("shardline:local"), "{name}");
        assert!(
            s.entrypoint.is_none(),
            "{name}: keep the image's entrypoint, so that `command` is the subcommand"
        );
        let command = s.command();
        let first = command.first().map(String::as_str).unwrap_or("");
        assert!(
            SUBCOMMANDS.contains(&first),
            "{name}: command {command:?} does not start with one of {SUBCOMMANDS:?}"
        );
        let env = s.env();
        assert_eq!(
            env.get("SHARDLINE_AMQP_URL").map(String::as_str),
            Some("amqp://guest:guest@rabbitmq:5672/%2f"),
            "{name}"
        );
        assert_eq!(
            env.get("SHARDLINE_REDIS_URL").map(String::as_str),
            Some("redis://redis:6379"),
            "{name}"
        );
        assert_eq!(
            env.get("SHARDLINE_LOG_FORMAT").map(String::as_str),
            Some("json"),
            "{name}: one JSON object per log line, for a log collector"
        );
    }
    assert_eq!(
        service(&compose, "topology").command(),
        ["topology", "apply"]
    );
    assert_eq!(
        service(&compose, "publisher")
            .command()
            .first()
            .map(String::as_str),
        Some("load")
    );
}

#[test]
fn services_start_in_order() {
    let compose = compose();
    let topology = service(&compose, "topology").depends_on();
    assert_eq!(
        topology.get("rabbitmq").map(String::as_str),
        Some("service_healthy")
    );
    for name in ["worker-a", "worker-b", "publisher"] {
        let deps = service(&compose, name).depends_on();
        assert_eq!(
            deps.get("topology").map(String::as_str),
            Some("service_completed_successfully"),
            "{name}: {deps:?}"
        );
        assert_eq!(
            deps.get("rabbitmq").map(String::as_str),
            Some("service_healthy"),
            "{name}: {deps:?}"
        );
    }
    for (name, worker) in worker_services(&compose) {
        let deps = worker.depends_on();
        assert_eq!(
            deps.get("redis").map(String::as_str),
            Some("service_healthy"),
            "{name}: {deps:?}"
        );
    }
}

#[test]
fn broker_and_redis_are_health_checked_and_redis_never_evicts() {
    let compose = compose();
    let rabbitmq = service(&compose, "rabbitmq");
    assert!(
        rabbitmq
            .image
            .as_deref()
            .unwrap()
            .starts_with("rabbitmq:3.10-management")
    );
    let test = rabbitmq.healthcheck.as_ref().unwrap().test.to_vec();
    assert!(
        test.iter().any(|w| w == "rabbitmq-diagnostics") && test.iter().any(|w| w == "ping"),
        "{test:?}"
    );

    let redis = service(&compose, "redis");
    assert!(redis.image.as_deref().unwrap().starts_with("redis:7"));
    let test = redis.healthcheck.as_ref().unwrap().test.to_vec();
    assert!(
        test.iter().any(|w| w == "redis-cli") && test.iter().any(|w| w == "ping"),
        "{test:?}"
    );
    assert_eq!(
        flag_value(&redis.command(), "--maxmemory-policy").as_deref(),
        Some("noeviction"),
        "dedup keys must not be evicted"
    );
}

// ---------------------------------------------------------------- observability

/// Worker services: those whose command is `worker`.
fn worker_services(compose: &Compose) -> Vec<(&String, &Service)> {
    compose
        .services
        .iter()
        .filter(|(_, s)| {
            s.is_shardline() && s.command().first().map(String::as_str) == Some("worker")
        })
        .collect()
}

/// The host file mounted at `target` (`./host:target[:ro]`), relative to the repo.
fn mounted(service: &Service, target: &str) -> Option<String> {
    service.volumes.iter().flatten().find_map(|v| {
        let mut parts = v.split(':');
        let (host, inside) = (parts.next()?, parts.next()?);
        (inside == target).then(|| host.trim_start_matches("./").to_owned())
    })
}

#[test]
fn every_worker_serves_metrics_and_prometheus_scrapes_each() {
    let compose = compose();
    let prometheus = service(&compose, "prometheus");
    assert!(
        prometheus
            .image
            .as_deref()
            .is_some_and(|i| i.starts_with("prom/prometheus")),
        "{:?}",
        prometheus.image
    );
    let config_file = mounted(prometheus, "/etc/prometheus/prometheus.yml")
        .expect("prometheus mounts its config at /etc/prometheus/prometheus.yml");
    let config: Value = serde_yaml::from_str(&read(&config_file)).unwrap();
    let targets: BTreeSet<String> = config["scrape_configs"]
        .as_sequence()
        .expect("scrape_configs")
        .iter()
        .filter(|job| {
            job.get("metrics_path")
                .and_then(Value::as_str)
                .is_none_or(|p| p == "/metrics")
        })
        .flat_map(|job| {
            job["static_configs"]
                .as_sequence()
                .cloned()
                .unwrap_or_default()
        })
        .flat_map(|sc| sc["targets"].as_sequence().cloned().unwrap_or_default())
        .filter_map(|t| t.as_str().map(str::to_owned))
        .collect();
    let workers = worker_services(&compose);
    assert!(workers.len() >= 2, "{workers:?}");
    for (name, worker) in workers {
        let addr = flag_value(&worker.command(), "--metrics-addr")
            .unwrap_or_else(|| panic!("{name} has no --metrics-addr: {:?}", worker.command()));
        let addr: std::net::SocketAddr = addr
            .parse()
            .unwrap_or_else(|e| panic!("{name}: {addr}: {e}"));
        assert!(
            addr.ip().is_unspecified(),
            "{name} must listen on 0.0.0.0 to be scraped: {addr}"
        );
        let target = format!("{name}:{}", addr.port());
        assert!(
            targets.contains(&target),
            "prometheus does not scrape {target}: {targets:?}"
        );
        let deps = prometheus.depends_on();
        assert!(
            deps.contains_key(name.as_str()),
            "prometheus should start after {name}: {deps:?}"
        );
    }
}

#[test]
fn grafana_loads_the_dashboard_from_prometheus() {
    let compose = compose();
    let grafana = service(&compose, "grafana");
    assert!(
        grafana
            .image
            .as_deref()
            .is_some_and(|i| i.starts_with("grafana/grafana"))
    );
    assert_eq!(
        grafana.depends_on().get("prometheus").map(String::as_str),
        Some("service_started")
    );
    let datasource = mounted(
        grafana,
        "/etc/grafana/provisioning/datasources/shardline.yml",
    )
    .expect("grafana provisions a data source");
    let datasource: Value = serde_yaml::from_str(&read(&datasource)).unwrap();
    assert_eq!(
        datasource["datasources"][0]["url"].as_str(),
        Some("http://prometheus:9090")
    );
    let provider = mounted(
        grafana,
        "/etc/grafana/provisioning/dashboards/shardline.yml",
    )
    .expect("grafana provisions dashboards");
    let provider: Value = serde_yaml::from_str(&read(&provider)).unwrap();
    let dir = provider["providers"][0]["options"]["path"]
        .as_str()
        .unwrap()
        .to_owned();
    let dashboard = mounted(grafana, &format!("{dir}/shardline.json"))
        .expect("the dashboard is mounted where the provider looks");
    assert_eq!(dashboard, "deploy/grafana/shardline.json");
}

#[test]
fn the_dashboard_charts_backlog_with_its_thresholds_and_only_real_metrics() {
    use shardline_worker::metrics::names;
    let dashboard: serde_json::Value =
        serde_json::from_str(&read("deploy/grafana/shardline.json")).unwrap();
    let panels = dashboard["panels"].as_array().unwrap();
    let exprs: Vec<&str> = panels
        .iter()
        .flat_map(|p| p["targets"].as_array().into_iter().flatten())
        .filter_map(|t| t["expr"].as_str())
        .collect();
    let known = [
        names::EVENTS,
        names::DEAD_LETTERS,
        names::PROCESSING_SECONDS,
        names::HANDLER_ATTEMPTS,
        names::REDIS_OUTAGES,
        names::BROKER_RECONNECTS,
        names::SEQ_GAPS,
        names::BACKLOG_AGE_SECONDS,
        names::BACKLOG_LEVEL,
        names::QUEUE_DEPTH,
        names::DLQ_DEPTH,
        names::HELD_EVENTS,
        names::SHARD_ACTIVE,
        names::INFLIGHT_SECONDS,
        names::STUCK,
    ];
    let counters = [
        names::EVENTS,
        names::DEAD_LETTERS,
        names::HANDLER_ATTEMPTS,
        names::REDIS_OUTAGES,
        names::BROKER_RECONNECTS,
        names::SEQ_GAPS,
    ];
    for expr in &exprs {
        for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if !word.starts_with("shardline_") {
                continue;
            }
            let ok = known.contains(&word)
                || counters.iter().any(|c| word == format!("{c}_total"))
                || ["_bucket", "_sum", "_count"]
                    .iter()
                    .any(|suffix| word == format!("{}{suffix}", names::PROCESSING_SECONDS));
            assert!(ok, "dashboard queries unknown metric {word} in `{expr}`");
        }
    }
    let backlog = panels
        .iter()
        .find(|p| {
            p["targets"].as_array().into_iter().flatten().any(|t| {
                t["expr"]
                    .as_str()
                    .is_some_and(|e| e.contains(names::BACKLOG_AGE_SECONDS))
            })
        })
        .expect("a panel charts the backlog age");
    let steps: Vec<f64> = backlog["fieldConfig"]["defaults"]["thresholds"]["steps"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["value"].as_f64())
        .collect();
    assert_eq!(steps, [30.0, 120.0], "WARN and PAGE lines");
    assert_eq!(
        backlog["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"],
        "line"
    );
    for wanted in [
        "shardline_events_total",
        "shardline_dead_letters_total",
        "outcome=\"retried\"",
    ] {
        assert!(
            exprs.iter().any(|e| e.contains(wanted)),
            "no panel uses {wanted}"
        );
    }
}

/// `ports:` as (host port, container port) pairs: the short form
/// `[IP:]HOST:CONTAINER[/PROTO]` (a bare `CONTAINER` publishes no fixed host port) or
/// the long form with `target` and `published`.
fn published_ports(service: &Service) -> Vec<(Option<u16>, u16)> {
    let port = |v: &Value| -> Option<u16> {
        match v {
            Value::Number(n) => n.as_u64().and_then(|n| u16::try_from(n).ok()),
            Value::String(s) => s.parse().ok(),
            _ => None,
        }
    };
    service
        .ports
        .iter()
        .flatten()
        .map(|entry| match entry {
            Value::Mapping(_) => {
                let target = entry.get("target").and_then(port);
                let published = entry.get("published").and_then(port);
                (
                    published,
                    target.unwrap_or_else(|| panic!("port {entry:?}")),
                )
            }
            Value::Number(_) => (None, port(entry).unwrap()),
            Value::String(s) => {
                let s = s.split('/').next().unwrap();
                let parts: Vec<&str> = s.rsplitn(3, ':').collect();
                let container = parts[0].parse().unwrap_or_else(|e| panic!("port {s}: {e}"));
                let host = parts
                    .get(1)
                    .map(|h| h.parse().unwrap_or_else(|e| panic!("port {s}: {e}")));
                (host, container)
            }
            other => panic!("port {other:?} is neither a string, a number nor a map"),
        })
        .collect()
}

#[test]
fn jaeger_receives_otlp_and_serves_its_ui() {
    let compose = compose();
    let jaeger = service(&compose, "jaeger");
    assert!(
        jaeger
            .image
            .as_deref()
            .is_some_and(|i| i.starts_with("jaegertracing/all-in-one")),
        "{:?}",
        jaeger.image
    );
    let ports = published_ports(jaeger);
    for wanted in [16686, 4318] {
        assert!(
            ports.contains(&(Some(wanted), wanted)),
            "jaeger must publish {wanted}:{wanted}: {ports:?}"
        );
    }
}

#[test]
fn publisher_and_workers_export_traces_to_jaeger() {
    let compose = compose();
    let name_of = |name: &str| {
        let env = service(&compose, name).env();
        assert_eq!(
            env.get("OTEL_EXPORTER_OTLP_ENDPOINT").map(String::as_str),
            Some("http://jaeger:4318"),
            "{name}: {env:?}"
        );
        let service_name = env
            .get("OTEL_SERVICE_NAME")
            .filter(|n| !n.trim().is_empty())
            .unwrap_or_else(|| panic!("{name} has no OTEL_SERVICE_NAME: {env:?}"));
        service_name.clone()
    };
    let publisher = name_of("publisher");
    for (worker, _) in worker_services(&compose) {
        let worker_name = name_of(worker);
        assert_ne!(
            publisher, worker_name,
            "publisher and {worker} must trace under different service names"
        );
    }
}

// ---------------------------------------------------------------- Dockerfile

#[derive(Debug)]
struct Stage {
    name: Option<String>,
    /// (instruction in upper case, its arguments), continuation lines joined.
    instructions: Vec<(String, String)>,
}

fn dockerfile() -> Vec<Stage> {
    let text = read("Dockerfile");
    let mut logical = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('#') || (current.is_empty() && trimmed.is_empty()) {
            continue;
        }
        match trimmed.strip_suffix('\\') {
            Some(head) => {
                current.push_str(head);
                current.push(' ');
            }
            None => {
                current.push_str(trimmed);
                logical.push(std::mem::take(&mut current));
            }
        }
    }
    assert!(current.is_empty(), "Dockerfile ends in a continuation");

    let mut stages: Vec<Stage> = Vec::new();
    for line in logical {
        let (instruction, args) = line.split_once(char::is_whitespace).unwrap_or((&line, ""));
        let instruction = instruction.to_ascii_uppercase();
        let args = args.trim().to_owned();
        if instruction == "FROM" {
            let words: Vec<&str> = args.split_whitespace().collect();
            let name = match words.as_slice() {
                [.., as_, name] if as_.eq_ignore_ascii_case("as") => Some((*name).to_owned()),
                _ => None,
            };
            stages.push(Stage {
                name,
                instructions: vec![(instruction, args)],
            });
        } else {
            stages
                .last_mut()
                .expect("an instruction before the first FROM")
                .instructions
                .push((instruction, args));
        }
    }
    stages
}

impl Stage {
    fn all(&self, instruction: &str) -> impl Iterator<Item = &str> {
        self.instructions
            .iter()
            .filter(move |(i, _)| i == instruction)
            .map(|(_, args)| args.as_str())
    }

    /// The last `ENTRYPOINT`/`CMD` of the stage, which must be in exec (JSON) form.
    fn exec_form(&self, instruction: &str) -> Vec<String> {
        let args = self
            .all(instruction)
            .last()
            .unwrap_or_else(|| panic!("the final stage has no {instruction}"));
        serde_json::from_str(args)
            .unwrap_or_else(|e| panic!("{instruction} {args} is not in exec form: {e}"))
    }
}

#[test]
fn dockerfile_builds_the_binary_and_runs_it_unprivileged() {
    let stages = dockerfile();
    assert!(stages.len() >= 2, "a multi-stage build");
    let runtime = stages.last().unwrap();

    assert_eq!(runtime.exec_form("ENTRYPOINT"), [ENTRYPOINT]);
    let cmd = runtime.exec_form("CMD");
    assert!(
        SUBCOMMANDS.contains(&cmd.first().map(String::as_str).unwrap_or("")),
        "{cmd:?}"
    );

    // The runtime stage copies the binary from a stage that builds package shardline.
    let copy = runtime
        .all("COPY")
        .find(|args| args.split_whitespace().last() == Some(ENTRYPOINT))
        .unwrap_or_else(|| panic!("the final stage copies nothing to {ENTRYPOINT}"));
    let from = copy
        .split_whitespace()
        .find_map(|w| w.strip_prefix("--from="))
        .expect("the binary comes from a build stage");
    let builder = stages
        .iter()
        .find(|s| s.name.as_deref() == Some(from))
        .unwrap_or_else(|| panic!("no stage named {from}"));
    let builds_shardline = builder.all("RUN").any(|run| {
        let words: Vec<&str> = run.split_whitespace().collect();
        let package = words
            .windows(2)
            .any(|w| (w[0] == "-p" || w[0] == "--package") && w[1] == "shardline")
            || words.contains(&"--package=shardline");
        run.contains("cargo build")
            && words.contains(&"--release")
            && words.contains(&"--locked")
            && package
    });
    assert!(
        builds_shardline,
        "stage {from} must run `cargo build --release --locked -p shardline`"
    );

    let user = runtime
        .all("USER")
        .last()
        .expect("the final stage sets a USER");
    let user = user.split(':').next().unwrap();
    assert!(user != "root" && user != "0", "USER {user} is root");
}

#[test]
fn dockerignore_keeps_build_output_and_git_out() {
    let text = read(".dockerignore");
    let patterns: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| l.trim_start_matches('/').trim_end_matches('/'))
        .collect();
    assert!(patterns.contains(&"target"), "{patterns:?}");
    assert!(patterns.contains(&".git"), "{patterns:?}");
}

// ---------------------------------------------------------------- against the real CLI

#[test]
fn the_cli_accepts_every_container_command() {
    let compose = compose();
    let mut failures = Vec::new();
    for (name, s) in compose.services.iter().filter(|(_, s)| s.is_shardline()) {
        if let Err(e) = cli_accepts(&s.command(), &s.env()) {
            failures.push(format!("{name}: {e}"));
        }
    }
    let cmd = dockerfile().last().unwrap().exec_form("CMD");
    if let Err(e) = cli_accepts(&cmd, &BTreeMap::new()) {
        failures.push(format!("Dockerfile CMD: {e}"));
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

// ---------------------------------------------------------------- scripts

#[cfg(unix)]
#[test]
fn entry_point_scripts_are_executable() {
    use std::os::unix::fs::PermissionsExt;
    for name in [
        ".ci/run",
        "scripts/test",
        "scripts/services",
        "scripts/demo",
    ] {
        let path = repo_file(name);
        let mode = std::fs::metadata(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .permissions()
            .mode();
        assert!(mode & 0o111 != 0, "{name} is not executable");
    }
}
