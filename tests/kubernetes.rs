#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The Kubernetes manifests (`deploy/kubernetes/`) agree with the binary and with
//! each other.
//!
//! Every manifest is parsed (no cluster needed). Each container's environment is
//! resolved as the kubelet would (ConfigMap and Secret keys from their manifests, the
//! pod name from a sample), its `$(VAR)` references expanded, and its command line run
//! through the real CLI with `--help` appended, which parses each flag and value and
//! connects to nothing.

#[path = "support/manifests.rs"]
mod manifests;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use manifests::{ENTRYPOINT, SUBCOMMANDS, cli_accepts, flag_value, read, repo_file, setting};
use serde::Deserialize;
use serde_yaml::Value;

const DIR: &str = "deploy/kubernetes";
const WORKER: &str = "shardline-worker";
/// What `metadata.name` stands for when a container's environment is resolved.
const SAMPLE_POD: &str = "shardline-worker-5d8f7c9b6-x2x9z";

/// apiVersion and kind of every resource the manifests may hold.
const KINDS: &[(&str, &str)] = &[
    ("apps/v1", "Deployment"),
    ("policy/v1", "PodDisruptionBudget"),
    ("v1", "Service"),
    ("v1", "ConfigMap"),
    ("v1", "Secret"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
];

/// Every document of every `*.yaml` and `*.yml` file under `deploy/kubernetes/`.
struct Manifests {
    /// (file name, document).
    docs: Vec<(String, Value)>,
}

fn manifests() -> Manifests {
    let mut files: Vec<String> = std::fs::read_dir(repo_file(DIR))
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".yaml") || name.ends_with(".yml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no manifests in {DIR}");
    let mut docs = Vec::new();
    for file in files {
        let text = read(&format!("{DIR}/{file}"));
        for document in serde_yaml::Deserializer::from_str(&text) {
            let mut doc = Value::deserialize(document).unwrap_or_else(|e| panic!("{file}: {e}"));
            if doc.is_null() {
                continue; // an empty document between `---` lines
            }
            doc.apply_merge().unwrap();
            docs.push((file.clone(), doc));
        }
    }
    Manifests { docs }
}

fn str_of<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

fn seq<'a>(v: &'a Value, key: &str) -> &'a [Value] {
    v.get(key)
        .and_then(Value::as_sequence)
        .map_or(&[], Vec::as_slice)
}

/// A string map such as `labels`, `matchLabels` or a ConfigMap's `data`.
fn string_map(v: Option<&Value>) -> BTreeMap<String, String> {
    let Some(map) = v.and_then(Value::as_mapping) else {
        return BTreeMap::new();
    };
    map.iter()
        .map(|(k, v)| {
            let value = match v {
                Value::String(s) => s.clone(),
                other => panic!("{k:?}: {other:?} is not a string (quote it)"),
            };
            (k.as_str().unwrap().to_owned(), value)
        })
        .collect()
}

/// `cpu`/`memory` quantities in their base unit (cores, bytes).
fn quantity(q: &Value) -> f64 {
    let text = match q {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        other => panic!("quantity {other:?}"),
    };
    let units: &[(&str, f64)] = &[
        ("Ki", 1024.0),
        ("Mi", 1024.0 * 1024.0),
        ("Gi", 1024.0 * 1024.0 * 1024.0),
        ("m", 0.001),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
    ];
    let (number, factor) = units
        .iter()
        .find_map(|(unit, factor)| text.strip_suffix(unit).map(|n| (n, *factor)))
        .unwrap_or((&text, 1.0));
    number
        .parse::<f64>()
        .unwrap_or_else(|e| panic!("quantity {text}: {e}"))
        * factor
}

/// A pod template and where it comes from.
struct Pod<'a> {
    owner: String,
    template: &'a Value,
}

