//! Hostile input (docs/semantics.md §3, "Bad input never crashes the worker and never blocks a
//! shard"): a corpus of malformed bodies and odd AMQP headers, each published to a
//! known shard and followed by a good event on the same shard. Each bad body ends
//! up in the DLQ with its reason, each odd-but-valid message is processed, the
//! worker never panics, and every good follow-up reaches the downstream.

use std::collections::BTreeMap;
use std::time::SystemTime;

use lapin::BasicProperties;
use lapin::message::Delivery;
use lapin::options::BasicAckOptions;
use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString};
use shardline_contract::headers::{
    self, event_properties, header_i64, header_str, is_valid_traceparent, new_traceparent,
};

use shardline_contract::Outline;
use shardline_contract::letters::MAX_INDEXED_BODY;
use shardline_testkit::{Call, Downstream, Event, PROCESSING, Publisher, TestEnv, describe, dlq};

/// The worker's default body limit (`--max-body-bytes`).
const LIMIT: usize = 1024 * 1024;

/// What must become of a hostile message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// Dead-lettered at once with this `x-fail-reason`, no handler attempt.
    DeadLetter(&'static str),
    /// A valid envelope: processed, the downstream gets the original bytes under
    /// this dedup key.
    Processed,
}

struct Case {
    name: &'static str,
    body: Vec<u8>,
    /// `None`: the properties the publisher sets (with a fresh traceparent).
    props: Option<BasicProperties>,
    expect: Expect,
    /// For processed cases: the downstream must get no traceparent or a valid
    /// one, never what was sent.
    garbage_traceparent: bool,
    /// For dead letters: `dlq list --order-id` of the order the body names
    /// must list it (the index has it under its order).
    listed_by_order: bool,
}

impl Case {
    fn dead(name: &'static str, body: impl Into<Vec<u8>>, reason: &'static str) -> Self {
        Self {
            name,
            body: body.into(),
            props: None,
            expect: Expect::DeadLetter(reason),
            garbage_traceparent: false,
            listed_by_order: false,
        }
    }

    fn listed_by_order(mut self) -> Self {
        self.listed_by_order = true;
        self
    }

    fn processed(name: &'static str, body: Vec<u8>, props: BasicProperties) -> Self {
        Self {
            name,
            body,
            props: Some(props),
            expect: Expect::Processed,
            garbage_traceparent: false,
            listed_by_order: false,
        }
    }
}

