//! Reading an AMQP delivery as an [`Envelope`], and what to do when it cannot be read.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use lapin::message::Delivery;
use lapin::types::{AMQPValue, FieldTable};
use sha2::{Digest, Sha256};

use inbox_core::{Envelope, MessageKey, PayloadCut};

/// The header carrying the tenant.
pub const TENANT_HEADER: &str = "tenant";

/// The header carrying when the event happened (RFC 3339).
pub const OCCURRED_AT_HEADER: &str = "occurred_at";

/// A delivery that could not be read: dead-letter it under a made-up key.
pub(crate) struct Malformed {
    pub envelope: Envelope,
    pub reason: String,
}

fn value_to_string(value: &AMQPValue) -> Option<String> {
    Some(match value {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_owned(),
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::ShortShortInt(n) => n.to_string(),
        AMQPValue::ShortShortUInt(n) => n.to_string(),
        AMQPValue::ShortInt(n) => n.to_string(),
        AMQPValue::ShortUInt(n) => n.to_string(),
        AMQPValue::LongInt(n) => n.to_string(),
        AMQPValue::LongUInt(n) => n.to_string(),
        AMQPValue::LongLongInt(n) => n.to_string(),
        AMQPValue::Float(n) => n.to_string(),
        AMQPValue::Double(n) => n.to_string(),
        AMQPValue::Timestamp(n) => n.to_string(),
        _ => return None,
    })
}

/// The scalar headers, as strings (nested tables and arrays, like `x-death`, are left
/// out of the envelope; they stay on the message itself).
pub(crate) fn headers(table: Option<&FieldTable>) -> BTreeMap<String, String> {
    table
        .map(|t| {
            t.inner()
                .iter()
                .filter_map(|(k, v)| value_to_string(v).map(|v| (k.as_str().to_owned(), v)))
                .collect()
        })
        .unwrap_or_default()
}

fn delivery_count(table: Option<&FieldTable>) -> Option<u32> {
    match table?.inner().get("x-delivery-count")? {
        AMQPValue::LongLongInt(n) => u32::try_from(*n).ok(),
        AMQPValue::LongInt(n) => u32::try_from(*n).ok(),
        AMQPValue::LongUInt(n) => Some(*n),
        AMQPValue::ShortInt(n) => u32::try_from(*n).ok(),
        _ => None,
    }
}

/// The routing key a message was first published with, from the `x-death` entry of
/// the first queue that dead-lettered it (`x-first-death-queue`): once the broker has
/// dead-lettered a message, its routing key is the dead-letter queue's name.
fn original_routing_key(table: Option<&FieldTable>) -> Option<String> {
    let table = table?.inner();
    let first_queue = match table.get("x-first-death-queue")? {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_owned(),
        _ => return None,
    };
    let AMQPValue::FieldArray(deaths) = table.get("x-death")? else {
        return None;
    };
    deaths.as_slice().iter().find_map(|death| {
        let AMQPValue::FieldTable(death) = death else {
            return None;
        };
        let death = death.inner();
        let queue = death.get("queue").and_then(value_to_string)?;
        if queue != first_queue {
            return None;
        }
        let AMQPValue::FieldArray(keys) = death.get("routing-keys")? else {
            return None;
        };
        keys.as_slice()
            .first()
            .and_then(value_to_string)
            .filter(|k| !k.is_empty())
    })
}

/// The message type: the `type` property; without one, the routing key the message
/// was published with (the original one, when the broker dead-lettered it on the way).
pub(crate) fn message_type(delivery: &Delivery) -> String {
    let props = &delivery.properties;
    props
        .kind()
        .as_ref()
        .map(|k| k.as_str().to_owned())
        .filter(|k| !k.is_empty())
        .or_else(|| original_routing_key(props.headers().as_ref()))
        .unwrap_or_else(|| delivery.routing_key.as_str().to_owned())
}

/// How often the broker delivered a message before it dead-lettered it at the
/// delivery limit `limit` of `queue`: one delivery more than the limit per
/// `delivery_limit` death from `queue` that `x-death` counts. (The dead-lettered copy
/// does not keep the group queue's `x-delivery-count`; one it carries is the
/// dead-letter queue's own.)
pub(crate) fn deliveries_at_limit(
    table: Option<&FieldTable>,
    queue: &str,
    limit: u32,
) -> Option<u32> {
    let AMQPValue::FieldArray(deaths) = table?.inner().get("x-death")? else {
        return None;
    };
    deaths.as_slice().iter().find_map(|death| {
        let AMQPValue::FieldTable(death) = death else {
            return None;
        };
        let death = death.inner();
        let from_queue = death.get("queue").and_then(value_to_string)?;
        let reason = death.get("reason").and_then(value_to_string)?;
        if from_queue != queue || reason != "delivery_limit" {
            return None;
        }
        let count = death.get("count").and_then(value_to_string)?;
        let count: u32 = count.parse().ok()?;
        Some(count.saturating_mul(limit.saturating_add(1)))
    })
}