impl Pod<'_> {
    fn spec(&self) -> &Value {
        &self.template["spec"]
    }

    fn labels(&self) -> BTreeMap<String, String> {
        string_map(self.template["metadata"].get("labels"))
    }

    /// Init containers first, as they run.
    fn containers(&self) -> impl Iterator<Item = &Value> {
        seq(self.spec(), "initContainers")
            .iter()
            .chain(seq(self.spec(), "containers"))
    }
}

impl Manifests {
    fn all(&self, kind: &str) -> impl Iterator<Item = &Value> {
        self.docs
            .iter()
            .map(|(_, doc)| doc)
            .filter(move |doc| str_of(doc, "kind") == Some(kind))
    }

    fn one(&self, kind: &str, name: &str) -> &Value {
        self.all(kind)
            .find(|doc| str_of(&doc["metadata"], "name") == Some(name))
            .unwrap_or_else(|| panic!("{DIR} has no {kind} `{name}`"))
    }

    fn worker(&self) -> Pod<'_> {
        Pod {
            owner: format!("Deployment {WORKER}"),
            template: &self.one("Deployment", WORKER)["spec"]["template"],
        }
    }

    /// The pod templates of every workload.
    fn pods(&self) -> Vec<Pod<'_>> {
        let mut pods = Vec::new();
        for (_, doc) in &self.docs {
            let kind = str_of(doc, "kind").unwrap_or_default();
            let template = match kind {
                "Deployment" | "StatefulSet" | "DaemonSet" | "Job" => &doc["spec"]["template"],
                "CronJob" => &doc["spec"]["jobTemplate"]["spec"]["template"],
                _ => continue,
            };
            let name = str_of(&doc["metadata"], "name").unwrap_or_default();
            pods.push(Pod {
                owner: format!("{kind} {name}"),
                template,
            });
        }
        pods
    }

    /// The keys of ConfigMap or Secret `name` and their values (`data`; a Secret's
    /// `stringData`).
    fn keys(&self, kind: &str, name: &str) -> Option<BTreeMap<String, String>> {
        let doc = self
            .all(kind)
            .find(|doc| str_of(&doc["metadata"], "name") == Some(name))?;
        let mut keys = string_map(doc.get("stringData"));
        if kind == "ConfigMap" {
            keys.extend(string_map(doc.get("data")));
        } else {
            assert!(
                doc.get("data").is_none(),
                "Secret {name}: write placeholders as stringData"
            );
        }
        Some(keys)
    }

    /// The value of a `configMapKeyRef`/`secretKeyRef` (None when it may be missing).
    fn key_ref(&self, kind: &str, reference: &Value) -> Result<Option<String>, String> {
        let name = str_of(reference, "name").unwrap_or_default();
        let key = str_of(reference, "key").unwrap_or_default();
        let optional = reference.get("optional").and_then(Value::as_bool) == Some(true);
        match self
            .keys(kind, name)
            .and_then(|keys| keys.get(key).cloned())
        {
            Some(value) => Ok(Some(value)),
            None if optional => Ok(None),
            None => Err(format!("no {kind} `{name}` with key `{key}`")),
        }
    }

    /// A container's environment as the kubelet gives it: `envFrom` first, then
    /// `env` in order (later entries win; `$(VAR)` expands variables defined
    /// before it).
    fn env(&self, container: &Value) -> Result<BTreeMap<String, String>, String> {
        let mut env = BTreeMap::new();
        for source in seq(container, "envFrom") {
            let (kind, reference) = match (source.get("configMapRef"), source.get("secretRef")) {
                (Some(r), None) => ("ConfigMap", r),
                (None, Some(r)) => ("Secret", r),
                _ => return Err(format!("envFrom {source:?}")),
            };
            let name = str_of(reference, "name").unwrap_or_default();
            let prefix = str_of(source, "prefix").unwrap_or_default();
            let keys = self
                .keys(kind, name)
                .ok_or_else(|| format!("envFrom: no {kind} `{name}`"))?;
            env.extend(keys.into_iter().map(|(k, v)| (format!("{prefix}{k}"), v)));
        }
        for var in seq(container, "env") {
            let name = str_of(var, "name").ok_or_else(|| format!("env {var:?} has no name"))?;
            let value = if let Some(value) = var.get("value") {
                let text = value
                    .as_str()
                    .ok_or_else(|| format!("{name}: {value:?} is not a string (quote it)"))?;
                Some(expand(text, &env)?)
            } else if let Some(from) = var.get("valueFrom") {
                if let Some(r) = from.get("configMapKeyRef") {
                    self.key_ref("ConfigMap", r)
                        .map_err(|e| format!("{name}: {e}"))?
                } else if let Some(r) = from.get("secretKeyRef") {
                    self.key_ref("Secret", r)
                        .map_err(|e| format!("{name}: {e}"))?
                } else if let Some(field) = from.get("fieldRef") {
                    match str_of(field, "fieldPath") {
                        Some("metadata.name") => Some(SAMPLE_POD.to_owned()),
                        Some("metadata.namespace") => Some("default".to_owned()),
                        other => return Err(format!("{name}: fieldRef {other:?}")),
                    }
                } else {
                    return Err(format!("{name}: valueFrom {from:?}"));
                }
            } else {
                Some(String::new())
            };
            if let Some(value) = value {
                env.insert(name.to_owned(), value);
            }
        }
        Ok(env)
    }
}