/// `{"order_id":"{order}","event":"hostile.checked","seq":1, …}` with `extra`
/// spliced in before the closing brace.
fn envelope(order: &str, extra: &str) -> Vec<u8> {
    format!(r#"{{"order_id":"{order}","event":"hostile.checked","seq":1{extra}}}"#).into_bytes()
}

/// A valid envelope of `order` whose `data` makes it `depth` levels deep
/// (its own object is the first).
fn nested(order: &str, depth: usize) -> Vec<u8> {
    let inner = depth - 1;
    envelope(
        order,
        &format!(r#","data":{}"x"{}"#, "[".repeat(inner), "]".repeat(inner)),
    )
}

fn props_with(headers: FieldTable) -> BasicProperties {
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type("application/json".into())
        .with_headers(headers)
}

fn long(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

fn table(entries: Vec<(&str, AMQPValue)>) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in entries {
        t.insert(k.into(), v);
    }
    t
}

/// Publisher properties with `traceparent` replaced by `value`.
fn with_traceparent(value: AMQPValue) -> BasicProperties {
    let props = event_properties("hostile", SystemTime::now(), &new_traceparent());
    let mut h = props.headers().clone().unwrap_or_default();
    h.insert(headers::TRACEPARENT.into(), value);
    props.with_headers(h)
}

fn corpus() -> Vec<Case> {
    let q = "\"";
    let mut cases = vec![
        // Not UTF-8 JSON: `decode`.
        Case::dead("not json", "this is not json {", "decode"),
        Case::dead("empty body", "", "decode"),
        Case::dead(
            "truncated json",
            r#"{"order_id":"hostile-trunc","event":"e","seq":"#,
            "decode",
        ),
        Case::dead(
            "invalid utf-8",
            &b"{\"order_id\":\"\xff\",\"event\":\"hostile.utf8\",\"seq\":1}"[..],
            "decode",
        ),
        Case::dead(
            "trailing garbage",
            r#"{"order_id":"hostile-trail","event":"e","seq":1} x"#,
            "decode",
        ),
        // JSON, but not an envelope: `invalid`.
        Case::dead(
            "json array",
            r#"[{"order_id":"hostile-array","event":"e","seq":1}]"#,
            "invalid",
        ),
        Case::dead("json string", r#""hostile-string""#, "invalid"),
        // serde reads a struct from an array by position: still no object.
        Case::dead(
            "json array of an envelope's values",
            r#"["hostile-array-values","e",1]"#,
            "invalid",
        ),
        Case::dead("json number", "1024", "invalid"),
        Case::dead("json null", "null", "invalid"),
        // Nested past the limit (64), with a valid envelope at the top: the
        // letter is still indexed under its order.
        Case::dead("nested 65 deep", nested("hostile-deep-65", 65), "invalid").listed_by_order(),
        Case::dead(
            "nested 200 deep",
            nested("hostile-deep-200", 200),
            "invalid",
        )
        .listed_by_order(),
        Case::dead(
            "order_id missing",
            r#"{"event":"hostile.missing","seq":1}"#,
            "invalid",
        ),
        Case::dead(
            "order_id empty",
            r#"{"order_id":"","event":"hostile.empty","seq":1}"#,
            "invalid",
        ),
        Case::dead(
            "order_id a number",
            r#"{"order_id":1024,"event":"hostile.number","seq":1}"#,
            "invalid",
        ),
        Case::dead(
            "order_id 10 KB long",
            format!(
                r#"{{"order_id":"{}","event":"e","seq":1}}"#,
                "k".repeat(10 * 1024)
            ),
            "invalid",
        ),
        Case::dead(
            "order_id with a control character",
            r#"{"order_id":"hostile\u0007bell","event":"e","seq":1}"#,
            "invalid",
        ),
        Case::dead(
            "event missing",
            r#"{"order_id":"hostile-noevent","seq":1}"#,
            "invalid",
        ),
        Case::dead(
            "seq negative",
            r#"{"order_id":"hostile-neg","event":"e","seq":-1}"#,
            "invalid",
        ),
        Case::dead(
            "seq zero",
            r#"{"order_id":"hostile-zero","event":"e","seq":0}"#,
            "invalid",
        ),
        Case::dead(
            "seq a string",
            format!(r#"{{"order_id":"hostile-str","event":"e","seq":{q}3{q}}}"#),
            "invalid",
        ),
        Case::dead(
            "seq a float",
            r#"{"order_id":"hostile-float","event":"e","seq":1.5}"#,
            "invalid",
        ),
        Case::dead(
            "seq 2^70",
            r#"{"order_id":"hostile-big","event":"e","seq":1180591620717411303424}"#,
            "invalid",
        ),
        Case::dead(
            "seq 2^63",
            r#"{"order_id":"hostile-2p63","event":"e","seq":9223372036854775808}"#,
            "invalid",
        ),
        Case::dead(
            "seq and version both",
            r#"{"order_id":"hostile-both","event":"e","seq":1,"version":1}"#,
            "invalid",
        ),
        Case::dead(
            "event_id a number",
            r#"{"order_id":"hostile-eid","event":"e","seq":1,"event_id":7}"#,
            "invalid",
        ),
        Case::dead(
            "duplicate order_id",
            r#"{"order_id":"hostile-d1","order_id":"hostile-d2","event":"e","seq":1}"#,
            "invalid",
        ),
        Case::dead(
            "2 MiB body",
            envelope(
                "hostile-huge",
                &format!(r#","pad":"{}""#, "x".repeat(2 << 20)),
            ),
            "invalid",
        ),
    ];

    // Valid envelopes, odd headers: processed.
    let mut garbage = Case::processed(
        "garbage traceparent",
        envelope("hostile-tp-garbage", ""),
        with_traceparent(long("00-not-a-trace-context-at-all")),
    );
    garbage.garbage_traceparent = true;
    cases.push(garbage);
    let mut zeros = Case::processed(
        "all-zero traceparent",
        envelope("hostile-tp-zero", ""),
        with_traceparent(long(
            "00-00000000000000000000000000000000-0000000000000000-01",
        )),
    );
    zeros.garbage_traceparent = true;
    cases.push(zeros);
    let mut binary = Case::processed(
        "non-UTF-8 traceparent",
        envelope("hostile-tp-binary", ""),
        with_traceparent(AMQPValue::LongString(LongString::from(
            &b"00-\xff\xfe-\x00\x01-01"[..],
        ))),
    );
    binary.garbage_traceparent = true;
    cases.push(binary);
    let mut int_tp = Case::processed(
        "traceparent an integer",
        envelope("hostile-tp-int", ""),
        with_traceparent(AMQPValue::LongLongInt(42)),
    );
    int_tp.garbage_traceparent = true;
    cases.push(int_tp);
    // Huge and odd headers, replay markers among them: each a seq 1, so
    // whatever the marker says, the event runs as a fresh one would.
    let huge = "h".repeat(60 * 1024);
    for (name, headers) in [
        ("a 60 KB unknown header", vec![("x-huge", long(&huge))]),
        (
            "a 60 KB tracestate",
            vec![(headers::TRACESTATE, long(&huge))],
        ),
        (
            "a replay marker that is an integer",
            vec![(headers::REPLAY, AMQPValue::LongLongInt(7))],
        ),
        (
            "a 60 KB replay marker",
            vec![(headers::REPLAY, long(&huge))],
        ),
        (
            "a replay marker with control characters",
            vec![(headers::REPLAY, long("dl-\u{1b}]0;pwned\u{7}\r\nX: 1"))],
        ),
    ] {
        let order = format!("hostile-headers-{}", cases.len());
        let mut odd = table(headers);
        odd.insert(headers::TRACEPARENT.into(), long(&new_traceparent()));
        cases.push(Case::processed(name, envelope(&order, ""), props_with(odd)));
    }
    cases.push(Case::processed(
        "x-published-at-ms a string",
        envelope("hostile-pub-str", ""),
        props_with(table(vec![
            (headers::PUBLISHED_AT_MS, long("yesterday")),
            (headers::TRACEPARENT, long(&new_traceparent())),
        ])),
    ));
    cases.push(Case::processed(
        "x-published-at-ms negative and in the future",
        envelope("hostile-pub-neg", ""),
        props_with(table(vec![
            (headers::PUBLISHED_AT_MS, AMQPValue::LongLongInt(i64::MIN)),
            (headers::TRACESTATE, AMQPValue::Boolean(true)),
        ])),
    ));
    cases.push(Case::processed(
        "nested table and array headers",
        envelope("hostile-nested", ""),
        props_with(table(vec![
            (
                headers::PUBLISHED_AT_MS,
                AMQPValue::FieldTable(table(vec![("ms", AMQPValue::LongLongInt(1))])),
            ),
            (
                headers::TRACEPARENT,
                AMQPValue::FieldArray(FieldArray::from(vec![long(&new_traceparent())])),
            ),
            (
                "x-nested",
                AMQPValue::FieldTable(table(vec![(
                    "inner",
                    AMQPValue::FieldTable(table(vec![("deeper", AMQPValue::Void)])),
                )])),
            ),
            (headers::FAIL_REASON, AMQPValue::Double(1.5)),
        ])),
    ));
    cases.push(Case::processed(
        "no properties at all",
        envelope("hostile-bare", ""),
        BasicProperties::default(),
    ));
    cases.push(Case::processed(
        "unknown fields of every type",
        envelope(
            "hostile-unknown",
            r#","data":{"a":[1,2.5,null,true,{"b":"\u00e9\ud83d\ude00"}]},"x":1e300"#,
        ),
        event_properties("hostile-unknown", SystemTime::now(), &new_traceparent()),
    ));
    // Exactly at the limit: still an envelope.
    let mut at_limit = envelope("hostile-at-limit", r#","pad":""#);
    at_limit.truncate(at_limit.len() - 1); // drop the closing brace
    let pad = LIMIT - at_limit.len() - 2;
    at_limit.extend(std::iter::repeat_n(b'x', pad));
    at_limit.extend_from_slice(b"\"}");
    assert_eq!(at_limit.len(), LIMIT);
    cases.push(Case::processed(
        "body exactly at the 1 MiB limit",
        at_limit,
        event_properties("hostile-at-limit", SystemTime::now(), &new_traceparent()),
    ));
    // Control messages are never processed as events, even with an
    // envelope's body: this worker knows none, so each is dead-lettered.
    for (name, value) in [
        ("control message of an unknown kind", long("drain-marker")),
        (
            "control message whose kind is not text",
            AMQPValue::LongInt(7),
        ),
    ] {
        let mut props = event_properties("hostile-control", SystemTime::now(), &new_traceparent());
        let mut table = props.headers().clone().unwrap_or_default();
        table.insert(headers::CONTROL.into(), value);
        props = props.with_headers(table);
        cases.push(Case {
            name,
            body: envelope(&format!("hostile-control-{}", cases.len()), ""),
            props: Some(props),
            expect: Expect::DeadLetter("control"),
            garbage_traceparent: false,
            listed_by_order: false,
        });
    }
    cases
}

/// The dedup key of a processed case (every processed envelope has seq 1).
fn processed_key(body: &[u8]) -> String {
    let env = shardline_contract::Envelope::parse(body, LIMIT).unwrap();
    env.dedup_key(body)
}

fn short(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    if text.len() > 80 {
        let cut = text.char_indices().nth(80).map_or(text.len(), |(i, _)| i);
        format!("{}… ({} bytes)", &text[..cut], body.len())
    } else {
        format!("{text:?}")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_input_is_dead_lettered_or_processed_and_never_blocks_a_shard() {
    check_corpus("hostile", corpus()).await;
}

/// docs/semantics.md §3: `decode` is "not UTF-8 JSON". The decoder checks UTF-8 only in the
/// strings it reads, so invalid UTF-8 in `data` or an unknown field passes and
/// the downstream gets a body that is not UTF-8. Ignored until that is fixed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_utf8_anywhere_in_the_body_is_dead_lettered_as_decode() {
    check_corpus(
        "hostile-utf8",
        vec![
            Case::dead(
                "invalid utf-8 in data",
                &b"{\"order_id\":\"hostile-u1\",\"event\":\"e\",\"seq\":1,\"data\":\"\xff\"}"[..],
                "decode",
            ),
            Case::dead(
                "invalid utf-8 in an unknown field",
                &b"{\"order_id\":\"hostile-u2\",\"event\":\"e\",\"seq\":1,\"note\":[\"\xc3\x28\"]}"
                    [..],
                "decode",
            ),
        ],
    )
    .await;
}

/// Publishes each case, then a good event on the same shard, and checks the
/// outcomes: downstream calls, the DLQ, and a live worker that never panicked.
async fn check_corpus(name: &str, cases: Vec<Case>) {
    let env = TestEnv::new(name).await;
    env.apply_topology().await;
    let conn = env.connect().await;
    let downstream = Downstream::start().await;
    let mut worker = env.start_worker("w1", &downstream, |_| {}).await;
    let publisher = Publisher::connect(&env).await;

    // Case i goes to the shard of its follow-up order `hostile-good-{i}`, so the
    // cases spread over the shards and each is followed on its own shard.
    let mut follow_ups = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let good = Event::new(&format!("hostile-good-{i}"), 1, env.shards);
        // A processed envelope must be on the shard its order hashes to.
        let shard = match case.expect {
            Expect::Processed => env.shard_of(
                &shardline_contract::Envelope::parse(&case.body, LIMIT)
                    .unwrap()
                    .order_id,
            ),
            Expect::DeadLetter(_) => good.shard,
        };
        match &case.props {
            Some(props) => {
                publisher
                    .publish_with(shard, &case.body, props.clone())
                    .await;
            }
            None => publisher.publish_raw(shard, &case.body).await,
        }
        let good = if good.shard == shard {
            good
        } else {
            // Find a follow-up order on the same shard.
            (0..)
                .map(|j| Event::new(&format!("hostile-good-{i}-{j}"), 1, env.shards))
                .find(|e| e.shard == shard)
                .unwrap()
        };
        publisher.publish(std::slice::from_ref(&good)).await;
        follow_ups.push((shard, good));
    }

    // Every good follow-up and every processed case reaches the downstream.
    let mut expected_keys: Vec<String> = follow_ups.iter().map(|(_, e)| e.key()).collect();
    for case in &cases {
        if case.expect == Expect::Processed {
            expected_keys.push(processed_key(&case.body));
        }
    }
    let calls = {
        let expected_keys = expected_keys.clone();
        downstream
            .wait_for(
                "every follow-up and every valid hostile event answered",
                PROCESSING,
                move |calls| {
                    expected_keys
                        .iter()
                        .all(|k| calls.iter().any(|c| c.key() == k && c.ok() && c.completed))
                },
            )
            .await
    };
    let report = describe(&calls);
    // Every delivery acked: the dead letters were confirmed before.
    env.wait_shard_queues_drained(PROCESSING).await;

    // Letters found by their order: `dlq list --order-id` reads the index,
    // written before the ack.
    for case in cases.iter().filter(|c| c.listed_by_order) {
        let order = Outline::of(&case.body)
            .and_then(|o| o.order_id)
            .unwrap_or_else(|| panic!("{}: the body names no order", case.name))
            .into_owned();
        let list = dlq::list_json(&env, &["--order-id", &order]).await;
        let listed = &list["dead_letters"];
        assert_eq!(
            listed.as_array().map(Vec::len),
            Some(1),
            "{}: `dlq list --order-id {order}`: {list}",
            case.name
        );
        assert_eq!(
            listed[0]["order_id"],
            order.as_str(),
            "{}: {list}",
            case.name
        );
        let Expect::DeadLetter(reason) = case.expect else {
            panic!("{}: listed by order but not a dead letter", case.name);
        };
        assert_eq!(listed[0]["reason"], reason, "{}: {list}", case.name);
    }

    // Nothing else reached the downstream, and nothing twice.
    let mut per_key: BTreeMap<&str, usize> = BTreeMap::new();
    for c in &calls {
        *per_key.entry(c.key()).or_default() += 1;
    }
    for key in &expected_keys {
        assert_eq!(per_key.get(key.as_str()), Some(&1), "{key}:\n{report}");
    }
    assert_eq!(
        calls.len(),
        expected_keys.len(),
        "unexpected downstream calls:\n{report}"
    );

    // Each follow-up came after its hostile predecessor was settled: on the same
    // shard, in order, so its arrival proves the shard was not blocked.
    for ((shard, good), case) in follow_ups.iter().zip(&cases) {
        let call = calls.iter().find(|c| c.key() == good.key()).unwrap();
        assert_eq!(call.shard(), Some(*shard), "{}: {call:?}", case.name);
        if case.expect == Expect::Processed {
            let key = processed_key(&case.body);
            let hostile = calls.iter().find(|c| c.key() == key).unwrap();
            assert!(
                hostile.index < call.index,
                "{}: follow-up overtook it:\n{report}",
                case.name
            );
        }
    }

    // Processed cases: original bytes; a bad traceparent is never forwarded.
    for case in cases.iter().filter(|c| c.expect == Expect::Processed) {
        let key = processed_key(&case.body);
        let call: &Call = calls.iter().find(|c| c.key() == key).unwrap();
        assert_eq!(
            call.body, case.body,
            "{}: the handler must get the original bytes",
            case.name
        );
        if let Some(tp) = call.header("traceparent") {
            assert!(
                is_valid_traceparent(tp),
                "{}: downstream got an invalid traceparent {tp:?}",
                case.name
            );
        }
        if case.garbage_traceparent {
            let sent = case
                .props
                .as_ref()
                .and_then(|p| header_str(p, headers::TRACEPARENT));
            assert!(
                sent.is_none() || call.header("traceparent") != sent,
                "{}: the garbage traceparent was forwarded",
                case.name
            );
        }
    }

    // The DLQ holds exactly the expected dead letters, matched by body.
    let channel = conn.create_channel().await.unwrap();
    let letters: Vec<Delivery> = dlq::peek_all(&env, &channel).await;
    let summary: Vec<String> = letters
        .iter()
        .map(|d| {
            format!(
                "{} reason={:?} error={:?}",
                short(&d.data),
                header_str(&d.properties, headers::FAIL_REASON),
                header_str(&d.properties, headers::ERROR)
            )
        })
        .collect();
    let expected_dead: Vec<(&Case, u16)> = cases
        .iter()
        .zip(&follow_ups)
        .filter(|(c, _)| matches!(c.expect, Expect::DeadLetter(_)))
        .map(|(c, (shard, _))| (c, *shard))
        .collect();
    let mut failures = Vec::new();
    for (case, shard) in &expected_dead {
        let Expect::DeadLetter(reason) = case.expect else {
            unreachable!()
        };
        let matching: Vec<&Delivery> = letters.iter().filter(|d| d.data == case.body).collect();
        let [letter] = matching.as_slice() else {
            failures.push(format!(
                "{}: {} dead letter(s) with its body, expected 1",
                case.name,
                matching.len()
            ));
            continue;
        };
        let props = &letter.properties;
        let got = header_str(props, headers::FAIL_REASON);
        if got != Some(reason) {
            failures.push(format!(
                "{}: x-fail-reason {got:?}, expected {reason:?} (x-error {:?})",
                case.name,
                header_str(props, headers::ERROR)
            ));
        }
        if letter.routing_key.as_str() != reason {
            failures.push(format!(
                "{}: DLX routing key {}, expected {reason}",
                case.name, letter.routing_key
            ));
        }
        if header_i64(props, headers::RETRY_COUNT) != Some(0) {
            failures.push(format!(
                "{}: x-retry-count {:?}, expected 0 (never reached the handler)",
                case.name,
                header_i64(props, headers::RETRY_COUNT)
            ));
        }
        if header_i64(props, headers::SHARD) != Some(i64::from(*shard)) {
            failures.push(format!(
                "{}: x-shard {:?}, expected {shard}",
                case.name,
                header_i64(props, headers::SHARD)
            ));
        }
        if !header_str(props, headers::ERROR).is_some_and(|e| !e.is_empty() && e.len() <= 4096) {
            failures.push(format!(
                "{}: x-error missing, empty or not truncated",
                case.name
            ));
        }
        let Some(id) = header_str(props, headers::DEAD_LETTER_ID).filter(|id| !id.is_empty())
        else {
            failures.push(format!("{}: no x-dead-letter-id", case.name));
            continue;
        };
        // Indexed under the order its body names, whatever else it is.
        let named = (case.body.len() <= MAX_INDEXED_BODY)
            .then(|| Outline::of(&case.body))
            .flatten()
            .and_then(|o| Some(o.order_id?.into_owned()));
        let indexed = dlq::index_entry(&env, id).await.and_then(|e| e.order_id);
        if indexed != named {
            failures.push(format!(
                "{}: indexed under order {indexed:?}, its body names {named:?}",
                case.name
            ));
        }
    }
    if letters.len() != expected_dead.len() {
        failures.push(format!(
            "DLQ holds {} dead letters, expected {}",
            letters.len(),
            expected_dead.len()
        ));
    }
    assert!(
        failures.is_empty(),
        "dead letters wrong:\n  {}\nDLQ holds:\n  {}",
        failures.join("\n  "),
        summary.join("\n  ")
    );
    for letter in &letters {
        letter.ack(BasicAckOptions::default()).await.unwrap();
    }

    // The worker is alive and settled every message exactly once: processed,
    // or dead-lettered. A panic in a shard's task would have cost its
    // connection (a reconnect) or left a message unsettled.
    let total = (cases.len() + follow_ups.len()) as u64;
    let counts = worker.wait_settled(total).await;
    assert_eq!(counts.settled(), total, "{}", worker.describe());
    assert_eq!(
        counts.dead_lettered_total(),
        expected_dead.len() as u64,
        "{}",
        worker.describe()
    );
    assert_eq!(counts.broker_reconnects, 0, "{}", worker.describe());
    worker.assert_running().await;
}
