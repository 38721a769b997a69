//! `cargo +nightly fuzz run request`: an event's AMQP headers as the worker
//! reads them (`traceparent`, `tracestate`, `baggage`: any bytes, as long or
//! short strings or another type) and its order id, through the HTTP
//! handler's request building (`Http::request`, what `handle` sends).
//!
//! Building never panics and never fails (required headers are
//! percent-encoded); no header value holds CR, LF or NUL; `baggage` is sent
//! exactly when HTTP can carry it (UTF-8, no control character but tab, at
//! most 8192 bytes) and then as published; `traceparent` is always a valid
//! W3C one; the URL the HTTP client sees holds no credentials.
#![no_main]

use std::sync::OnceLock;

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use opentelemetry::Context;
use opentelemetry::trace::TraceContextExt as _;
use shardline_contract::headers::{self, BAGGAGE, TRACEPARENT, TRACESTATE};
use shardline_contract::{Envelope, OrderId, ShardCount, ShardId, w3c};
use shardline_worker::handler::{Event, Http};

/// W3C Baggage's limit, the handler's for `baggage`.
const BAGGAGE_LIMIT: usize = 8192;

#[derive(Debug, Arbitrary)]
enum Header {
    Long(Vec<u8>),
    Short(String),
    Number(i64),
}

impl Header {
    fn value(self) -> AMQPValue {
        match self {
            Self::Long(bytes) => AMQPValue::LongString(LongString::from(bytes)),
            // A short string holds at most 255 bytes on the wire.
            Self::Short(mut text) => {
                let mut end = text.len().min(255);
                while !text.is_char_boundary(end) {
                    end -= 1;
                }
                text.truncate(end);
                AMQPValue::ShortString(ShortString::from(text))
            }
            Self::Number(n) => AMQPValue::LongLongInt(n),
        }
    }
}

#[derive(Debug, Arbitrary)]
struct Input {
    traceparent: Option<Header>,
    tracestate: Option<Header>,
    baggage: Option<Header>,
    order_id: String,
    event: String,
    seq: Option<u64>,
    attempt: u32,
    shard: u8,
    with_credentials: bool,
    body: Vec<u8>,
}

/// The handler without credentials and with them, built once: building
/// its HTTP client (TLS roots included) would dwarf the rest of a run.
fn handlers() -> &'static [Http; 2] {
    static HANDLERS: OnceLock<[Http; 2]> = OnceLock::new();
    HANDLERS.get_or_init(|| {
        [
            "http://127.0.0.1:9/events",
            "http://user:pa%0Ass@127.0.0.1:9/events",
        ]
        .map(|url| Http::new(url).expect("a valid handler URL"))
    })
}

/// The rule `baggage` is judged by, written out again as an oracle.
fn carried(value: &[u8]) -> bool {
    std::str::from_utf8(value).is_ok_and(|text| {
        !text.chars().any(|c| c.is_control() && c != '\t') && value.len() <= BAGGAGE_LIMIT
    })
}

fn properties(input: &mut Input) -> BasicProperties {
    let mut table = FieldTable::default();
    for (name, header) in [
        (TRACEPARENT, input.traceparent.take()),
        (TRACESTATE, input.tracestate.take()),
        (BAGGAGE, input.baggage.take()),
    ] {
        if let Some(header) = header {
            table.insert(ShortString::from(name), header.value());
        }
    }
    BasicProperties::default().with_headers(table)
}

fn percent_decoded(value: &[u8]) -> String {
    percent_encoding::percent_decode(value)
        .decode_utf8_lossy()
        .into_owned()
}

fuzz_target!(|input: Input| {
    let mut input = input;
    let props = properties(&mut input);
    // What the worker does without a tracer provider: continue a valid
    // parent, else a fresh context.
    let parent = headers::extract(&props);
    let span_context = w3c::propagated(&parent);
    let trace = Context::new().with_remote_span_context(span_context.clone());
    let traceparent = w3c::traceparent(&span_context);
    let baggage = headers::header_bytes(&props, BAGGAGE);

    let Ok(order_id) = OrderId::new(input.order_id.clone()) else {
        return;
    };
    let envelope = Envelope {
        order_id,
        event: input.event.clone(),
        seq: input.seq,
        event_id: None,
    };
    let shards = ShardCount::default();
    let Ok(shard) = ShardId::new(u32::from(input.shard) % u32::from(shards.get()), shards) else {
        return;
    };
    let dedup_key = envelope.dedup_key(&input.body);
    let event = Event {
        envelope: &envelope,
        body: &input.body,
        dedup_key: &dedup_key,
        shard,
        attempt: input.attempt,
        trace: &trace,
        traceparent: &traceparent,
        published_at_ms: None,
        baggage,
    };
    let http = &handlers()[usize::from(input.with_credentials)];
    let request = match http.request(&event) {
        Ok(request) => request,
        Err(e) => panic!("the request for {input:?} was not built: {e}"),
    };

    for (name, value) in request.headers() {
        let bytes = value.as_bytes();
        assert!(
            !bytes.iter().any(|b| matches!(b, b'\r' | b'\n' | b'\0')),
            "{name}: {bytes:?}"
        );
    }
    let sent = |name: &str| request.headers().get(name).map(|v| v.as_bytes());
    match baggage {
        Some(value) if carried(value) => assert_eq!(sent(BAGGAGE), Some(value)),
        _ => assert_eq!(sent(BAGGAGE), None),
    }
    let sent_parent = sent(TRACEPARENT).expect("a traceparent");
    assert!(std::str::from_utf8(sent_parent).is_ok_and(headers::is_valid_traceparent));
    if let Some(state) = sent(TRACESTATE) {
        assert!(state.len() <= 512 && !state.is_empty());
    }
    let order = sent("x-order-id").expect("an x-order-id");
    assert_eq!(percent_decoded(order), envelope.order_id.as_str());
    let key = sent("idempotency-key").expect("an idempotency-key");
    assert_eq!(percent_decoded(key), dedup_key);
    assert_eq!(sent("x-seq").is_some(), envelope.seq.is_some());
    assert!(request.url().username().is_empty() && request.url().password().is_none());
    assert_eq!(sent("authorization").is_some(), input.with_credentials);
});