/// Kubernetes' `$(VAR)` expansion in `command`, `args` and `env` values (`$$` is a
/// literal `$`). A reference to an undefined variable stays as written in a pod;
/// here it is an error, since shardline would get the literal `$(VAR)`.
fn expand(text: &str, env: &BTreeMap<String, String>) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        if let Some(after) = after.strip_prefix('$') {
            out.push('$');
            rest = after;
        } else if let Some((name, tail)) = after.strip_prefix('(').and_then(|a| a.split_once(')')) {
            let value = env
                .get(name)
                .ok_or_else(|| format!("`{text}` refers to undefined $({name})"))?;
            out.push_str(value);
            rest = tail;
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    Ok(out)
}

/// A container's shardline command line (after the entrypoint), `$(VAR)` expanded.
fn command_line(container: &Value, env: &BTreeMap<String, String>) -> Result<Vec<String>, String> {
    let words = |key| -> Result<Vec<String>, String> {
        seq(container, key)
            .iter()
            .map(|w| expand(w.as_str().ok_or(format!("{key}: {w:?}"))?, env))
            .collect()
    };
    let mut line = words("command")?;
    match line.first().map(String::as_str) {
        // Keeping the image's entrypoint, or naming it.
        None => {}
        Some(ENTRYPOINT) => {
            line.remove(0);
        }
        Some(other) => return Err(format!("command runs {other}, not {ENTRYPOINT}")),
    }
    line.extend(words("args")?);
    Ok(line)
}

fn worker_container(pod: &Pod<'_>) -> Value {
    seq(pod.spec(), "containers")
        .iter()
        .find(|c| seq(c, "args").first().and_then(Value::as_str) == Some("worker"))
        .unwrap_or_else(|| panic!("{} runs no `worker` container", pod.owner))
        .clone()
}

/// The worker's (command line, environment).
fn worker_settings(m: &Manifests) -> (Vec<String>, BTreeMap<String, String>) {
    let container = worker_container(&m.worker());
    let env = m.env(&container).unwrap();
    (command_line(&container, &env).unwrap(), env)
}

/// The port a probe or a Service's `targetPort` means: a number, or a container
/// port's name.
fn port_number(port: &Value, container: &Value) -> u16 {
    match port {
        Value::Number(n) => u16::try_from(n.as_u64().unwrap()).unwrap(),
        Value::String(name) => seq(container, "ports")
            .iter()
            .find(|p| str_of(p, "name") == Some(name))
            .and_then(|p| p["containerPort"].as_u64())
            .map(|n| u16::try_from(n).unwrap())
            .unwrap_or_else(|| panic!("no container port named {name}")),
        other => panic!("port {other:?}"),
    }
}