/// Reads a delivery. `message_id` is the message key, the message type is
/// [`message_type`]; headers `tenant` and `occurred_at`; `redelivered` and
/// `x-delivery-count` are hints.
pub(crate) fn read(delivery: &Delivery, max_body: usize) -> Result<Envelope, Box<Malformed>> {
    let props = &delivery.properties;
    let message_type = message_type(delivery);
    let headers = headers(props.headers().as_ref());
    let tenant = headers.get(TENANT_HEADER).cloned();
    let occurred_at = headers
        .get(OCCURRED_AT_HEADER)
        .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
        .map(|t| t.with_timezone(&Utc));

    // A body over the limit is never copied: the letter keeps its first
    // `CUT_PAYLOAD_PREFIX` bytes, its length and its SHA-256 (the one the made-up key
    // is derived from), so the consumer adds a few KiB to what lapin already holds.
    let malformed = |reason: String| {
        let digest: [u8; 32] = Sha256::digest(&delivery.data).into();
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        let key = MessageKey::derive("inbox.malformed", &hex, &message_type);
        let (payload, cut) = if delivery.data.len() > max_body {
            let (prefix, cut) = PayloadCut::with_digest(&delivery.data, digest);
            (prefix, Some(cut))
        } else {
            (delivery.data.clone(), None)
        };
        let mut envelope = Envelope::new(key, message_type.clone(), payload);
        envelope.payload_cut = cut;
        envelope.headers = headers.clone();
        envelope.tenant = tenant.clone();
        Box::new(Malformed { envelope, reason })
    };

    let Some(id) = props.message_id().as_ref().map(|m| m.as_str()) else {
        return Err(malformed("no message_id property".to_owned()));
    };
    let message_key = MessageKey::new(id).map_err(|e| malformed(e.to_string()))?;
    if delivery.data.len() > max_body {
        return Err(malformed(format!(
            "body of {} bytes exceeds the limit of {max_body} bytes",
            delivery.data.len()
        )));
    }
    Ok(Envelope {
        message_key,
        message_type,
        payload: delivery.data.clone(),
        delivery_count: delivery_count(props.headers().as_ref()),
        headers,
        tenant,
        occurred_at,
        redelivered: delivery.redelivered,
        payload_cut: None,
    })
}

#[cfg(test)]
mod tests {
    use lapin::types::{FieldArray, LongString};
    use lapin::BasicProperties;

    use super::*;

    fn long(s: &str) -> AMQPValue {
        AMQPValue::LongString(LongString::from(s))
    }

    /// A delivery from `routing_key` whose `x-death` says it was dead-lettered from
    /// `queue` for `reason`, `count` times, published with `original`.
    fn dead_lettered(routing_key: &str, queue: &str, reason: &str, original: &str) -> Delivery {
        let mut death = FieldTable::default();
        death.insert("queue".into(), long(queue));
        death.insert("reason".into(), long(reason));
        death.insert("count".into(), AMQPValue::LongLongInt(2));
        death.insert(
            "routing-keys".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![long(original)])),
        );
        let mut other = FieldTable::default();
        other.insert("queue".into(), long("elsewhere"));
        other.insert("reason".into(), long("expired"));
        other.insert("count".into(), AMQPValue::LongLongInt(9));
        other.insert(
            "routing-keys".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![long("elsewhere")])),
        );
        let mut headers = FieldTable::default();
        headers.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![
                AMQPValue::FieldTable(other),
                AMQPValue::FieldTable(death),
            ])),
        );
        headers.insert("x-first-death-queue".into(), long(queue));
        let mut d = Delivery::mock(1, "".into(), routing_key.into(), false, b"{}".to_vec());
        d.properties = BasicProperties::default()
            .with_message_id("k".into())
            .with_headers(headers);
        d
    }

    #[test]
    fn the_type_is_the_type_property_else_the_routing_key_first_published_with() {
        let d = dead_lettered("g:dlq", "g", "delivery_limit", "usage.recorded");
        assert_eq!(message_type(&d), "usage.recorded");
        let mut typed = dead_lettered("g:dlq", "g", "delivery_limit", "usage.recorded");
        typed.properties = typed.properties.with_type("usage.typed".into());
        assert_eq!(message_type(&typed), "usage.typed");
        let plain = Delivery::mock(1, "x".into(), "usage.plain".into(), false, Vec::new());
        assert_eq!(message_type(&plain), "usage.plain");
    }

    #[test]
    fn a_body_over_the_limit_is_cut_to_its_prefix_with_its_length_and_digest() {
        let body: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
        let digest: [u8; 32] = Sha256::digest(&body).into();
        let with_id = |id: Option<&str>| {
            let mut d = Delivery::mock(1, "".into(), "t".into(), false, body.clone());
            if let Some(id) = id {
                d.properties = BasicProperties::default().with_message_id(id.into());
            }
            d
        };
        for d in [with_id(Some("k")), with_id(None)] {
            let Err(m) = read(&d, 10_000) else {
                panic!("a body over the limit is malformed");
            };
            assert_eq!(m.envelope.payload, body[..inbox_core::CUT_PAYLOAD_PREFIX]);
            let cut = m.envelope.payload_cut.expect("the cut is recorded");
            assert_eq!((cut.length, cut.sha256), (20_000, digest));
        }
        // At the limit, or malformed for another reason: kept whole.
        let Err(m) = read(&with_id(None), 20_000) else {
            panic!("no message id is malformed");
        };
        assert_eq!(
            (m.envelope.payload, m.envelope.payload_cut),
            (body.clone(), None)
        );
        let read_whole = read(&with_id(Some("k")), 20_000).map_err(|m| m.reason);
        assert_eq!(read_whole.map(|e| e.payload_cut), Ok(None));
    }

    #[test]
    fn deliveries_at_the_limit_are_counted_from_x_death() {
        let d = dead_lettered("g:dlq", "g", "delivery_limit", "usage.recorded");
        let table = d.properties.headers().as_ref();
        // Twice dead-lettered from `g` at a limit of 2: three deliveries each time.
        assert_eq!(deliveries_at_limit(table, "g", 2), Some(6));
        assert_eq!(deliveries_at_limit(table, "other", 2), None);
        let expired = dead_lettered("g:dlq", "g", "expired", "usage.recorded");
        assert_eq!(
            deliveries_at_limit(expired.properties.headers().as_ref(), "g", 2),
            None
        );
        assert_eq!(deliveries_at_limit(None, "g", 2), None);
    }
}
