//! A test helper, not part of what the bench measures: declares durable classic queues and fills
//! them with persistent messages, each with an AMQP `message_id`, round-robin, with publisher
//! confirms. Used to try the peer by hand.
//!
//! Environment: FILL_AMQP_URL, FILL_QUEUES (comma-separated), FILL_COUNT (total messages),
//! FILL_ID_PREFIX (message-id prefix, default "m-"), FILL_NO_ID=1 (publish without a message id),
//! FILL_SAC=1 (declare the queues with `x-single-active-consumer: true`, to check that the peer
//! consumes a queue with arguments without declaring it).

use std::env;
use std::process::ExitCode;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};

async fn fill() -> Result<u64, String> {
    let var = |name: &str| env::var(name).map_err(|_| format!("{name} is not set"));
    let url = var("FILL_AMQP_URL")?;
    let queues: Vec<String> = var("FILL_QUEUES")?
        .split(',')
        .filter(|q| !q.is_empty())
        .map(str::to_owned)
        .collect();
    let count: u64 = var("FILL_COUNT")?
        .parse()
        .map_err(|e| format!("FILL_COUNT: {e}"))?;
    let id_prefix = env::var("FILL_ID_PREFIX").unwrap_or_else(|_| "m-".to_owned());
    let with_id = env::var("FILL_NO_ID").map_or(true, |v| v != "1");
    let mut arguments = FieldTable::default();
    if env::var("FILL_SAC").is_ok_and(|v| v == "1") {
        arguments.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    }

    let conn = Connection::connect(&url, ConnectionProperties::default())
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let channel = conn
        .create_channel()
        .await
        .map_err(|e| format!("channel: {e}"))?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| format!("confirm.select: {e}"))?;
    for queue in &queues {
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                arguments.clone(),
            )
            .await
            .map_err(|e| format!("queue.declare {queue}: {e}"))?;
    }
    let mut confirms = Vec::with_capacity(count as usize);
    for i in 0..count {
        let queue = &queues[(i as usize) % queues.len()];
        let mut props = BasicProperties::default().with_delivery_mode(2);
        if with_id {
            props = props.with_message_id(format!("{id_prefix}{i}").as_str().into());
        }
        let body = format!("{{\"n\":{i}}}");
        let confirm = channel
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                props,
            )
            .await
            .map_err(|e| format!("publish: {e}"))?;
        confirms.push(confirm);
    }
    for confirm in confirms {
        let confirmation = confirm.await.map_err(|e| format!("confirm: {e}"))?;
        if !confirmation.is_ack() {
            return Err("a publish was nacked".to_owned());
        }
    }
    conn.close(200, "OK".into())
        .await
        .map_err(|e| format!("close: {e}"))?;
    Ok(count)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    match fill().await {
        Ok(n) => {
            println!("peer-fill: published {n} messages");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("peer-fill: {e}");
            ExitCode::FAILURE
        }
    }
}