/// The port the worker serves `/metrics`, `/healthz` and `/readyz` on.
fn metrics_port(m: &Manifests) -> u16 {
    let (args, env) = worker_settings(m);
    let addr = setting(&args, &env, "--metrics-addr")
        .unwrap_or_else(|| panic!("the worker has no --metrics-addr: {args:?}"));
    let addr: std::net::SocketAddr = addr.parse().unwrap_or_else(|e| panic!("{addr}: {e}"));
    assert!(
        addr.ip().is_unspecified(),
        "the worker must listen on all addresses to be probed and scraped: {addr}"
    );
    addr.port()
}

fn assert_selects(what: &str, selector: &Value, pod: &Pod<'_>) {
    let wanted = string_map(selector.get("matchLabels"));
    assert!(!wanted.is_empty(), "{what} has no matchLabels");
    assert!(
        selector.get("matchExpressions").is_none(),
        "{what}: matchLabels only"
    );
    let labels = pod.labels();
    for (key, value) in &wanted {
        assert_eq!(
            labels.get(key),
            Some(value),
            "{what} selects {key}={value}; {}'s pods have {labels:?}",
            pod.owner
        );
    }
}

#[test]
fn the_manifests_hold_the_fleet_and_the_readme_names_each_file() {
    let m = manifests();
    let mut seen = BTreeSet::new();
    for (file, doc) in &m.docs {
        let api = str_of(doc, "apiVersion").unwrap_or_default();
        let kind = str_of(doc, "kind").unwrap_or_default();
        assert!(
            KINDS.contains(&(api, kind)),
            "{file}: {api} {kind} is not one of {KINDS:?}"
        );
        let name = str_of(&doc["metadata"], "name")
            .unwrap_or_else(|| panic!("{file}: {kind} has no metadata.name"));
        assert!(
            seen.insert((kind, name)),
            "{file}: {kind} {name} is defined twice"
        );
        assert_eq!(
            str_of(&doc["metadata"]["labels"], "app.kubernetes.io/name"),
            Some("shardline"),
            "{file}: {kind} {name}"
        );
    }
    for kind in [
        "Deployment",
        "PodDisruptionBudget",
        "Service",
        "ConfigMap",
        "Secret",
        "NetworkPolicy",
    ] {
        assert!(m.all(kind).next().is_some(), "{DIR} has no {kind}");
    }

    let readme = read(&format!("{DIR}/README.md"));
    for file in m.docs.iter().map(|(file, _)| file).collect::<BTreeSet<_>>() {
        assert!(
            readme.contains(file.as_str()),
            "README.md does not describe {file}"
        );
    }
}

#[test]
fn every_container_runs_a_real_subcommand_the_cli_accepts() {
    let m = manifests();
    let mut failures = Vec::new();
    let mut shard_counts = BTreeMap::new();
    for pod in m.pods() {
        for container in pod.containers() {
            let name = format!("{} {}", pod.owner, str_of(container, "name").unwrap_or("?"));
            let image = str_of(container, "image").unwrap_or_default();
            let repository = image.rsplit('/').next().unwrap().split([':', '@']).next();
            assert_eq!(
                repository,
                Some("shardline"),
                "{name}: image {image} is not shardline's"
            );
            let checked = m.env(container).and_then(|env| {
                let args = command_line(container, &env)?;
                let first = args.first().map(String::as_str).unwrap_or_default();
                if !SUBCOMMANDS.contains(&first) {
                    return Err(format!(
                        "{args:?} does not start with one of {SUBCOMMANDS:?}"
                    ));
                }
                shard_counts.insert(name.clone(), setting(&args, &env, "--shards"));
                let log_format = setting(&args, &env, "--log-format");
                if log_format.as_deref() != Some("json") {
                    return Err(format!(
                        "logs {log_format:?}, not JSON for the log collector"
                    ));
                }
                cli_accepts(&args, &env)
            });
            if let Err(e) = checked {
                failures.push(format!("{name}: {e}"));
            }
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
    // Queue names and the shard map follow the count: one value for every container.
    let counts: BTreeSet<_> = shard_counts.values().collect();
    assert_eq!(
        counts.len(),
        1,
        "the containers disagree on --shards: {shard_counts:?}"
    );
    assert!(
        shard_counts.values().all(Option::is_some),
        "set SHARDLINE_SHARDS explicitly: {shard_counts:?}"
    );
}

#[test]
fn workers_join_the_elastic_fleet_under_their_pod_names() {
    let m = manifests();
    let deployment = m.one("Deployment", WORKER);
    let replicas = deployment["spec"]["replicas"].as_u64().unwrap_or(1);
    assert!(replicas >= 2, "a fleet of {replicas}");
    let labels = m.worker().labels();
    for (key, value) in [
        ("app.kubernetes.io/name", "shardline"),
        ("app.kubernetes.io/component", "worker"),
    ] {
        assert_eq!(
            labels.get(key).map(String::as_str),
            Some(value),
            "{labels:?}"
        );
    }
    assert_selects(
        "the Deployment",
        &deployment["spec"]["selector"],
        &m.worker(),
    );

    let (args, env) = worker_settings(&m);
    assert_eq!(
        setting(&args, &env, "--assign").as_deref(),
        Some("auto"),
        "{args:?}"
    );
    // A pod's name is its member id: kept across container restarts, unique in the
    // fleet. Given as a flag, it must be a `$(VAR)` of such a variable.
    let container = worker_container(&m.worker());
    let written: Vec<String> = ["command", "args"]
        .iter()
        .flat_map(|key| seq(&container, key))
        .filter_map(|w| w.as_str().map(str::to_owned))
        .collect();
    let var = match flag_value(&written, "--member-id") {
        None => "SHARDLINE_MEMBER_ID".to_owned(),
        Some(id) => id
            .strip_prefix("$(")
            .and_then(|v| v.strip_suffix(')'))
            .unwrap_or_else(|| panic!("--member-id {id} gives every pod one id"))
            .to_owned(),
    };
    let member = seq(&container, "env")
        .iter()
        .find(|v| str_of(v, "name") == Some(var.as_str()))
        .unwrap_or_else(|| panic!("the worker does not set {var}"));
    assert_eq!(
        str_of(&member["valueFrom"]["fieldRef"], "fieldPath"),
        Some("metadata.name"),
        "{member:?}"
    );
    assert_eq!(
        setting(&args, &env, "--member-id").as_deref(),
        Some(SAMPLE_POD)
    );

    // Rolling updates start a new member before an old one stops.
    let strategy = &deployment["spec"]["strategy"];
    assert_eq!(str_of(strategy, "type"), Some("RollingUpdate"));
    let rolling = &strategy["rollingUpdate"];
    assert_eq!(rolling["maxUnavailable"].as_u64(), Some(0), "{rolling:?}");
    assert_eq!(rolling["maxSurge"].as_u64(), Some(1), "{rolling:?}");
}

#[test]
fn probes_ask_the_metrics_port() {
    let m = manifests();
    let port = metrics_port(&m);
    let container = worker_container(&m.worker());
    for (probe, path) in [("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")] {
        let get = &container[probe]["httpGet"];
        assert_eq!(str_of(get, "path"), Some(path), "{probe}: {get:?}");
        assert_eq!(
            port_number(&get["port"], &container),
            port,
            "{probe}: {get:?}"
        );
    }
    assert!(
        seq(&container, "ports")
            .iter()
            .any(|p| p["containerPort"].as_u64() == Some(u64::from(port))),
        "the worker container does not declare port {port}"
    );
}

/// The metrics port listens on all addresses (the kubelet and Prometheus reach
/// the pod IP), so a NetworkPolicy admits to it only the nodes (an ipBlock:
/// the kubelet probes from the node) and Prometheus (a podSelector), and
/// nothing else to the worker pods.
#[test]
fn only_the_nodes_and_prometheus_reach_the_metrics_port() {
    let m = manifests();
    let port = metrics_port(&m);
    let worker = m.worker();
    let container = worker_container(&worker);
    let policy = m.one("NetworkPolicy", WORKER);
    let spec = &policy["spec"];
    assert_selects("the NetworkPolicy", &spec["podSelector"], &worker);
    let types: Vec<_> = seq(spec, "policyTypes")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(types, ["Ingress"], "ingress only: {spec:?}");
    let [rule] = seq(spec, "ingress") else {
        panic!("one ingress rule: {spec:?}");
    };
    let ports = seq(rule, "ports");
    assert!(!ports.is_empty(), "the rule names its port: {rule:?}");
    for p in ports {
        assert_eq!(port_number(&p["port"], &container), port, "{p:?}");
        assert_eq!(str_of(p, "protocol").unwrap_or("TCP"), "TCP");
    }
    let from = seq(rule, "from");
    assert_eq!(from.len(), 2, "the nodes and Prometheus: {from:?}");
    let nodes = from
        .iter()
        .find_map(|peer| peer.get("ipBlock"))
        .unwrap_or_else(|| panic!("no ipBlock for the nodes: {from:?}"));
    let cidr = str_of(nodes, "cidr").unwrap_or_default();
    let (ip, prefix) = cidr
        .split_once('/')
        .unwrap_or_else(|| panic!("{cidr} is not a CIDR"));
    let ip: std::net::IpAddr = ip.parse().unwrap_or_else(|e| panic!("{cidr}: {e}"));
    let prefix: u8 = prefix.parse().unwrap_or_else(|e| panic!("{cidr}: {e}"));
    assert!(
        prefix > 0 && prefix <= if ip.is_ipv4() { 32 } else { 128 },
        "{cidr}: not everyone"
    );
    assert!(nodes.get("except").is_none(), "{nodes:?}");
    let prometheus = from
        .iter()
        .find(|peer| peer.get("podSelector").is_some())
        .unwrap_or_else(|| panic!("no podSelector for Prometheus: {from:?}"));
    let pods = string_map(prometheus["podSelector"].get("matchLabels"));
    assert!(
        pods.values().any(|v| v.contains("prometheus")),
        "the podSelector selects Prometheus: {pods:?}"
    );
    // Without it a podSelector selects only the policy's own namespace.
    assert!(
        !string_map(
            prometheus
                .get("namespaceSelector")
                .and_then(|n| n.get("matchLabels"))
        )
        .is_empty(),
        "Prometheus's namespace is named: {prometheus:?}"
    );
}

#[test]
fn pods_are_given_longer_than_the_drain_to_stop() {
    let m = manifests();
    let (args, env) = worker_settings(&m);
    let drain = setting(&args, &env, "--drain-timeout").map_or_else(
        || shardline_worker::Config::default().drain_timeout,
        |d| humantime::parse_duration(&d).unwrap_or_else(|e| panic!("drain timeout {d}: {e}")),
    );
    // Kubernetes' default when the field is absent.
    let grace = m.worker().spec()["terminationGracePeriodSeconds"]
        .as_u64()
        .unwrap_or(30);
    assert!(
        Duration::from_secs(grace) > drain,
        "terminationGracePeriodSeconds {grace} must exceed the drain timeout {drain:?}: \
         SIGKILL mid-drain redelivers the in-flight events"
    );
}

#[test]
fn every_container_requests_resources_within_its_limits() {
    let m = manifests();
    for pod in m.pods() {
        for container in pod.containers() {
            let name = format!("{} {}", pod.owner, str_of(container, "name").unwrap_or("?"));
            let resources = &container["resources"];
            let (requests, limits) = (&resources["requests"], &resources["limits"]);
            for (what, value) in [
                ("requests.cpu", &requests["cpu"]),
                ("requests.memory", &requests["memory"]),
                ("limits.memory", &limits["memory"]),
            ] {
                assert!(!value.is_null(), "{name} has no resources.{what}");
                assert!(quantity(value) > 0.0, "{name}: resources.{what} {value:?}");
            }
            for unit in ["cpu", "memory"] {
                if !limits[unit].is_null() {
                    assert!(
                        quantity(&requests[unit]) <= quantity(&limits[unit]),
                        "{name}: requests.{unit} above limits.{unit}"
                    );
                }
            }
        }
    }
}

#[test]
fn the_budget_and_the_service_select_the_workers() {
    let m = manifests();
    let worker = m.worker();
    let budget = m.one("PodDisruptionBudget", WORKER);
    assert_selects(
        "the PodDisruptionBudget",
        &budget["spec"]["selector"],
        &worker,
    );
    assert_eq!(
        budget["spec"]["maxUnavailable"].as_u64(),
        Some(1),
        "{budget:?}"
    );

    let port = metrics_port(&m);
    let container = worker_container(&worker);
    let service = m
        .all("Service")
        .find(|s| {
            string_map(s["spec"].get("selector"))
                .iter()
                .all(|(k, v)| worker.labels().get(k) == Some(v))
        })
        .expect("a Service selects the workers");
    let spec = &service["spec"];
    assert!(
        !string_map(spec.get("selector")).is_empty(),
        "the Service selects every pod"
    );
    assert_eq!(str_of(spec, "type").unwrap_or("ClusterIP"), "ClusterIP");
    let metrics = seq(spec, "ports")
        .iter()
        .find(|p| str_of(p, "name") == Some("metrics"))
        .unwrap_or_else(|| panic!("the Service has no port named metrics: {spec:?}"));
    let target = metrics.get("targetPort").unwrap_or(&metrics["port"]);
    assert_eq!(port_number(target, &container), port, "{metrics:?}");
}

#[test]
fn every_key_reference_names_a_key_of_its_manifest() {
    let m = manifests();
    let mut references = 0;
    let mut failures = Vec::new();
    for pod in m.pods() {
        for container in pod.containers() {
            let name = format!("{} {}", pod.owner, str_of(container, "name").unwrap_or("?"));
            for var in seq(container, "env") {
                let from = &var["valueFrom"];
                for (kind, key) in [("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")] {
                    if let Some(reference) = from.get(key) {
                        references += 1;
                        if let Err(e) = m.key_ref(kind, reference) {
                            failures.push(format!("{name}: {e}"));
                        }
                    }
                }
            }
            for source in seq(container, "envFrom") {
                for (kind, key) in [("ConfigMap", "configMapRef"), ("Secret", "secretRef")] {
                    if let Some(reference) = source.get(key) {
                        references += 1;
                        let target = str_of(reference, "name").unwrap_or_default();
                        if m.keys(kind, target).is_none() {
                            failures.push(format!("{name}: envFrom: no {kind} `{target}`"));
                        }
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
    assert!(
        references > 0,
        "no container reads the ConfigMap or the Secret"
    );
}

#[test]
fn the_secret_holds_placeholders_only() {
    let m = manifests();
    for secret in m.all("Secret") {
        let name = str_of(&secret["metadata"], "name").unwrap_or_default();
        assert_eq!(str_of(secret, "type"), Some("Opaque"), "Secret {name}");
        let keys = m.keys("Secret", name).unwrap();
        assert!(!keys.is_empty(), "Secret {name} is empty");
        for (key, value) in keys {
            assert!(
                value.contains("CHANGE-ME"),
                "Secret {name} {key} must be an obvious placeholder, not a credential"
            );
        }
    }
}

#[test]
fn expand_resolves_references_like_kubernetes() {
    let env = BTreeMap::from([("A".to_owned(), "1".to_owned())]);
    assert_eq!(expand("x$(A)y", &env).unwrap(), "x1y");
    assert_eq!(expand("$$(A) $5", &env).unwrap(), "$(A) $5");
    assert!(expand("$(B)", &env).is_err());
}
